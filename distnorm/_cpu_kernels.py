"""The CPU kernels of distnorm: the backward's element-wise pass (ATen's CUDA
``batch_norm_backward_elemt``, which the CPU does not have), the forward's statistics
(ATen's own arithmetic, in fewer cycles), the forward's output and the backward's local sums
(ATen's CUDA ``batch_norm_elemt`` and ``batch_norm_backward_reduce``, which the CPU does not
have either), CBN's per-channel steps (``cbn_plan``, ``backward_sums``: the Triton kernels'
programs, one loop each instead of some thirty ATen calls on C-sized vectors), and BNP's
gradient transform (``bnp_precondition``: one pass over the weight gradient instead of ATen's
five).

A synchronized layer's input gradient is, per channel ``c`` (module plan of
:mod:`distnorm._functions`)::

    dx = (g - sum_dy / n - (x - mean) * invstd^2 * sum_dy_xmu / n) * weight * invstd

— the formula of ATen's CUDA kernel (``batch_norm_backward_elemt_kernel_impl`` in
``aten/src/ATen/native/cuda/Normalization.cuh``), with ``n`` the sum of the int32 ``count``
tensor. On CUDA the layers call that kernel; on the CPU ATen has it only as two passes
(an affine map of ``x``, then ``addcmul_`` of ``g``: 5 activation passes instead of 3), so
this module builds the same kernel in C, once per machine, and declares it as the operator
``distnorm::batch_norm_backward_elemt`` with ATen's schema (:mod:`distnorm._functions`).

The C source computes in the order of the CUDA kernel (``norm = 1 / n``; ``m_dy = sum_dy *
norm``; ``k1 = invstd * invstd * sum_dy_xmu * norm``; ``k2 = weight * invstd``; then ``(g -
m_dy - (x - mean) * k1) * k2``) in float32 for float32 / bfloat16 / float16 input (rounded
once to the input's dtype, round-to-nearest-even) and in float64 for float64, and is
compiled with ``-ffp-contract=off``: no fused multiply-add, so every machine and every rank
computes the same bits whatever its vector width.

The statistics. ATen's CPU ``batch_norm_update_stats`` computes a contiguous float32 input's
per-channel mean and variance as one running double sum per channel, a chain of dependent
additions that takes several times as long as reading the input (``nn.BatchNorm2d``'s
training forward runs the same loop; the profile: ``docs/reference/benchmarks.md``).
``stats_f32`` computes the same quantities in the same precisions (sum of ``x`` in double,
``mean`` rounded to float, the float ``(x - mean)^2`` summed in double) with 32 partial sums
per channel folded in a fixed order, and is declared as ``distnorm::batch_norm_update_stats``
with ATen's schema. The values summed are the same, their order differs: the float results
are ATen's except where a double sum's last bits decide a float rounding (not seen in the
tests). ``stats_f32_cl`` does the same for a channels-last float32 input below ATen's grain
(32,768 values), where ATen's reduction costs a small layer more than the rest of its
statistics step; above it ATen's parallel reduction is the faster (the figures:
``docs/reference/benchmarks.md``). Calls neither covers (other dtypes and sizes, running
buffers) are ATen's, whose channels-last bits change with the number of threads.

The output and the local sums. ``distnorm::batch_norm_elemt`` computes ``(x - mean) * k + b``
with ``k = invstd * weight`` per channel (CUDA's formula with its two factors multiplied once per
channel) in one pass, where ATen's CPU inference batch norm (what the CPU runs with
``DISTNORM_CPU_KERNEL=0``) spends most of a small layer's call on its setup. ``distnorm::batch_norm_backward_reduce`` sums ``g`` and ``g *
(x - mean)`` per channel in double over partial sums folded in a fixed order, as the statistics
do: the same bits whatever the number of threads. A channels-last input from ATen's grain up
takes ATen's parallel backward reduction instead (the statistics' rule).

Every loop fixes its order of operations in the source, so the versions compiled for each
vector width (``target_clones``: AVX-512, AVX2, baseline) give the same bits.

Python calls the operators through :data:`BINDINGS_SOURCE` once the library is loaded
(:mod:`distnorm._ops`): the dispatcher's typed handle of each, so every dispatch key sees the
call as before, without ``torch.ops``'s conversion of every argument.

Build: :data:`C_SOURCE` (``distnorm/csrc/kernels.c``) with ``$CC`` (default ``cc``) and ``-O3
-fopenmp``, linked with the operators around it, :data:`CPP_SOURCE` (``distnorm/csrc/cpu_ops.cpp``,
and the Python calls into them, :data:`BINDINGS_SOURCE`), compiled by ``$CXX``,
default ``c++``, against the headers of the torch this process imported), into one library
under ``$DISTNORM_CACHE_DIR`` (default ``~/.cache/distnorm``) named by a hash of the sources, the
flags, the compilers and the torch: once per machine and torch (the C++ file reads torch's
headers, which takes most of the build), then each process loads it with
``torch.ops.load_library``. Loaded, its C++ operators take the CPU dispatch key of distnorm's
operators (:mod:`distnorm._ops`), so a call goes from the dispatcher to the loop with no Python
between, where Python wrappers behind the dispatcher cost a CBN step a large part of its host
time (the build's and the step's figures: ``docs/reference/benchmarks.md``). OpenMP's runtime is the one torch already loaded
(``libgomp.so.1``), with ``torch.get_num_threads()`` threads from ATen's grain (32,768 values)
up, one below it.

``DISTNORM_CPU_KERNEL``: ``1`` (default) these kernels; ``0`` ATen's two passes for the
backward and ATen's statistics (the same maths, rounded otherwise: use it on every rank or
none). Which kernels a synchronized layer runs is agreed by its group at the group's first
step (:func:`distnorm._kernel_choice.cpu_kernel_decision`): every rank builds or loads the C kernels
for its vote before using them, and that step's statistics are ATen's on every rank. A rank
without a C or C++ compiler, or whose build fails, is named by every rank, which all raise at that
collective — never a wait for the timeout, never a quiet fallback to other arithmetic on
some ranks. A layer without a group reads the setting at each call and builds the kernels at
its first use.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = ["BINDINGS_SOURCE", "CPP_SOURCE", "C_SOURCE", "check_precondition_arguments", "cpu_kernel_enabled", "library",
           "memory_format", "when_loaded"]

#: The C loops (``distnorm/csrc/kernels.c``), which the C++ operators call.
C_SOURCE = Path(__file__).with_name("csrc") / "kernels.c"

_FLAGS = ["-O3", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
#: The C++ operators around the C kernels, registered under the CPU dispatch key.
CPP_SOURCE = Path(__file__).with_name("csrc") / "cpu_ops.cpp"
#: Python's calls into the operators through the dispatcher's typed handles (the module
#: :func:`library` imports from the same library).
BINDINGS_SOURCE = Path(__file__).with_name("csrc") / "bindings.cpp"
#: The Python module's name, ``PYBIND11_MODULE(_cpu_ops, ...)`` in :data:`BINDINGS_SOURCE`.
_BINDINGS = "distnorm._cpu_ops"


def cpu_kernel_enabled() -> bool:
    """``DISTNORM_CPU_KERNEL`` is not ``0``: the backward's element-wise pass runs this kernel."""
    return os.environ.get("DISTNORM_CPU_KERNEL", "1").strip() != "0"


