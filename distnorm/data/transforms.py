"""The recipes' image transforms, split where a loader can do better than one image at a time.

A preset (:func:`build_transform`) is torchvision's ``Compose([*geometry, ToTensor(),
Normalize(mean, std)])``, written as an :class:`ImageTransform` with two stages:

geometry (per image, PIL)
    crops, resizes and flips on the decoded image: ``uint8`` pixels out, the same random
    draws as torchvision's transforms.
normalization (per batch)
    ``x = (p / 255 - mean[c]) / std[c]`` in float32, written straight into the batch tensor
    (in shared memory inside a DataLoader worker, as ``default_collate`` does). The same
    three float32 operations as ``ToTensor`` + ``Normalize``, so the values are bit for bit
    those of the ``Compose``, without its four temporary tensors per image.

Calling an :class:`ImageTransform` on one PIL image gives exactly the ``Compose``'s tensor.

**Decoding down to the crop** (PIL, RandomResizedCrop first, always on): the crop is drawn on
the size in the JPEG's header (the transform's own draw), and the decoder stops after the
crop's last row (:func:`_jpeg_rows`): the same pixels as a full decode, for less decoding
work (the rows below the crop are never decoded; measured on docs/reference/benchmarks.md).
Files it does not apply to are decoded in full.

**Reduced-size decoding** (``reduced_decode=True``, opt-in): when the geometry shrinks the
image anyway, libjpeg decodes it at 1/2, 1/4 or 1/8 of its size (DCT scaling, PIL's
``Image.draft``), never below what the output needs: for ``RandomResizedCrop`` the crop is
drawn on the full-size image first (the same draw), then decoded at the largest reduction
that keeps the crop at least as large as the output; for ``Resize`` the short side stays at
least the target. Pixels differ slightly from a full decode (a DCT-domain downscale before
the bilinear one), which is why it is a setting. Images too small for a reduction decode as
before.

**Decoders** (``decoder``): ``"pil"`` (default; libjpeg-turbo through Pillow, geometry on PIL
images) or ``"torchvision"`` (``torchvision.io.decode_jpeg``, geometry on ``uint8`` tensors
with torchvision's tensor kernels). Both draw the same random numbers for the same seed, so
they crop and flip alike; pixels differ by at most a few levels (torch's antialiased resize
is not Pillow's to the bit). With ``decode_device`` (``"cuda"`` on a GPU host; ``"cpu"``
runs the same path on the CPU), the DataLoader workers only read the files and draw the
geometry (:class:`Deferred` rows); the main process decodes each batch in one batched
``decode_jpeg(..., device=decode_device)`` call and crops, flips and normalizes there
(:meth:`ImageTransform.finish`), so the batch arrives normalized on that device. The
deferred path supports the ImageNet presets' steps (RandomResizedCrop, RandomHorizontalFlip,
Resize, CenterCrop).
"""

from __future__ import annotations

import functools
import io
import math
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch
from PIL import Image

from distnorm.data.batches import shared_tensor
from distnorm.data.specs import DECODERS, TRANSFORM_PRESETS, ImageSpec, _check_decoding

__all__ = ["ImageSpec", "ImageTransform", "Deferred", "build_transform", "spec_transform", "TRANSFORM_PRESETS", "DECODERS",
           "IMAGENET_MEAN", "IMAGENET_STD"]

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
_DCT_SCALES = (8, 4, 2)  # the reductions libjpeg decodes at, largest first


class Deferred(NamedTuple):
    """A sample the main process decodes (``decode_device``): its encoded bytes and the drawn
    geometry, ``(kind, args)`` steps applied by :meth:`ImageTransform.finish`."""

    data: torch.Tensor  # uint8, the encoded file
    plan: tuple[tuple[str, tuple], ...]


