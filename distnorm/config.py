"""One configuration object for the plugin, from the command line, the environment or YAML.

    cfg = DistNormConfig(norm="cbn", rho=2.0, bnp=True)
    cfg = DistNormConfig.from_args(args)          # after distnorm.add_arguments(parser)
    cfg = DistNormConfig.from_env()               # DISTNORM_NORM=cbn DISTNORM_RHO=2 DISTNORM_BNP=1
    cfg = DistNormConfig.from_yaml("run.yaml")    # the `distnorm:` section

Unknown keys (YAML), unknown ``DISTNORM_*`` variables and invalid values are errors that
name the key and the accepted values: a typo must not silently train the wrong model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Mapping

from distnorm.convert import ACTIVATIONS, NORMS

__all__ = ["DistNormConfig", "add_arguments", "ENV_PREFIX"]

ENV_PREFIX = "DISTNORM_"
_ENV_RESERVED = {"DISTNORM_DEBUG"}  # not configuration: read by distnorm._debug
OFF = "off"


def _help(text: str, **extra: Any) -> Any:
    return field(metadata={"help": text, **extra})


@dataclass
class DistNormConfig:
    """What the plugin does to a model. Field help doubles as ``--help`` text."""

    norm: str = field(default=OFF, metadata={"help": f"normalization: {', '.join(NORMS)}, or {OFF} to leave it alone", "choices": (*NORMS, OFF)})
    activation: str | None = field(default=None, metadata={"help": "replace activations: " + ", ".join(ACTIVATIONS), "choices": tuple(ACTIVATIONS)})
    rho: float = field(default=1.0, metadata={"help": "CBN normalization magnitude rho"})
    kappa: float = field(default=4.0, metadata={"help": "POP-Norm magnitude kappa"})
    amat: bool = field(default=True, metadata={"help": "CBN: adaptive moving averages (AMAT)"})
    omega: float = field(default=10.0, metadata={"help": "AMAT: eta = clip(1 - omega * lr, 0, 1)"})
    eps: float | None = field(default=None, metadata={"help": "normalization eps (default: the layer's)"})
    momentum: float | None = field(default=None, metadata={"help": "running-statistics momentum (default: the layer's)"})
    gn_groups: int = field(default=32, metadata={"help": "GroupNorm groups for norm=gn"})
    bnp: bool = field(default=False, metadata={"help": "attach BNP gradient preconditioning"})
    bnp_momentum: float = field(default=0.99, metadata={"help": "BNP running-moment weight rho"})
    bnp_eps1: float = field(default=1e-2, metadata={"help": "BNP eps1 (relative variance floor)"})
    bnp_eps2: float = field(default=1e-4, metadata={"help": "BNP eps2 (absolute variance floor)"})
    bnp_add_bias: bool = field(default=True, metadata={"help": "BNP: give bias-free layers a bias"})
    bnp_exclude: tuple[str, ...] = field(default=(), metadata={"help": "BNP: module name patterns to skip (comma separated)"})
    group_size: int | None = field(default=None, metadata={"help": "synchronize within groups of this many consecutive ranks (default: all ranks)"})
    own_communicator: bool = field(default=False, metadata={"help": "run the layers' all-reduces on a communicator of their own, so on NCCL they do not queue behind DDP's / ZeRO's gradient buckets (one more communicator)"})
    check_every: int = field(default=200, metadata={"help": "verify buffers are identical across ranks every N training forwards (0: never)"})
    collective_timeout_s: float | None = field(default=None, metadata={"help": "timeout of the sub-groups distnorm creates (default: the default group's)"})

    def __post_init__(self) -> None:
        if isinstance(self.bnp_exclude, str):
            self.bnp_exclude = tuple(p.strip() for p in self.bnp_exclude.split(",") if p.strip())
        else:
            self.bnp_exclude = tuple(self.bnp_exclude)
        if self.norm not in (*NORMS, OFF):
            raise ValueError(f"distnorm config: norm must be one of {(*NORMS, OFF)}, got {self.norm!r}")
        if self.activation is not None and self.activation not in ACTIVATIONS:
            raise ValueError(f"distnorm config: activation must be one of {tuple(ACTIVATIONS)} or None, got {self.activation!r}")
        for name in ("rho", "kappa", "bnp_eps1", "bnp_eps2", "omega") + (("eps",) if self.eps is not None else ()):
            value = getattr(self, name)
            allow_zero = name in ("omega", "bnp_eps1", "bnp_eps2")
            if not (isinstance(value, (int, float)) and math.isfinite(value) and (value >= 0 if allow_zero else value > 0)):
                raise ValueError(f"distnorm config: {name} must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}")
        if self.momentum is not None and not 0 <= self.momentum <= 1:
            raise ValueError(f"distnorm config: momentum must be in [0, 1], got {self.momentum!r}")
        if not 0 <= self.bnp_momentum < 1:
            raise ValueError(f"distnorm config: bnp_momentum must be in [0, 1), got {self.bnp_momentum!r}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"distnorm config: group_size must be >= 1 or None, got {self.group_size!r}")
        if self.collective_timeout_s is not None and not self.collective_timeout_s > 0:
            raise ValueError(f"distnorm config: collective_timeout_s must be > 0 or None, got {self.collective_timeout_s!r}")
        if self.check_every < 0:
            raise ValueError(f"distnorm config: check_every must be >= 0, got {self.check_every!r}")
        if self.gn_groups < 1:
            raise ValueError(f"distnorm config: gn_groups must be >= 1, got {self.gn_groups!r}")

    @property
    def active(self) -> bool:
        """Whether this configuration changes the model at all (a norm other than ``off``, or BNP)."""
        return self.norm != OFF or self.bnp

    # ----------------------------------------------------------------- conversions
    def layer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the new normalization layers for ``self.norm``."""
        common = {k: v for k, v in (("eps", self.eps), ("momentum", self.momentum)) if v is not None}
        if self.norm == "cbn":
            return {"rho": self.rho, "amat": self.amat, "omega": self.omega, **common}
        if self.norm == "popnorm":
            return {"kappa": self.kappa, **common}
        if self.norm == "bn":
            return common
        if self.norm == "gn":
            return {"num_groups": self.gn_groups, **({"eps": self.eps} if self.eps is not None else {})}
        return {}

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["bnp_exclude"] = list(self.bnp_exclude)
        return out

    def fingerprint(self) -> str:
        """A canonical string of the configuration (compared across ranks)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, where: str = "config") -> "DistNormConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"distnorm {where}: unknown key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**dict(values))

    @classmethod
    def from_yaml(cls, source: str | os.PathLike | Mapping[str, Any], section: str | None = "distnorm") -> "DistNormConfig":
        """From a YAML file (or an already loaded mapping); ``section=None`` uses the top level."""
        if isinstance(source, Mapping):
            data = dict(source)
        else:
            import yaml

            with open(source) as f:
                data = yaml.safe_load(f) or {}
        if section is not None:
            data = data.get(section) or {}
        return cls.from_dict(data, where=f"YAML section {section!r}" if section else "YAML")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, prefix: str = ENV_PREFIX) -> "DistNormConfig":
        """From ``DISTNORM_<FIELD>`` variables (``DISTNORM_BNP_EXCLUDE=fc,head``)."""
        environ = os.environ if environ is None else environ
        by_name = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in environ.items():
            if not key.startswith(prefix) or key in _ENV_RESERVED:
                continue
            name = key[len(prefix):].lower()
            if name not in by_name:
                raise ValueError(f"unknown environment variable {key}; known: {sorted(prefix + n.upper() for n in by_name)}")
            values[name] = _parse(by_name[name], raw, key)
        return cls(**values)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DistNormConfig":
        """From a namespace parsed with a parser prepared by :func:`add_arguments`."""
        values = {f.name: getattr(args, _dest(f.name)) for f in fields(cls) if hasattr(args, _dest(f.name))}
        return cls(**values)


def _dest(name: str) -> str:
    return "distnorm" if name == "norm" else f"distnorm_{name}"


def _parse(f: Any, raw: str, where: str) -> Any:
    text = raw.strip()
    kind = str(f.type)
    if text.lower() in ("none", "") and "None" in kind:
        return None
    try:
        if kind.startswith("bool"):
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if kind.startswith("int"):
            return int(text)
        if kind.startswith("float"):
            return float(text)
    except ValueError:
        raise ValueError(f"{where}={raw!r} is not a valid {kind.split(' ')[0]}") from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--distnorm NORM`` and ``--distnorm-<option>`` flags to ``parser``.

    Example:
        >>> import argparse, distnorm
        >>> parser = distnorm.add_arguments(argparse.ArgumentParser())
        >>> cfg = distnorm.DistNormConfig.from_args(parser.parse_args(["--distnorm", "cbn", "--distnorm-rho", "2"]))
        >>> cfg.norm, cfg.rho
        ('cbn', 2.0)
    """
    group = parser.add_argument_group("distnorm", "normalization plugin (see distnorm.DistNormConfig)")
    for f in fields(DistNormConfig):
        flag = "--distnorm" if f.name == "norm" else "--distnorm-" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        kwargs: dict[str, Any] = {"dest": _dest(f.name), "default": default, "help": f.metadata.get("help")}
        kind = str(f.type)
        if kind.startswith("bool"):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.name == "bnp_exclude":
            kwargs["type"] = str
        elif "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        elif kind.startswith("int"):
            kwargs["type"] = int
        elif kind.startswith("float"):
            kwargs["type"] = float
        group.add_argument(flag, **kwargs)
    return parser
