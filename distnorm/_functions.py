"""Private autograd Functions: one per mathematics, with hand-written backward passes.

* :class:`SyncBatchNormFunction` — batch normalization with statistics over every rank
  (SPEC §3), the mathematics of ``torch.nn.BatchNorm*`` on the concatenated global batch.
* :class:`CompleteNormFunction` — CBN with AMAT (SPEC §1) and, with ``amat=False`` and
  ``rho=kappa``, POP-Norm (SPEC §2).
* :class:`BNPGradientFunction` — BNP's gradient preconditioner (SPEC §5); it has no
  collective of its own (the statistics it uses are all-reduced in the layer's forward).

The two normalization Functions share one plan:
chosen so that each layer issues exactly one collective in the forward and one in the
backward, and saves only its input plus per-channel vectors:

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

__all__ = ["BNPGradientFunction", "bnp_precondition", "CompleteNormFunction", "SyncBatchNormFunction", "channel_affine"]


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
        stats_out: dict | None = None,
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

        if stats_out is not None:  # theory monitors (distnorm.monitors); None on the hot path
            stats_out.update(mean=mu_b.detach().clone(), sigma=s.detach().clone(), amat_mean=mu_u.detach().clone())
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
        return (grad_x, grad_gamma, grad_beta) + (None,) * 14


class BNPGradientFunction(torch.autograd.Function):
    """Identity on ``(weight, bias)`` in the forward; BNP's preconditioner in the backward.

    The layer computes its output from the *returned* aliases, so the gradients that reach
    this Function are the layer's plain ``(G_w, G_b)`` for this backward pass; it returns
    ``(1/q²) P Pᵀ [G_b; G_w]`` (see :func:`bnp_precondition`), which
    autograd accumulates into ``weight.grad`` / ``bias.grad``. Every optimizer and engine
    therefore sees the preconditioned gradient, and nothing runs at ``optimizer.step()``.

    The map is linear and built from rank-consistent statistics, so applying it on each
    rank before the data-parallel average (as here) equals applying it after.
    """

    @staticmethod
    def forward(
        ctx: Any,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        mean: torch.Tensor,
        var_t: torch.Tensor,
        q2: torch.Tensor,
        groups: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx.save_for_backward(mean, var_t, q2)
        ctx.groups = groups
        return weight.view_as(weight), (bias.view_as(bias) if bias is not None else None)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_weight: torch.Tensor, grad_bias: torch.Tensor | None) -> tuple[Any, ...]:
        mean, var_t, q2 = ctx.saved_tensors
        if grad_weight is None:
            return None, grad_bias, None, None, None, None
        if ctx.needs_input_grad[1] and grad_bias is None:
            grad_bias = torch.zeros(grad_weight.shape[0], dtype=grad_weight.dtype, device=grad_weight.device)
        new_weight, new_bias = bnp_precondition(grad_weight, grad_bias, mean, var_t, q2, groups=ctx.groups)
        return new_weight, new_bias, None, None, None, None


def bnp_precondition(
    grad_weight: torch.Tensor,
    grad_bias: torch.Tensor | None,
    mean: torch.Tensor,
    var_t: torch.Tensor,
    q2: torch.Tensor | float,
    *,
    groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """BNP's gradient transform ``(1/q²) P Pᵀ [G_b; G_w]`` (paper 004, Eq. 15; SPEC §5).

    With ``P = [[1, -mu^T], [0, I]] · diag(1, 1/sqrt(var_t))``, per output channel ``d`` and
    input channel ``p`` of its group (kernel positions share their channel's statistics)::

        G_w[d, p, ...] <- (G_w[d, p, ...] - mu[p] * G_b[d]) / (q2 * var_t[p])
        G_b[d]         <- G_b[d] / q2 - sum_{p, ...} mu[p] * G_w_new[d, p, ...]

    Without a bias only the scaling ``G_w / (q2 * var_t)`` applies.

    Args:
        grad_weight: ``(C_out, C_in / groups, *kernel)`` (conv) or ``(out, in)`` (dense).
        grad_bias: ``(C_out,)`` or ``None``.
        mean, var_t: per-input-channel moments, length ``C_in`` (``var_t`` already
            regularised: ``var + eps1 * max(var) + eps2``).
        q2: the block-norm scale ``q²`` (0-dim tensor or float).
        groups: convolution groups; output channel ``d`` sees input channels of group
            ``d // (C_out / groups)`` (depthwise: ``groups = C_in``).

    Returns:
        The preconditioned ``(grad_weight, grad_bias)`` in their original dtypes.
    """
    out_channels = grad_weight.shape[0]
    compute = torch.promote_types(grad_weight.dtype, torch.float32)
    per_group = mean.numel() // groups
    if grad_weight.dim() < 2 or grad_weight.shape[1] != per_group or out_channels % groups:
        raise ValueError(
            f"bnp_precondition: weight gradient of shape {tuple(grad_weight.shape)} does not match "
            f"{mean.numel()} input channels in {groups} group(s)"
        )
    shape = (out_channels, per_group) + (1,) * (grad_weight.dim() - 2)
    # Row d of the per-(output, input-channel) statistics is its group's input channels.
    mu = mean.to(compute).view(groups, per_group).repeat_interleave(out_channels // groups, dim=0)
    vt = var_t.to(compute).view(groups, per_group).repeat_interleave(out_channels // groups, dim=0)
    q2 = torch.as_tensor(q2, dtype=compute, device=grad_weight.device)
    gw = grad_weight.to(compute)
    if grad_bias is None:
        return (gw / (q2 * vt).view(shape)).to(grad_weight.dtype), None
    gb = grad_bias.to(compute)
    # Weight-sized work: one new tensor, updated in place (keeps the transient memory of the
    # backward at one extra weight gradient per layer).
    new_w = torch.addcmul(gw, mu.view(shape), gb.view((-1,) + (1,) * (gw.dim() - 1)), value=-1.0)
    new_w.div_((q2 * vt).view(shape))
    # sum_{p, kernel} mu[p] * new_w[d, p, kernel]: reduce the kernel first, then a row dot.
    per_channel = new_w.sum(dim=tuple(range(2, gw.dim()))) if gw.dim() > 2 else new_w
    new_b = gb / q2 - torch.einsum("dp,dp->d", per_channel, mu)
    return new_w.to(grad_weight.dtype), new_b.to(grad_bias.dtype)
