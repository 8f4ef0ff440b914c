"""A synchronized layer's training step, from the layer's call down to the operators and
the collectives.

:mod:`distnorm.functional` hands a training call here (:func:`normalize`), and it goes down
in one direction: the statistics step, then :class:`NormalizeFunction`, whose backward is
written by hand. Every synchronized layer runs the same plan, chosen so that a training step
issues exactly one collective in the forward and one in the backward, saves only its input
plus per-channel vectors, and never reads a tensor on the host:

statistics (:func:`bn_statistics`, :func:`cbn_statistics`; no autograd)
    1. :func:`distnorm._moments.global_moments`: local moments (ATen's statistics
       kernel; on the CPU ``distnorm::batch_norm_update_stats``, the same arithmetic in
       fewer cycles: :mod:`distnorm._cpu_kernels`), ONE all-reduce (before a group's first
       statistics, one more, once: the ranks' vote on the kernels — Triton's per-channel
       operators, the CPU's C kernels — so every rank runs the same ones:
       :mod:`distnorm._kernel_choice`).
    2. Per-channel algebra in the accumulation dtype (float32, float64 for float64 input):
       the statistics the output uses, and the coefficients of the backward below (for
       CBN one operator, ``distnorm::cbn_plan``).
    3. Buffer updates (running / AMAT statistics), on device, exactly once per step.
    The result is a :class:`NormPlan` of per-channel tensors. Activation checkpointing
    recomputes a forward during the backward pass; such a recomputation reuses the stashed
    plan of the first forward instead (:mod:`distnorm._recompute`).

forward (:func:`forward_output`, in :class:`NormalizeFunction`)
    ``y = scale * (x - center) / sqrt(var + eps) + shift`` in one fused pass for every input
    rank, memory format and dtype: ATen's inference batch norm; on the CPU with the C kernels
    ``distnorm::batch_norm_elemt``, the schema and formula of ATen's CUDA ``batch_norm_elemt``.

backward (:func:`normalize_backward`)
    1. The local sums ``S1 = sum(g)`` and ``T = sum(g * (x - center)) * invstd`` in one pass:
       ATen's batch-norm backward (on CUDA its ``batch_norm_backward_reduce``); on the CPU with
       the C kernels ``distnorm::batch_norm_backward_reduce``, that kernel's schema.
    2. Parameter gradients from the local sums (the data-parallel engine averages them),
       and the local sums scaled for step 3, ``[r_mu S1, q T]``: ``r_mu`` and ``q`` are the
       same on every rank, so the all-reduce of the scaled sums is the scaled global sums
       (one operator, ``distnorm::backward_sums``).
    3. ONE all-reduce of ``[r_mu S1, q T]`` (only if the input needs a gradient), then ONE
       pass reading ``g`` and ``x`` and writing ``dx`` (:func:`backward_elemt`)::

           dx = a * (g - r_mu * S1 / n - (x - w) * q * T / n)

       with per-channel ``a`` (float32 for fp16/bf16 inputs) and ``grad_coef = [[r_mu, q],
       [w, n]]``. That is ATen's CUDA ``batch_norm_backward_elemt`` with ``mean = w``,
       ``invstd = 1``, ``weight = a``, ``sum_dy = r_mu * S1``, ``sum_dy_xmu = q * T``,
       ``count = [n]`` (no division by ``a``); on the CPU, its twin of the same schema
       (:mod:`distnorm._cpu_kernels`). A training step so moves 8 activation passes: the
       statistics' read, the output's read and write, the sums' two reads, and this pass's
       two reads and one write (``tests/test_step_cost.py`` holds the ceiling).

The CBN and SyncBatchNorm input gradients are both of that form, ``a * g + B * x + D`` with
``u = a / n``::

    B = -u * q * T                 D = -u * r_mu * S1 + u * q * w * T

SyncBatchNorm: ``a = weight * invstd``, ``q = invstd``, ``r_mu = 1``, ``w = mean``.
CBN (SPEC §1.1, with ``T = S2 / s_u``): ``a = gamma / (rho * s_u)``, ``q = r_sig / s``,
``w = (mu_U - beta) + r_mu * d``, ``d = mu_B - mu_U + beta``.

Operators: :mod:`distnorm._ops` declares them, :mod:`distnorm._kernels` runs them.

Compiled. Under ``torch.compile`` the statistics step and the backward are
:mod:`distnorm._traced`'s: the same mathematics as ATen calls Inductor decomposes and fuses
with the model's kernels, and one functional all-reduce per phase -- opaque to the compiler
are only the collectives and ``distnorm::snapshot`` (a copy kernel per AMAT or BNP buffer),
and no host decision is left for the graph to guard on (a compiled model trains across AMAT's
phases in one graph).

CUDA graphs. A captured step is replayed at other learning rates and buffer states, so while
capturing (:func:`distnorm._capture.capturing`) a layer takes the decisions a replay keeps:
AMAT's history path with ``eta`` read on the device, the AMAT initialisation checked on the
device, and the all-reduce as compiled code runs it (NCCL only: the fingerprints compared on
the device, :func:`distnorm._frames.traced_reduce`). What reads the device on the host -- the
group's first step, with its kernel vote; debug mode; gloo -- raises while capturing, naming
what works (one step before capture, as ``torch.cuda.graph`` prescribes a warm-up).

Kernel contracts. The CUDA kernels of the batch-norm family demand more than their CPU
twins; every call below gives them what CUDA needs, on every device, and
``tests/test_kernel_contracts.py`` checks each dispatched call on the CPU
(:class:`tests.dispatch.CudaContractChecker` cites the CUDA source line of each rule):

* no empty input: the CUDA templates reshape ``x`` to ``(N, C, -1)``, which raises for
  ``N = 0`` (the CPU kernels return early), so a rank without samples computes its empty
  output and gradient without a kernel and still joins both collectives;

* per-channel arguments are 1-D, contiguous, of length ``C`` and of the accumulation dtype
  (CUDA's ``is_mixed_type`` takes the dtype of the first defined parameter; the CPU kernel
  requires float32 parameters for fp16/bf16 input);
* ``native_batch_norm_backward`` gets a defined ``save_mean`` and ``save_invstd`` (CUDA
  asserts it: ``batch_norm_backward_cuda``) and a defined weight whenever weight or bias
  gradients are asked for (``batch_norm_backward_reduce_cuda`` gives them its options).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from distnorm import _bnp_functions, _capture, _collectives, _kernel_choice, _ops, _traced
from distnorm._collectives import ProcessGroup
from distnorm._composite import backward_sums_composite, grad_coef_of, to_dtype, update_running
from distnorm._constants import constant
from distnorm._cpu_kernels import memory_format as _memory_format
from distnorm._kernel_choice import Kernels
from distnorm._recompute import Stash, StashedPlan, in_backward
from distnorm._state import CBNBuffers, NormPlan, NormState

__all__ = [
    "AffinePartsFunction",
    "NormalizeFunction",
    "bn_statistics",
    "bnp_statistics",
    "cbn_statistics",
    "channel_affine",
    "forward_output",
    "normalize",
    "normalize_backward",
    "normalize_parts",
]


def _without_grad(statistics: Callable[..., NormPlan], *args: Any) -> NormPlan:
    """``statistics(*args)`` with autograd off, as ``torch.no_grad()`` runs it, without the
    two Python frames of its context manager (host time every step pays)."""
    enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        return statistics(*args)
    finally:
        torch._C._set_grad_enabled(enabled)


def _once_differentiable(backward: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.autograd.function.once_differentiable`` for a hand-written backward, with its
    ``no_grad`` block skipped where autograd is off already: every backward pass that does
    not ask for a graph (``create_graph=False``) runs ``backward`` itself; one that does gets
    the decorator's refusal of a second derivative."""
    refusing = once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Tensor) -> Any:
        return refusing(ctx, *grads) if torch.is_grad_enabled() else backward(ctx, *grads)

    return wrapper


