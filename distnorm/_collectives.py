"""Every collective distnorm issues lives in this module.

Layers never call ``torch.distributed`` themselves: they ask here for the group to
synchronize over (``None`` means "run locally") and for the packed reductions. Keeping the
collectives in one place makes the per-step communication easy to audit:

* forward of a synchronized layer: :func:`all_reduce_sum` of the ``(3, C)`` float64
  statistics payload (:func:`distnorm._moments.global_moments`); once per group and device
  type, before its first statistics, one more of the ranks' votes on the kernels (four
  numbers, :mod:`distnorm._kernel_choice`);
* backward: :func:`all_reduce_sum` — ONE all-reduce of the ``(2, C)`` per-channel gradient
  sums;
* each of these travels in a frame (:mod:`distnorm._frames`): one size for every distnorm
  all-reduce of the process, with every rank's fingerprint of its layer and phase, so ranks
  that run different layers raise :class:`~distnorm.errors.CollectiveMismatchError`
  instead of mixing statistics, aborting or hanging;
* BNP (``distnorm.bnp``) reuses :func:`distnorm._moments.global_moments` on each layer's input;
* start-up and consistency checks: :func:`all_agree` (one fixed-size MAX all-reduce) and,
  only once something disagrees, :func:`gather_tensors` / :func:`gather_texts` to say who.

Every collective runs on tensors of the group's device (:func:`group_device`, PyTorch's
rule: for NCCL the device the group is bound to, else the current CUDA device; the CPU for
gloo): the training all-reduces on the input's device, which must be that device
(:func:`check_collective_device`, once per group and device), so the consistency checks and
the training collectives never run on different GPUs. None goes through the pickling
``*_object`` collectives, which on NCCL move data through the host. Nothing here reads a
tensor on the host (no ``.item()``) except in debug mode and on error paths.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.distributed as dist

from distnorm import _capture, _debug, _frames
from distnorm._frames import stable_hash
from distnorm._release import released
from distnorm.errors import CollectiveFailedError, CollectiveMismatchError, InconsistentStateError

__all__ = [
    "all_agree",
    "assert_same_across_ranks",
    "all_reduce_sum",
    "broadcast_from_first",
    "check_collective_device",
    "check_frames",
    "collective_device",
    "gather_tensors",
    "gather_texts",
    "group_device",
    "group_ranks",
    "group_size",
    "norm_group",
    "refuse_debug_mode",
    "sync_group",
    "traced_all_reduce_sum",
]

ProcessGroup = dist.ProcessGroup if dist.is_available() else object


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


#: Test switch ``DISTNORM_SYNC_ONE_RANK=1`` (read at import; :func:`keep_one_rank_groups`
#: flips it): a group of one rank keeps its collectives, so a machine with one GPU runs the
#: synchronized path -- NCCL, the frames' GPU checks, the kernels a group agrees on, CUDA
#: graphs with the all-reduce inside -- that a real job runs on many. The arithmetic is the
#: synchronized path's (float64 packing, device counts), equal to the local path's within
#: rounding; never set in training.
_ONE_RANK_GROUPS = [os.environ.get("DISTNORM_SYNC_ONE_RANK", "") == "1"]


def keep_one_rank_groups(keep: bool = True) -> bool:
    """Set the test switch ``DISTNORM_SYNC_ONE_RANK`` in this process (see above); returns
    the previous value."""
    previous, _ONE_RANK_GROUPS[0] = _ONE_RANK_GROUPS[0], bool(keep)
    return previous


def sync_group(process_group: ProcessGroup | None = None) -> ProcessGroup | None:
    """The group a synchronized layer reduces over, or ``None`` to run locally.

    Layers synchronize only when ``torch.distributed`` is initialised and the group has
    more than one rank (or one, under the test switch ``DISTNORM_SYNC_ONE_RANK=1``);
    otherwise they run the same mathematics on the local batch.
    """
    if not is_distributed():  # (asked at every step: the common answer first)
        return None
    size = group_size(process_group)
    if size <= 1 and not (size == 1 and _ONE_RANK_GROUPS[0]):
        return None
    return process_group if process_group is not None else dist.group.WORLD


def group_ranks(process_group: ProcessGroup | None) -> list[int]:
    """Global ranks of the members of ``process_group`` in group-rank order."""
    if not is_distributed():
        return [0]
    if process_group is None or process_group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return [dist.get_global_rank(process_group, r) for r in range(dist.get_world_size(process_group))]


def group_device(process_group: ProcessGroup | None = None) -> torch.device:
    """The device collectives of ``process_group`` run on (:func:`collective_device`).

    gloo (and any other CPU backend): the CPU. NCCL: the device the group is bound to
    (``init_process_group(device_id=...)``; sub-groups inherit it), else the current CUDA
    device — the rule PyTorch applies to the same group (``barrier`` and the object
    collectives in ``torch.distributed.distributed_c10d``). Each process picks its GPU
    before its first collective: ``torch.cuda.set_device(local_rank)`` (``distnorm-train``,
    Accelerate and the DeepSpeed engine do) or ``device_id=``; otherwise every rank of a
    node would use GPU 0.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    return collective_device(*_device_facts(group))


