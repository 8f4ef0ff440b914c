"""The per-channel steps of a synchronized layer in ATen calls: the reference every kernel
of :mod:`distnorm._kernels` equals, and what runs where none takes the case.

Between its two passes over the input, a layer step does per-channel algebra on vectors of
length C: the AMAT blend, the ratios, the backward coefficients, the buffer updates.

``distnorm::cbn_plan`` (:func:`cbn_plan_composite`)
    The statistics' finalize: from the global ``(mean, var, count)`` to the plan
    ``(center, var_U, invstd, a, grad_coef, beta_coef)``, and the AMAT and running buffers
    updated in place.
``distnorm::backward_sums`` (:func:`backward_sums_composite`)
    The backward's per-channel step, between ATen's reduction and the all-reduce: from the
    local sums ``S1 = sum(g)``, ``T`` and ``grad_coef = [[r_mu, q], [w, n]]``, the sums the
    all-reduce completes already scaled, ``[r_mu S1, q T]`` (``r_mu`` and ``q`` come from
    the global statistics, the same on every rank, so the all-reduce of the scaled local
    sums gives ``shift = r_mu S1`` and ``slope = q T`` of the global batch with no step
    after it), the local parameter gradients ``dgamma = T / rho``, ``dbeta = a (S1 - q d
    T)``, ``w`` and ``n`` (an int32 ``(1,)`` tensor): exactly the arguments of ATen's CUDA
    kernel ``batch_norm_backward_elemt`` (and of its CPU twin, :mod:`distnorm._cpu_kernels`)
    for the element-wise pass ``dx = a (g - shift / n - (x - w) slope / n)``.

``distnorm::bnp_precondition`` (:func:`bnp_precondition`)
    BNP's gradient transform ``(1/q²) P Pᵀ [G_b; G_w]`` of a preconditioned layer's weight
    and bias gradients (paper 004, Eq. 15; SPEC §5). Also the public
    :func:`distnorm.functional.bnp_precondition`.

The helpers (:func:`blend`, :func:`update_running`, :func:`grad_coef_of`) serve batch
normalization's statistics too (:mod:`distnorm._functions`, :mod:`distnorm._traced`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from distnorm._constants import constant
from distnorm._cpu_kernels import check_precondition_arguments

__all__ = ["backward_sums_composite", "blend", "bnp_precondition", "cbn_plan_composite", "grad_coef_of", "to_dtype", "update_running"]


def to_dtype(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """``t`` in ``dtype`` (no op when it already is, or when ``t`` is None)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def grad_coef_of(r_mu: Tensor, q: Tensor, w: Tensor, count: int | Tensor) -> Tensor:
    """``[[r_mu, q], [w, n]]`` as a ``(2, 2, C)`` tensor: the backward's per-channel
    coefficients (:func:`backward_sums_composite`), ``n`` the global count (a host count, at
    least 1, or the device's per-channel count)."""
    if isinstance(count, int):
        count = constant(float(max(count, 1)), q.shape[0], q.dtype, q.device)
    return torch.stack([r_mu, q, w, to_dtype(count, q.dtype)]).view(2, 2, -1)


def blend(buffers: list[Tensor], new: list[Tensor], weight: float | Tensor, valid: bool | Tensor) -> None:
    """``buffer <- lerp(buffer, new, weight)`` for each pair, where the batch was valid.

    ``valid`` is ``True`` when the host knows it; otherwise a bool tensor masks the update
    (an all-empty step changes nothing). Both forms compute the new values with the same
    (multi-tensor) operation, so ranks that take different forms still hold bit-identical
    buffers.
    """
    new = [to_dtype(n, b.dtype) for n, b in zip(new, buffers)]
    if isinstance(weight, Tensor):  # the foreach ops take a scalar weight
        blended = [b.lerp(n, weight) for b, n in zip(buffers, new)]
    elif valid is True:
        torch._foreach_lerp_(buffers, new, weight)
        return
    else:
        blended = torch._foreach_lerp(buffers, new, weight)
    if valid is not True:
        blended = [torch.where(valid, n, b) for b, n in zip(buffers, blended)]
    torch._foreach_copy_(buffers, blended)


