"""Synchronized normalization layers: :class:`CBN`, :class:`POPNorm`, :class:`SyncBatchNorm`;
and :class:`GroupNorm` (per sample, for BNP + GN), kept in its input's layout and dtype.

The modules own parameters, buffers and their :class:`~distnorm.functional.NormState`;
each forward is one call of :func:`distnorm.functional.normalize`, whose training path goes
down to the operators (:mod:`distnorm._functions`) and the collectives
(:mod:`distnorm._collectives`).

Every layer accepts ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` and ``(N, C, D, H, W)``
inputs, channels_last inputs, and fp16/bf16 inputs (statistics in float32, output in the
input dtype). Buffers stay float32 even after ``model.half()``.
"""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Any

import torch
from torch import nn

from distnorm import _debug
from distnorm import functional  # not torch.nn.functional: distnorm's own
from distnorm._collectives import ProcessGroup
from distnorm.functional import CBNBuffers, NormState
from distnorm.specs import EPS, MOMENTUM, CBNSpec, GNSpec, POPNormSpec, SyncBNSpec, register_builder

__all__ = ["CBN", "GroupNorm", "POPNorm", "SyncBatchNorm", "set_lr", "set_lrs", "name_layers"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_warned_no_lr = False  # one warning per process, not one per layer


def _check_num_features(owner: str, num_features: int) -> None:
    if not isinstance(num_features, int) or isinstance(num_features, bool) or num_features <= 0:
        raise ValueError(f"{owner}: num_features must be a positive int, got {num_features!r}")


#: Layers built by this process, in order: an unnamed layer's name (_DistNormLayer._init_state).
_BUILT = itertools.count(1)


def _state_field(name: str, doc: str) -> property:
    """A module attribute stored in the layer's :class:`NormState` (one owner)."""

    def get(self: "_DistNormLayer") -> Any:
        return getattr(self._state, name)

    def set_(self: "_DistNormLayer", value: Any) -> None:
        setattr(self._state, name, value)

    return property(get, set_, doc=doc)


class _DistNormLayer(nn.Module):
    """Shared behaviour: the layer's :class:`NormState`, a readable name for errors,
    float32 buffers under ``.half()``, and the checkpointing stash."""

    num_features: int
    _state: NormState

    eps = _state_field("eps", "added to the variance")
    momentum = _state_field("momentum", "weight of the new batch in the running statistics (None: cumulative)")
    process_group = _state_field("process_group", "group to synchronize over (None: the default group)")

    def _init_state(self, kind: str, **fields: Any) -> None:
        # Until a model names it (name_layers, set_lr, convert, the plugin), a layer is named by
        # the order in which the process built it: ranks that build the same model name its
        # layers alike, and two bare CBN(64) that ranks run in different orders are told apart
        # by the frames (distnorm._frames) instead of mixing their statistics.
        name = f"{type(self).__name__}({self.num_features}) #{next(_BUILT)}"
        self._state = NormState.of_layer(kind, name, self.num_features, **fields)

    @property
    def _distnorm_name(self) -> str:
        """Qualified name in the model (set by :func:`name_layers`, :func:`set_lr`,
        conversion and the consistency check); used in error messages and debug-mode slot
        fingerprints."""
        return self._state.name

    @_distnorm_name.setter
    def _distnorm_name(self, value: str) -> None:
        self._state.name = value
        self._named = True

    _named = False  # whether a qualified name was recorded

    def train(self, mode: bool = True) -> "_DistNormLayer":
        # A train()/eval() switch ends any reentrant-checkpointing recomputation still pending.
        self._state.stash.drop_detached()
        return super().train(mode)

    def _apply(self, fn: Any, recurse: bool = True) -> "_DistNormLayer":
        # model.half() / .to(bfloat16) would round the statistics buffers to 8-11 mantissa
        # bits; keep them float32 (parameters follow the model's dtype as usual).
        super()._apply(fn, recurse)
        for key, buf in self._buffers.items():
            if buf is not None and buf.dtype in _LOW_PRECISION:
                self._buffers[key] = buf.float()
        return self


class _CompleteNorm(_DistNormLayer):
    """Common implementation of :class:`CBN` and :class:`POPNorm`."""

    rho = _state_field("rho", "normalization magnitude (kappa for POP-Norm)")
    r_max = _state_field("r_max", "clamp of the stop-gradient ratios")
    sync = _state_field("sync", "synchronize statistics across ranks")
    eval_stats = _state_field("eval_stats", 'statistics at evaluation: "auto", "amat" or "running"')
    amat = _state_field("amat", "AMAT on: the training forward blends in history by eta")

    def __init__(self, num_features: int, spec: CBNSpec, process_group: ProcessGroup | None) -> None:
        # Hyper-parameters were validated by the spec (distnorm.specs), their one owner.
        super().__init__()
        _check_num_features(type(self).__name__, num_features)
        self.num_features = num_features
        self._init_state("cbn", eps=float(spec.eps), momentum=spec.momentum, rho=float(spec.rho),
                         r_max=float(spec.r_max), process_group=process_group, sync=bool(spec.sync),
                         eval_stats=spec.resolved_eval_stats, amat=bool(spec.amat))
        self.omega = float(spec.omega)
        self.lr: float | None = None

        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("amat_mean", torch.zeros(num_features))
        self.register_buffer("amat_var", torch.ones(num_features))
        self.register_buffer("amat_initialized", torch.tensor(False))
        #: AMAT's eta in force (set by set_lr), read by the training forward and by
        #: eval_stats="auto"; a tensor so that a changing learning rate never recompiles.
        self.register_buffer("amat_eta", torch.tensor(0.0))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    @property
    def stats_sink(self) -> dict | None:
        """Set to a dict by :mod:`distnorm.monitors` to receive the last batch statistics."""
        return self._state.stats_sink

    @stats_sink.setter
    def stats_sink(self, sink: dict | None) -> None:
        self._state.stats_sink = sink

    def reset_running_stats(self) -> None:
        """Reset the running and AMAT statistics (AMAT re-initialises from the next batch)."""
        self.amat_mean.zero_()
        self.amat_var.fill_(1.0)
        self.amat_initialized.fill_(False)
        self._state.amat_ready = False
        self.running_mean.zero_()
        self.running_var.fill_(1.0)
        self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def set_lr(self, lr: float | torch.Tensor) -> None:
        """Tell AMAT the learning rate the optimizer applies at the current step.

        Call it before each training forward (``distnorm.set_lr(model, lr)`` does it for
        every layer). ``eta = clip(1 - omega * lr, 0, 1)``.

        ``lr`` may be a one-element tensor (capturable / fused optimizers keep it on the
        device): ``eta`` is then computed on the device, never read on the host, and the
        layer reads it on the device as it reads every ``eta`` (for ``eta = 0`` AMAT's blend
        gives the batch statistics). Its value is checked only in debug mode
        (:func:`distnorm.debug`), which reads it.
        """
        lr = _checked_lr(lr, self._distnorm_name)
        self.lr = lr
        if isinstance(lr, torch.Tensor) and self.amat:
            self._set_eta(functional.amat_eta(lr, self.omega))
        else:
            self._set_eta(self.eta)

    def _set_eta(self, eta: float | torch.Tensor) -> None:
        """``amat_eta``, which every training step reads on the device."""
        if isinstance(eta, torch.Tensor):
            self.amat_eta.copy_(eta)
        else:
            self.amat_eta.fill_(eta)

    @property
    def eta(self) -> float:
        """AMAT's weight on history for the current learning rate (0 without AMAT). For a
        tensor learning rate this reads it on the host."""
        if not self.amat or self.lr is None:
            return 0.0
        return float(functional.amat_eta(self.lr, self.omega))

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        # The host-side fact follows the loaded buffer (one read at load time, not per step).
        self._state.amat_ready = bool(self.amat_initialized)

    def _statistics(self) -> CBNBuffers:
        """The six statistics buffers, as one structure (read from the module's buffer dict:
        six ``nn.Module.__getattr__`` fallbacks cost a step more host time than the lookups)."""
        buffers = self._buffers
        return CBNBuffers(buffers["amat_mean"], buffers["amat_var"], buffers["amat_initialized"],
                          buffers["running_mean"], buffers["running_var"], buffers["num_batches_tracked"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = functional.normalize(x, self.weight, self.bias, self._statistics(), self._state,
                                 training=self.training, eta=self.amat_eta)
        if self.training:
            self._warn_once_without_lr()  # after the input was checked: a bad input raises first
        return y

    def forward_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The training forward on an input that needs no gradient, in parts ``(x_hat,
        scale, shift)`` with ``forward(x) = scale[c] * x_hat + shift[c]``: for
        :class:`distnorm.PreNorm`, which folds ``scale`` and ``shift`` into the convolution
        after it (:func:`distnorm.functional.normalize_parts`).

        Example:
            >>> cbn, twin = CBN(3), CBN(3)
            >>> cbn.set_lr(0.2); twin.set_lr(0.2)
            >>> x = torch.randn(8, 3, 4, 4)
            >>> x_hat, scale, shift = cbn.forward_parts(x)
            >>> y = scale.view(1, 3, 1, 1) * x_hat + shift.view(1, 3, 1, 1)
            >>> torch.allclose(y, twin(x), atol=1e-6)
            True
        """
        if not self.training:
            raise RuntimeError(f"{self._distnorm_name}: forward_parts computes a training step; in eval() mode call "
                               "the layer itself")
        parts = functional.normalize_parts(x, self.weight, self.bias, self._statistics(), self._state,
                                           eta=self.amat_eta)
        self._warn_once_without_lr()
        return parts

    def _warn_once_without_lr(self) -> None:
        global _warned_no_lr
        # is_compiling() first: reading the Python float ``self.lr`` inside a compiled region
        # would guard on its value and recompile at every learning-rate change.
        if not torch.compiler.is_compiling() and self.amat and self.lr is None and not _warned_no_lr:
            _warned_no_lr = True
            warnings.warn(
                f"{self._distnorm_name}: AMAT has no learning rate yet, so it uses eta=0 (plain "
                "batch statistics). Call distnorm.set_lr(model, lr) with the optimizer's "
                "current learning rate before each training step.",
                stacklevel=3,
            )


class CBN(_CompleteNorm):
    r"""Complete batch normalization with the adaptive moving-average technique (AMAT).

    Placed *before* a convolution / linear layer, after the previous nonlinearity (paper
    002, Fig. 1c). Per channel, with statistics over the whole global batch of every rank:

    .. math::
        \mu_U = \eta\,\mu_A + (1-\eta)\,\mu_B,\qquad x_1 = x - \mu_U + \beta,\qquad
        \sigma_U^2 = \eta\,\sigma_A^2 + (1-\eta)\,\overline{x_1^2},\qquad
        y = \frac{\gamma}{\rho}\,\frac{x_1}{\sqrt{\sigma_U^2 + \epsilon}}

    with :math:`\eta = \mathrm{clip}(1 - \omega\,\mathrm{lr}, 0, 1)` taken from the learning
    rate given to :meth:`set_lr`, and :math:`(\mu_A, \sigma_A^2)` the AMAT buffers, which
    become :math:`(\mu_U, \sigma_U^2)` after each step. Gradients flow through the batch
    statistics, scaled by stop-gradient ratios clamped to ``[1/r_max, r_max]``.

    Args:
        num_features: number of channels ``C``.
        rho: normalization magnitude :math:`\rho` (output scale ``gamma / rho``).
        amat: use AMAT during training.
        omega: AMAT's learning-rate multiplier :math:`\omega`.
        eps: added to the variance.
        momentum: factor of the running statistics (``None``: cumulative average).
        r_max: clamp of the stop-gradient ratios.
        eval_stats: statistics at evaluation: ``"auto"`` (default with AMAT) uses the AMAT
            statistics once they average at least as much history as the running ones
            (the last training step had ``eta >= 1 - momentum``) and the running ones
            before; ``"amat"`` or ``"running"`` (default without AMAT) force one.
        sync: synchronize statistics across ranks (when distributed with > 1 rank).
        process_group: group to synchronize over (default: the default group).

    Parameters ``weight`` (gamma) and ``bias`` (beta); buffers ``amat_mean``,
    ``amat_var``, ``amat_initialized``, ``amat_eta`` (the eta in force), ``running_mean``,
    ``running_var``, ``num_batches_tracked``.

    Example:
        >>> import torch, distnorm
        >>> norm = distnorm.CBN(16, rho=2.0)
        >>> norm.set_lr(0.01)                       # eta = 1 - 10 * 0.01 = 0.9
        >>> y = norm(torch.randn(8, 16, 5, 5))
        >>> y.shape
        torch.Size([8, 16, 5, 5])
    """

    def __init__(  # SPEC §7's public signature, its defaults the spec's (CBNSpec)
        self,
        num_features: int,
        *,
        rho: float = CBNSpec.rho,
        amat: bool = CBNSpec.amat,
        omega: float = CBNSpec.omega,
        eps: float = CBNSpec.eps,
        momentum: float | None = CBNSpec.momentum,
        r_max: float = CBNSpec.r_max,
        eval_stats: str | None = CBNSpec.eval_stats,
        sync: bool = CBNSpec.sync,
        process_group: ProcessGroup | None = None,
    ) -> None:
        spec = CBNSpec(rho=rho, amat=amat, omega=omega, eps=eps, momentum=momentum, r_max=r_max,
                       eval_stats=eval_stats, sync=sync)
        super().__init__(num_features, spec, process_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, rho={self.rho}, amat={self.amat}, omega={self.omega}, "
            f"eps={self.eps}, momentum={self.momentum}, eval_stats={self.eval_stats!r}, sync={self.sync}"
        )


class POPNorm(_CompleteNorm):
    r"""POP-Norm (papers 000/001): complete normalization without moving averages.

    .. math::
        x_1 = x - \mu_B + \beta,\qquad
        y = \frac{\gamma}{\kappa}\,\frac{x_1}{\sqrt{\overline{x_1^2} + \epsilon}}

    It is :class:`CBN` with ``amat=False`` and ``rho=kappa``; evaluation uses the running
    statistics, ``(x - running_mean + beta) / sqrt(running_var + beta^2 + eps)``.

    Example:
        >>> import torch, distnorm
        >>> y = distnorm.POPNorm(16)(torch.randn(8, 16))
    """

    def __init__(
        self,
        num_features: int,
        *,
        kappa: float = POPNormSpec.kappa,
        eps: float = POPNormSpec.eps,
        momentum: float | None = POPNormSpec.momentum,
        sync: bool = POPNormSpec.sync,
        process_group: ProcessGroup | None = None,
    ) -> None:
        spec = POPNormSpec(kappa=kappa, eps=eps, momentum=momentum, sync=sync)
        super().__init__(num_features, spec.as_cbn(), process_group)

    @property
    def kappa(self) -> float:
        return self.rho

    def extra_repr(self) -> str:
        return f"{self.num_features}, kappa={self.rho}, eps={self.eps}, momentum={self.momentum}, sync={self.sync}"


class SyncBatchNorm(_DistNormLayer):
    r"""Batch normalization with statistics over every rank, on CPU (gloo) and CUDA (NCCL).

    The mathematics of ``torch.nn.BatchNorm{1,2,3}d`` applied to the concatenated global
    batch — outputs, gradients (with DDP averaging parameter gradients) and running
    statistics — for any input rank from 2-D to 5-D. Unlike ``torch.nn.SyncBatchNorm`` it
    accepts CPU tensors, uneven per-rank batch sizes (weighted exactly) and empty ranks.
    Parameter and buffer names match ``torch.nn.BatchNorm*``, so state dicts interchange.

    Example:
        >>> import torch, distnorm
        >>> bn = distnorm.SyncBatchNorm(16)
        >>> bn(torch.randn(8, 16, 5, 5)).shape
        torch.Size([8, 16, 5, 5])
    """

    def __init__(
        self,
        num_features: int,
        *,
        eps: float = EPS,
        momentum: float | None = MOMENTUM,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        _check_num_features("SyncBatchNorm", num_features)
        if eps is None:  # the spec's None means "the replaced BatchNorm's"; a layer needs a value
            raise ValueError("SyncBatchNorm: eps must be a positive finite number, got None")
        SyncBNSpec(eps=eps, momentum=momentum)  # validates
        if momentum is None and not track_running_stats:
            momentum = 0.0  # unused
        self.num_features = num_features
        self._init_state("bn", eps=float(eps), momentum=momentum, process_group=process_group)
        self.affine = bool(affine)
        self.track_running_stats = bool(track_running_stats)
        if self.affine:
            self.weight = nn.Parameter(torch.ones(num_features))
            self.bias = nn.Parameter(torch.zeros(num_features))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if self.track_running_stats:
            self.register_buffer("running_mean", torch.zeros(num_features))
            self.register_buffer("running_var", torch.ones(num_features))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            self.running_mean.zero_()
            self.running_var.fill_(1.0)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        if self.affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffers = (self.running_mean, self.running_var, self.num_batches_tracked)
        return functional.normalize(x, self.weight, self.bias, buffers, self._state, training=self.training)

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"track_running_stats={self.track_running_stats}"
        )


class GroupNorm(nn.GroupNorm):
    """``torch.nn.GroupNorm`` (same arguments, parameters and ``state_dict``) computed in its
    input's layout and dtype: :func:`distnorm.functional.group_norm`.

    On CUDA, PyTorch's GroupNorm copies a channels_last input to NCHW and, under autocast,
    runs in float32 (its output too); this one keeps its input's layout and dtype (under
    autocast, the dtype the convolution before it gave), with float32 arithmetic and float32
    parameters, as ``BatchNorm2d`` does under autocast. Not synchronized: its statistics are
    each sample's own. Differentiable once, and not under ``torch.func``'s transforms.

    Example:
        >>> layer = GroupNorm(4, 8)
        >>> layer(torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)).is_contiguous(
        ...     memory_format=torch.channels_last)
        True
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


def name_layers(model: nn.Module) -> int:
    """Record each distnorm layer's qualified name in ``model`` for error messages.

    Returns the number of distnorm layers found.
    """
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, _DistNormLayer):
            module._distnorm_name = f"{type(module).__name__} '{name or '<root>'}'"
            count += 1
    return count


