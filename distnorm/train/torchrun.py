"""``torchrun`` as ``launch/torchrun.sh`` starts it: the same launcher, with a shorter ending.

    python -c 'from distnorm.train.torchrun import main; main()' -m torch.distributed.run [torchrun arguments]

runs ``torch.distributed.run``'s own ``main`` with those arguments (the ``-m
torch.distributed.run`` only says what runs, as in ``python -m torch.distributed.run``).
Where torchrun would end with a Python traceback of its own, this ends with:

* a worker failed (``ChildFailedError``): torchrun's failure summary alone — which rank,
  its exit code, and the root cause the worker recorded (``distnorm-train`` records its
  one-line error there) — and exit status 1, as torchrun's;
* torchrun stopped by a signal (Ctrl-C's SIGINT, a scheduler's SIGTERM), which it has
  forwarded to the workers (rank 0 of ``distnorm-train`` prints where to resume): nothing
  more, and exit status 128 + the signal number, as a shell reports it.
"""

from __future__ import annotations

import os
import sys
import tempfile

__all__ = ["main"]


def main() -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    args = sys.argv[1:]
    if args[:2] != ["-m", "torch.distributed.run"]:
        raise SystemExit(f"usage: python -c '...' -m torch.distributed.run [torchrun arguments]; got {args[:2]}")
    sys.argv = ["torchrun", *args[2:]]  # its usage messages name it as its own command does
    with tempfile.TemporaryDirectory(prefix="distnorm-torchrun-") as scratch:
        # torchrun copies the root cause's error file to its own, and logs an error when it has
        # none; the workers get theirs from torchrun, whatever this process has.
        os.environ.setdefault("TORCHELASTIC_ERROR_FILE", os.path.join(scratch, "error.json"))
        try:
            torchrun()
        except ChildFailedError as err:
            print(err, file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        except SignalException as err:
            raise SystemExit(128 + int(err.sigval)) from None
