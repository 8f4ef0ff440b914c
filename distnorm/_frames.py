"""Frames: the statistics collectives of the synchronized layers, checked on every rank.

A rank that runs the model's layers in another order or number (a branch taken on one rank
only) pairs its collectives with the wrong ones of the other ranks: collectives match by
the order they are issued, never by layer. Unchecked, that mixes unrelated statistics
silently (same sizes), or hands the backend a collective of mismatched sizes (gloo aborts
the process; NCCL may hang until its timeout). A frame rules out both:

* **One size.** Every distnorm collective of a process — forward statistics, backward
  sums, BNP's statistics, the trainer's small reductions — is one float64 tensor of the
  same length: the payload, padded to the widest payload any synchronized layer of this
  process reserved at construction (:func:`reserve`), then the header. Whatever two ranks
  pair, the backend sees a well-formed all-reduce.
* **A fingerprint per rank.** The header has one entry per rank of the group for the slot
  (``layer|phase``, a 52-bit hash) and one for the shape (channels and dtype); rank ``r``
  writes entry ``r``, zeros elsewhere, so the sum hands every rank every rank's
  fingerprint, exactly (integers below ``2**53`` in float64). No extra collective: the
  header travels in the all-reduce the layer issues anyway (``2 * group_size`` float64).
* **Checked where the host already waits.** On the CPU (gloo) the host waited for the
  all-reduce: the header is compared at once, and every rank raises at the same collective
  (they all summed the same header). On a GPU, reading it would be a host
  synchronisation: the header is copied to pinned memory behind the all-reduce, and each
  later frame compares those that have arrived (``Event.query``, never a wait); the
  plugin's periodic check (:func:`check_pending`, at a step where it synchronises anyway)
  compares the rest. A rank that finds a bad frame raises from the fingerprints alone —
  no collective on the error path — naming every rank's layer: ranks that had run ahead
  find the same bad frame, which every rank issued, among their completed ones.

The error names layers by the slot texts this process knows: the slots it issued and the
layer names :func:`add_name_source` callbacks return (a layer another rank ran and this one
never did is named if it is in this process's model). Layers are told apart by name: a model's
layers by their qualified names (``distnorm.set_lr``, ``distnorm.name_layers``,
``distnorm.convert``, the plugin name them), a bare layer by the order the process built it
(``CBN(64) #3``).
"""

from __future__ import annotations

import collections
import hashlib
from typing import Callable, Iterable, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from distnorm._debug import is_debug
from distnorm._release import released
from distnorm.errors import CollectiveMismatchError

__all__ = ["VOTE", "add_name_source", "check_pending", "compare_at_once", "frame_length", "reduce", "reserve",
           "slot_hash", "stable_hash", "traced_reduce"]

#: dtype codes of the shape entry (the input's dtype is part of the slot).
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

_WIDTH = [0]  # the longest payload reserved in this process (float64 elements)


def reserve(channels: int, rows: int = 3) -> None:
    """A synchronized layer of ``channels`` channels exists in this process: frames hold its
    ``rows x channels`` statistics (3: sum, sum of squares, count). Called at construction,
    so that ranks building the same model size every frame alike from its first step."""
    _WIDTH[0] = max(_WIDTH[0], rows * int(channels))


def frame_length(payload: int) -> int:
    """Payload elements of a frame carrying ``payload``: the process's reserved width, or
    more for a payload wider than every layer built (a functional call), which then widens
    the later frames too — the same on every rank that runs the same calls."""
    reserve(payload, rows=1)
    return _WIDTH[0]


def stable_hash(text: str) -> int:
    """A 63-bit hash of ``text`` that is the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def slot_hash(slot: str) -> int:
    """The fingerprint of a slot's ``layer|phase``: :func:`stable_hash` cut to 52 bits (exact
    in a float64 header), never 0 (0 is "no rank here")."""
    return 1 + (stable_hash("|".join(slot.split("|")[:2])) >> 11)


def _shape_code(channels: int, dtype: torch.dtype) -> int:
    return 1 + channels * len(_DTYPES) + (_DTYPES.index(dtype) if dtype in _DTYPES else 0)


def _describe_shape(code: int) -> str:
    if code <= 0:
        return "?"
    channels, index = divmod(code - 1, len(_DTYPES))
    return f"C={channels}, {str(_DTYPES[index]).replace('torch.', '')}"


# ------------------------------------------------------------------------ names
_NAME_SOURCES: list[Callable[[], Iterable[str]]] = []
_ISSUED: dict[int, str] = {}  # hash -> "layer|phase" of the slots this process issued


def add_name_source(source: Callable[[], Iterable[str]]) -> None:
    """Register a callable returning the names of this process's layers (read on error only)."""
    _NAME_SOURCES.append(source)