def _checked_lr(lr: float | torch.Tensor, owner: str) -> float | torch.Tensor:
    """``lr`` as a float, or a tensor learning rate as it is (read on the host only in debug
    mode); a bad one raises naming ``owner``."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or not lr.is_floating_point():
            raise ValueError(f"{owner}: a tensor learning rate must hold one floating-point value, got "
                             f"shape {tuple(lr.shape)} and dtype {lr.dtype}")
        if not _debug.is_debug():
            return lr
        value = float(lr)  # debug mode: the check costs a host synchronisation
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{owner}: learning rate must be finite and >= 0, got the tensor value {value!r}")
        return lr
    value = float(lr)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{owner}: learning rate must be finite and >= 0, got {lr!r}")
    return value


def set_lrs(layers: list["_CompleteNorm"], lrs: list[float | torch.Tensor]) -> None:
    """``layer.set_lr(lr)`` for each pair; a tensor learning rate shared by several layers of
    one ``omega`` gives one ``eta`` computation on its device, copied into each layer."""
    etas: dict[tuple[int, float], torch.Tensor] = {}
    for layer, lr in zip(layers, lrs):
        if not isinstance(lr, torch.Tensor) or not layer.amat:
            layer.set_lr(lr)
            continue
        key = (id(lr), layer.omega)
        if key not in etas:
            etas[key] = functional.amat_eta(_checked_lr(lr, layer._distnorm_name), layer.omega)
        layer.lr = lr
        layer._set_eta(etas[key])


def set_lr(model: nn.Module, lr: float | torch.Tensor) -> int:
    """Give every AMAT layer in ``model`` the learning rate of the current step.

    Pass the learning rate the optimizer applies at this step (after warm-up and
    schedulers), e.g. ``optimizer.param_groups[0]["lr"]`` read before ``optimizer.step()``.

    Args:
        model: any module (a DDP / engine wrapper included).
        lr: learning rate, finite and >= 0: a float, or a one-element tensor (read on the
            device only; see :meth:`CBN.set_lr`).

    Returns:
        The number of AMAT layers updated.

    Example:
        >>> import torch, distnorm
        >>> model = torch.nn.Sequential(distnorm.CBN(4), torch.nn.Linear(4, 2))
        >>> distnorm.set_lr(model, 0.05)
        1
    """
    lr = _checked_lr(lr, "distnorm.set_lr")
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, _CompleteNorm):
            if not module._named:
                module._distnorm_name = f"{type(module).__name__} '{name or '<root>'}'"
            if module.amat:
                layers.append(module)
    set_lrs(layers, [lr] * len(layers))
    return len(layers)


# --------------------------------------------------------------- building from a spec
def _build_cbn(spec: CBNSpec, num_features: int, *, process_group: ProcessGroup | None = None,
               replacing: nn.Module | None = None) -> CBN:
    return CBN(num_features, process_group=process_group, **spec.kwargs())


def _build_popnorm(spec: POPNormSpec, num_features: int, *, process_group: ProcessGroup | None = None,
                   replacing: nn.Module | None = None) -> POPNorm:
    return POPNorm(num_features, process_group=process_group, **spec.kwargs())


def _build_sync_batch_norm(spec: SyncBNSpec, num_features: int, *, process_group: ProcessGroup | None = None,
                           replacing: nn.Module | None = None) -> SyncBatchNorm:
    """A SyncBatchNorm; in place of a BatchNorm it keeps that layer's ``affine`` /
    ``track_running_stats`` and shares its very Parameter and buffer objects (state_dict
    keys and values, and the optimizer's references, stay valid)."""
    layer = SyncBatchNorm(num_features, **spec.resolved(replacing), affine=getattr(replacing, "affine", True),
                          track_running_stats=getattr(replacing, "track_running_stats", True),
                          process_group=process_group)
    if replacing is None:
        return layer
    for key in ("weight", "bias"):
        layer._parameters[key] = replacing._parameters.get(key)
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        layer._buffers[key] = replacing._buffers.get(key)
    return layer.train(replacing.training)


def _build_group_norm(spec: GNSpec, num_features: int, *, process_group: ProcessGroup | None = None,
                      replacing: nn.Module | None = None) -> GroupNorm:
    """:class:`GroupNorm` (not synchronized: its statistics are per sample); in place of a
    BatchNorm it starts from that layer's affine parameters."""
    affine = getattr(replacing, "affine", True)
    layer = GroupNorm(spec.groups_for(num_features), num_features, eps=spec.resolved_eps(replacing), affine=affine)
    if replacing is not None and affine:
        with torch.no_grad():
            layer.weight.copy_(replacing.weight)
            layer.bias.copy_(replacing.bias)
    return layer


register_builder(CBNSpec, _build_cbn)
register_builder(POPNormSpec, _build_popnorm)
register_builder(SyncBNSpec, _build_sync_batch_norm)
register_builder(GNSpec, _build_group_norm)
