"""The training recipe's configuration: typed sections, YAML with ``extends:``, overrides.

A recipe file is YAML with these top-level sections (every key optional but ``model.name``
and the data paths; defaults below)::

    extends: ../base/imagenet.yaml      # deep-merged underneath this file (relative path, or a
                                        # shipped recipe's name: extends: imagenet/resnet50_cbn)
    model:    {name: resnet18, num_classes: 1000}
    distnorm: {norm: cbn, cbn: {rho: 1.0, omega: 10.0}, bnp: null, ...}  # distnorm.DistNormConfig
    data:     {train_shards: ..., train_index: ..., val_shards: ..., val_index: ..., ...}
    optim:    {lr: 0.1, momentum: 0.9, weight_decay: 1.0e-4, milestones: [30, 60, 90], ...}
    train:    {engine: accelerate, epochs: 120, global_batch_size: 256, precision: fp32, ...}
    output:   {dir: runs/resnet18_cbn, checkpoint_every_steps: 0, keep_last: 3, ...}

``key=value`` overrides (``train.epochs=2 distnorm.norm=bn distnorm.cbn.rho=2``) are applied on top, values
parsed as YAML. Unknown sections or keys anywhere are errors naming the key and the
accepted ones: no key in a config is ignored silently.

The recipes of ``configs/`` ship inside the package as ``distnorm.recipes`` (read through
:mod:`importlib.resources`; in a clone with an editable install it is ``configs/`` itself), so
a recipe is named without a clone: ``imagenet/resnet50_cbn`` (:func:`find_recipe`; a path
that exists wins, and ``configs/imagenet/resnet50_cbn.yaml`` names the same shipped file from
any directory). ``train.deepspeed_config`` is looked up the same way when it is not a file
here (``configs/deepspeed/zero2_bf16.json`` or ``deepspeed/zero2_bf16.json``).
"""

from __future__ import annotations

import copy
import difflib
import importlib.resources
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import yaml

from distnorm import models
from distnorm.config import DistNormConfig
from distnorm.data.specs import LoaderSpec
from distnorm.settings import (
    Section,
    boolean,
    describe,
    from_mapping,
    increasing_ints,
    non_negative,
    non_negative_int,
    one_of,
    optional,
    param,
    positive,
    positive_int,
    text,
)

__all__ = ["TrainConfig", "load_config", "apply_overrides", "find_recipe", "shipped_recipes", "describe_recipes",
           "ENGINES", "PRECISIONS"]

ENGINES = ("accelerate", "deepspeed")
PRECISIONS = ("fp32", "bf16", "fp16")


class ConfigError(ValueError):
    """A recipe configuration is invalid; the message says which key and why."""


LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ModelConfig(Section):
    label: ClassVar[str] = "model"
    qualified: ClassVar[bool] = True

    name: str = param("resnet18", "architecture (distnorm.models.available())", one_of(*models.available()))
    num_classes: int = param(1000, "classes of the classifier", positive_int)


@dataclass(frozen=True)
class DataConfig(LoaderSpec):
    """The loaders' settings (:class:`~distnorm.data.specs.LoaderSpec`, which owns their
    defaults), with the shards and what only a recipe decides."""

    label: ClassVar[str] = "data"
    qualified: ClassVar[bool] = True

    train_shards: str | None = param(None, "training shards, a brace pattern (data/imagenet/train-{000000..001281}.tar)")
    train_index: str | None = param(None, "index file of the training shards (distnorm.data.shards)")
    val_shards: str | None = param(None, "evaluation shards, a brace pattern")
    val_index: str | None = param(None, "index file of the evaluation shards")
    eval_workers: int = param(4, "DataLoader workers per rank for evaluation (num_workers: for training)",
                              non_negative_int)
    eval_batch_size: int | None = param(None, "per-rank evaluation batch (default: the training per-rank batch)",
                                        optional(positive_int))
    device_prefetch: int = param(1, "batches copied to the device ahead of the step that reads them (CUDA: on a side "
                                    "stream, from pinned memory; distnorm.data.to_device); 0: each at its step",
                                 non_negative_int)


