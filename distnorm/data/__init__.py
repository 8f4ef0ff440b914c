"""The WebDataset ImageNet pipeline (``pip install distnorm[data]``).

* :mod:`distnorm.data.shards` — shard writer and the ``distnorm-shards`` command;
* :mod:`distnorm.data.sources` — ImageFolder, torchvision datasets, digits demo, synthetic;
* :mod:`distnorm.data.loaders` — :class:`TrainLoader` (equal-length epochs on every rank)
  and :class:`EvalLoader` (every validation sample exactly once);
* :func:`evaluate` — top-1 / top-5 / loss reduced across ranks.
"""

from distnorm.data.evaluation import evaluate
from distnorm.data.index import ShardIndex, ShardInfo, index_path
from distnorm.data.loaders import TRANSFORM_PRESETS, DataError, EvalLoader, TrainLoader, build_transform, expand_urls
from distnorm.data.shards import plan_shards, write_shards
from distnorm.data.sources import DatasetSource, DigitsSource, ImageFolderSource, SyntheticSource

__all__ = [
    "evaluate",
    "ShardIndex",
    "ShardInfo",
    "index_path",
    "TrainLoader",
    "EvalLoader",
    "DataError",
    "build_transform",
    "expand_urls",
    "TRANSFORM_PRESETS",
    "write_shards",
    "plan_shards",
    "DatasetSource",
    "DigitsSource",
    "ImageFolderSource",
    "SyntheticSource",
]
