"""Every collective distnorm issues lives in this module.

Layers never call ``torch.distributed`` themselves: they ask here for the group to
synchronize over (``None`` means "run locally") and for the packed reductions. Keeping the
collectives in one place makes the per-step communication easy to audit:

* forward of a synchronized layer: :func:`global_moments` — ONE all-reduce of a ``(3, C)``
  float64 payload (per-channel sum, sum of squares and sample count); at a group's first
  CBN / BN step the count row also carries the ranks' vote on the fused operators' kernels
  (:mod:`distnorm._fused`), in the same values;
* backward: :func:`all_reduce_sum` — ONE all-reduce of the ``(2, C)`` per-channel gradient
  sums;
* each of these travels in a frame (:mod:`distnorm._frames`): one size for every distnorm
  all-reduce of the process, with every rank's fingerprint of its layer and phase, so ranks
  that run different layers raise :class:`~distnorm.errors.CollectiveMismatchError`
  instead of mixing statistics, aborting or hanging;
* BNP (``distnorm.bnp``) reuses :func:`global_moments` on each layer's input;
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

import hashlib
import os
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from distnorm import _debug, _frames
from distnorm._release import released
from distnorm.errors import (
    CollectiveFailedError,
    CollectiveMismatchError,
    InconsistentStateError,
    NonFiniteStatisticsError,
)

__all__ = [
    "Moments",
    "accumulate_dtype",
    "all_agree",
    "assert_same_across_ranks",
    "all_reduce_sum",
    "broadcast_from_first",
    "capturing",
    "check_collective_device",
    "check_frames",
    "collective_device",
    "constant",
    "gather_tensors",
    "gather_texts",
    "global_moments",
    "group_device",
    "group_ranks",
    "group_size",
    "local_moments",
    "norm_group",
    "refuse_capture",
    "stable_hash",
    "sync_group",
    "traced_all_reduce_sum",
    "traced_moments",
]

ProcessGroup = dist.ProcessGroup if dist.is_available() else object


class Moments(NamedTuple):
    """Per-channel statistics of a (possibly distributed) batch, in the accumulation dtype.

    Attributes:
        count: values per channel over every rank — a Python ``int`` when it is known on
            the host (local statistics), else a ``(C,)`` tensor (the same count repeated).
        mean: per-channel mean.
        var: per-channel biased variance ``mean((x - mean)**2)``.
        valid: whether the global batch has more than one value per channel — ``True``
            when the host knows it (this rank alone has more than one), else a ``(C,)``
            bool tensor computed from the all-reduced count (identical on every rank).
    """

    count: int | torch.Tensor
    mean: torch.Tensor
    var: torch.Tensor
    valid: bool | torch.Tensor


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
    size = group_size(process_group)
    if size <= 1 and not (size == 1 and _ONE_RANK_GROUPS[0] and is_distributed()):
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


def accumulate_dtype(x: torch.Tensor) -> torch.dtype:
    """dtype in which per-channel statistics are accumulated: float64 for float64, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def stable_hash(text: str) -> int:
    """A 63-bit hash of ``text`` that is the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


_CONSTANTS: dict[tuple[float, int, torch.dtype, torch.device], torch.Tensor] = {}


def constant(value: float, channels: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached, read-only ``(channels,)`` tensor filled with ``value`` (no op per step).

    Under ``torch.compile`` a fill in the graph instead, which Inductor folds into the kernels
    that read it: a cache entry made while tracing would change the dictionary the graph's
    guards read, and recompile the graph at its next call."""
    if torch.compiler.is_compiling():
        return torch.full((channels,), value, dtype=dtype, device=device)
    key = (value, channels, dtype, device)
    t = _CONSTANTS.get(key)
    if t is None:
        t = torch.full((channels,), value, dtype=dtype, device=device)
        if not capturing(device):  # a fill captured into a CUDA graph has not run yet: not for eager steps
            _CONSTANTS[key] = t
    return t


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
def _check_slot(group: ProcessGroup, slot: str, device: torch.device) -> None:
    """Debug mode: verify that every rank is entering the same collective slot.

    One fixed-size MAX all-reduce of a fingerprint (:func:`all_agree`), so this check itself
    cannot deadlock on mismatched shapes; the slots are gathered only on a mismatch.
    """
    h = torch.tensor([stable_hash(slot)], dtype=torch.int64, device=device)
    if bool(all_agree(h, group).all()):
        return
    listing = "\n".join(f"  rank {r}: {s}" for r, s in zip(group_ranks(group), gather_texts(slot, group)))
    raise CollectiveMismatchError(
        "ranks entered the same distnorm collective from different places "
        "(layer | phase | channels | dtype):\n"
        f"{listing}\n"
        "Every rank must run the same model on inputs of the same dtype and channel count."
    )


