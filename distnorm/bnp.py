"""BNP — batch normalization preconditioning (paper 004; SPEC §5).

BNP changes no activation. It preconditions the gradient of each dense / convolution layer
with running statistics of that layer's *input*::

    handle = distnorm.bnp.attach(model)     # before DDP / accelerate.prepare / deepspeed.initialize
    ...                                     # train as usual: after loss.backward(), weight.grad
    handle.detach()                         # and bias.grad already hold the preconditioned gradient

Per preconditioned layer, in every training forward (one all-reduce, shared with the
synchronized layers' packing):

* ``mu_H, var_H``: mean and biased variance of the input per input feature / channel over
  the global batch (conv: also over the spatial dims; dense global batch of one sample:
  ``var_H = (h - mu)^2`` with the running ``mu``, paper 004 §3.3);
* ``mu <- rho mu + (1 - rho) mu_H``, ``var <- rho var + (1 - rho) var_H`` — buffers
  ``bnp_mean`` / ``bnp_var`` on the layer, so they travel with ``model.state_dict()``;
* ``var_t = var + eps1 * max(var) + eps2``; ``q² = max(n_in / N, 1)`` (dense) or
  ``max(c_in k_h k_w / N, sqrt(H_out W_out))`` (conv; ``c_in`` is the per-group fan-in,
  ``N`` the global batch size).

In the backward, :class:`distnorm._bnp_functions.BNPGradientFunction` replaces ``(G_w, G_b)``
by ``(1/q²) P Pᵀ [G_b; G_w]``. Because the statistics are all-reduced, the map is the same
linear map on every rank, so it commutes with the data-parallel gradient average: DDP,
Accelerate and every DeepSpeed ZeRO stage see exactly the gradient single-process training
on the global batch would produce.

Gradient accumulation: each micro-batch forward is one BNP step for the statistics, and each
micro-batch's gradient is preconditioned with the statistics of its own forward (``N`` is
the micro-batch's global size). The accumulated gradient is the sum of those.

Weight decay applied by the optimizer (``weight_decay=``) is added after the
preconditioning; an L2 term in the loss is preconditioned with the rest.

Only training-mode forwards with gradients enabled update the statistics and precondition;
``torch.no_grad()`` and ``eval()`` forwards leave everything untouched.

Each layer keeps its own ``forward``, so subclasses that pad, standardize or otherwise
transform their weight (timm's ``Conv2dSame``, ``StdConv2d``) behave as before: hooks give
the forward an alias of the weight whose gradient is preconditioned, and ``q²`` is taken
from the output the layer really produced. A layer whose forward never runs (the
``out_proj`` of ``nn.MultiheadAttention``) is refused with an error naming it.

Activation checkpointing: a recomputed forward reuses the first forward's statistics, so
the moments are updated once per step (:mod:`distnorm._recompute`).
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from typing import Any, Iterable

import torch
from torch import nn

from distnorm import _functions, _kernel_choice, _state
from distnorm._bnp_functions import BNPGradientFunction, BNPLayerState, bnp_q2
from distnorm._collectives import ProcessGroup
from distnorm._recompute import StashedPlan
from distnorm._wrappers import refuse_wrapped
from distnorm.specs import BNPSpec, register_builder

__all__ = ["BNPHandle", "attach", "SUPPORTED_LAYERS"]

#: Layer types BNP knows how to precondition (subclasses included).
SUPPORTED_LAYERS: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)

BUFFERS = ("bnp_mean", "bnp_var")


class _Q2:
    """``q²`` of one forward: known once the layer's output exists (forward hook), read by
    the gradient transform in the backward."""

    __slots__ = ("q2", "stashed")

    def __init__(self, stashed: StashedPlan | None) -> None:
        self.q2: torch.Tensor | float | None = None
        self.stashed = stashed  # the autograd node holds the holder: the stashed plan lives as long


def _pre_forward(module: nn.Module, args: tuple) -> None:
    """Before the layer's own forward: this step's statistics (one collective).

    The layer keeps its own ``forward`` (a subclass's too). During the call, its
    ``weight`` and ``bias`` attributes read aliases returned by
    :class:`~distnorm._bnp_functions.BNPGradientFunction`, whose backward preconditions the
    gradient on its way to the Parameters (see :func:`_preconditioned_class`). The aliases
    are made at the first read inside the forward, after every other pre-forward hook —
    DeepSpeed ZeRO-3 gathers partitioned parameters in one of those.
    """
    state: BNPLayerState = module._distnorm_bnp
    state.called = True
    state.active = None
    if not (module.training and torch.is_grad_enabled()):
        return
    for buf in BUFFERS:  # keep the moments float32 after model.half() / .bfloat16()
        if module._buffers[buf].dtype in (torch.float16, torch.bfloat16):
            module._buffers[buf] = module._buffers[buf].float()
    x = args[0]
    h = x.reshape(-1, x.shape[-1]) if state.dense else x
    mean, var_t, count = _functions.bnp_statistics(h, module.bnp_mean, module.bnp_var, state)
    state.count, state.in_spatial = count, tuple(x.shape[2:])
    if torch.compiler.is_compiling():
        # The compiled backward is traced now, so q² must be known now: nn.ConvNd's output
        # size (checked against the real output in _post_forward).
        state.holder = None
        q2: Any = bnp_q2(count, state.fan_in, state.in_spatial, _expected_out_spatial(module, x))
    else:
        q2 = state.holder = _Q2(state.pending)
    state.pending = None
    state.active = (mean, var_t, q2)


def _aliases(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The preconditioned aliases of this forward, made once at the first read."""
    state: BNPLayerState = module.__dict__["_distnorm_bnp"]
    if state.aliases is None:
        mean, var_t, q2 = state.active
        weight = _own(module, "weight")
        # The kernel the group agreed on (after this step's statistics, which carried the vote
        # at its first step); a compiled backward fuses ATen's calls itself.
        kernel = (None if torch.compiler.is_compiling()
                  else _kernel_choice.kernels_of(state, state.group(), weight.device).per_channel)
        state.aliases = BNPGradientFunction.apply(weight, _own(module, "bias"), mean, var_t, q2, state.groups,
                                                  kernel)
    return state.aliases


def _own(module: nn.Module, name: str) -> torch.Tensor | None:
    """The layer's ``weight`` / ``bias`` as the plain class would give it: an instance
    attribute an engine set past ``nn.Module.__setattr__`` first, then the Parameter.
    FSDP1 (``FullyShardedDataParallel``) puts views of its gathered flat parameter there for
    the forward, so BNP preconditions the gathered weight."""
    if name in module.__dict__:
        return module.__dict__[name]
    params = module._parameters
    if name in params:
        return params[name]
    raise AttributeError(f"'{type(module).__name__}' object has no attribute '{name}'")


def _weight(module: nn.Module) -> torch.Tensor:
    state = module.__dict__.get("_distnorm_bnp")
    if state is None or state.active is None:
        return _own(module, "weight")
    return _aliases(module)[0]


def _bias(module: nn.Module) -> torch.Tensor | None:
    state = module.__dict__.get("_distnorm_bnp")
    if state is None or state.active is None:
        return _own(module, "bias")
    return _aliases(module)[1]


def _setter(name: str) -> Any:
    """What ``object.__setattr__`` does for the plain class (engines that bypass
    ``nn.Module.__setattr__``, as FSDP1 does, land here): an instance attribute, which
    ``nn.Module`` removes again when a Parameter of that name is registered."""
    def set_(module: nn.Module, value: torch.Tensor | None) -> None:
        module.__dict__[name] = value
    return set_


def _deleter(name: str) -> Any:
    def delete(module: nn.Module) -> None:
        if module.__dict__.pop(name, _MISSING) is _MISSING:
            raise AttributeError(name)
    return delete


_MISSING = object()


_CLASSES: dict[type, type] = {}


def _preconditioned_class(cls: type) -> type:
    """``cls`` with ``weight`` / ``bias`` properties: the Parameters, or during a training
    forward their preconditioned aliases — the way ``torch.nn.utils.parametrize`` changes
    a layer's weight without replacing its ``forward``. The Parameters, the state dict and
    the optimizer are untouched; ``isinstance`` and the class name are kept.

    The class is made per layer class (timm's ``Conv2dSame`` needs its own), so it cannot
    be found by name: a pickled layer records ``cls`` and is given this class again on
    loading (:func:`_reduce_preconditioned`), ``torch.save(model)`` and ``copy.deepcopy``
    included."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (cls,), {
            "weight": property(_weight, _setter("weight"), _deleter("weight")),
            "bias": property(_bias, _setter("bias"), _deleter("bias")),
            "__reduce_ex__": _reduce_preconditioned, "__setstate__": _setstate_preconditioned,
            "__module__": cls.__module__, "_distnorm_original_class": cls,
        })
    return _CLASSES[cls]


def _reduce_preconditioned(module: nn.Module, protocol: int) -> tuple[Any, ...]:
    """Pickle a preconditioned layer as its own class (which pickle finds by name), made
    preconditioned again by :func:`_preconditioned_instance` on loading; the rest (its
    ``__dict__``: Parameters, buffers, hooks, BNP's state) as ``nn.Module`` pickles it."""
    _, _, *state = object.__reduce_ex__(module, max(protocol, 2))
    return (_preconditioned_instance, (module._distnorm_original_class,), *state)


def _preconditioned_instance(cls: type) -> nn.Module:
    """An empty ``cls`` object of the preconditioned class, for pickle to fill."""
    module = cls.__new__(cls)
    module.__class__ = _preconditioned_class(cls)
    return module


def _setstate_preconditioned(module: nn.Module, state: dict[str, Any]) -> None:
    """The layer class's own ``__setstate__``, then register the loaded layer's BNP state
    under a key of its own (the process's layers, whose names a mismatched collective's
    error reads)."""
    module._distnorm_original_class.__setstate__(module, state)
    bnp_state = module.__dict__.get("_distnorm_bnp")
    if bnp_state is not None:
        _state.register(bnp_state, channels=module.bnp_mean.numel())  # its frames' width too


def _post_forward(module: nn.Module, args: tuple, output: Any) -> None:
    """After the forward (also after an exception): drop the aliases; ``q²`` from the
    output's real spatial size (exact for subclasses that pad or reshape)."""
    state: BNPLayerState = module._distnorm_bnp
    state.active = state.aliases = None
    holder, state.holder = state.holder, None
    if not isinstance(output, torch.Tensor) or state.count is None:
        return
    out_spatial = None if state.dense else tuple(output.shape[2:])
    if holder is not None:
        holder.q2 = bnp_q2(state.count, state.fan_in, state.in_spatial, out_spatial)
    elif out_spatial is not None and out_spatial != _expected_out_spatial(module, args[0]):
        raise RuntimeError(
            f"BNP '{state.name}': under torch.compile, q² is computed before the forward from nn.ConvNd's "
            f"output size, but {type(module).__name__}'s own forward produced spatial size {out_spatial}. "
            f"Exclude the layer from BNP (exclude=[{state.name!r}]) or run it without torch.compile."
        )
    state.count = None


def _expected_out_spatial(module: nn.Module, x: torch.Tensor) -> tuple[int, ...] | None:
    """Output spatial size of ``nn.ConvNd``'s own forward for input ``x`` (None: dense)."""
    if isinstance(module, nn.Linear):
        return None
    in_spatial = tuple(x.shape[2:])
    if module.padding == "same":
        return in_spatial
    padding = (0,) * len(in_spatial) if module.padding == "valid" else module.padding
    return tuple(
        (size + 2 * pad - dil * (k - 1) - 1) // stride + 1
        for size, pad, dil, k, stride in zip(in_spatial, padding, module.dilation, module.kernel_size, module.stride)
    )


class BNPHandle:
    """The result of :func:`attach`: the preconditioned layers and how to undo it.

    Attributes:
        config: the hyper-parameters (``config.exclude``: the name patterns given).
        layers: qualified name → preconditioned module.
        exclude: everything ``exclude=`` gave: name patterns, module types, modules.
    """

    def __init__(self, model: nn.Module, config: BNPSpec, layers: dict[str, nn.Module], root_hook: Any,
                 exclude: tuple[Any, ...] = ()):
        self._model = model
        self.config = config
        self.exclude = exclude
        self.layers = layers
        self._root_hook = root_hook
        self._attached = True

    def __repr__(self) -> str:
        state = "attached" if self._attached else "detached"
        return f"BNPHandle({len(self.layers)} layers, {state}, {self.config})"

    def detach(self) -> None:
        """Remove every wrapper, buffer and added bias: the model is as before ``attach``.

        A bias that BNP added and that training has made non-zero is removed too (the
        model's function changes); a warning names those layers.
        """
        if not self._attached:
            return
        changed = []
        self._root_hook.remove()
        for name, module in self.layers.items():
            state: BNPLayerState = module._distnorm_bnp
            for hook in state.hooks:
                hook.remove()
            module.__class__ = module._distnorm_original_class
            for buf in BUFFERS:
                del module._buffers[buf]
            if state.added_bias:
                if module.bias is not None and bool(module.bias.detach().ne(0).any()):
                    changed.append(name)
                module.bias = None
            del module._distnorm_bnp
            del module._distnorm_buffers
        if changed:
            warnings.warn(
                f"bnp.detach(): removed biases that BNP added and training made non-zero in {changed}; "
                "the model's output changes. Keep BNP attached to keep using them.",
                stacklevel=2,
            )
        self._attached = False

    def state_dict(self) -> dict[str, Any]:
        """The configuration and every layer's moments (also in ``model.state_dict()``)."""
        return {
            "config": _saved_config(self.config),
            "layers": {name: {buf: getattr(m, buf).detach().clone() for buf in BUFFERS} for name, m in self.layers.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore moments saved by :meth:`state_dict` into the attached layers."""
        if not self._attached:
            raise RuntimeError("bnp: this handle was detached; attach again before loading state")
        saved = BNPSpec(**state["config"], exclude=self.config.exclude)
        if saved != self.config:
            raise ValueError(f"bnp: saved configuration {saved} differs from the attached {self.config}")
        missing = set(self.layers) ^ set(state["layers"])
        if missing:
            raise ValueError(f"bnp: saved state and attached model differ in layers {sorted(missing)}")
        with torch.no_grad():
            for name, module in self.layers.items():
                for buf in BUFFERS:
                    getattr(module, buf).copy_(state["layers"][name][buf])


def _excluded(name: str, module: nn.Module, exclude: Iterable[Any]) -> bool:
    for item in exclude:
        if isinstance(item, str) and fnmatch.fnmatchcase(name, item):
            return True
        if isinstance(item, type) and isinstance(module, item):
            return True
        if item is module:
            return True
    return False


def _saved_config(spec: BNPSpec) -> dict[str, Any]:
    """What a handle's state records of its configuration (the hyper-parameters that shape the
    moments; which layers were chosen is recorded by the layer names)."""
    return {"decay": spec.decay, "eps1": spec.eps1, "eps2": spec.eps2, "add_bias": spec.add_bias}


def attach(
    model: nn.Module,
    *,
    decay: float = BNPSpec.decay,
    eps1: float = BNPSpec.eps1,
    eps2: float = BNPSpec.eps2,
    add_bias: bool = BNPSpec.add_bias,
    layers: tuple[type[nn.Module], ...] = SUPPORTED_LAYERS,
    exclude: Iterable[Any] = BNPSpec.exclude,
    process_group: ProcessGroup | None = None,
) -> BNPHandle:
    """Precondition the gradients of ``model``'s dense and convolution layers with BNP.

    Call it on the bare model, before wrapping it (DDP, ``accelerator.prepare``,
    ``deepspeed.initialize``) and before building the optimizer (``add_bias`` may add
    parameters). Registers buffers ``bnp_mean`` / ``bnp_var`` on every preconditioned layer.

    Args:
        model: the model to precondition.
        decay: weight of the history in the running moments (the paper's ``rho``).
        eps1, eps2: ``var_t = var + eps1 * max(var) + eps2``.
        add_bias: give bias-free layers a zero-initialised bias, so that the centring part
            of the preconditioner applies; with ``False`` they only get the scaling part.
        layers: the layer types to precondition (a subset of :data:`SUPPORTED_LAYERS`).
        exclude: qualified module names (``fnmatch`` patterns), module types or module
            instances to leave alone (e.g. ``exclude=["fc"]`` for the classifier).
        process_group: group over which the input statistics are all-reduced.

    Returns:
        A :class:`BNPHandle` (``detach()``, ``state_dict()``, ``load_state_dict()``).

    Raises:
        TypeError: the model is wrapped by DDP / FSDP / DeepSpeed, or ``layers`` names a
            type BNP cannot precondition.
        ValueError: BNP is already attached, a hyper-parameter is invalid, or no layer matched.

    Example:
        >>> import torch, distnorm
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> handle = distnorm.bnp.attach(model)
        >>> model(torch.randn(16, 8)).sum().backward()   # grads are preconditioned
        >>> sorted(handle.layers)
        ['0', '2']
        >>> handle.detach()
    """
    refuse_wrapped(model, "distnorm.bnp.attach()")
    if isinstance(exclude, str):  # "fc,head", as the command line and the environment give it
        exclude = tuple(p.strip() for p in exclude.split(",") if p.strip())
    exclude = tuple(exclude)
    patterns = tuple(item for item in exclude if isinstance(item, str))
    config = BNPSpec(decay=decay, eps1=eps1, eps2=eps2, add_bias=add_bias, exclude=patterns)  # validates
    chosen = _choose_layers(model, _supported(tuple(layers)), exclude)
    for name, module in chosen.items():
        _precondition(name, module, config, process_group)
    root_hook = model.register_forward_hook(_FirstForwardCheck(chosen))
    return BNPHandle(model, config, chosen, root_hook, exclude)


def _supported(layers: tuple[Any, ...]) -> tuple[type[nn.Module], ...]:
    """``layers`` if BNP can precondition every type in it, else a TypeError naming the other."""
    for kind in layers:
        if not (isinstance(kind, type) and issubclass(kind, SUPPORTED_LAYERS)):
            supported = ", ".join(f"nn.{t.__name__}" for t in SUPPORTED_LAYERS)
            raise TypeError(
                f"bnp: cannot precondition {getattr(kind, '__name__', kind)!r} listed in layers=; "
                f"BNP supports {supported} (and their subclasses). Remove it from layers=."
            )
    return layers


def _choose_layers(model: nn.Module, layers: tuple[type[nn.Module], ...],
                   exclude: tuple[Any, ...]) -> dict[str, nn.Module]:
    """The modules of ``model`` to precondition, refusing what BNP would silently miss."""
    chosen = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, layers) and not _excluded(name, module, exclude)
    }
    bypassed = [f"{name}.out_proj" if name else "out_proj" for name, m in model.named_modules()
                if isinstance(m, nn.MultiheadAttention) and (f"{name}.out_proj" if name else "out_proj") in chosen]
    if bypassed:
        raise ValueError(
            f"bnp: cannot precondition {bypassed}: nn.MultiheadAttention uses out_proj's weight directly and "
            "never calls its forward, so its gradient would silently go unpreconditioned. Leave them out "
            f"with exclude={bypassed!r}."
        )
    already = [name for name, m in chosen.items() if hasattr(m, "_distnorm_bnp")]
    if already:
        raise ValueError(
            f"bnp: already attached to {already}; call handle.detach() on the earlier handle first"
        )
    if not chosen:
        raise ValueError(
            "bnp: no layer to precondition (looked for "
            f"{', '.join(t.__name__ for t in layers)}; exclude={list(exclude)!r})"
        )
    return chosen


def _precondition(name: str, module: nn.Module, config: BNPSpec, process_group: ProcessGroup | None) -> None:
    """Give ``module`` its moments buffers, its state and its hooks (and a zero bias, if asked)."""
    weight = module.weight
    in_channels = module.in_features if isinstance(module, nn.Linear) else module.in_channels
    added_bias = False
    if module.bias is None and config.add_bias:
        module.bias = nn.Parameter(torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device))
        added_bias = True
    kw = dict(device=weight.device, dtype=torch.float64 if weight.dtype == torch.float64 else torch.float32)
    module.register_buffer("bnp_mean", torch.zeros(in_channels, **kw))
    module.register_buffer("bnp_var", torch.ones(in_channels, **kw))
    module._distnorm_buffers = BUFFERS  # checked by distnorm.check_consistency
    state = BNPLayerState(
        name=name or "<root>", config=config, process_group=process_group, added_bias=added_bias,
        dense=isinstance(module, nn.Linear), fan_in=math.prod(weight.shape[1:]),
        groups=getattr(module, "groups", 1),
    )
    _state.register(state, channels=in_channels)
    state.hooks = [module.register_forward_pre_hook(_pre_forward),
                   module.register_forward_hook(_post_forward, always_call=True)]
    module._distnorm_bnp = state
    module.__class__ = _preconditioned_class(type(module))


class _FirstForwardCheck:
    """After the model's first training forward: refuse preconditioned layers whose forward
    never ran (their weights are used some other way, so BNP would silently not apply)."""

    def __init__(self, layers: dict[str, nn.Module]):
        self.layers = layers
        self.done = False

    def __call__(self, model: nn.Module, args: tuple, output: Any) -> None:
        if self.done or not (model.training and torch.is_grad_enabled()):
            return
        if not torch.compiler.is_compiling():
            # Compiled: checked whenever the forward is traced, and never flipped -- the graph
            # guards on the flag it reads, and would recompile at the next call.
            self.done = True
        missed = [name for name, m in self.layers.items() if not m._distnorm_bnp.called]
        if missed:
            raise ValueError(
                f"bnp: the forward of {missed} did not run in the model's training forward, so BNP cannot "
                "precondition their gradients (their weights are used without calling them, or they are "
                f"unused). Leave them out with bnp.attach(..., exclude={missed!r})."
            )


def _attach_spec(model: nn.Module, *, process_group: ProcessGroup | None = None, **fields: Any) -> BNPHandle:
    return attach(model, process_group=process_group, **fields)


register_builder(BNPSpec, _attach_spec)
