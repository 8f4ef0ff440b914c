"""The mathematics of the layers: per-step statistics ("plans"), the forward and the backward.

Every synchronized layer runs the same plan, chosen so that a training step issues exactly
one collective in the forward and one in the backward, saves only its input plus
per-channel vectors, and never reads a tensor on the host:

statistics (:func:`bn_statistics`, :func:`cbn_statistics`; no autograd)
    1. :func:`distnorm._collectives.global_moments`: local Welford moments, ONE all-reduce
       (at a group's first step its counts also carry the ranks' vote on the fused
       operators' kernels, so every rank runs the same ones: :mod:`distnorm._fused`).
    2. Per-channel algebra in the accumulation dtype (float32, float64 for float64 input):
       the statistics the output uses, and the coefficients of the backward below.
    3. Buffer updates (running / AMAT statistics), on device, exactly once per step.
    The result is a :class:`NormPlan` of per-channel tensors. Activation checkpointing
    recomputes a forward during the backward pass; such a recomputation reuses the stashed
    plan of the first forward instead (:mod:`distnorm._recompute`).

forward (:func:`forward_output`; the autograd glue is :class:`distnorm._autograd.NormalizeFunction`)
    ``y = scale * (x - center) / sqrt(var + eps) + shift``: ATen's inference batch norm,
    one fused pass for every input rank, memory format and dtype.

backward (:func:`normalize_backward`)
    1. ATen's batch-norm backward computes the local sums ``S1 = sum(g)`` and
       ``T = sum(g * (x - center)) * invstd`` in one pass.
    2. Parameter gradients from the local sums (the data-parallel engine averages them).
    3. ONE all-reduce of ``[S1, T]`` (only if the input needs a gradient), then
       ``dx = a * g + B * x + D`` with per-channel ``a`` (float32 for fp16/bf16 inputs) and
       ``[D, B] = grad_coef @ [S1, T]``: two fused passes.

The CBN and SyncBatchNorm input gradients are both of that form. With ``u = a / n``::

    B = -u * q * T                 D = -u * r_mu * S1 + u * q * w * T

SyncBatchNorm: ``a = weight * invstd``, ``q = invstd``, ``r_mu = 1``, ``w = mean``.
CBN (SPEC §1.1, with ``T = S2 / s_u``): ``a = gamma / (rho * s_u)``, ``q = r_sig / s``,
``w = (mu_U - beta) + r_mu * d``, ``d = mu_B - mu_U + beta``.

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

import copy
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from distnorm import _collectives, _fused
from distnorm._collectives import ProcessGroup, constant
from distnorm._fused import grad_coef_of, neg_inverse_count, to_dtype, update_running
from distnorm._recompute import Stash, StashedPlan, in_backward

__all__ = [
    "CBNBuffers",
    "NormPlan",
    "NormState",
    "bn_statistics",
    "cbn_statistics",
    "channel_affine",
    "forward_output",
    "normalize_backward",
]


@dataclass(eq=False)
class NormState:
    """What the mathematics needs to know about one layer, in one small structure.

    The module owns parameters and buffers; this object carries its hyper-parameters and
    the host-side facts that let the statistics skip work without reading the device.

    Attributes:
        kind: ``"bn"`` (batch normalization) or ``"cbn"`` (CBN / POP-Norm).
        name: the layer's name in error messages.
        eps, momentum: hyper-parameters.
        rho, r_max: CBN's (``rho = kappa``, ``r_max = 1`` for POP-Norm); ``None`` for BN.
        process_group, sync: what to synchronize over.
        history: AMAT blends in history at this step (``eta > 0``); known from ``set_lr``.
        amat_ready: the AMAT buffers are initialised on every rank (the host saw it happen).
        stats_sink: dict the theory monitors read the last batch statistics from, or None
            (references to the fused operator's inputs and outputs: no op of its own).
        stash: plans kept for activation checkpointing (made at first use).
    """

    kind: str
    name: str
    eps: float
    momentum: float | None
    rho: float | None = None
    r_max: float | None = None
    process_group: ProcessGroup | None = None
    sync: bool = True
    history: bool = False
    amat_ready: bool = False
    stats_sink: dict | None = None
    stash: Stash | None = field(default=None, repr=False)  # made at the first stash (a layer makes its own)
    pending: StashedPlan | None = field(default=None, repr=False)
    key: int = field(default=-1, repr=False)  # registry key of distnorm._ops (torch.compile)

    def group(self) -> ProcessGroup | None:
        return _collectives.sync_group(self.process_group) if self.sync else None

    def __getstate__(self) -> dict[str, Any]:  # pickling / deepcopy: runtime fields reset
        state = dict(self.__dict__)
        state.update(stash=None, pending=None, key=-1, stats_sink=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.stash = Stash()

    def __deepcopy__(self, memo: dict) -> "NormState":
        new = NormState.__new__(NormState)
        state = self.__getstate__()
        group = state.pop("process_group")
        new.__setstate__(copy.deepcopy(state, memo))
        new.process_group = group  # process groups are shared handles, never copied
        return new


class CBNBuffers(NamedTuple):
    """The statistics a CBN / POP-Norm layer keeps (its buffers), updated in place by a
    training call. ``CBNBuffers.fresh(c)`` gives new ones for ``c`` channels."""

    amat_mean: torch.Tensor
    amat_var: torch.Tensor
    amat_initialized: torch.Tensor
    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor

    @classmethod
    def fresh(cls, channels: int, *, dtype: torch.dtype = torch.float32, device: Any = None) -> "CBNBuffers":
        def vec(value: float) -> torch.Tensor:
            return torch.full((channels,), value, dtype=dtype, device=device)

        return cls(vec(0.0), vec(1.0), torch.zeros((), dtype=torch.bool, device=device), vec(0.0), vec(1.0),
                   torch.zeros((), dtype=torch.long, device=device))


class NormPlan(NamedTuple):
    """Per-channel tensors of one training step (all of the accumulation dtype).

    Attributes:
        center: subtracted from ``x`` (``mean`` for BN, ``mu_U - beta`` for CBN).
        var: variance the output divides by (``sqrt(var + eps)``).
        invstd: ``1 / sqrt(var + eps)``.
        grad_scale: ``a``, the factor of ``g`` in the input gradient — except for
            unsynchronized BN, whose backward is ATen's own: there, the weight (ones without
            affine) that kernel takes.
        grad_coef: ``(2, 2, C)``, maps the global ``[S1, T]`` to ``[D, B]`` (zeros, unread,
            for unsynchronized BN).
        beta_coef: ``q * d`` of CBN's ``dbeta = a * (S1 - q d T)`` (local sums); empty for BN.
    """

    center: torch.Tensor
    var: torch.Tensor
    invstd: torch.Tensor
    grad_scale: torch.Tensor
    grad_coef: torch.Tensor
    beta_coef: torch.Tensor


def _begin(x: torch.Tensor, state: Any, replay: bool) -> Any:
    """A recomputed forward (activation checkpointing) reuses the first forward's plan."""
    if replay and in_backward():
        return _stash_of(state).pop(x.shape, state.name)
    return None