def update_running(running_mean: Tensor | None, running_var: Tensor | None, num_batches_tracked: Tensor | None,
                   mean: Tensor, var: Tensor, count: int | Tensor, momentum: float | None,
                   valid: bool | Tensor) -> None:
    """PyTorch's running statistics (unbiased variance, global count), once per step."""
    if num_batches_tracked is not None:
        num_batches_tracked.add_(1 if valid is True else valid[0].to(num_batches_tracked.dtype))
    if running_mean is None or running_var is None:
        return
    if momentum is None:  # cumulative moving average: weight 1 / num_batches_tracked
        assert num_batches_tracked is not None, "cumulative averaging needs num_batches_tracked"
        weight: float | Tensor = num_batches_tracked.to(running_mean.dtype).clamp_min(1.0).reciprocal()
    else:
        weight = momentum
    # Bessel's correction with the global count (where the count is <= 1 the step is
    # masked out, so the inf / NaN it gives there is never used).
    bessel = count / max(count - 1, 1) if isinstance(count, int) else count / (count - 1.0)
    blend([running_mean, running_var], [mean, var * bessel], weight, valid)


def cbn_plan_composite(mean: Tensor, var: Tensor, count: Optional[Tensor], valid: Optional[Tensor], weight: Tensor,
                       bias: Tensor, eta: Optional[Tensor], buffers: Sequence[Tensor], host_count: int,
                       hyper: Sequence[float], momentum: Optional[float], amat_ready: bool,
                       amat_before: Optional[Sequence[Tensor]] = None) -> tuple[Tensor, ...]:
    """CBN's per-channel step (SPEC §1; POP-Norm: ``rho = 1``, ``r_max = 1``), in ATen calls.

    Per channel, with ``mu_B = mean``, ``var(x) = var`` and ``eta`` (given when history blends in)::

        mu_U  = mu_B + eta (mu_A - mu_B)          d = mu_B - mu_U + beta
        var_B = var(x) + d^2                      var_U = var_B + eta (var_A - var_B)
        s = sqrt(var_B + eps)                     s_u = sqrt(var_U + eps)
        r_sig = clamp(s_u / s)                    r_mu = clamp(mu_U / mu_B) where meaningful, else 1

    and the backward's coefficients (:mod:`distnorm._functions`): ``a = gamma / (rho s_u)``,
    ``q = r_sig / s``, ``w = (mu_U - beta) + r_mu d``, ``u = a / n``. The AMAT buffers become
    ``(mu_U, var_U)`` — before their first valid step they are taken to be this batch's
    statistics, so that step is plain CBN — and the running ones blend in ``(mu_B, var(x)
    n / (n - 1))``.

    Args:
        mean, var: the global statistics (:func:`distnorm._moments.global_moments`).
        count: the global count per channel on the device, or ``None`` where the host knows
            it (``host_count``).
        valid: with a device count, the device's mask of a valid batch (more than one value
            per channel; the update is masked), or ``None`` where the host knows it is valid.
        weight, bias: ``gamma`` and ``beta``.
        eta: AMAT's weight on history (0-dim) for a layer with AMAT, which always blends
            history in (``eta = 0`` gives the batch statistics); ``None`` without AMAT.
        buffers: the six CBN buffers (:class:`distnorm._state.CBNBuffers` order), updated
            in place.
        host_count: the count when the host knows it, else -1.
        hyper: ``[eps, rho, r_max]``.
        momentum: the running statistics' (``None``: cumulative average).
        amat_ready: the host saw the AMAT buffers initialised (no device-side check needed).
        amat_before: the values of ``amat_mean``, ``amat_var``, ``amat_initialized`` to blend
            with, when not the buffers themselves: compiled code passes copies
            (:func:`distnorm._traced.cbn_statistics` says why).

    Returns ``(center, var_U, invstd, a, grad_coef, beta_coef)``, all new tensors.
    """
    mu_b, var_x = mean, var
    n: int | Tensor = count if count is not None else host_count
    # A branch on the host count, which in a compiled step may be a symbol (a dynamic batch
    # size): Dynamo guards on the condition, where a comparison alone stays a symbolic bool.
    ok: bool | Tensor
    if count is not None:
        ok = valid if valid is not None else True
    else:
        ok = True if host_count > 1 else False
    eps, rho, r_max = hyper
    acc = mu_b.dtype
    beta = to_dtype(bias, acc)
    if eta is not None:
        amat = buffers[:3] if amat_before is None else amat_before
        mu_u, d, var_u, invstd, q, r_mu, center, w = _with_history(mu_b, var_x, beta, to_dtype(eta, acc), amat,
                                                                   (eps, r_max), amat_ready)
    else:
        # No history (AMAT off, or eta = 0 at learning rates >= 1/omega): mu_U = mu_B,
        # var_U = var_B = var(x) + beta^2, both ratios exactly 1.
        mu_u, d, r_mu = mu_b, beta, constant(1.0, mu_b.shape[0], acc, mu_b.device)
        var_u = torch.addcmul(var_x, beta, beta)
        invstd = q = torch.rsqrt(var_u + eps)
        center = mu_b - beta
        w = mu_b  # (mu_U - beta) + d

    a = invstd * to_dtype(weight, acc)
    if rho != 1.0:
        a.mul_(1.0 / rho)
    grad_coef = grad_coef_of(r_mu, q, w, n)
    beta_coef = q * d
    _update_buffers(buffers, (mu_b, var_x, mu_u, var_u), n, momentum, ok, amat_ready)
    return center, var_u, invstd, a, grad_coef, beta_coef


