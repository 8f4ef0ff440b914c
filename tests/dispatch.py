"""Watching what the layers dispatch, on the CPU, as a GPU would pay for it.

* :class:`CudaContractChecker` — a ``TorchDispatchMode`` that checks every call of the
  batch-norm kernel family against the argument contract of its **CUDA** kernel
  (``aten/src/ATen/native/cuda/Normalization.cu``), which demands more than the CPU kernel:
  a call the CPU accepts but CUDA would reject is a violation.
* :class:`OpCounter` — counts dispatched ATen ops (each is a kernel launch, a view or an
  autograd bookkeeping op on a GPU), the bytes of activation-sized tensors they read and
  write (activation passes), and host synchronisations (``.item()``,
  ``bool(tensor)``, ``.tolist()`` all dispatch ``_local_scalar_dense``; ``torch.tensor(v,
  device=...)`` dispatches ``lift_fresh`` before its host-to-device copy).
* :class:`CollectiveCounter` — every ``torch.distributed`` collective this process issues.
  Every collective, whatever the Python entry point (``all_reduce``, ``broadcast``,
  ``all_gather``, ``reduce_scatter``, ``barrier``, the ``*_object`` collectives, a
  ``ProcessGroup`` method called directly), reaches the dispatcher as a ``c10d`` op, so a
  dispatch mode sees all of them — unlike a wrapper around ``dist.all_reduce``, which misses
  an added ``dist.broadcast``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: Host synchronisations: reading a device value on the host (``.item()``, ``bool(t)``,
#: ``.tolist()``), or making a tensor from a Python value: ``torch.tensor(v, device="cuda")``
#: (and ``torch.as_tensor``) dispatches ``lift_fresh`` on a CPU tensor that is then copied to
#: the device, a host-to-device copy from pageable memory the host waits for. On the CPU
#: the copy is invisible, so the ``lift_fresh`` itself is counted. ``torch.full`` /
#: ``torch.zeros`` with a Python value launch a fill kernel instead: no sync.
HOST_SYNC = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.item.default,
             aten.lift_fresh.default, aten.lift_fresh_copy.default}

#: Batch-norm kernels that exist only on CUDA: a CPU call would fail, so a layer calls none of
#: them on the CPU — and on CUDA only ``batch_norm_backward_elemt`` (the backward's element-wise
#: pass), whose contract is checked there and on its CPU twin ``distnorm::batch_norm_backward_elemt``.
CUDA_ONLY = {
    aten.batch_norm_stats.default, aten.batch_norm_elemt.default, aten.batch_norm_gather_stats.default,
    aten.batch_norm_gather_stats_with_counts.default, aten.batch_norm_backward_reduce.default,
    aten.batch_norm_backward_elemt.default,
}


def _cpu_twin() -> Any:
    import distnorm._ops  # noqa: F401  (declares the distnorm operators)

    return torch.ops.distnorm.batch_norm_backward_elemt.default


_CPU_TWIN = _cpu_twin()
_BACKWARD_ELEMT = {aten.batch_norm_backward_elemt.default, _CPU_TWIN}
#: The forward's output and the backward's local sums on the CPU: distnorm's operators with the
#: schemas of CUDA's batch_norm_elemt and batch_norm_backward_reduce, checked against their contracts.
_ELEMT_TWIN = torch.ops.distnorm.batch_norm_elemt.default
_REDUCE_TWIN = torch.ops.distnorm.batch_norm_backward_reduce.default
#: The forward's statistics: ATen's, and on the CPU distnorm's operator of the same schema
#: (distnorm._cpu_kernels), which receives exactly the arguments the CUDA path gives ATen's.
_UPDATE_STATS = {aten.batch_norm_update_stats.default, torch.ops.distnorm.batch_norm_update_stats.default}


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class ContractViolation(RuntimeError):
    """A batch-norm-family call the CUDA kernel would reject (raised instead of running it)."""


class CudaContractChecker(TorchDispatchMode):
    """Record every batch-norm-family call whose arguments the CUDA kernel would reject.

    ``violations`` lists ``(op, reason)``; ``calls`` counts the checked calls per op. A call
    that breaks a rule is not run: it raises :class:`ContractViolation` (a ``RuntimeError``,
    as CUDA's check would), so it fails its test instead of reaching a CPU kernel that was
    never meant to see such arguments and may take the whole test process down with it (the
    CPU backward on an empty training batch divides by N = 0: SIGFPE; with ``save_mean``
    undefined in training it reads a null pointer: SIGSEGV). Each rule names the line of PyTorch's CUDA source (``aten/src/ATen/native/cuda/
    Normalization.cu`` / ``Normalization.cuh``) it stands for:

    * **no empty input** to ``native_batch_norm``, ``native_batch_norm_backward`` or
      ``batch_norm_update_stats``: the CUDA templates (``batch_norm_stats_cuda_template``,
      ``batch_norm_elemt_cuda_template``, ``batch_norm_backward_cuda_template``) start with
      ``input_.reshape({input_.size(0), input_.size(1), -1})``, which raises for N = 0
      ("cannot reshape tensor of 0 elements"). The CPU kernels return early, so every CPU
      test passes: only ``torch.batch_norm`` (``at::batch_norm``: ``if (input.sym_numel()
      == 0)``) guards it on both devices. The CPU's ``distnorm::batch_norm_update_stats``
      (ATen's schema and arithmetic) is checked as ``batch_norm_update_stats``: the CUDA path
      gives ATen's the same arguments.
    * **per-channel arguments** 1-D, contiguous, of length C and of the accumulation dtype
      (``batch_norm_elementwise``'s channels-last branch needs contiguous ones; the
      mixed-precision dispatch ``is_mixed_type`` takes the dtype of the first defined one).
    * **running mean / var given in pairs**, in training too (``batch_norm_cuda_out``:
      ``TORCH_CHECK(has_running_mean == has_running_var)``; ``batch_norm_update_stats_cuda``
      likewise).
    * ``batch_norm_backward_elemt`` (on a CUDA tensor; and its CPU twin
      ``distnorm::batch_norm_backward_elemt``, which receives exactly the arguments the CUDA
      path gives it): no empty input (``batch_norm_backward_elemt_cuda_template`` reshapes to
      ``(N, C, -1)``); ``grad_out`` of the input's shape and dtype; ``mean``, ``invstd``,
      ``sum_dy``, ``sum_dy_xmu`` and ``weight`` 1-D, contiguous, of length C and of the
      accumulation dtype (``TORCH_CHECK(mean_st == invstd_st)``; the channels-last kernel
      reads them through ``data_ptr<stat_accscalar_t>``); ``count`` an int32 tensor
      (``count.data_ptr<int>()``) on the input's device. Any other CUDA-only kernel, or this
      one on a CPU tensor, is a violation: the CPU has no such kernel.
    * backward: ``save_mean`` / ``save_invstd`` defined (``batch_norm_backward_cuda``:
      ``TORCH_INTERNAL_ASSERT(save_mean->defined(), "save_mean should always be
      defined")``); a defined weight when weight / bias gradients are requested
      (``batch_norm_backward_reduce_cuda`` takes their options from it); ``grad_out`` of the
      input's dtype and shape (the fused ``batch_norm_backward_cuda_template`` reads both
      through accessors of one ``input_scalar_t``); and **weight, running mean and running
      var of one dtype**, the input's or the accumulation dtype: the fused branch
      (``needs_reduction && grad_input_mask[0] && !batch_norm_use_channels_last_kernels``)
      reads all three through accessors of the ``stat_scalar_t`` that ``is_mixed_type``
      chose from the first defined one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[tuple[str, str]] = []
        self.calls: Counter = Counter()

    def _fail(self, op: Any, reason: str) -> None:
        self.violations.append((str(op), reason))

    def _per_channel(self, op: Any, name: str, t: torch.Tensor | None, channels: int, dtype: torch.dtype) -> None:
        """CUDA's channels-last kernels need contiguous 1-D per-channel tensors; its
        mixed-precision dispatch (``is_mixed_type``) needs them in the accumulation dtype."""
        if t is None:
            return
        if t.dim() != 1 or t.numel() != channels:
            self._fail(op, f"{name} has shape {tuple(t.shape)}, expected ({channels},)")
        if not t.is_contiguous():
            self._fail(op, f"{name} is not contiguous")
        if t.dtype != dtype:
            self._fail(op, f"{name} has dtype {t.dtype}, expected the accumulation dtype {dtype}")

    def _input(self, op: Any, x: torch.Tensor) -> None:
        if x.numel() == 0:
            self._fail(op, f"empty input of shape {tuple(x.shape)}: CUDA reshapes it to (N, C, -1) and raises")
        if not 2 <= x.dim() <= 5:
            self._fail(op, f"input of {x.dim()} dims")

    def _pair(self, op: Any, rmean: torch.Tensor | None, rvar: torch.Tensor | None) -> None:
        if (rmean is None) != (rvar is None):
            self._fail(op, "running_mean and running_var must both be given or both be None")

    def _backward_elemt(self, op, grad_out, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count) -> None:
        """``batch_norm_backward_elemt_cuda``'s contract (see the class docstring)."""
        acc, c = _acc(x.dtype), x.shape[1]
        self._input(op, x)
        if tuple(grad_out.shape) != tuple(x.shape) or grad_out.dtype != x.dtype:
            self._fail(op, "grad_out and input differ in shape or dtype")
        for name, t in (("mean", mean), ("invstd", invstd), ("weight", weight), ("sum_dy", sum_dy),
                        ("sum_dy_xmu", sum_dy_xmu)):
            self._per_channel(op, name, t, c, acc)
        if count.dtype != torch.int32 or count.dim() != 1 or count.device != x.device:
            self._fail(op, f"count must be a 1-D int32 tensor on the input's device, got {count.dtype} "
                           f"{tuple(count.shape)} on {count.device}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = len(self.violations)
        if func in _BACKWARD_ELEMT and (func is _CPU_TWIN or args[1].is_cuda):
            self.calls[str(func)] += 1
            self._backward_elemt(func, *args[:8])
        elif func is _ELEMT_TWIN:  # batch_norm_elemt_cuda (batch_norm_elemt_cuda_template)
            self.calls[str(func)] += 1
            x, weight, bias, mean, invstd, _ = args
            acc, c = _acc(x.dtype), x.shape[1]
            self._input(func, x)
            for name, t in (("weight", weight), ("bias", bias), ("mean", mean), ("invstd", invstd)):
                self._per_channel(func, name, t, c, acc)
        elif func is _REDUCE_TWIN:  # batch_norm_backward_reduce_cuda
            self.calls[str(func)] += 1
            grad_out, x, mean, invstd, weight, _, weight_g, bias_g = args
            acc, c = _acc(x.dtype), x.shape[1]
            self._input(func, x)
            if tuple(grad_out.shape) != tuple(x.shape) or grad_out.dtype != x.dtype:
                self._fail(func, "grad_out and input differ in shape or dtype")
            for name, t in (("mean", mean), ("invstd", invstd), ("weight", weight)):
                self._per_channel(func, name, t, c, acc)
            # it takes grad_weight / grad_bias options from weight
            if (weight_g or bias_g) and weight is None:
                self._fail(func, "weight undefined while weight/bias gradients are requested")
        elif func in CUDA_ONLY:
            self._fail(func, "CUDA-only kernel: the CPU path would differ")
        elif func is aten.native_batch_norm.default:
            self.calls[str(func)] += 1
            x, weight, bias, rmean, rvar, training, _, eps = args
            acc, c = _acc(x.dtype), x.shape[1]
            self._input(func, x)
            self._pair(func, rmean, rvar)
            for name, t in (("weight", weight), ("bias", bias), ("running_mean", rmean), ("running_var", rvar)):
                self._per_channel(func, name, t, c, acc)
            if not training and (rmean is None or rvar is None):
                self._fail(func, "inference mode without running statistics")
        elif func is aten.native_batch_norm_backward.default:
            self.calls[str(func)] += 1
            grad_out, x, weight, rmean, rvar, save_mean, save_invstd, train, _, mask = args
            acc, c = _acc(x.dtype), x.shape[1]
            self._input(func, x)
            self._pair(func, rmean, rvar)
            # batch_norm_backward_cuda: TORCH_INTERNAL_ASSERT(save_mean->defined()) (and invstd).
            if save_mean is None or save_invstd is None:
                self._fail(func, "save_mean / save_invstd undefined (CUDA asserts they are defined)")
            else:
                if save_mean.numel() == 0 and (train or rmean is None):
                    self._fail(func, "empty save_mean needs train=False and running statistics")
                if save_mean.numel():
                    self._per_channel(func, "save_mean", save_mean, c, acc)
                    self._per_channel(func, "save_invstd", save_invstd, c, acc)
            # batch_norm_backward_reduce_cuda takes grad_weight / grad_bias options from weight.
            if (mask[1] or mask[2]) and weight is None:
                self._fail(func, "weight undefined while weight/bias gradients are requested")
            stats = [(n, t) for n, t in (("weight", weight), ("running_mean", rmean), ("running_var", rvar))
                     if t is not None]
            if stats:
                first = stats[0][1].dtype
                if first not in (x.dtype, acc):
                    self._fail(func, f"{stats[0][0]} dtype {first} is neither the input's nor {acc}")
                for name, t in stats:
                    self._per_channel(func, name, t, c, first)
                    if t.dtype != first:
                        self._fail(func, f"{name} dtype {t.dtype} differs from {stats[0][0]}'s {first} "
                                         "(the fused backward reads them as one stat_scalar_t)")
            if not train and (rmean is None or rvar is None):
                self._fail(func, "train=False without running statistics (the CPU kernel reads them)")
            if tuple(grad_out.shape) != tuple(x.shape):
                self._fail(func, "grad_out and input shapes differ")
            if grad_out.dtype != x.dtype:
                self._fail(func, f"grad_out dtype {grad_out.dtype} differs from the input's {x.dtype}")
        elif func in _UPDATE_STATS:
            self.calls[str(func)] += 1
            x, rmean, rvar, _ = args
            self._input(func, x)
            self._pair(func, rmean, rvar)
            if x.dtype in (torch.float16, torch.bfloat16) and (rmean is None or rmean.dtype != torch.float32):
                self._fail(func, "fp16/bf16 input without float32 buffers: the CPU kernel returns fp16/bf16 statistics")
        if len(self.violations) > before:
            raise ContractViolation(f"CUDA would reject {func}: " + "; ".join(r for _, r in self.violations[before:]))
        out = func(*args, **kwargs)
        if func in _UPDATE_STATS and out[0].dtype != _acc(args[0].dtype):
            self._fail(func, f"statistics came back as {out[0].dtype}")
        return out


class OpCounter(TorchDispatchMode):
    """Count every dispatched op; ``host_syncs`` counts reads of device values on the host.

    With ``activation`` (the layer's input, or its shape's element count), each op's
    **activation traffic** is counted too: the bytes of the activation-sized tensors it
    reads (tensor arguments) and writes (outputs), the measure of a memory-bound kernel on
    a GPU and of a large one on a CPU. ``passes`` is that traffic in units of the
    activation's own size (``x.numel() * x.element_size()``): a kernel reading ``x`` and
    writing ``y`` is 2 passes. The rules, read from each op's schema:

    * a **view** (an output that aliases an argument without writing it: ``view``,
      ``expand``, ``detach``, ``as_strided``...) moves nothing: free;
    * an **in-place** op reads its mutated argument and writes it **once** (the output it
      returns is that argument, not a second write); an ``out=`` argument is written only;
    * an allocation (``empty``, ``empty_like``, ``empty_strided``) moves nothing;
    * a tensor is activation-sized when it has at least ``activation``'s element count and
      no broadcast (stride-0) dimension: a per-channel vector ``expand``-ed to the full shape
      is read from its ``C`` values.

    Per-op traffic counts what each argument holds once, as a fused kernel would stream
    it: ``native_batch_norm`` in training reads ``x`` twice inside (statistics, then the
    output) but is counted as one read and one write — which is why ``torch.nn.BatchNorm2d``
    shows 5 passes per training step for the 8 its kernels make.
    ``per_op`` lists ``(op, passes)`` for the ops that moved activation data.
    """

    def __init__(self, activation: torch.Tensor | int | None = None) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.host_syncs = 0
        if isinstance(activation, torch.Tensor):
            self._numel, self._unit = activation.numel(), activation.numel() * activation.element_size()
        else:
            self._numel, self._unit = activation, None
        self.read_bytes = 0
        self.written_bytes = 0
        self.per_op: list[tuple[str, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append(str(func))
        if func in HOST_SYNC:
            self.host_syncs += 1
        out = func(*args, **kwargs)
        if self._numel is not None:
            self._traffic(func, args, kwargs, out)
        return out

    def _large(self, t: Any) -> bool:
        return (isinstance(t, torch.Tensor) and t.numel() >= self._numel
                and all(st != 0 or sz == 1 for st, sz in zip(t.stride(), t.shape)))

    def _traffic(self, func, args, kwargs, out) -> None:
        """Add ``func``'s activation reads and writes (see the class docstring)."""
        if func.name().split("::")[-1].split(".")[0] in _ALLOCATIONS:
            return
        schema = func._schema
        read = written = 0
        mutated = False
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            tensors = value if isinstance(value, (list, tuple)) else [value]
            size = sum(t.numel() * t.element_size() for t in tensors if self._large(t))
            alias = arg.alias_info
            if alias is not None and alias.is_write:
                mutated = True
                written += size
                if not arg.kwarg_only:  # an in-place self is read first; an out= argument is not
                    read += size
            else:
                read += size
        views = any(r.alias_info is not None for r in schema.returns)
        if not mutated and not views:  # fresh outputs
            outs = out if isinstance(out, (list, tuple)) else [out]
            written += sum(t.numel() * t.element_size() for t in outs if self._large(t))
        if views and not mutated:  # a view reads nothing
            read = 0
        self.read_bytes += read
        self.written_bytes += written
        if read or written:
            self.per_op.append((str(func), (read + written) / self._unit_bytes(read + written)))

    def _unit_bytes(self, fallback: int) -> int:
        return self._unit or fallback

    @property
    def passes(self) -> float:
        """Activation traffic in units of the activation's size (see the class docstring)."""
        total = self.read_bytes + self.written_bytes
        return total / self._unit if self._unit else float(total > 0)

    def __len__(self) -> int:
        return len(self.ops)

    def table(self) -> list[tuple[str, int]]:
        return Counter(self.ops).most_common()


#: Ops that allocate without moving data: no activation traffic.
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class CollectiveCounter(TorchDispatchMode):
    """Record every collective (``c10d`` op) dispatched while active, as ``(op, shapes)``.

    ``op`` is the c10d op name (``allreduce_``, ``broadcast_``, ``allgather_``,
    ``_allgather_base_``, ``reduce_scatter_``, ``barrier``, ...); ``shapes`` the shapes of its
    input tensors. Object collectives show up as the tensor collectives they are made of.

    Example::

        with CollectiveCounter() as counter:
            layer(x).sum().backward()
        # one frame forward, one backward: 3 * C + 2 * world_size float64 (distnorm._frames)
        assert counter.calls == [("allreduce_", ((3 * C + 2 * world,),))] * 2
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[tuple[int, ...], ...]]] = []
        self.nbytes: list[int] = []  # bytes of the input tensors of each call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            first = args[0] if args else None
            tensors = first if isinstance(first, (list, tuple)) else [first]
            shapes = tuple(tuple(t.shape) for t in tensors if isinstance(t, torch.Tensor))
            self.calls.append((func._opname, shapes))
            self.nbytes.append(sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)))
        return func(*args, **(kwargs or {}))

    def __len__(self) -> int:
        return len(self.calls)

    def mark(self) -> int:
        """The number of calls so far (slice ``calls[mark:]`` for what followed)."""
        return len(self.calls)
