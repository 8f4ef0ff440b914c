"""One typed, frozen specification per normalization and for BNP: the single owner of every
hyper-parameter's default, validation and documentation.

Everything else is derived from these classes: the layers' keyword defaults
(``CBN(rho=CBNSpec.rho)``), the keywords :func:`distnorm.convert` accepts, the nested
sections of :class:`distnorm.DistNormConfig` and, from those, its command-line flags
(``--distnorm-cbn-rho``), ``DISTNORM_*`` variables (``DISTNORM_CBN_RHO``) and YAML keys
(``distnorm: {cbn: {rho: 2.0}}``). Adding a parameter is adding one field here and using it
in the layer.

Momentum names say which way they point, as in the libraries they come from:
``momentum`` is PyTorch BatchNorm's weight of the *new* batch in the running statistics
(0.1); BNP's ``decay`` is the weight of the *history* in its running moments (0.99, the
``rho`` of paper 004), as in an exponential moving average's ``decay``. ``decay`` is BNP's
one name everywhere (``bnp.attach(decay=...)``, ``distnorm.bnp.decay``,
``--distnorm-bnp-decay``).

The specs are data at the bottom of the package: they import no layer. The modules that
define the layers register how each spec becomes a module (:func:`register_builder`); the
first ``spec.build(...)`` (or ``BNPSpec.attach``) of a type imports its module by name.

Example:
    >>> from distnorm.specs import CBNSpec
    >>> spec = CBNSpec(rho=2.0, omega=5.0)
    >>> spec.build(16)
    CBN(16, rho=2.0, amat=True, omega=5.0, eps=1e-05, momentum=0.1, eval_stats='auto', sync=True)
    >>> CBNSpec(r_max=0.5)
    Traceback (most recent call last):
    ...
    ValueError: CBN: r_max must be >= 1 (ratios are clamped to [1/r_max, r_max]), got 0.5
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar

from distnorm.settings import (
    Section,
    boolean,
    non_negative,
    one_of,
    optional,
    param,
    positive,
    positive_int,
    unit_interval,
)

__all__ = ["CBNSpec", "POPNormSpec", "SyncBNSpec", "GNSpec", "BNPSpec", "NORM_SPECS", "NORMS", "NORM_LABELS", "KEEP",
           "REMOVE", "EVAL_STATS", "ACTIVATION_NAMES", "spec_fields", "register_builder"]

#: What CBN evaluates with: the AMAT averages, the running statistics, or "auto" (AMAT while
#: eta > 0 was in force, else the running statistics; SPEC §2).
EVAL_STATS = ("auto", "amat", "running")

#: Defaults shared by every normalization (PyTorch BatchNorm's): written once here.
EPS = 1e-5
MOMENTUM = 0.1
_MOMENTUM_HELP = "running statistics: weight of the new batch (None: cumulative average)"
_EPS_HELP = "added to the mean square before the square root"

#: spec class -> the function that makes its module (filled by distnorm.layers, distnorm.bnp).
_BUILDERS: dict[type, Callable[..., Any]] = {}


def register_builder(spec_type: type, builder: Callable[..., Any]) -> None:
    """Register how instances of ``spec_type`` become modules: ``builder(spec, ...)``."""
    _BUILDERS[spec_type] = builder


# ------------------------------------------------------------------------ checks
def new_batch_weight(value: Any) -> str | None:
    if value is None or unit_interval(value) is None:
        return None
    return "must be in [0, 1] or None (cumulative average)"


def history_weight(value: Any) -> str | None:
    return None if non_negative(value) is None and value < 1.0 else "must be in [0, 1)"


def ratio_clamp(value: Any) -> str | None:
    return None if positive(value) is None and value >= 1.0 else "must be >= 1 (ratios are clamped to [1/r_max, r_max])"


def spec_fields(spec: type["_Spec"] | "_Spec") -> tuple[dataclasses.Field, ...]:
    """The hyper-parameters of a spec class (what the front ends expose)."""
    return fields(spec)


@dataclass(frozen=True)
class _Spec(Section):
    """A layer's (or BNP's) hyper-parameters: a :class:`~distnorm.settings.Section` that
    builds what it describes. ``label`` names the layer in errors ("CBN", "BNP", ...)."""

    #: The module that registers this spec's builder when imported (a plugin, loaded by name
    #: the first time a spec of this type builds: the specs import no layer).
    builder_module: ClassVar[str] = "distnorm.layers"

    def _builder(self) -> Callable[..., Any]:
        if type(self) not in _BUILDERS:
            importlib.import_module(self.builder_module)
        try:
            return _BUILDERS[type(self)]
        except KeyError:
            raise RuntimeError(f"{self.label}: no layer is registered for {type(self).__name__} "
                               f"({self.builder_module} registers none); register one with register_builder") from None

    def build(self, num_features: int, process_group: Any = None, *, replacing: Any = None) -> Any:
        """The layer this spec describes, for ``num_features`` channels.

        ``replacing``: the BatchNorm the layer takes the place of (``distnorm.convert``);
        fields left ``None`` take its values, and SyncBatchNorm shares its parameters and
        buffers.
        """
        return self._builder()(self, num_features, process_group=process_group, replacing=replacing)

    @classmethod
    def from_kwargs(cls, where: str, **values: Any) -> "_Spec":
        """``cls(**values)``, with an unknown keyword reported as a ``ValueError`` naming
        ``where`` and the accepted ones."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"{where}: unknown keyword(s) {unknown}; accepted: {sorted(known)}")
        return cls(**values)


