"""The statistics of a synchronized layer's input: local moments, and their all-reduce.

Every synchronized layer (CBN, POP-Norm, SyncBatchNorm, BNP) enters its statistics step
here: :func:`global_moments` in eager mode -- ATen's statistics kernel (on the CPU its C twin
``distnorm::batch_norm_update_stats``, :mod:`distnorm._cpu_kernels`), then ONE all-reduce of
a ``(3, C)`` float64 payload (per-channel sum, sum of squares and sample count) in a checked
frame (:func:`distnorm._collectives.all_reduce_sum`); :func:`traced_moments` as
``torch.compile`` traces it and a CUDA graph replays it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from distnorm import _capture, _debug, _ops
from distnorm._collectives import ProcessGroup, all_reduce_sum, refuse_debug_mode, traced_all_reduce_sum
from distnorm._constants import constant
from distnorm.errors import NonFiniteStatisticsError

__all__ = ["Moments", "accumulate_dtype", "global_moments", "local_moments", "traced_moments"]


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


def accumulate_dtype(x: torch.Tensor) -> torch.dtype:
    """dtype in which per-channel statistics are accumulated: float64 for float64, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def local_moments(x: torch.Tensor, cpu_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance of a non-empty ``(N, C, *)`` tensor, in the
    accumulation dtype.

    ATen's batch-norm statistics kernel (any memory format, CPU and CUDA); with
    ``cpu_kernel`` (a CPU tensor; :func:`distnorm._kernel_choice.cpu_kernel_decision`) its twin
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
    stats = _ops.batch_norm_update_stats if on_cpu else torch.batch_norm_update_stats
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
        if _capture.capturing(device):  # its fills have not run yet: not for eager steps (and never read back)
            return scratch
        _SCRATCH[key] = scratch
    return _SCRATCH[key]


def global_moments(x: torch.Tensor, group: ProcessGroup | None, *, layer: str = "",
                   training: bool = True, cpu_kernel: bool = False) -> Moments:
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

    ``cpu_kernel``: the local moments of a CPU tensor come from distnorm's C kernel
    (:func:`local_moments`); every rank of ``group`` must pass the same value, which
    :func:`distnorm._kernel_choice.cpu_kernel_decision` gives.
    """
    channels = x.shape[1]
    acc = accumulate_dtype(x)
    local_count = x.numel() // channels if channels else 0
    if _debug.is_debug() and _capture.capturing(x.device):
        refuse_debug_mode(layer)  # its checks read the statistics on the host
    if group is None:
        if local_count == 0:  # kernel contract: CUDA's statistics kernel rejects N = 0
            mean, var = torch.zeros(2, channels, dtype=acc, device=x.device).unbind()  # two tensors, not one
            return Moments(0, mean, var, False)
        mean, var = local_moments(x, cpu_kernel)
        if _debug.is_debug():
            _check_statistics(torch.stack([mean.double(), var.double()]), layer, training, float(local_count))
        return Moments(local_count, mean, var, local_count > 1)

    packed = _packed(local_moments(x, cpu_kernel) if local_count > 0 else None, local_count, channels, x.device)
    all_reduce_sum(packed, group, slot=f"{layer}|forward|C={channels}|{x.dtype}", shape=(channels, x.dtype))
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
    refuse_debug_mode(layer)
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
