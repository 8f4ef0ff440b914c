"""The training step of the synchronized layers as ``torch.compile`` sees it.

Eager mode runs a layer step through :mod:`distnorm._functions`: host decisions made per call
(AMAT's initialisation known on the host, the group's vote on the kernels, the checkpoint
stash, the frames' checks on the host), the per-channel algebra as one operator each
(``distnorm::cbn_plan``, ``distnorm::backward_sums``: Triton, C or ATen, as the group agreed).
Under ``torch.compile`` none of that helps: every op is a node of the graph that Inductor
fuses with the model's own kernels, and a host decision would be baked into the graph or
guarded on. So when :func:`torch.compiler.is_compiling` is true, the statistics step and the
hand-written backward are the functions here: the same mathematics in ATen calls the compiler
decomposes, with

* the per-channel algebra of :func:`distnorm._composite.cbn_plan_composite` and
  :func:`distnorm._composite.backward_sums_composite`, traced (the composites are the
  implementations' reference; the eager Triton and C kernels are checked against them);
* ONE functional all-reduce per phase (:func:`distnorm._moments.traced_moments`,
  :func:`distnorm._collectives.traced_all_reduce_sum`): a collective node that Inductor keeps
  as one and that CUDA graphs capture on NCCL;
* every decision either fixed by the layer's configuration (a layer with AMAT blends history
  by ``eta`` read on the device, as in eager mode: for ``eta = 0`` it gives the batch
  statistics) or made on the device (the AMAT buffers' initialisation, an empty global
  batch), so a compiled step never recompiles as the learning rate changes, ``eta`` crosses
  0 or the AMAT buffers initialise, and a captured CUDA graph replays the right branch;
* the frames' fingerprints compared on the device, a mismatch logged there and raised by
  :func:`distnorm._collectives.check_frames` (:func:`distnorm._frames.traced_reduce`).

Compiled and eager agree within rounding (the compiler contracts and reorders the
arithmetic). Ranks whose batches have the same shape run the same compiled graph, so their
buffers stay bit-identical (checked on 2 gloo ranks); ranks with batches of different sizes
are specialised apart by the compiler, and nothing has checked yet that Inductor then rounds
their buffer updates alike. Activation checkpointing inside a compiled region is not covered (the
recomputation would repeat the buffer updates the eager path stashes).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from distnorm import _bnp_functions, _collectives, _moments, _ops
from distnorm._composite import backward_sums_composite, cbn_plan_composite, grad_coef_of, to_dtype, update_running

__all__ = ["bn_statistics", "bnp_statistics", "cbn_statistics", "normalize_backward"]


def _view(v: Tensor, ndim: int) -> Tensor:
    return v.view([1, -1] + [1] * (ndim - 2))


def bn_statistics(x: Tensor, weight: Tensor | None, buffers: Sequence[Tensor | None],
                  state: Any) -> tuple[Tensor, ...]:
    """Batch normalization's statistics step (the fields of
    :class:`distnorm._state.NormPlan`; the eager maths:
    :func:`distnorm._functions.bn_statistics`); the running statistics updated in place."""
    running_mean, running_var, num_batches_tracked = buffers
    group = state.group()
    count, mean, var, valid = _moments.traced_moments(x.detach(), group, state.name)
    channels, acc = mean.shape[0], mean.dtype
    invstd = torch.rsqrt(var + state.eps)
    one = torch.ones(channels, dtype=acc, device=mean.device)
    weight = weight.detach() if weight is not None else None
    if group is None:  # the backward is ATen's (normalize_backward), given the weight (ones without affine)
        a = to_dtype(weight, acc) if weight is not None else one
        grad_coef = mean.new_zeros(2, 2, channels)
    else:
        a = invstd * to_dtype(weight, acc) if weight is not None else invstd
        grad_coef = grad_coef_of(one, invstd, mean, count)  # r_mu = 1, q = invstd, w = mean
    update_running(running_mean, running_var, num_batches_tracked, mean, var, count, state.momentum, valid)
    return mean, var, invstd, a, grad_coef, mean.new_zeros(0)


def cbn_statistics(x: Tensor, weight: Tensor, bias: Tensor, buffers: Sequence[Tensor], eta: Tensor,
                   state: Any) -> tuple[Tensor, ...]:
    """CBN's / POP-Norm's statistics step (SPEC §1): the plan's fields, the AMAT and running
    buffers updated in place (:func:`distnorm._composite.cbn_plan_composite`, traced).

    A layer with AMAT (``state.amat``) blends history with ``eta`` read on the device, as in
    eager mode, and always checks the AMAT buffers' initialisation on the device: the host's
    knowledge of it (``state.amat_ready``) changes during training, and a graph reading it
    would recompile.

    The AMAT buffers are read through ``distnorm::snapshot`` (copies, made by an operator the
    compiler keeps). Why: AOTAutograd applies a graph's in-place updates of its
    inputs after the forward, and its min-cut partitioner may save such an input for the
    backward and recompute from it what the backward needs -- from the buffer already updated
    (compiled CBN's gradients were off by 1e-4 to 1 at eta = 0.5; pytorch/pytorch#197039,
    open, pins such reads). It never recomputes an operator outside ATen's allowlist, so it
    saves the copies instead (C values). A copy as ATen ops is recomputable; one as a
    reduction the partitioner bans (the maximum over expanded views) made Inductor's CUDA code
    write a wrong AMAT mean (bench/results/gpu-2026-11-28-c-diagnostics.md)."""
    group = state.group()
    count, mean, var, valid = _moments.traced_moments(x.detach(), group, state.name)
    host_count, device_count, device_valid = (count, None, None) if isinstance(count, int) else (
        -1, count, None if valid is True else valid)
    hyper = [float(state.eps), float(state.rho), float(state.r_max)]
    amat_before = _ops.snapshot(list(buffers[:3])) if state.amat else None
    plan = cbn_plan_composite(mean, var, device_count, device_valid, weight.detach(), bias.detach(),
                              eta if state.amat else None, list(buffers), host_count, hyper, state.momentum,
                              amat_ready=False, amat_before=amat_before)
    if state.stats_sink is not None:  # the theory monitors' references (distnorm.monitors)
        state.stats_sink.update(mean=mean, var=var, center=plan[0], eps=state.eps)
    return plan


def bnp_statistics(h: Tensor, mean: Tensor, var: Tensor, state: Any) -> tuple[Tensor, Tensor, Any]:
    """BNP's statistics step on a preconditioned layer's input (``(mean, var_t, count)``;
    :func:`distnorm._bnp_functions.running_update`), the moments updated in place and read
    through ``distnorm::snapshot`` (:func:`cbn_statistics` says why)."""
    moments = _moments.traced_moments(h.detach(), state.group(), f"BNP '{state.name}'")
    before = tuple(_ops.snapshot([mean, var]))
    new_mean, var_t, count = _bnp_functions.running_update(moments, h, mean, var, state.config, before)
    if isinstance(count, int):  # a host count (local statistics): a tensor, as the backward traced now reads q²
        count = torch.full((), float(count), dtype=new_mean.dtype, device=new_mean.device)
    return new_mean, var_t, count


def normalize_backward(grad_out: Tensor, x: Tensor, saved: Sequence[Tensor], need_input_grad: bool,
                       state: Any) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_x, grad_weight, grad_bias)`` in the accumulation dtype: the eager
    :func:`distnorm._functions.normalize_backward` in element-wise ops and two reductions
    that Inductor fuses into one pass over ``(g, x)`` for the sums and one for ``dx``, with
    ONE functional all-reduce of ``[r_mu S1, q T]`` between them.

    ``dx = a (g - shift / n - (x - w) slope / n)``, ``shift, slope`` the all-reduced sums
    (the module plan of :mod:`distnorm._functions`)."""
    center, invstd, grad_scale, grad_coef, beta_coef = saved
    group = state.group()
    acc, ndim = center.dtype, x.dim()
    if state.kind == "bn" and group is None:  # as torch.nn.BatchNorm*: ATen's training backward, decomposed
        grad_x, grad_weight, grad_bias = torch.ops.aten.native_batch_norm_backward(
            grad_out, x, grad_scale, None, None, center, invstd, True, state.eps, [need_input_grad, True, True])
        return (grad_x if need_input_grad else x.new_empty(0)), grad_weight, grad_bias
    dims = [0, *range(2, ndim)]
    g = grad_out.to(acc)
    x_centered = x.to(acc) - _view(center, ndim)
    s1 = g.sum(dims)
    t = (g * x_centered).sum(dims) * invstd
    if state.kind == "bn":  # ATen's sums are BN's parameter gradients; no beta term
        sums, grad_weight, grad_bias = grad_coef[0] * torch.stack([s1, t]), t, s1
    else:
        sums, grad_weight, grad_bias, _, _ = backward_sums_composite(s1, t, beta_coef, grad_scale, grad_coef,
                                                                          1.0 / state.rho)
    if not need_input_grad:
        return x.new_empty(0), grad_weight, grad_bias
    channels = center.shape[0]
    sums = _collectives.traced_all_reduce_sum(sums, group, slot=f"{state.name}|backward|C={channels}|{x.dtype}",
                                              shape=(channels, x.dtype))
    shift, slope = sums.unbind()
    w, n = grad_coef[1, 0], grad_coef[1, 1]
    u = grad_scale / n
    grad_x = _view(grad_scale, ndim) * g - _view(u * shift, ndim) - (x.to(acc) - _view(w, ndim)) * _view(u * slope,
                                                                                                          ndim)
    return grad_x.to(x.dtype), grad_weight, grad_bias