def _device_facts(group: ProcessGroup) -> tuple[str, torch.device | None, int | None]:
    """``group``'s backend, bound device and — only for an unbound NCCL group, so a CPU-only
    process never touches CUDA — the current CUDA device index."""
    backend = dist.get_backend(group)
    bound = getattr(group, "bound_device_id", None)
    current = torch.cuda.current_device() if backend == "nccl" and bound is None else None
    return backend, bound, current


def collective_device(backend: str, bound: torch.device | None, current_index: int | None,
                      input_device: torch.device | None = None, *, what: str = "distnorm") -> torch.device:
    """The device a group's collectives run on; with ``input_device``, also check that a
    tensor there can join them.

    Args:
        backend: the group's backend (``dist.get_backend``).
        bound: the group's ``bound_device_id`` (``init_process_group(device_id=...)``), or
            ``None``.
        current_index: ``torch.cuda.current_device()``; read only for an unbound NCCL group.
        input_device: where the tensor to reduce lives (a synchronized layer's input).
        what: who reduces, for the error (the layer and phase).

    Returns:
        The CPU for gloo and other CPU backends; for NCCL ``bound``, else
        ``cuda:current_index``.

    Raises:
        ValueError: NCCL and ``input_device`` is not that device. The consistency checks
            and buffer broadcasts run on the group's device while a training all-reduce runs
            on its tensor's: two GPUs for one rank (another rank's communicator, or a
            cross-device copy every step), so this is refused instead.
    """
    if backend != "nccl":
        return torch.device("cpu")
    if bound is not None:
        device, source = bound, "the device the group is bound to (init_process_group(device_id=...))"
    else:
        assert current_index is not None, "an unbound NCCL group needs the current CUDA device"
        device, source = torch.device("cuda", current_index), "the current CUDA device"
    if input_device is not None and input_device != device:
        raise ValueError(
            f"{what}: the tensor to all-reduce is on {input_device} (where its input is), but this "
            f"rank's NCCL process group runs its collectives on {device}, {source}. Give each process one GPU "
            "for both: call torch.cuda.set_device(local_rank) before creating the process group and put the "
            "model and its inputs on that device (or pass init_process_group(device_id=torch.device('cuda', "
            "local_rank))). This rank stops before the collective; ranks without this mistake wait in it until "
            "the process group's timeout, unless the launcher (torchrun, deepspeed) stops them first."
        )
    return device


# The groups whose device check passed, with the tensor devices it passed for: the check then
# costs one dictionary lookup per collective. Weak keys: a group dropped by the user is not kept
# alive (an NCCL communicator holds GPU memory).
_DEVICES_CHECKED: "weakref.WeakKeyDictionary[ProcessGroup, set[torch.device]]" = weakref.WeakKeyDictionary()


