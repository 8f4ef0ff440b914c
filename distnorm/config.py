"""One configuration object for the plugin, from the command line, the environment or YAML.

    cfg = DistNormConfig(norm="cbn", cbn=CBNSpec(rho=2.0), bnp=BNPSpec())
    cfg = DistNormConfig.from_args(args)          # after distnorm.add_arguments(parser)
    cfg = DistNormConfig.from_env()               # DISTNORM_NORM=cbn DISTNORM_CBN_RHO=2 DISTNORM_BNP=1
    cfg = DistNormConfig.from_yaml("run.yaml")    # the `distnorm:` section

The hyper-parameters of each normalization and of BNP live in their spec
(:mod:`distnorm.specs`), nested here as ``cbn``, ``popnorm``, ``bn``, ``gn`` and ``bnp``; the
command-line flags (``--distnorm-<section>-<field>``), the ``DISTNORM_<SECTION>_<FIELD>``
variables and the YAML keys (``distnorm: {cbn: {rho: 2.0}}``) are generated from the specs'
fields, so every layer parameter is reachable from every front end. ``bnp`` is ``None`` (off)
or a :class:`~distnorm.specs.BNPSpec`; ``bnp: true`` / ``--distnorm-bnp`` / ``DISTNORM_BNP=1``
switch it on with its defaults.

Unknown keys (YAML), unknown ``DISTNORM_*`` variables and invalid values are errors that
name the key and the accepted values: a typo must not silently train the wrong model.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Mapping

from distnorm.settings import (Section, boolean, coerce, keyed_lines, non_negative_int, one_of, optional, param, positive,
                               positive_int)
from distnorm.specs import ACTIVATION_NAMES, KEEP, NORM_LABELS, NORM_SPECS, BNPSpec, CBNSpec, GNSpec, POPNormSpec, SyncBNSpec

__all__ = ["DistNormConfig", "add_arguments", "ENV_PREFIX"]

ENV_PREFIX = "DISTNORM_"
_ENV_RESERVED = {"DISTNORM_DEBUG"}  # not configuration: read by distnorm._debug

#: The nested spec sections: name -> spec class (``bnp`` may also be ``None``: off).
SECTIONS: dict[str, type] = {**NORM_SPECS, "bnp": BNPSpec}

@dataclass(frozen=True)
class DistNormConfig(Section):
    """What the plugin does to a model. Field help doubles as ``--help`` text.

    Sections may be given as mappings (``cbn={"rho": 2.0}``) and ``bnp`` as ``True`` (on,
    with its defaults) or ``False`` / ``None`` (off).
    """

    label: ClassVar[str] = "distnorm config"

    norm: str = param(KEEP, f"normalization: {', '.join(NORM_LABELS)} ({KEEP}: leave the BatchNorm layers as "
                            "they are; none: remove them)", one_of(*NORM_LABELS), choices=NORM_LABELS)
    activation: str | None = param(None, "replace activations: " + ", ".join(ACTIVATION_NAMES),
                                   one_of(None, *ACTIVATION_NAMES), choices=ACTIVATION_NAMES)
    cbn: CBNSpec = field(default_factory=CBNSpec, metadata={"help": "CBN hyper-parameters (norm=cbn)"})
    popnorm: POPNormSpec = field(default_factory=POPNormSpec, metadata={"help": "POP-Norm hyper-parameters (norm=popnorm)"})
    bn: SyncBNSpec = field(default_factory=SyncBNSpec, metadata={"help": "synchronized BatchNorm hyper-parameters (norm=bn)"})
    gn: GNSpec = field(default_factory=GNSpec, metadata={"help": "GroupNorm hyper-parameters (norm=gn)"})
    bnp: BNPSpec | None = param(None, "attach BNP gradient preconditioning (None: off)", section=BNPSpec)
    sync_group_size: int | None = param(None, "synchronize within groups of this many consecutive ranks, e.g. one "
                                              "node (default: all ranks)", optional(positive_int))
    own_communicator: bool = param(False, "run the layers' all-reduces on a communicator of their own, so on NCCL "
                                          "they do not queue behind DDP's / ZeRO's gradient buckets (one more "
                                          "communicator)", boolean)
    check_every: int = param(200, "verify buffers are identical across ranks every N training forwards (0: never)",
                             non_negative_int)
    collective_timeout_s: float | None = param(None, "timeout of the sub-groups distnorm creates (default: the "
                                                     "default group's)", optional(positive))

    def __post_init__(self) -> None:
        bnp = {True: BNPSpec(), False: None}.get(self.bnp, self.bnp) if isinstance(self.bnp, bool) else self.bnp
        object.__setattr__(self, "bnp", bnp)
        for name, cls in SECTIONS.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, cls.from_kwargs(f"distnorm config section {name!r}", **value))
            elif not (isinstance(value, cls) or (name == "bnp" and value is None)):
                raise ValueError(f"distnorm config: {name} must be a {cls.__name__}"
                                 f"{' or None' if name == 'bnp' else ''}, got {value!r}")
        super().__post_init__()

    @property
    def active(self) -> bool:
        """Whether this configuration changes the model at all (a norm other than ``keep``, or BNP)."""
        return self.norm != KEEP or self.bnp is not None

    @property
    def norm_spec(self) -> Any:
        """The spec of the selected normalization (``None`` for ``keep`` / ``none``)."""
        return getattr(self, self.norm) if self.norm in SECTIONS else None

    # ----------------------------------------------------------------- conversions
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in SECTIONS:
                value = None if value is None else {k: list(v) if isinstance(v, tuple) else v
                                                    for k, v in value.kwargs().items()}
            out[f.name] = value
        return out

    def fingerprint(self) -> str:
        """A canonical text of the configuration, one ``key = value`` line per setting
        (compared across ranks: a mismatch names the keys that differ)."""
        return "\n".join(keyed_lines(self.to_dict()))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, where: str = "config") -> "DistNormConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"distnorm {where}: unknown key(s) {unknown}; known keys: {sorted(known)} "
                             f"(hyper-parameters go in their section, e.g. cbn: {{rho: 2.0}})")
        return cls(**values)

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
        """From ``DISTNORM_<FIELD>`` and ``DISTNORM_<SECTION>_<FIELD>`` variables
        (``DISTNORM_NORM=cbn DISTNORM_CBN_RHO=2 DISTNORM_BNP=1 DISTNORM_BNP_EXCLUDE=fc,head``)."""
        environ = os.environ if environ is None else environ
        options = _options()
        values: dict[str, Any] = {}
        for key, raw in environ.items():
            if not key.startswith(prefix) or key in _ENV_RESERVED:
                continue
            name = key[len(prefix):].lower()
            if name not in options:
                raise ValueError(f"unknown environment variable {key}; known: {sorted(prefix + n.upper() for n in options)}")
            values[name] = coerce(options[name], raw, key)
        return cls._from_options(values, where="environment")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DistNormConfig":
        """From a namespace parsed with a parser prepared by :func:`add_arguments` (only the
        flags given on the command line; the rest keep their defaults)."""
        values = {name: getattr(args, _dest(name)) for name in _options()
                  if getattr(args, _dest(name), None) is not None}
        return cls._from_options(values, where="command line")

    @classmethod
    def _from_options(cls, values: dict[str, Any], where: str) -> "DistNormConfig":
        """From flat option names (``norm``, ``cbn_rho``, ``bnp``, ``bnp_decay``, ...)."""
        nested: dict[str, Any] = {}
        sections: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            section = next((s for s in SECTIONS if name.startswith(s + "_")
                            and name[len(s) + 1:] in {f.name for f in fields(SECTIONS[s])}), None)
            if section is not None:
                sections.setdefault(section, {})[name[len(section) + 1:]] = value
            else:
                nested[name] = value
        bnp_on = nested.pop("bnp", None)
        if bnp_on and "bnp" not in sections:
            sections["bnp"] = {}
        for section, given in sections.items():
            if section == "bnp" and not bnp_on and given:
                raise ValueError(f"distnorm {where}: BNP options {sorted(given)} given without switching BNP on "
                                 f"({'--distnorm-bnp' if where == 'command line' else ENV_PREFIX + 'BNP=1'})")
            nested[section] = given
        return cls.from_dict(nested, where=where)


def _options() -> dict[str, dataclasses.Field]:
    """Every front-end option: the top-level fields (but the sections) and
    ``<section>_<field>`` for every spec field; ``bnp`` is the on switch."""
    out: dict[str, dataclasses.Field] = {}
    for f in fields(DistNormConfig):
        if f.name in SECTIONS:
            if f.name == "bnp":
                out["bnp"] = dataclasses.field(default=False, metadata=f.metadata)
                out["bnp"].name, out["bnp"].type = "bnp", "bool"
            for sf in fields(SECTIONS[f.name]):
                out[f"{f.name}_{sf.name}"] = sf
        else:
            out[f.name] = f
    return out


def _dest(name: str) -> str:
    return "distnorm" if name == "norm" else f"distnorm_{name}"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--distnorm NORM`` and ``--distnorm-<option>`` flags to ``parser`` (one per
    top-level option and per spec field: ``--distnorm-cbn-rho``, ``--distnorm-bnp-decay``).

    Example:
        >>> import argparse, distnorm
        >>> parser = distnorm.add_arguments(argparse.ArgumentParser())
        >>> cfg = distnorm.DistNormConfig.from_args(parser.parse_args(["--distnorm", "cbn", "--distnorm-cbn-rho", "2"]))
        >>> cfg.norm, cfg.cbn.rho
        ('cbn', 2.0)
    """
    group = parser.add_argument_group("distnorm", "normalization plugin (see distnorm.DistNormConfig, distnorm.specs)")
    for name, f in _options().items():
        flag = "--distnorm" if name == "norm" else "--distnorm-" + name.replace("_", "-")
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        text = f.metadata.get("help") or ""
        # Flags default to None ("not given"): the spec, not argparse, owns the defaults.
        kwargs: dict[str, Any] = {"dest": _dest(name), "default": None,
                                  "help": f"{text} (default: {default})" if name != "bnp" else "attach BNP gradient preconditioning"}
        kind = str(f.type)
        if kind.startswith("bool"):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        elif name == "bnp_exclude" or kind.startswith("str") or kind.startswith("tuple"):
            kwargs["type"] = str
        elif kind.startswith("int"):
            kwargs["type"] = int
        elif kind.startswith("float"):
            kwargs["type"] = float
        group.add_argument(flag, **kwargs)
    return parser