def _cache_dir() -> Path:
    root = os.environ.get("DISTNORM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "distnorm")
    return Path(root)


def _failure(why: str) -> RuntimeError:
    return RuntimeError(
        f"distnorm: the CPU kernel of the backward's element-wise pass cannot be built: {why}. Install a C and "
        "C++ compiler (gcc / g++ or clang; set CC and CXX to choose them), or set DISTNORM_CPU_KERNEL=0 on every "
        "rank to run ATen's two passes instead (the same maths, rounded twice).")


def _compilers() -> tuple[str, str]:
    """The C and C++ compilers (``$CC``, default ``cc``; ``$CXX``, default ``c++``)."""
    found = []
    for variable, default, language in (("CC", "cc", "C"), ("CXX", "c++", "C++")):
        compiler = shutil.which(os.environ.get(variable, default))
        if compiler is None:
            raise _failure(f"no {language} compiler ({os.environ.get(variable, default)!r} is not on PATH)")
        found.append(compiler)
    return found[0], found[1]


def _torch_flags() -> list[str]:
    """What a C++ file needs to include torch's and Python's headers (the paths, C++ standard and
    ABI of ``torch.utils.cpp_extension``, which is not imported: it looks for CUDA at import)."""
    root = Path(torch.__file__).parent
    return ["-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-I{sysconfig.get_paths()['include']}"]


def _link_flags() -> list[str]:
    """What the library links against: the torch this process imported."""
    lib = Path(torch.__file__).parent / "lib"
    return [f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", "-ltorch_python"]


def _run_all(commands: list[list[str]]) -> None:
    """Run ``commands`` side by side (the C++ files take most of the build); raise for the first
    that fails."""
    running = [(command, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
               for command in commands]
    finished = [(command, process, process.communicate()[1]) for command, process in running]
    for command, process, stderr in finished:
        if process.returncode != 0:
            raise _failure(f"{command[0]} failed (exit status {process.returncode})" + (
                f":\n{stderr.strip()[-2000:]}\n" if stderr.strip() else ""))


def _build(cc: str, cxx: str, target: Path) -> None:
    """Compile :data:`C_SOURCE` (C), :data:`CPP_SOURCE` and :data:`BINDINGS_SOURCE` (C++) into the
    shared library ``target`` (atomically: concurrent processes may race)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        lib = Path(tmp) / target.name
        objects = [Path(tmp) / name for name in ("kernels.o", "cpu_ops.o", "bindings.o")]
        _run_all([[cc, *_FLAGS, "-c", str(C_SOURCE), "-o", str(objects[0])],
                  [cxx, *_FLAGS, *_torch_flags(), "-c", str(CPP_SOURCE), "-o", str(objects[1])],
                  [cxx, *_FLAGS, *_torch_flags(), "-c", str(BINDINGS_SOURCE), "-o", str(objects[2])]])
        _run_all([[cxx, *_FLAGS, "-shared", *map(str, objects), "-o", str(lib), *_link_flags()]])
        os.replace(lib, target)


#: Called with the bindings module once the library is loaded (:func:`when_loaded`).
_HOOKS: list[Callable[[ModuleType], None]] = []


def when_loaded(hook: Callable[[ModuleType], None]) -> None:
    """Call ``hook(bindings)`` once :func:`library` has loaded the library (at once if it has):
    ``bindings`` is the module of :data:`BINDINGS_SOURCE`, one function per operator. How
    :mod:`distnorm._ops`, which declares the operators, learns of their faster calls without this
    module importing it."""
    _HOOKS.append(hook)
    if library.cache_info().currsize:
        hook(sys.modules[_BINDINGS])


def _import_bindings(target: Path) -> ModuleType:
    """The Python module of :data:`BINDINGS_SOURCE` in the loaded library ``target``."""
    spec = importlib.util.spec_from_file_location(_BINDINGS, target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_BINDINGS] = module
    return module


@functools.cache
def library() -> Path:
    """Build this machine's kernels at their first call, load them into this process once
    (their C++ operators then take the CPU dispatch key of distnorm's operators:
    :mod:`distnorm._ops`; the bindings module goes to the :func:`when_loaded` hooks), and return
    the library's path. Raises, naming the fix, where they cannot be built."""
    cc, cxx = _compilers()
    key = hashlib.sha256("\0".join([C_SOURCE.read_text(), CPP_SOURCE.read_text(), BINDINGS_SOURCE.read_text(), *_FLAGS,
                                     *_torch_flags(), *_link_flags(), cc, cxx, sys.platform, sys.version,
                                     torch.__version__, torch.__file__]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu-ops-{key}.so"
    if not target.exists():
        # The one step that takes a while (tens of seconds, once per machine and torch): said, not silent.
        logger.info("distnorm: building the CPU kernels into %s (once per machine and torch version)", target)
        try:
            _build(cc, cxx, target)
        except OSError:  # an unwritable cache: this process's own temporary directory
            target = Path(tempfile.gettempdir()) / f"distnorm-{os.getuid()}" / target.name
            if not target.exists():
                _build(cc, cxx, target)
    torch.ops.load_library(str(target))
    bindings = _import_bindings(target)
    for hook in _HOOKS:
        hook(bindings)
    return target


def memory_format(t: Tensor) -> torch.memory_format:
    """``t``'s layout: channels_last(_3d) for a tensor laid out so and not also contiguous."""
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d) and not t.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def check_precondition_arguments(grad_weight: torch.Tensor, grad_bias: torch.Tensor | None, mean: torch.Tensor,
                                 var_t: torch.Tensor, groups: int) -> None:
    """Raise ``ValueError`` unless the arguments of BNP's transform fit together (shapes as in
    :func:`distnorm._composite.bnp_precondition`): the check of its ATen calls and of the
    C kernel :func:`bnp_precondition`, which reads raw pointers."""
    in_channels = mean.numel()
    if (grad_weight.dim() < 2 or groups < 1 or grad_weight.shape[0] % groups
            or in_channels != groups * grad_weight.shape[1] or var_t.numel() != in_channels
            or (grad_bias is not None and grad_bias.numel() != grad_weight.shape[0])):
        raise ValueError(
            f"bnp_precondition: weight gradient of shape {tuple(grad_weight.shape)}, bias gradient of "
            f"{None if grad_bias is None else grad_bias.numel()} values and {in_channels} / {var_t.numel()} "
            f"input-channel moments do not match in {groups} group(s)")
