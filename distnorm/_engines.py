"""One registration per training engine: everything the core must know about it, in one object.

The core (:mod:`distnorm.plugin`, :mod:`distnorm.consistency`, :mod:`distnorm._wrappers`)
names no engine library. What differs between engines is written once, in the engine's
integration module (``distnorm/integrations/<library>.py``), as one :class:`Engine` it
registers with :func:`register_engine` when imported:

* ``wrappers`` — the types that wrap a model (model surgery refuses them: parameters added
  after wrapping would be neither synchronized nor optimized);
* ``follow`` — how :meth:`DistNormPlugin.follow` reads the learning rate from such an engine;
* ``partitioned`` — which parameters the engine keeps as one shard per rank (left out of
  :func:`distnorm.check_consistency`, which compares replicated state only).

How the plugin's state rides in an engine's own checkpoints is the integration's own code
(its module's functions, called by the script or the engine's hook); the core never calls it.

An integration is found by its library's name, as a trainer's strategy registry finds a strategy by its
name: an object whose class comes from library ``L`` makes the registry import
``distnorm.integrations.L`` once, if such a module exists, so a script that never imported
the integration is covered too. Parameters carry no library, so before selecting replicated
parameters the registry imports the integration of every library the script has imported
(:func:`partition_tests`). Nothing here imports an engine: ``import distnorm`` needs only torch.

torch's own wrappers (DDP, DataParallel, FSDP) are registered here, as engines of library
``torch``. Importing ``torch.distributed.fsdp`` (and DTensor with it) costs about 0.4 s of CPU,
paid by every process that imports distnorm if done here; a model cannot be wrapped by FSDP,
nor hold a DTensor, before the user's code has imported them, so both are looked up in
``sys.modules`` when needed instead.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

import torch
from torch import nn

__all__ = ["Engine", "register_engine", "engines", "engine_of", "partition_tests", "fsdp_sharded", "fsdp_flat"]

logger = logging.getLogger(__name__)

#: The integration modules shipped with distnorm, by the library each one integrates.
_INTEGRATIONS = frozenset(m.name for m in pkgutil.iter_modules([str(Path(__file__).with_name("integrations"))])
                          if not m.name.startswith("_"))

Types = Union[tuple[type, ...], Callable[[], tuple[type, ...]]]


@dataclass(frozen=True)
class Engine:
    """What distnorm needs to know about one training engine.

    Attributes:
        name: shown to the user ("already wrapped by {name}").
        library: the top-level package its classes come from (``type(x).__module__``'s first
            part); the integration module carries the same name.
        wrappers: types whose instances wrap a model, or a function returning them (for types
            that only exist once the user imported their module).
        follow: ``follow(plugin, engine) -> lrs``: for an instance of ``wrappers`` given to
            :meth:`DistNormPlugin.follow`, a function returning each AMAT layer's learning
            rate; it may also set ``plugin.optimizer`` (the state the periodic check compares).
        partitioned: ``partitioned(parameter) -> bool``: true for a parameter the engine keeps
            as one shard per rank. Must give the same answer on every rank.
    """

    name: str
    library: str
    wrappers: Types = ()
    follow: Callable[[Any, Any], Callable[[], list[Any]]] | None = None
    partitioned: Callable[[torch.Tensor], bool] | None = None

    def wrapper_types(self) -> tuple[type, ...]:
        """The wrapper types known now (a function's answer may grow once a module is imported)."""
        return self.wrappers() if callable(self.wrappers) else self.wrappers


_ENGINES: dict[str, Engine] = {}
_LIBRARIES_SEEN: set[str] = {"torch", "builtins", "__main__", "distnorm"}


def register_engine(engine: Engine) -> Engine:
    """Register ``engine`` (an integration calls it once, when imported); returns it. The
    integration's module imported again (``importlib.reload``) replaces its registration.

    Raises:
        ValueError: an engine of another library holds the name already.
    """
    known = _ENGINES.get(engine.name)
    if known is not None and known.library != engine.library:
        raise ValueError(f"the engine name {engine.name!r} is taken by library {known.library!r}")
    _ENGINES[engine.name] = engine
    return engine


def engines() -> tuple[Engine, ...]:
    """Every registered engine, in registration order."""
    return tuple(_ENGINES.values())


def _load_integration(library: str) -> None:
    """Import ``distnorm.integrations.<library>`` once, if distnorm ships one, so that it has
    registered its engine. An integration whose engine is not installed registers nothing."""
    if library in _LIBRARIES_SEEN:
        return
    _LIBRARIES_SEEN.add(library)
    if library in _INTEGRATIONS:
        try:
            importlib.import_module(f"distnorm.integrations.{library}")
        except ImportError as err:  # the extra is missing: nothing of this engine can be met
            logger.debug("distnorm: integration %s not loaded: %s", library, err)


def engine_of(obj: Any) -> Engine | None:
    """The engine whose wrapper types ``obj`` is an instance of, or ``None``. The
    integration of ``obj``'s library is imported first."""
    _load_integration(type(obj).__module__.partition(".")[0])
    return next((e for e in _ENGINES.values() if isinstance(obj, e.wrapper_types())), None)


def partition_tests() -> list[Callable[[torch.Tensor], bool]]:
    """Every registered test of a partitioned parameter, the integrations of every engine
    library the script has imported loaded first (a parameter does not say which engine
    partitioned it)."""
    for library in _INTEGRATIONS & sys.modules.keys():
        _load_integration(library)
    return [e.partitioned for e in _ENGINES.values() if e.partitioned is not None]


# ------------------------------------------------------------------- torch's own engines
def _is_dtensor(tensor: torch.Tensor) -> bool:
    """``isinstance(tensor, DTensor)`` without importing DTensor (public since torch 2.5)."""
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        dtensor = getattr(sys.modules.get(name), "DTensor", None)
        if dtensor is not None and isinstance(tensor, dtensor):
            return True
    return False


def fsdp_sharded(param: torch.Tensor) -> bool:
    """A parameter torch's FSDP manages: one shard per rank (FSDP1 marks every parameter it
    flattens, ``use_orig_params`` or not; ``fully_shard`` makes them DTensors). The same
    answer on every rank, whatever is gathered at the moment."""
    return bool(getattr(param, "_fsdp_flattened", False)) or _is_dtensor(param)


def fsdp_flat(param: torch.Tensor) -> bool:
    """A ``FlatParameter`` of FSDP1 without ``use_orig_params``: many layers' parameters in one."""
    return bool(getattr(param, "_is_flat_param", False))


def _fsdp(*names: str) -> Callable[[], tuple[type, ...]]:
    """The classes ``names`` of ``torch.distributed.fsdp``, once the user's code has imported
    it (none before; ``FSDPModule``, of ``fully_shard``, exists from torch 2.6)."""

    def types() -> tuple[type, ...]:
        fsdp = sys.modules.get("torch.distributed.fsdp")
        if fsdp is None or not hasattr(fsdp, "FullyShardedDataParallel"):  # not imported (or not yet whole)
            return ()
        return tuple(getattr(fsdp, n) for n in names if hasattr(fsdp, n))

    return types


register_engine(Engine("torch DistributedDataParallel", "torch", (nn.parallel.DistributedDataParallel,)))
register_engine(Engine("torch DataParallel", "torch", (nn.DataParallel,)))
register_engine(Engine("torch FSDP", "torch", _fsdp("FullyShardedDataParallel"), partitioned=fsdp_sharded))
register_engine(Engine("torch FSDP (fully_shard)", "torch", _fsdp("FSDPModule")))  # its DTensors: fsdp_sharded
