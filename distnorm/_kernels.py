"""The fused kernels of the per-channel operators and of BNP's gradient transform, and which
implementation a call runs.

Each of these operators (``distnorm::cbn_plan``, ``distnorm::backward_sums``,
``distnorm::bnp_precondition``, declared in :mod:`distnorm._ops`) has three implementations:
the ATen composite (:mod:`distnorm._composite`, the reference, on every device), one Triton
kernel (:mod:`distnorm._triton`, CUDA) and one C kernel (:mod:`distnorm._cpu_kernels`, the
CPU), the last two for the cases they take -- float32 accumulation, buffers of that dtype, a
host count only when the batch is valid (the transform: the dtypes each kernel reads). Each is
registered under its dispatch key (:mod:`distnorm._ops`): the composite for every device, the
CPU's and CUDA's own implementations under ``CPU`` and ``CUDA``, each checking the cases it
takes. The operator's last argument names the one the layer's group agreed on
(:mod:`distnorm._kernel_choice`): the three are not bit-identical (``rsqrt`` / division
rounding and FMA contraction differ by a few ulp), so every rank of a group runs the same one.
A case a kernel does not take runs the composite, on every rank alike (the case reads
shapes, dtypes and devices, which the ranks share).

``DISTNORM_TRITON`` (read when a decision is made): ``1`` (default) Triton on CUDA where it
works; ``0`` the composite everywhere; ``interpret`` the Triton kernels on every device, the
CPU included, through Triton's interpreter (slow: to run the Triton path without a GPU, as
the tests do).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
from types import ModuleType
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from distnorm import _composite, _cpu_kernels
from distnorm._composite import backward_sums_composite, cbn_plan_composite

__all__ = ["MODES", "backward_sums", "backward_sums_cpu", "backward_sums_cuda", "bnp_precondition",
           "bnp_precondition_cpu", "bnp_precondition_cuda", "cbn_plan", "cbn_plan_cpu", "cbn_plan_cuda",
           "interpreted_kernels", "kernels_for", "load_interpreted", "mode"]


#: The values of ``DISTNORM_TRITON``.
MODES = ("1", "0", "interpret")


def mode() -> str:
    """``DISTNORM_TRITON`` as this process has it now (one of :data:`MODES` when valid)."""
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


def kernels_for(device: torch.device) -> tuple[ModuleType | None, str]:
    """The Triton kernels for tensors on ``device`` under ``DISTNORM_TRITON``, or ``None`` and
    why there are none (a mode of ``0``, a CPU device, no Triton)."""
    chosen = mode()
    if chosen == "0":
        return None, "DISTNORM_TRITON=0"
    if chosen == "interpret":
        try:
            return interpreted_kernels(), ""
        except ImportError as err:
            return None, f"triton cannot be imported ({err})"
    if device.type != "cuda":
        return None, (f"{device.type} tensors: the ATen composite is their kernel "
                      "(DISTNORM_TRITON=interpret runs the Triton kernels in Triton's interpreter)")
    return _compiled_kernels()


def _on_one_device(first: Tensor, *others: Optional[Tensor]) -> bool:
    """Every tensor on ``first``'s device: a Triton kernel reads raw pointers, where ATen would
    have accepted a CPU 0-dim tensor (a user's ``eta`` in the functional API) as a scalar."""
    return all(t is None or t.device == first.device for t in others)


def _launch(name: str, device: torch.device, call: Callable[[ModuleType], tuple]) -> tuple:
    """``call(kernels)`` with the Triton kernels of ``device``. The group agreed on Triton
    after each rank launched every kernel once, so an error here is one no probe could
    foresee (a launch configuration of this step only): raised, never hidden by the
    composite."""
    kernels, why = kernels_for(device)
    if kernels is None:  # the environment changed after the group agreed
        raise RuntimeError(f"distnorm::{name}: the group agreed on the Triton kernels, but this process has none now "
                           f"({why}); DISTNORM_TRITON must not change during a run")
    try:
        return call(kernels)
    except Exception as err:
        raise RuntimeError(f"distnorm::{name}: the Triton kernel failed ({type(err).__name__}: {err}). Set "
                           "DISTNORM_TRITON=0 on every rank to run the ATen composite instead.") from err


#: The AMAT and running statistics among a CBN layer's buffers (the float ones).
_STATISTICS = (0, 1, 3, 4)


def _triton_takes_plan(mean: Tensor, var: Tensor, count: Optional[Tensor], params: Sequence[Optional[Tensor]],
                       buffers: Sequence[Tensor], host_count: int) -> bool:
    """The Triton kernel's cases: float32 statistics and buffers, contiguous vectors, every
    tensor on the statistics' device, and a host count only when the batch is valid (the
    degenerate local case keeps the composite). The same answer on every rank of a group:
    it reads shapes, dtypes and devices, which the ranks share."""
    statistics = [buffers[i] for i in _STATISTICS]
    return (mean.dtype == torch.float32 and all(b.dtype == torch.float32 for b in statistics)
            and all(v.is_contiguous() for v in (mean, *statistics)) and (count.is_contiguous() if count is not None
                                                                         else host_count > 1)
            and _on_one_device(mean, var, count, *params, *buffers))


def cbn_plan(mean: Tensor, var: Tensor, count: Optional[Tensor], valid: Optional[Tensor], weight: Tensor,
             bias: Tensor, eta: Optional[Tensor], buffers: list[Tensor], host_count: int, hyper: list[float],
             momentum: Optional[float], amat_ready: bool,
             kernel: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``distnorm::cbn_plan`` on every device (``CompositeExplicitAutograd``): the composite,
    :func:`~distnorm._composite.cbn_plan_composite` (its arguments and the maths). ``kernel``,
    what the layer's group agreed (:func:`distnorm._kernel_choice.kernel_choice`), is read by
    the CPU's and CUDA's own implementations (:func:`cbn_plan_cpu`, :func:`cbn_plan_cuda`)."""
    return cbn_plan_composite(mean, var, count, valid, weight, bias, eta, buffers, host_count, hyper, momentum,
                              amat_ready)


def cbn_plan_cuda(mean: Tensor, var: Tensor, count: Optional[Tensor], valid: Optional[Tensor], weight: Tensor,
                  bias: Tensor, eta: Optional[Tensor], buffers: list[Tensor], host_count: int, hyper: list[float],
                  momentum: Optional[float], amat_ready: bool, kernel: str) -> tuple[Tensor, ...]:
    """``distnorm::cbn_plan`` on CUDA: the Triton kernel where the group agreed on it
    (``kernel="triton"``) and it takes the case (it computes a device count's validity itself,
    ``count > 1``: no ``valid``), else the composite."""
    if kernel == "triton" and _triton_takes_plan(mean, var, count, (weight, bias, eta), buffers, host_count):
        return _triton_plan(mean, var, count, weight, bias, eta, buffers, host_count, hyper, momentum)
    return cbn_plan(mean, var, count, valid, weight, bias, eta, buffers, host_count, hyper, momentum, amat_ready,
                    kernel)


def _triton_plan(mean: Tensor, var: Tensor, count: Optional[Tensor], weight: Tensor, bias: Tensor,
                 eta: Optional[Tensor], buffers: list[Tensor], host_count: int, hyper: list[float],
                 momentum: Optional[float]) -> tuple[Tensor, ...]:
    """The Triton kernel of ``cbn_plan`` on ``mean``'s device (compiled on CUDA, interpreted on
    the CPU), for a case it takes."""
    return _launch("cbn_plan", mean.device, lambda k: k.cbn_plan(mean, var, count, weight, bias, eta, buffers,
                                                                 host_count, hyper, momentum))


def cbn_plan_cpu(mean: Tensor, var: Tensor, count: Optional[Tensor], valid: Optional[Tensor], weight: Tensor,
                 bias: Tensor, eta: Optional[Tensor], buffers: list[Tensor], host_count: int, hyper: list[float],
                 momentum: Optional[float], amat_ready: bool, kernel: str) -> tuple[Tensor, ...]:
    """``distnorm::cbn_plan`` on the CPU in Python: the Triton kernel in Triton's interpreter
    where the group agreed on it (``DISTNORM_TRITON=interpret``) and it takes the case, else
    the composite. The C kernel (``kernel="cpu"``) is C++'s: :mod:`distnorm._ops` says how
    the CPU key passes to it, and it calls this function for the cases it does not take."""
    if kernel == "triton" and _triton_takes_plan(mean, var, count, (weight, bias, eta), buffers, host_count):
        return _triton_plan(mean, var, count, weight, bias, eta, buffers, host_count, hyper, momentum)
    return cbn_plan(mean, var, count, valid, weight, bias, eta, buffers, host_count, hyper, momentum, amat_ready,
                    kernel)


def backward_sums(s1: Tensor, t: Tensor, beta_coef: Tensor, grad_scale: Tensor, grad_coef: Tensor, inv_rho: float,
                  kernel: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``distnorm::backward_sums`` on every device: the composite,
    :func:`~distnorm._composite.backward_sums_composite` (``kernel`` as for :func:`cbn_plan`)."""
    return backward_sums_composite(s1, t, beta_coef, grad_scale, grad_coef, inv_rho)


def backward_sums_cuda(s1: Tensor, t: Tensor, beta_coef: Tensor, grad_scale: Tensor, grad_coef: Tensor,
                       inv_rho: float, kernel: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``distnorm::backward_sums`` on CUDA: the Triton kernel where the group agreed on it and
    the sums are float32 on one device, else the composite."""
    if kernel == "triton" and s1.dtype == torch.float32 and _on_one_device(s1, t, beta_coef, grad_scale, grad_coef):
        return _triton_sums(s1, t, beta_coef, grad_scale, grad_coef, inv_rho)
    return backward_sums(s1, t, beta_coef, grad_scale, grad_coef, inv_rho, kernel)


def _triton_sums(s1: Tensor, t: Tensor, beta_coef: Tensor, grad_scale: Tensor, grad_coef: Tensor,
                 inv_rho: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The Triton kernel of ``backward_sums`` on ``s1``'s device (compiled on CUDA,
    interpreted on the CPU), for float32 sums on one device."""
    return _launch("backward_sums", s1.device, lambda k: k.backward_sums(
        s1.contiguous(), t.contiguous(), beta_coef.contiguous(), grad_scale.contiguous(), grad_coef.contiguous(),
        inv_rho))


def backward_sums_cpu(s1: Tensor, t: Tensor, beta_coef: Tensor, grad_scale: Tensor, grad_coef: Tensor,
                      inv_rho: float, kernel: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``distnorm::backward_sums`` on the CPU in Python: the Triton kernel in Triton's
    interpreter (``kernel="triton"``) for float32 sums on one device, else the composite (the
    C kernel: as for :func:`cbn_plan_cpu`)."""
    if kernel == "triton" and s1.dtype == torch.float32 and _on_one_device(s1, t, beta_coef, grad_scale, grad_coef):
        return _triton_sums(s1, t, beta_coef, grad_scale, grad_coef, inv_rho)
    return backward_sums(s1, t, beta_coef, grad_scale, grad_coef, inv_rho, kernel)


def bnp_precondition(grad_weight: Tensor, grad_bias: Optional[Tensor], mean: Tensor, var_t: Tensor, q2: Tensor,
                     groups: int, kernel: str) -> tuple[Tensor, Tensor]:
    """``distnorm::bnp_precondition`` on every device: the composite,
    :func:`~distnorm._composite.bnp_precondition` (its arguments; ``q2`` a 0-dim tensor).
    Without a bias the second result is empty. ``kernel`` as for :func:`cbn_plan`."""
    new_weight, new_bias = _composite.bnp_precondition(grad_weight, grad_bias, mean, var_t, q2, groups=groups)
    return new_weight, new_bias if new_bias is not None else grad_weight.new_empty(0)


def _triton_takes_transform(grad_weight: Tensor, grad_bias: Optional[Tensor], mean: Tensor, var_t: Tensor,
                            q2: Tensor) -> bool:
    """The Triton kernel's cases: a non-empty float32 / bfloat16 / float16 gradient, float32
    moments, every tensor on the gradient's device (the same answer on every rank)."""
    return (grad_weight.dtype in (torch.float32, torch.bfloat16, torch.float16) and grad_weight.numel() > 0
            and mean.dtype == torch.float32 and var_t.dtype == torch.float32
            and _on_one_device(grad_weight, grad_bias, mean, var_t, q2))


def _triton_transform(grad_weight: Tensor, grad_bias: Optional[Tensor], mean: Tensor, var_t: Tensor, q2: Tensor,
                      groups: int) -> tuple[Tensor, Tensor]:
    """The Triton kernel of ``bnp_precondition`` on the gradient's device (compiled on CUDA,
    interpreted on the CPU), for a case it takes; its arguments checked first (it reads raw
    pointers)."""
    _cpu_kernels.check_precondition_arguments(grad_weight, grad_bias, mean, var_t, groups)
    return _launch("bnp_precondition", grad_weight.device,
                   lambda k: k.bnp_precondition(grad_weight, grad_bias, mean, var_t, q2, groups))


def bnp_precondition_cuda(grad_weight: Tensor, grad_bias: Optional[Tensor], mean: Tensor, var_t: Tensor, q2: Tensor,
                          groups: int, kernel: str) -> tuple[Tensor, Tensor]:
    """``distnorm::bnp_precondition`` on CUDA: the Triton kernel (one launch, where the
    composite makes five weight-sized passes) where the group agreed on it and it takes the
    case, else the composite."""
    if kernel == "triton" and _triton_takes_transform(grad_weight, grad_bias, mean, var_t, q2):
        return _triton_transform(grad_weight, grad_bias, mean, var_t, q2, groups)
    return bnp_precondition(grad_weight, grad_bias, mean, var_t, q2, groups, kernel)


def bnp_precondition_cpu(grad_weight: Tensor, grad_bias: Optional[Tensor], mean: Tensor, var_t: Tensor, q2: Tensor,
                         groups: int, kernel: str) -> tuple[Tensor, Tensor]:
    """``distnorm::bnp_precondition`` on the CPU in Python: the Triton kernel in Triton's
    interpreter (``kernel="triton"``) for the cases it takes, else the composite (the C kernel,
    for a float32 or float64 gradient: as for :func:`cbn_plan_cpu`)."""
    if kernel == "triton" and _triton_takes_transform(grad_weight, grad_bias, mean, var_t, q2):
        return _triton_transform(grad_weight, grad_bias, mean, var_t, q2, groups)
    return bnp_precondition(grad_weight, grad_bias, mean, var_t, q2, groups, kernel)