def _with_history(mu_b: Tensor, var_x: Tensor, beta: Tensor, eta: Tensor, amat: Sequence[Tensor],
                  limits: tuple[float, float], amat_ready: bool) -> tuple[Tensor, ...]:
    """The AMAT blend and the stop-gradient ratios: ``(mu_U, d, var_U, invstd, q, r_mu,
    center, w)`` of :func:`cbn_plan_composite` (``limits``: ``eps`` and ``r_max``)."""
    eps, r_max = limits
    amat_mean, amat_var, amat_initialized = amat
    mu_a, var_a = to_dtype(amat_mean, mu_b.dtype), to_dtype(amat_var, mu_b.dtype)
    if not amat_ready:  # "update, then substitute" starts from this batch
        mu_a = torch.where(amat_initialized, mu_a, mu_b)
        var_a = torch.where(amat_initialized, var_a, torch.addcmul(var_x, beta, beta))
    delta = mu_a - mu_b
    mu_u = torch.addcmul(mu_b, delta, eta)
    d = torch.addcmul(beta, delta, eta, value=-1.0)
    var_b = torch.addcmul(var_x, d, d)
    var_u = torch.lerp(var_b, var_a, eta)
    inv_s, invstd = torch._foreach_rsqrt_(torch._foreach_add([var_b, var_u], eps))
    # Stop-gradient ratios. mu_U / mu_B explodes when the batch mean is near zero (tanh,
    # centred inputs): use it only where both share a sign and |mu_B| > 0.1 sd(x)
    # (mu_B^2 > 0.01 (var + eps)); clamp both. This changes only gradient scales.
    r_sig = torch.div(inv_s, invstd).clamp_(1.0 / r_max, r_max)
    q = r_sig * inv_s
    ratio = mu_u / mu_b
    meaningful = (ratio > 0) & (torch.addcmul(var_x, mu_b, mu_b, value=-100.0) < -eps)
    one = constant(1.0, mu_b.shape[0], mu_b.dtype, mu_b.device)
    r_mu = torch.where(meaningful, ratio.clamp_(1.0 / r_max, r_max), one)
    center = mu_u - beta
    w = torch.addcmul(center, r_mu, d)
    return mu_u, d, var_u, invstd, q, r_mu, center, w


