"""The WebDataset ImageNet pipeline (``pip install distnorm[data]``).

* :mod:`distnorm.data.shards` — shard writer and the ``distnorm-shards`` command;
* :mod:`distnorm.data.sources` — ImageFolder, torchvision datasets, digits demo, synthetic;
* :mod:`distnorm.data.loaders` — :class:`TrainLoader` (equal-length epochs on every rank)
  and :class:`EvalLoader` (every validation sample exactly once);
* :mod:`distnorm.data.specs` — their settings, :class:`LoaderSpec` and :class:`ImageSpec`,
  checked without importing torch (what ``distnorm-train --check`` reads);
* :mod:`distnorm.data.transforms` — the recipes' transforms, normalized per batch;
* :mod:`distnorm.data.prefetch` — :func:`to_device`: the next batches copied to the GPU
  while the step runs;
* :func:`evaluate` — top-1 / top-5 / loss reduced across ranks.

Names are imported lazily (so ``python -m distnorm.data.shards`` and ``import
distnorm.data`` stay light).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "evaluate": "evaluation",
    "ShardIndex": "index", "ShardInfo": "index", "index_path": "index",
    "TrainLoader": "loaders", "EvalLoader": "loaders", "DataError": "specs", "LoaderSpec": "specs",
    "expand_urls": "index",
    "build_transform": "transforms", "ImageTransform": "transforms", "ImageSpec": "specs",
    "TRANSFORM_PRESETS": "specs",
    "write_shards": "shards", "plan_shards": "shards",
    "DatasetSource": "sources", "DigitsSource": "sources", "ImageFolderSource": "sources",
    "SyntheticSource": "sources",
    "to_device": "prefetch",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"distnorm.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'distnorm.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
