"""Stateless functional forms of distnorm's layers, and the call every layer makes.

Like ``torch.nn.functional.batch_norm``, :func:`cbn`, :func:`pop_norm` and
:func:`sync_batch_norm` take the parameters and buffers as arguments and update the
buffers in place when ``training`` is true. Each describes its layer by a
:class:`NormState` made for the call and hands it to :func:`normalize`, which the modules
in :mod:`distnorm.layers` call with the state they keep: there it also holds facts the
host learnt at earlier steps (whether AMAT is initialised, which a call must otherwise
check on the device) and the statistics activation checkpointing needs — use the modules
for training. A training call goes down to :func:`distnorm._functions.normalize`.

Synchronization: pass ``process_group`` (``None`` = default group). The functions reduce
over it only when ``torch.distributed`` is initialised and the group has more than one
rank; ``sync=False`` forces local statistics.
"""

from __future__ import annotations

from typing import Sequence

import torch

from distnorm import _functions
from distnorm._bnp_functions import bnp_precondition
from distnorm._collectives import ProcessGroup
from distnorm._functions import channel_affine
from distnorm._gn_function import group_norm
from distnorm._moments import accumulate_dtype
from distnorm._state import CBNBuffers, NormState
from distnorm.specs import EPS, EVAL_STATS, MOMENTUM, CBNSpec, POPNormSpec  # EVAL_STATS: CBN's eval_stats values (SPEC §1)

__all__ = ["CBNBuffers", "NormState", "amat_eta", "bnp_precondition", "cbn", "cbn_eval_affine", "cbn_inference",
           "group_norm", "normalize", "normalize_parts", "pop_norm", "sync_batch_norm"]


def amat_eta(lr: float | torch.Tensor, omega: float) -> float | torch.Tensor:
    """AMAT's history weight ``eta = clip(1 - omega * lr, 0, 1)`` (paper 002, Eq. 9).

    A tensor ``lr`` (capturable and fused optimizers keep the learning rate as a tensor on
    the device) gives a float64 0-dim tensor on its device, computed there without reading
    it on the host, and to the bit what the float formula gives for the same value.
    """
    if isinstance(lr, torch.Tensor):
        return torch.clamp(1.0 - omega * lr.detach().reshape(()).double(), 0.0, 1.0)
    return min(max(1.0 - omega * lr, 0.0), 1.0)


def _check_input(x: torch.Tensor, num_features: int, layer: str) -> None:
    """Shape/dtype validation, raised before any collective so every rank raises alike."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{layer}: expected a torch.Tensor input, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{layer}: expected a floating-point input, got dtype {x.dtype}")
    if not 2 <= x.dim() <= 5:
        raise ValueError(
            f"{layer}: expected a 2-D to 5-D input (N, C), (N, C, L), (N, C, H, W) or "
            f"(N, C, D, H, W), got shape {tuple(x.shape)}"
        )
    if x.shape[1] != num_features:
        raise ValueError(
            f"{layer}: expected {num_features} channels in dim 1, got input of shape "
            f"{tuple(x.shape)}; construct the layer with num_features={x.shape[1]} or fix the "
            "preceding layer"
        )


def _eta_tensor(eta: float | torch.Tensor, buffers: Sequence[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """CBN's AMAT ``eta`` as a 0-dim tensor of the buffers' dtype on ``x``'s device. No host
    sync: ``torch.tensor(eta, device="cuda")`` would copy from the host and wait for it;
    ``torch.full`` launches a fill kernel."""
    if isinstance(eta, torch.Tensor):
        return eta
    return torch.full((), float(eta), dtype=buffers[0].dtype, device=x.device)


def _check_local_batch(x: torch.Tensor, layer: str) -> None:
    # Without synchronization the batch is all there is: one value per channel has no
    # variance (PyTorch raises the same error).
    if x.numel() // x.shape[1] <= 1:
        raise ValueError(
            f"{layer}: expected more than 1 value per channel when training, got input of "
            f"shape {tuple(x.shape)}; increase the batch size or put the model in eval() mode"
        )


def normalize(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
              buffers: Sequence[torch.Tensor | None], state: NormState, *, training: bool = True,
              eta: float | torch.Tensor | None = None) -> torch.Tensor:
    """One call of the layer that ``state`` describes: what every module's forward calls.

    Args:
        x: the input, ``(N, C, *)``.
        weight, bias: ``gamma`` and ``beta`` (``None``: a BatchNorm without affine).
        buffers: CBN / POP-Norm: a :class:`CBNBuffers`; batch normalization:
            ``(running_mean, running_var, num_batches_tracked)``, any of them None. A
            training call updates them in place.
        state: the layer (:class:`NormState`): kind, name, hyper-parameters, group, and
            what the host knows from earlier calls.
        training: normalize with this batch's statistics over the group; else evaluate
            with the buffers.
        eta: CBN's AMAT weight on history: a float, or a 0-dim tensor never read on the host.
    """
    channels = weight if weight is not None else buffers[0]
    _check_input(x, channels.shape[0] if channels is not None else x.shape[1], state.name)
    if state.kind == "cbn":
        eta = _eta_tensor(eta, buffers, x)
    if not training:
        if state.kind == "bn":
            # PyTorch's semantics: running statistics, or this batch's when none are tracked.
            running_mean, running_var = buffers[:2]
            use_batch = running_mean is None or running_var is None
            return torch.batch_norm(x, weight, bias, running_mean, running_var, use_batch, 0.0, state.eps, False)
        return cbn_inference(x, weight, bias, buffers, eta, state)
    group = state.group()
    if group is None:
        _check_local_batch(x, state.name)
    return _functions.normalize(x, weight, bias, buffers, eta, state, group)


def normalize_parts(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, buffers: CBNBuffers,
                    state: NormState, *, eta: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A CBN / POP-Norm training call on an input that needs no gradient, in parts:
    ``(x_hat, scale, shift)`` with the layer's output ``y = scale[c] * x_hat + shift[c]``.

    For a caller that folds ``scale`` and ``shift`` into the convolution that follows
    (:class:`distnorm.PreNorm` before the stem): the statistics step is the layer's own (one
    all-reduce, the buffers updated), and ``scale`` / ``shift`` take gamma's and beta's
    gradients as the layer's backward gives them
    (:func:`distnorm._functions.normalize_parts`).
    """
    if state.kind != "cbn":
        raise ValueError(f"{state.name}: normalize_parts is for CBN / POP-Norm layers, got a {state.kind!r} layer")
    _check_input(x, weight.shape[0], state.name)
    if x.requires_grad:
        raise ValueError(f"{state.name}: normalize_parts computes no input gradient, but the input requires one; "
                         "call normalize instead")
    group = state.group()
    if group is None:
        _check_local_batch(x, state.name)
    return _functions.normalize_parts(x, weight, bias, buffers, _eta_tensor(eta, buffers, x), state, group)


