"""Where shard samples come from: an ImageFolder tree, any torchvision-style dataset, the
embedded demo digits, or a synthetic ImageNet-shaped generator.

A source is an indexable collection of samples; each gives a WebDataset key (no dots), the
JPEG payload and an integer label. Sources are picklable, so the shard writer can hand them
to worker processes, and deterministic, so a resumed or parallel run writes the same bytes.
"""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image

__all__ = [
    "ShardSource",
    "ImageFolderSource",
    "DatasetSource",
    "DigitsSource",
    "SyntheticSource",
    "IMAGENET_SHAPES",
    "encode_jpeg",
    "is_jpeg",
]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
JPEG_QUALITY = 95


class ShardSource(Protocol):
    """What the shard writer needs from a source."""

    classes: list[str]

    def __len__(self) -> int: ...
    def key(self, index: int) -> str: ...
    def label(self, index: int) -> int: ...
    def jpeg(self, index: int) -> bytes: ...
    def size_hint(self, index: int) -> int: ...


def is_jpeg(data: bytes) -> bool:
    """JPEG files start with the SOI marker FF D8 FF, whatever their extension says."""
    return data[:3] == b"\xff\xd8\xff"


def encode_jpeg(image: Any, quality: int = JPEG_QUALITY) -> bytes:
    """Encode a PIL image, HWC uint8 array or CHW tensor as RGB JPEG bytes."""
    if not isinstance(image, Image.Image):
        array = image.numpy() if hasattr(image, "numpy") else np.asarray(image)
        if array.ndim == 3 and array.shape[0] in (1, 3) and array.shape[-1] not in (1, 3):
            array = array.transpose(1, 2, 0)  # CHW tensor -> HWC
        if array.dtype != np.uint8:
            array = np.clip(array * (255.0 if array.max() <= 1.0 else 1.0), 0, 255).astype(np.uint8)
        image = Image.fromarray(array.squeeze(-1) if array.ndim == 3 and array.shape[-1] == 1 else array)
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _clean_key(text: str) -> str:
    # WebDataset splits keys from extensions at the first dot: keys must not contain any.
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)


class _EncodedSizeMixin:
    def size_hint(self, index: int) -> int:
        return len(self.jpeg(index))  # type: ignore[attr-defined]


@dataclass
class ImageFolderSource:
    """``root/<class>/<image>`` trees such as ImageNet's ``train/<wnid>/*.JPEG``.

    Classes are the sorted sub-directory names (as in ``torchvision.datasets.ImageFolder``).
    JPEG files are stored byte for byte; other formats are re-encoded to JPEG.
    """

    root: str
    classes: list[str] = field(init=False)
    files: list[tuple[str, int]] = field(init=False)

    def __post_init__(self) -> None:
        root = Path(self.root)
        if not root.is_dir():
            raise ValueError(f"ImageFolder source {self.root!r} is not a directory")
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        if not self.classes:
            raise ValueError(f"ImageFolder source {self.root!r} has no class sub-directories")
        self.files = []
        for label, name in enumerate(self.classes):
            for dirpath, _, filenames in sorted(os.walk(root / name)):
                for fname in sorted(filenames):
                    if fname.lower().endswith(IMAGE_EXTENSIONS):
                        self.files.append((os.path.join(dirpath, fname), label))
        if not self.files:
            raise ValueError(f"ImageFolder source {self.root!r} contains no images ({', '.join(IMAGE_EXTENSIONS)})")

    def __len__(self) -> int:
        return len(self.files)

    def key(self, index: int) -> str:
        stem = Path(self.files[index][0]).stem
        return f"{index:08d}_{_clean_key(stem)}"

    def label(self, index: int) -> int:
        return self.files[index][1]

    def jpeg(self, index: int) -> bytes:
        data = Path(self.files[index][0]).read_bytes()
        if is_jpeg(data):
            return data  # never re-encode a JPEG
        with Image.open(io.BytesIO(data)) as image:
            return encode_jpeg(image)

    def size_hint(self, index: int) -> int:
        return os.path.getsize(self.files[index][0])


@dataclass
class DatasetSource(_EncodedSizeMixin):
    """Any torchvision-style dataset: ``dataset[i] -> (image, label)`` with a PIL image,
    HWC uint8 array or CHW tensor. Class names come from ``dataset.classes`` if present."""

    dataset: Any
    name: str = "sample"
    classes: list[str] = field(init=False)

    def __post_init__(self) -> None:
        classes = getattr(self.dataset, "classes", None)
        if classes is None:
            labels = {int(self.dataset[i][1]) for i in range(len(self.dataset))}
            classes = [str(i) for i in range(max(labels) + 1)]
        self.classes = [str(c) for c in classes]

    def __len__(self) -> int:
        return len(self.dataset)

    def key(self, index: int) -> str:
        return f"{_clean_key(self.name)}_{index:08d}"

    def label(self, index: int) -> int:
        return int(self.dataset[index][1])

    def jpeg(self, index: int) -> bytes:
        return encode_jpeg(self.dataset[index][0])