#: The phase of a group's vote on its kernels (distnorm._kernel_choice), once per group and
#: device type, in the frame of the layer that stepped first.
VOTE = "kernel vote"


def _name_of(fingerprint: int) -> str:
    if fingerprint in _ISSUED:
        return _ISSUED[fingerprint]
    phases = ("forward", "backward", VOTE)
    for source in _NAME_SOURCES:
        for name in source():
            for text in [f"{name}|{p}" for p in phases] + [f"BNP '{name}'|{p}" for p in ("forward", VOTE)]:
                if slot_hash(text) == fingerprint:
                    return text
    return f"a collective this process never issued (fingerprint {fingerprint:#x})"


# ------------------------------------------------------------------------ frames
class _Header(NamedTuple):
    mine: torch.Tensor  # (2p,) on the device: this rank's entries, zeros elsewhere
    expected: torch.Tensor  # (2p,) on the device: every rank's entries equal to this rank's
    expected_host: torch.Tensor  # the same on the CPU, compared with a GPU frame's copy
    slot: str


_HEADERS: dict[tuple, _Header] = {}


def _header(slot: str, shape: tuple[int, torch.dtype], rank: int, size: int, device: torch.device) -> _Header:
    """The cached header tensors of a slot: made once (a layer's forward makes its backward's
    too, so a step's ops are the same from the first backward on), from fills, never from a
    host-to-device copy."""
    key = (slot, shape, rank, size, device)
    if key not in _HEADERS:
        layer, _, rest = slot.partition("|")
        phase, _, detail = rest.partition("|")
        for each in ("forward", "backward") if phase in ("forward", "backward") else (phase,):
            text = "|".join(part for part in (layer, each, detail) if part) if rest else slot
            _HEADERS[(text, shape, rank, size, device)] = _make_header(text, shape, rank, size, device)
    return _HEADERS[key]


def _make_header(slot: str, shape: tuple[int, torch.dtype], rank: int, size: int, device: torch.device) -> _Header:
    fingerprint, code = float(slot_hash(slot)), float(_shape_code(*shape))
    mine = torch.zeros(2 * size, dtype=torch.float64, device=device)
    mine[rank], mine[size + rank] = fingerprint, code
    expected_host = torch.full((2 * size,), fingerprint, dtype=torch.float64)
    expected_host[size:] = code
    expected = expected_host if device.type == "cpu" else torch.full_like(mine, fingerprint).index_fill_(
        0, torch.arange(size, 2 * size, device=device), code)
    _ISSUED.setdefault(slot_hash(slot), "|".join(slot.split("|")[:2]))
    _log(str(device), size)  # made here, by the eager steps before any CUDA-graph capture
    return _Header(mine, expected, expected_host, slot)


class _Frame(NamedTuple):
    """A slot's frame, kept across steps with views made once: each collective then costs
    four ops besides the all-reduce (payload in, header in, payload out, compare)."""

    whole: torch.Tensor  # (length + 2p,) float64
    payload: torch.Tensor  # the first numel elements, viewed in the payload's shape
    header: torch.Tensor  # the last 2p elements


_FRAMES: dict[tuple, _Frame] = {}


def _frame(tensor: torch.Tensor, slot: str, size: int) -> _Frame:
    length = frame_length(tensor.numel())
    key = (slot, tuple(tensor.shape), length, size, tensor.device)
    frame = _FRAMES.get(key)
    if frame is None:
        # torch.empty: the padding is never read, its values do not matter
        whole = torch.empty(length + 2 * size, dtype=torch.float64, device=tensor.device)
        frame = _FRAMES[key] = _Frame(whole, whole[: tensor.numel()].view(tensor.shape), whole[length:])
    return frame


