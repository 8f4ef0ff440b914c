"""Every collective distnorm issues lives in this module.

Layers never call ``torch.distributed`` themselves: they ask here for the group to
synchronise over (``None`` means "run locally") and for the packed reductions. Keeping the
collectives in one place makes the per-step communication easy to audit:

* forward of a synchronized layer: :func:`global_moments` — ONE all-reduce of ``2C + 1``
  float64 values (per-channel sum, per-channel sum of squares, the sample count);
* backward: :func:`all_reduce_sum` — ONE all-reduce of the ``2C`` per-channel gradient sums;
* BNP (``distnorm.bnp``) reuses :func:`global_moments` on each layer's input.

Everything works with gloo on CPU tensors and with NCCL on CUDA tensors; nothing here
moves data to the host (no ``.item()``), except in debug mode.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import torch
import torch.distributed as dist

from distnorm import _debug
from distnorm.errors import CollectiveFailedError, CollectiveMismatchError, NonFiniteStatisticsError

__all__ = [
    "Moments",
    "accumulate_dtype",
    "all_reduce_sum",
    "broadcast_from_first",
    "global_moments",
    "group_ranks",
    "group_size",
    "stable_hash",
    "sync_group",
]

ProcessGroup = dist.ProcessGroup if dist.is_available() else object


class Moments(NamedTuple):
    """Per-channel statistics of a (possibly distributed) batch, all float64.

    Attributes:
        count: number of values per channel over every rank (0-dim tensor).
        mean: per-channel mean.
        var: per-channel biased variance ``mean((x - mean)**2)``.
    """

    count: torch.Tensor
    mean: torch.Tensor
    var: torch.Tensor


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_size(process_group: ProcessGroup | None = None) -> int:
    """World size of ``process_group`` (default group if ``None``); 1 when not distributed."""
    if not is_distributed():
        return 1
    size = dist.get_world_size(process_group)
    if size < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the "
            "process_group given to distnorm; create the layer with a group this rank belongs "
            "to (e.g. from torch.distributed.new_subgroups())"
        )
    return size


def sync_group(process_group: ProcessGroup | None = None) -> ProcessGroup | None:
    """The group a synchronized layer reduces over, or ``None`` to run locally.

    Layers synchronize only when ``torch.distributed`` is initialised and the group has
    more than one rank; otherwise they run the same mathematics on the local batch.
    """
    if group_size(process_group) <= 1:
        return None
    return process_group if process_group is not None else dist.group.WORLD


def group_ranks(process_group: ProcessGroup | None) -> list[int]:
    """Global ranks of the members of ``process_group`` in group-rank order."""
    if not is_distributed():
        return [0]
    if process_group is None or process_group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return [dist.get_global_rank(process_group, r) for r in range(dist.get_world_size(process_group))]


def accumulate_dtype(x: torch.Tensor) -> torch.dtype:
    """dtype in which per-channel statistics are accumulated: float64 for float64, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def stable_hash(text: str) -> int:
    """A 63-bit hash of ``text`` that is the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _check_slot(group: ProcessGroup, slot: str, device: torch.device) -> None:
    """Debug mode: verify that every rank is entering the same collective slot.

    One MAX all-reduce of ``[h, ~h]``: all ranks agree iff the maximum of ``h`` and the
    maximum of ``~h`` (i.e. ``~min(h)``) both come back unchanged. The tensor has a fixed
    size, so this check itself cannot deadlock on mismatched shapes.
    """
    h = stable_hash(slot)
    probe = torch.tensor([h, ~h], dtype=torch.int64, device=device)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
    if int(probe[0]) != h or int(probe[1]) != ~h:
        slots: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(slots, slot, group=group)
        listing = "\n".join(f"  rank {r}: {s}" for r, s in zip(group_ranks(group), slots))
        raise CollectiveMismatchError(
            "ranks entered the same distnorm collective from different places "
            "(layer | phase | channels | dtype):\n"
            f"{listing}\n"
            "Every rank must run the same model on inputs of the same dtype and channel count."
        )


def all_reduce_sum(tensor: torch.Tensor, group: ProcessGroup | None, *, slot: str = "") -> torch.Tensor:
    """Sum ``tensor`` in place over ``group`` (no-op for ``None``) and return it."""
    if group is None:
        return tensor
    if _debug.is_debug():
        _check_slot(group, slot, tensor.device)
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    except RuntimeError as err:  # DistBackendError included: a peer died or timed out
        layer, _, rest = slot.partition("|")
        phase = rest.split("|")[0] if rest else "collective"
        raise CollectiveFailedError(
            f"{layer or 'distnorm'}: the {phase} all-reduce failed on rank {dist.get_rank()} ({err}). Another rank "
            "probably died, stalled past the process group's timeout, or raised an error of its own; see its log."
        ) from err
    return tensor


def local_mean_var(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance of a non-empty ``(N, C, *)`` tensor.

    Uses ATen's single-pass batch-norm statistics kernel (Welford on CPU and CUDA, any
    memory format). Passing float32 scratch "running" buffers with momentum 0 selects the
    mixed-precision kernel, so fp16/bf16 inputs yield float32 statistics.
    """
    acc = accumulate_dtype(x)
    channels = x.shape[1]
    scratch_mean = torch.zeros(channels, dtype=acc, device=x.device)
    scratch_var = torch.ones(channels, dtype=acc, device=x.device)
    mean, var = torch.ops.aten.batch_norm_update_stats(x, scratch_mean, scratch_var, 0.0)
    return mean.to(acc), var.to(acc)