def sync_batch_norm(  # torch.nn.functional.batch_norm's arguments, then where to synchronize
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    num_batches_tracked: torch.Tensor | None = None,
    *,
    training: bool = True,
    momentum: float | None = MOMENTUM,
    eps: float = EPS,
    process_group: ProcessGroup | None = None,
    sync: bool = True,
    layer: str = "sync_batch_norm",
) -> torch.Tensor:
    """Batch normalization whose training statistics span every rank of ``process_group``.

    ``y = (x - mean) / sqrt(var + eps) * weight + bias`` with the global batch mean and
    biased variance in training, the running statistics in evaluation (when given).

    Example:
        >>> x = torch.randn(8, 3, 4, 4)
        >>> rm, rv = torch.zeros(3), torch.ones(3)
        >>> sync_batch_norm(x, rm, rv).shape
        torch.Size([8, 3, 4, 4])
    """
    state = NormState("bn", layer, eps, momentum, process_group=process_group, sync=sync)
    return normalize(x, weight, bias, (running_mean, running_var, num_batches_tracked), state, training=training)


def cbn(  # the layer's tensors, then the call's configuration as keywords
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    buffers: CBNBuffers,
    *,
    training: bool = True,
    eta: float | torch.Tensor = 0.0,
    spec: CBNSpec = CBNSpec(),
    process_group: ProcessGroup | None = None,
    layer: str = "cbn",
) -> torch.Tensor:
    """Complete batch normalization with AMAT (paper 002; SPEC §1).

    Training: ``y = (gamma/rho) * (x - mu_U + beta) / sqrt(var_U + eps)`` where
    ``mu_U = eta*mu_A + (1-eta)*mu_B`` and ``var_U = eta*var_A + (1-eta)*mean(x1^2)`` blend
    the AMAT averages with the (global) batch statistics; the AMAT, running and
    ``num_batches_tracked`` buffers are updated in place. ``eta = 0`` gives no history.

    Evaluation with ``eval_stats="amat"``:
    ``y = (gamma/rho) * (x - mu_A + beta) / sqrt(var_A + eps)``; with ``"running"``:
    ``y = (gamma/rho) * (x - running_mean + beta) / sqrt(running_var + beta^2 + eps)``.

    The hyper-parameters are those of :class:`distnorm.specs.CBNSpec` (``amat`` and
    ``omega`` are the layer's business: here ``eta`` is given). Evaluation uses
    ``spec.resolved_eval_stats``, as the layer does (``None``: ``"auto"`` with AMAT, which
    compares ``eta`` with ``1 - momentum``; ``"running"`` without).

    Example:
        >>> from distnorm.specs import CBNSpec
        >>> buffers = CBNBuffers.fresh(3)
        >>> y = cbn(torch.randn(8, 3), torch.ones(3), torch.zeros(3), buffers, eta=0.5, spec=CBNSpec(rho=2.0))
        >>> y.shape, int(buffers.num_batches_tracked)
        (torch.Size([8, 3]), 1)
    """
    # A tensor eta may be 0 or not, which the host cannot know without reading it, so it
    # takes AMAT's path, which for eta = 0 computes the batch statistics.
    amat = True if isinstance(eta, torch.Tensor) else float(eta) > 0
    state = NormState("cbn", layer, spec.eps, spec.momentum, rho=float(spec.rho), r_max=float(spec.r_max),
                      process_group=process_group, sync=spec.sync, eval_stats=spec.resolved_eval_stats, amat=amat)
    return normalize(x, weight, bias, buffers, state, training=training, eta=eta)


