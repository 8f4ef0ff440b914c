"""Stateless functional forms of distnorm's layers.

Like ``torch.nn.functional.batch_norm``, these take the parameters and buffers as
arguments and update the buffers in place when ``training`` is true. The modules in
:mod:`distnorm.layers` own the state and share the same mathematics
(:mod:`distnorm._functions`); they also know, on the host, facts these functions must
recompute (whether AMAT is initialised), and keep the statistics activation checkpointing
needs — use the modules for training.

Synchronization: pass ``process_group`` (``None`` = default group). The functions reduce
over it only when ``torch.distributed`` is initialised and the group has more than one
rank; ``sync=False`` forces local statistics.
"""

from __future__ import annotations


import torch

from distnorm import _collectives, _ops
from distnorm._collectives import ProcessGroup
from distnorm._autograd import NormalizeFunction
from distnorm._bnp_functions import bnp_precondition
from distnorm._functions import CBNBuffers, NormState, channel_affine
from distnorm._ops import no_grad_input
from distnorm.specs import EPS, EVAL_STATS, MOMENTUM, CBNSpec, POPNormSpec  # EVAL_STATS: CBN's eval_stats values (SPEC §1)

__all__ = ["CBNBuffers", "amat_eta", "bnp_precondition", "cbn", "cbn_inference", "pop_norm", "sync_batch_norm"]


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


def _check_local_batch(x: torch.Tensor, layer: str) -> None:
    # Without synchronization the batch is all there is: one value per channel has no
    # variance (PyTorch raises the same error).
    if x.numel() // x.shape[1] <= 1:
        raise ValueError(
            f"{layer}: expected more than 1 value per channel when training, got input of "
            f"shape {tuple(x.shape)}; increase the batch size or put the model in eval() mode"
        )


def normalize(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
              state: NormState, statistics) -> torch.Tensor:
    """The training path shared by modules and functions: statistics, then normalization."""
    if state.group() is None:
        _check_local_batch(x, state.name)
    plan = statistics(no_grad_input(x))
    return NormalizeFunction.apply(x, weight, bias, *plan, state)


def sync_batch_norm(
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
    state: NormState | None = None,
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
    expected = weight if weight is not None else running_mean
    _check_input(x, expected.shape[0] if expected is not None else x.shape[1], layer)
    if not training:
        # PyTorch's semantics: running statistics, or this batch's when none are tracked.
        use_batch = running_mean is None or running_var is None
        return torch.batch_norm(x, weight, bias, running_mean, running_var, use_batch, 0.0, eps, False)
    if state is None:
        state = NormState("bn", layer, eps, momentum, process_group=process_group, sync=sync)
    stats = lambda xd: _ops.bn_statistics(  # noqa: E731
        xd, no_grad_input(weight), running_mean, running_var, num_batches_tracked, state)
    return normalize(x, weight, bias, state, stats)


def cbn(
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
    _check_input(x, weight.shape[0], layer)
    b = buffers
    # No host sync: torch.tensor(eta, device="cuda") would copy from the host and wait for
    # it; torch.full launches a fill kernel. A tensor eta may be 0 or not, which the host
    # cannot know without reading it, so it takes the history path, which for eta = 0
    # computes the no-history values.
    eta_given = isinstance(eta, torch.Tensor)
    eta_t = eta if eta_given else torch.full((), float(eta), dtype=b.amat_mean.dtype, device=x.device)
    if not training:
        return cbn_inference(x, weight, bias, b.amat_mean, b.amat_var, eta_t, b.running_mean, b.running_var,
                             b.num_batches_tracked, rho=spec.rho, eps=spec.eps, momentum=spec.momentum,
                             eval_stats=spec.resolved_eval_stats, layer=layer)
    history = True if eta_given else float(eta) > 0
    state = NormState("cbn", layer, spec.eps, spec.momentum, rho=float(spec.rho), r_max=float(spec.r_max),
                      process_group=process_group, sync=spec.sync, history=history)
    stats = lambda xd: _ops.cbn_statistics(xd, no_grad_input(weight), no_grad_input(bias), b, eta_t, state)  # noqa: E731
    return normalize(x, weight, bias, state, stats)


def cbn_inference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    amat_mean: torch.Tensor,
    amat_var: torch.Tensor,
    amat_eta: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    num_batches_tracked: torch.Tensor,
    *,
    rho: float,
    eps: float,
    momentum: float | None,
    eval_stats: str,
    layer: str = "cbn",
) -> torch.Tensor:
    """CBN at evaluation: a per-channel affine map, differentiable in x, gamma and beta.

    ``"amat"``: ``(gamma/rho) (x - mu_A + beta) / sqrt(var_A + eps)``; ``"running"``:
    ``(gamma/rho) (x - running_mean + beta) / sqrt(running_var + beta^2 + eps)`` (for a
    centred ``x``, ``E[(x - mu + beta)^2] = var + beta^2``); ``"auto"``: the AMAT
    statistics once they average at least as much history as the running ones — the last
    training step had ``eta >= 1 - momentum`` (``1 - 1/num_batches_tracked`` for the
    cumulative average) — else the running ones. The choice reads ``amat_eta``, a buffer,
    so a model reloaded from a checkpoint evaluates as it did before saving.
    """
    if eval_stats not in EVAL_STATS:
        raise ValueError(f"{layer}: eval_stats must be one of {EVAL_STATS}, got {eval_stats!r}")
    acc = _collectives.accumulate_dtype(x)
    gamma, beta = weight.to(acc), bias.to(acc)
    if eval_stats == "amat":
        mean, var = amat_mean.to(acc), amat_var.to(acc)
    else:
        mean, var = running_mean.to(acc), torch.addcmul(running_var.to(acc), beta, beta)
        if eval_stats == "auto":
            if momentum is None:
                threshold: float | torch.Tensor = 1.0 - num_batches_tracked.to(amat_eta.dtype).clamp_min(1.0).reciprocal()
            else:
                threshold = 1.0 - momentum  # a Python scalar: no host-to-device copy
            use_amat = amat_eta >= threshold  # compared in the buffer's dtype
            mean = torch.where(use_amat, amat_mean.to(acc), mean)
            var = torch.where(use_amat, amat_var.to(acc), var)
    scale = gamma / rho * torch.rsqrt(var + eps)
    return channel_affine(x, scale, scale * (beta - mean))


def pop_norm(
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
