"""Convert a model's BatchNorm layers to synchronized CBN / POP-Norm / BN, GroupNorm, or none.

``distnorm.convert(model, norm="cbn")`` is the entry point users reach for first: it works
on models they own, not only on ours.

* ``"cbn"`` / ``"popnorm"`` are **pre-operation** (paper 002, Fig. 1c): every BatchNorm that
  follows a conv / linear layer is removed, and a CBN / POP-Norm over that layer's *input*
  channels is inserted before it, so normalization sits after the previous nonlinearity.
  The conv → BN pairs come from the model's dataflow (``torch.fx``), not from attribute
  names; a model ``torch.fx`` cannot trace falls back to pairing modules in registration
  order, with a warning listing the pairs it chose.
* ``"bn"`` swaps each BatchNorm for :class:`distnorm.SyncBatchNorm` in place, sharing the
  same Parameter and buffer objects (``state_dict`` keys and values unchanged).
* ``"gn"`` swaps each BatchNorm for :class:`distnorm.GroupNorm` (an ``nn.GroupNorm``, for BNP +
  GN); ``"none"`` removes them.
* **Fused norm + activation** modules (timm's ``BatchNormAct2d`` / ``SyncBatchNormAct``: a
  BatchNorm subclass with ``drop`` and ``act`` children, applied after the normalization)
  keep their activation: ``"bn"`` / ``"gn"`` make the new norm a :class:`SyncBatchNormAct`
  / :class:`GroupNormAct` with the same ``drop`` and ``act`` children (``state_dict`` keys
  unchanged; classes written out here, so a converted model pickles), the pre-op modes and
  ``"none"`` leave ``drop`` → ``act`` where the BatchNorm was.
* ``activation=`` swaps every activation module for relu / sigmoid / tanh / selu / swish,
  keeping the sigmoid gates of squeeze-excitation blocks (found from the dataflow: an
  activation whose output multiplies another tensor). It also turns ``inplace=True`` off
  throughout the model: the architecture's in-place choices were made for its own
  activations, and a later in-place op could overwrite what the new one needs.

Every replacement is recorded on the model, so :func:`revert` puts the original module
objects back, and :func:`conversion_summary` reports what was replaced.
"""

from __future__ import annotations

import logging
import operator
import warnings
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from distnorm import _folding
from distnorm._collectives import ProcessGroup
from distnorm._wrappers import refuse_wrapped
from distnorm.layers import GroupNorm, SyncBatchNorm, _DistNormLayer, name_layers
from distnorm.specs import ACTIVATION_NAMES, KEEP, NORM_LABELS, NORM_SPECS, NORMS, CBNSpec, GNSpec, POPNormSpec, SyncBNSpec

#: What ``convert(norm=...)`` accepts besides a name.
NormSpec = CBNSpec | POPNormSpec | SyncBNSpec | GNSpec

__all__ = ["NORMS", "ACTIVATIONS", "PreNorm", "SyncBatchNormAct", "GroupNormAct", "NORM_ACT_CLASSES", "convert",
           "revert", "conversion_summary"]

logger = logging.getLogger(__name__)

ACTIVATIONS: dict[str, type[nn.Module]] = dict(zip(ACTIVATION_NAMES, (nn.ReLU, nn.Sigmoid, nn.Tanh, nn.SELU, nn.SiLU)))

_ACTIVATION_ALIASES = {"silu": "swish"}

BATCH_NORMS: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm, SyncBatchNorm)
LINEAR_OPS: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
ACTIVATION_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.RReLU, nn.ELU, nn.CELU, nn.SELU, nn.GELU,
    nn.SiLU, nn.Mish, nn.Hardswish, nn.Hardsigmoid, nn.Sigmoid, nn.Tanh, nn.Hardtanh,
    nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.LogSigmoid,
)
_GATES = (nn.Sigmoid, nn.Hardsigmoid)
_MUL_TARGETS = {operator.mul, torch.mul, operator.imul}


