"""GroupNorm's autograd Function over ``distnorm::group_norm`` and its backward
(:mod:`distnorm._ops`; the kernels and why they are not ATen's: :mod:`distnorm._gn_kernels`),
and the checks of its arguments.

For each sample ``n`` and group ``g`` of ``C / G`` channels, over those channels and every
spatial position (``M = C / G * S`` values)::

    mean = sum(x) / M,   var = sum((x - mean)^2) / M,   rstd = 1 / sqrt(var + eps)
    y    = (x - mean) rstd w_c + b_c

and, with ``dot = sum(w_c dy (x - mean))`` and ``total = sum(w_c dy)`` over the group,
``dx = rstd w_c dy - rstd^3 dot (x - mean) / M - rstd total / M``,
``dw_c = sum_n rstd sum(dy (x - mean))``, ``db_c = sum(dy)``.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from distnorm import _ops

__all__ = ["GroupNormFunction", "check_group_norm", "group_norm"]


def check_group_norm(x: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor]) -> None:
    """The arguments ``torch.nn.functional.group_norm`` takes, checked with errors that say
    what to change."""
    if not isinstance(x, Tensor):
        raise TypeError(f"group_norm: expected a torch.Tensor input, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"group_norm: expected a floating-point input, got dtype {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"group_norm: expected an input of shape (N, C, *), got shape {tuple(x.shape)}")
    channels = x.shape[1]
    try:
        groups = operator.index(num_groups)  # an int, or what stands for one (numpy's integers)
    except TypeError:
        groups = 0
    if isinstance(num_groups, bool) or groups <= 0:
        raise ValueError(f"group_norm: num_groups must be a positive int, got {num_groups!r}")
    num_groups = groups
    if channels % num_groups:
        raise ValueError(f"group_norm: the input's {channels} channels (dim 1) are not divisible by "
                         f"num_groups={num_groups}; choose a num_groups that divides {channels}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.dim() != 1 or p.shape[0] != channels):
            raise ValueError(f"group_norm: expected {name} of shape ({channels},) for an input of "
                             f"{channels} channels, got {tuple(p.shape)}")
        if p is not None and not p.is_floating_point():
            raise TypeError(f"group_norm: expected a floating-point {name}, got dtype {p.dtype}")


class GroupNormFunction(torch.autograd.Function):
    """``y`` of ``distnorm::group_norm``; its backward is ``distnorm::group_norm_backward``,
    once differentiable (a second derivative, a gradient penalty through the layer, is refused:
    ``nn.GroupNorm`` has one), and not for ``torch.func``'s transforms. The saved statistics are
    ``(N, G)``: activation checkpointing and ``torch.compile`` see one operator each way."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], groups: int,
                eps: float) -> Tensor:
        y, mean, rstd = _ops.group_norm(x, weight, bias, groups, eps)
        ctx.save_for_backward(x, mean, rstd, weight)
        ctx.groups = groups
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        x, mean, rstd, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
        grad_x, grad_w, grad_b = _ops.group_norm_backward(grad_out, x, mean, rstd, weight, ctx.groups, mask)
        return (grad_x if mask[0] else None, grad_w if mask[1] else None, grad_b if mask[2] else None, None, None)


def group_norm(x: Tensor, num_groups: int, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5) -> Tensor:
    """``torch.nn.functional.group_norm``'s arguments and result, computed in ``x``'s layout
    and dtype (float32 arithmetic; float64 for float64), under autocast too."""
    check_group_norm(x, num_groups, weight, bias)
    return GroupNormFunction.apply(x, weight, bias, operator.index(num_groups), float(eps))