@dataclass
class DigitsSource(_EncodedSizeMixin):
    """The demo dataset that installs without a download: scikit-learn's bundled handwritten
    digits (1,797 8×8 images, 10 classes), upscaled to 32×32 RGB JPEGs.

    The split is fixed: every fifth sample (index % 5 == 0) is validation (360 images), the
    rest training (1,437 images).
    """

    split: str = "train"
    size: int = 32
    classes: list[str] = field(init=False)
    _indices: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.split not in ("train", "val"):
            raise ValueError(f"digits split must be 'train' or 'val', got {self.split!r}")
        digits = _load_digits()
        positions = np.arange(len(digits.target))
        self._indices = positions[(positions % 5 == 0) == (self.split == "val")]
        self.classes = [str(c) for c in range(10)]

    def __len__(self) -> int:
        return len(self._indices)

    def key(self, index: int) -> str:
        return f"digits_{self.split}_{int(self._indices[index]):04d}"

    def label(self, index: int) -> int:
        return int(_load_digits().target[self._indices[index]])

    def jpeg(self, index: int) -> bytes:
        pixels = _load_digits().images[self._indices[index]]  # 8x8, values 0..16
        image = Image.fromarray((pixels * (255.0 / 16.0)).astype(np.uint8), mode="L")
        return encode_jpeg(image.resize((self.size, self.size), Image.BILINEAR))


_DIGITS = None


def _load_digits():
    global _DIGITS
    if _DIGITS is None:
        try:
            from sklearn.datasets import load_digits
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError("the digits demo needs scikit-learn: `pip install distnorm[data]`") from err
        _DIGITS = load_digits()
    return _DIGITS


#: A cycle of the frame shapes common in ImageNet-1k's training set (height, width): mostly
#: 500 px on the long side, landscape 4:3 and 3:2 most often, some portrait and square, some
#: smaller; their mean is 380 x 443 (ImageNet's is about 400 x 350 with a long tail of larger
#: images, which reduced-size decoding would help more).
IMAGENET_SHAPES: tuple[tuple[int, int], ...] = (
    (375, 500), (333, 500), (500, 375), (500, 333), (375, 500),
    (281, 500), (500, 500), (300, 400), (240, 320), (400, 500),
)


@dataclass
class SyntheticSource(_EncodedSizeMixin):
    """ImageNet-shaped synthetic images with class-dependent patterns, for pipeline tests
    and throughput runs: class ``c`` is an oriented grating whose angle, frequency and tint
    depend on ``c``, plus per-image noise. Deterministic in ``(seed, index)``.

    Images are ``image_size`` squares, or, given ``shapes``, image ``i`` is
    ``shapes[i % len(shapes)]`` (height, width) — e.g. :data:`IMAGENET_SHAPES`; JPEGs of
    ``quality`` (ImageNet's own are mostly 75-95).
    """

    num_samples: int
    num_classes: int = 1000
    image_size: int = 224
    seed: int = 0
    shapes: tuple[tuple[int, int], ...] | None = None
    quality: int = JPEG_QUALITY
    classes: list[str] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_samples < 1 or self.num_classes < 1 or self.image_size < 8:
            raise ValueError("synthetic source needs num_samples >= 1, num_classes >= 1, image_size >= 8")
        self.classes = [f"class_{c:04d}" for c in range(self.num_classes)]

    def __len__(self) -> int:
        return self.num_samples

    def key(self, index: int) -> str:
        return f"synthetic_{self.seed}_{index:08d}"

    def label(self, index: int) -> int:
        return index % self.num_classes

    def jpeg(self, index: int) -> bytes:
        c = self.label(index)
        rng = np.random.default_rng([self.seed, index])
        h, w = self.shapes[index % len(self.shapes)] if self.shapes else (self.image_size, self.image_size)
        n = max(h, w)
        yy, xx = np.mgrid[0:h, 0:w] / n
        angle = np.pi * (c * 0.61803398875 % 1.0)
        freq = 2.0 + (c % 7) * 1.5
        phase = rng.uniform(0, 2 * np.pi)
        wave = np.sin(2 * np.pi * freq * (np.cos(angle) * xx + np.sin(angle) * yy) + phase)
        tint = np.array([(c * 37) % 255, (c * 91) % 255, (c * 53) % 255]) / 255.0
        image = 0.5 + 0.35 * wave[..., None] * (0.5 + tint) + rng.normal(0, 0.08, (h, w, 3))
        return encode_jpeg((np.clip(image, 0, 1) * 255).astype(np.uint8), self.quality)