@dataclass(frozen=True)
class OptimConfig(Section):
    label: ClassVar[str] = "optim"
    qualified: ClassVar[bool] = True

    lr: float = param(0.1, "peak learning rate (SGD)", positive)
    momentum: float = param(0.9, "SGD momentum", non_negative)
    nesterov: bool = param(False, "Nesterov momentum", boolean)
    weight_decay: float = param(1e-4, "weight decay", non_negative)
    milestones: list[int] = param([30, 60, 90], "epochs at which the learning rate is multiplied by gamma",
                                  increasing_ints)
    gamma: float = param(0.1, "learning-rate factor at each milestone", positive)
    warmup_epochs: float = param(0.0, "linear warm-up length in epochs", non_negative)
    warmup_start_factor: float = param(0.1, "warm-up starts at this fraction of lr", positive)


@dataclass(frozen=True)
class RunConfig(Section):
    label: ClassVar[str] = "train"
    qualified: ClassVar[bool] = True

    engine: str = param("accelerate", "training engine (each named after its library)", one_of(*ENGINES))
    epochs: int = param(120, "epochs the schedule spans", positive_int)
    global_batch_size: int = param(256, "samples per optimizer step over every rank", positive_int)
    seed: int = param(0, "seed of the model initialisation and the data order", non_negative_int)
    precision: str = param("fp32", "fp32, or bf16 / fp16 autocast", one_of(*PRECISIONS))
    cpu: bool = param(False, "train on the CPU even where CUDA is available", boolean)
    deepspeed_config: str | None = param(None, "DeepSpeed JSON (ZeRO stage, precision) for engine=deepspeed")
    max_steps: int | None = param(None, "stop after this many steps (smoke tests); the schedule still spans epochs",
                                  optional(positive_int))
    eval_every_epochs: int = param(1, "evaluate every N epochs", positive_int)
    collective_timeout_s: float = param(600.0, "every collective of the run fails after this long", positive)
    on_nonfinite: str = param("stop", "a NaN/Inf loss on any rank: 'stop' (error) or 'skip' the step everywhere",
                              one_of("stop", "skip"))
    debug: bool = param(False, "distnorm debug mode: name the first layer with non-finite statistics", boolean)
    resume_world_size: str = param(
        "refuse", "a checkpoint written by another number of processes: 'refuse' it, or 'allow' it (Accelerate: "
        "the weights and optimizer state carry over; training goes on at the start of the next epoch)",
        one_of("refuse", "allow"))

    def _check_together(self) -> None:
        if self.engine == "deepspeed" and not self.deepspeed_config:
            raise ValueError("train.engine=deepspeed needs train.deepspeed_config (a DeepSpeed JSON file)")


@dataclass(frozen=True)
class OutputConfig(Section):
    label: ClassVar[str] = "output"
    qualified: ClassVar[bool] = True

    dir: str = param("runs/default", "run directory: metrics, checkpoints, TensorBoard", text)
    checkpoint_every_steps: int = param(0, "also checkpoint mid-epoch every N steps (0: at the end of each epoch only)",
                                        non_negative_int)
    keep_last: int = param(3, "checkpoints kept", positive_int)
    log_every: int = param(20, "log metrics every N steps", positive_int)
    tensorboard: bool = param(True, "write TensorBoard events", boolean)
    progress: bool = param(True, "progress bar on rank 0", boolean)
    monitors: bool = param(False, "theory monitors (distnorm.monitors), logged as kind 'monitor'", boolean)
    monitor_every: int = param(50, "monitor every N steps", positive_int)
    # The progress bar and one summary line per epoch are printed regardless.
    log_level: str = param("warning", "console logging of distnorm and the libraries (Accelerate, DeepSpeed, torch)",
                           one_of(*LOG_LEVELS))


