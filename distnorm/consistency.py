"""Prove that state which must be identical on every rank is identical.

distnorm computes every buffer (running / AMAT statistics, BNP moments) from all-reduced
statistics, so the buffers stay bit-identical across ranks without ``broadcast_buffers``;
data-parallel engines keep the parameters (and a replicated optimizer's state) identical
by averaging the gradients. :func:`check_consistency` verifies that at any time, cheaply:

1. one fixed-size all-reduce compares a hash of the tensor names, dtypes and shapes (so a
   structural mismatch is reported, not turned into a hang by differently sized tensors);
2. one all-reduce of a 64-bit fingerprint of the bits of every tensor;
3. only if some fingerprints differ: the divergent tensors are gathered and compared
   exactly, and the error names each tensor and the groups of ranks that agree.

Only replicated state is compared. A parameter an engine partitions across ranks (one shard
per rank: torch FSDP, sharding engines) holds a different shard on every rank by design and is
left out, as is optimizer state kept for such shards; each engine's registration says which
parameters it partitions (:class:`distnorm._engines.Engine`), so which tensors are compared
depends only on facts every rank shares, and no rank can be left waiting in a collective
another skipped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distnorm import _collectives
from distnorm._collectives import ProcessGroup, assert_same_across_ranks
from distnorm._engines import partition_tests
from distnorm.errors import InconsistentStateError
from distnorm.layers import _DistNormLayer, name_layers

__all__ = [
    "check_consistency",
    "consistent_tensors",
    "assert_same_across_ranks",
    "InconsistentStateError",
]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_GOLDEN = 0x9E3779B1  # odd multiplier: a position-dependent weight for every element


def consistent_tensors(
    model: nn.Module,
    *,
    parameters: bool = False,
    optimizer: Any | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """The ``(qualified name, tensor)`` pairs that must match across ranks.

    Every buffer of a distnorm layer, the buffers a module lists in its
    ``_distnorm_buffers`` attribute (BNP's moments); with ``parameters=True`` every
    parameter of ``model`` that is replicated (not partitioned by an engine), named as in
    ``model.named_parameters()``; with ``optimizer`` the tensors of its per-parameter state
    for those parameters (``optimizer[<parameter>].<key>``, e.g. SGD's ``momentum_buffer``).
    An optimizer whose state is kept for flattened or partitioned copies (a sharding engine's
    optimizer) holds no state for the model's own parameters, so contributes nothing.
    """
    found: list[tuple[str, torch.Tensor]] = []
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(module, _DistNormLayer):
            names = [n for n, b in module.named_buffers(recurse=False) if b is not None]
        else:
            names = list(getattr(module, "_distnorm_buffers", ()))
        for name in names:
            buf = module._buffers.get(name)
            if buf is not None:
                found.append((dot + name, buf))
    tests = partition_tests() if parameters or optimizer is not None else []
    replicated = [(n, p) for n, p in model.named_parameters() if not any(test(p) for test in tests)]
    if parameters:
        found.extend(replicated)
    if optimizer is not None:
        state = getattr(optimizer, "state", None) or {}
        for name, param in replicated:
            for key, value in sorted(state.get(param, {}).items()):
                if torch.is_tensor(value):
                    found.append((f"optimizer[{name}].{key}", value))
    return found


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A 64-bit, position-sensitive checksum of the bits of ``t`` (0-dim int64)."""
    flat = t.detach().reshape(-1)
    bits = flat.view(_INT_VIEW[flat.element_size()]).to(torch.int64)
    weights = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) * _GOLDEN + 1
    return (bits * weights).sum()


def _rank_groups(values: list[torch.Tensor], ranks: list[int]) -> list[list[int]]:
    """Partition ``ranks`` into groups holding bit-identical ``values``."""
    groups: list[tuple[torch.Tensor, list[int]]] = []
    for rank, value in zip(ranks, values):
        for ref, members in groups:
            if ref.shape == value.shape and ref.dtype == value.dtype and torch.equal(
                ref.reshape(-1).view(_INT_VIEW[ref.element_size()]),
                value.reshape(-1).view(_INT_VIEW[value.element_size()]),
            ):
                members.append(rank)
                break
        else:
            groups.append((value, [rank]))
    return [members for _, members in groups]


def check_consistency(
    model: nn.Module,
    process_group: ProcessGroup | None = None,
    *,
    parameters: bool = False,
    optimizer: Any | None = None,
) -> int:
    """Raise :class:`InconsistentStateError` unless distnorm's buffers match on every rank.

    Collective: every rank of ``process_group`` must call it at the same point. A no-op
    returning the count when not distributed.

    Args:
        model: the model (wrapped by DDP or an engine, or not).
        process_group: ranks to compare (default: the default group).
        parameters: also compare every replicated parameter (catches replicas whose weights
            drifted apart: a rank that skipped a step, a per-rank edit or load). Parameters
            an engine partitions are left out: each rank holds its own shard.
        optimizer: also compare this optimizer's state for the replicated parameters (a
            torch optimizer or an engine's wrapper with ``state``).

    Returns:
        The number of tensors compared.

    Raises:
        InconsistentStateError: naming each divergent tensor and the ranks that disagree.
        CollectiveMismatchError: first, when a layer collective since the last check was
            paired with another layer's on some rank (on a GPU these are compared here at
            the latest: :mod:`distnorm._frames`), naming every rank's layer.

    Example:
        >>> import torch, distnorm
        >>> distnorm.check_consistency(torch.nn.Sequential(distnorm.CBN(4)))
        7
    """
    _collectives.check_frames()  # before any collective of its own: a misaligned rank stops here
    name_layers(model)
    named = consistent_tensors(model, parameters=parameters, optimizer=optimizer)
    group = _collectives.sync_group(process_group)
    if group is None:
        return len(named)
    device = _collectives.group_device(group)
    ranks = _collectives.group_ranks(group)

    layout = "\n".join(f"{n}:{t.dtype}:{tuple(t.shape)}" for n, t in named)
    assert_same_across_ranks(
        layout,
        "the model structure (distnorm buffer names, dtypes, shapes; every rank must build the same "
        "model with the same distnorm config)" + (" and the compared parameters / optimizer state"
                                                  if parameters or optimizer is not None else ""),
        group,
    )
    if not named:
        return 0

    sums = torch.stack([_fingerprint(t).to(device) for _, t in named])
    agree = _collectives.all_agree(sums, group)
    if bool(agree.all()):
        return len(named)

    # The layout agreed, so every suspect has the same shape and dtype on every rank and
    # can be gathered through the tensor path.
    suspects = [named[i] for i in (~agree).nonzero().flatten().tolist()]
    mismatches: dict[str, list[list[int]]] = {}
    lines = []
    for name, tensor in suspects:
        copies = _collectives.gather_tensors(tensor, group)
        groups = _rank_groups(copies, ranks)
        if len(groups) > 1:
            mismatches[name] = groups
            ref = copies[0].double()
            worst = max((copies[ranks.index(m[0])].double() - ref).abs().max().item() for m in groups[1:])
            lines.append(f"  {name}: ranks {' | '.join(map(str, groups))} (max |diff| vs rank {ranks[0]}: {worst:.3g})")
    if not mismatches:  # fingerprints disagreed but bits agree: impossible unless memory changed
        return len(named)
    raise InconsistentStateError(
        f"{len(mismatches)} tensor(s) differ across ranks (groups of ranks that agree):\n"
        + "\n".join(lines)
        + "\nBuffers of distnorm layers are computed from all-reduced statistics and must be "
        "bit-identical; a difference means a rank changed them outside distnorm (a load, a "
        "manual edit, a layer run with sync=False) or ran a different model. Parameters and "
        "optimizer state stay identical only while every rank applies the same averaged "
        "gradients: a difference there means a rank skipped or repeated a step, or changed "
        "them on its own.",
        mismatches,
    )
