"""The per-channel steps of a CBN / POP-Norm training step, one operator each.

Between its two passes over the input, a layer step does per-channel algebra on vectors of
length C: the AMAT blend, the ratios, the backward coefficients, the buffer updates. Written
as ATen calls that is some thirty small kernels per layer per step; on a GPU each is a launch
the host pays for, more than the arithmetic. So each step is one custom operator:

``distnorm::cbn_plan``
    The statistics' finalize: from the global ``(mean, var, count)`` to the plan
    ``(center, var_U, invstd, a, grad_coef, beta_coef)``, and the AMAT and running buffers
    updated in place (see :func:`cbn_plan_composite` for the maths).
``distnorm::cbn_param_grads``
    The backward's local step: ``sums = [S1, T]`` for the all-reduce, and the local
    parameter gradients ``dgamma = T / rho``, ``dbeta = a (S1 - q d T)``.
``distnorm::shift_slope``
    The backward's global step: ``[D, B] = grad_coef @ sums``, per channel.

Each operator has one kernel per device, like an ATen op: the ATen composite below on every
device (the reference, and the kernel on the CPU), and on CUDA one Triton kernel
(:mod:`distnorm._triton`) where the case is supported — float32 accumulation, buffers of
that dtype, a host count only when the batch is valid — the composite elsewhere.
``DISTNORM_TRITON=0`` selects the composite on CUDA too. The op counter of the tests
(``tests/dispatch.py``) sees each operator as one op, which is what a GPU launches; the
Triton kernels are checked against the composite by ``tests/test_fused.py`` through
Triton's interpreter. Under ``torch.compile`` the operators have fake kernels, so a graph
can hold them.

The helpers below (:func:`blend`, :func:`update_running`, :func:`grad_coef_of`,
:func:`neg_inverse_count`) are shared with batch normalization's statistics in
:mod:`distnorm._functions`.
"""

from __future__ import annotations

import functools
import os
import warnings
from types import ModuleType
from typing import Callable, Optional

import torch
from torch import Tensor

from distnorm._collectives import constant

__all__ = ["blend", "cbn_param_grads", "cbn_plan", "cbn_plan_composite", "grad_coef_of", "neg_inverse_count",
           "shift_slope", "to_dtype", "triton_enabled", "update_running"]


