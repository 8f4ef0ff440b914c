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

In the backward, :class:`distnorm._functions.BNPGradientFunction` replaces ``(G_w, G_b)``
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
"""

from __future__ import annotations

import fnmatch
import math
import types
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Iterable

import torch
from torch import nn

from distnorm import _collectives
from distnorm._collectives import ProcessGroup
from distnorm._functions import BNPGradientFunction
from distnorm._wrappers import refuse_wrapped

__all__ = ["BNPConfig", "BNPHandle", "attach", "SUPPORTED_LAYERS"]

#: Layer types BNP knows how to precondition (subclasses included).
SUPPORTED_LAYERS: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)

BUFFERS = ("bnp_mean", "bnp_var")


@dataclass(frozen=True)
class BNPConfig:
    """BNP's hyper-parameters (paper 004 defaults)."""

    momentum: float = 0.99
    eps1: float = 1e-2
    eps2: float = 1e-4
    add_bias: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.momentum, (int, float)) and 0.0 <= self.momentum < 1.0):
            raise ValueError(f"bnp: momentum (the running-average weight rho) must be in [0, 1), got {self.momentum!r}")
        for name in ("eps1", "eps2"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"bnp: {name} must be a finite number >= 0, got {value!r}")
        if self.eps1 == 0 and self.eps2 == 0:
            raise ValueError("bnp: eps1 and eps2 cannot both be 0 (var_t could be 0 and divide by zero)")


@dataclass
class _LayerState:
    """What BNP keeps per preconditioned layer (stored as ``module._distnorm_bnp``)."""

    name: str
    config: BNPConfig
    group: ProcessGroup | None
    added_bias: bool
    instance_forward: Any  # a forward the instance had before (rare), restored on detach


def _conv_out_spatial(module: nn.Module, in_spatial: tuple[int, ...]) -> tuple[int, ...]:
    """Output spatial size of a Conv{1,2,3}d for an input of spatial size ``in_spatial``."""
    if module.padding == "same":
        return in_spatial
    padding = (0,) * len(in_spatial) if module.padding == "valid" else module.padding
    return tuple(
        (size + 2 * pad - dil * (k - 1) - 1) // stride + 1
        for size, pad, dil, k, stride in zip(in_spatial, padding, module.dilation, module.kernel_size, module.stride)
    )


def _update_and_precondition_args(module: nn.Module, x: torch.Tensor, state: _LayerState):
    """One BNP statistics step on ``x``; returns ``(mean, var_t, q2)`` for the backward."""
    conv = not isinstance(module, nn.Linear)
    h = x if conv else x.reshape(-1, x.shape[-1])
    moments = _collectives.global_moments(h, state.group, layer=f"BNP '{state.name}'")
    for buf in BUFFERS:  # keep the moments float32 after model.half() / .bfloat16()
        if module._buffers[buf].dtype in (torch.float16, torch.bfloat16):
            module._buffers[buf] = module._buffers[buf].float()
    mean_buf, var_buf = module.bnp_mean, module.bnp_var
    with torch.no_grad():
        count = moments.count
        # Global batch of a single value per feature: the variance is measured around the
        # running mean instead (paper 004 §3.3). Moments are float64; buffers float32.
        var_h = torch.where(count == 1, (moments.mean - mean_buf.double()) ** 2, moments.var)
        weight = (1.0 - state.config.momentum) * (count > 0).double()
        mean_buf.lerp_(moments.mean.to(mean_buf.dtype), weight.to(mean_buf.dtype))
        var_buf.lerp_(var_h.to(var_buf.dtype), weight.to(var_buf.dtype))
        var_t = var_buf + state.config.eps1 * var_buf.max() + state.config.eps2

        weight_shape = module.weight.shape
        fan_in = math.prod(weight_shape[1:])  # per-group input channels x kernel size
        if conv:
            in_spatial = tuple(x.shape[2:])
            samples = count / max(math.prod(in_spatial), 1)
            floor = math.sqrt(math.prod(_conv_out_spatial(module, in_spatial)))
        else:
            samples, floor = count, 1.0
        q2 = torch.clamp_min(fan_in / samples.clamp_min(1.0), floor)
    return mean_buf.clone(), var_t, q2


