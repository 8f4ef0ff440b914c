"""A CPU collective returns only once the backend has let go of its tensors.

Why: gloo runs each collective on a worker thread, which wakes the caller when the
collective completes and only then drops its own references to the tensors. A tensor that
has a Python object is kept alive by that worker's reference (torch's PyObject
preservation), so dropping it takes the GIL — while the caller, awake again, holds the GIL.
If the caller reaches interpreter shutdown before the worker gets the GIL (a script whose
last statements are a distnorm collective — ``check_consistency`` — and
``destroy_process_group``, with the group still referenced: a module-level DDP model holds
it), CPython ends the worker thread inside that release and the process dies with
"terminate called without an active exception" (SIGABRT). That race is torch's (the same
abort without distnorm: ``docs/guides/ddp.md``, "At exit"); distnorm's own collectives stay
out of it by waiting here, with the GIL released, until the worker's reference is gone.

The condition waited for is that release itself — the tensor's Python reference count back
where it was before the collective — so the wait is as long as the worker needs the GIL:
microseconds, and no extra work for the backend. Only CPU tensors: the host already waited
for their collective. A GPU collective's tensors are released after the device finishes,
which the host never waits for on the hot path.
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from typing import Iterator

import torch

__all__ = ["released"]

#: A backend that keeps a tensor (none of torch's does once a synchronous collective has
#: returned) must not hang the caller: past this many seconds the wait gives up, and says so.
_PATIENCE_S = 2.0


@contextlib.contextmanager
def released(*tensors: torch.Tensor) -> Iterator[None]:
    """Around a synchronous collective on ``tensors``: on leaving, wait (GIL released) until
    the backend holds no reference to the CPU ones.

    Example:
        >>> import torch
        >>> t = torch.zeros(3)
        >>> with released(t):
        ...     t += 1  # stands for dist.all_reduce(t, group=group)
    """
    cpu = [t for t in tensors if t.device.type == "cpu"]
    # Counted the same way before and after (by index: a loop variable, or the tuple zip
    # reuses, would be one more reference on one side).
    before = [sys.getrefcount(cpu[i]) for i in range(len(cpu))]
    yield
    deadline = None
    for i in range(len(cpu)):
        while sys.getrefcount(cpu[i]) > before[i]:
            deadline = deadline or time.monotonic() + _PATIENCE_S
            if time.monotonic() > deadline:
                warnings.warn(f"distnorm: the process group's backend still holds a collective's tensor "
                              f"{_PATIENCE_S:g} s after the collective returned; distnorm goes on without "
                              "waiting for it (torch's exit race, docs/guides/ddp.md, is then possible "
                              "again)", RuntimeWarning, stacklevel=3)
                return
            time.sleep(0)  # releases the GIL: the worker takes it and lets go of the tensor