def _stash_of(state: Any) -> Stash:
    if state.stash is None:  # created here, not in NormState(): torch.compile traces the functional API's
        state.stash = Stash()
    return state.stash


def _finish(plan: Any, x: torch.Tensor, state: Any, replay: bool) -> Any:
    """Stash the plan of a first forward for a possible recomputation (eager mode)."""
    if not replay:
        return plan
    stashed = StashedPlan(plan, x.shape)
    grad_enabled = torch.is_grad_enabled()
    _stash_of(state).push(stashed, grad_enabled=grad_enabled)
    state.pending = stashed if grad_enabled else None  # the autograd node keeps it alive
    return plan


# --------------------------------------------------------------------------- statistics
@torch.no_grad()
def bn_statistics(x: torch.Tensor, weight: torch.Tensor | None, running_mean: torch.Tensor | None,
                  running_var: torch.Tensor | None, num_batches_tracked: torch.Tensor | None,
                  state: NormState, replay: bool = True) -> NormPlan:
    """Batch normalization over the global batch (SPEC §3): the plan, and running stats.

    ``mean``, ``var`` are the global batch mean and biased variance; ``a = weight * invstd``,
    and the backward coefficients are those of ``torch.nn.BatchNorm*`` on the global batch.
    """
    replayed = _begin(x, state, replay)
    if replayed is not None:
        return replayed
    group = state.group()
    votes = _fused.triton_vote(group, x.device, x.shape[1])  # the group's first step: agree on the kernels
    moments = _collectives.global_moments(x, group, layer=state.name, piggyback=votes)
    if votes is not None:
        _fused.triton_decision(group, x.device, votes)  # kept for the backward's shift_slope
    mean, var, count = moments.mean, moments.var, moments.count
    acc = mean.dtype
    channels = mean.shape[0]
    invstd = torch.rsqrt(var + state.eps)
    one = constant(1.0, channels, acc, mean.device)
    if group is None:
        # Local: ATen's training backward does all of it (normalize_backward), given the
        # weight in the accumulation dtype (ones without affine) as grad_scale.
        a = to_dtype(weight, acc) if weight is not None else one
        grad_coef = _ZEROS.get((2, 2, channels), acc, mean.device)
    else:
        a = invstd * to_dtype(weight, acc) if weight is not None else invstd
        grad_coef = grad_coef_of(neg_inverse_count(a, count), invstd, one, mean)
    plan = NormPlan(mean, var, invstd, a, grad_coef, _ZEROS.get((0,), acc, mean.device))
    update_running(running_mean, running_var, num_batches_tracked, mean, var, count, state.momentum, moments.valid)
    return _finish(plan, x, state, replay)