def check_collective_device(tensor: torch.Tensor, group: ProcessGroup, slot: str = "") -> None:
    """Raise ``ValueError`` (:func:`collective_device`) unless ``tensor`` may be reduced over
    ``group``: with NCCL it must sit on the group's device. ``slot`` (``"layer|phase|..."``)
    names who reduces. Host-side only — ``torch.device`` comparisons, no device op or sync —
    and done at the first collective of each group and tensor device; later ones cost one
    dictionary lookup (a ``torch.cuda.set_device`` after that first step is not seen)."""
    device = tensor.device
    seen = _DEVICES_CHECKED.get(group)
    if seen is not None and device in seen:
        return
    layer, phase = _slot_names(slot)
    collective_device(*_device_facts(group), device, what=f"{layer} ({phase})")
    _DEVICES_CHECKED.setdefault(group, set()).add(device)


def _slot_names(slot: str) -> tuple[str, str]:
    """The layer and phase of a collective slot ``"layer|phase|..."``, for messages."""
    layer, _, rest = slot.partition("|")
    return layer or "distnorm", rest.split("|")[0] if rest else "collective"


# Held weakly: torch's registry keeps each group until destroy_process_group, and a group kept
# past it keeps its backend's threads running into interpreter shutdown (distnorm._release).
_NORM_GROUPS: "weakref.WeakValueDictionary[tuple[int, ...], ProcessGroup]" = weakref.WeakValueDictionary()


def norm_group(process_group: ProcessGroup | None = None) -> ProcessGroup | None:
    """A communicator of its own for the normalization layers, with the ranks of
    ``process_group`` (default: every rank); ``None`` when not distributed.

    Collective: every rank of the default group must call it, in the same order (it is
    built with ``new_group``). One group per rank set is created and then reused.

    With NCCL each communicator has its own stream, so the layers' small backward
    all-reduces, which the input gradient waits for, do not queue behind the gradient
    buckets DDP / ZeRO launch on their communicator. It costs one more NCCL communicator
    (GPU memory for its buffers, a few seconds at start-up).
    """
    if not is_distributed():
        return None
    ranks = tuple(group_ranks(process_group))
    group = _NORM_GROUPS.get(ranks)
    if group is None:
        group = _NORM_GROUPS[ranks] = dist.new_group(list(ranks))
    return group