@dataclass(frozen=True)
class TrainConfig:
    """The recipe: one section per concern, each a :class:`~distnorm.settings.Section`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    distnorm: DistNormConfig = field(default_factory=DistNormConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: RunConfig = field(default_factory=RunConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    # ------------------------------------------------------------------ I/O
    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name).kwargs() for name in _SECTIONS if name != "distnorm"}
        out["distnorm"] = self.distnorm.to_dict()
        return {name: out[name] for name in _SECTIONS}

    def save(self, path: str | os.PathLike) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    def per_rank_batch(self, world_size: int) -> int:
        if self.train.global_batch_size % world_size:
            raise ConfigError(
                f"train.global_batch_size={self.train.global_batch_size} does not split over {world_size} "
                f"processes; use a multiple of {world_size} or launch a number of processes that divides it"
            )
        return self.train.global_batch_size // world_size


_SECTIONS = {f.name: f for f in fields(TrainConfig)}


def describe_config() -> str:
    """Every key of a recipe with its type, default and help (``distnorm-train --help-config``),
    generated from the sections' declarations."""
    lines = []
    for name, f in _SECTIONS.items():
        lines.append(f"{name}:")
        for key, kind, default, help_text in describe(type(f.default_factory()), f"{name}."):  # type: ignore[misc]
            lines.append(f"  {key} ({kind}, default {default!r}): {help_text}")
    return "\n".join(lines)


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    if cls is DistNormConfig:
        return DistNormConfig.from_dict(values, where=f"config section {where!r}")
    return from_mapping(cls, values, where)


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _read(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"config {path} extends itself (cycle: {' -> '.join(map(str, seen + (path,)))})")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:  # one line: the file, the place, what YAML found there
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = " ".join(str(p) for p in (getattr(err, "context", None), getattr(err, "problem", None)) if p) or str(err)
        raise ConfigError(f"config {path}{where}: not valid YAML ({what}); fix the file there "
                          "(a key is 'name: value', nested keys indented by spaces, no tabs)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of sections")
    parent = data.pop("extends", None)
    if parent is None:
        return data
    return _merge(_read(_extended(path, str(parent)), seen + (path,)), data)


