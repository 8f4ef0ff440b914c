"""One way to declare a group of settings, and one way to read it.

Every configurable value of distnorm — a layer's hyper-parameters (:mod:`distnorm.specs`),
the plugin's configuration (:class:`distnorm.DistNormConfig`) and the training recipe's
sections (:mod:`distnorm.train.config`) — is a field of a :class:`Section`: a frozen
dataclass whose fields are declared with :func:`param` (default, help text, check). From
that one declaration come

* validation at construction (each field's check, then :meth:`Section._check_together`),
  with an error that names the field, the value and what is accepted;
* :func:`from_mapping`: a section from a mapping (YAML, ``key=value`` overrides, the
  environment, the command line), unknown keys refused by name, values read as text
  converted by the field's type (:func:`coerce`);
* the help of every front end (``--help`` flags, ``distnorm-train --help-config``):
  :func:`describe`.

This module is at the bottom of the package: it imports nothing of distnorm's.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, ClassVar, Iterator, Mapping

__all__ = ["Section", "param", "from_mapping", "coerce", "describe", "Check"]

#: A check: ``None`` when the value is valid, else the reason ("must be ...").
Check = Callable[[Any], "str | None"]


# ------------------------------------------------------------------------ checks
def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive(value: Any) -> str | None:
    return None if _number(value) and value > 0 else "must be a positive finite number"


def non_negative(value: Any) -> str | None:
    return None if _number(value) and value >= 0 else "must be a finite number >= 0"


def unit_interval(value: Any) -> str | None:
    return None if _number(value) and 0.0 <= value <= 1.0 else "must be in [0, 1]"


def boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def positive_int(value: Any) -> str | None:
    return None if _int(value) and value >= 1 else "must be an int >= 1"


def non_negative_int(value: Any) -> str | None:
    return None if _int(value) and value >= 0 else "must be an int >= 0"


def text(value: Any) -> str | None:
    return None if isinstance(value, str) and value else "must be a non-empty string"


def increasing_ints(value: Any) -> str | None:
    ok = isinstance(value, (list, tuple)) and all(_int(v) for v in value) and list(value) == sorted(value)
    return None if ok else "must be an increasing list of ints"


def optional(check: Check) -> Check:
    """``check``, or ``None`` (the field's "not given")."""

    def optional_check(value: Any) -> str | None:
        reason = None if value is None else check(value)
        return None if reason is None else f"{reason} or None"

    return optional_check


def one_of(*choices: Any) -> Check:
    def check(value: Any) -> str | None:
        return None if value in choices else f"must be one of {choices}"

    return check


# ------------------------------------------------------------------------ fields
def param(default: Any, help: str, check: Check | None = None, **extra: Any) -> Any:
    """A settings field: its default, its help text and its check. A list default is copied
    for every instance (a dataclass ``default_factory``)."""
    metadata = {"help": help, "check": check, **extra}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]


@dataclass(frozen=True)
class Section:
    """A typed, frozen, documented group of settings (subclass with :func:`param` fields).

    ``label`` names the section in errors; ``qualified`` chooses their form: ``"CBN: rho
    must be ..."`` for a layer's hyper-parameters, ``"train.epochs must be ..."`` for a
    section of a configuration file.
    """

    label: ClassVar[str] = ""
    qualified: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for f in fields(self):
            check = f.metadata.get("check")
            value = getattr(self, f.name)
            reason = check(value) if check is not None else None
            if reason:
                raise ValueError(f"{self.where(f.name)} {reason}, got {value!r}")
        self._check_together()

    @classmethod
    def where(cls, name: str) -> str:
        """How errors name field ``name``."""
        return f"{cls.label}.{name}" if cls.qualified else f"{cls.label}: {name}"

    def _check_together(self) -> None:
        """Constraints between fields (subclasses)."""

    def kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def replace(self, **changes: Any) -> "Section":
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------- reading
def coerce(f: dataclasses.Field, value: Any, where: str) -> Any:
    """``value`` for field ``f``: as given when it already has the field's type, converted
    when it is text (the environment, the command line, YAML 1.1's ``1e-4``), else as given
    (the field's check then names what is wrong)."""
    kind = str(f.type)
    if isinstance(value, str) and "None" in kind and value.strip().lower() in ("none", "null", ""):
        return None
    if not isinstance(value, str) or kind.startswith("str"):
        if kind.startswith("float") and _int(value):
            return float(value)  # YAML's 2 for a float field
        return value
    raw = value.strip()
    try:
        if kind.startswith("bool"):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
        if kind.startswith(("list[int]", "tuple[int")):
            return [int(v) for v in raw.strip("[]()").split(",") if v.strip()]
        if kind.startswith(("list[str]", "tuple[str")):
            return tuple(v.strip() for v in raw.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{where}={value!r} is not a valid {kind.split(' ')[0]}") from None
    return value


def from_mapping(cls: type, values: Mapping[str, Any], where: str) -> Any:
    """``cls(**values)`` with unknown keys refused by name (with the accepted ones) and text
    values converted (:func:`coerce`); ``where`` prefixes the names in errors."""
    known = {f.name: f for f in fields(cls) if f.init}
    unknown = sorted(set(values) - set(known))
    if unknown:
        names = [f"{where}.{k}" for k in unknown] if where else unknown
        raise ValueError(f"unknown key(s) {names} in {where or cls.__name__}; known keys: {sorted(known)}")
    return cls(**{k: coerce(known[k], v, f"{where}.{k}" if where else k) for k, v in values.items()})


def describe(cls: type, prefix: str = "") -> Iterator[tuple[str, str, Any, str]]:
    """``(key, type, default, help)`` for every field of ``cls``, nested sections expanded
    (``prefix.section.field``): the generated help of every front end."""
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        default = default_of(f) if (f.default is not MISSING or f.default_factory is not MISSING) else None
        section = type(default) if isinstance(default, Section) else f.metadata.get("section")
        if section is not None:  # a nested section (or an optional one: metadata "section")
            if not isinstance(default, Section):
                yield key, "bool", default is not None, f.metadata.get("help", "")
            yield from describe(section, key + ".")
            continue
        kind = str(f.type).replace("'", "")
        yield key, kind, default, f.metadata.get("help", "")


def keyed_lines(values: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``section.key = value`` lines of a configuration (values as JSON), nested sections
    flattened and sorted: compared across ranks or with a checkpoint's, a mismatch names the
    keys that differ (:func:`differing_keys`; ``distnorm._collectives.assert_same_across_ranks``)."""
    lines = []
    for key, value in sorted(values.items()):
        if isinstance(value, Mapping) and value:
            lines += keyed_lines(value, f"{prefix}{key}.")
        else:
            lines.append(f"{prefix}{key} = {json.dumps(value, sort_keys=True, default=str)}")
    return lines


def differing_keys(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """The flattened keys whose values differ between two configurations: ``{key: (ours,
    theirs)}``, a missing key shown as ``(not set)``."""
    a = dict(line.split(" = ", 1) for line in keyed_lines(ours))
    b = dict(line.split(" = ", 1) for line in keyed_lines(theirs))
    return {k: (a.get(k, "(not set)"), b.get(k, "(not set)")) for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k)}
