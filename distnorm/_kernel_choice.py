"""Which kernels a synchronized layer's group runs: agreed once, by every rank alike.

The per-channel operators have three implementations (:mod:`distnorm._kernels`: the ATen
composite, Triton on CUDA, C on the CPU) that differ by a few ulp, so **every rank of a
synchronized layer's group must run the same one**, or the buffers that are meant to be
identical on every rank drift apart. The group agrees once, with one collective of its own:
at the group's first synchronized CBN / BN / BNP step on a device type, before its
statistics, each rank votes (:func:`triton_vote`: Triton works here / failed / neither; and
on the CPU, whether its C kernels are on and build: :func:`cpu_kernel_decision`), one
all-reduce of those four numbers sums the votes (a checked frame, :mod:`distnorm._frames`),
and every rank reads the same sums (:func:`triton_decision`) and keeps the answer
(:func:`kernels_of`). That first step runs the kernels agreed, as every later one does.

* every rank works: Triton, on every rank;
* a rank's Triton failed (it imports but cannot build or launch a kernel -- no C compiler or
  CUDA driver library for its launcher, an unsupported GPU -- or its kernels differ from the
  composite there): **every** rank raises, naming the ranks and their errors, after the same
  collective, so none is left waiting. A failure is never turned into a quiet fallback;
* no rank failed but some do not run Triton (``DISTNORM_TRITON=0``, no Triton installed, CPU
  tensors): the composite on every rank of the group, with a warning where that differs
  from what a rank would have chosen alone.

A layer without a group (one process, or ``sync=False``) decides alone, with the same rule:
its buffers are its rank's own, so no other rank must match them -- but a failed Triton then
raises on that rank only (in a multi-rank job the others stop at their next collective's
timeout). A rank's vote launches each kernel once on a few channels and compares it with the
composite, so the toolchain failures above surface before the first real step; a kernel
that fails only later, for a launch configuration the vote did not try, raises (never falls
back) on every rank that reaches it -- all of them, as they run the same step. What is
decided, and why, is :func:`triton_state` (the GPU report prints it). The op counter of the
tests (``tests/dispatch.py``) sees each operator as one op, which is what a GPU launches;
``tests/test_fused.py`` checks the kernels against the composite through the interpreter.
"""

from __future__ import annotations

import functools
import os
import warnings
import weakref
from types import ModuleType
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from distnorm import _capture, _collectives, _cpu_kernels, _frames, _kernels, _moments
from distnorm._collectives import ProcessGroup
from distnorm._composite import backward_sums_composite, bnp_precondition, cbn_plan_composite
from distnorm._cpu_kernels import cpu_kernel_enabled

__all__ = ["Kernels", "TritonState", "cpu_kernel_decision", "kernel_choice", "kernels_of", "synced_moments",
           "triton_decision", "triton_enabled", "triton_state", "triton_vote"]


class TritonState(NamedTuple):
    """Whether the fused operators run their Triton kernels, and why not.

    Attributes:
        used: the Triton kernels run (for the group / device asked about).
        reason: why not (empty when ``used``); where a group agreed, what it agreed on.
    """

    used: bool
    reason: str


_OK, _FAILED, _OFF = 0, 1, 2  # a rank's verdict; its vote sends [ok, failed] (off: neither)


def _probe(kernels: ModuleType, device: torch.device) -> None:
    """Launch each kernel once on 16 channels of ``device`` (BNP's transform: a 16 x 4 x 2 x 2
    weight gradient) and compare it with the composite:
    a Triton that cannot build its launcher or compile here raises, and so does one whose
    kernels compute something else (to 1e-5)."""
    c = 16
    ramp = torch.arange(c, dtype=torch.float32, device=device)
    mean, var = (ramp - 7.5) * 0.3, ramp * 0.05 + 0.5
    weight, bias, eta = ramp * 0.01 + 0.9, ramp * 0.02 - 0.1, torch.full((), 0.6, device=device)
    count = torch.full((c,), 64.0, device=device)

    def buffers() -> list[Tensor]:
        return [mean * 0.5, var * 1.5, torch.ones((), dtype=torch.bool, device=device), mean * 0.1, var * 0.9,
                torch.full((), 3, dtype=torch.long, device=device)]

    hyper = [1e-5, 1.5, 3.0]
    got_buffers, want_buffers = buffers(), buffers()
    got = kernels.cbn_plan(mean, var, count, weight, bias, eta, got_buffers, -1, hyper, 0.1)
    want = cbn_plan_composite(mean, var, count, None, weight, bias, eta, want_buffers, -1, hyper, 0.1, True)
    grad_weight, q2 = torch.outer(ramp + 1.0, ramp - 3.0).view(c, 4, 2, 2), torch.full((), 2.5, device=device)
    pairs = [*zip(got, want), *zip(got_buffers, want_buffers),
             *zip(kernels.backward_sums(mean, var, weight, bias, want[4], 0.5),
                  backward_sums_composite(mean, var, weight, bias, want[4], 0.5)),
             *zip(kernels.bnp_precondition(grad_weight, bias, mean[:4], var[:4], q2, 1),
                  bnp_precondition(grad_weight, bias, mean[:4], var[:4], q2))]
    for i, (g, w) in enumerate(pairs):
        if not torch.allclose(g.double(), w.double(), rtol=1e-5, atol=1e-6):
            raise RuntimeError(f"the Triton kernels differ from the ATen composite here (output {i}: "
                               f"{g.tolist()} instead of {w.tolist()})")