def _extended(path: Path, parent: str) -> Path:
    """The file ``extends: parent`` in ``path`` names: a path relative to ``path``'s folder,
    or else a shipped recipe's name (``base/imagenet``, ``imagenet/resnet50_cbn``)."""
    relative = path.parent / parent
    if relative.is_file():
        return relative
    name = _shipped_name(parent).removesuffix(".yaml")
    try:
        shipped = shipped_recipes().get(name)
    except ConfigError:
        shipped = None
    if shipped is None:
        raise ConfigError(f"config {path}: extends: {parent} is neither a file ({relative} does not exist) nor a "
                          "shipped recipe's name (distnorm-train --list-configs lists them)")
    return shipped


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` strings (values parsed as YAML).

    A key given twice is an error, not "the last one wins": the usual cause is a shell that
    expanded a value — ``data.train_shards=shard-{000000..000005}.tar`` unquoted becomes six
    arguments, and training silently on the last shard alone is the worst outcome."""
    data = copy.deepcopy(data)
    given: dict[str, list[str]] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        dotted, raw = item.split("=", 1)
        given.setdefault(dotted.strip(), []).append(raw)
    for dotted, values in given.items():
        if len(values) > 1:
            raise ConfigError(
                f"override {dotted} given {len(values)} times ({', '.join(values[:3])}{', ...' if len(values) > 3 else ''}); "
                "give it once. If you wrote a brace or glob pattern such as {000000..000005}, a shell expanded "
                "it: quote the argument (remote shells, e.g. the DeepSpeed runner's pdsh, expand it too).")
    for dotted, (raw,) in given.items():
        parts = dotted.split(".")
        nested = len(parts) == 3 and parts[0] == "distnorm"  # distnorm.cbn.rho=2: a spec's field
        if not (len(parts) == 2 or nested) or parts[0] not in _SECTIONS:
            raise ConfigError(f"override {dotted!r} must be <section>.<key> with section in {sorted(_SECTIONS)}, "
                              "or distnorm.<norm or bnp>.<key>")
        target = data.setdefault(parts[0], {})
        if nested:
            inner = target.get(parts[1])
            if not isinstance(inner, dict):  # absent, or `bnp: true/false`: a mapping now (for bnp: on)
                inner = target[parts[1]] = {}
            target = inner
        target[parts[-1]] = yaml.safe_load(raw)
    return data


def from_dict(data: dict[str, Any]) -> TrainConfig:
    unknown = sorted(set(data) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"unknown section(s) {unknown}; known sections: {sorted(_SECTIONS)}")
    sections = {}
    for name, f in _SECTIONS.items():
        values = data.get(name) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"section {name!r} must be a mapping, got {type(values).__name__}")
        try:
            sections[name] = _build(f.default_factory().__class__, values, name)  # type: ignore[misc]
        except ConfigError:
            raise
        except (TypeError, ValueError) as err:
            raise ConfigError(str(err)) from err
    return TrainConfig(**sections)


# ------------------------------------------------------------------ the shipped recipes
#: The package the recipes install as (pyproject.toml maps it onto configs/).
RECIPES_PACKAGE = "distnorm.recipes"
#: How a recipe is named in a clone (``configs/imagenet/resnet50_cbn.yaml``): the same name
#: reaches the shipped copy from any directory.
_CLONE_PREFIX = "configs/"


def _shipped_root() -> Path:
    """The directory of the shipped recipes: ``distnorm/recipes/`` of an installed wheel, or
    the clone's ``configs/`` under an editable install."""
    try:
        root = importlib.resources.files(RECIPES_PACKAGE)
    except ModuleNotFoundError:
        raise ConfigError(f"the shipped recipes ({RECIPES_PACKAGE}) are not installed for this Python: install "
                          "distnorm (in a clone: pip install -e .), or give the recipe's path") from None
    if not isinstance(root, Path):  # a zipped install: `extends:` needs files on disk
        raise ConfigError(f"the shipped recipes are not files on disk ({root}); install distnorm unzipped "
                          "(pip install), or give the recipe's path")
    return root


def _shipped_name(value: str) -> str:
    """``value`` as a path under the recipes' directory: a clone's ``configs/`` dropped."""
    return Path(value).as_posix().removeprefix(_CLONE_PREFIX)


def shipped_recipes() -> dict[str, Path]:
    """Every shipped recipe by name (its path under ``configs/`` without ``.yaml``, e.g.
    ``imagenet/resnet50_cbn``), with its file. ``base/`` holds what the others extend."""
    root = _shipped_root()
    return {p.relative_to(root).with_suffix("").as_posix(): p for p in sorted(root.rglob("*.yaml"))}


def find_recipe(config: str | os.PathLike) -> Path:
    """The recipe ``config`` names: a YAML file's path, or else a shipped recipe's name
    (``imagenet/resnet50_cbn``; ``configs/`` before it and ``.yaml`` after it allowed).

    A name that matches nothing is a :class:`ConfigError` listing the closest names."""
    path = Path(config)
    if path.is_file():
        return path
    recipes = shipped_recipes()
    name = _shipped_name(str(config)).removesuffix(".yaml")
    if name in recipes:
        return recipes[name]
    stem = Path(name).name  # `resnet50_cbn` without its directory still finds imagenet/resnet50_cbn
    close = [n for n in recipes if Path(n).name == stem] + difflib.get_close_matches(name, list(recipes), n=5)
    close = list(dict.fromkeys(close))[:5]
    hint = f"; the closest: {', '.join(close)}" if close else ""
    raise ConfigError(f"config {str(config)!r} is neither a file nor the name of a shipped recipe{hint} "
                      "(distnorm-train --list-configs lists them all)")


def _shipped_file(value: str) -> Path | None:
    """The shipped file ``value`` names (``configs/deepspeed/zero2_bf16.json`` or
    ``deepspeed/zero2_bf16.json``), or ``None``."""
    try:
        candidate = _shipped_root() / _shipped_name(value)
    except ConfigError:  # no shipped files: the value stays as given
        return None
    return candidate if candidate.is_file() else None


def describe_recipes() -> str:
    """The shipped recipes and DeepSpeed configs, for ``distnorm-train --list-configs``."""
    root = _shipped_root()
    lines = [f"Recipes shipped with distnorm ({root}); run one by name, e.g.",
             "  distnorm-train --config imagenet/resnet50_cbn --check", ""]
    lines += [f"  {name}" for name in shipped_recipes()]
    lines += ["", "DeepSpeed configs (train.deepspeed_config=NAME, for train.engine=deepspeed):", ""]
    lines += [f"  {p.relative_to(root).as_posix()}" for p in sorted(root.rglob("*.json"))]
    return "\n".join(lines)


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> TrainConfig:
    """Read a recipe (a path or a shipped recipe's name, following ``extends:``), apply
    overrides, validate."""
    data = apply_overrides(_read(find_recipe(path)), list(overrides))
    run = data.get("train")
    deepspeed_config = run.get("deepspeed_config") if isinstance(run, dict) else None
    if isinstance(deepspeed_config, str) and not Path(deepspeed_config).is_file():
        shipped = _shipped_file(deepspeed_config)  # e.g. configs/deepspeed/... outside a clone
        if shipped is not None:
            run["deepspeed_config"] = str(shipped)
    return from_dict(data)