# ------------------------------------------------------------------- the step
def normalize(x: Tensor, weight: Tensor | None, bias: Tensor | None, buffers: Sequence[Tensor | None],
              eta: Tensor | None, state: NormState, group: ProcessGroup | None) -> Tensor:
    """A training step of a synchronized layer: the statistics of ``x`` (one all-reduce; the
    buffers updated), then ``y = scale * (x - center) / sqrt(var + eps) + shift``, whose
    backward (one all-reduce) is :class:`NormalizeFunction`'s.

    ``buffers``: a :class:`CBNBuffers` for CBN / POP-Norm, with ``eta`` AMAT's (0-dim);
    ``(running_mean, running_var, num_batches_tracked)`` for BN, any of them None. ``group``:
    ``state.group()``, asked once per step by the caller.
    """
    plan = _statistics(x, weight, bias, buffers, eta, state, group)
    return NormalizeFunction.apply(x, weight, bias, plan, state, group)


def normalize_parts(x: Tensor, weight: Tensor, bias: Tensor, buffers: CBNBuffers, eta: Tensor,
                    state: NormState, group: ProcessGroup | None) -> tuple[Tensor, Tensor, Tensor]:
    """A CBN / POP-Norm training step for an input that needs no gradient, in parts:
    ``(x_hat, scale, shift)`` with the layer's output ``y = scale[c] * x_hat + shift[c]``,
    for a caller that folds ``scale`` and ``shift`` into the linear operation that follows
    (:mod:`distnorm._folding`).

    The statistics step is :func:`normalize`'s (the same collective, buffer updates and
    checkpoint stash). ``x_hat = (x - center) / sqrt(var + eps)`` carries no gradient;
    ``scale = gamma / rho`` and ``shift = 0`` come from :class:`AffinePartsFunction`, whose
    backward gives gamma and beta the gradients :func:`normalize_backward` gives them. The
    input gradient, and so the backward's collective, is never needed.
    """
    plan = _statistics(x, weight, bias, buffers, eta, state, group)
    if x.numel() == 0:  # kernel contract: no empty input (see channel_affine); the rank still joined the collective
        x_hat = torch.empty_like(x)
    else:
        x_hat = torch.native_batch_norm(x, None, None, plan.center, plan.var, False, 0.0, state.eps)[0]
    scale, shift = AffinePartsFunction.apply(weight, bias, plan, state)
    return x_hat, scale, shift