def capturing(device: torch.device) -> bool:
    """Whether work on ``device`` is being captured into a CUDA graph (``torch.cuda.graph``,
    ``torch.cuda.make_graphed_callables``, and ``torch.compile(mode="reduce-overhead")``'s
    recording): the layers then take the decisions a replay can keep (:mod:`distnorm._functions`,
    :func:`all_reduce_sum`). One host call on a CUDA device, none elsewhere."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def refuse_capture(device: torch.device, what: str) -> None:
    """Raise while ``device``'s work is being captured: ``what`` (a step that reads the device
    on the host) cannot be recorded into a CUDA graph, and a step before capture does it."""
    if capturing(device):
        raise RuntimeError(
            f"distnorm: {what} reads the device on the host, which a CUDA graph cannot capture. Run one training "
            "step before capturing (the warm-up torch.cuda.graph's documentation prescribes, on a side stream): "
            "it does this once, and every captured step after it replays without it.")


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
    if capturing(tensor.device):  # the frame as compiled code runs it: compared on the device, logged
        _refuse_capture_of(group, slot)
        return tensor.copy_(traced_all_reduce_sum(tensor, group, slot=slot, shape=shape))
    if _debug.is_debug():
        _check_slot(group, slot, tensor.device)
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


def local_moments(x: torch.Tensor, cpu_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance of a non-empty ``(N, C, *)`` tensor, in the
    accumulation dtype.

    ATen's batch-norm statistics kernel (any memory format, CPU and CUDA); with
    ``cpu_kernel`` (a CPU tensor; :func:`distnorm._fused.cpu_kernel_decision`) its twin
    ``distnorm::batch_norm_update_stats`` (same schema and arithmetic, faster for
    contiguous float32: :mod:`distnorm._cpu_kernels`).
    Kernel contract: the CUDA kernel returns accumulation-dtype statistics for any
    input; the CPU kernel does so for fp16/bf16 inputs only when given float32 "running"
    buffers, which select its mixed-precision path. Both devices therefore get float32
    scratch buffers (momentum 0: their values are never read back) for fp16/bf16 inputs,
    and none for float32/float64, where both return the input dtype already.
    """
    acc = accumulate_dtype(x)
    on_cpu = cpu_kernel and x.device.type == "cpu"
    stats = torch.ops.distnorm.batch_norm_update_stats if on_cpu else torch.ops.aten.batch_norm_update_stats
    if x.dtype == acc:
        mean, var = stats(x, None, None, 0.0)
    else:
        channels = x.shape[1]
        scratch = _scratch(channels, x.device)
        mean, var = stats(x, scratch[0], scratch[1], 0.0)
    return mean, var