# ----------------------------------------------------------------- normalizations
@dataclass(frozen=True)
class CBNSpec(_Spec):
    """Complete batch normalization with AMAT (paper 002, SPEC §1-§2)."""

    label: ClassVar[str] = "CBN"
    rho: float = param(1.0, "normalization magnitude rho: y = gamma / rho * x1 / rms(x1)", positive)
    amat: bool = param(True, "adaptive moving averages of the statistics (AMAT)", boolean)
    omega: float = param(10.0, "AMAT: eta = clip(1 - omega * lr, 0, 1), the weight of the history", non_negative)
    eps: float = param(EPS, _EPS_HELP, positive)
    momentum: float | None = param(MOMENTUM, _MOMENTUM_HELP, new_batch_weight)
    r_max: float = param(3.0, "AMAT: clamp of the stop-gradient ratios to [1/r_max, r_max]", ratio_clamp)
    eval_stats: str | None = param(None, "evaluate with 'amat', 'running' or 'auto' (default: auto with AMAT, "
                                         "else running)", one_of(None, *EVAL_STATS), choices=EVAL_STATS)
    sync: bool = param(True, "all-reduce the statistics across ranks", boolean)

    @property
    def resolved_eval_stats(self) -> str:
        """What evaluation uses: ``eval_stats``, or when ``None`` ``"auto"`` with AMAT and
        ``"running"`` without (the one place this default is decided)."""
        if self.eval_stats is not None:
            return self.eval_stats
        return "auto" if self.amat else "running"


@dataclass(frozen=True)
class POPNormSpec(_Spec):
    """POP-Norm (papers 000/001): CBN without moving averages, magnitude kappa."""

    label: ClassVar[str] = "POPNorm"
    kappa: float = param(4.0, "normalization magnitude kappa", positive)
    eps: float = param(EPS, _EPS_HELP, positive)
    momentum: float | None = param(MOMENTUM, _MOMENTUM_HELP, new_batch_weight)
    sync: bool = param(True, "all-reduce the statistics across ranks", boolean)

    def as_cbn(self) -> CBNSpec:
        """POP-Norm is CBN without AMAT, with ``rho = kappa`` and unclamped (= 1) ratios,
        evaluated with the running statistics: the one place this equivalence is written."""
        return CBNSpec(rho=self.kappa, amat=False, omega=0.0, eps=self.eps, momentum=self.momentum, r_max=1.0,
                       eval_stats="running", sync=self.sync)


@dataclass(frozen=True)
class SyncBNSpec(_Spec):
    """Synchronized BatchNorm (``torch.nn.BatchNorm*`` over the global batch). Converting a
    BatchNorm keeps its parameters, buffers, ``eps`` and ``momentum`` unless given here."""

    label: ClassVar[str] = "SyncBatchNorm"
    eps: float | None = param(None, f"added to the variance (default: the replaced BatchNorm's; {EPS} for a new layer)",
                              optional(positive))
    momentum: float | None = param(None, "running statistics: weight of the new batch (default: the replaced "
                                         f"BatchNorm's; {MOMENTUM} for a new layer)", new_batch_weight)

    def resolved(self, replacing: Any = None) -> dict[str, Any]:
        """``eps`` and ``momentum`` of the layer to build: the given values, else the
        replaced BatchNorm's, else the defaults of a new layer."""
        return {
            "eps": self.eps if self.eps is not None else getattr(replacing, "eps", EPS),
            "momentum": self.momentum if self.momentum is not None else getattr(replacing, "momentum", MOMENTUM),
        }