def _update_buffers(buffers: Sequence[Tensor], stats: tuple[Tensor, ...], n: int | Tensor, momentum: Optional[float],
                    valid: bool | Tensor, amat_ready: bool) -> None:
    """AMAT buffers <- ``(mu_U, var_U)``; running statistics <- ``(mu_B, var(x))``, blended
    (``stats``: ``(mu_B, var(x), mu_U, var_U)``); masked where only the device knows the
    batch is valid (same values as the unmasked form)."""
    amat_mean, amat_var, amat_initialized, running_mean, running_var, num_batches_tracked = buffers
    mu_b, var_x, mu_u, var_u = stats
    if valid is True:
        torch._foreach_copy_([amat_mean, amat_var], [mu_u, var_u])
        if not amat_ready:
            amat_initialized.fill_(True)
    else:  # a rank that cannot know whether the global batch was valid: masked, same values
        torch._foreach_copy_([amat_mean, amat_var], [torch.where(valid, mu_u, amat_mean),
                                                     torch.where(valid, var_u, amat_var)])
        amat_initialized.logical_or_(valid[0])
    update_running(running_mean, running_var, num_batches_tracked, mu_b, var_x, n, momentum, valid)


def backward_sums_composite(s1: Tensor, t: Tensor, beta_coef: Tensor, grad_scale: Tensor, grad_coef: Tensor,
                            inv_rho: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(sums, dgamma, dbeta, w, count)`` from the local sums ``S1 = sum(g)``, ``T`` and
    ``grad_coef = [[r_mu, q], [w, n]]``:

    * ``sums = [r_mu S1, q T]``, the local sums scaled for the element-wise pass: their
      all-reduce gives its ``shift`` and ``slope`` (``r_mu`` and ``q`` are the global
      statistics', the same on every rank; the sum of the scaled local sums equals the
      scaled global sum up to rounding, and every rank gets the same bits from the
      collective);
    * ``dgamma = T / rho`` and SPEC §1.1's ``dbeta = a (S1 - q d T)`` with the local/global
      roles exchanged — ``c_local * sum_global(x1)`` instead of ``c_global *
      sum_local(x1)``: both are linear in the local sums and agree after the data-parallel
      average, and this form needs no collective;
    * ``w`` and ``count = [n]`` (int32), the element-wise pass's center and count: copies,
      so that the pass reads its arguments without a view op per step.
    """
    sums = grad_coef[0] * torch.stack([s1, t])
    grad_bias = torch.addcmul(s1, beta_coef, t, value=-1.0).mul_(grad_scale)
    # outputs of an operator may not share storage with its inputs
    return sums, t * inv_rho, grad_bias, grad_coef[1, 0].clone(), grad_coef[1, 1, :1].to(torch.int32)


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
    check_precondition_arguments(grad_weight, grad_bias, mean, var_t, groups)
    out_channels = grad_weight.shape[0]
    compute = torch.promote_types(grad_weight.dtype, torch.float32)
    per_group = mean.numel() // groups
    shape = (out_channels, per_group) + (1,) * (grad_weight.dim() - 2)
    mu, vt = mean.to(compute), var_t.to(compute)
    if groups > 1:  # row d of the per-(output, input-channel) statistics: its group's channels
        mu = mu.view(groups, per_group).repeat_interleave(out_channels // groups, dim=0)
        vt = vt.view(groups, per_group).repeat_interleave(out_channels // groups, dim=0)
    else:
        mu, vt = mu.view(1, -1), vt.view(1, -1)
    denominator = (vt * q2).view((-1,) + shape[1:]) if groups > 1 else (vt * q2).view((1,) + shape[1:])
    gw = to_dtype(grad_weight, compute)
    if grad_bias is None:
        return (gw / denominator).to(grad_weight.dtype), None
    gb = to_dtype(grad_bias, compute)
    # Weight-sized work: one new tensor, updated in place (keeps the transient memory of the
    # backward at one extra weight gradient per layer).
    new_w = torch.addcmul(gw, mu.view((mu.shape[0],) + shape[1:]), gb.view((-1,) + (1,) * (gw.dim() - 1)), value=-1.0)
    new_w.div_(denominator)
    # sum_{p, kernel} mu[p] * new_w[d, p, kernel]: reduce the kernel first, then a row dot.
    per_channel = new_w.sum(dim=tuple(range(2, gw.dim()))) if gw.dim() > 2 else new_w
    new_b = torch.addcdiv(-(per_channel * mu).sum(1), gb, q2) if isinstance(q2, torch.Tensor) else gb / q2 - (per_channel * mu).sum(1)
    return new_w.to(grad_weight.dtype), new_b.to(grad_bias.dtype)
