"""Top-1 / top-5 / loss over an exact-once evaluation, reduced across ranks."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from distnorm import _collectives
from distnorm._collectives import ProcessGroup
from distnorm.data.prefetch import to_device

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple],
    *,
    device: torch.device | str = "cpu",
    process_group: ProcessGroup | None = None,
    non_blocking: bool = True,
    cast: Callable[[torch.Tensor], torch.Tensor] | None = None,
    prefetch: int = 1,
) -> dict[str, float]:
    """Evaluate ``model`` on ``(images, labels, mask, keys)`` batches (an
    :class:`~distnorm.data.EvalLoader`) and reduce the metrics over every rank.

    ``cast`` converts the images after they reach ``device`` (e.g. to bf16 for an engine
    running in bf16). Masked (padding) samples run through the model, so every rank performs the same number
    of forwards, but count nowhere. One all-reduce of four float64 sums at the end.
    ``prefetch``: batches copied to ``device`` ahead of the forward that reads them
    (:func:`distnorm.data.prefetch.to_device`; on CUDA on a side stream); ``0``: each batch
    when it is read, with ``non_blocking``.

    Returns:
        ``{"top1": %, "top5": %, "loss": mean cross-entropy, "count": samples}``, identical
        on every rank.
    """
    device = torch.device(device)
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, top1, top5, count
    try:
        for images, labels, mask, _keys in (to_device(batches, device, prefetch) if prefetch else batches):
            images = images.to(device, non_blocking=non_blocking)
            if cast is not None:
                images = cast(images)
            labels = labels.to(device, non_blocking=non_blocking)
            mask = mask.to(device, non_blocking=non_blocking)
            logits = model(images).float()
            loss = nn.functional.cross_entropy(logits, labels, reduction="none")
            k = min(5, logits.shape[1])
            top = logits.topk(k, dim=1).indices
            hit = top.eq(labels[:, None])
            m = mask.double()
            sums += torch.stack([
                (loss.double() * m).sum(),
                (hit[:, 0].double() * m).sum(),
                (hit.any(dim=1).double() * m).sum(),
                m.sum(),
            ])
    finally:
        model.train(was_training)
    _collectives.all_reduce_sum(sums, _collectives.sync_group(process_group), slot="evaluate")
    loss_sum, top1, top5, count = sums.tolist()
    n = max(count, 1.0)
    return {"top1": 100.0 * top1 / n, "top5": 100.0 * top5 / n, "loss": loss_sum / n, "count": int(count)}
