"""Private autograd Functions: one per mathematics, with hand-written backward passes.

* :class:`SyncBatchNormFunction` — batch normalization with statistics over every rank
  (SPEC §3), the mathematics of ``torch.nn.BatchNorm*`` on the concatenated global batch.
* :class:`CompleteNormFunction` — CBN with AMAT (SPEC §1) and, with ``amat=False`` and
  ``rho=kappa``, POP-Norm (SPEC §2).

Both follow the same plan, chosen so that each layer issues exactly one collective in the
forward and one in the backward, and saves only its input plus per-channel vectors:

forward
    1. ``global_moments``: one all-reduce of per-channel sums and a float64 count.
    2. Per-channel algebra in float64 (a handful of length-C vectors).
    3. The output is ATen's fused inference batch-norm kernel applied with the statistics
       from step 2, i.e. ``(x - m) / sqrt(v + eps) * w + b`` for per-channel ``m, v, w, b``.
       It handles every rank (2-D to 5-D), channels_last, and fp16/bf16 inputs with float32
       statistics, on CPU and CUDA alike.
    4. Buffer updates from the all-reduced statistics, on device, without host syncs.

backward
    1. ATen's fused inference batch-norm backward computes the two local per-channel sums
       ``sum(g)`` and ``sum(g * (x - m)) / sqrt(v + eps)`` in one pass.
    2. One all-reduce of those ``2C`` sums, only if the input needs a gradient (parameter
       gradients stay local: the data-parallel engine averages them, as for
       ``torch.nn.SyncBatchNorm``).
    3. ``dx = A * g + B * x + D`` with per-channel ``A, B, D``, in two fused passes.

Buffers (running / AMAT statistics) are updated only where the global batch has more than
one value per channel, via ``lerp`` with an on-device weight, so an all-empty step leaves
them untouched without a host-side branch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from distnorm import _collectives
from distnorm._collectives import ProcessGroup, accumulate_dtype

__all__ = ["CompleteNormFunction", "SyncBatchNormFunction", "channel_affine"]


def _channel_view(v: torch.Tensor, ndim: int) -> torch.Tensor:
    return v.view([1, -1] + [1] * (ndim - 2))


def channel_affine(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``scale[c] * x + shift[c]`` per channel, in ``x``'s dtype and memory format.

    Implemented with the inference batch-norm kernel (mean 0, variance 1, eps 0, so its
    ``1/sqrt(var + eps)`` is exactly 1): one fused pass that computes in float32 for
    fp16/bf16 inputs. ``scale``/``shift`` are in the accumulation dtype of ``x``.
    """
    zeros = torch.zeros_like(scale)
    ones = torch.ones_like(scale)
    return torch.batch_norm(x, scale, shift, zeros, ones, False, 0.0, 0.0, False)