class PreNorm(nn.Module):
    """``op(norm(x))``: a pre-operation normalization in front of a conv / linear layer.

    In training, a CBN / POP-Norm whose input needs no gradient (the one before the stem) is
    folded into a plain convolution after it: the same values and gradients, without the
    convolution's input gradient that ``norm``'s gamma and beta would otherwise need
    (:mod:`distnorm._folding`).

    The layer's descriptive attributes (``weight``, ``bias``, ``in_channels``,
    ``out_features``, ``kernel_size``, ...) are forwarded to ``op``, so code written for the
    original layer keeps working. Only that fixed list is forwarded: engines that tag
    modules with attributes of their own (DeepSpeed, FSDP) must never see ``op``'s tags
    through the wrapper.
    """

    FORWARDED = frozenset({
        "weight", "bias", "in_channels", "out_channels", "in_features", "out_features", "kernel_size",
        "stride", "padding", "dilation", "groups", "padding_mode", "transposed", "output_padding",
    })

    def __init__(self, norm: nn.Module, op: nn.Module):
        super().__init__()
        self.norm = norm
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _folding.folds(self.norm, self.op, x):  # the stem: no input gradient to pay for
            return _folding.fold_into_conv(x, self.norm, self.op)
        return self.op(self.norm(x))

    def __getattr__(self, name: str) -> Any:
        if name in PreNorm.FORWARDED:
            modules = self.__dict__.get("_modules", {})
            if "op" in modules:
                return getattr(modules["op"], name)
        return super().__getattr__(name)


@dataclass
class _Change:
    path: str
    original: nn.Module
    description: str


@dataclass
class _Record:
    """What :func:`convert` did to a model (stored as ``model._distnorm_conversion``)."""

    norm: str | None
    activation: str | None
    changes: list[_Change] = field(default_factory=list)
    inplace_disabled: list[str] = field(default_factory=list)  # paths whose inplace was True

    def summary(self) -> dict[str, int]:
        return dict(Counter(c.description for c in self.changes))


