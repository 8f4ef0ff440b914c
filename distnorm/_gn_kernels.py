"""GroupNorm's implementations, in its input's own layout and dtype: the kernels of
``distnorm::group_norm`` and ``distnorm::group_norm_backward`` (declared in :mod:`distnorm._ops`).

Why not ATen's: on CUDA, ``native_group_norm`` makes its input NCHW-contiguous
(``aten/src/ATen/native/group_norm.cpp``, ``native_group_norm``: the memory format is
``X.suggest_memory_format()`` only on the CPU and PrivateUse1), so a channels_last model pays
a copy of every GroupNorm input and hands NCHW to the next convolution; and it reads its
weight and bias in the input's dtype and writes its statistics in it
(``group_norm_kernel.cu``, ``GroupNormKernelImplInternal``: ``gamma.const_data_ptr<T>()``,
``mean.mutable_data_ptr<T>()``), so a bfloat16 input needs bfloat16 parameters. Autocast
therefore runs ``group_norm`` in float32 on CUDA (its float32 list), and everything after it
up to the next convolution too. These operators have no autocast rule: the input keeps its
dtype, the parameters theirs (float32), and the arithmetic is float32 (float64 for a float64
input) — as ``batch_norm`` under autocast.

* :func:`group_norm`, :func:`group_norm_backward` — the composite, on every device: ATen's
  ``native_group_norm`` (and its backward) in the accumulation dtype, the input and
  parameters cast to it, which is what CUDA's kernel demands (one dtype) given everywhere;
  the results cast back to the input's (the parameters') dtype and laid out as the input.
* :func:`group_norm_cuda`, :func:`group_norm_backward_cuda` — CUDA: the Triton kernels of
  :mod:`distnorm._triton` (three launches forward, four backward), reading the
  input through its strides, for a non-empty float32 / bfloat16 / float16 input; else the
  composite.
* :func:`group_norm_cpu`, :func:`group_norm_backward_cpu` — the CPU: the composite, or the
  Triton kernels in Triton's interpreter under ``DISTNORM_TRITON=interpret`` (tests).

Before the Triton kernels first run on a device, they run once on a small input and are
compared with the composite (:func:`_verified`): a Triton that cannot compile or launch
there, or whose kernels compute something else, raises an error that names the way back
(``DISTNORM_TRITON=0``), never a quiet fallback, as for the synchronized layers' kernels.

GroupNorm normalizes each sample by itself: no collective, so a rank's kernel changes no
other rank's arithmetic.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from distnorm import _capture
from distnorm._kernels import _launch, _on_one_device, kernels_for, mode

__all__ = ["group_norm", "group_norm_backward", "group_norm_backward_cpu", "group_norm_backward_cuda",
           "group_norm_backward_fake", "group_norm_cpu", "group_norm_cuda", "group_norm_fake"]


def _acc(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _cast(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _laid_out_as(result: Tensor, x: Tensor) -> Tensor:
    """``result`` with ``torch.empty_like(x)``'s strides, which the fake kernels promise (ATen's
    CUDA kernel returns NCHW for a channels_last input)."""
    if result.stride() == x.stride():  # a fresh result with x's strides: x is dense, as empty_like's
        return result
    like = torch.empty_like(x, dtype=result.dtype)
    return result if like.stride() == result.stride() else like.copy_(result)


def _spatial(x: Tensor) -> int:
    return math.prod(x.shape[2:])


_native_group_norm_backward = torch.ops.aten.native_group_norm_backward.default  # no torch.* binding


def group_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], groups: int,
               eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``distnorm::group_norm`` on every device: ``(y, mean, rstd)``, ``y = (x - mean_g) rstd_g
    w + b`` over each sample's groups of ``C / groups`` channels, ``rstd = 1 / sqrt(var + eps)``
    (biased variance); ``y`` in ``x``'s dtype and layout, ``mean`` and ``rstd`` ``(N, groups)``
    in the accumulation dtype."""
    acc = _acc(x)
    y, mean, rstd = torch.native_group_norm(_cast(x, acc), _cast(weight, acc), _cast(bias, acc), x.shape[0],
                                            x.shape[1], _spatial(x), groups, eps)
    return _laid_out_as(_cast(y, x.dtype), x), mean, rstd


