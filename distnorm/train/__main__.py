"""``distnorm-train`` / ``python -m distnorm.train``: the recipe's command line."""

from __future__ import annotations

import sys

from distnorm.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