_SCRATCH: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(channels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (channels, device)
    if key not in _SCRATCH:
        scratch = (torch.zeros(channels, device=device), torch.ones(channels, device=device))
        if capturing(device):  # its fills have not run yet: not for eager steps (and never read back)
            return scratch
        _SCRATCH[key] = scratch
    return _SCRATCH[key]


def global_moments(x: torch.Tensor, group: ProcessGroup | None, *, layer: str = "",
                   training: bool = True, piggyback: torch.Tensor | None = None, cpu_kernel: bool = False) -> Moments:
    """Per-channel count, mean and biased variance of ``x`` over every rank of ``group``.

    Local (``group is None``): the Welford statistics of :func:`local_moments`, count known
    on the host. Synchronized: ONE all-reduce of ``n_r * [m_r, v_r + m_r**2, 1]`` in
    float64, ``m_r``, ``v_r`` being this rank's Welford statistics, then
    ``var = sum(n_r (v_r + m_r^2)) / n - mean^2``. In float64 this cancellation costs about
    ``1e-16 * (mean/std)^2`` relative — nothing next to the float32 rounding of ``x`` — and
    the count rides along as a third row (repeated per channel, so every later step is
    element-wise). Unequal batch sizes are weighted exactly; an empty rank contributes
    zeros and still joins the collective.

    The synchronized result is identical on every rank (computed from the same reduced
    tensor), which is what keeps every buffer derived from it bit-identical without
    broadcasts. Ranks that hold more than one value per channel know the global batch is
    valid without reading the count; the others get the mask as a tensor.

    ``piggyback``: a float64 ``(k,)`` tensor of small integers on ``x``'s device, ``k < C``,
    summed over the group in the same all-reduce and overwritten with the sums — how a group
    agrees once on something without a collective of its own, or a byte more
    (:func:`distnorm._fused.triton_vote`). It rides on the count row, whose ``C`` entries are
    copies of one integer: entry ``i`` is added to channel ``i``'s count and taken out again
    after the reduction from channel ``k``'s, exactly (integers below ``2**53`` in float64).
    Every rank must pass one at the same call, or none.

    ``cpu_kernel``: the local moments of a CPU tensor come from distnorm's C kernel
    (:func:`local_moments`); every rank of ``group`` must pass the same value, which
    :func:`distnorm._fused.cpu_kernel_decision` gives.
    """
    channels = x.shape[1]
    acc = accumulate_dtype(x)
    local_count = x.numel() // channels if channels else 0
    if _debug.is_debug() and capturing(x.device):
        _refuse_debug_mode(layer)  # its checks read the statistics on the host
    if group is None:
        if local_count == 0:  # kernel contract: CUDA's statistics kernel rejects N = 0
            mean, var = torch.zeros(2, channels, dtype=acc, device=x.device).unbind()  # two tensors, not one
            return Moments(0, mean, var, False)
        mean, var = local_moments(x, cpu_kernel)
        if _debug.is_debug():
            _check_statistics(torch.stack([mean.double(), var.double()]), layer, training, float(local_count))
        return Moments(local_count, mean, var, local_count > 1)

    packed = _packed(local_moments(x, cpu_kernel) if local_count > 0 else None, local_count, channels, x.device)
    if piggyback is not None:
        k = piggyback.numel()
        packed[2, :k] += piggyback
    all_reduce_sum(packed, group, slot=f"{layer}|forward|C={channels}|{x.dtype}", shape=(channels, x.dtype))
    if piggyback is not None:
        torch.sub(packed[2, :k], packed[2, k], out=piggyback)
        packed[2, :k] = packed[2, k]
    if _debug.is_debug():
        _check_statistics(packed[:2], layer, training, float(packed[2, 0]) if channels else 0.0)
    return _unpacked(packed, local_count, acc)


def _packed(moments: tuple[torch.Tensor, torch.Tensor] | None, local_count: int, channels: int,
            device: torch.device) -> torch.Tensor:
    """The statistics all-reduce's payload ``n_r * [m_r, v_r + m_r**2, 1]`` (float64, ``(3,
    C)``) from this rank's ``(mean, var)``, or zeros for a rank without samples."""
    if moments is None:
        return torch.zeros(3, channels, dtype=torch.float64, device=device)
    mean, var = moments
    m64 = mean.double()
    packed = torch.stack([m64, torch.addcmul(var, m64, m64), constant(1.0, channels, torch.float64, device)])
    return packed.mul_(local_count)


def _unpacked(packed: torch.Tensor, local_count: int, acc: torch.dtype) -> Moments:
    """The global :class:`Moments` from the all-reduced payload of :func:`_packed`."""
    count = packed[2]
    # Only a rank with at most one value of its own can see an all-empty global batch:
    # elsewhere the count is >= 2 and needs no guard against 0 / 0.
    ratios = packed / (count if local_count > 1 else count.clamp_min(1.0))  # [mean, E[x^2], 1]
    mean, ex2, _ = ratios.unbind()
    var = torch.addcmul(ex2, mean, mean, value=-1.0).clamp_min_(0.0)
    valid: bool | torch.Tensor = True if local_count > 1 else count > 1
    return Moments(count.to(acc), mean.to(acc), var.to(acc), valid)


def traced_moments(x: torch.Tensor, group: ProcessGroup | None, layer: str) -> Moments:
    """:func:`global_moments` as ``torch.compile`` traces it and a CUDA graph replays it: the
    local statistics as ATen's ``var_mean`` (a reduction Inductor generates and fuses with
    what produced ``x``), the same float64 payload, ONE functional all-reduce in a frame
    (:func:`traced_all_reduce_sum`). No host decision depends on a value: the kernel vote
    of the eager path is not needed (the compiler chooses every kernel, the same on every
    rank), nor possible (it reads the vote on the host)."""
    _refuse_debug_mode(layer)
    channels = x.shape[1]
    acc = accumulate_dtype(x)
    local_count = x.numel() // channels if channels else 0
    local = None
    if local_count > 0:
        dims = [0, *range(2, x.dim())]
        var, mean = torch.var_mean(x.to(acc), dims, correction=0)
        local = (mean, var)
    if group is None:
        if local is None:
            mean, var = torch.zeros(2, channels, dtype=acc, device=x.device).unbind()
            return Moments(0, mean, var, False)
        # A branch, not bool(): with a dynamic batch size (automatic dynamic shapes,
        # dynamic=True) the count is a symbol, and Dynamo guards on a branch's condition
        return Moments(local_count, local[0], local[1], True if local_count > 1 else False)
    packed = traced_all_reduce_sum(_packed(local, local_count, channels, x.device), group,
                                   slot=f"{layer}|forward|C={channels}|{x.dtype}", shape=(channels, x.dtype))
    return _unpacked(packed, local_count, acc)


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
    _refuse_debug_mode(layer)


def _refuse_debug_mode(layer: str) -> None:
    if _debug.is_debug():
        raise RuntimeError(
            f"{layer}: distnorm.debug() reads every collective's fingerprint and the batch statistics on the host "
            "at each step, which a compiled graph or a captured CUDA graph cannot do. Debug the model eagerly "
            "(without torch.compile and without CUDA-graph capture), or leave debug mode off.")


def _check_statistics(sums: torch.Tensor, layer: str, training: bool, count: float) -> None:
    """Debug mode: raise on non-finite statistics or a degenerate global training batch."""
    finite = torch.isfinite(sums)
    if not bool(finite.all()):
        bad = (~finite).any(0).nonzero().flatten().tolist()
        raise NonFiniteStatisticsError(
            f"{layer}: non-finite batch statistics in channels {bad[:16]}"
            f"{' ...' if len(bad) > 16 else ''}; the layer's input already contains NaN/Inf "
            "(look at the layer before it, the learning rate, or the loss scale)"
        )
    if training and count <= 1:
        raise ValueError(
            f"{layer}: expected more than 1 value per channel when training, got a global "
            f"batch of {count:g} values per channel; increase the batch size or put the model "
            "in eval() mode"
        )


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