@dataclass(frozen=True)
class GNSpec(_Spec):
    """GroupNorm, for BNP + GN (paper 004): ``num_groups`` groups, or ``group_size`` channels
    per group; either is reduced to the largest divisor of the channel count not above it."""

    label: ClassVar[str] = "GroupNorm"
    #: Groups when neither ``num_groups`` nor ``group_size`` is given (Wu & He's default).
    default_groups: ClassVar[int] = 32
    num_groups: int | None = param(None, f"number of groups (default {default_groups} when group_size is not given)",
                                   optional(positive_int))
    group_size: int | None = param(None, "channels per group (instead of num_groups)", optional(positive_int))
    eps: float | None = param(None, f"added to the variance (default: the replaced BatchNorm's; {EPS} for a new layer)",
                              optional(positive))

    def _check_together(self) -> None:
        if self.num_groups is not None and self.group_size is not None:
            raise ValueError("GroupNorm: give num_groups or group_size, not both")

    def groups_for(self, channels: int) -> int:
        """The group count for a layer of ``channels`` channels."""
        if self.group_size is not None:
            wanted = max(channels // self.group_size, 1)
        else:
            wanted = self.num_groups if self.num_groups is not None else self.default_groups
        return max(g for g in range(1, min(wanted, channels) + 1) if channels % g == 0)

    def resolved_eps(self, replacing: Any = None) -> float:
        """The given ``eps``, else the replaced BatchNorm's, else a new layer's."""
        return self.eps if self.eps is not None else getattr(replacing, "eps", EPS)


#: ``convert(norm=...)`` names of the specs.
NORM_SPECS: dict[str, type[_Spec]] = {"cbn": CBNSpec, "popnorm": POPNormSpec, "bn": SyncBNSpec, "gn": GNSpec}

#: The ``norm`` that removes every BatchNorm (for BNP alone, or a model without normalization).
REMOVE = "none"
#: The ``norm`` that leaves every BatchNorm as it is (PyTorch's unsynchronized layer: the
#: baseline, or a run that only changes the activations); the default of the configuration.
KEEP = "keep"
#: What a BatchNorm can be converted to: one name per spec, and :data:`REMOVE`.
NORMS: tuple[str, ...] = (*NORM_SPECS, REMOVE)
#: Every ``norm`` label, the one spelling of each, for ``distnorm.convert``,
#: ``distnorm.DistNormConfig`` (YAML, ``--distnorm``, ``DISTNORM_NORM``) and ``distnorm.models``.
NORM_LABELS: tuple[str, ...] = (*NORMS, KEEP)

#: The activations :func:`distnorm.convert` puts in place of a model's own (``activation=``);
#: their modules are :data:`distnorm.convert.ACTIVATIONS`.
ACTIVATION_NAMES: tuple[str, ...] = ("relu", "sigmoid", "tanh", "selu", "swish")


# ------------------------------------------------------------------------------ BNP
def _patterns(value: Any) -> str | None:
    if isinstance(value, tuple) and all(isinstance(p, str) for p in value):
        return None
    return "must be a tuple of module-name patterns"


@dataclass(frozen=True)
class BNPSpec(_Spec):
    """Batch normalization preconditioning (paper 004): gradients of dense / conv layers
    preconditioned with running moments of their inputs."""

    label: ClassVar[str] = "BNP"
    builder_module: ClassVar[str] = "distnorm.bnp"
    decay: float = param(0.99, "running moments: weight of the history (the paper's rho)", history_weight)
    eps1: float = param(1e-2, "var_t = var + eps1 * max(var) + eps2 (relative floor)", non_negative)
    eps2: float = param(1e-4, "var_t = var + eps1 * max(var) + eps2 (absolute floor)", non_negative)
    add_bias: bool = param(True, "give bias-free layers a zero bias, so the centring part applies", boolean)
    exclude: tuple[str, ...] = param((), "module name patterns to leave alone (comma separated on the command line)",
                                     _patterns)

    def __post_init__(self) -> None:
        if isinstance(self.exclude, str):
            object.__setattr__(self, "exclude", tuple(p.strip() for p in self.exclude.split(",") if p.strip()))
        elif isinstance(self.exclude, list):
            object.__setattr__(self, "exclude", tuple(self.exclude))
        super().__post_init__()

    def _check_together(self) -> None:
        if self.eps1 == 0 and self.eps2 == 0:
            raise ValueError("BNP: eps1 and eps2 cannot both be 0 (var_t could be 0 and divide by zero)")

    def build(self, num_features: int, process_group: Any = None, *, replacing: Any = None) -> Any:
        raise TypeError("BNP is not a layer: use BNPSpec.attach(model) or distnorm.bnp.attach(model, ...)")

    def attach(self, model: Any, process_group: Any = None) -> Any:
        """``distnorm.bnp.attach(model, **spec.kwargs())``: BNP with these hyper-parameters."""
        return self._builder()(model, process_group=process_group, **self.kwargs())