class AffinePartsFunction(torch.autograd.Function):
    """``(scale, shift) = (gamma / rho, 0)`` (accumulation dtype): the per-channel parts of
    CBN's output ``y = scale * x_hat + shift`` (:func:`normalize_parts`).

    The backward receives ``dL/dscale = T = sum(g * x_hat)`` and ``dL/dshift = S1 = sum(g)``
    (``g`` the gradient of ``y``), the local sums :func:`normalize_backward` takes from ATen's
    kernel, and maps them as it does, with ``distnorm::backward_sums``: ``dgamma = T / rho``,
    ``dbeta = a (S1 - beta_coef T)`` (the plan's ``a`` and ``beta_coef``).
    """

    @staticmethod
    def forward(ctx: Any, weight: Tensor, bias: Tensor, plan: NormPlan, state: NormState) -> tuple[Tensor, Tensor]:
        scale = to_dtype(weight, plan.center.dtype) * (1.0 / state.rho)  # a new tensor, never weight itself
        ctx.save_for_backward(plan.grad_scale, plan.grad_coef, plan.beta_coef)
        ctx.state = state
        ctx.weight_dtype, ctx.bias_dtype = weight.dtype, bias.dtype
        if not torch.compiler.is_compiling():
            ctx.stashed = state.pending  # keeps the stashed plan alive as long as this node (NormalizeFunction)
            state.pending = None
        return scale, torch.zeros_like(scale)

    @staticmethod
    @_once_differentiable
    def backward(ctx: Any, grad_scale: Tensor, grad_shift: Tensor) -> tuple[Tensor | None, ...]:
        a, grad_coef, beta_coef = ctx.saved_tensors
        state = ctx.state
        if torch.compiler.is_compiling():  # traced: the composite, which the compiler fuses
            _, grad_weight, grad_bias, _, _ = backward_sums_composite(
                grad_shift, grad_scale, beta_coef, a, grad_coef, 1.0 / state.rho)
        else:
            _, grad_weight, grad_bias, _, _ = _ops.backward_sums(
                grad_shift, grad_scale, beta_coef, a, grad_coef, 1.0 / state.rho,
                _kernel_choice.kernels_of(state, state.group(), a.device).per_channel)
        return to_dtype(grad_weight, ctx.weight_dtype), to_dtype(grad_bias, ctx.bias_dtype), None, None