class ImageTransform:
    """Per-image geometry on PIL images, then per-channel normalization (see the module docs).

    Args:
        geometry: torchvision transforms on PIL images (crop, resize, flip), applied in order.
        mean, std: per-channel normalization of ``p / 255``.
        reduced_decode: decode JPEGs at a reduced size where the geometry allows it (PIL).
        decoder: ``"pil"`` or ``"torchvision"``.
        decode_device: decode in the main process on this device, batched (torchvision).
    """

    def __init__(self, geometry: Sequence[Callable], mean: Sequence[float], std: Sequence[float], *,
                 reduced_decode: bool = ImageSpec.reduced_decode, decoder: str = ImageSpec.decoder,
                 decode_device: str | torch.device | None = ImageSpec.decode_device):
        from torchvision import transforms as T

        _check_decoding(geometry, reduced_decode, decoder, decode_device)
        self.geometry = list(geometry)
        self.mean, self.std = tuple(mean), tuple(std)
        self.reduced_decode, self.decoder = reduced_decode, decoder
        # RandomResizedCrop first (not a subclass: its draw is repeated here): decode to the crop.
        self._crop_first = bool(self.geometry) and type(self.geometry[0]) is T.RandomResizedCrop
        self.decode_device = None if decode_device is None else torch.device(decode_device)
        # torchvision's Normalize makes these from the tuples in the input's dtype: float32.
        self._mean = torch.tensor(self.mean, dtype=torch.float32).view(-1, 1, 1)
        self._std = torch.tensor(self.std, dtype=torch.float32).view(-1, 1, 1)
        self._stats: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __repr__(self) -> str:
        steps = ", ".join(repr(g) for g in self.geometry)
        extra = "".join(f", {k}={v!r}" for k, v in (("reduced_decode", self.reduced_decode), ("decoder", self.decoder),
                                                    ("decode_device", self.decode_device))
                        if v != getattr(ImageSpec, k))
        return f"ImageTransform([{steps}], mean={self.mean}, std={self.std}{extra})"

    # ------------------------------------------------------------------ one image
    def decode(self, data: bytes) -> Image.Image:
        """The RGB image of an encoded file, full size (reduced-size decoding needs the
        geometry's draws first: :meth:`pixels` does it)."""
        return self._loaded(Image.open(io.BytesIO(data)))

    def pixels(self, data: bytes | Image.Image) -> np.ndarray | torch.Tensor | Deferred:
        """The sample after the geometry, from encoded bytes or an image: ``uint8`` pixels
        ``(H, W, 3)`` (PIL), ``(3, H, W)`` (torchvision), or a :class:`Deferred` row."""
        if self.decoder == "torchvision" and not isinstance(data, Image.Image):
            return self._deferred(data) if self.decode_device is not None else self._tensor_pixels(data)
        if isinstance(data, Image.Image):
            image, steps = data.convert("RGB") if data.mode != "RGB" else data, self.geometry
        elif self.reduced_decode:
            image, steps = self._decode_reduced(data)
        elif self._crop_first:
            image, steps = self._decode_to_crop(data)
        else:
            image, steps = self.decode(data), self.geometry
        for step in steps:
            image = step(image)
        return np.array(image, dtype=np.uint8)  # a writable copy, as ToTensor takes

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """The ``(3, H, W)`` float32 tensor torchvision's ``Compose`` gives for ``image``."""
        pixels = self.pixels(image)
        out = torch.empty((3, *pixels.shape[:2]), dtype=torch.float32)
        self._normalize_into(out, pixels)
        return out

    # ------------------------------------------------------------------ batches
    def batch(self, rows: Sequence[np.ndarray | torch.Tensor | Deferred],
              out: torch.Tensor | None = None) -> torch.Tensor | list[Deferred | torch.Tensor]:
        """``(B, 3, H, W)`` float32 from :meth:`pixels` rows (float ``(3, H, W)`` tensors are
        placeholders, taken as they are), written into ``out`` if given (of
        :meth:`batch_shape`), else into a new tensor, in shared memory inside a DataLoader
        worker. With ``decode_device``, the rows themselves, for :meth:`finish`."""
        if self.decode_device is not None:
            return list(rows)
        shape = self.batch_shape(rows)
        if out is None:
            out = batch_tensor(shape, torch.float32)
        elif tuple(out.shape) != shape or out.dtype != torch.float32:
            raise ValueError(f"batch() needs a float32 output of shape {shape}, got {out.dtype} {tuple(out.shape)}")
        for target, row in zip(out, rows):
            if isinstance(row, torch.Tensor) and row.is_floating_point():
                target.copy_(row)
            else:
                self._normalize_into(target, row)
        return out

    @staticmethod
    def batch_shape(rows: Sequence[np.ndarray | torch.Tensor]) -> tuple[int, int, int, int]:
        """The ``(B, 3, H, W)`` shape :meth:`batch` gives for these rows."""
        first = rows[0]
        shape = tuple(first.shape) if isinstance(first, torch.Tensor) else (first.shape[2], *first.shape[:2])
        return (len(rows), *shape)

    def _normalize_into(self, out: torch.Tensor, pixels: np.ndarray | torch.Tensor) -> None:
        # ToTensor: float32(p) / 255; Normalize: (x - mean) / std — the same three roundings.
        # One image at a time: the four passes run on a slice that stays in the cache.
        out.copy_(pixels if isinstance(pixels, torch.Tensor) else torch.from_numpy(pixels).permute(2, 0, 1))
        out.div_(255).sub_(self._mean).div_(self._std)  # on the CPU (workers; batch())

    # ------------------------------------------------------------ torchvision decoder
    @staticmethod
    def _encoded(data: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def _tensor_pixels(self, data: bytes) -> torch.Tensor:
        from torchvision.io import ImageReadMode, decode_jpeg

        image = decode_jpeg(self._encoded(data), mode=ImageReadMode.RGB)
        for step in self.geometry:
            image = step(image)
        return image

    def _deferred(self, data: bytes) -> Deferred:
        """Draw the geometry on the header's size (the same draws as the in-worker paths;
        RandomResizedCrop, the one step that needs the size, comes first)."""
        from torchvision import transforms as T

        with Image.open(io.BytesIO(data)) as header:  # reads the size, decodes nothing
            height, width = header.height, header.width
        plan = []
        for step in self.geometry:
            if isinstance(step, T.RandomResizedCrop):
                top, left, height, width = T.RandomResizedCrop.get_params(
                    torch.empty(0, height, width), step.scale, step.ratio)
                size = list(_pair(step.size))
                plan.append(("resized_crop", (top, left, height, width, size, step.interpolation, step.antialias)))
                height, width = size
            elif isinstance(step, T.RandomHorizontalFlip):
                if torch.rand(1) < step.p:
                    plan.append(("hflip", ()))
            elif isinstance(step, T.Resize):
                plan.append(("resize", (step.size, step.interpolation, step.max_size, step.antialias)))
            else:  # CenterCrop (the constructor admits nothing else)
                plan.append(("center_crop", (step.size,)))
        return Deferred(self._encoded(data), tuple(plan))

    def finish(self, rows: Sequence[Deferred | torch.Tensor]) -> torch.Tensor:
        """Decode and transform a batch of :class:`Deferred` rows on ``decode_device``: one
        batched ``decode_jpeg``, the geometry per image, then one stack and one normalization
        for the batch (the same three roundings as :meth:`batch`). Float tensors
        (evaluation's placeholders) are taken as they are."""
        from torchvision.io import ImageReadMode, decode_jpeg
        from torchvision.transforms import functional as F

        device = self.decode_device
        encoded = [r.data for r in rows if isinstance(r, Deferred)]
        decoded = iter(decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device) if encoded else [])
        images = []
        for row in rows:
            if isinstance(row, Deferred):
                image = next(decoded)
                for kind, args in row.plan:
                    image = getattr(F, kind)(image, *args)
                images.append(image)
            else:
                images.append(row.to(device))
        mean, std = self._stats_on(device)
        if all(not image.is_floating_point() for image in images):  # training: no placeholders
            return torch.stack(images).to(torch.float32).div_(255).sub_(mean).div_(std)
        out = torch.empty((len(images), *images[0].shape), dtype=torch.float32, device=device)
        for target, image in zip(out, images):  # evaluation with padding: rare, per image
            if image.is_floating_point():
                target.copy_(image)
            else:
                target.copy_(image).div_(255).sub_(mean).div_(std)
        return out

    def _stats_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``mean`` / ``std`` on ``device``, copied there once (a copy per batch would make
        the host wait for the device at every batch)."""
        if device not in self._stats:
            self._stats[device] = (self._mean.to(device), self._std.to(device))
        return self._stats[device]

    # ------------------------------------------------------------ decoding to the crop
    def _decode_to_crop(self, data: bytes) -> tuple[Image.Image, list[Callable]]:
        """RandomResizedCrop first: draw the crop on the header's size (the draw the transform
        makes), decode only the JPEG's rows down to the crop's bottom edge
        (:func:`_jpeg_rows`), then crop and resize with that draw: the pixels of a full
        decode. Returns the image and the geometry still to apply."""
        from torchvision import transforms as T
        from torchvision.transforms import functional as F

        first = self.geometry[0]
        image = Image.open(io.BytesIO(data))  # reads the header, decodes nothing
        top, left, height, width = T.RandomResizedCrop.get_params(image, first.scale, first.ratio)
        image = self._loaded_to_row(image, data, top + height)
        crop = functools.partial(F.resized_crop, top=top, left=left, height=height, width=width, size=first.size,
                                 interpolation=first.interpolation, antialias=first.antialias)
        return image, [crop, *self.geometry[1:]]

    # ------------------------------------------------------------ reduced decoding
    def _decode_reduced(self, data: bytes) -> tuple[Image.Image, list[Callable]]:
        """Open lazily, pick the reduction from the first geometry step, decode; returns the
        decoded image and the geometry still to apply (a drawn crop replaces RandomResizedCrop)."""
        from torchvision import transforms as T
        from torchvision.transforms import functional as F

        image = Image.open(io.BytesIO(data))
        first, rest = (self.geometry[0], self.geometry[1:]) if self.geometry else (None, [])
        if image.format != "JPEG" or first is None:
            return self._loaded(image), self.geometry
        width, height = image.size
        if isinstance(first, T.RandomResizedCrop):
            # The crop is drawn on the full-size image (the same draw as without reduction).
            top, left, h, w = T.RandomResizedCrop.get_params(image, first.scale, first.ratio)
            out_h, out_w = _pair(first.size)
            factor = _reduction(min(h / out_h, w / out_w))
            if factor > 1:
                image.draft("RGB", (math.ceil(width / factor), math.ceil(height / factor)))
                image = self._loaded(image)
            else:  # no reduction: the decode stops at the crop's bottom edge, as without reduced_decode
                image = self._loaded_to_row(image, data, top + h)
            if factor == 1:  # exactly what RandomResizedCrop does with this draw
                crop = functools.partial(F.resized_crop, top=top, left=left, height=h, width=w, size=[out_h, out_w],
                                         interpolation=first.interpolation, antialias=first.antialias)
            else:  # the same box on the reduced image (fractional coordinates)
                sx, sy = image.size[0] / width, image.size[1] / height
                crop = functools.partial(Image.Image.resize, size=(out_w, out_h),
                                         resample=_pil_filter(first.interpolation),
                                         box=(left * sx, top * sy, (left + w) * sx, (top + h) * sy))
            return image, [crop, *rest]
        if isinstance(first, T.Resize) and isinstance(first.size, int):
            factor = _reduction(min(width, height) / first.size)
            if factor > 1:
                image.draft("RGB", (math.ceil(width / factor), math.ceil(height / factor)))
        return self._loaded(image), self.geometry

    @classmethod
    def _loaded_to_row(cls, image: Image.Image, data: bytes, bottom: int) -> Image.Image:
        """``image``'s rows above ``bottom`` decoded (:func:`_jpeg_rows`), else the whole image."""
        rows = _jpeg_rows(image, data, bottom)
        return cls._loaded(image) if rows is None else rows

    @staticmethod
    def _loaded(image: Image.Image) -> Image.Image:
        image.load()
        return image if image.mode == "RGB" else image.convert("RGB")  # convert() of RGB is a copy