# ------------------------------------------------------------------------- helpers
def to_dtype(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """``t`` in ``dtype`` (no op when it already is, or when ``t`` is None)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def grad_coef_of(u_neg: Tensor, q: Tensor, r_mu: Tensor, w: Tensor) -> Tensor:
    """``[[kD1, kD2], [0, kB]] = -u * [[r_mu, -q w], [0, q]]`` as a ``(2, 2, C)`` tensor."""
    zero = constant(0.0, q.shape[0], q.dtype, q.device)
    qw_neg = torch.addcmul(zero, q, w, value=-1.0)
    return torch.stack([r_mu, qw_neg, zero, q]).mul_(u_neg).view(2, 2, -1)


def neg_inverse_count(a: Tensor, count: int | Tensor) -> Tensor:
    """``-a / n`` with a host count (one op) or a device count."""
    if isinstance(count, int):
        return a * (-1.0 / max(count, 1))
    return torch.div(a, count).neg_()


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


# ------------------------------------------------------------------ distnorm::cbn_plan
def cbn_plan_composite(mean: Tensor, var: Tensor, count: Optional[Tensor], host_count: int, valid_known: bool,
                       weight: Tensor, bias: Tensor, eta: Tensor, amat_mean: Tensor, amat_var: Tensor,
                       amat_initialized: Tensor, running_mean: Tensor, running_var: Tensor,
                       num_batches_tracked: Tensor, eps: float, momentum: Optional[float], rho: float,
                       r_max: float, history: bool, amat_ready: bool,
                       sink: dict | None = None) -> tuple[Tensor, ...]:
    """CBN's per-channel step (SPEC §1; POP-Norm: ``rho = 1``, ``r_max = 1``), in ATen calls.

    Per channel, with ``mu_B = mean``, ``var(x) = var`` and ``eta`` (``history``: eta > 0)::

        mu_U  = mu_B + eta (mu_A - mu_B)          d = mu_B - mu_U + beta
        var_B = var(x) + d^2                      var_U = var_B + eta (var_A - var_B)
        s = sqrt(var_B + eps)                     s_u = sqrt(var_U + eps)
        r_sig = clamp(s_u / s)                    r_mu = clamp(mu_U / mu_B) where meaningful, else 1

    and the backward's coefficients (:mod:`distnorm._functions`): ``a = gamma / (rho s_u)``,
    ``q = r_sig / s``, ``w = (mu_U - beta) + r_mu d``, ``u = a / n``. The AMAT buffers become
    ``(mu_U, var_U)`` — before their first valid step they are taken to be this batch's
    statistics, so that step is plain CBN — and the running ones blend in ``(mu_B, var(x)
    n / (n - 1))``.

    The count is ``count`` (a device tensor, synchronized layers) or ``host_count``; the
    step is valid (buffers updated) when it exceeds 1: known on the host when
    ``valid_known`` or for a host count, else masked on the device.

    Returns ``(center, var_U, invstd, a, grad_coef, beta_coef)``, all new tensors. ``sink``
    (the theory monitors', :mod:`distnorm.monitors`) receives the batch's ``mean``,
    ``sigma = sqrt(var_B + eps)`` and ``amat_mean = mu_U``.
    """
    n: int | Tensor = host_count if count is None else count
    valid: bool | Tensor = host_count > 1 if count is None else (True if valid_known else count > 1)
    acc = mean.dtype
    channels = mean.shape[0]
    mu_b, var_x = mean, var
    beta = to_dtype(bias, acc)
    one = constant(1.0, channels, acc, mean.device)

    if history:
        eta_acc = to_dtype(eta, acc)
        mu_a, var_a = to_dtype(amat_mean, acc), to_dtype(amat_var, acc)
        if not amat_ready:  # "update, then substitute" starts from this batch
            mu_a = torch.where(amat_initialized, mu_a, mu_b)
            var_a = torch.where(amat_initialized, var_a, torch.addcmul(var_x, beta, beta))
        delta = mu_a - mu_b
        mu_u = torch.addcmul(mu_b, delta, eta_acc)
        d = torch.addcmul(beta, delta, eta_acc, value=-1.0)
        var_b = torch.addcmul(var_x, d, d)
        var_u = torch.lerp(var_b, var_a, eta_acc)
        inv_s, invstd = torch._foreach_rsqrt_(torch._foreach_add([var_b, var_u], eps))
        # Stop-gradient ratios. mu_U / mu_B explodes when the batch mean is near zero (tanh,
        # centred inputs): use it only where both share a sign and |mu_B| > 0.1 sd(x)
        # (mu_B^2 > 0.01 (var + eps)); clamp both. This changes only gradient scales.
        r_sig = torch.div(inv_s, invstd).clamp_(1.0 / r_max, r_max)
        q = r_sig * inv_s
        ratio = mu_u / mu_b
        meaningful = (ratio > 0) & (torch.addcmul(var_x, mu_b, mu_b, value=-100.0) < -eps)
        r_mu = torch.where(meaningful, ratio.clamp_(1.0 / r_max, r_max), one)
        center = mu_u - beta
        w = torch.addcmul(center, r_mu, d)
    else:
        # No history (AMAT off, or eta = 0 at learning rates >= 1/omega): mu_U = mu_B,
        # var_U = var_B = var(x) + beta^2, both ratios exactly 1.
        mu_u, d, r_mu = mu_b, beta, one
        var_b = var_u = torch.addcmul(var_x, beta, beta)
        invstd = q = torch.rsqrt(var_u + eps)
        center = mu_b - beta
        w = mu_b  # (mu_U - beta) + d

    a = invstd * to_dtype(weight, acc)
    if rho != 1.0:
        a.mul_(1.0 / rho)
    grad_coef = grad_coef_of(neg_inverse_count(a, n), q, r_mu, w)
    beta_coef = q * d

    if valid is True:
        torch._foreach_copy_([amat_mean, amat_var], [mu_u, var_u])
        if not amat_ready:
            amat_initialized.fill_(True)
    else:  # a rank that cannot know whether the global batch was valid: masked, same values
        torch._foreach_copy_([amat_mean, amat_var], [torch.where(valid, mu_u, amat_mean),
                                                     torch.where(valid, var_u, amat_var)])
        amat_initialized.logical_or_(valid[0])
    update_running(running_mean, running_var, num_batches_tracked, mu_b, var_x, n, momentum, valid)
    if sink is not None:
        sink.update(mean=mu_b.clone(), sigma=torch.rsqrt(var_b + eps).reciprocal(), amat_mean=mu_u.clone())
    return center, var_u, invstd, a, grad_coef, beta_coef


@functools.cache
def _triton_kernels() -> ModuleType | None:
    """:mod:`distnorm._triton`, or None where Triton cannot be imported. Loaded on the first
    CUDA step that can use it (never on a CPU-only run) and remembered, so a machine without
    Triton pays one failed import, not one per step."""
    try:
        from distnorm import _triton
    except ImportError:
        return None
    return _triton


_TRITON_FAILED: list[str] = []  # the first launch error, once one happened (then the composite only)


def triton_enabled() -> bool:
    """Whether CUDA tensors take the Triton kernels (Triton importable, ``DISTNORM_TRITON``
    not ``0``, no launch has failed in this process)."""
    return (os.environ.get("DISTNORM_TRITON", "1") != "0" and not _TRITON_FAILED
            and _triton_kernels() is not None)


def _on_one_device(first: Tensor, *others: Optional[Tensor]) -> bool:
    """Every tensor on ``first``'s device: a Triton kernel reads raw pointers, where ATen would
    have accepted a CPU 0-dim tensor (a user's ``eta`` in the functional API) as a scalar."""
    return all(t is None or t.device == first.device for t in others)


def _triton_or_composite(name: str, triton_call: Callable[[], tuple], composite_call: Callable[[], tuple]) -> tuple:
    """``triton_call()``; if Triton cannot compile or launch here (no C compiler or CUDA
    driver library for its launcher, an unsupported GPU), warn once and use the composite from
    then on. Such errors are raised on the host before the kernel runs, so no buffer was
    written and the composite computes the same step."""
    try:
        return triton_call()
    except Exception as err:  # noqa: BLE001 - any launch failure: fall back, loudly
        _TRITON_FAILED.append(f"{type(err).__name__}: {err}")
        warnings.warn(f"distnorm: the Triton kernel of distnorm::{name} failed to launch ({_TRITON_FAILED[0]}); "
                      "using the ATen composite for the fused operators from now on (same values to 1e-6, more "
                      "launches). Set DISTNORM_TRITON=0 to choose the composite without trying Triton.",
                      RuntimeWarning, stacklevel=2)
        return composite_call()


_LIB = torch.library.Library("distnorm", "FRAGMENT")


def _define(name: str, kernel: Callable, *, cuda: Callable, fake: Callable,
            mutates_args: tuple[str, ...] = ()) -> torch._ops.OpOverload:
    """Declare ``distnorm::<name>`` with ``kernel``'s signature (its schema inferred, the
    mutated arguments annotated) and register its kernels: ``kernel`` for every device
    (``CompositeExplicitAutograd``), ``cuda`` for CUDA tensors, ``fake`` for ``torch.compile``.

    Registered through :class:`torch.library.Library` rather than ``torch.library.custom_op``:
    the operators run with autograd off (inside the statistics step and the hand-written
    backward), so they need no autograd registration, and ``custom_op``'s Python wrapper
    around every call costs ~100 us of host time for a 20-argument operator (measured on
    the CPU machine, 2026-11-24) against ~10 us this way — host time being what the fusion
    saves on a GPU. Returns the operator (``torch.ops.distnorm.<name>.default``)."""
    _LIB.define(name + torch.library.infer_schema(kernel, mutates_args=mutates_args))
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    _LIB.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"distnorm::{name}", fake, lib=_LIB)
    return getattr(torch.ops.distnorm, name).default


_CBN_BUFFERS = ("amat_mean", "amat_var", "amat_initialized", "running_mean", "running_var", "num_batches_tracked")


def _cbn_plan(mean: Tensor, var: Tensor, count: Optional[Tensor], host_count: int, valid_known: bool,
             weight: Tensor, bias: Tensor, eta: Tensor, amat_mean: Tensor, amat_var: Tensor,
             amat_initialized: Tensor, running_mean: Tensor, running_var: Tensor, num_batches_tracked: Tensor,
             eps: float, momentum: Optional[float], rho: float, r_max: float, history: bool,
             amat_ready: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fused CBN statistics step (:func:`cbn_plan_composite` for the maths)."""
    return cbn_plan_composite(mean, var, count, host_count, valid_known, weight, bias, eta, amat_mean, amat_var,
                              amat_initialized, running_mean, running_var, num_batches_tracked, eps, momentum,
                              rho, r_max, history, amat_ready)


def _triton_takes_plan(mean: Tensor, count: Optional[Tensor], host_count: int, buffers: tuple[Tensor, ...],
                       others: tuple[Tensor, ...]) -> bool:
    """The Triton kernel's cases: float32 statistics and buffers, contiguous vectors, every
    tensor on the statistics' device, and a host count only when the batch is valid (the
    degenerate local case keeps the composite)."""
    vectors = (mean, *buffers) + (() if count is None else (count,))
    return (mean.dtype == torch.float32 and all(b.dtype == torch.float32 for b in buffers)
            and all(v.is_contiguous() for v in vectors) and (count is not None or host_count > 1)
            and _on_one_device(mean, count, *buffers, *others) and triton_enabled())


def _cbn_plan_cuda(mean, var, count, host_count, valid_known, weight, bias, eta, amat_mean, amat_var,
                   amat_initialized, running_mean, running_var, num_batches_tracked, eps, momentum, rho, r_max,
                   history, amat_ready):
    args = (mean, var, count, host_count, valid_known, weight, bias, eta, amat_mean, amat_var, amat_initialized,
            running_mean, running_var, num_batches_tracked, eps, momentum, rho, r_max, history, amat_ready)
    if not _triton_takes_plan(mean, count, host_count, (amat_mean, amat_var, running_mean, running_var),
                              (var, weight, bias, eta, amat_initialized, num_batches_tracked)):
        return cbn_plan_composite(*args)
    return _triton_or_composite(
        "cbn_plan",
        lambda: _triton_kernels().cbn_plan(mean, var, count, host_count, weight.contiguous(), bias.contiguous(), eta,
                                           amat_mean, amat_var, amat_initialized, running_mean, running_var,
                                           num_batches_tracked, eps, momentum, rho, r_max, history),
        lambda: cbn_plan_composite(*args))


def _cbn_plan_fake(mean, var, count, host_count, valid_known, weight, bias, eta, amat_mean, amat_var,
                   amat_initialized, running_mean, running_var, num_batches_tracked, eps, momentum, rho, r_max,
                   history, amat_ready):
    channels = mean.shape[0]
    return (*(mean.new_empty(channels) for _ in range(4)), mean.new_empty(2, 2, channels), mean.new_empty(channels))


cbn_plan = _define("cbn_plan", _cbn_plan, cuda=_cbn_plan_cuda, fake=_cbn_plan_fake, mutates_args=_CBN_BUFFERS)


# --------------------------------------------------------- distnorm::cbn_param_grads
def _cbn_param_grads_composite(s1: Tensor, t: Tensor, beta_coef: Tensor, grad_scale: Tensor,
                               inv_rho: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(sums, dgamma, dbeta)`` from the local sums ``S1 = sum(g)``, ``T``: ``sums = [S1, T]``
    (for the backward all-reduce), ``dgamma = T / rho`` and SPEC §1.1's ``dbeta = a (S1 - q d
    T)`` with the local/global roles exchanged — ``c_local * sum_global(x1)`` instead of
    ``c_global * sum_local(x1)``: both are linear in the local sums and agree after the
    data-parallel average, and this form needs no collective."""
    sums = torch.stack([s1, t])
    grad_bias = torch.addcmul(s1, beta_coef, t, value=-1.0).mul_(grad_scale)
    return sums, t * inv_rho, grad_bias


def _cbn_param_grads(s1: Tensor, t: Tensor, beta_coef: Tensor, grad_scale: Tensor,
                    inv_rho: float) -> tuple[Tensor, Tensor, Tensor]:
    """The fused backward's local step (:func:`_cbn_param_grads_composite`)."""
    return _cbn_param_grads_composite(s1, t, beta_coef, grad_scale, inv_rho)


def _cbn_param_grads_cuda(s1, t, beta_coef, grad_scale, inv_rho):
    if s1.dtype != torch.float32 or not _on_one_device(s1, t, beta_coef, grad_scale) or not triton_enabled():
        return _cbn_param_grads_composite(s1, t, beta_coef, grad_scale, inv_rho)
    return _triton_or_composite(
        "cbn_param_grads",
        lambda: _triton_kernels().cbn_param_grads(s1.contiguous(), t.contiguous(), beta_coef.contiguous(),
                                                  grad_scale.contiguous(), inv_rho),
        lambda: _cbn_param_grads_composite(s1, t, beta_coef, grad_scale, inv_rho))


def _cbn_param_grads_fake(s1, t, beta_coef, grad_scale, inv_rho):
    return s1.new_empty(2, s1.shape[0]), torch.empty_like(s1), torch.empty_like(s1)


cbn_param_grads = _define("cbn_param_grads", _cbn_param_grads, cuda=_cbn_param_grads_cuda, fake=_cbn_param_grads_fake)


# ------------------------------------------------------------- distnorm::shift_slope
def _shift_slope_composite(grad_coef: Tensor, sums: Tensor) -> tuple[Tensor, Tensor]:
    """``(D, B) = grad_coef @ [S1, T]`` per channel (``grad_coef``: ``(2, 2, C)``)."""
    shift, slope = (grad_coef * sums).sum(1).unbind()
    return shift, slope.clone()  # outputs of an operator may not share storage


def _shift_slope(grad_coef: Tensor, sums: Tensor) -> tuple[Tensor, Tensor]:
    """The fused backward's global step (:func:`_shift_slope_composite`)."""
    return _shift_slope_composite(grad_coef, sums)


def _shift_slope_cuda(grad_coef, sums):
    if sums.dtype != torch.float32 or not _on_one_device(sums, grad_coef) or not triton_enabled():
        return _shift_slope_composite(grad_coef, sums)
    return _triton_or_composite(
        "shift_slope",
        lambda: _triton_kernels().shift_slope(grad_coef.contiguous(), sums.contiguous()),
        lambda: _shift_slope_composite(grad_coef, sums))


def _shift_slope_fake(grad_coef, sums):
    return sums.new_empty(sums.shape[1]), sums.new_empty(sums.shape[1])


shift_slope = _define("shift_slope", _shift_slope, cuda=_shift_slope_cuda, fake=_shift_slope_fake)