def _bnp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Replacement ``forward`` of a preconditioned layer (bound to the instance)."""
    state: _LayerState = self._distnorm_bnp
    weight, bias = self.weight, self.bias
    if self.training and torch.is_grad_enabled():
        mean, var_t, q2 = _update_and_precondition_args(self, x, state)
        groups = getattr(self, "groups", 1)
        weight, bias = BNPGradientFunction.apply(weight, bias, mean, var_t, q2, groups)
    if isinstance(self, nn.Linear):
        return nn.functional.linear(x, weight, bias)
    return self._conv_forward(x, weight, bias)


class BNPHandle:
    """The result of :func:`attach`: the preconditioned layers and how to undo it.

    Attributes:
        config: the hyper-parameters.
        layers: qualified name → preconditioned module.
    """

    def __init__(self, model: nn.Module, config: BNPConfig, layers: dict[str, nn.Module]):
        self._model = model
        self.config = config
        self.layers = layers
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
        for name, module in self.layers.items():
            state: _LayerState = module._distnorm_bnp
            if state.instance_forward is None:
                del module.forward
            else:
                module.forward = state.instance_forward
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
            "config": asdict(self.config),
            "layers": {name: {buf: getattr(m, buf).detach().clone() for buf in BUFFERS} for name, m in self.layers.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore moments saved by :meth:`state_dict` into the attached layers."""
        if not self._attached:
            raise RuntimeError("bnp: this handle was detached; attach again before loading state")
        saved = BNPConfig(**state["config"])
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


def attach(
    model: nn.Module,
    *,
    momentum: float = 0.99,
    eps1: float = 1e-2,
    eps2: float = 1e-4,
    add_bias: bool = True,
    layers: tuple[type[nn.Module], ...] = SUPPORTED_LAYERS,
    exclude: Iterable[Any] = (),
    process_group: ProcessGroup | None = None,
) -> BNPHandle:
    """Precondition the gradients of ``model``'s dense and convolution layers with BNP.

    Call it on the bare model, before wrapping it (DDP, ``accelerator.prepare``,
    ``deepspeed.initialize``) and before building the optimizer (``add_bias`` may add
    parameters). Registers buffers ``bnp_mean`` / ``bnp_var`` on every preconditioned layer.

    Args:
        model: the model to precondition.
        momentum: running-average weight ``rho`` of the moments.
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
    config = BNPConfig(momentum=momentum, eps1=eps1, eps2=eps2, add_bias=add_bias)
    layers = tuple(layers)
    for kind in layers:
        if not (isinstance(kind, type) and issubclass(kind, SUPPORTED_LAYERS)):
            supported = ", ".join(f"nn.{t.__name__}" for t in SUPPORTED_LAYERS)
            raise TypeError(
                f"bnp: cannot precondition {getattr(kind, '__name__', kind)!r} listed in layers=; "
                f"BNP supports {supported} (and their subclasses). Remove it from layers=."
            )
    exclude = list(exclude)
    group = _collectives.sync_group(process_group)

    chosen = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, layers) and not _excluded(name, module, exclude)
    }
    already = [name for name, m in chosen.items() if hasattr(m, "_distnorm_bnp")]
    if already:
        raise ValueError(
            f"bnp: already attached to {already}; call handle.detach() on the earlier handle first"
        )
    if not chosen:
        raise ValueError(
            "bnp: no layer to precondition (looked for "
            f"{', '.join(t.__name__ for t in layers)}; exclude={exclude!r})"
        )
    for name, module in chosen.items():
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
        module._distnorm_bnp = _LayerState(
            name=name or "<root>", config=config, group=group, added_bias=added_bias,
            instance_forward=module.__dict__.get("forward"),
        )
        module.forward = types.MethodType(_bnp_forward, module)
    return BNPHandle(model, config, chosen)