def _local_grad_sums(
    grad_out: torch.Tensor, x: torch.Tensor, center: torch.Tensor, var: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local per-channel ``(sum(g), sum(g * (x - center)) / sqrt(var + eps))``, one pass.

    ATen's batch-norm backward in inference mode returns exactly these as its bias and
    weight gradients (without a weight, and without computing an input gradient).
    """
    _, sum_g_xhat, sum_g = torch.ops.aten.native_batch_norm_backward(
        grad_out, x, None, center, var, None, None, False, eps, [False, True, True]
    )
    return sum_g.double(), sum_g_xhat.double()


def _update_running_stats(
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    moments: _collectives.Moments,
    momentum: float | None,
    valid: torch.Tensor,
) -> None:
    """PyTorch's running statistics (unbiased variance, global count) from ``moments``.

    ``momentum=None`` is PyTorch's cumulative moving average (factor ``1/num_batches``).
    ``valid`` (float64 0/1) masks out steps whose global batch had at most one value.
    """
    if num_batches_tracked is not None:
        num_batches_tracked.add_(valid.to(num_batches_tracked.dtype))
    if running_mean is None or running_var is None:
        return
    if momentum is None:
        assert num_batches_tracked is not None, "cumulative averaging needs num_batches_tracked"
        factor = valid / num_batches_tracked.double().clamp_min(1.0)
    else:
        factor = valid * momentum
    count = moments.count
    unbiased_var = moments.var * count / (count - 1.0).clamp_min(1.0)
    running_mean.lerp_(moments.mean.to(running_mean.dtype), factor.to(running_mean.dtype))
    running_var.lerp_(unbiased_var.to(running_var.dtype), factor.to(running_var.dtype))


class SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalization over the global batch of all ranks in ``group``.

    Forward::

        mu, var = global mean and biased variance of x        (one all-reduce)
        y = (x - mu) / sqrt(var + eps) * weight + bias

    Backward (``n`` global count, ``xhat = (x - mu) * invstd``)::

        dweight = sum_local(g * xhat), dbias = sum_local(g)   (DDP averages them)
        dx = weight * invstd * (g - S1/n - xhat * S2/n)       S1, S2: global sums of g, g*xhat
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        num_batches_tracked: torch.Tensor | None,
        momentum: float | None,
        eps: float,
        group: ProcessGroup | None,
        layer: str,
    ) -> torch.Tensor:
        acc = accumulate_dtype(x)
        moments = _collectives.global_moments(x, group, layer=layer)
        mean = moments.mean.to(acc)
        var = moments.var.to(acc)
        w = weight.to(acc) if weight is not None else None
        b = bias.to(acc) if bias is not None else None
        y = torch.batch_norm(x, w, b, mean, var, False, 0.0, eps, torch.backends.cudnn.enabled)

        valid = (moments.count > 1).double()
        _update_running_stats(running_mean, running_var, num_batches_tracked, moments, momentum, valid)

        ctx.save_for_backward(x, weight, mean, var, moments.count)
        ctx.eps = eps
        ctx.group = group
        ctx.layer = layer
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, var, count = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        channels = x.shape[1]
        acc = mean.dtype
        if x.numel() > 0:
            sum_g, sum_g_xhat = _local_grad_sums(grad_out, x, mean, var, ctx.eps)
        else:  # an empty rank contributes nothing but still joins the collective below
            sum_g = torch.zeros(channels, dtype=torch.float64, device=x.device)
            sum_g_xhat = torch.zeros_like(sum_g)

        grad_x = None
        if need_x:
            # The statistics depend on every rank's samples, so the input gradient needs the
            # global sums. Parameter gradients do not: they stay local and the data-parallel
            # engine averages them, exactly as for torch.nn.SyncBatchNorm.
            sums = torch.cat([sum_g, sum_g_xhat])
            _collectives.all_reduce_sum(sums, ctx.group, slot=f"{ctx.layer}|backward|C={channels}|{x.dtype}")
            n = count.clamp_min(1.0)
            invstd = torch.rsqrt(var.double() + ctx.eps)
            w = weight.double() if weight is not None else torch.ones_like(invstd)
            a = w * invstd
            b = -a * invstd * sums[channels:] / n
            d = -a * sums[:channels] / n - b * mean.double()
            if x.numel() > 0:
                grad_x = channel_affine(x, b.to(acc), d.to(acc))
                grad_x.addcmul_(grad_out, _channel_view(a.to(grad_x.dtype), x.dim()))
            else:
                grad_x = torch.empty_like(x)

        grad_w = sum_g_xhat.to(weight.dtype) if need_w else None
        grad_b = sum_g.to(weight.dtype if weight is not None else acc) if need_b else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


class CompleteNormFunction(torch.autograd.Function):
    """Complete batch normalization (CBN) with AMAT; POP-Norm when ``amat=False``.

    Forward, per channel (SPEC §1; ``n`` global count, statistics over every rank)::

        mu_B  = mean(x)                         var_x = biased variance of x
        mu_U  = eta * mu_A + (1 - eta) * mu_B   (mu_U = mu_B without AMAT)
        x1    = x - mu_U + beta                 d = mean(x1) = mu_B - mu_U + beta
        var_B = mean(x1^2) = var_x + d^2        s = sqrt(var_B + eps)
        var_U = eta * var_A + (1 - eta) * var_B s_u = sqrt(var_U + eps)
        y     = (gamma / rho) * x1 / s_u

    Gradients flow through the *batch* statistics scaled by the constant (stop-gradient)
    ratios ``r_mu ~ mu_U / mu_B`` and ``r_sig ~ s_u / s`` (guarded, clamped to
    ``[1/r_max, r_max]``; exactly 1 without AMAT or when ``eta = 0``). With
    ``a = gamma / (rho * s_u)``, ``S1 = sum(g)``, ``S2 = sum(g * x1)`` (SPEC §1.1)::

        c        = r_sig * S2 / (n * s_u * s)
        dx       = a * (g - c * x1 - (r_mu / n) * (S1 - c * n * d))      global S1, S2
        dgamma   = S2_local / (rho * s_u)
        dbeta    = a * (S1_local - r_sig * d * S2_local / (s_u * s))

    ``dbeta`` is SPEC's ``a * (S1_local - c * sum_local(x1))`` with the roles of the local
    and global factors exchanged: ``c_local * sum_global(x1)`` instead of
    ``c_global * sum_local(x1)``. Both are linear in the local sums and agree after the
    data-parallel average (their sums over ranks are equal), and this form needs no
    collective, so parameter gradients never wait for the network. With one process the two
    are identical.

    The AMAT buffers are initialised from the first valid batch (``mu_A = mu_B``,
    ``var_A = var_x + beta^2``), so that step is plain complete batch normalization.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        amat_mean: torch.Tensor,
        amat_var: torch.Tensor,
        amat_initialized: torch.Tensor,
        running_mean: torch.Tensor,
        running_var: torch.Tensor,
        num_batches_tracked: torch.Tensor,
        eta: float,
        rho: float,
        eps: float,
        momentum: float | None,
        r_max: float,
        group: ProcessGroup | None,
        layer: str,
    ) -> torch.Tensor:
        acc = accumulate_dtype(x)
        moments = _collectives.global_moments(x, group, layer=layer)
        mu_b, var_x = moments.mean, moments.var
        beta = bias.double()
        gamma = weight.double()

        if eta > 0.0:
            # AMAT, "update, then substitute" (SPEC §1 Decisions): fold this batch into the
            # averages, then normalize with them. Before initialisation the averages are
            # taken to be this batch's statistics, so the first step is plain CBN.
            initialized = amat_initialized.bool()
            mu_a = torch.where(initialized, amat_mean.double(), mu_b)
            mu_u = torch.lerp(mu_b, mu_a, eta)
            d = mu_b - mu_u + beta
            var_b = torch.addcmul(var_x, d, d)
            var_a = torch.where(initialized, amat_var.double(), torch.addcmul(var_x, beta, beta))
            var_u = torch.lerp(var_b, var_a, eta)
            s = torch.sqrt(var_b + eps)
            s_u = torch.sqrt(var_u + eps)
            # Stop-gradient ratios. mu_U / mu_B explodes when the batch mean is near zero
            # (tanh, centred inputs): use it only where both have the same sign and the mean
            # is at least a tenth of a standard deviation; clamp both. Guarding changes only
            # the gradient scale, never the forward value.
            meaningful = (mu_u * mu_b > 0) & (mu_b.abs() > 0.1 * torch.sqrt(var_x + eps))
            r_mu = torch.where(meaningful, mu_u / torch.where(meaningful, mu_b, 1.0), 1.0)
            r_mu = r_mu.clamp(1.0 / r_max, r_max)
            r_sig = (s_u / s).clamp(1.0 / r_max, r_max)
        else:
            # No history (AMAT off, or eta = 0 at learning rates >= 1/omega): mu_U = mu_B,
            # var_U = var_B, both ratios are exactly 1.
            mu_u = mu_b
            d = beta
            var_b = var_u = torch.addcmul(var_x, beta, beta)
            s = s_u = torch.sqrt(var_b + eps)
            r_mu = r_sig = torch.ones_like(s)

        center = (mu_u - beta).to(acc)  # x - center == x1
        var_used = var_u.to(acc)
        scale = (gamma / rho).to(acc)
        y = torch.batch_norm(x, scale, None, center, var_used, False, 0.0, eps, torch.backends.cudnn.enabled)

        valid = (moments.count > 1).double()
        amat_mean.lerp_(mu_u.to(amat_mean.dtype), valid.to(amat_mean.dtype))
        amat_var.lerp_(var_u.to(amat_var.dtype), valid.to(amat_var.dtype))
        amat_initialized.logical_or_(valid.bool())
        _update_running_stats(running_mean, running_var, num_batches_tracked, moments, momentum, valid)

        a = gamma / (rho * s_u)
        ctx.save_for_backward(x, center, var_used, moments.count, a, s_u, s, d, r_mu, r_sig, mu_u - beta)
        ctx.rho = rho
        ctx.eps = eps
        ctx.group = group
        ctx.layer = layer
        ctx.param_dtype = weight.dtype
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, center, var_used, count, a, s_u, s, d, r_mu, r_sig, center64 = ctx.saved_tensors
        need_x, need_gamma, need_beta = ctx.needs_input_grad[:3]
        channels = x.shape[1]
        if x.numel() > 0:
            # sum(g) and sum(g * x1) / s_u in one fused pass.
            sum_g, sum_g_x1_su = _local_grad_sums(grad_out, x, center, var_used, ctx.eps)
        else:
            sum_g = torch.zeros(channels, dtype=torch.float64, device=x.device)
            sum_g_x1_su = torch.zeros_like(sum_g)

        grad_gamma = (sum_g_x1_su / ctx.rho).to(ctx.param_dtype) if need_gamma else None
        grad_beta = None
        if need_beta:
            # Local form, no collective needed (see the class docstring).
            grad_beta = (a * (sum_g - (r_sig * d / s) * sum_g_x1_su)).to(ctx.param_dtype)

        grad_x = None
        if need_x:
            sums = torch.cat([sum_g, sum_g_x1_su])
            _collectives.all_reduce_sum(sums, ctx.group, slot=f"{ctx.layer}|backward|C={channels}|{x.dtype}")
            n = count.clamp_min(1.0)
            s1 = sums[:channels]
            c = r_sig * sums[channels:] / (n * s)  # = r_sig * S2 / (n * s_u * s)
            # dx = a*g - a*c*(x - center) - a*(r_mu/n)*(S1 - c*n*d)  ==  A*g + B*x + D
            b = -a * c
            d_term = a * c * center64 - a * (r_mu / n) * (s1 - c * n * d)
            if x.numel() > 0:
                acc = center.dtype
                grad_x = channel_affine(x, b.to(acc), d_term.to(acc))
                grad_x.addcmul_(grad_out, _channel_view(a.to(grad_x.dtype), x.dim()))
            else:
                grad_x = torch.empty_like(x)
        return (grad_x, grad_gamma, grad_beta) + (None,) * 13