def global_moments(
    x: torch.Tensor,
    group: ProcessGroup | None,
    *,
    layer: str = "",
    training: bool = True,
) -> Moments:
    """Per-channel count, mean and biased variance of ``x`` over every rank of ``group``.

    One all-reduce of ``[n_r * m_r, n_r * (v_r + m_r**2), n_r]`` in float64, where ``m_r``,
    ``v_r`` are this rank's Welford statistics. The global variance is recovered as
    ``sum(n_r (v_r + m_r^2)) / n - mean^2``; in float64 this cancellation costs about
    ``1e-16 * (mean/std)^2`` relative, i.e. nothing for any realistic activation (the
    float32 rounding of ``x`` itself dominates). Unequal batch sizes are weighted exactly
    by count; an empty rank contributes zeros and still joins the collective.

    The result is identical on every rank (it is computed from the same reduced tensor),
    which is what keeps every buffer derived from it bit-identical without broadcasts.
    """
    channels = x.shape[1]
    local_count = x.numel() // channels if channels else 0
    if local_count > 0:
        mean, var = local_mean_var(x)
        mean = mean.double()
        packed = torch.cat(
            [
                mean * local_count,
                torch.addcmul(var.double(), mean, mean) * local_count,
                torch.full((1,), float(local_count), dtype=torch.float64, device=x.device),
            ]
        )
    else:
        packed = torch.zeros(2 * channels + 1, dtype=torch.float64, device=x.device)
    all_reduce_sum(packed, group, slot=f"{layer}|forward|C={channels}|{x.dtype}")

    count = packed[-1]
    safe_count = count.clamp_min(1.0)  # an all-empty batch gives zeros, not NaN
    mean = packed[:channels] / safe_count
    var = (packed[channels : 2 * channels] / safe_count - mean * mean).clamp_min(0.0)
    if _debug.is_debug():
        _check_statistics(packed, layer, training)
    return Moments(count, mean, var)


def _check_statistics(packed: torch.Tensor, layer: str, training: bool) -> None:
    """Debug mode: raise on non-finite statistics or a degenerate global training batch."""
    finite = torch.isfinite(packed)
    if not bool(finite.all()):
        channels = (packed.numel() - 1) // 2
        bad = (~finite[:channels] | ~finite[channels : 2 * channels]).nonzero().flatten().tolist()
        raise NonFiniteStatisticsError(
            f"{layer}: non-finite batch statistics in channels {bad[:16]}"
            f"{' ...' if len(bad) > 16 else ''}; the layer's input already contains NaN/Inf "
            "(look at the layer before it, the learning rate, or the loss scale)"
        )
    count = float(packed[-1])
    if training and count <= 1:
        raise ValueError(
            f"{layer}: expected more than 1 value per channel when training, got a global "
            f"batch of {count:g} values per channel; increase the batch size or put the model "
            "in eval() mode"
        )



def broadcast_from_first(tensors: list[torch.Tensor], group: ProcessGroup | None) -> None:
    """Overwrite ``tensors`` in place with the copies of the group's first rank.

    One broadcast per tensor (they are per-channel vectors: few and small).
    """
    if group is None:
        return
    src = group_ranks(group)[0]
    for t in tensors:
        dist.broadcast(t, src=src, group=group)