def group_norm_backward(grad_out: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Optional[Tensor],
                        groups: int, mask: Sequence[bool]) -> tuple[Tensor, Tensor, Tensor]:
    """``distnorm::group_norm_backward`` on every device: ``(grad_input, grad_weight,
    grad_bias)``, the input's in ``x``'s dtype and layout, the parameters' in the weight's dtype
    (the accumulation dtype without one; autograd casts a bias of another dtype), each empty
    where ``mask`` does not ask for it."""
    acc = mean.dtype
    grads = _native_group_norm_backward(_cast(grad_out, acc), _cast(x, acc), mean, rstd, _cast(weight, acc),
                                        x.shape[0], x.shape[1], _spatial(x), groups, [bool(m) for m in mask])
    pdt = weight.dtype if weight is not None else acc
    params = tuple(_cast(g, pdt) if asked else x.new_empty(0, dtype=pdt) for g, asked in zip(grads[1:], mask[1:]))
    return (_laid_out_as(_cast(grads[0], x.dtype), x) if mask[0] else x.new_empty(0)), *params


def group_norm_fake(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], groups: int,
                    eps: float) -> tuple[Tensor, Tensor, Tensor]:
    stats = x.new_empty(x.shape[0], groups, dtype=_acc(x))
    return torch.empty_like(x), stats, torch.empty_like(stats)


def group_norm_backward_fake(grad_out: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Optional[Tensor],
                             groups: int, mask: Sequence[bool]) -> tuple[Tensor, Tensor, Tensor]:
    pdt = weight.dtype if weight is not None else mean.dtype
    return (torch.empty_like(x) if mask[0] else x.new_empty(0),
            *(x.new_empty(x.shape[1] if asked else 0, dtype=pdt) for asked in mask[1:]))


_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _dense_format(x: Tensor) -> Optional[torch.memory_format]:
    """The memory format ``x`` is dense in, of those the kernels read (None: neither)."""
    if x.is_contiguous():
        return torch.contiguous_format
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return None


def _triton_takes(x: Tensor, *others: Optional[Tensor]) -> bool:
    """The Triton kernels' cases: a non-empty float32 / bfloat16 / float16 input, floating
    parameters of those dtypes, every tensor on the input's device."""
    return (x.dtype in _TRITON_DTYPES and x.numel() > 0 and x.dim() >= 2
            and all(t is None or t.dtype in _TRITON_DTYPES for t in others) and _on_one_device(x, *others))


def _probe_cases(device: torch.device) -> list[tuple[Tensor, Optional[Tensor], Optional[Tensor], Tensor]]:
    """Inputs (mean far from 0), parameters and output gradients from ramps, the same on every
    machine: a float32 channels_last ``(2, 32, 24, 24)`` in two slices with parameters, and a
    bfloat16 NCHW ``(2, 32, 3, 5)`` without, both in 4 groups."""
    cases = []
    for shape, dtype, fmt, affine in (((2, 32, 24, 24), torch.float32, torch.channels_last, True),
                                      ((2, 32, 3, 5), torch.bfloat16, torch.contiguous_format, False)):
        ramp = torch.arange(math.prod(shape), dtype=torch.float32, device=device)
        x = (torch.sin(ramp * 0.37) * 2.0 + 3.0).view(shape).to(dtype, memory_format=fmt)
        grad = torch.cos(ramp * 0.11).view(shape).to(dtype, memory_format=fmt)
        channels = torch.arange(shape[1], dtype=torch.float32, device=device)
        cases.append((x, channels * 0.01 + 0.9 if affine else None, channels * 0.02 - 0.3 if affine else None, grad))
    return cases


