"""``python -m distnorm.launch`` (= ``distnorm-launch``): the launchers from an install."""

from __future__ import annotations

import sys

from distnorm.launch import main

if __name__ == "__main__":
    sys.exit(main())
