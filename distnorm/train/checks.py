"""What ``distnorm-train`` knows and checks before it imports torch.

Every launcher runs ``distnorm-train --check`` before it starts a worker, and a refused
configuration should cost its user a tenth of a second, not the second or more of CPU that
``import torch`` takes (paid again by every process of a launch). This module, like
:mod:`distnorm.train.config` and :mod:`distnorm.data.specs` it reads, imports no torch:

* :func:`local_world` — this process's rank and the world size, from the launcher's
  environment;
* :func:`require_training_modules`, :func:`require_engine` — what the training imports, and
  the configured engine's library, are installed (looked up, not imported);
* :func:`check_setup` — the batch split, the DeepSpeed JSON, and the shards against their
  index (sizes; SHA-256 checksums on request).

Checks that need the processes together (ranks agreeing on their setup) run in the training
loop (:func:`distnorm.train.loop.agree_on_setup`); their error, :class:`SetupMismatchError`, is
defined here so that the command line can report it without importing the loop.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

from distnorm.data.index import ShardIndex, expand_urls
from distnorm.train.config import ConfigError, TrainConfig

__all__ = ["SetupMismatchError", "check_setup", "local_world", "require_engine", "require_training_modules",
           "TRAINING_MODULES"]


def local_world() -> tuple[int, int]:
    """``(rank, world_size)`` from the launcher's environment, before any group exists."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


#: The third-party modules a training process imports beyond the check path's (the ``[train]``
#: extra and torch); ``--check`` looks each up, so a missing one is said before the queue wait.
TRAINING_MODULES = ("torch", "torchvision", "numpy", "PIL", "webdataset", "braceexpand", "tqdm")


def require_training_modules() -> None:
    """Raise a clear error naming the extra to install if a module the training imports is
    missing (looked up, not imported: see :func:`require_engine`)."""
    missing = [m for m in TRAINING_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise missing_module(missing[0])


def _relative_to_here(path: str | os.PathLike) -> str:
    """For a relative data path: which directory it was looked up in (the current one)."""
    return "" if Path(path).is_absolute() else f" (a relative path: looked up from the current directory, {Path.cwd()})"


def missing_module(name: str) -> ConfigError:
    """The error for a module of the ``[train]`` extra that is not installed."""
    return ConfigError(f"the optional dependency {name!r} is not installed; install the [train] extra: "
                       'pip install "distnorm[train]" (from a clone: pip install -e ".[train]")')


def require_engine(name: str) -> None:
    """Raise a clear error if the engine's library is not installed.

    Looked up, not imported (importing DeepSpeed or Accelerate imports torch and much more):
    a library that is installed but fails to import raises its own error when the engine is
    built.
    """
    module = name  # each engine is named after its library (train.config.ENGINES)
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"train.engine={name!r} needs the {module} package: `pip install distnorm[{name}]`")


class SetupMismatchError(ConfigError):
    """Ranks disagree on their setup. Raised on every rank with the same message (so one
    rank printing it says everything)."""


def _local_shards(pattern: str) -> list[str]:
    """The local shard files among the URLs (remote / pipe: URLs cannot be checked here)."""
    urls = expand_urls(pattern)
    local = [u[len("file://"):] if u.startswith("file://") else u for u in urls if "://" not in u or u.startswith("file://")]
    return [u for u in local if not u.startswith("pipe:")]


def _check_shard_files(cfg: TrainConfig, split: str, local: list[str], index: ShardIndex, checksums: bool,
                       warn: bool) -> None:
    """The local shards against their index: a size each (one ``stat``), and with ``checksums``
    every byte (SHA-256). A mismatch is a ConfigError, or a warning under data.on_error=skip
    (the loaders then skip what cannot be read)."""
    index_key = f"data.{split}_index {getattr(cfg.data, f'{split}_index')}"
    unrecorded = index.unchecked(checksum=checksums)
    if checksums and unrecorded:
        raise ConfigError(
            f"{index_key} records no checksum for {len(unrecorded)} shard(s) (e.g. {unrecorded[0]}): an earlier "
            "distnorm-shards wrote it. Run the same distnorm-shards command again: it keeps the shards that verify "
            "against their source and writes the index with each shard's size and SHA-256.")
    problems = index.verify_files(local, checksum=checksums)
    unlisted = [p for p in problems if p.endswith(": not listed in the index")]
    if unlisted:
        raise ConfigError(f"data.{split}_shards names {len(unlisted)} shard(s) that {index_key} does not list, e.g. "
                          f"{unlisted[0].removesuffix(': not listed in the index')}: point both at the same shard set")
    if not problems:
        return
    listing = "; ".join(problems[:5]) + (f"; ... {len(problems) - 5} more" if len(problems) > 5 else "")
    what = f"data.{split}_shards: {len(problems)} of {len(local)} shard(s) differ from {index_key}: {listing}."
    if cfg.data.on_error == "skip":
        if warn:
            warnings.warn(f"{what} Training goes on (data.on_error=skip): what cannot be read is skipped and counted.",
                          stacklevel=3)
        return
    raise ConfigError(f"{what} Copy them again from the original (or write them again with distnorm-shards), or set "
                      "data.on_error=skip to go on without the samples that cannot be read.")


def check_setup(cfg: TrainConfig, world_size: int, *, data: bool = True, checksums: bool = False,
                warn: bool = True) -> None:
    """Everything that can be checked before any worker starts; raises ConfigError.

    The local shards are compared with their index: sizes always (a ``stat`` each), SHA-256
    checksums with ``checksums`` (every byte read; minutes for ImageNet, see the data
    reference). ``warn``: whether this process warns (rank 0) when data.on_error=skip lets
    a mismatch through."""
    require_engine(cfg.train.engine)
    cfg.per_rank_batch(world_size)
    if cfg.train.engine == "deepspeed" and not Path(cfg.train.deepspeed_config).is_file():
        raise ConfigError(f"train.deepspeed_config {cfg.train.deepspeed_config} does not exist")
    if not data:
        return
    for split in ("train", "val"):
        shards, index = getattr(cfg.data, f"{split}_shards"), getattr(cfg.data, f"{split}_index")
        if shards is None:
            if split == "train":
                raise ConfigError("data.train_shards is not set")
            continue
        if index is None:
            raise ConfigError(f"data.{split}_index is not set (distnorm-shards writes it beside the shards)")
        if not Path(index).is_file():
            raise ConfigError(f"data.{split}_index {index} does not exist{_relative_to_here(index)}; write the shards "
                              "with distnorm-shards first, or set the path")
        local = _local_shards(shards)
        missing = [u for u in local if not Path(u).is_file()]
        if missing:
            raise ConfigError(f"data.{split}_shards: {len(missing)} shard(s) missing, e.g. {missing[0]}"
                              f"{_relative_to_here(missing[0])}")
        try:
            shard_index = ShardIndex.load(index)
        except ValueError as err:  # not an index, or an inconsistent one
            raise ConfigError(f"data.{split}_index: {err}") from None
        classes = len(shard_index.classes)
        if classes != cfg.model.num_classes:
            raise ConfigError(f"model.num_classes={cfg.model.num_classes} but {index} lists {classes} classes")
        _check_shard_files(cfg, split, local, shard_index, checksums, warn)