def cbn_inference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, buffers: CBNBuffers,
                  eta: torch.Tensor, state: NormState) -> torch.Tensor:
    """CBN at evaluation: a per-channel affine map, differentiable in x, gamma and beta.

    ``state.eval_stats``: ``"amat"``: ``(gamma/rho) (x - mu_A + beta) / sqrt(var_A + eps)``;
    ``"running"``: ``(gamma/rho) (x - running_mean + beta) / sqrt(running_var + beta^2 +
    eps)`` (for a centred ``x``, ``E[(x - mu + beta)^2] = var + beta^2``); ``"auto"``: the
    AMAT statistics once they average at least as much history as the running ones — the
    last training step had ``eta >= 1 - momentum`` (``1 - 1/num_batches_tracked`` for the
    cumulative average) — else the running ones. The choice reads ``eta`` (the layer's
    ``amat_eta``, a buffer), so a model reloaded from a checkpoint evaluates as it did
    before saving.
    """
    scale, shift = cbn_eval_affine(weight, bias, buffers, eta, state, accumulate_dtype(x))
    return channel_affine(x, scale, shift)


def cbn_eval_affine(weight: torch.Tensor, bias: torch.Tensor, buffers: CBNBuffers, eta: torch.Tensor,
                    state: NormState, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel ``(scale, shift)`` of CBN / POP-Norm at evaluation, in ``dtype``:
    ``y = scale[c] * x + shift[c]`` (:func:`cbn_inference`, its statistics and their choice),
    with ``scale = gamma / rho / sqrt(var + eps)`` and ``shift = scale * (beta - mean)``.
    Also what :func:`distnorm.freeze` puts in an evaluation-mode ``nn.BatchNorm``."""
    eval_stats, b = state.eval_stats, buffers
    if eval_stats not in EVAL_STATS:
        raise ValueError(f"{state.name}: eval_stats must be one of {EVAL_STATS}, got {eval_stats!r}")
    acc = dtype
    gamma, beta = weight.to(acc), bias.to(acc)
    if eval_stats == "amat":
        mean, var = b.amat_mean.to(acc), b.amat_var.to(acc)
    else:
        mean, var = b.running_mean.to(acc), torch.addcmul(b.running_var.to(acc), beta, beta)
        if eval_stats == "auto":
            if state.momentum is None:
                threshold: float | torch.Tensor = (
                    1.0 - b.num_batches_tracked.to(eta.dtype).clamp_min(1.0).reciprocal())
            else:
                threshold = 1.0 - state.momentum  # a Python scalar: no host-to-device copy
            use_amat = eta >= threshold  # compared in the buffer's dtype
            mean = torch.where(use_amat, b.amat_mean.to(acc), mean)
            var = torch.where(use_amat, b.amat_var.to(acc), var)
    scale = gamma / state.rho * torch.rsqrt(var + state.eps)
    return scale, scale * (beta - mean)


def pop_norm(  # the buffers one by one (no AMAT buffers: the call makes throwaway ones)
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    num_batches_tracked: torch.Tensor,
    *,
    training: bool = True,
    spec: POPNormSpec = POPNormSpec(),
    process_group: ProcessGroup | None = None,
    layer: str = "pop_norm",
) -> torch.Tensor:
    """POP-Norm (papers 000/001; SPEC §2): CBN without AMAT and with ``rho = kappa``.

    ``y = (gamma/kappa) * (x - mu_B + beta) / sqrt(mean((x - mu_B + beta)^2) + eps)``;
    evaluation uses the running statistics.
    """
    # No AMAT history: throwaway AMAT buffers (eta = 0 only initialises them).
    like = running_mean
    buffers = CBNBuffers(torch.zeros_like(like), torch.ones_like(like), torch.zeros((), dtype=torch.bool, device=like.device),
                         running_mean, running_var, num_batches_tracked)
    return cbn(x, weight, bias, buffers, training=training, eta=0.0, spec=spec.as_cbn(), process_group=process_group,
               layer=layer)
