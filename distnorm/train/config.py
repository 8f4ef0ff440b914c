"""The training recipe's configuration: typed sections, YAML with ``extends:``, overrides.

A recipe file is YAML with these top-level sections (every key optional but ``model.name``
and the data paths; defaults below)::

    extends: ../base/imagenet.yaml      # deep-merged underneath this file (relative path)
    model:    {name: resnet18, num_classes: 1000}
    distnorm: {norm: cbn, cbn: {rho: 1.0, omega: 10.0}, bnp: null, ...}  # distnorm.DistNormConfig
    data:     {train_shards: ..., train_index: ..., val_shards: ..., val_index: ..., ...}
    optim:    {lr: 0.1, momentum: 0.9, weight_decay: 1.0e-4, milestones: [30, 60, 90], ...}
    train:    {engine: accelerate, epochs: 120, global_batch_size: 256, precision: fp32, ...}
    output:   {dir: runs/resnet18_cbn, checkpoint_every_steps: 0, keep_last: 3, ...}

``key=value`` overrides (``train.epochs=2 distnorm.norm=bn distnorm.cbn.rho=2``) are applied on top, values
parsed as YAML. Unknown sections or keys anywhere are errors naming the key and the
accepted ones: no key in a config is ignored silently.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from distnorm import models
from distnorm.config import DistNormConfig
from distnorm.data.loaders import TRANSFORM_PRESETS

__all__ = ["TrainConfig", "load_config", "apply_overrides", "ENGINES", "PRECISIONS"]

ENGINES = ("accelerate", "deepspeed")
PRECISIONS = ("fp32", "bf16", "fp16")


class ConfigError(ValueError):
    """A recipe configuration is invalid; the message says which key and why."""


@dataclass
class ModelConfig:
    name: str = "resnet18"
    num_classes: int = 1000


@dataclass
class DataConfig:
    train_shards: str | None = None
    train_index: str | None = None
    val_shards: str | None = None
    val_index: str | None = None
    transform: str = "imagenet"
    image_size: int = 224
    num_workers: int = 8
    eval_workers: int = 4
    prefetch_factor: int = 2
    shuffle_buffer: int = 5000
    eval_batch_size: int | None = None  # per rank; default: the training per-rank batch
    on_error: str = "raise"


@dataclass
class OptimConfig:
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 1e-4
    milestones: list[int] = field(default_factory=lambda: [30, 60, 90])
    gamma: float = 0.1
    warmup_epochs: float = 0.0
    warmup_start_factor: float = 0.1


@dataclass
class RunConfig:
    engine: str = "accelerate"
    epochs: int = 120
    global_batch_size: int = 256
    seed: int = 0
    precision: str = "fp32"
    cpu: bool = False
    deepspeed_config: str | None = None
    max_steps: int | None = None  # stop early (smoke tests); the schedule still spans `epochs`
    eval_every_epochs: int = 1
    collective_timeout_s: float = 600.0  # every collective of the run fails after this long
    on_nonfinite: str = "stop"  # a NaN/Inf loss on any rank: "stop" (error) or "skip" the step everywhere
    debug: bool = False  # distnorm debug mode: name the first layer with non-finite statistics


@dataclass
class OutputConfig:
    dir: str = "runs/default"
    checkpoint_every_steps: int = 0  # also mid-epoch; 0: only at the end of each epoch
    keep_last: int = 3
    log_every: int = 20
    tensorboard: bool = True
    progress: bool = True
    monitors: bool = False  # theory monitors (distnorm.monitors), logged as kind "monitor"
    monitor_every: int = 50
    # Console logging of distnorm and the libraries (Accelerate, DeepSpeed, torch): the
    # progress bar and one summary line per epoch are printed regardless.
    log_level: str = "warning"


LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    distnorm: DistNormConfig = field(default_factory=DistNormConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: RunConfig = field(default_factory=RunConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    # ------------------------------------------------------------------ I/O
    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["distnorm"] = self.distnorm.to_dict()
        return out

    def save(self, path: str | os.PathLike) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    # ------------------------------------------------------------- checks
    def per_rank_batch(self, world_size: int) -> int:
        if self.train.global_batch_size % world_size:
            raise ConfigError(
                f"train.global_batch_size={self.train.global_batch_size} does not split over {world_size} "
                f"processes; use a multiple of {world_size} or launch a number of processes that divides it"
            )
        return self.train.global_batch_size // world_size

    def validate(self) -> None:
        """Value checks that need no file system or launcher (done at construction)."""
        t, o, d, op = self.train, self.output, self.data, self.optim
        if self.model.name not in models.available():
            raise ConfigError(f"model.name={self.model.name!r} is not one of {models.available()}")
        if t.engine not in ENGINES:
            raise ConfigError(f"train.engine={t.engine!r}; choose one of {ENGINES}")
        if t.precision not in PRECISIONS:
            raise ConfigError(f"train.precision={t.precision!r}; choose one of {PRECISIONS}")
        if t.engine == "deepspeed" and not t.deepspeed_config:
            raise ConfigError("train.engine=deepspeed needs train.deepspeed_config (a DeepSpeed JSON file)")
        if t.on_nonfinite not in ("stop", "skip"):
            raise ConfigError(f"train.on_nonfinite={t.on_nonfinite!r}; choose 'stop' or 'skip'")
        if not t.collective_timeout_s > 0:
            raise ConfigError(f"train.collective_timeout_s must be > 0, got {t.collective_timeout_s!r}")
        if d.transform not in TRANSFORM_PRESETS:
            raise ConfigError(f"data.transform={d.transform!r}; choose one of {TRANSFORM_PRESETS}")
        if o.log_level not in LOG_LEVELS:
            raise ConfigError(f"output.log_level={o.log_level!r}; choose one of {LOG_LEVELS}")
        if d.on_error not in ("raise", "skip"):
            raise ConfigError(f"data.on_error={d.on_error!r}; choose 'raise' or 'skip'")
        for name, value in (("train.epochs", t.epochs), ("train.global_batch_size", t.global_batch_size),
                            ("model.num_classes", self.model.num_classes), ("data.image_size", d.image_size),
                            ("output.keep_last", o.keep_last), ("output.log_every", o.log_every),
                            ("train.eval_every_epochs", t.eval_every_epochs)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not (op.lr > 0 and math.isfinite(op.lr)):
            raise ConfigError(f"optim.lr must be positive, got {op.lr!r}")
        if sorted(op.milestones) != list(op.milestones):
            raise ConfigError(f"optim.milestones must be increasing, got {op.milestones!r}")


_SECTIONS = {f.name: f for f in fields(TrainConfig)}


def _coerce(value: Any, kind: str, key: str) -> Any:
    """Check (and where lossless, convert) a YAML value against a field's annotation."""
    optional = kind.endswith("| None")
    base = kind.replace("| None", "").strip()
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key} must not be empty")
    if base == "float":
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif base == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base == "bool":
        if isinstance(value, bool):
            return value
    elif base == "str":
        if isinstance(value, str):
            return value
    elif base == "list[int]":
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return value
    else:  # pragma: no cover - a new annotation needs a case here
        raise TypeError(f"unhandled config annotation {kind!r}")
    raise ConfigError(f"{key}={value!r} is not a valid {kind}")


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    if cls is DistNormConfig:
        return DistNormConfig.from_dict(values, where=f"config section {where!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"unknown key(s) {[f'{where}.{k}' for k in unknown]}; known keys in {where!r}: {sorted(known)}")
    return cls(**{k: _coerce(v, str(known[k].type), f"{where}.{k}") for k, v in values.items()})


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
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of sections")
    parent = data.pop("extends", None)
    if parent is None:
        return data
    return _merge(_read(path.parent / parent, seen + (path,)), data)


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
        sections[name] = _build(f.default_factory().__class__, values, name)  # type: ignore[misc]
    try:
        cfg = TrainConfig(**sections)
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from err
    cfg.validate()
    return cfg


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> TrainConfig:
    """Read a recipe (following ``extends:``), apply overrides, validate."""
    return from_dict(apply_overrides(_read(Path(path)), list(overrides)))
