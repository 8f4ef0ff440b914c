"""Every operator of distnorm, declared through one :class:`torch.library.Library` (the
``distnorm`` namespace), each with a fake kernel for tracing. The package calls them through
this module's names (``_ops.cbn_plan(...)``): each is the operator's one overload, which
skips the overload resolution of ``torch.ops.distnorm.cbn_plan(...)`` at every call, and a
room that calls one imports the room that declares it.

* ``distnorm::cbn_plan``, ``backward_sums``: the per-channel steps, one operator each
  (kernels: :mod:`distnorm._kernels`, the composite for every device and each device's own
  under its dispatch key; the maths: :mod:`distnorm._composite`), so a GPU
  launches one kernel where ATen would launch some thirty, and a CPU runs one C loop
  (:mod:`distnorm._cpu_kernels`); their last argument names which (``"composite"``,
  ``"triton"``, ``"cpu"``), as the group agreed (:mod:`distnorm._kernel_choice`).
* ``distnorm::batch_norm_update_stats``, ``batch_norm_elemt``, ``batch_norm_backward_reduce``
  and ``batch_norm_backward_elemt``: CPU kernels with the schemas of ATen's (the statistics:
  ATen's CPU arithmetic in fewer cycles; the other three exist in ATen for CUDA only:
  :mod:`distnorm._cpu_kernels`).
* ``distnorm::bnp_precondition``: BNP's gradient transform in one pass over the weight
  gradient, registered as the per-channel steps are (the C kernel under ``CPU``, Triton's
  under ``CUDA``, the composite for every device; the maths:
  :func:`distnorm._composite.bnp_precondition`), with the same last argument.
* ``distnorm::group_norm`` and ``group_norm_backward``: GroupNorm in its input's layout and
  dtype (:mod:`distnorm._gn_kernels` says why not ATen's: the composite for every device, the
  Triton kernels under ``CUDA``), called by :class:`distnorm._gn_function.GroupNormFunction`.
* ``distnorm::snapshot`` (compiled code only): copies of the AMAT and BNP buffers that a
  compiled step reads before updating them in place (:func:`distnorm._traced.cbn_statistics`
  says why it is an operator).

The operators run with autograd off (inside the statistics step and the hand-written
backward), so none needs an autograd formula; declaring them on a
:class:`~torch.library.Library` rather than with ``torch.library.custom_op`` spares every
call that decorator's Python wrapper, whose host time is what the fusion saves on a GPU
(figures: ``docs/reference/benchmarks.md``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from distnorm._torch_floor import require_torch

# The torch really imported (`import distnorm` read its metadata, which a torch on PYTHONPATH
# without one does not have), checked before anything below declares an operator.
require_torch(torch.__version__)

from distnorm import _cpu_kernels, _gn_kernels, _kernels  # noqa: E402

__all__ = ["FAST_CALLS", "backward_sums", "batch_norm_backward_elemt", "batch_norm_backward_reduce", "batch_norm_elemt",
           "batch_norm_update_stats", "bnp_precondition", "cbn_plan", "group_norm", "group_norm_backward", "snapshot"]

_LIB = torch.library.Library("distnorm", "FRAGMENT")


def _define(name: str, kernel: Callable, fake: Callable, mutates: tuple[str, ...] = ()) -> None:
    """Declare ``distnorm::<name>`` with ``kernel``'s signature (its schema inferred, the
    ``mutates`` arguments annotated), register ``kernel`` for every device
    (``CompositeExplicitAutograd``) and ``fake`` for tracing."""
    _LIB.define(name + torch.library.infer_schema(kernel, mutates_args=mutates))
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"distnorm::{name}", fake, lib=_LIB)


# The per-channel steps (kernels: distnorm._kernels).
def _cbn_plan_fake(mean: Tensor, *_: Any) -> tuple[Tensor, ...]:
    vec, channels = mean.new_empty, mean.shape[0]
    return vec(channels), vec(channels), vec(channels), vec(channels), vec(2, 2, channels), vec(channels)


def _backward_sums_fake(s1: Tensor, *_: Any) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return (s1.new_empty(2, s1.shape[0]), torch.empty_like(s1), torch.empty_like(s1), torch.empty_like(s1),
            s1.new_empty(1, dtype=torch.int32))


_define("cbn_plan", _kernels.cbn_plan, _cbn_plan_fake, mutates=("buffers",))
_define("backward_sums", _kernels.backward_sums, _backward_sums_fake)
# Each device's own kernels under its dispatch key (the composite above serves every other).
_LIB.impl("cbn_plan", _kernels.cbn_plan_cuda, "CUDA")
_LIB.impl("backward_sums", _kernels.backward_sums_cuda, "CUDA")


# Copies of the buffers a compiled step updates in place, read by its backward
# (distnorm._traced.cbn_statistics says why): an operator the compiler keeps, so that its
# partitioner saves the copies rather than recompute from the updated buffers.
def _snapshot(tensors: list[Tensor]) -> list[Tensor]:
    return [t.clone() for t in tensors]


def _snapshot_fake(tensors: list[Tensor]) -> list[Tensor]:
    return [torch.empty_like(t) for t in tensors]


_define("snapshot", _snapshot, _snapshot_fake)


# The backward's element-wise pass on the CPU (kernel: distnorm._cpu_kernels), with the schema
# and the formula of ATen's CUDA batch_norm_backward_elemt, which the CUDA path calls.
def _batch_norm_backward_elemt_fake(grad_out: Tensor, x: Tensor, *_: Any) -> Tensor:
    return torch.empty_like(x)


_LIB.define("batch_norm_backward_elemt(Tensor grad_out, Tensor input, Tensor mean, Tensor invstd, Tensor? weight, "
            "Tensor sum_dy, Tensor sum_dy_xmu, Tensor count) -> Tensor")
torch.library.register_fake("distnorm::batch_norm_backward_elemt", _batch_norm_backward_elemt_fake, lib=_LIB)


# The forward's statistics on the CPU (kernel: distnorm._cpu_kernels; ATen's arithmetic in fewer
# cycles), with the schema of ATen's batch_norm_update_stats, which every other device calls.
def _batch_norm_update_stats_fake(x: Tensor, running_mean: Optional[Tensor], *_: Any) -> tuple[Tensor, Tensor]:
    acc = running_mean.dtype if running_mean is not None else x.dtype
    return x.new_empty(x.shape[1], dtype=acc), x.new_empty(x.shape[1], dtype=acc)


_LIB.define("batch_norm_update_stats(Tensor input, Tensor? running_mean, Tensor? running_var, float momentum) "
            "-> (Tensor, Tensor)")
torch.library.register_fake("distnorm::batch_norm_update_stats", _batch_norm_update_stats_fake, lib=_LIB)


# The forward's output and the backward's local sums on the CPU (kernels: distnorm._cpu_kernels),
# with the schemas of ATen's CUDA batch_norm_elemt and batch_norm_backward_reduce (the CPU has
# neither): a synchronized layer's step calls them where its group agreed on the C kernels.
def _batch_norm_elemt_fake(x: Tensor, *_: Any) -> Tensor:
    return torch.empty_like(x)


def _batch_norm_backward_reduce_fake(grad_out: Tensor, x: Tensor, mean: Tensor, *_: Any) -> tuple[Tensor, ...]:
    return tuple(torch.empty_like(mean) for _ in range(4))  # (the kernel leaves the outputs not asked for undefined)


_LIB.define("batch_norm_elemt(Tensor input, Tensor? weight, Tensor? bias, Tensor mean, Tensor invstd, float eps) "
            "-> Tensor")
torch.library.register_fake("distnorm::batch_norm_elemt", _batch_norm_elemt_fake, lib=_LIB)
_LIB.define("batch_norm_backward_reduce(Tensor grad_out, Tensor input, Tensor mean, Tensor invstd, Tensor? weight, "
            "bool input_g, bool weight_g, bool bias_g) -> (Tensor, Tensor, Tensor, Tensor)")
torch.library.register_fake("distnorm::batch_norm_backward_reduce", _batch_norm_backward_reduce_fake, lib=_LIB)


# BNP's gradient transform (kernels: distnorm._kernels): one pass over the weight gradient, the C
# kernel on the CPU and Triton's on CUDA, called by distnorm._bnp_functions.BNPGradientFunction in
# eager mode with the kernel the layer's group agreed on; compiled code fuses the composite's ATen
# calls itself.
def _bnp_precondition_fake(grad_weight: Tensor, grad_bias: Optional[Tensor], *_: Any) -> tuple[Tensor, Tensor]:
    return torch.empty_like(grad_weight), grad_weight.new_empty(grad_weight.shape[0] if grad_bias is not None else 0)


_define("bnp_precondition", _kernels.bnp_precondition, _bnp_precondition_fake)
_LIB.impl("bnp_precondition", _kernels.bnp_precondition_cuda, "CUDA")


# GroupNorm in its input's layout and dtype (kernels: distnorm._gn_kernels). No autocast rule:
# the input keeps the autocast dtype, as batch_norm's does.
_LIB.define("group_norm(Tensor input, Tensor? weight, Tensor? bias, int groups, float eps) -> (Tensor, Tensor, Tensor)")
_LIB.define("group_norm_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, Tensor? weight, int groups, "
            "bool[3] output_mask) -> (Tensor, Tensor, Tensor)")
for _name in ("group_norm", "group_norm_backward"):
    _LIB.impl(_name, getattr(_gn_kernels, _name), "CompositeExplicitAutograd")
    _LIB.impl(_name, getattr(_gn_kernels, f"{_name}_cuda"), "CUDA")
    _LIB.impl(_name, getattr(_gn_kernels, f"{_name}_cpu"), "CPU")
    torch.library.register_fake(f"distnorm::{_name}", getattr(_gn_kernels, f"{_name}_fake"), lib=_LIB)


# The CPU. Its kernels are C++ (distnorm/csrc/cpu_ops.cpp around the C loops of csrc/kernels.c,
# built by distnorm._cpu_kernels), at the first step that asks for them and registered under the
# CPU key when they load, so a call goes from the dispatcher to the loop with no Python between.
# Until then the CPU key holds a Python function that loads them (the first call that names
# the C kernel, kernel="cpu", or one of the four operators with ATen's schemas, which only the
# C kernels implement) and calls the operator again; every other case runs the Python
# implementation of the CPU (distnorm._kernels: the composite, or Triton's interpreter).
# That implementation is also declared as the private operator distnorm::_<name>_cpu, which
# the C++ kernels call for the cases they do not take.
def _until_loaded(name: str, python_cpu: Optional[Callable]) -> Callable:
    op = getattr(torch.ops.distnorm, name).default

    def first_call(*args: Any) -> Any:
        if python_cpu is not None and args[-1] != "cpu":
            return python_cpu(*args)
        if _cpu_kernels.library.cache_info().currsize:  # loaded, yet this function still holds the key
            raise RuntimeError(f"distnorm::{name}: distnorm's C++ CPU kernels loaded but did not register")
        _cpu_kernels.library()
        return op(*args)

    return first_call


for _name, _python_cpu in (("cbn_plan", _kernels.cbn_plan_cpu), ("backward_sums", _kernels.backward_sums_cpu),
                           ("bnp_precondition", _kernels.bnp_precondition_cpu),
                           ("batch_norm_backward_elemt", None), ("batch_norm_update_stats", None),
                           ("batch_norm_elemt", None), ("batch_norm_backward_reduce", None)):
    _LIB.impl(_name, _until_loaded(_name, _python_cpu), "CPU")
    if _python_cpu is not None:
        _LIB.define(str(getattr(torch.ops.distnorm, _name).default._schema).replace(
            f"distnorm::{_name}", f"_{_name}_cpu", 1))
        _LIB.impl(f"_{_name}_cpu", _python_cpu, "CPU")


# The operators' one overload each: what the package calls (no overload resolution per call).
cbn_plan = torch.ops.distnorm.cbn_plan.default
backward_sums = torch.ops.distnorm.backward_sums.default
snapshot = torch.ops.distnorm.snapshot.default
batch_norm_backward_elemt = torch.ops.distnorm.batch_norm_backward_elemt.default
batch_norm_update_stats = torch.ops.distnorm.batch_norm_update_stats.default
bnp_precondition = torch.ops.distnorm.bnp_precondition.default
batch_norm_elemt = torch.ops.distnorm.batch_norm_elemt.default
batch_norm_backward_reduce = torch.ops.distnorm.batch_norm_backward_reduce.default
group_norm = torch.ops.distnorm.group_norm.default
group_norm_backward = torch.ops.distnorm.group_norm_backward.default

#: The names above that the C++ library, once loaded, also calls from Python
#: (distnorm/csrc/bindings.cpp): the same operator through the dispatcher's typed handle, every
#: dispatch key visited as before (autograd, a TorchDispatchMode, the profiler, each device's
#: kernel), without torch.ops's conversion of every argument, host time each eager step pays
#: per operator. Compiled code never calls these (it traces ATen calls, and ``snapshot``).
FAST_CALLS = ("cbn_plan", "backward_sums", "batch_norm_backward_elemt", "batch_norm_update_stats",
              "bnp_precondition", "batch_norm_elemt", "batch_norm_backward_reduce")


def _take_fast_calls(bindings: ModuleType) -> None:
    globals().update({name: getattr(bindings, name) for name in FAST_CALLS})


_cpu_kernels.when_loaded(_take_fast_calls)
