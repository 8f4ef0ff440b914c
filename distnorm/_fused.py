"""The per-channel steps of a CBN / POP-Norm training step: their two kernels, and which runs.

Between its two passes over the input, a layer step does per-channel algebra on vectors of
length C: the AMAT blend, the ratios, the backward coefficients, the buffer updates. Written
as ATen calls that is some thirty small kernels per layer per step; on a GPU each is a launch
the host pays for, more than the arithmetic. So each step is one operator, declared with the
others in :mod:`distnorm._functions`, whose kernel is the function of the same name here:

``distnorm::cbn_plan`` (:func:`cbn_plan`)
    The statistics' finalize: from the global ``(mean, var, count)`` to the plan
    ``(center, var_U, invstd, a, grad_coef, beta_coef)``, and the AMAT and running buffers
    updated in place (see :func:`cbn_plan_composite` for the maths).
``distnorm::backward_sums`` (:func:`backward_sums`)
    The backward's per-channel step, between ATen's reduction and the all-reduce: from the
    local sums ``S1 = sum(g)``, ``T`` and ``grad_coef = [[r_mu, q], [w, n]]``, the sums the
    all-reduce completes already scaled, ``[r_mu S1, q T]`` (``r_mu`` and ``q`` come from
    the global statistics, the same on every rank, so the all-reduce of the scaled local
    sums gives ``shift = r_mu S1`` and ``slope = q T`` of the global batch with no step
    after it), the local parameter gradients ``dgamma = T / rho``, ``dbeta = a (S1 - q d
    T)``, ``w`` and ``n`` (an int32 ``(1,)`` tensor): exactly the arguments of ATen's CUDA
    kernel ``batch_norm_backward_elemt`` (and of its CPU twin, :mod:`distnorm._cpu_kernels`)
    for the element-wise pass ``dx = a (g - shift / n - (x - w) slope / n)``.

Each operator has two implementations: the ATen composite below (the reference, and what
runs on the CPU) and one Triton kernel (:mod:`distnorm._triton`, CUDA) for the supported
cases — float32 accumulation, buffers of that dtype, a host count only when the batch is
valid. Which one runs is the operator's last argument, ``triton``, and the caller takes it
from :func:`triton_decision`: the two are not bit-identical (the kernel's ``rsqrt`` /
division rounding and FMA contraction differ from ATen's by a few ulp), so **every rank of
a synchronized layer's group must take the same one**, or the buffers that are meant to be
identical on every rank drift apart.

Whether Triton runs is therefore agreed by the group, once, through the all-reduce a layer
already issues: at the group's first synchronized CBN / BN / BNP step on a device type (of a
layer of more than 4 channels), each rank votes (:func:`triton_vote`: Triton works here /
failed / neither; and on the CPU, whether its C kernels are on and build:
:func:`cpu_kernel_decision`), the vote rides in the values of that all-reduce (added to the
counts and taken out again, exactly: no byte more), and every rank reads the same sums
(:func:`triton_decision`). Until then the group runs the composite, on every rank alike.

* every rank works: Triton, on every rank;
* a rank's Triton failed (it imports but cannot build or launch a kernel — no C compiler or
  CUDA driver library for its launcher, an unsupported GPU — or its kernels differ from the
  composite there): **every** rank raises, naming the ranks and their errors, after the same
  collective, so none is left waiting. A failure is never turned into a quiet fallback;
* no rank failed but some do not run Triton (``DISTNORM_TRITON=0``, no Triton installed, CPU
  tensors): the composite on every rank of the group, with a warning where that differs
  from what a rank would have chosen alone.

A layer without a group (one process, or ``sync=False``) decides alone, with the same rule:
its buffers are its rank's own, so no other rank must match them — but a failed Triton then
raises on that rank only (in a multi-rank job the others stop at their next collective's
timeout). A rank's vote launches each kernel once on a few channels and compares it with the
composite, so the toolchain failures above surface before the first real step; a kernel
that fails only later, for a launch configuration the vote did not try, raises (never falls
back) on every rank that reaches it — all of them, as they run the same step. What is
decided, and why, is :func:`triton_state` (the GPU report prints it).

``DISTNORM_TRITON`` (read when a decision is made): ``1`` (default) Triton on CUDA where it
works; ``0`` the composite everywhere; ``interpret`` the Triton kernels on every device, the
CPU included, through Triton's interpreter (slow: to run the Triton path without a GPU, as
the tests do). The op counter of the tests (``tests/dispatch.py``) sees each operator as one
op, which is what a GPU launches; ``tests/test_fused.py`` checks the kernels against the
composite through the interpreter.

The helpers below (:func:`blend`, :func:`update_running`, :func:`grad_coef_of`) are shared
with batch normalization's statistics in
:mod:`distnorm._functions`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import warnings
import weakref
from types import ModuleType
from typing import Callable, Iterator, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from distnorm import _collectives, _cpu_kernels
from distnorm._cpu_kernels import cpu_kernel_enabled
from distnorm._collectives import ProcessGroup, constant

__all__ = ["TritonState", "backward_sums", "backward_sums_composite", "blend", "cbn_plan", "cbn_plan_composite",
           "cpu_kernel_decision", "grad_coef_of", "interpreted_kernels", "kernel_choice", "load_interpreted",
           "synced_moments", "to_dtype", "triton_decision", "triton_enabled", "triton_state", "triton_vote",
           "update_running"]


# ------------------------------------------------------------------------- helpers
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


# ------------------------------------------------------------------ distnorm::cbn_plan
def cbn_plan_composite(moments: Sequence[Tensor], host_count: int, params: Sequence[Tensor], buffers: Sequence[Tensor],
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
        moments: the global statistics as :func:`distnorm._collectives.global_moments` gives
            them: ``[mean, var]`` with a host count; ``[mean, var, count]`` with a device count
            when the host knows the batch is valid (more than one value per channel);
            ``[mean, var, count, valid]`` when only the device knows (the update is masked).
        host_count: the count when the host knows it, else -1.
        params: ``[weight, bias]``, and ``eta`` (0-dim) when history blends in (``eta > 0``,
            or a tensor learning rate the host does not read).
        buffers: the six CBN buffers (:class:`distnorm._functions.CBNBuffers` order), updated
            in place.
        hyper: ``[eps, rho, r_max]``.
        momentum: the running statistics' (``None``: cumulative average).
        amat_ready: the host saw the AMAT buffers initialised (no device-side check needed).
        amat_before: the values of ``amat_mean``, ``amat_var``, ``amat_initialized`` to blend
            with, when not the buffers themselves: compiled code passes copies
            (:func:`distnorm._traced.cbn_statistics` says why).

    Returns ``(center, var_U, invstd, a, grad_coef, beta_coef)``, all new tensors.
    """
    mu_b, var_x, *device = moments
    n: int | Tensor = device[0] if device else host_count
    # A branch on the host count, which in a compiled step may be a symbol (a dynamic batch
    # size): Dynamo guards on the condition, where a comparison alone stays a symbolic bool.
    if device:
        valid: bool | Tensor = device[1] if len(device) > 1 else True
    else:
        valid = True if host_count > 1 else False
    weight, bias, *eta = params
    eps, rho, r_max = hyper
    acc = mu_b.dtype
    beta = to_dtype(bias, acc)
    if eta:
        amat = buffers[:3] if amat_before is None else amat_before
        mu_u, d, var_u, invstd, q, r_mu, center, w = _with_history(mu_b, var_x, beta, to_dtype(eta[0], acc), amat,
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
    _update_buffers(buffers, (mu_b, var_x, mu_u, var_u), n, momentum, valid, amat_ready)
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


# ------------------------------------------------------------------ which kernels run
class TritonState(NamedTuple):
    """Whether the fused operators run their Triton kernels, and why not.

    Attributes:
        used: the Triton kernels run (for the group / device asked about).
        reason: why not (empty when ``used``); where a group agreed, what it agreed on.
    """

    used: bool
    reason: str


_OK, _FAILED, _OFF = 0, 1, 2  # a rank's verdict; its vote sends [ok, failed] (off: neither)
_MODES = ("1", "0", "interpret")


def _mode() -> str:
    return os.environ.get("DISTNORM_TRITON", "1").strip()


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


@functools.cache
def _compiled_kernels() -> tuple[ModuleType | None, str]:
    """:mod:`distnorm._triton` and ``""``, or ``None`` and why Triton cannot be imported.
    Loaded at the first decision for CUDA tensors (never on a CPU-only run) and remembered."""
    try:
        return importlib.import_module("distnorm._triton"), ""
    except ImportError as err:
        return None, f"triton cannot be imported ({err})"


@functools.cache
def interpreted_kernels() -> ModuleType:
    """A second copy of :mod:`distnorm._triton` whose kernels run in Triton's interpreter (on
    CPU tensors too): ``DISTNORM_TRITON=interpret``, and the tests."""
    return load_interpreted(os.path.join(os.path.dirname(__file__), "_triton.py"))


def load_interpreted(path: str | os.PathLike, name: str = "distnorm._triton_interpreted") -> ModuleType:
    """The kernel module at ``path`` (:mod:`distnorm._triton`'s interface) with its kernels
    in Triton's interpreter. Triton itself is imported first, normally: imported under
    ``TRITON_INTERPRET=1`` its own helpers would become interpreted functions, which parts
    it imports later (Triton 3.8's gluon, at the first launch) reject."""
    importlib.import_module("triton")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with _env("TRITON_INTERPRET", "1"):  # read by @triton.jit when the kernels are defined
        spec.loader.exec_module(module)
    return module


def _kernels_for(device: torch.device) -> tuple[ModuleType | None, str]:
    """The Triton kernels for tensors on ``device`` under ``DISTNORM_TRITON``, or ``None`` and
    why there are none (a mode of ``0``, a CPU device, no Triton)."""
    mode = _mode()
    if mode == "0":
        return None, "DISTNORM_TRITON=0"
    if mode == "interpret":
        try:
            return interpreted_kernels(), ""
        except ImportError as err:
            return None, f"triton cannot be imported ({err})"
    if device.type != "cuda":
        return None, (f"{device.type} tensors: the ATen composite is their kernel "
                      "(DISTNORM_TRITON=interpret runs the Triton kernels in Triton's interpreter)")
    return _compiled_kernels()


def _probe(kernels: ModuleType, device: torch.device) -> None:
    """Launch each kernel once on 16 channels of ``device`` and compare it with the composite:
    a Triton that cannot build its launcher or compile here raises, and so does one whose
    kernels compute something else (to 1e-5)."""
    c = 16
    ramp = torch.arange(c, dtype=torch.float32, device=device)
    mean, var = (ramp - 7.5) * 0.3, ramp * 0.05 + 0.5
    weight, bias, eta = ramp * 0.01 + 0.9, ramp * 0.02 - 0.1, torch.full((), 0.6, device=device)
    count = torch.full((c,), 64.0, device=device)

    def buffers() -> list[Tensor]:
        return [mean * 0.5, var * 1.5, torch.ones((), dtype=torch.bool, device=device), mean * 0.1, var * 0.9,
                torch.full((), 3, dtype=torch.long, device=device)]

    moments, params, hyper = [mean, var, count], [weight, bias, eta], [1e-5, 1.5, 3.0]
    got_buffers, want_buffers = buffers(), buffers()
    got = kernels.cbn_plan(moments, -1, params, got_buffers, hyper, 0.1)
    want = cbn_plan_composite(moments, -1, params, want_buffers, hyper, 0.1, True)
    pairs = [*zip(got, want), *zip(got_buffers, want_buffers),
             *zip(kernels.backward_sums(mean, var, weight, bias, want[4], 0.5),
                  backward_sums_composite(mean, var, weight, bias, want[4], 0.5))]
    for i, (g, w) in enumerate(pairs):
        if not torch.allclose(g.double(), w.double(), rtol=1e-5, atol=1e-6):
            raise RuntimeError(f"the Triton kernels differ from the ATen composite here (output {i}: "
                               f"{g.tolist()} instead of {w.tolist()})")


@functools.lru_cache(maxsize=None)
def _verdict(mode: str, device: torch.device) -> tuple[int, str]:
    """This process's own vote for tensors on ``device``: ``(_OK, "")``, ``(_OFF, why)`` or
    ``(_FAILED, error)`` — remembered per mode and device (one probe per process)."""
    if mode not in _MODES:
        return _FAILED, f"DISTNORM_TRITON={mode!r} is not one of {', '.join(_MODES)}"
    # The probe compares on the host; raised, not remembered as a failure (lru_cache keeps returns only).
    _collectives.refuse_capture(device, "the first training step's probe of the Triton kernels")
    try:  # never raises: a synchronized layer votes before its collective, and says it there
        kernels, why = _kernels_for(device)
        if kernels is None:
            return _OFF, why
        _probe(kernels, device)
    except Exception as err:  # noqa: BLE001 - whatever Triton raises here is this rank's failure
        return _FAILED, f"{type(err).__name__}: {err}"
    return _OK, ""


def _local_verdict(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _verdict(_mode(), device)


#: What each group agreed, per device type: a group keeps its answer for its lifetime. Held
#: weakly: a later group cannot find an earlier one's answer, and a group the program dropped
#: is not kept alive, so ``destroy_process_group`` destroys it and gloo joins its worker
#: threads there, not at interpreter shutdown (:mod:`distnorm._release` says why that matters).
_AGREED: "weakref.WeakKeyDictionary[ProcessGroup, dict[str, TritonState]]" = weakref.WeakKeyDictionary()


#: Whether a group's CPU layers run distnorm's C kernels (:func:`cpu_kernel_decision`), agreed
#: at the same step as Triton; held weakly as :data:`_AGREED`.
_CPU_KERNEL_AGREED: "weakref.WeakKeyDictionary[ProcessGroup, bool]" = weakref.WeakKeyDictionary()


def _agreed(group: ProcessGroup, device_type: str) -> TritonState | None:
    return _AGREED.get(group, {}).get(device_type)


def _agree(group: ProcessGroup, device_type: str, state: TritonState) -> None:
    _AGREED.setdefault(group, {})[device_type] = state


def _failure(reason: str) -> RuntimeError:
    return RuntimeError(
        f"distnorm: the Triton kernels of the fused operators cannot run here: {reason.rstrip('.')}. Fix Triton "
        "on this machine (it needs a C compiler and the CUDA driver library to build its launcher), or set "
        "DISTNORM_TRITON=0 on every rank to run the ATen composite instead (the same values to about 1e-6, more "
        "kernel launches).")


#: The entries of a rank's vote (:func:`triton_vote`); a layer needs more channels than this.
_VOTE_ENTRIES = 4


def _cpu_kernel_verdict(device: torch.device) -> tuple[int, str]:
    """This rank's CPU kernels: ``(_OK, "")``, ``(_OFF, why)`` (``DISTNORM_CPU_KERNEL=0``, or
    not a CPU device) or ``(_FAILED, error)`` (the C kernels cannot be built or loaded here:
    the build runs now, before the rank uses them)."""
    if device.type != "cpu":
        return _OFF, "not a CPU device"
    if not cpu_kernel_enabled():
        return _OFF, "DISTNORM_CPU_KERNEL=0"
    try:
        _cpu_kernels.library()
    except (RuntimeError, OSError) as err:
        return _FAILED, str(err)
    return _OK, ""


def triton_vote(group: ProcessGroup | None, device: torch.device, channels: int) -> Optional[Tensor]:
    """This rank's vote as a float64 ``[ok, failed, cpu_kernel_off, cpu_kernel_failed]`` on
    ``device`` (``ok = failed = 0``: Triton not wanted or not here; ``cpu_kernel_off``:
    ``DISTNORM_CPU_KERNEL=0`` here; ``cpu_kernel_failed``: the C kernels of
    :mod:`distnorm._cpu_kernels` cannot be built here), to be summed over ``group`` by the
    statistics' all-reduce of a layer of ``channels`` channels; or ``None`` when there is
    nothing to agree or no room: no group, the group agreed already for this device type, or
    at most 4 channels (the vote rides on the counts,
    :func:`distnorm._collectives.global_moments`). Every rank of a group gets ``None`` or a
    tensor at the same call — what decides it is the same on every rank. A CPU rank builds
    its C kernels here, before it uses them: a rank that cannot is named by every rank at
    this collective instead of raising alone before it."""
    if group is None or channels <= _VOTE_ENTRIES or _agreed(group, device.type) is not None:
        return None
    _collectives.refuse_capture(device, "the group's first synchronized step, whose all-reduce carries the ranks' "
                                        "vote on the kernels,")
    verdict = _local_verdict(device)[0]
    cpu = _cpu_kernel_verdict(device)[0]
    off = device.type == "cpu" and cpu == _OFF
    return torch.tensor([verdict == _OK, verdict == _FAILED, off, cpu == _FAILED], dtype=torch.float64).to(device)


def cpu_kernel_decision(group: ProcessGroup | None, device: torch.device) -> bool:
    """Whether a layer synchronizing over ``group`` runs distnorm's C kernels on ``device``
    (the statistics, the per-channel operators and the backward's element-wise pass,
    :mod:`distnorm._cpu_kernels`).

    Without a group: this process's own setting (``DISTNORM_CPU_KERNEL``; a kernel that
    cannot be built raises at its first use, on this rank only, as no other rank computes
    with it). With a group: what the group agreed at its first step on this device type
    (:func:`triton_decision`) — ATen's kernels before that step's collective, the voting
    step included, and in a group that never votes (all of its layers of at most 4
    channels), on every rank alike."""
    if device.type != "cpu":
        return False
    if group is None:
        return cpu_kernel_enabled()
    return _CPU_KERNEL_AGREED.get(group, False)


def synced_moments(x: Tensor, group: ProcessGroup | None, layer: str) -> _collectives.Moments:
    """A synchronized layer's statistics (:func:`distnorm._collectives.global_moments`) with
    the group's agreement on the kernels: at the group's first step on ``x``'s device type the
    ranks' votes (:func:`triton_vote`) ride on that all-reduce, whose local statistics are then
    ATen's on every rank (nothing is agreed yet), and every rank decides right after it
    (:func:`triton_decision`, raising alike where a rank's kernels failed); later steps run the
    kernels agreed. The one way every layer (CBN, BN, BNP) enters its statistics step."""
    votes = triton_vote(group, x.device, x.shape[1])
    moments = _collectives.global_moments(x, group, layer=layer, piggyback=votes,
                                          cpu_kernel=cpu_kernel_decision(group, x.device))
    if votes is not None:
        triton_decision(group, x.device, votes)
    return moments


def kernel_choice(group: ProcessGroup | None, device: torch.device) -> str:
    """Which implementation the per-channel operators run for a layer synchronizing over
    ``group`` on ``device``, as the group agreed (their last argument): ``"triton"``
    (:func:`triton_decision`), ``"cpu"`` (:func:`cpu_kernel_decision`) or ``"composite"``."""
    if triton_decision(group, device):
        return "triton"
    return "cpu" if cpu_kernel_decision(group, device) else "composite"


def triton_decision(group: ProcessGroup | None, device: torch.device, votes: Optional[Tensor] = None) -> bool:
    """Whether the fused operators of a layer synchronizing over ``group`` run Triton on
    ``device`` — the argument ``triton`` of :data:`cbn_plan` and :data:`backward_sums`.

    ``votes``: the sums of every rank's :func:`triton_vote`, right after the collective that
    carried them; the group's answer is made and kept from them (raising on every rank when a
    rank's Triton failed). Without ``votes``: the group's kept answer — the composite while
    the group has not voted yet, on every rank alike — or, for ``group=None``, this process's
    own (raising when its Triton failed).
    """
    if group is None:
        verdict, reason = _local_verdict(device)
        if verdict == _FAILED:
            raise _failure(reason)
        return verdict == _OK
    if votes is None:
        agreed = _agreed(group, device.type)
        return agreed is not None and agreed.used
    ok, failed, cpu_kernel_off, cpu_kernel_failed = (int(v) for v in votes.tolist())  # once per group and device
    size = _collectives.group_size(group)
    if 0 < cpu_kernel_off < size:  # the statistics and the backward would round differently on some ranks
        texts = _collectives.gather_texts(f"DISTNORM_CPU_KERNEL={os.environ.get('DISTNORM_CPU_KERNEL', '')!r}", group)
        listing = "\n".join(f"  rank {r}: {t}" for r, t in zip(_collectives.group_ranks(group), texts))
        raise RuntimeError(f"distnorm: DISTNORM_CPU_KERNEL=0 on {cpu_kernel_off} of the {size} ranks of the group; every "
                           f"rank must run the same backward arithmetic, so set it on every rank or on none:\n{listing}")
    if cpu_kernel_failed:  # every rank knows from the same sums: all gather who, all raise
        cpu_verdict, cpu_reason = _cpu_kernel_verdict(device)
        texts = _collectives.gather_texts(cpu_reason.splitlines()[0] if cpu_verdict == _FAILED else "ok", group)
        listing = "\n".join(f"  rank {r}: {t}" for r, t in zip(_collectives.group_ranks(group), texts) if t != "ok")
        raise RuntimeError(
            f"distnorm: the CPU kernels (distnorm._cpu_kernels) cannot be built on {cpu_kernel_failed} of the {size} "
            f"ranks of the group:\n{listing}\nInstall a C compiler there (gcc or clang; CC chooses one), or set "
            "DISTNORM_CPU_KERNEL=0 on every rank to run ATen's kernels instead.")
    if device.type == "cpu":
        _CPU_KERNEL_AGREED[group] = cpu_kernel_off == 0
    if ok == size:
        _agree(group, device.type, TritonState(True, ""))
        return True
    verdict, reason = _local_verdict(device)
    if failed == 0 and ok == 0:  # nobody wanted Triton: nothing to report beyond this rank's reason
        _agree(group, device.type, TritonState(False, reason))
        return False
    # Some ranks differ: every rank knows it from the same sums, so every rank gathers who
    # (one more collective, this step only) and raises or warns alike.
    texts = _collectives.gather_texts(["ok", f"failed: {reason}", f"off: {reason}"][verdict], group)
    listing = "\n".join(f"  rank {r}: {t}" for r, t in zip(_collectives.group_ranks(group), texts) if t != "ok")
    if failed:
        raise _failure(f"Triton failed on {failed} of the {size} ranks of the group:\n{listing}\n")
    why = (f"the composite on all {size} ranks of the group: {size - ok} do not run Triton and every rank "
           f"must compute alike:\n{listing}")
    _agree(group, device.type, TritonState(False, why))
    if verdict == _OK:
        warnings.warn(f"distnorm: the fused operators run {why}", RuntimeWarning, stacklevel=3)
    return False


def triton_state(process_group: ProcessGroup | None = None, device: torch.device | str | None = None) -> TritonState:
    """Whether the fused operators of layers synchronizing over ``process_group`` (default:
    the default group; none when not distributed) run their Triton kernels on ``device``
    (default: the current CUDA device, else the CPU), and why not.

    Where the group has not agreed yet (before its first synchronized training step), the
    answer is this process's own vote, which the group may still overrule with the
    composite; probing it launches each kernel once. Never raises for a failed Triton: it is
    the answer's reason.

    Example:
        >>> import torch
        >>> from distnorm._fused import triton_state
        >>> triton_state(device="cpu")
        TritonState(used=False, reason="cpu tensors: the ATen composite is their kernel (DISTNORM_TRITON=interpret runs the Triton kernels in Triton's interpreter)")
    """
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    group = _collectives.sync_group(process_group)
    agreed = _agreed(group, device.type) if group is not None else None
    if agreed is not None:
        return agreed
    verdict, reason = _local_verdict(device)
    if verdict == _FAILED:
        return TritonState(False, f"Triton failed here: {reason}")
    return TritonState(verdict == _OK, reason)


def triton_enabled() -> bool:
    """Whether this process, alone, would run the Triton kernels for CUDA tensors
    (:func:`triton_state` says why not, and what a group agreed)."""
    return torch.cuda.is_available() and triton_state(device="cuda").used


def _on_one_device(first: Tensor, *others: Optional[Tensor]) -> bool:
    """Every tensor on ``first``'s device: a Triton kernel reads raw pointers, where ATen would
    have accepted a CPU 0-dim tensor (a user's ``eta`` in the functional API) as a scalar."""
    return all(t is None or t.device == first.device for t in others)


def _launch(name: str, device: torch.device, call: Callable[[ModuleType], tuple]) -> tuple:
    """``call(kernels)`` with the Triton kernels of ``device``. The group agreed on Triton
    after each rank launched every kernel once, so an error here is one no probe could
    foresee (a launch configuration of this step only): raised, never hidden by the
    composite."""
    kernels, why = _kernels_for(device)
    if kernels is None:  # the environment changed after the group agreed
        raise RuntimeError(f"distnorm::{name}: the group agreed on the Triton kernels, but this process has none now "
                           f"({why}); DISTNORM_TRITON must not change during a run")
    try:
        return call(kernels)
    except Exception as err:
        raise RuntimeError(f"distnorm::{name}: the Triton kernel failed ({type(err).__name__}: {err}). Set "
                           "DISTNORM_TRITON=0 on every rank to run the ATen composite instead.") from err


# ----------------------------------------------------- the operators' kernels
#: The AMAT and running statistics among a CBN layer's buffers (the float ones).
_STATISTICS = (0, 1, 3, 4)


def _triton_takes_plan(moments: Sequence[Tensor], host_count: int, params: Sequence[Tensor],
                       buffers: Sequence[Tensor]) -> bool:
    """The Triton kernel's cases: float32 statistics and buffers, contiguous vectors, every
    tensor on the statistics' device, and a host count only when the batch is valid (the
    degenerate local case keeps the composite). The same answer on every rank of a group:
    it reads shapes, dtypes and devices, which the ranks share."""
    mean, var, *device = moments
    count = device[:1]  # [count] with a device count, else []
    statistics = [buffers[i] for i in _STATISTICS]
    return (mean.dtype == torch.float32 and all(b.dtype == torch.float32 for b in statistics)
            and all(v.is_contiguous() for v in (mean, *statistics, *count)) and (bool(count) or host_count > 1)
            and _on_one_device(mean, var, *count, *params, *buffers))


def cbn_plan(moments: list[Tensor], host_count: int, params: list[Tensor], buffers: list[Tensor], hyper: list[float],
             momentum: Optional[float], amat_ready: bool, kernel: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                                 Tensor]:
    """The kernel of ``distnorm::cbn_plan``: :func:`cbn_plan_composite` (its arguments and
    the maths), or where it takes the case, for ``kernel="triton"`` (:func:`triton_decision`)
    the Triton kernel, for ``kernel="cpu"`` (:func:`cpu_kernel_decision`) the C kernel of
    :mod:`distnorm._cpu_kernels` (the same cases, on the CPU); ``"composite"``: the composite."""
    if kernel == "triton" and _triton_takes_plan(moments, host_count, params, buffers):
        return _launch("cbn_plan", moments[0].device,
                       lambda k: k.cbn_plan(moments, host_count, params, buffers, hyper, momentum))
    if (kernel == "cpu" and moments[0].device.type == "cpu" and _triton_takes_plan(moments, host_count, params, buffers)
            and buffers[2].dtype == torch.bool and buffers[5].dtype == torch.int64):
        return _cpu_kernels.cbn_plan(moments, host_count, params, buffers, hyper, momentum)
    return cbn_plan_composite(moments, host_count, params, buffers, hyper, momentum, amat_ready)


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


def backward_sums(s1: Tensor, t: Tensor, beta_coef: Tensor, grad_scale: Tensor, grad_coef: Tensor, inv_rho: float,
                  kernel: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The kernel of ``distnorm::backward_sums`` (:func:`backward_sums_composite`; ``kernel``
    as for :func:`cbn_plan`)."""
    if kernel != "composite" and s1.dtype == torch.float32 and _on_one_device(s1, t, beta_coef, grad_scale, grad_coef):
        if kernel == "triton":
            return _launch("backward_sums", s1.device, lambda k: k.backward_sums(
                s1.contiguous(), t.contiguous(), beta_coef.contiguous(), grad_scale.contiguous(), grad_coef.contiguous(),
                inv_rho))
        if kernel == "cpu" and s1.device.type == "cpu":
            return _cpu_kernels.backward_sums(s1, t, beta_coef, grad_scale, grad_coef, inv_rho)
    return backward_sums_composite(s1, t, beta_coef, grad_scale, grad_coef, inv_rho)