def _statistics(x: Tensor, weight: Tensor | None, bias: Tensor | None, buffers: Sequence[Tensor | None],
                eta: Tensor | None, state: NormState, group: ProcessGroup | None) -> NormPlan:
    """The statistics step of a training call: as ``torch.compile`` traces it, else eagerly
    (with the checkpoint stash)."""
    if torch.compiler.is_compiling():
        return _compiled_statistics(x, weight, bias, buffers, eta, state)
    return _eager_statistics(x, weight, bias, buffers, eta, state, group)


def _eager_statistics(x: Tensor, weight: Tensor | None, bias: Tensor | None, buffers: Sequence[Tensor | None],
                      eta: Tensor | None, state: NormState, group: ProcessGroup | None) -> NormPlan:
    """The statistics step — or, in a forward that activation checkpointing recomputes
    during the backward pass, the plan its first forward stashed (no collective, no buffer
    update)."""
    stash = _stash_of(state)
    if in_backward():
        return stash.pop(x.shape, state.name)
    if state.kind == "bn":
        plan = _without_grad(bn_statistics, x, weight, buffers, state, group)
    else:
        plan = _without_grad(cbn_statistics, x, weight, bias, buffers, eta, state, group)
    stashed = StashedPlan(plan, x.shape)
    grad_enabled = torch.is_grad_enabled()  # the caller's: the statistics ran under no_grad
    stash.push(stashed, grad_enabled=grad_enabled)
    state.pending = stashed if grad_enabled else None  # the autograd node keeps it alive
    return plan


def _stash_of(state: NormState) -> Stash:
    if state.stash is None:  # created here, not in NormState(): torch.compile traces the functional API's
        state.stash = Stash()
    return state.stash


def _compiled_statistics(x: Tensor, weight: Tensor | None, bias: Tensor | None, buffers: Sequence[Tensor | None],
                         eta: Tensor | None, state: NormState) -> NormPlan:
    """The statistics step as ``torch.compile`` traces it (:mod:`distnorm._traced`)."""
    if state.kind == "bn":
        return NormPlan(*_traced.bn_statistics(x, weight, buffers, state))
    return NormPlan(*_traced.cbn_statistics(x, weight, bias, buffers, eta, state))