def reduce(tensor: torch.Tensor, group: "dist.ProcessGroup", slot: str, shape: tuple[int, torch.dtype],
           rank: int, size: int) -> torch.Tensor:
    """All-reduce (sum) ``tensor`` in place over ``group`` inside a checked frame.

    ``shape``: ``(channels, dtype)`` of the layer's input, part of the fingerprint; ``rank``
    and ``size``: this process's rank in ``group`` and the group's size. Raises
    :class:`CollectiveMismatchError` when the frame (on the CPU) or an earlier one (on a GPU)
    was paired with another slot or shape on some rank.

    The frame is the slot's own, reused at every step: stream order on a GPU (and the host's
    wait on the CPU) puts each step's writes after the last step's reads.
    """
    header = _header(slot, shape, rank, size, tensor.device)
    if is_debug():
        # The header first, alone: its size is the group's, so ranks whose frames would differ
        # in width (they built layers of other widths) are named here, not by the backend.
        alone = header.mine.clone()
        with released(alone):
            dist.all_reduce(alone, op=dist.ReduceOp.SUM, group=group)
        if not torch.equal(alone, header.expected):
            _raise(alone)
    frame = _frame(tensor, slot, size)
    frame.payload.copy_(tensor)
    frame.header.copy_(header.mine)
    with released(frame.whole):  # gloo's worker lets go of the frame before we go on
        dist.all_reduce(frame.whole, op=dist.ReduceOp.SUM, group=group)
    tensor.copy_(frame.payload)
    if compare_at_once(tensor.device):
        if not torch.equal(frame.header, header.expected):
            _raise(frame.header)
    else:
        _PENDING.record(frame.header, header)
    return tensor


def compare_at_once(device: torch.device) -> bool:
    """Whether a frame's header is compared as soon as its all-reduce returns: on the CPU,
    where the host waited for it (gloo) and the comparison reads no device, and in debug mode
    (:mod:`distnorm._debug`) everywhere, where a host synchronisation per collective is the
    price of the error at the collective that went wrong. Elsewhere it is deferred
    (:class:`_Pending`). The tests count the deferred path's ops on the CPU by answering
    ``False``."""
    return device.type == "cpu" or is_debug()


def _raise(received: torch.Tensor) -> None:
    values = [int(v) for v in received.tolist()]  # the error path: a host read is fine here
    size = len(values) // 2
    lines = [f"  rank {r}: {_name_of(values[r])} ({_describe_shape(values[size + r])})" for r in range(size)]
    raise CollectiveMismatchError(
        "ranks paired a distnorm collective from different layers, phases or shapes; what each rank "
        "of the group ran:\n" + "\n".join(lines) + "\n"
        "Every rank must run the same synchronized layers in the same order: a branch taken on some "
        "ranks only (a layer skipped, another layer run, another channel count) pairs statistics "
        "that do not belong together. Make the branch the same on every rank, or build the layers "
        "that may differ with sync=False. (A layer no model named is named by the order its process "
        "built it, 'CBN(64) #3': where ranks built different layers before, name the model's with "
        "distnorm.name_layers(model) or distnorm.set_lr.)"
    )


class _Pending:
    """GPU frames whose headers are on their way to pinned host memory, oldest first."""

    LIMIT = 4096  # frames kept unchecked at most: beyond, the oldest is waited for

    def __init__(self) -> None:
        self._frames: collections.deque = collections.deque()

    def record(self, received: torch.Tensor, header: _Header) -> None:
        if received.is_cuda:
            # Behind the all-reduce on the stream: a copy to pinned memory, then an event the
            # host polls. Nothing waits. Both on the frame's device, which need not be the
            # current one (init_process_group(device_id=...) sets none; gloo takes any GPU's
            # tensors): the copy runs on its source's current stream (ATen's device-to-host
            # copy), so the event goes on that stream too -- on the current device's it
            # would be done at once and the host would compare bytes not yet copied -- and
            # nothing here touches, or opens a context on, another GPU.
            with torch.cuda.device(received.device):
                host = torch.empty(received.shape, dtype=received.dtype, pin_memory=True)
                host.copy_(received, non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(received.device))
        else:
            # Deferred on the CPU (compare_at_once answered False, as the tests do): taken as
            # still on its way until a check waits for it, like a GPU far behind its host,
            # the latest a mismatch can surface.
            host, event = received.clone(), None  # the frame is overwritten at the next step
        self._frames.append((event, host, header))
        self.check()
        while len(self._frames) > self.LIMIT:
            self._check_oldest(wait=True)

    def check(self, wait: bool = False) -> None:
        """Compare the headers that have arrived, oldest first (with ``wait``: all of them,
        waiting for each; a bad one raises before any later frame is waited for)."""
        while self._frames and self._check_oldest(wait):
            pass

    def _check_oldest(self, wait: bool) -> bool:
        event, host, header = self._frames[0]
        if event is None or not event.query():
            if not wait:
                return False
            if event is not None:
                event.synchronize()
        self._frames.popleft()
        if not torch.equal(host, header.expected_host):
            self._frames.clear()
            _raise(host)
        return True

    def __len__(self) -> int:
        return len(self._frames)


_PENDING = _Pending()


