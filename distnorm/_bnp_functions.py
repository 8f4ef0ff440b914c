"""The mathematics of BNP (paper 004; SPEC §5), below the operators of
:mod:`distnorm._functions`, which runs its statistics step (eager, or as :mod:`distnorm._traced`
traces it under ``torch.compile``).

* :func:`layer_statistics`: one statistics step of a preconditioned layer's input — the
  global moments (ONE all-reduce), the running moments ``bnp_mean`` / ``bnp_var`` updated
  in place, and ``var_t = var + eps1 max(var) + eps2``;
* :func:`bnp_q2`: the block-norm scale ``q²`` from the global count;
* :func:`bnp_precondition` / :class:`BNPGradientFunction`: the gradient transform
  ``(1/q²) P Pᵀ [G_b; G_w]`` in the backward.

:mod:`distnorm.bnp` attaches all this to a model's layers with hooks.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from distnorm import _collectives, _kernel_choice, _moments, _ops
from distnorm._collectives import ProcessGroup
from distnorm._composite import bnp_precondition
from distnorm._constants import constant
from distnorm._recompute import Stash, StashedPlan, in_backward
from distnorm.specs import BNPSpec

__all__ = ["BNPGradientFunction", "BNPLayerState", "bnp_precondition", "bnp_q2",
           "layer_statistics", "running_update"]


@dataclass(eq=False)
class BNPLayerState:
    """What BNP keeps per preconditioned layer (stored as ``module._distnorm_bnp`` by
    :func:`distnorm.bnp.attach`): its hyper-parameters, its shape facts, and the state of
    the current forward that the hooks pass on."""

    name: str
    config: BNPSpec
    process_group: ProcessGroup | None
    added_bias: bool
    dense: bool
    fan_in: int  # per-group input channels x kernel size
    groups: int
    hooks: list = field(default_factory=list)
    stash: Stash = field(default_factory=Stash)
    pending: StashedPlan | None = None
    holder: Any = None  # distnorm.bnp's q² holder of the current forward
    count: Any = None
    in_spatial: tuple[int, ...] = ()
    active: Any = None  # (mean, var_t, q2) during a training forward
    aliases: Any = None  # the preconditioned (weight, bias) of that forward
    called: bool = False
    key: int = -1
    kernels: Any = None  # (group, device, Kernels) once decided: distnorm._kernel_choice.kernels_of

    def group(self) -> ProcessGroup | None:
        return _collectives.sync_group(self.process_group)

    #: What one forward leaves for its backward or for a recomputation: references into a
    #: graph of this process (the stash holds weak ones), never pickled or copied.
    RUNTIME_FIELDS = ("pending", "holder", "count", "active", "aliases", "kernels")

    def __getstate__(self) -> dict[str, Any]:
        """Pickling / deepcopy: the configuration and the hooks, not the stash and not the
        current forward's fields (a loaded layer starts with none pending)."""
        state = dict(self.__dict__)
        state.update(dict.fromkeys(self.RUNTIME_FIELDS), stash=None, key=-1)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A fresh stash; the layer that holds this state registers it under a new key
        (:mod:`distnorm.bnp`)."""
        self.__dict__.update(state)
        self.stash = Stash()

    def __deepcopy__(self, memo: dict) -> "BNPLayerState":
        """Like pickling, but the process group is shared: a group is a handle, not data."""
        new = BNPLayerState.__new__(BNPLayerState)
        memo[id(self)] = new
        state = self.__getstate__()
        group = state.pop("process_group")
        new.__setstate__(copy.deepcopy(state, memo))
        new.process_group = group
        return new


@torch.no_grad()
def layer_statistics(h: torch.Tensor, mean_buf: torch.Tensor, var_buf: torch.Tensor, state: BNPLayerState,
                     replay: bool = True) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """One BNP statistics step on a layer input ``h``; returns ``(mean, var_t, count)``.

    ``mean <- rho mean + (1 - rho) mean_H``, ``var <- rho var + (1 - rho) var_H`` (buffers,
    updated in place once per step) and ``var_t = var + eps1 max(var) + eps2``. A
    recomputed forward (activation checkpointing) reuses the first forward's result; when
    there was none — the first pass of reentrant checkpointing runs without gradients,
    where BNP does nothing — this is the step's only statistics pass.
    """
    if replay and in_backward() and len(state.stash):
        return state.stash.pop(h.shape, f"BNP '{state.name}'")
    moments = _kernel_choice.synced_moments(h, state.group(), f"BNP '{state.name}'", state)  # the group's first step: its vote
    result = running_update(moments, h, mean_buf, var_buf, state.config)
    if replay:
        stashed = StashedPlan(result, h.shape)
        state.stash.push(stashed, grad_enabled=True)
        state.pending = stashed
    return result


def running_update(moments: _moments.Moments, h: torch.Tensor, mean_buf: torch.Tensor, var_buf: torch.Tensor,
                   cfg: BNPSpec, before: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The arithmetic of :func:`layer_statistics` from the global ``moments`` of ``h``
    (eager, and as ``torch.compile`` traces it: :func:`distnorm._traced.bnp_statistics`):
    the buffers updated in place; returns ``(mean, var_t, count)``. ``before``: the
    buffers' values to blend from, when not the buffers themselves (compiled code's copies)."""
    count, batch_mean, batch_var, _ = moments
    local = h.numel() // h.shape[1] if h.shape[1] else 0
    weight = 1.0 - cfg.decay
    old_mean, old_var = (mean_buf, var_buf) if before is None else before
    batch_mean = batch_mean.to(mean_buf.dtype)
    if local <= 1:
        # A global batch of one value per feature: the variance is measured around the
        # running mean instead (paper 004 §3.3); an all-empty batch changes nothing.
        if isinstance(count, int):  # local statistics: the host knows the count (no sync)
            if count == 1:
                batch_var = (batch_mean - old_mean) ** 2
            weight = weight if count > 0 else 0.0
        else:
            batch_var = torch.where(count == 1, (batch_mean - old_mean) ** 2, batch_var.to(var_buf.dtype))
            weight = weight * (count > 0).to(mean_buf.dtype)
    new_mean = old_mean.lerp(batch_mean, weight)
    new_var = old_var.lerp(batch_var.to(var_buf.dtype), weight)
    mean_buf.copy_(new_mean)
    var_buf.copy_(new_var)
    var_t = torch.add(new_var, new_var.max(), alpha=cfg.eps1).add_(cfg.eps2)
    return new_mean, var_t, count if isinstance(count, int) else count[0]