class NormalizeFunction(torch.autograd.Function):
    """``y = scale * (x - center) / sqrt(var + eps) + shift`` with the statistics' backward.

    ``plan`` (a :class:`NormPlan`) takes no gradient: its dependence on ``x`` and the
    parameters is in the hand-written backward. ``state`` is the layer's :class:`NormState`,
    ``group`` the one its statistics reduced over: the backward's, with the kernels the group
    agreed (:func:`distnorm._kernel_choice.kernels_of`, asked once per step, here).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, plan: NormPlan,
                state: NormState, group: ProcessGroup | None) -> Tensor:
        compiling = torch.compiler.is_compiling()
        kernels = None if compiling else _kernel_choice.kernels_of(state, group, x.device)
        y = forward_output(x, weight, bias, plan, state, kernels is not None and kernels.cpu)
        ctx.save_for_backward(x, plan.center, plan.invstd, plan.grad_scale, plan.grad_coef, plan.beta_coef)
        ctx.state, ctx.group, ctx.kernels = state, group, kernels
        ctx.weight_dtype = weight.dtype if weight is not None else None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        if not compiling:
            ctx.stashed = state.pending  # keeps the stashed plan alive as long as this node
            state.pending = None
        return y

    @staticmethod
    @_once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, *saved = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_out = grad_out.contiguous(memory_format=_memory_format(x))
        if torch.compiler.is_compiling():
            grad_x, grad_w, grad_b = _traced.normalize_backward(grad_out, x, saved, need_x, ctx.state)
        else:
            grad_x, grad_w, grad_b = normalize_backward(grad_out, x, saved, need_x, ctx.state, ctx.group, ctx.kernels)
        return (
            grad_x if need_x else None,
            to_dtype(grad_w, ctx.weight_dtype) if need_w else None,
            to_dtype(grad_b, ctx.bias_dtype) if need_b else None,
            None, None, None,
        )


def bnp_statistics(h: Tensor, mean: Tensor, var: Tensor, state: Any) -> tuple[Tensor, Tensor, Any]:
    """BNP's statistics step on a preconditioned layer's input ``h``
    (:func:`distnorm._bnp_functions.layer_statistics`): eager, or as ``torch.compile`` traces
    it (:func:`distnorm._traced.bnp_statistics`). ``state``: the layer's
    :class:`~distnorm._bnp_functions.BNPLayerState`."""
    if torch.compiler.is_compiling():
        return _traced.bnp_statistics(h, mean, var, state)
    return _bnp_functions.layer_statistics(h, mean, var, state)


# ------------------------------------------------------------------ statistics
def bn_statistics(x: Tensor, weight: Tensor | None, buffers: Sequence[Tensor | None], state: NormState,
                  group: ProcessGroup | None) -> NormPlan:
    """Batch normalization over the global batch (SPEC §3): the plan, and running stats.

    ``mean``, ``var`` are the global batch mean and biased variance; ``a = weight * invstd``,
    and the backward coefficients are those of ``torch.nn.BatchNorm*`` on the global batch.
    ``buffers``: ``(running_mean, running_var, num_batches_tracked)``, any of them None;
    ``group``: ``state.group()``. Runs with autograd off (:func:`_eager_statistics`).
    """
    running_mean, running_var, num_batches_tracked = buffers
    moments = _kernel_choice.synced_moments(x, group, state.name, state)  # the group's first step: its kernel vote
    mean, var, count = moments.mean, moments.var, moments.count
    acc = mean.dtype
    channels = mean.shape[0]
    invstd = torch.rsqrt(var + state.eps)
    one = constant(1.0, channels, acc, mean.device)
    if group is None:
        # Local: ATen's training backward does all of it (normalize_backward), given the
        # weight in the accumulation dtype (ones without affine) as grad_scale.
        a = to_dtype(weight, acc) if weight is not None else one
        grad_coef = constant(0.0, (2, 2, channels), acc, mean.device)
    else:
        a = invstd * to_dtype(weight, acc) if weight is not None else invstd
        grad_coef = grad_coef_of(one, invstd, mean, count)  # r_mu = 1, q = invstd, w = mean
    plan = NormPlan(mean, var, invstd, a, grad_coef, constant(0.0, (0,), acc, mean.device))
    update_running(running_mean, running_var, num_batches_tracked, mean, var, count, state.momentum, moments.valid)
    return plan


def cbn_statistics(x: Tensor, weight: Tensor, bias: Tensor, buffers: Sequence[Tensor], eta: Tensor,
                   state: NormState, group: ProcessGroup | None) -> NormPlan:
    """Complete batch normalization with AMAT (SPEC §1; POP-Norm without history): the
    global moments (one all-reduce), then one operator, ``distnorm::cbn_plan``, for the
    per-channel algebra and the buffer updates (:func:`distnorm._composite.cbn_plan_composite`
    gives the maths). A layer with AMAT (``state.amat``) always blends history by ``eta``,
    read on the device (for ``eta = 0`` that gives the batch statistics): in eager mode, in
    a captured CUDA graph replayed at other learning rates, and in compiled code alike.
    ``group``: ``state.group()``. Runs with autograd off (:func:`_eager_statistics`).
    """
    count, mean, var, valid = _kernel_choice.synced_moments(x, group, state.name, state)  # the group's first step: its vote
    plan_kernel = _kernel_choice.kernels_of(state, group, x.device).per_channel
    # A count on the host, or on the device with the device's validity mask where only it knows.
    host_count, device_count, device_valid = (count, None, None) if isinstance(count, int) else (
        -1, count, None if valid is True else valid)
    # Captured into a CUDA graph, the step may be replayed before the AMAT buffers' first
    # update: their initialisation is then checked on the device (the same values either way).
    replayed = _capture.capturing(x.device)
    hyper = [float(state.eps), float(state.rho), float(state.r_max)]
    plan = NormPlan(*_ops.cbn_plan(mean, var, device_count, device_valid, weight, bias, eta if state.amat else None,
                                   list(buffers), host_count, hyper, state.momentum,
                                   state.amat_ready and not replayed, plan_kernel))
    if state.stats_sink is not None:
        # Theory monitors (distnorm.monitors) read the operator's own inputs and outputs, the
        # values every rank computes: references, no op and no second computation, so a rank
        # with a monitor runs exactly the arithmetic of the others.
        state.stats_sink.update(mean=mean, var=var, center=plan.center, eps=state.eps)
    if valid is True and not replayed:
        state.amat_ready = True  # the host saw the AMAT buffers initialised (a capture has not run yet)
    return plan


# ---------------------------------------------------------------- forward / backward
def _view(v: Tensor, ndim: int) -> Tensor:
    return v.view([1, -1] + [1] * (ndim - 2))


def channel_affine(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """``scale[c] * x + shift[c]`` per channel, in ``x``'s dtype and memory format.

    ATen's inference batch norm with mean 0, variance 1 and eps 0 (so ``1/sqrt(var + eps)``
    is exactly 1): one fused pass that computes in float32 for fp16/bf16 inputs.
    ``scale`` / ``shift`` must have the accumulation dtype of ``x`` (kernel contract).
    """
    if x.numel() == 0:
        # Kernel contract (Normalization.cuh, batch_norm_elemt_cuda_template): CUDA reshapes
        # the input to (N, C, -1), which raises for an empty batch. Element-wise ops accept
        # it on every device, and keep the result connected to scale and shift (zero
        # gradients, not None), as at::batch_norm does for empty inputs.
        return (x * _view(scale, x.dim()) + _view(shift, x.dim())).to(x.dtype)
    channels = scale.shape[0]
    zero = constant(0.0, channels, scale.dtype, scale.device)
    one = constant(1.0, channels, scale.dtype, scale.device)
    return torch.native_batch_norm(x, scale, shift, zero, one, False, 0.0, 0.0)[0]


def forward_output(x: Tensor, weight: Tensor | None, bias: Tensor | None, plan: NormPlan, state: NormState,
                   cpu_kernel: bool = False) -> Tensor:
    """``scale * (x - center) / sqrt(var + eps) + shift`` in one pass.

    BN: ``scale, shift = weight, bias``; CBN: ``scale = gamma / rho``, no shift (beta is in
    ``center``). With ``cpu_kernel`` (the group agreed on the C kernels) a CPU input takes
    ``distnorm::batch_norm_elemt`` (:mod:`distnorm._cpu_kernels`), the schema and formula of
    ATen's CUDA ``batch_norm_elemt``, ``(x - center) * invstd * weight + bias``: for CBN with
    ``weight = a = gamma * invstd / rho`` (the plan's ``grad_scale``) and ``invstd = 1``, so
    POP-Norm's ``1 / rho`` costs no operator of its own. Elsewhere ATen's inference batch norm;
    calling ``native_batch_norm`` directly (not ``torch.batch_norm``, which may pick cuDNN) runs
    the same native kernel family on CPU and CUDA. Kernel contract: per-channel arguments of
    the accumulation dtype.
    """
    if x.numel() == 0:  # a rank without samples (kernel contract: no empty input, see channel_affine)
        return torch.empty_like(x)
    acc = plan.center.dtype
    if cpu_kernel and x.device.type == "cpu":
        if state.kind == "bn":
            return _ops.batch_norm_elemt(x, to_dtype(weight, acc), to_dtype(bias, acc), plan.center, plan.invstd,
                                         state.eps)
        return _ops.batch_norm_elemt(x, plan.grad_scale, None, plan.center,
                                     constant(1.0, plan.center.shape[0], acc, x.device), state.eps)
    if state.kind == "bn":
        scale, shift = to_dtype(weight, acc), to_dtype(bias, acc)
    else:
        scale = to_dtype(weight, acc) if state.rho == 1.0 else to_dtype(weight, acc) * (1.0 / state.rho)
        shift = None
    return torch.native_batch_norm(x, scale, shift, plan.center, plan.var, False, 0.0, state.eps)[0]


def normalize_backward(grad_out: Tensor, x: Tensor, saved: Sequence[Tensor], need_input_grad: bool,
                       state: NormState, group: ProcessGroup | None, kernels: Kernels) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_x, grad_weight, grad_bias)`` in the accumulation dtype (see the module plan).

    ``saved``: the plan's ``(center, invstd, grad_scale, grad_coef, beta_coef)``. ``grad_x``
    is an empty tensor when ``need_input_grad`` is false (no collective then). ``group`` and
    ``kernels``: the forward's (:class:`NormalizeFunction`). Runs inside
    :class:`NormalizeFunction`'s backward, where autograd records nothing.
    """
    center, invstd, grad_scale, grad_coef, beta_coef = saved
    channels = center.shape[0]
    if state.kind == "bn" and group is None:
        return _local_batch_norm_backward(grad_out, x, saved, need_input_grad, state)
    if x.numel() > 0 and kernels.cpu and x.device.type == "cpu":
        # The C kernel, with the arguments of ATen's CUDA batch_norm_backward_reduce (which the CUDA
        # path's native_batch_norm_backward below runs): T = sum(g (x - center)) invstd, S1 = sum(g).
        _, _, t_local, s1_local = _ops.batch_norm_backward_reduce(grad_out, x, center, invstd, invstd,
                                                                  False, True, True)
    elif x.numel() > 0:
        # Kernel contract (batch_norm_backward_cuda): train=True makes both kernels read
        # save_mean / save_invstd, which CUDA asserts are defined; the mask [False, True,
        # True] takes CUDA's non-fused branch, whose batch_norm_backward_reduce needs a
        # defined weight for its outputs' dtype. `invstd` serves: the sums do not depend
        # on the weight's values.
        _, t_local, s1_local = torch.ops.aten.native_batch_norm_backward(
            grad_out, x, invstd, None, None, center, invstd, True, state.eps, [False, True, True])
    else:  # an empty rank contributes nothing but still joins the collective below
        # (kernel contract: no empty input; fresh zeros, since they become gradients)
        t_local, s1_local = torch.zeros(2, channels, dtype=center.dtype, device=center.device).unbind()

    # One fused operator (distnorm._kernels): the local sums scaled for the element-wise
    # pass, [r_mu S1, q T], the local parameter gradients, the pass's w and count.
    if state.kind == "bn":  # ATen's sums are BN's parameter gradients; no beta term
        sums, _, _, w, count = _ops.backward_sums(
            s1_local, t_local, constant(0.0, (channels,), center.dtype, center.device),
            constant(1.0, channels, center.dtype, center.device), grad_coef, 1.0, kernels.per_channel)
        grad_weight, grad_bias = t_local, s1_local
    else:
        sums, grad_weight, grad_bias, w, count = _ops.backward_sums(
            s1_local, t_local, beta_coef, grad_scale, grad_coef, 1.0 / state.rho, kernels.per_channel)

    if not need_input_grad:
        return torch.empty(0, dtype=x.dtype, device=x.device), grad_weight, grad_bias
    # The statistics depend on every rank's samples, so the input gradient needs the global
    # sums. Parameter gradients do not: they stay local and the data-parallel engine
    # averages them, exactly as for torch.nn.SyncBatchNorm.
    if group is not None:  # (the slot's text only where a frame carries it)
        _collectives.all_reduce_sum(sums, group, slot=f"{state.name}|backward|C={channels}|{x.dtype}",
                                    shape=(channels, x.dtype))
    if x.numel() == 0:
        return torch.empty_like(x), grad_weight, grad_bias
    shift, slope = sums.unbind()  # r_mu S1, q T of the global batch
    # The C pass wherever the group agreed on the C kernels (also where Triton's interpreter runs the operators).
    return backward_elemt(grad_out, x, grad_scale, (w, shift, slope, count), kernels.cpu), grad_weight, grad_bias


def backward_elemt(grad_out: Tensor, x: Tensor, grad_scale: Tensor, args: Sequence[Tensor],
                   cpu_kernel: bool = False) -> Tensor:
    """``dx = a (g - shift / n - (x - w) slope / n)`` in ONE pass over ``g`` and ``x``
    (``args``: ``(w, shift, slope, count)``: ``w`` and ``count`` of ``distnorm::backward_sums``,
    ``shift`` and ``slope`` its sums after the all-reduce; ``a = grad_scale``).

    That is ATen's CUDA ``batch_norm_backward_elemt`` with ``mean = w``, ``invstd = 1``,
    ``weight = a``, ``sum_dy = shift``, ``sum_dy_xmu = slope`` and ``count = [n]``, which
    the CUDA path calls; the CPU calls its twin of the same schema and formula,
    ``distnorm::batch_norm_backward_elemt`` (:mod:`distnorm._cpu_kernels`), with
    ``cpu_kernel`` (:func:`distnorm._kernel_choice.cpu_kernel_decision`). Other devices, and the CPU
    without it, take ATen's two passes
    (``a g + B x + D``, rounded twice). Kernel contract (CUDA): a non-empty input, per-channel
    tensors of the accumulation dtype, 1-D and contiguous, ``count`` int32.
    """
    w, shift, slope, count = args
    one = constant(1.0, w.shape[0], w.dtype, w.device)
    if x.device.type == "cuda":
        return torch.batch_norm_backward_elemt(grad_out, x, w, one, grad_scale, shift, slope, count)
    if cpu_kernel and x.device.type == "cpu":
        return _ops.batch_norm_backward_elemt(grad_out, x, w, one, grad_scale, shift, slope, count)
    # B = -a slope / n, D = a (w slope - shift) / n: an affine map of x, then + a g.
    u = grad_scale / count.to(w.dtype)
    grad_x = channel_affine(x, torch.mul(u, slope).neg_(), torch.addcmul(shift, w, slope, value=-1.0).mul_(u).neg_())
    # a stays in the accumulation dtype: the in-place op computes in float32 and rounds once.
    return grad_x.addcmul_(grad_out, _view(grad_scale, x.dim()))


def _local_batch_norm_backward(grad_out: Tensor, x: Tensor, saved: Sequence[Tensor], need_input_grad: bool,
                               state: NormState) -> tuple[Tensor, Tensor, Tensor]:
    """Batch normalization without synchronization: the global sums are this rank's, so
    ATen's training backward computes ``dx``, ``dweight`` and ``dbias`` in one kernel, as
    for ``torch.nn.BatchNorm*`` (the plan's ``grad_scale``: the layer's weight, or ones, in
    the accumulation dtype). Kernel contract: ``train=True`` reads the defined
    ``save_mean`` / ``save_invstd``; the weight is defined whenever its gradients are asked
    for."""
    mean, invstd, weight = saved[:3]
    grad_x, grad_weight, grad_bias = torch.ops.aten.native_batch_norm_backward(
        grad_out, x, weight, None, None, mean, invstd, True, state.eps, [need_input_grad, True, True])
    if not need_input_grad:
        grad_x = torch.empty(0, dtype=x.dtype, device=x.device)
    return grad_x, grad_weight, grad_bias


