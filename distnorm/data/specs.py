"""The data pipeline's settings, checked without importing torch.

:class:`ImageSpec` (how a sample becomes a tensor) and :class:`LoaderSpec` (the loaders'
keywords, which the recipe's ``data`` section extends) own their defaults and validate their
values here, so ``distnorm-train --check`` and a refused configuration never load torch or
torchvision (a second or more of CPU per process, paid by every launcher's check). The
transforms (:mod:`distnorm.data.transforms`) and loaders (:mod:`distnorm.data.loaders`) that
act on them import them from here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

from distnorm.settings import Section, boolean, from_mapping, non_negative_int, one_of, optional, param, positive_int

if TYPE_CHECKING:
    import torch

__all__ = ["ImageSpec", "LoaderSpec", "DataError", "SKIP_HINT", "TRANSFORM_PRESETS", "DECODERS", "DEFERRED_PRESETS"]

TRANSFORM_PRESETS = ("imagenet", "cifar", "digits")
DECODERS = ("pil", "torchvision")
_DEFERRED_DEVICES = ("cpu", "cuda")
#: The presets whose geometry ``decode_device`` can apply on the device (tests/test_data.py
#: checks this against the geometry :mod:`distnorm.data.transforms` builds for each preset).
DEFERRED_PRESETS = ("imagenet",)


def _preset_or_callable(value: Any) -> str | None:
    if callable(value) or value in TRANSFORM_PRESETS:
        return None
    return f"must be a preset, one of {TRANSFORM_PRESETS}, or a callable on PIL images"


def _device(value: Any) -> str | None:
    torch = sys.modules.get("torch")  # a torch.device exists only where torch is imported
    if (torch is not None and isinstance(value, torch.device)) or (isinstance(value, str) and value.split(":")[0] in _DEFERRED_DEVICES):
        return None
    return "must be 'cpu', 'cuda', 'cuda:N' or a torch.device"


@dataclass(frozen=True)
class ImageSpec(Section):
    """How a sample becomes a tensor: a preset's geometry at ``image_size``, decoded by
    ``decoder`` (see :mod:`distnorm.data.transforms`, whose
    :func:`~distnorm.data.transforms.spec_transform` builds it). The
    one owner of these defaults: :func:`~distnorm.data.transforms.build_transform`,
    :class:`~distnorm.data.transforms.ImageTransform`, the loaders (:class:`LoaderSpec` extends
    this) and the recipe's ``data`` section take them from here.

    Example:
        >>> from distnorm.data.transforms import spec_transform
        >>> transform = spec_transform(ImageSpec(transform="digits", image_size=32), train=False)
        >>> transform.decoder, transform.mean
        ('pil', (0.5, 0.5, 0.5))
        >>> ImageSpec(decoder="torchvision", reduced_decode=True)
        Traceback (most recent call last):
        ...
        ValueError: data: reduced_decode is PIL's DCT scaling: it needs decoder='pil'
    """

    label: ClassVar[str] = "data"
    qualified: ClassVar[bool] = True

    transform: str | Callable = param("imagenet", f"augmentation preset ({', '.join(TRANSFORM_PRESETS)}); in Python "
                                                  "also any callable on PIL images", _preset_or_callable)
    image_size: int = param(224, "side of the preset's output (the training crop; evaluation resizes to 256/224 "
                                 "of it and crops the centre)", positive_int)
    reduced_decode: bool = param(False, "decode JPEGs at 1/2, 1/4 or 1/8 size where the crop or resize shrinks them "
                                        "at least that much (libjpeg DCT scaling; pixels differ slightly)", boolean)
    decoder: str = param("pil", "JPEG decoder: 'pil' (Pillow, PIL geometry) or 'torchvision' (torchvision.io, "
                                "tensor geometry)", one_of(*DECODERS))
    decode_device: str | torch.device | None = param(
        None, "decode each batch in the main process on this device ('cuda' on GPU hosts; needs decoder: "
              "torchvision); unset: in the workers", optional(_device))

    def _check_together(self) -> None:
        if callable(self.transform):
            return
        try:  # the decoder's rules, before any worker starts
            _check_decoding((), self.reduced_decode, self.decoder, self.decode_device)
        except ValueError as err:
            raise ValueError(f"{self.label}: {err}") from None
        if self.decode_device is not None and self.transform not in DEFERRED_PRESETS:
            raise ValueError(f"{self.label}: decode_device supports the presets {DEFERRED_PRESETS}, whose steps "
                             f"(RandomResizedCrop first, RandomHorizontalFlip, Resize, CenterCrop) it decodes on the "
                             f"device, not {self.transform!r}; leave decode_device unset to decode in the workers")


def _check_decoding(geometry: Sequence[Callable], reduced_decode: bool, decoder: str,
                    decode_device: str | torch.device | None) -> None:
    """What each decoder supports; an error names the setting to change."""
    if decoder not in DECODERS:
        raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
    if decode_device is not None and decoder != "torchvision":
        raise ValueError("decode_device needs decoder='torchvision' (PIL decodes on the CPU, in the workers)")
    if reduced_decode and decoder != "pil":
        raise ValueError("reduced_decode is PIL's DCT scaling: it needs decoder='pil'")
    if decode_device is not None and geometry:
        from torchvision import transforms as T

        supported = (T.RandomResizedCrop, T.RandomHorizontalFlip, T.Resize, T.CenterCrop)
        unsupported = [type(g).__name__ for g in geometry if not isinstance(g, supported)]
        if unsupported or any(isinstance(g, T.RandomResizedCrop) for g in geometry[1:]):
            raise ValueError(f"decode_device supports the ImageNet presets' steps (RandomResizedCrop first, "
                             f"RandomHorizontalFlip, Resize, CenterCrop), not {unsupported or list(geometry)}; "
                             "leave decode_device unset to decode in the workers")


class DataError(RuntimeError):
    """A shard or sample could not be read; the message names the shard and key."""


@dataclass(frozen=True)
class LoaderSpec(ImageSpec):
    """What a loader does besides its shards and batches: the image pipeline (the fields of
    :class:`ImageSpec`), the DataLoader workers and bad data. The
    one owner of these defaults: :class:`TrainLoader` and :class:`EvalLoader` take them as
    keywords, the recipe's ``data`` section extends this class."""

    label: ClassVar[str] = "data"

    num_workers: int = param(8, "DataLoader workers per rank (0: load in the main process)", non_negative_int)
    prefetch_factor: int | None = param(2, "batches each worker loads ahead (None: the DataLoader's default)",
                                        optional(positive_int))
    pin_memory: bool | None = param(None, "copy batches to page-locked memory (default: when CUDA is available)",
                                    optional(boolean))
    shuffle_buffer: int = param(5000, "training: samples in each worker's shuffle buffer", positive_int)
    on_error: str = param("raise", "an unreadable shard or undecodable sample: 'raise', or 'skip' it (counted and "
                                   "reported)", one_of("raise", "skip"))

    @classmethod
    def of(cls, where: str, options: dict[str, Any]) -> "LoaderSpec":
        """The spec of a loader's keywords; an unknown one is refused by name."""
        return from_mapping(cls, options, where)

    def loader_options(self) -> dict[str, Any]:
        """This spec's fields as loader keywords (a subclass's own fields left out)."""
        return {f.name: getattr(self, f.name) for f in fields(LoaderSpec)}


#: How an unreadable shard's or sample's error says to go on. ``distnorm-train`` puts its own
#: setting in its place (``data.on_error=skip``): its users never call the loader.
SKIP_HINT = "pass on_error='skip' to skip bad data"