@torch.no_grad()
def cbn_statistics(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, buffers: CBNBuffers,
                   amat_eta: torch.Tensor, state: NormState, replay: bool = True) -> NormPlan:
    """Complete batch normalization with AMAT (SPEC §1; POP-Norm without history): the
    global moments (one all-reduce), then one fused operator, ``distnorm::cbn_plan``, for
    the per-channel algebra and the buffer updates (:func:`distnorm._fused.cbn_plan_composite`
    gives the maths). ``state.history`` says whether ``amat_eta`` is > 0.
    """
    replayed = _begin(x, state, replay)
    if replayed is not None:
        return replayed
    group = state.group()
    votes = _fused.triton_vote(group, x.device, x.shape[1])  # the group's first step: agree on the kernels
    count, mu_b, var_x, valid = _collectives.global_moments(x, group, layer=state.name, piggyback=votes)
    triton = _fused.triton_decision(group, x.device, votes)
    host_count = count if isinstance(count, int) else -1
    args = (mu_b, var_x, None if isinstance(count, int) else count, host_count, valid is True, weight, bias,
            amat_eta, *buffers, state.eps, state.momentum, state.rho, state.r_max, state.history, state.amat_ready)
    plan = NormPlan(*torch.ops.distnorm.cbn_plan(*args, triton))
    if state.stats_sink is not None:
        # Theory monitors (distnorm.monitors) read the operator's own inputs and outputs, the
        # values every rank computes: references, no op and no second computation, so a rank
        # with a monitor runs exactly the arithmetic of the others.
        state.stats_sink.update(mean=mu_b, var=var_x, center=plan.center, eps=state.eps)
    if valid is True:
        state.amat_ready = True  # the host saw the AMAT buffers initialised
    return _finish(plan, x, state, replay)