def _jpeg_rows(image: Image.Image, data: bytes, rows: int) -> Image.Image | None:
    """The top ``rows`` rows of a baseline RGB JPEG (``image``: ``data`` opened,
    not loaded), or ``None`` where this does not apply (the caller decodes in full).

    Pillow's own JPEG decoder (libjpeg-turbo), stopped after ``rows`` scanlines: libjpeg
    emits scanlines top to bottom and a scanline does not depend on those after it, so these
    are the pixels of a full decode, bit for bit; the entropy decoding, IDCT and colour
    conversion of the rows below are skipped (RandomResizedCrop's crop ends on average at
    84 % of the height on ImageNet-shaped images). Not for progressive files (libjpeg reads
    all of their scans before the first row anyway) and not for files that do not end with
    the EOI marker: a truncated file must still fail as a full decode fails. The header is
    fed first, so a broken header is left to the full decode to report too; damage inside
    the entropy-coded data below ``rows`` goes unnoticed (what is used is decoded). One case
    cannot be told apart: libjpeg reports its stop after ``rows`` scanlines and a fatal error
    part-way through them with the same code, so a file whose scan data above ``rows`` makes
    libjpeg give up (rare: most corruption is a warning, decoded as it is in a full decode)
    yields rows it did not finish, where a full decode would raise.
    """
    if (image.format != "JPEG" or image.mode != "RGB" or not 0 < rows < image.height or "progressive" in image.info
            or image.decoderconfig or len(image.tile) != 1 or image.tile[0][0] != "jpeg" or image.tile[0][2] != 0
            or not data.endswith(b"\xff\xd9")):
        return None
    try:  # Pillow's decoder interface (what ImageFile.load uses), not its public API:
        # should a Pillow release change it, every image takes the full decode instead.
        header = image.fp.tell()  # Image.open stopped reading after the first scan header
        out = Image.core.new("RGB", (image.width, rows))  # (Pillow's decoder takes whole rows only)
        decoder = Image._getdecoder("RGB", "jpeg", image.tile[0][3], ())
    except (AttributeError, TypeError, OSError, ValueError):
        return None
    view = memoryview(data)
    try:
        decoder.setimage(out, (0, 0, image.width, rows))
        # The headers alone first: libjpeg parses them and sets up the decompression, then
        # waits for data. Anything less (an error; a header it did not take whole) is left
        # to the full decode: the scan below then runs on a header that was accepted.
        consumed, _ = decoder.decode(view[:header])
        if consumed != header:
            return None
        # libjpeg's finish, called after `rows` scanlines, objects to the rows left unread
        # (IMAGING_CODEC_BROKEN, -2) once those rows are written; consumed >= 0: out of data.
        status, err = decoder.decode(view[consumed:])
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    finally:
        decoder.cleanup()
    return image._new(out) if status < 0 and err in (0, -2) else None


