"""Batch buffers in shared memory, reused across a DataLoader worker's batches.

A DataLoader worker hands each batch to the main process through shared memory. A fresh
buffer per batch, what ``default_collate`` allocates, makes the kernel fault in and zero a
new shared page every 4 KiB, several times the cost of writing the same values into a buffer
written before: a sizeable part of a worker's time per ImageNet image (``bench/data.py``
measures both, ``batch_buffer_write_ms``; figures on docs/reference/benchmarks.md, "Data").
So each worker keeps the buffers it sent (:class:`BatchPool`) and writes a later batch into
one the main process has given back (:class:`BatchReturns`):

* the main process gives a buffer back once nothing in it can still see the buffer: at
  once when the DataLoader's pinning thread has copied the batch into pinned memory
  (``pin_memory=True``, as on GPU hosts), else once the batch's storage has no reference
  left — no tensor, view or NumPy array of it (a :class:`~torch.multiprocessing.reductions.
  StorageWeakRef` expired). A batch the caller keeps keeps its buffer; nothing is copied;
* nothing ever waits on the other side: a worker whose buffers are all still out allocates
  a fresh one, as ``default_collate`` does, up to ``capacity`` pooled buffers, then
  unpooled ones; a worker that exits leaves its returns unread. A late or missing return
  costs the fresh allocation, never a stall;
* a buffer goes back only to the worker that made it, through that worker's own pipe, once
  per time it was sent.

A process forked while batches are held (``multiprocessing`` with ``fork``) inherits them
as they are: their buffers never go back (:func:`_before_fork`). One thing this cannot see:
a batch *pickled* to another process (a ``multiprocessing`` queue, pipe or pool task — torch
shares the shared memory instead of copying it) and then dropped here; that process would
read a buffer the worker writes again, so ``clone()`` a batch before sending it. The
DataLoader, DDP, Accelerate, DeepSpeed and the recipes never send one.

One pair per epoch: the workers, their pools and the pipes end with the epoch's DataLoader.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["BatchPool", "BatchReturns", "Lease", "shared_tensor"]

Lease = tuple[int, int, bool]  # (worker, slot, fresh): whose buffer a batch is in, and whether it is new


def shared_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in shared memory: sent to another process, it is not copied."""
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


class BatchReturns:
    """The main process's side: which workers' buffers are still in use, and one pipe per
    worker to give back those that are not.

    Made before the DataLoader starts its workers, which inherit it with the dataset
    (``fork``) or receive it pickled with the dataset (``spawn``, ``forkserver``).
    """

    def __init__(self, num_workers: int, capacity: int):
        if num_workers < 1 or capacity < 1:
            raise ValueError(f"need num_workers >= 1 and capacity >= 1, got {num_workers}, {capacity}")
        self.capacity = capacity
        self._pipes = [multiprocessing.SimpleQueue() for _ in range(num_workers)]
        self._out: dict[tuple[int, int], StorageWeakRef] = {}  # (worker, slot) handed on, not yet dropped
        self.fresh = 0  # batches received in a newly allocated buffer (the others reused one)
        _LIVE.add(self)

    def __getstate__(self) -> dict:
        """What a spawned worker receives: its pipes, not the main process's weak references
        (process-local pointers)."""
        return {"capacity": self.capacity, "_pipes": self._pipes}

    def pool(self, worker: int) -> BatchPool:
        """Worker ``worker``'s pool (called inside that worker)."""
        return BatchPool(worker, self._pipes[worker], self.capacity)

    def claim(self, images: torch.Tensor, lease: Lease | None) -> torch.Tensor:
        """Record that ``images`` (a batch just received) is handed on; give back the
        buffers of earlier batches nothing refers to any more."""
        for held, ref in list(self._out.items()):
            if ref.expired():  # no tensor, view or array in this process refers to it
                del self._out[held]
                self._give_back(held)
        if lease is None:  # unpooled (the worker's pool was full)
            self.fresh += 1
            return images
        worker, slot, fresh = lease  # (a list: the DataLoader turns tuples into lists)
        self.fresh += bool(fresh)
        assert (worker, slot) not in self._out, "a worker reused a buffer it was not given back"
        if images.is_pinned():  # the DataLoader's pinning thread copied it: free now
            self._give_back((worker, slot))
        else:
            self._out[worker, slot] = StorageWeakRef(images.untyped_storage())
        return images

    def _give_back(self, held: tuple[int, int]) -> None:
        worker, slot = held
        self._pipes[worker].put(slot)  # a pipe write: after every use of the buffer here


class BatchPool:
    """A worker's side: its pooled buffers, and which of them are free to write.

    Args:
        worker: this worker's id (returned in each :data:`Lease`).
        returns: the pipe the main process sends freed slots through.
        capacity: most pooled buffers kept; beyond it, batches get unpooled buffers.
    """

    def __init__(self, worker: int, returns, capacity: int):
        self.worker, self.capacity = worker, capacity
        self._returns = returns
        self._buffers: list[torch.Tensor] = []
        self._free: list[int] = []

    def _collect(self) -> None:
        while not self._returns.empty():  # never blocks: only what has arrived
            self._free.append(self._returns.get())

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Lease | None]:
        """A shared buffer of ``shape`` and ``dtype`` to write a batch into, and its lease
        (``None``: unpooled, the main process keeps it as it is)."""
        self._collect()
        key = (tuple(shape), dtype)
        for i, slot in enumerate(self._free):
            buffer = self._buffers[slot]
            if (tuple(buffer.shape), buffer.dtype) == key:
                del self._free[i]
                return buffer, (self.worker, slot, False)
        if len(self._buffers) < self.capacity:
            self._buffers.append(shared_tensor(tuple(shape), dtype))
            return self._buffers[-1], (self.worker, len(self._buffers) - 1, True)
        if self._free:  # a free buffer of another shape (an evaluation's last, partial batch)
            slot = self._free.pop()
            self._buffers[slot] = shared_tensor(tuple(shape), dtype)
            return self._buffers[slot], (self.worker, slot, True)
        return shared_tensor(tuple(shape), dtype), None


_LIVE: weakref.WeakSet[BatchReturns] = weakref.WeakSet()


def _before_fork() -> None:
    """A child forked now shares every batch held now (shared memory stays shared across a
    fork): keep those buffers out of the pools for good (the workers allocate others)."""
    for returns in list(_LIVE):
        returns._out.clear()


os.register_at_fork(before=_before_fork)
