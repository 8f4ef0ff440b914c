"""Read-only constant tensors, cached: the one cache of the package.

A plan field a path does not use (BN's ``beta_coef``), the ones and zeros ATen's kernels take
as arguments (``native_batch_norm``'s mean and variance of a channel affine): made once per
value, shape, dtype and device, so a training step issues no fill for them.
"""

from __future__ import annotations

import torch

from distnorm import _capture


__all__ = ["constant"]


_CONSTANTS: dict[tuple[float, tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = {}


def constant(value: float, shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached, read-only tensor of ``shape`` (an int: ``(shape,)``) filled with ``value``
    (no op per step). Nothing may write into it.

    Under ``torch.compile`` a fill in the graph instead, which Inductor folds into the kernels
    that read it: a cache entry made while tracing would change the dictionary the graph's
    guards read, and recompile the graph at its next call. While a CUDA graph is captured, a
    fill that is not kept: captured, it has not run yet, so no eager step may read it."""
    size = (shape,) if isinstance(shape, int) else tuple(shape)
    if torch.compiler.is_compiling():
        return torch.full(size, value, dtype=dtype, device=device)
    key = (value, size, dtype, device)
    t = _CONSTANTS.get(key)
    if t is None:
        t = torch.full(size, value, dtype=dtype, device=device)
        if not _capture.capturing(device):
            _CONSTANTS[key] = t
    return t
