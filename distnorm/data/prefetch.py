"""Batches moved to the training device ahead of the step that uses them.

:func:`to_device` wraps any iterable of batches (a :class:`~distnorm.data.TrainLoader`, an
:class:`~distnorm.data.EvalLoader`, a list): while step ``n`` trains, batch ``n + 1`` (up to
``depth`` batches) is already taken from the loader and copied to the device. On CUDA the
copies run on a side stream, from the page-locked buffers the loaders fill (``pin_memory``,
on by default where CUDA is available), so the copy of the next batch overlaps the step's
kernels instead of waiting in line before them; a loader that decodes on the GPU
(``decode_device: cuda``) issues that decoding on the side stream too. The step's stream
waits for the batch's copy (an event, never a host sync) and the batch's memory is marked as
used by it (``Tensor.record_stream``), as ``torch.utils.data``'s pin-memory thread and
Lightning's and DALI's prefetchers do.

What a training run sees does not change: the same batches in the same order, bit for bit,
whatever ``depth`` (a copy is exact), the loader's equal batch counts and exact-once
evaluation untouched (every batch the loader yields is yielded once). Only when a batch is
read changes: up to ``depth`` batches early, which a loop that stops mid-epoch leaves unused.

Example:
    >>> import torch
    >>> batches = [(torch.full((2, 3), float(i)), torch.tensor([i, i])) for i in range(3)]
    >>> [int(labels[0]) for _, labels in to_device(batches, "cpu", depth=2)]
    [0, 1, 2]
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Iterable, Iterator

import torch

__all__ = ["to_device"]


def to_device(batches: Iterable[Any], device: torch.device | str, depth: int = 1) -> Iterator[Any]:
    """Yield each batch of ``batches`` with its tensors on ``device``, taking and copying up to
    ``depth`` batches ahead (``0``: each batch when it is asked for).

    A batch is a tensor or a tuple / list / dict of them and of other values (keys, masks),
    which pass through. On CUDA the copies are ``non_blocking`` on a side stream of
    ``device``; elsewhere ``Tensor.to`` (a no-op for tensors already there).
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"depth must be a non-negative int (batches copied ahead), got {depth!r}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(device) if device.type == "cuda" and depth > 0 else None
    source = iter(batches)
    ahead: collections.deque = collections.deque()

    def take() -> bool:
        # The loader's own work for this batch (a GPU decode included) is issued on the side
        # stream too: the generator runs inside next().
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            try:
                batch = next(source)
            except StopIteration:
                return False
            moved = _moved(batch, device)
            event = torch.cuda.Event() if side is not None else None
            if event is not None:
                event.record(side)
        ahead.append((moved, event))
        return True

    if depth == 0:
        for batch in source:
            yield _moved(batch, device)
        return
    while len(ahead) < depth and take():
        pass
    while ahead:
        batch, event = ahead.popleft()
        if event is not None:
            stream = torch.cuda.current_stream(device)
            stream.wait_event(event)
            _used_by(batch, stream)  # the allocator keeps the memory until the step's stream is done with it
        take()  # the next batch's copy goes out before this one's step starts
        yield batch


def _moved(batch: Any, device: torch.device) -> Any:
    """``batch`` with its tensors on ``device`` (non-blocking: a side stream's copies)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(_moved(b, device) for b in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_moved(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _moved(v, device) for k, v in batch.items()}
    return batch


def _used_by(batch: Any, stream: torch.cuda.Stream) -> None:
    if isinstance(batch, torch.Tensor):
        if batch.device.type == "cuda":
            batch.record_stream(stream)
    elif isinstance(batch, (tuple, list)):
        for b in batch:
            _used_by(b, stream)
    elif isinstance(batch, dict):
        for b in batch.values():
            _used_by(b, stream)
