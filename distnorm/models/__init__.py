"""The papers' model zoo, built through :func:`distnorm.convert` (one code path for all).

Example:
    >>> from distnorm import models
    >>> net = models.create("resnet20", num_classes=10, norm="cbn", activation="tanh")
    >>> sorted(models.available())
    ['efficientnet_b0', 'resnet18', 'resnet20', 'resnet50', 'vgg16']

Models are built with ordinary BatchNorm and their native activations, then converted:
``norm`` is any of :data:`distnorm.specs.NORM_LABELS` (``"keep"`` keeps PyTorch's local,
unsynchronized BatchNorm: the baseline). No pretrained weights are downloaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from distnorm.specs import NORM_LABELS

if TYPE_CHECKING:
    from torch import nn

    from distnorm.models.cifar import VGG16, ResNet20

__all__ = ["available", "create", "register", "ResNet20", "VGG16"]

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}


def register(name: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Decorator adding a builder ``fn(num_classes, **kw) -> nn.Module`` to the zoo."""

    def add(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return add


def available() -> list[str]:
    """Names accepted by :func:`create` (torch is imported only when one is built, so the
    recipe's configuration checks these names without it)."""
    return sorted(_REGISTRY)


def __getattr__(name: str) -> Any:
    if name in ("ResNet20", "VGG16"):  # the papers' CIFAR networks, at first use
        from distnorm.models import cifar

        return getattr(cifar, name)
    raise AttributeError(f"module 'distnorm.models' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _torchvision():
    try:
        import torchvision
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "this model comes from torchvision; install it with `pip install distnorm[vision]`"
        ) from err
    return torchvision


@register("resnet18")
def _resnet18(num_classes: int, **kw: Any) -> nn.Module:
    return _torchvision().models.resnet18(weights=None, num_classes=num_classes, **kw)


@register("resnet50")
def _resnet50(num_classes: int, **kw: Any) -> nn.Module:
    return _torchvision().models.resnet50(weights=None, num_classes=num_classes, **kw)


@register("efficientnet_b0")
def _efficientnet_b0(num_classes: int, **kw: Any) -> nn.Module:
    return _torchvision().models.efficientnet_b0(weights=None, num_classes=num_classes, **kw)


@register("resnet20")
def _resnet20(num_classes: int, **kw: Any) -> nn.Module:
    from distnorm.models.cifar import ResNet20

    return ResNet20(num_classes=num_classes, **kw)


@register("vgg16")
def _vgg16(num_classes: int, **kw: Any) -> nn.Module:
    from distnorm.models.cifar import VGG16

    return VGG16(num_classes=num_classes, **kw)


def create(
    name: str,
    *,
    num_classes: int,
    norm: Any = "bn",
    activation: str | None = "relu",
    process_group: Any = None,
    norm_kwargs: dict[str, Any] | None = None,
    **kw: Any,
) -> nn.Module:
    """Build a zoo model and convert its normalization and activations.

    Args:
        name: one of :func:`available`.
        num_classes: classifier outputs.
        norm: ``"cbn"``, ``"popnorm"``, ``"bn"`` (synchronized), ``"gn"``, ``"none"``, or
            ``"keep"`` (PyTorch's BatchNorm, unsynchronized: the baseline); or a spec
            from :mod:`distnorm.specs` (``CBNSpec(rho=2.0)``).
        activation: ``"relu"``, ``"sigmoid"``, ``"tanh"``, ``"selu"``, ``"swish"``, or
            ``None`` for the architecture's own (EfficientNet: swish).
        process_group: group of the synchronized layers.
        norm_kwargs: fields of the norm's spec when ``norm`` is a name (``rho``, ``kappa``,
            ``omega``, ``num_groups``, ...).
        **kw: passed to the architecture's constructor.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; available: {available()}")
    if isinstance(norm, str) and norm not in NORM_LABELS:
        raise ValueError(f"unknown norm {norm!r}; choose one of {NORM_LABELS}")
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    from distnorm.convert import convert

    model = _REGISTRY[name](num_classes, **kw)
    return convert(
        model,
        norm=norm,
        activation=activation,
        process_group=process_group,
        **(norm_kwargs or {}),
    )
