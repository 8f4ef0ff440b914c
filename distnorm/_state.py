"""What a synchronized layer's step needs besides its tensors: the layer's state, its
buffers, the plan a statistics step hands the forward and backward, and the process's
registry of layers (whose names a mismatched frame's error reads).
"""

from __future__ import annotations

import copy
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from distnorm import _collectives, _frames
from distnorm._collectives import ProcessGroup
from distnorm._recompute import Stash, StashedPlan

__all__ = ["CBNBuffers", "NormPlan", "NormState", "register"]


@dataclass(eq=False)
class NormState:
    """What the mathematics needs to know about one layer, in one small structure.

    The module owns parameters and buffers; this object carries its hyper-parameters and
    the host-side facts that let the statistics skip work without reading the device.

    Attributes:
        kind: ``"bn"`` (batch normalization) or ``"cbn"`` (CBN / POP-Norm).
        name: the layer's name in error messages.
        eps, momentum: hyper-parameters.
        rho, r_max: CBN's (``rho = kappa``, ``r_max = 1`` for POP-Norm); ``None`` for BN.
        process_group, sync: what to synchronize over.
        eval_stats: CBN's statistics at evaluation (``"auto"``, ``"amat"``, ``"running"``).
        amat: CBN's AMAT is on: every training step blends in history by ``eta``, read on the
            device; for a functional call, whether this call's ``eta`` may be > 0.
        amat_ready: the AMAT buffers are initialised on every rank (the host saw it happen).
        stats_sink: dict the theory monitors read the last batch statistics from, or None
            (references to the fused operator's inputs and outputs: no op of its own).
        stash: plans kept for activation checkpointing (made at first use).
    """

    kind: str
    name: str
    eps: float
    momentum: float | None
    rho: float | None = None
    r_max: float | None = None
    process_group: ProcessGroup | None = None
    sync: bool = True
    eval_stats: str | None = None
    amat: bool = False
    amat_ready: bool = False
    stats_sink: dict | None = None
    stash: Stash | None = field(default=None, repr=False)  # made at the first stash (a layer makes its own)
    pending: StashedPlan | None = field(default=None, repr=False)
    key: int = field(default=-1, repr=False)  # registry key (a module's state; -1: a functional call's)
    channels: int = field(default=0, repr=False)  # a module's, reserved in every frame (distnorm._frames)
    kernels: Any = field(default=None, repr=False)  # (group, device, Kernels): distnorm._kernel_choice.kernels_of

    @classmethod
    def of_layer(cls, kind: str, name: str, channels: int, **fields: Any) -> "NormState":
        """A module's state: kept across its calls, with its own stash, and registered."""
        state = cls(kind, name, stash=Stash(), channels=channels, **fields)
        register(state, channels)
        return state

    def group(self) -> ProcessGroup | None:
        return _collectives.sync_group(self.process_group) if self.sync else None

    def __getstate__(self) -> dict[str, Any]:  # pickling / deepcopy: runtime fields reset
        state = dict(self.__dict__)
        state.update(stash=None, pending=None, stats_sink=None, kernels=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.stash = Stash()
        if self.key >= 0:  # a module's state: the copy gets a key of its own (and its frames' width)
            register(self, self.channels)

    def __deepcopy__(self, memo: dict) -> "NormState":
        new = NormState.__new__(NormState)
        state = self.__getstate__()
        group = state.pop("process_group")
        new.__setstate__(copy.deepcopy(state, memo))
        new.process_group = group  # process groups are shared handles, never copied
        return new


class CBNBuffers(NamedTuple):
    """The statistics a CBN / POP-Norm layer keeps (its buffers), updated in place by a
    training call. ``CBNBuffers.fresh(c)`` gives new ones for ``c`` channels."""

    amat_mean: Tensor
    amat_var: Tensor
    amat_initialized: Tensor
    running_mean: Tensor
    running_var: Tensor
    num_batches_tracked: Tensor

    @classmethod
    def fresh(cls, channels: int, *, dtype: torch.dtype = torch.float32, device: Any = None) -> "CBNBuffers":
        def vec(value: float) -> Tensor:
            return torch.full((channels,), value, dtype=dtype, device=device)

        return cls(vec(0.0), vec(1.0), torch.zeros((), dtype=torch.bool, device=device), vec(0.0), vec(1.0),
                   torch.zeros((), dtype=torch.long, device=device))


class NormPlan(NamedTuple):
    """Per-channel tensors of one training step (all of the accumulation dtype).

    Attributes:
        center: subtracted from ``x`` (``mean`` for BN, ``mu_U - beta`` for CBN).
        var: variance the output divides by (``sqrt(var + eps)``).
        invstd: ``1 / sqrt(var + eps)``.
        grad_scale: ``a``, the factor of ``g`` in the input gradient — except for
            unsynchronized BN, whose backward is ATen's own: there, the weight (ones without
            affine) that kernel takes.
        grad_coef: ``(2, 2, C)``, ``[[r_mu, q], [w, n]]``: with the global ``[S1, T]``, the
            element-wise pass's coefficients (``distnorm::backward_sums``; zeros, unread, for
            unsynchronized BN).
        beta_coef: ``q * d`` of CBN's ``dbeta = a (S1 - q d T)`` (local sums); empty for BN.
    """

    center: Tensor
    var: Tensor
    invstd: Tensor
    grad_scale: Tensor
    grad_coef: Tensor
    beta_coef: Tensor


_STATES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


_KEYS = itertools.count()


def register(state: Any, channels: int = 0) -> int:
    """Record ``state`` (a module's :class:`NormState`, a BNP layer's state) among the
    process's layers, whose names a mismatched frame's error reads
    (:func:`distnorm._frames.add_name_source`); a key per object, held weakly.
    ``channels``: the layer's, whose statistics every collective frame of the process must
    hold (:func:`distnorm._frames.reserve`)."""
    if channels:
        _frames.reserve(channels)
    key = getattr(state, "key", -1)
    if key < 0 or _STATES.get(key) is not state:
        key = next(_KEYS)
        _STATES[key] = state
        state.key = key
    return key


_frames.add_name_source(lambda: [state.name for state in list(_STATES.values())])