def _get(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    if not path:
        raise ValueError(
            f"convert: the model itself is a {type(model).__name__}; wrap it in a container "
            "(e.g. nn.Sequential) so that it can be replaced"
        )
    parent_path, _, name = path.rpartition(".")
    setattr(_get(model, parent_path), name, module)


def _like(new: nn.Module, reference: nn.Module) -> nn.Module:
    """Give ``new`` the device, float dtype and training mode of ``reference``."""
    tensors = list(reference.parameters(recurse=False)) + list(reference.buffers(recurse=False))
    floats = [t for t in tensors if t.is_floating_point()]
    if floats:
        new.to(device=floats[0].device, dtype=floats[0].dtype)
    elif tensors:
        new.to(device=tensors[0].device)
    return new.train(reference.training)


def _channels_in(op: nn.Module) -> int:
    return op.in_features if isinstance(op, nn.Linear) else op.in_channels


def _channels_out(op: nn.Module) -> int:
    return op.out_features if isinstance(op, nn.Linear) else op.out_channels


def _fused_activation(bn: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """``(drop, act)`` of a fused norm + activation module (timm's ``BatchNormAct2d``:
    ``act(drop(batch_norm(x)))``), or ``None`` for a plain BatchNorm."""
    act = bn._modules.get("act")
    if act is None:
        return None
    drop = bn._modules.get("drop")
    return (drop if drop is not None else nn.Identity()), act


class _NormAct:
    """``act(drop(norm(x)))``: the forward of the norm + activation classes below, which
    take the place of a fused BatchNorm + activation (timm's ``BatchNormAct2d``).

    Built directly, the norm's own arguments come first, then ``drop=`` / ``act=``
    (``nn.Identity()`` when not given)."""

    def __init__(self, *args: Any, drop: nn.Module | None = None, act: nn.Module | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drop = drop if drop is not None else nn.Identity()
        self.act = act if act is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(super().forward(x)))


class SyncBatchNormAct(_NormAct, SyncBatchNorm):
    """:class:`distnorm.SyncBatchNorm`, then its ``drop`` and ``act`` children: what
    ``convert(norm="bn")`` makes of timm's ``BatchNormAct2d`` (same ``state_dict`` keys)."""


class GroupNormAct(_NormAct, GroupNorm):
    """:class:`distnorm.layers.GroupNorm`, then its ``drop`` and ``act`` children: what ``convert(norm="gn")``
    makes of timm's ``BatchNormAct2d`` (BNP + GN; same ``state_dict`` keys)."""


#: The norm + activation class of each norm :func:`convert` puts in place of a fused
#: BatchNorm + activation (the pre-operation norms sit in front of the conv instead).
#: Written out at module level, as timm does, so that ``torch.save(model)`` and ``pickle``
#: find them by name.
NORM_ACT_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    SyncBatchNorm: SyncBatchNormAct,
    GroupNorm: GroupNormAct,
}


def _with_activation(norm: nn.Module, drop: nn.Module, act: nn.Module) -> nn.Module:
    """``norm`` followed by ``drop`` and ``act`` as its children ``drop`` / ``act`` (the layout
    of timm's ``BatchNormAct2d``, so state_dict keys do not change). ``norm`` keeps its
    Parameters and buffers: only its class becomes the norm + activation one."""
    fused = NORM_ACT_CLASSES.get(type(norm))
    if fused is None:  # an internal invariant: _new_norm builds only these classes
        raise TypeError(f"convert: no norm + activation class for {type(norm).__name__}; "
                        f"known: {[cls.__name__ for cls in NORM_ACT_CLASSES]}")
    norm.__class__ = fused
    norm.drop, norm.act = drop, act
    return norm


def _activation_only(drop: nn.Module, act: nn.Module) -> nn.Module:
    """What stays where a fused norm + activation was removed: ``act(drop(x))``."""
    return nn.Sequential(OrderedDict([("drop", drop), ("act", act)]))


class _Tracer(fx.Tracer):
    """torch.fx tracer that keeps distnorm's own modules (their forwards call autograd
    Functions that cannot take proxies) and every BatchNorm, fused ones included, as leaves:
    a BatchNorm subclass outside ``torch.nn`` (timm's ``BatchNormAct2d``) would otherwise be
    traced through and never show up as the conv's follower."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, (_DistNormLayer, PreNorm, *BATCH_NORMS)) or super().is_leaf_module(m, module_qualified_name)


def _trace(model: nn.Module) -> fx.GraphModule | None:
    try:
        return fx.GraphModule(model, _Tracer().trace(model))
    except Exception as err:  # noqa: BLE001 - any tracing failure means "use the fallback"
        logger.debug("torch.fx could not trace %s: %s", type(model).__name__, err)
        return None


def linear_batchnorm_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """``(op, batchnorm)`` names of the conv / linear layers whose output goes straight into a
    BatchNorm, from the model's dataflow (``torch.fx``); empty if it cannot be traced. The
    pairs the pre-operation modes of :func:`convert` move normalization across."""
    graph = _trace(model)
    if graph is None:
        return []
    return _pairs_from_graph(graph, dict(model.named_modules()))[0]


def _pairs_from_graph(graph_module: fx.GraphModule, modules: dict[str, nn.Module]):
    """``(pairs, unpaired)``: BN paths whose input comes straight from a conv / linear."""
    pairs: list[tuple[str, str]] = []
    unpaired: list[str] = []
    seen_bn: Counter = Counter()
    seen_op: Counter = Counter()
    for node in graph_module.graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(node.target), BATCH_NORMS):
            continue
        seen_bn[node.target] += 1
        source = node.args[0] if node.args else None
        if (
            isinstance(source, fx.Node)
            and source.op == "call_module"
            and isinstance(modules.get(source.target), LINEAR_OPS)
            and _channels_out(modules[source.target]) == modules[node.target].num_features
        ):
            seen_op[source.target] += 1
            pairs.append((source.target, node.target))
        else:
            unpaired.append(node.target)
    reused = [name for name, n in (seen_bn + seen_op).items() if n > 1]
    if reused:
        raise ValueError(
            f"convert: modules {reused} are called more than once in the forward, so moving "
            "normalization in front of them is ambiguous; give each call its own module"
        )
    return pairs, unpaired


def _pairs_by_registration(modules: dict[str, nn.Module]):
    """Fallback for untraceable models: each BN pairs with the closest preceding conv /
    linear in registration order whose output channels match."""
    pairs, unpaired = [], []
    last_op: str | None = None
    for name, module in modules.items():
        if isinstance(module, LINEAR_OPS):
            last_op = name
        elif isinstance(module, BATCH_NORMS):
            if last_op is not None and _channels_out(modules[last_op]) == module.num_features:
                pairs.append((last_op, name))
                last_op = None
            else:
                unpaired.append(name)
    return pairs, unpaired


def _gates(graph_module: fx.GraphModule | None, modules: dict[str, nn.Module]) -> set[str]:
    """Sigmoid-like activations that gate a product (squeeze-excitation)."""
    if graph_module is not None:
        gates = set()
        for node in graph_module.graph.nodes:
            if node.op == "call_module" and isinstance(modules.get(node.target), _GATES):
                for user in node.users:
                    if (user.op == "call_function" and user.target in _MUL_TARGETS) or (
                        user.op == "call_method" and user.target in ("mul", "mul_")
                    ):
                        gates.add(node.target)
        return gates
    # Untraceable model: recognise gates by the conventional names of SE implementations.
    gates = set()
    for name, module in modules.items():
        parent, _, attr = name.rpartition(".")
        parent_cls = type(modules.get(parent, nn.Module())).__name__.lower()
        if isinstance(module, _GATES) and (attr in ("scale_activation", "gate") or "squeezeexcit" in parent_cls):
            gates.add(name)
    return gates


def _new_norm(norm: str, bn: nn.Module, process_group: ProcessGroup | None, spec: Any) -> nn.Module:
    if norm == "bn":  # shares the BatchNorm's Parameter and buffer objects
        return spec.build(bn.num_features, process_group=process_group, replacing=bn)
    if norm == "gn":
        return _like(spec.build(bn.num_features, replacing=bn), bn)
    return _like(nn.Identity(), bn)  # "none" and the removed BN of the pre-op modes


def _pre_norm(spec: Any, op: nn.Module, process_group: ProcessGroup | None) -> nn.Module:
    return _like(spec.build(_channels_in(op), process_group=process_group), op)


def _norm_spec(norm: Any, layer_kwargs: dict[str, Any]) -> tuple[str | None, Any]:
    """``(name, spec)`` from ``convert``'s ``norm`` (a name or a spec) and keywords; the
    spec validates the hyper-parameters (``distnorm.specs``, their one owner)."""
    if isinstance(norm, tuple(NORM_SPECS.values())):
        if layer_kwargs:
            raise ValueError(f"convert: give the hyper-parameters in the spec or as keywords, not both "
                             f"(got {type(norm).__name__} and {sorted(layer_kwargs)})")
        return next(name for name, cls in NORM_SPECS.items() if isinstance(norm, cls)), norm
    if norm is None:
        raise ValueError(f"convert: norm=None is not a norm; norm={KEEP!r} leaves the BatchNorm layers as they are")
    if norm not in NORM_LABELS:
        raise ValueError(f"convert: unknown norm {norm!r}; choose one of {NORM_LABELS} or a spec from distnorm.specs")
    if norm == KEEP:
        if layer_kwargs:
            raise ValueError(f"convert(norm={KEEP!r}) changes no layer: unknown keyword(s) {sorted(layer_kwargs)}")
        return None, None
    if norm in NORM_SPECS:
        return norm, NORM_SPECS[norm].from_kwargs(f"convert(norm={norm!r})", **layer_kwargs)
    if layer_kwargs:
        raise ValueError(f"convert(norm={norm!r}): unknown keyword(s) {sorted(layer_kwargs)}; accepted: []")
    return norm, None


def convert(
    model: nn.Module,
    norm: str | NormSpec = "cbn",
    activation: str | None = None,
    process_group: ProcessGroup | None = None,
    *,
    unpaired: str = "error",
    **layer_kwargs: Any,
) -> nn.Module:
    """Convert ``model``'s BatchNorm layers (and optionally activations) in place.

    Args:
        model: the bare model (not yet wrapped by DDP / DeepSpeed / FSDP).
        norm: ``"cbn"``, ``"popnorm"`` (pre-operation), ``"bn"`` (synchronized BatchNorm),
            ``"gn"`` (GroupNorm), ``"none"`` (remove), or ``"keep"`` to leave the
            BatchNorm layers as they are (e.g. to change only the activation); or a spec from
            :mod:`distnorm.specs` (``CBNSpec(rho=2.0)``), which carries the hyper-parameters.
        activation: ``"relu"``, ``"sigmoid"``, ``"tanh"``, ``"selu"``, ``"swish"``, or
            ``None`` to keep the model's activations.
        process_group: group the new synchronized layers reduce over.
        unpaired: pre-op modes only — what to do with a BatchNorm whose input does not come
            straight from a conv / linear: ``"error"`` (default) or ``"sync"`` (make it a
            synchronized BatchNorm in place, with a warning naming it).
        **layer_kwargs: the fields of the norm's spec (``rho``, ``omega``, ``kappa``, ``eps``,
            ``momentum``, ...; ``num_groups`` or ``group_size`` for ``"gn"``), when ``norm``
            is a name.

    Returns:
        ``model`` itself, converted; :func:`conversion_summary` tells what was replaced.

    Raises:
        ValueError: unknown ``norm`` / ``activation`` / keyword, an unpaired BatchNorm with
            ``unpaired="error"``, or a model already converted differently.
        TypeError: the model is wrapped by DDP / DeepSpeed / FSDP.

    Example:
        >>> import torch, distnorm
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        ...                           torch.nn.Conv2d(8, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        >>> net = distnorm.convert(net, norm="cbn", activation="tanh")
        >>> distnorm.conversion_summary(net)
        {'BatchNorm2d -> removed (pre-op CBN)': 2, 'Conv2d -> CBN + Conv2d': 2, 'ReLU -> Tanh': 2}
    """
    refuse_wrapped(model, "distnorm.convert()")
    norm, spec = _norm_spec(norm, layer_kwargs)
    if activation is not None:
        activation = _ACTIVATION_ALIASES.get(activation, activation)
        if activation not in ACTIVATIONS:
            raise ValueError(f"convert: unknown activation {activation!r}; choose one of {tuple(ACTIVATIONS)} or None")
    if unpaired not in ("error", "sync"):
        raise ValueError(f"convert: unpaired must be 'error' or 'sync', got {unpaired!r}")

    record: _Record | None = getattr(model, "_distnorm_conversion", None)
    if record is not None:
        same_norm = norm is None or norm == record.norm
        same_act = activation is None or activation == record.activation
        if same_norm and same_act:
            return model  # idempotent
        if not same_norm and record.norm is not None:
            raise ValueError(
                f"convert: the model was already converted with norm={record.norm!r}; "
                "call distnorm.revert(model) before converting it to another norm"
            )
    else:
        record = _Record(norm=None, activation=None)

    modules = dict(model.named_modules())
    graph_module = _trace(model)
    if norm is not None and record.norm is None:
        _convert_norms(model, modules, graph_module, norm, spec, process_group, unpaired, record)
        record.norm = norm
    if activation is not None and activation != record.activation:
        _swap_activations(model, dict(model.named_modules()), modules, graph_module, activation, record)
        record.activation = activation
    model._distnorm_conversion = record
    name_layers(model)
    logger.info("distnorm.convert: %s", record.summary())
    return model


def _convert_norms(model, modules, graph_module, norm, spec, process_group, unpaired, record) -> None:
    bns = [name for name, m in modules.items() if isinstance(m, BATCH_NORMS)]
    if norm in ("bn", "gn", "none"):
        for name in bns:
            bn = modules[name]
            new = _new_norm(norm, bn, process_group, spec)
            fused = _fused_activation(bn)
            if fused is not None:
                new = _with_activation(new, *fused) if norm != "none" else _activation_only(*fused)
            _set(model, name, new)
            target = {"bn": "SyncBatchNorm", "gn": "GroupNorm", "none": "removed"}[norm]
            record.changes.append(_Change(name, bn, f"{type(bn).__name__} -> {target}"))
        return

    if graph_module is not None:
        pairs, lonely = _pairs_from_graph(graph_module, modules)
    else:
        pairs, lonely = _pairs_by_registration(modules)
        if pairs:
            listing = ", ".join(f"{op} -> {bn}" for op, bn in pairs)
            warnings.warn(
                f"convert: torch.fx cannot trace {type(model).__name__}, so conv -> BatchNorm pairs were "
                f"taken from registration order: {listing}. Check them, or make the model traceable.",
                stacklevel=3,
            )
    if lonely:
        if unpaired == "error":
            raise ValueError(
                f"convert(norm={norm!r}): BatchNorm layers {lonely} do not follow a conv / linear layer, "
                "so there is no operation to move normalization in front of. Pass unpaired='sync' to make "
                "them synchronized BatchNorm instead, or convert with norm='bn'."
            )
        warnings.warn(
            f"convert(norm={norm!r}): BatchNorm layers {lonely} follow no conv / linear; they become "
            "distnorm.SyncBatchNorm in place (unpaired='sync')",
            stacklevel=3,
        )
        for name in lonely:
            bn = modules[name]
            new = _new_norm("bn", bn, process_group, SyncBNSpec())
            fused = _fused_activation(bn)
            _set(model, name, _with_activation(new, *fused) if fused is not None else new)
            record.changes.append(_Change(name, bn, f"{type(bn).__name__} -> SyncBatchNorm (unpaired)"))
    label = "CBN" if norm == "cbn" else "POPNorm"
    for op_name, bn_name in pairs:
        bn, op = modules[bn_name], modules[op_name]
        fused = _fused_activation(bn)
        _set(model, bn_name, _activation_only(*fused) if fused is not None else _new_norm("none", bn, process_group, None))
        record.changes.append(_Change(bn_name, bn, f"{type(bn).__name__} -> removed (pre-op {label})"))
        _set(model, op_name, PreNorm(_pre_norm(spec, op, process_group), op).train(op.training))
        record.changes.append(_Change(op_name, op, f"{type(op).__name__} -> {label} + {type(op).__name__}"))


def _swap_activations(model, current, original_modules, graph_module, activation, record) -> None:
    gates = _gates(graph_module, original_modules)
    new_cls = ACTIVATIONS[activation]
    for name, module in current.items():
        if not isinstance(module, ACTIVATION_MODULES) or name in gates or type(module) is new_cls:
            continue
        _set(model, name, _like(new_cls(), module))
        record.changes.append(_Change(name, module, f"{type(module).__name__} -> {new_cls.__name__}"))
    # The architecture chose in-place execution for its own activations: a later in-place
    # op (ReLU(inplace=True), Dropout(inplace=True)) may overwrite a tensor the new
    # activation needs for its backward (tanh and sigmoid keep their output). Run everything
    # out of place; revert() restores the flags.
    for name, module in model.named_modules():
        if getattr(module, "inplace", False) is True:
            module.inplace = False
            record.inplace_disabled.append(name)
    if graph_module is not None:
        functional = [
            n.name for n in graph_module.graph.nodes
            if n.op in ("call_function", "call_method")
            and getattr(n.target, "__name__", n.target) in ("relu", "relu_", "sigmoid", "tanh", "silu", "gelu", "selu", "elu")
        ]
        if functional:
            warnings.warn(
                f"convert(activation={activation!r}): activations called as functions ({functional}) "
                "cannot be swapped by module surgery and were left unchanged",
                stacklevel=3,
            )


def revert(model: nn.Module) -> nn.Module:
    """Undo :func:`convert`: put every original module object back (original classes; for
    ``"bn"`` with the synchronized layers' trained parameters and statistics, on their device
    and dtype). Returns ``model``.

    The other norms have nothing to give back: the BatchNorms they replaced come back as they
    were before training, so a trained model computes something else after ``revert``. It
    warns then, naming :func:`distnorm.freeze`, which gives the trained model as plain
    ``torch.nn``.
    """
    record: _Record | None = getattr(model, "_distnorm_conversion", None)
    if record is None:
        raise ValueError("revert: this model was not converted by distnorm.convert")
    refuse_wrapped(model, "distnorm.revert()")
    untrained = []
    for change in reversed(record.changes):
        current = _get(model, change.path)
        if isinstance(current, SyncBatchNorm) and isinstance(change.original, nn.modules.batchnorm._BatchNorm):
            _carry_over(current, change.original)
        elif _trained(current):
            untrained.append(change.path)
        _set(model, change.path, change.original)
    if untrained:
        warnings.warn(
            f"revert: {len(untrained)} trained distnorm layer(s) ({', '.join(untrained[:3])}"
            f"{', ...' if len(untrained) > 3 else ''}) go back to the BatchNorms they replaced, as they were before "
            "training: the model's outputs change. To keep what was trained as plain torch.nn, use "
            "distnorm.freeze(model) instead.", stacklevel=2)
    for path in record.inplace_disabled:
        _get(model, path).inplace = True
    del model._distnorm_conversion
    return model


def _trained(module: nn.Module) -> bool:
    """Whether ``module`` holds a norm that training changed: a distnorm layer that counted
    steps, or a GroupNorm whose affine left its initial ones and zeros."""
    for m in module.modules():
        if isinstance(m, _DistNormLayer) and getattr(m, "num_batches_tracked", None) is not None:
            if int(m.num_batches_tracked) > 0:
                return True
        elif isinstance(m, nn.GroupNorm) and m.affine:
            if bool(m.weight.detach().ne(1).any()) or bool(m.bias.detach().ne(0).any()):
                return True
    return False


def _carry_over(layer: SyncBatchNorm, original: nn.Module) -> None:
    """``layer``'s parameters and statistics into the BatchNorm it replaced: the Parameters
    are shared, but a buffer replaced by ``model.to(...)`` after ``convert`` is the layer's alone."""
    own = {k: v for k, v in layer.state_dict().items() if "." not in k}
    floats = [t for t in own.values() if t.is_floating_point()]
    if floats:
        original.to(device=floats[0].device, dtype=floats[0].dtype)
    original.load_state_dict({**original.state_dict(), **own}, strict=True)


def conversion_summary(model: nn.Module) -> dict[str, int]:
    """What :func:`convert` replaced in ``model``: ``{"old -> new": count}`` (empty if nothing)."""
    record: _Record | None = getattr(model, "_distnorm_conversion", None)
    return record.summary() if record is not None else {}
