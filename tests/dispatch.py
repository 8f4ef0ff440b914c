"""Watching what the layers dispatch, on the CPU, as a GPU would pay for it.

* :class:`CudaContractChecker` — a ``TorchDispatchMode`` that checks every call of the
  batch-norm kernel family against the argument contract of its **CUDA** kernel
  (``aten/src/ATen/native/cuda/Normalization.cu``), which demands more than the CPU kernel:
  a call the CPU accepts but CUDA would reject is a violation.
* :class:`OpCounter` — counts dispatched ATen ops (each is a kernel launch, a view or an
  autograd bookkeeping op on a GPU) and host synchronisations (``.item()``,
  ``bool(tensor)``, ``.tolist()`` all dispatch ``_local_scalar_dense``).
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

#: Host synchronisations: reading a device value on the host.
HOST_SYNC = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.item.default}

#: Batch-norm kernels that exist only on CUDA: a same-path layer never calls them.
CUDA_ONLY = {
    aten.batch_norm_stats.default, aten.batch_norm_elemt.default, aten.batch_norm_gather_stats.default,
    aten.batch_norm_gather_stats_with_counts.default, aten.batch_norm_backward_reduce.default,
    aten.batch_norm_backward_elemt.default,
}


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class CudaContractChecker(TorchDispatchMode):
    """Record every batch-norm-family call whose arguments the CUDA kernel would reject.

    ``violations`` lists ``(op, reason)``; ``calls`` counts the checked calls per op.
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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in CUDA_ONLY:
            self._fail(func, "CUDA-only kernel: the CPU path would differ")
        elif func is aten.native_batch_norm.default:
            self.calls[str(func)] += 1
            x, weight, bias, rmean, rvar, training, _, eps = args
            acc, c = _acc(x.dtype), x.shape[1]
            for name, t in (("weight", weight), ("bias", bias), ("running_mean", rmean), ("running_var", rvar)):
                self._per_channel(func, name, t, c, acc)
            if not training and (rmean is None or rvar is None):
                self._fail(func, "inference mode without running statistics")
        elif func is aten.native_batch_norm_backward.default:
            self.calls[str(func)] += 1
            grad_out, x, weight, rmean, rvar, save_mean, save_invstd, train, _, mask = args
            acc, c = _acc(x.dtype), x.shape[1]
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
            if weight is not None and weight.dtype not in (x.dtype, acc):
                self._fail(func, f"weight dtype {weight.dtype} is neither the input's nor {acc}")
            if weight is not None:
                self._per_channel(func, "weight", weight, c, weight.dtype)
            if not train and (rmean is None or rvar is None):
                self._fail(func, "train=False without running statistics (the CPU kernel reads them)")
            if tuple(grad_out.shape) != tuple(x.shape):
                self._fail(func, "grad_out and input shapes differ")
        elif func is aten.batch_norm_update_stats.default:
            self.calls[str(func)] += 1
            x, rmean, rvar, _ = args
            if (rmean is None) != (rvar is None):
                self._fail(func, "running_mean and running_var must both be given or both be None")
            if x.numel() == 0:
                self._fail(func, "empty input")
            if x.dtype in (torch.float16, torch.bfloat16) and (rmean is None or rmean.dtype != torch.float32):
                self._fail(func, "fp16/bf16 input without float32 buffers: the CPU kernel returns fp16/bf16 statistics")
        out = func(*args, **kwargs)
        if func is aten.batch_norm_update_stats.default and out[0].dtype != _acc(args[0].dtype):
            self._fail(func, f"statistics came back as {out[0].dtype}")
        return out


class OpCounter(TorchDispatchMode):
    """Count every dispatched op; ``host_syncs`` counts reads of device values on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.host_syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        if func in HOST_SYNC:
            self.host_syncs += 1
        return func(*args, **(kwargs or {}))

    def __len__(self) -> int:
        return len(self.ops)

    def table(self) -> list[tuple[str, int]]:
        return Counter(self.ops).most_common()


class CollectiveCounter(TorchDispatchMode):
    """Record every collective (``c10d`` op) dispatched while active, as ``(op, shapes)``.

    ``op`` is the c10d op name (``allreduce_``, ``broadcast_``, ``allgather_``,
    ``_allgather_base_``, ``reduce_scatter_``, ``barrier``, ...); ``shapes`` the shapes of its
    input tensors. Object collectives show up as the tensor collectives they are made of.

    Example::

        with CollectiveCounter() as counter:
            layer(x).sum().backward()
        assert counter.calls == [("allreduce_", ((3, C),)), ("allreduce_", ((2, C),))]
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
