"""Test-only observer of a training process: which backward passes and optimizer steps ran.

Put this directory on ``PYTHONPATH`` and set ``DISTNORM_TEST_TRACE=<prefix>``: every process
then appends one line per ``torch.autograd.backward`` call (``Tensor.backward`` and the
engines' ``backward`` all go through it) and per optimizer step (torch's global
optimizer-step hook) to ``<prefix>.<RANK>``. Nothing is replaced: the real functions run.
Fault tests use it to observe — not assume — that a rank stopped before the backward.
"""

import os

_PREFIX = os.environ.get("DISTNORM_TEST_TRACE")
if _PREFIX:
    import torch
    import torch.autograd
    import torch.optim.optimizer as _optimizer

    _FILE = f"{_PREFIX}.{os.environ.get('RANK', '0')}"

    def _log(event: str) -> None:
        with open(_FILE, "a") as f:
            f.write(event + "\n")

    _backward = torch.autograd.backward

    def _traced_backward(*args, **kwargs):
        _log("backward")
        return _backward(*args, **kwargs)

    torch.autograd.backward = _traced_backward
    _optimizer.register_optimizer_step_post_hook(lambda optimizer, args, kwargs: _log("optimizer_step"))