class _ZerosCache:
    """Read-only zero tensors per (shape, dtype, device), for plan fields a path does not use
    (BN's ``beta_coef``; the local BN backward's ``grad_coef``): no op per step, and the
    shapes the compiled operators declare."""

    def __init__(self) -> None:
        self._cache: dict[tuple[tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (shape, dtype, device)
        if key not in self._cache:
            self._cache[key] = torch.zeros(shape, dtype=dtype, device=device)
        return self._cache[key]


_ZEROS = _ZerosCache()


# ---------------------------------------------------------------- forward / backward
def _view(v: torch.Tensor, ndim: int) -> torch.Tensor:
    return v.view([1, -1] + [1] * (ndim - 2))


def channel_affine(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
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
    return torch.ops.aten.native_batch_norm(x, scale, shift, zero, one, False, 0.0, 0.0)[0]


def forward_output(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   center: torch.Tensor, var: torch.Tensor, state: NormState) -> torch.Tensor:
    """``scale * (x - center) / sqrt(var + eps) + shift``: ATen's inference batch norm.

    BN: ``scale, shift = weight, bias``; CBN: ``scale = gamma / rho``, no shift (beta is in
    ``center``). Kernel contract: weight and bias of the accumulation dtype; calling
    ``native_batch_norm`` directly (not ``torch.batch_norm``, which may pick cuDNN) runs the
    same native kernel family on CPU and CUDA.
    """
    if x.numel() == 0:  # a rank without samples (kernel contract: no empty input, see channel_affine)
        return torch.empty_like(x)
    acc = center.dtype
    if state.kind == "bn":
        scale, shift = to_dtype(weight, acc), to_dtype(bias, acc)
    else:
        scale = to_dtype(weight, acc) if state.rho == 1.0 else to_dtype(weight, acc) * (1.0 / state.rho)
        shift = None
    return torch.ops.aten.native_batch_norm(x, scale, shift, center, var, False, 0.0, state.eps)[0]


@torch.no_grad()
def normalize_backward(grad_out: torch.Tensor, x: torch.Tensor, center: torch.Tensor, invstd: torch.Tensor,
                       grad_scale: torch.Tensor, grad_coef: torch.Tensor, beta_coef: torch.Tensor,
                       need_input_grad: bool, state: NormState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight, grad_bias)`` in the accumulation dtype (see the module plan).

    ``grad_x`` is an empty tensor when ``need_input_grad`` is false (no collective then).
    """
    channels = center.shape[0]
    if state.kind == "bn" and state.group() is None:
        return _local_batch_norm_backward(grad_out, x, center, invstd, grad_scale, need_input_grad, state)
    if x.numel() > 0:
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

    triton = _fused.triton_decision(state.group(), x.device)  # what the forward's group agreed
    if state.kind == "bn":
        sums = torch.stack([s1_local, t_local])
        grad_weight, grad_bias = t_local, s1_local
    else:  # one fused operator: [S1, T], dgamma, dbeta (local sums; see distnorm._fused)
        sums, grad_weight, grad_bias = torch.ops.distnorm.cbn_param_grads(
            s1_local, t_local, beta_coef, grad_scale, 1.0 / state.rho, triton)

    if not need_input_grad:
        return torch.empty(0, dtype=x.dtype, device=x.device), grad_weight, grad_bias
    # The statistics depend on every rank's samples, so the input gradient needs the global
    # sums. Parameter gradients do not: they stay local and the data-parallel engine
    # averages them, exactly as for torch.nn.SyncBatchNorm.
    _collectives.all_reduce_sum(sums, state.group(), slot=f"{state.name}|backward|C={channels}|{x.dtype}")
    shift, slope = torch.ops.distnorm.shift_slope(grad_coef, sums, triton)  # D, B = grad_coef @ sums
    if x.numel() == 0:
        return torch.empty_like(x), grad_weight, grad_bias
    grad_x = channel_affine(x, slope, shift)
    # a stays in the accumulation dtype: the in-place op computes in float32 and rounds once.
    grad_x.addcmul_(grad_out, _view(grad_scale, x.dim()))
    return grad_x, grad_weight, grad_bias


def _local_batch_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                               weight: torch.Tensor, need_input_grad: bool,
                               state: NormState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch normalization without synchronization: the global sums are this rank's, so
    ATen's training backward computes ``dx``, ``dweight`` and ``dbias`` in one kernel, as
    for ``torch.nn.BatchNorm*`` (``weight``: the layer's, or ones, in the accumulation
    dtype). Kernel contract: ``train=True`` reads the defined ``save_mean`` /
    ``save_invstd``; the weight is defined whenever its gradients are asked for."""
    grad_x, grad_weight, grad_bias = torch.ops.aten.native_batch_norm_backward(
        grad_out, x, weight, None, None, mean, invstd, True, state.eps, [need_input_grad, True, True])
    if not need_input_grad:
        grad_x = torch.empty(0, dtype=x.dtype, device=x.device)
    return grad_x, grad_weight, grad_bias