# ----------------------------------------------------------------------- agreement
def all_agree(values: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Element-wise: does every rank hold the same int64 ``values``? One MAX all-reduce of
    ``[v, ~v]`` of fixed size: all ranks agree iff both maxima come back unchanged (the
    maximum of ``~v`` is ``~min(v)``). Returns a bool tensor, identical on every rank."""
    probe = torch.cat([values, torch.bitwise_not(values)])
    with released(probe):
        dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
    k = values.numel()
    return (probe[:k] == values) & (probe[k:] == torch.bitwise_not(values))


def gather_tensors(tensor: torch.Tensor, group: ProcessGroup) -> list[torch.Tensor]:
    """Every rank's copy of ``tensor`` (same shape and dtype on every rank), tensor path."""
    device = group_device(group)
    local = tensor.detach().to(device).contiguous()
    flat = local.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    out = [torch.empty_like(flat) for _ in range(group_size(group))]
    with released(flat, *out):
        dist.all_gather(out, flat, group=group)
    return [o.to(tensor.dtype).reshape(tensor.shape).cpu() for o in out]


def gather_texts(text: str, group: ProcessGroup, limit: int = 4096) -> list[str]:
    """Every rank's ``text`` (UTF-8, cut at ``limit`` bytes) through fixed-size byte
    tensors: one MAX all-reduce of the length, then one all-gather."""
    device = group_device(group)
    data = text.encode()[:limit]
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    with released(length):
        dist.all_reduce(length, op=dist.ReduceOp.MAX, group=group)
    size = int(length.item())
    buf = torch.zeros(size + 8, dtype=torch.uint8)
    buf[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    buf[8 : 8 + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    parts = gather_tensors(buf.to(device), group)
    texts = []
    for p in parts:
        raw = bytes(p.tolist())
        n = int.from_bytes(raw[:8], "little")
        texts.append(raw[8 : 8 + n].decode(errors="replace"))
    return texts


# ------------------------------------------------------------------ reductions
def all_reduce_sum(tensor: torch.Tensor, group: ProcessGroup | None, *, slot: str = "",
                   shape: tuple[int, torch.dtype] = (0, torch.float64)) -> torch.Tensor:
    """Sum ``tensor`` in place over ``group`` (no-op for ``None``) and return it.

    The all-reduce is a checked frame (:mod:`distnorm._frames`): one size for every
    distnorm collective of the process, with every rank's fingerprint of ``slot``
    (``"layer|phase|..."``) and ``shape`` (the layer input's channels and dtype). Raises
    :class:`~distnorm.errors.CollectiveMismatchError` on every rank when ranks paired
    different slots (at once on the CPU; on a GPU a few collectives later, or at the
    plugin's next check)."""
    if group is None:
        return tensor
    # Before any collective, the debug fingerprint included: a tensor off the NCCL group's device.
    check_collective_device(tensor, group, slot)
    if _capture.capturing(tensor.device):  # the frame as compiled code runs it: compared on the device, logged
        _refuse_capture_of(group, slot)
        return tensor.copy_(traced_all_reduce_sum(tensor, group, slot=slot, shape=shape))
    try:
        _frames.reduce(tensor, group, slot, shape, dist.get_rank(group), group_size(group))
    except CollectiveMismatchError:
        raise  # every rank raises it: the frame it names completed everywhere
    except RuntimeError as err:  # DistBackendError included: a peer died or timed out
        layer, phase = _slot_names(slot)
        raise CollectiveFailedError(
            f"{layer}: the {phase} all-reduce failed on rank {dist.get_rank()} ({err}). Another rank "
            "probably died, stalled past the process group's timeout, or raised an error of its own; see its log."
        ) from err
    return tensor


def check_frames() -> None:
    """Compare the fingerprints of every layer collective not compared yet (a GPU's, waiting
    for them; :func:`distnorm._frames.check_pending`)."""
    _frames.check_pending()


def traced_all_reduce_sum(tensor: torch.Tensor, group: ProcessGroup | None, *, slot: str,
                          shape: tuple[int, torch.dtype]) -> torch.Tensor:
    """:func:`all_reduce_sum` as ``torch.compile`` traces it and a CUDA graph captures it: a
    new tensor (the functional all-reduce, :func:`distnorm._frames.traced_reduce`), ``tensor``
    itself for ``None``. The frame's fingerprints are compared on the device and a mismatch
    is kept for :func:`check_frames`; the device check of :func:`check_collective_device` is
    the eager path's (a host-side dictionary the graph cannot keep)."""
    if group is None:
        return tensor
    return _frames.traced_reduce(tensor, group, slot, shape, dist.get_rank(group), group_size(group))


def _refuse_capture_of(group: ProcessGroup, slot: str) -> None:
    """A collective being captured into a CUDA graph: NCCL only, and not in debug mode."""
    layer, phase = _slot_names(slot)
    backend = dist.get_backend(group)
    if backend != "nccl":
        raise RuntimeError(
            f"{layer}: the {phase} all-reduce is being captured into a CUDA graph, but its process group runs on "
            f"{backend}, whose collectives run on the host and cannot be captured. Use the nccl backend for CUDA "
            "graphs, or train without capturing (torch.compile's default mode fuses the layers without CUDA graphs).")
    refuse_debug_mode(layer)


def refuse_debug_mode(layer: str) -> None:
    if _debug.is_debug():
        raise RuntimeError(
            f"{layer}: distnorm.debug() reads every collective's fingerprint and the batch statistics on the host "
            "at each step, which a compiled graph or a captured CUDA graph cannot do. Debug the model eagerly "
            "(without torch.compile and without CUDA-graph capture), or leave debug mode off.")


def broadcast_from_first(tensors: list[torch.Tensor], group: ProcessGroup | None) -> None:
    """Overwrite ``tensors`` in place with the copies of the group's first rank.

    One broadcast per tensor (they are per-channel vectors: few and small), each on the
    group's device.
    """
    if group is None:
        return
    src = group_ranks(group)[0]
    device = group_device(group)
    for t in tensors:
        if t.device == device:
            with released(t):
                dist.broadcast(t, src=src, group=group)
        else:
            staged = t.detach().to(device)
            with released(staged):
                dist.broadcast(staged, src=src, group=group)
            t.copy_(staged)


# ------------------------------------------------------------ agreement of texts
def assert_same_across_ranks(
    text: str,
    what: str,
    process_group: ProcessGroup | None = None,
    *,
    error: type[Exception] = InconsistentStateError,
) -> None:
    """Raise ``error`` on every rank unless every rank passes the same ``text``.

    One fixed-size all-reduce of a hash (so differing inputs cannot become differently
    sized collectives); only on a mismatch are the texts gathered to say who differs. Texts
    made of ``key = value`` lines (a flattened configuration) are reported as the keys that
    differ, each with every rank's value; other texts as each group of ranks' text.
    """
    group = sync_group(process_group)
    if group is None:
        return
    device = group_device(group)
    value = torch.tensor([stable_hash(text)], dtype=torch.int64, device=device)
    if bool(all_agree(value, group).all()):
        return
    groups: dict[str, list[int]] = {}
    for rank, t in zip(group_ranks(group), gather_texts(text, group, limit=1 << 20)):
        groups.setdefault(t, []).append(rank)
    keyed = _describe_keys(groups)
    if keyed is not None:
        raise error(f"{what} differs across ranks in {keyed}")
    raise error(f"{what} differs across ranks:\n{_describe_groups(groups)}")


def _rank_list(ranks: list[int]) -> str:
    """``rank 3`` / ``ranks 0-6, 9``."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _describe_keys(groups: dict[str, list[int]], shown: int = 20) -> str | None:
    """Texts made of ``key = value`` lines (a flattened configuration) as the keys that differ,
    each with its value per group of ranks; ``None`` for any other text."""
    import re

    parsed = []
    for text, members in groups.items():
        pairs = [re.match(r"^(\S+) = (.*)$", line) for line in text.splitlines()]
        if not pairs or None in pairs:
            return None
        parsed.append(({m[1]: m[2] for m in pairs}, members))
    keys = list(dict.fromkeys(k for values, _ in parsed for k in values))
    differing = [k for k in keys if len({values.get(k) for values, _ in parsed}) > 1]
    if not differing:
        return None
    lines = []
    for key in differing[:shown]:
        by_value: dict[str, list[int]] = {}
        for values, members in parsed:
            by_value.setdefault(values.get(key, "(not set)"), []).extend(members)
        lines.append(f"  {key}: " + "; ".join(f"{_rank_list(m)}: {v}" for v, m in by_value.items()))
    more = f"\n  ... {len(differing) - shown} more" if len(differing) > shown else ""
    return f"{len(differing)} key{'s' if len(differing) > 1 else ''}:\n" + "\n".join(lines) + more


def _describe_groups(groups: dict[str, list[int]]) -> str:
    """Each group of ranks with its text; long texts as the lines that differ from the first
    group's (a model listing of hundreds of lines that differs in one)."""
    import difflib

    items = list(groups.items())
    if all("\n" not in t and len(t) <= 500 for t, _ in items):
        return "\n".join(f"  ranks {members}: {t}" for t, members in items)
    (ref, ref_ranks), out = items[0], []
    out.append(f"  ranks {ref_ranks}: {len(ref.splitlines())} lines")
    for t, members in items[1:]:
        diff = [line for line in difflib.unified_diff(ref.splitlines(), t.splitlines(), lineterm="", n=0)
                if not line.startswith(("---", "+++", "@@"))]
        shown = "\n".join(f"      {line}" for line in diff[:12]) + (f"\n      ... {len(diff) - 12} more" if len(diff) > 12 else "")
        out.append(f"  ranks {members}: differs from ranks {ref_ranks} in (- theirs, + these ranks'):\n{shown}")
    return "\n".join(out)