@functools.lru_cache(maxsize=None)
def _verdict(mode: str, device: torch.device) -> tuple[int, str]:
    """This process's own vote for tensors on ``device``: ``(_OK, "")``, ``(_OFF, why)`` or
    ``(_FAILED, error)`` — remembered per mode and device (one probe per process)."""
    if mode not in _kernels.MODES:
        return _FAILED, f"DISTNORM_TRITON={mode!r} is not one of {', '.join(_kernels.MODES)}"
    # The probe compares on the host; raised, not remembered as a failure (lru_cache keeps returns only).
    _capture.refuse_capture(device, "the first training step's probe of the Triton kernels")
    try:  # never raises: a synchronized layer votes before its collective, and says it there
        kernels, why = _kernels.kernels_for(device)
        if kernels is None:
            return _OFF, why
        _probe(kernels, device)
    except Exception as err:  # noqa: BLE001 - whatever Triton raises here is this rank's failure
        return _FAILED, f"{type(err).__name__}: {err}"
    return _OK, ""


def _local_verdict(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _verdict(_kernels.mode(), device)


#: What each group agreed, per device type: a group keeps its answer for its lifetime. Held
#: weakly: a later group cannot find an earlier one's answer, and a group the program dropped
#: is not kept alive, so ``destroy_process_group`` destroys it and gloo joins its worker
#: threads there, not at interpreter shutdown (:mod:`distnorm._release` says why that matters).
_AGREED: "weakref.WeakKeyDictionary[ProcessGroup, dict[str, TritonState]]" = weakref.WeakKeyDictionary()


#: Whether a group's CPU layers run distnorm's C kernels (:func:`cpu_kernel_decision`), agreed
#: at the same step as Triton; held weakly as :data:`_AGREED`.
_CPU_KERNEL_AGREED: "weakref.WeakKeyDictionary[ProcessGroup, bool]" = weakref.WeakKeyDictionary()


def _agreed(group: ProcessGroup, device_type: str) -> TritonState | None:
    return _AGREED.get(group, {}).get(device_type)


def _agree(group: ProcessGroup, device_type: str, state: TritonState) -> None:
    _AGREED.setdefault(group, {})[device_type] = state


def _failure(reason: str) -> RuntimeError:
    return RuntimeError(
        f"distnorm: the Triton kernels of the fused operators cannot run here: {reason.rstrip('.')}. Fix Triton "
        "on this machine (it needs a C compiler and the CUDA driver library to build its launcher), or set "
        "DISTNORM_TRITON=0 on every rank to run the ATen composite instead (the same values to about 1e-6, more "
        "kernel launches).")


def _cpu_kernel_verdict(device: torch.device) -> tuple[int, str]:
    """This rank's CPU kernels: ``(_OK, "")``, ``(_OFF, why)`` (``DISTNORM_CPU_KERNEL=0``, or
    not a CPU device) or ``(_FAILED, error)`` (the C kernels cannot be built or loaded here:
    the build runs now, before the rank uses them)."""
    if device.type != "cpu":
        return _OFF, "not a CPU device"
    if not cpu_kernel_enabled():
        return _OFF, "DISTNORM_CPU_KERNEL=0"
    try:
        _cpu_kernels.library()
    except (RuntimeError, OSError) as err:
        return _FAILED, str(err)
    return _OK, ""


def triton_vote(group: ProcessGroup | None, device: torch.device) -> Optional[Tensor]:
    """This rank's vote as a float64 ``[ok, failed, cpu_kernel_off, cpu_kernel_failed]`` on
    ``device`` (``ok = failed = 0``: Triton not wanted or not here; ``cpu_kernel_off``:
    ``DISTNORM_CPU_KERNEL=0`` here; ``cpu_kernel_failed``: the C kernels of
    :mod:`distnorm._cpu_kernels` cannot be built here), to be summed over ``group``; or
    ``None`` when there is nothing to agree: no group, or the group agreed already for this
    device type. Every rank of a group gets ``None`` or a tensor at the same call — what
    decides it is the same on every rank. A CPU rank builds its C kernels here, before it
    uses them: a rank that cannot is named by every rank at the vote's collective instead of
    raising alone before it."""
    if group is None or _agreed(group, device.type) is not None:
        return None
    _capture.refuse_capture(device, "the group's first synchronized step (its vote on the kernels)")
    verdict = _local_verdict(device)[0]
    cpu = _cpu_kernel_verdict(device)[0]
    off = device.type == "cpu" and cpu == _OFF
    return torch.tensor([verdict == _OK, verdict == _FAILED, off, cpu == _FAILED], dtype=torch.float64).to(device)


def cpu_kernel_decision(group: ProcessGroup | None, device: torch.device) -> bool:
    """Whether a layer synchronizing over ``group`` runs distnorm's C kernels on ``device``
    (the statistics, the per-channel operators and the backward's element-wise pass,
    :mod:`distnorm._cpu_kernels`).

    Without a group: this process's own setting (``DISTNORM_CPU_KERNEL``; a kernel that
    cannot be built raises at its first use, on this rank only, as no other rank computes
    with it). With a group: what the group agreed at its first step on this device type
    (:func:`triton_decision`); ATen's kernels before that vote, on every rank alike."""
    if device.type != "cpu":
        return False
    if group is None:
        return cpu_kernel_enabled()
    return _CPU_KERNEL_AGREED.get(group, False)


def synced_moments(x: Tensor, group: ProcessGroup | None, layer: str, state: Any) -> _moments.Moments:
    """A synchronized layer's statistics (:func:`distnorm._moments.global_moments`) with
    the group's agreement on the kernels: at the group's first step on ``x``'s device type the
    ranks' votes (:func:`triton_vote`) are summed by one all-reduce of their own, and every
    rank decides from the same sums (:func:`triton_decision`, raising alike where a rank's
    kernels failed) before the statistics, which run the kernels agreed from that step on
    (:func:`kernels_of` the layer's ``state``; ``layer``: its name in errors). The one way
    every layer (CBN, BN, BNP) enters its statistics step."""
    votes = triton_vote(group, x.device)
    if votes is not None:
        _collectives.all_reduce_sum(votes, group, slot=f"{layer}|{_frames.VOTE}", shape=(x.shape[1], x.dtype))
        triton_decision(group, x.device, votes)
    return _moments.global_moments(x, group, layer=layer, cpu_kernel=kernels_of(state, group, x.device).cpu)


class Kernels(NamedTuple):
    """The kernels a layer's step runs on one device, as its group agreed.

    Attributes:
        per_channel: the per-channel operators' implementation, their last argument
            (:func:`kernel_choice`: ``"triton"``, ``"cpu"`` or ``"composite"``).
        cpu: distnorm's C kernels for the statistics and the backward's element-wise pass
            (:func:`cpu_kernel_decision`).
    """

    per_channel: str
    cpu: bool


def kernels_of(state: Any, group: ProcessGroup | None, device: torch.device) -> Kernels:
    """The :class:`Kernels` of a layer (``state``: its ``NormState`` or ``BNPLayerState``)
    synchronizing over ``group`` on ``device``: decided once and kept in ``state.kernels``
    from the step the decision is final on -- a group's agreement, made at its first
    synchronized step, or a process's own setting without a group -- so a step makes no
    choice after that (``DISTNORM_TRITON`` and ``DISTNORM_CPU_KERNEL`` must not change
    during a run, as :func:`distnorm._kernels.cbn_plan` says). Until then each call asks
    again: before its vote a group runs ATen's kernels on every rank."""
    kept = state.kernels
    if kept is not None and kept[1] == device and (kept[0]() if kept[0] is not None else None) is group:
        return kept[2]
    chosen = Kernels(kernel_choice(group, device), cpu_kernel_decision(group, device))
    if group is None or _agreed(group, device.type) is not None:
        # The group held weakly, as _AGREED holds it: a layer must not keep a destroyed group alive.
        state.kernels = (weakref.ref(group) if group is not None else None, device, chosen)
    return chosen


def kernel_choice(group: ProcessGroup | None, device: torch.device) -> str:
    """Which implementation the per-channel operators run for a layer synchronizing over
    ``group`` on ``device``, as the group agreed (their last argument): ``"triton"``
    (:func:`triton_decision`), ``"cpu"`` (:func:`cpu_kernel_decision`) or ``"composite"``."""
    if triton_decision(group, device):
        return "triton"
    return "cpu" if cpu_kernel_decision(group, device) else "composite"


def triton_decision(group: ProcessGroup | None, device: torch.device, votes: Optional[Tensor] = None) -> bool:
    """Whether the fused operators of a layer synchronizing over ``group`` run Triton on
    ``device`` — the argument ``triton`` of :data:`cbn_plan` and :data:`backward_sums`.

    ``votes``: the sums of every rank's :func:`triton_vote`, right after the collective that
    carried them; the group's answer is made and kept from them (raising on every rank when a
    rank's Triton failed). Without ``votes``: the group's kept answer — the composite while
    the group has not voted yet, on every rank alike — or, for ``group=None``, this process's
    own (raising when its Triton failed).
    """
    if group is None:
        verdict, reason = _local_verdict(device)
        if verdict == _FAILED:
            raise _failure(reason)
        return verdict == _OK
    if votes is None:
        agreed = _agreed(group, device.type)
        return agreed is not None and agreed.used
    ok, failed, cpu_kernel_off, cpu_kernel_failed = (int(v) for v in votes.tolist())  # once per group and device
    size = _collectives.group_size(group)
    if 0 < cpu_kernel_off < size:  # the statistics and the backward would round differently on some ranks
        texts = _collectives.gather_texts(f"DISTNORM_CPU_KERNEL={os.environ.get('DISTNORM_CPU_KERNEL', '')!r}", group)
        listing = "\n".join(f"  rank {r}: {t}" for r, t in zip(_collectives.group_ranks(group), texts))
        raise RuntimeError(f"distnorm: DISTNORM_CPU_KERNEL=0 on {cpu_kernel_off} of the {size} ranks of the group; every "
                           f"rank must run the same backward arithmetic, so set it on every rank or on none:\n{listing}")
    if cpu_kernel_failed:  # every rank knows from the same sums: all gather who, all raise
        cpu_verdict, cpu_reason = _cpu_kernel_verdict(device)
        texts = _collectives.gather_texts(cpu_reason.splitlines()[0] if cpu_verdict == _FAILED else "ok", group)
        listing = "\n".join(f"  rank {r}: {t}" for r, t in zip(_collectives.group_ranks(group), texts) if t != "ok")
        raise RuntimeError(
            f"distnorm: the CPU kernels (distnorm._cpu_kernels) cannot be built on {cpu_kernel_failed} of the {size} "
            f"ranks of the group:\n{listing}\nInstall a C and C++ compiler there (gcc / g++ or clang; CC and CXX choose them), or set "
            "DISTNORM_CPU_KERNEL=0 on every rank to run ATen's kernels instead.")
    if device.type == "cpu":
        _CPU_KERNEL_AGREED[group] = cpu_kernel_off == 0
    if ok == size:
        _agree(group, device.type, TritonState(True, ""))
        return True
    verdict, reason = _local_verdict(device)
    if failed == 0 and ok == 0:  # nobody wanted Triton: nothing to report beyond this rank's reason
        _agree(group, device.type, TritonState(False, reason))
        return False
    # Some ranks differ: every rank knows it from the same sums, so every rank gathers who
    # (one more collective, this step only) and raises or warns alike.
    texts = _collectives.gather_texts(["ok", f"failed: {reason}", f"off: {reason}"][verdict], group)
    listing = "\n".join(f"  rank {r}: {t}" for r, t in zip(_collectives.group_ranks(group), texts) if t != "ok")
    if failed:
        raise _failure(f"Triton failed on {failed} of the {size} ranks of the group:\n{listing}\n")
    why = (f"the composite on all {size} ranks of the group: {size - ok} do not run Triton and every rank "
           f"must compute alike:\n{listing}")
    _agree(group, device.type, TritonState(False, why))
    if verdict == _OK:
        warnings.warn(f"distnorm: the fused operators run {why}", RuntimeWarning, stacklevel=3)
    return False


def triton_state(process_group: ProcessGroup | None = None, device: torch.device | str | None = None) -> TritonState:
    """Whether the fused operators of layers synchronizing over ``process_group`` (default:
    the default group; none when not distributed) run their Triton kernels on ``device``
    (default: the current CUDA device, else the CPU), and why not.

    Where the group has not agreed yet (before its first synchronized training step), the
    answer is this process's own vote, which the group may still overrule with the
    composite; probing it launches each kernel once. Never raises for a failed Triton: it is
    the answer's reason.

    Example:
        >>> import torch
        >>> from distnorm._kernel_choice import triton_state
        >>> triton_state(device="cpu")
        TritonState(used=False, reason="cpu tensors: the ATen composite is their kernel (DISTNORM_TRITON=interpret runs the Triton kernels in Triton's interpreter)")
    """
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    group = _collectives.sync_group(process_group)
    agreed = _agreed(group, device.type) if group is not None else None
    if agreed is not None:
        return agreed
    verdict, reason = _local_verdict(device)
    if verdict == _FAILED:
        return TritonState(False, f"Triton failed here: {reason}")
    return TritonState(verdict == _OK, reason)


def triton_enabled() -> bool:
    """Whether this process, alone, would run the Triton kernels for CUDA tensors
    (:func:`triton_state` says why not, and what a group agreed)."""
    return torch.cuda.is_available() and triton_state(device="cuda").used


# ----------------------------------------------------- the operators' kernels