@functools.lru_cache(maxsize=None)
def _verified(device: torch.device, triton_mode: str) -> None:
    """Run the Triton kernels once on ``device`` against the composite (to 1e-4 of each result's
    largest value in float32, two units of bfloat16's rounding): a failure or a difference
    raises, and is raised again at every call (only a success is remembered)."""
    _capture.refuse_capture(device, "the first GroupNorm step's check of its Triton kernels")
    for x, weight, bias, grad in _probe_cases(device):
        try:
            got = _launch("group_norm", device, lambda k: k.group_norm(x, weight, bias, 4, 1e-5))
            got += _launch("group_norm_backward", device, lambda k: k.group_norm_backward(
                grad, x, got[1], got[2], weight, 4, [True, weight is not None, bias is not None]))
        except RuntimeError as err:
            raise RuntimeError(f"distnorm.GroupNorm: {err}") from err.__cause__
        want = group_norm(x, weight, bias, 4, 1e-5)
        want += group_norm_backward(grad, x, want[1], want[2], weight, 4, [True, weight is not None, bias is not None])
        tol = 1e-4 if x.dtype == torch.float32 else 2 * torch.finfo(x.dtype).eps
        for i, (g, w) in enumerate(zip(got, want)):
            # to the result's scale: the parameters' gradients are sums over the batch, and ATen's
            # (uncentred: sum(dy x) - mean sum(dy)) are the less exact side, by about 2e-5 here
            if w.numel() and (g.double() - w.double()).abs().max() > tol * (w.double().abs().max() + 1.0):
                raise RuntimeError(
                    f"distnorm.GroupNorm: its Triton kernels differ from ATen's GroupNorm on {device} ({x.dtype} "
                    f"input, result {i}, largest difference {(g.double() - w.double()).abs().max().item():.3g}). "
                    "Set DISTNORM_TRITON=0 to run ATen's GroupNorm instead.")


def _triton_forward(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], groups: int,
                    eps: float) -> tuple[Tensor, Tensor, Tensor]:
    _verified(x.device, mode())
    dense = x if _dense_format(x) is not None else x.contiguous()
    y, mean, rstd = _launch("group_norm", x.device, lambda k: k.group_norm(dense, weight, bias, groups, eps))
    return _laid_out_as(y, x), mean, rstd


def _triton_backward(grad_out: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Optional[Tensor],
                     groups: int, mask: Sequence[bool]) -> tuple[Tensor, Tensor, Tensor]:
    _verified(x.device, mode())  # the forward may have taken the composite (a parameter's dtype)
    fmt = _dense_format(x)
    dense = x if fmt is not None else x.contiguous()
    fmt = fmt or torch.contiguous_format
    grad = grad_out if grad_out.stride() == dense.stride() else grad_out.contiguous(memory_format=fmt)
    grad_x, grad_w, grad_b = _launch("group_norm_backward", x.device, lambda k: k.group_norm_backward(
        grad, dense, mean.contiguous(), rstd.contiguous(), weight, groups, mask))
    return (_laid_out_as(grad_x, x) if mask[0] else grad_x), grad_w, grad_b


def group_norm_cuda(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], groups: int,
                    eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``distnorm::group_norm`` on CUDA: the Triton kernels where Triton loads
    (``DISTNORM_TRITON`` not ``0``) and they take the case, else the composite."""
    if _triton_takes(x, weight, bias) and kernels_for(x.device)[0] is not None:
        return _triton_forward(x, weight, bias, groups, eps)
    return group_norm(x, weight, bias, groups, eps)


def group_norm_backward_cuda(grad_out: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Optional[Tensor],
                             groups: int, mask: Sequence[bool]) -> tuple[Tensor, Tensor, Tensor]:
    """``distnorm::group_norm_backward`` on CUDA: the Triton kernels for the cases they take
    (float32 statistics; the bias is not an argument here, so a forward that took the composite
    for its bias's dtype may come back to them), else the composite."""
    if (_triton_takes(x, weight, grad_out) and mean.dtype == torch.float32
            and kernels_for(x.device)[0] is not None):
        return _triton_backward(grad_out, x, mean, rstd, weight, groups, mask)
    return group_norm_backward(grad_out, x, mean, rstd, weight, groups, mask)


def group_norm_cpu(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], groups: int,
                   eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``distnorm::group_norm`` on the CPU: the composite (ATen's CPU kernel keeps
    channels_last), or the Triton kernels in Triton's interpreter under
    ``DISTNORM_TRITON=interpret``."""
    if mode() == "interpret" and _triton_takes(x, weight, bias) and kernels_for(x.device)[0] is not None:
        return _triton_forward(x, weight, bias, groups, eps)
    return group_norm(x, weight, bias, groups, eps)


def group_norm_backward_cpu(grad_out: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Optional[Tensor],
                            groups: int, mask: Sequence[bool]) -> tuple[Tensor, Tensor, Tensor]:
    """``distnorm::group_norm_backward`` on the CPU: as :func:`group_norm_cpu`."""
    if (mode() == "interpret" and _triton_takes(x, weight, grad_out) and mean.dtype == torch.float32
            and kernels_for(x.device)[0] is not None):
        return _triton_backward(grad_out, x, mean, rstd, weight, groups, mask)
    return group_norm_backward(grad_out, x, mean, rstd, weight, groups, mask)