def _pair(size: int | Sequence[int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (size[0], size[-1])


def _reduction(room: float) -> int:
    """The largest libjpeg reduction ``k`` with ``room / k >= 1`` (1 if none)."""
    return next((k for k in _DCT_SCALES if room >= k), 1)


def _pil_filter(interpolation) -> int:
    from torchvision.transforms.functional import pil_modes_mapping

    return pil_modes_mapping[interpolation]


def batch_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor, in shared memory when built inside a DataLoader worker.

    A batch a worker returns travels to the main process through shared memory; built there
    from the start, it is not copied into it when sent (what ``default_collate`` does too).
    """
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    return shared_tensor(shape, dtype)


def build_transform(preset: str, *, train: bool, image_size: int, **decoding: Any) -> ImageTransform:
    """The image transform of a preset: ``spec_transform(ImageSpec(preset, image_size, **decoding), train)``.

    ``imagenet``: train = RandomResizedCrop + horizontal flip (pytorch/examples imagenet),
    eval = resize to 256/224 of the size + center crop. ``cifar``: train = 4-pixel padded
    random crop + flip. ``digits``: 2-pixel padded random crop, no flip (digits are not
    mirror-symmetric). All end with ToTensor and per-channel normalization; the result is an
    :class:`ImageTransform`. ``decoding``: ``reduced_decode``, ``decoder``, ``decode_device``
    (:class:`ImageSpec`; see the module docs).
    """
    if not isinstance(preset, str):
        raise ValueError(f"build_transform needs a preset name, one of {TRANSFORM_PRESETS}; got {preset!r}")
    return spec_transform(ImageSpec(transform=preset, image_size=image_size, **decoding), train)


def spec_transform(spec: ImageSpec, train: bool) -> Callable:
    """The training (``train=True``) or evaluation transform ``spec`` describes: an
    :class:`ImageTransform` for a preset, else the callable given."""
    if callable(spec.transform):
        return spec.transform
    geometry, mean, std = _preset(spec.transform, train, spec.image_size)
    return ImageTransform(geometry, mean, std, reduced_decode=spec.reduced_decode, decoder=spec.decoder,
                          decode_device=spec.decode_device)


def _preset(preset: str, train: bool, image_size: int) -> tuple[list[Callable], tuple[float, ...], tuple[float, ...]]:
    """A preset's geometry (torchvision transforms on PIL images), mean and std."""
    from torchvision import transforms as T

    if preset == "imagenet":
        geometry = [T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()] if train else [
            T.Resize(int(round(image_size * 256 / 224))), T.CenterCrop(image_size)]
        return geometry, IMAGENET_MEAN, IMAGENET_STD
    if preset == "cifar":
        geometry = [T.RandomCrop(image_size, padding=4), T.RandomHorizontalFlip()] if train else [
            T.Resize(image_size), T.CenterCrop(image_size)]
        return geometry, CIFAR_MEAN, CIFAR_STD
    if preset == "digits":
        geometry = [T.RandomCrop(image_size, padding=2)] if train else [T.Resize(image_size), T.CenterCrop(image_size)]
        return geometry, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    raise ValueError(f"unknown transform preset {preset!r}; choose one of {TRANSFORM_PRESETS}")
