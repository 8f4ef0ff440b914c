"""The autograd Function of the synchronized layers.

:class:`NormalizeFunction` applies a :class:`~distnorm._functions.NormPlan` in the forward
and runs the statistics' backward through :mod:`distnorm._ops` (the eager function, or its
custom operator under ``torch.compile``). It sits above both, so the mathematics below
never imports the operators that wrap it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from distnorm import _ops
from distnorm._functions import NormState, forward_output
from distnorm._fused import to_dtype

__all__ = ["NormalizeFunction"]


class NormalizeFunction(torch.autograd.Function):
    """``y = scale * (x - center) / sqrt(var + eps) + shift`` with the statistics' backward.

    Inputs after ``(x, weight, bias)`` are a :class:`NormPlan` (no gradient flows into it:
    its dependence on ``x`` and the parameters is in the hand-written backward) and the
    layer's :class:`NormState`.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                center: torch.Tensor, var: torch.Tensor, invstd: torch.Tensor, grad_scale: torch.Tensor,
                grad_coef: torch.Tensor, beta_coef: torch.Tensor, state: NormState) -> torch.Tensor:
        y = forward_output(x, weight, bias, center, var, state)
        ctx.save_for_backward(x, center, invstd, grad_scale, grad_coef, beta_coef)
        ctx.state = state
        ctx.weight_dtype = weight.dtype if weight is not None else None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        if not torch.compiler.is_compiling():
            ctx.stashed = state.pending  # keeps the stashed plan alive as long as this node
            state.pending = None
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, center, invstd, grad_scale, grad_coef, beta_coef = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x, grad_w, grad_b = _ops.normalize_backward(
            grad_out.contiguous(memory_format=_memory_format(x)), x, center, invstd, grad_scale, grad_coef,
            beta_coef, need_x, ctx.state)
        return (
            grad_x if need_x else None,
            to_dtype(grad_w, ctx.weight_dtype) if need_w else None,
            to_dtype(grad_b, ctx.bias_dtype) if need_b else None,
            None, None, None, None, None, None, None,
        )


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format