class BNPGradientFunction(torch.autograd.Function):
    """Identity on ``(weight, bias)`` in the forward; BNP's preconditioner in the backward.

    The layer computes its output from the *returned* aliases, so the gradients that reach
    this Function are the layer's plain ``(G_w, G_b)`` for this backward pass; it returns
    ``(1/q²) P Pᵀ [G_b; G_w]`` (see :func:`bnp_precondition`), which autograd accumulates
    into ``weight.grad`` / ``bias.grad``. Every optimizer and engine therefore sees the
    preconditioned gradient, and nothing runs at ``optimizer.step()``.

    ``q2`` depends on the layer's output size, known only after its forward: in eager mode
    it arrives through a holder object filled by the layer's forward hook before any
    backward runs; under ``torch.compile`` (which traces the backward at once) it is a
    tensor computed from the size the layer's class is known to produce.

    The map is linear and built from rank-consistent statistics, so applying it on each
    rank before the data-parallel average (as here) equals applying it after.

    ``kernel``: the implementation of ``distnorm::bnp_precondition`` the layer's group agreed on
    (:attr:`distnorm._kernel_choice.Kernels.per_channel`: the CPU's C kernel, one pass over the
    weight gradient; Triton's on CUDA, one launch), passed by eager forwards only; ``None``
    (compiled code, which fuses :func:`~distnorm._composite.bnp_precondition`'s ATen calls
    itself) or ``"composite"`` runs those calls.
    """

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, bias: torch.Tensor | None, mean: torch.Tensor,
                var_t: torch.Tensor, q2: Any, groups: int, kernel: str | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(q2, torch.Tensor):
            ctx.save_for_backward(mean, var_t, q2)
            ctx.holder = None
        else:
            ctx.save_for_backward(mean, var_t)
            ctx.holder = q2
        ctx.groups, ctx.kernel = groups, kernel
        return weight.view_as(weight), (bias.view_as(bias) if bias is not None else None)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_weight: torch.Tensor, grad_bias: torch.Tensor | None) -> tuple[Any, ...]:
        mean, var_t, *q2 = ctx.saved_tensors
        q2 = q2[0] if q2 else ctx.holder.q2
        if grad_weight is None:
            return None, grad_bias, None, None, None, None, None
        if ctx.needs_input_grad[1] and grad_bias is None:
            grad_bias = torch.zeros(grad_weight.shape[0], dtype=grad_weight.dtype, device=grad_weight.device)
        if ctx.kernel in (None, "composite"):
            new_weight, new_bias = bnp_precondition(grad_weight, grad_bias, mean, var_t, q2, groups=ctx.groups)
            return new_weight, new_bias, None, None, None, None, None
        # The agreed kernel: one pass over the weight gradient (the operator's CPU and CUDA
        # implementations, distnorm._kernels). A host q2 travels as a cached 0-dim float64
        # tensor (no fill per step; float64, so a float64 gradient's transform is not rounded
        # through float32); a device q2 is read on the device, with no sync.
        if not isinstance(q2, torch.Tensor):
            q2 = constant(float(q2), (), torch.float64, grad_weight.device)
        new_weight, new_bias = _ops.bnp_precondition(grad_weight, grad_bias, mean, var_t, q2, ctx.groups, ctx.kernel)
        return new_weight, (new_bias if grad_bias is not None else None), None, None, None, None, None


def bnp_q2(count: int | torch.Tensor, fan_in: int, in_spatial: tuple[int, ...],
           out_spatial: tuple[int, ...] | None) -> float | torch.Tensor:
    """BNP's ``q² = max(fan_in / N, floor)`` from the global count of input values per
    channel: dense ``N = count``, floor 1; conv ``N = count / (H_in W_in)``, floor
    ``sqrt(H_out W_out)`` (SPEC §5). A host count gives a float, a device count a tensor."""
    numerator = float(fan_in) if out_spatial is None else float(fan_in * max(math.prod(in_spatial), 1))
    floor = 1.0 if out_spatial is None else math.sqrt(math.prod(out_spatial))
    if isinstance(count, int):
        return max(numerator / max(count, 1), floor)
    return torch.clamp_min(numerator / count.clamp_min(1.0), floor)