def check_pending() -> None:
    """Compare every frame still unchecked (GPU), waiting for them, and read the logs of the
    compiled and captured collectives (:func:`traced_reduce`): the plugin's periodic check
    calls it at a step where it synchronises anyway. Raises :class:`CollectiveMismatchError`
    naming each rank's layer. Free on the CPU without compiled collectives (nothing
    pending: gloo frames are checked as they return)."""
    _PENDING.check(wait=True)
    _check_logs()


# ------------------------------------------------------------------ traced frames
def _marked_constant(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result(fn)`` without importing ``torch._dynamo`` (2 s)
    when distnorm is imported: that decorator only sets this attribute
    (``torch/_dynamo/decorators.py``, ``assume_constant_result``; ``tests/test_compile.py``
    checks that it still does). Dynamo then calls ``fn`` while tracing and puts its result in
    the graph as a constant: no guard on what ``fn`` reads, no graph op for it."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@_marked_constant
def _fingerprint(slot: str) -> int:
    """The slot's fingerprint (:func:`slot_hash`: a hash the compiler cannot trace). An
    integer below ``2**53``: exact in the float64 header, and a constant to Dynamo (a float
    would become an input of the graph). The shape code is plain arithmetic, traced: with a
    dynamic shape the channel count is a symbol, which a trace-time constant cannot take."""
    _ISSUED.setdefault(slot_hash(slot), "|".join(slot.split("|")[:2]))
    return slot_hash(slot)


#: Per device and group size, the first mismatched frame a traced or captured collective
#: received (:func:`traced_reduce`): ``[1, header...]``, zeros while none.
_LOGS: dict[tuple[str, int], torch.Tensor] = {}


@_marked_constant
def _log(device: str, size: int) -> torch.Tensor:
    """The frame log of ``device`` for groups of ``size`` ranks: made once, outside any
    graph (a constant of the compiled graphs, a static address for CUDA graphs), and
    written by the graphs on the device."""
    key = (device, size)
    if key not in _LOGS:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("distnorm: a synchronized layer's first collective on this device is being captured "
                               "into a CUDA graph; run one training step before capturing (as torch.cuda.graph's "
                               "warm-up on a side stream does), so that its frame log exists outside the graph")
        _LOGS[key] = torch.zeros(1 + 2 * size, dtype=torch.float64, device=device)
    return _LOGS[key]


def traced_reduce(tensor: torch.Tensor, group: "dist.ProcessGroup", slot: str, shape: tuple[int, torch.dtype],
                  rank: int, size: int) -> torch.Tensor:
    """:func:`reduce` for a compiled graph or a captured CUDA graph: the same frame (payload
    padded to the process's width, then the header of every rank's fingerprint), summed by
    ONE functional all-reduce (``torch.distributed._functional_collectives``: traced by
    ``torch.compile`` as a collective, and captured by CUDA graphs on NCCL), and the sum of
    ``tensor`` returned as a new tensor.

    Reading the header on the host would stop the graph, so it is compared on the device,
    and the first mismatched header is written to the device's frame log (:func:`_log`);
    :func:`check_pending` reads the logs and raises :class:`CollectiveMismatchError` from
    them, naming every rank's layer, as the eager path does."""
    numel, device = tensor.numel(), tensor.device
    # The process's frame width, read (a graph guards on it: a layer built later that widens the
    # frames recompiles the graph, on every rank that builds it) and never written while traced.
    length, fingerprint, code = max(_WIDTH[0], numel), _fingerprint(slot), _shape_code(*shape)
    # Fills of slices, never an indexed assignment: that copies a host scalar, which CUDA-graph
    # capture refuses ("Cannot copy between CPU and CUDA tensors during CUDA graph capture").
    header = torch.zeros(2 * size, dtype=torch.float64, device=device)
    header.narrow(0, rank, 1).fill_(fingerprint)
    header.narrow(0, size + rank, 1).fill_(code)
    whole = torch.cat([tensor.reshape(-1).to(torch.float64), header.new_zeros(length - numel), header])
    whole = funcol.all_reduce(whole, "sum", group)
    received = whole[length:]
    expected = torch.full((2 * size,), fingerprint, dtype=torch.float64, device=device)
    expected.narrow(0, size, size).fill_(code)
    log = _log(str(device), size)
    first = (received != expected).any() & (log[:1] == 0)  # a slice: log[0] would be read as a Python float
    log.copy_(torch.where(first, torch.cat([received.new_ones(1), received]), log))
    return whole[:numel].view(tensor.shape).to(tensor.dtype)


def _check_logs() -> None:
    """Raise for the first mismatched frame a traced or captured collective logged (a host
    read of each log)."""
    for log in _LOGS.values():
        if bool(log[0] != 0):
            received = log[1:].to("cpu", copy=True)
            log.zero_()
            _raise(received)
