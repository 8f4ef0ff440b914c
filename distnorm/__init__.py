"""distnorm: synchronized CBN / POP-Norm / BatchNorm with AMAT, and BNP, for data-parallel PyTorch.

Quick start::

    import distnorm
    norm = distnorm.CBN(64)              # synchronized across ranks when distributed
    distnorm.set_lr(model, lr)           # AMAT follows the optimizer's learning rate
    distnorm.check_consistency(model)    # buffers are bit-identical on every rank

``import distnorm`` checks the installed torch (>= 2.4) without importing it; each name
loads its module, and torch, at first use, so the recipe's command line checks a
configuration without torch (:mod:`distnorm.train.checks`). Where torch is already imported,
``import distnorm`` registers the operators (``torch.ops.distnorm.*``) at once. Integrations
are imported lazily too.
"""

import importlib as _importlib
import importlib.util as _importlib_util
import sys as _sys
import types as _types
from typing import TYPE_CHECKING as _TYPE_CHECKING, Any as _Any

from distnorm._torch_floor import require_torch as _require_torch, torch_version as _torch_version

_require_torch(_torch_version())

# The public names, imported at first use (PEP 562): ``import distnorm`` loads no torch, so the
# recipe's command line checks a configuration (``distnorm-train --check``, a refused key) in a
# tenth of a second instead of the second or more that ``import torch`` costs every process.
_EXPORTS = {
    "bnp": None, "functional": None,  # submodules
    "norm_group": "_collectives",
    "debug": "_debug",
    "DistNormConfig": "config", "add_arguments": "config",
    "check_consistency": "consistency",
    "PreNorm": "convert", "conversion_summary": "convert", "convert": "convert", "revert": "convert",
    "CollectiveFailedError": "errors", "CollectiveMismatchError": "errors", "ConfigurationMismatchError": "errors",
    "DistNormError": "errors",
    "InconsistentStateError": "errors", "NonFiniteStatisticsError": "errors",
    "CBN": "layers", "GroupNorm": "layers", "POPNorm": "layers", "SyncBatchNorm": "layers", "name_layers": "layers", "set_lr": "layers",
    "DistNormPlugin": "plugin", "ddp_kwargs": "plugin",
    "freeze": "serving",
    "BNPSpec": "specs", "CBNSpec": "specs", "GNSpec": "specs", "POPNormSpec": "specs", "SyncBNSpec": "specs",
}


def __getattr__(name: str) -> _Any:
    if name in _EXPORTS:
        module = _EXPORTS[name]
        value = _importlib.import_module(f"distnorm.{module or name}")
        if module is not None:
            value = getattr(value, name)
        globals()[name] = value  # once: later reads skip this function
        return value
    if not name.startswith("_") and _importlib_util.find_spec(f"distnorm.{name}") is not None:
        return _importlib.import_module(f"distnorm.{name}")  # a submodule (distnorm.specs, .layers, ...)
    raise AttributeError(f"module 'distnorm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(_types.ModuleType):
    """``distnorm.convert`` is the function, also once its submodule is imported.

    Importing a submodule sets it as an attribute of its package, so any ``from
    distnorm.convert import ...`` (``distnorm.plugin`` has one) would otherwise leave the
    module where ``distnorm.convert(model)`` expects the function.
    """

    def __setattr__(self, name: str, value: _Any) -> None:
        if name == "convert" and isinstance(value, _types.ModuleType):
            value = value.convert
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package

if _sys.modules.get("torch") is not None:
    # torch is loaded anyway: register distnorm's operators (torch.ops.distnorm.*) now, as a
    # program compiled or exported with them, loaded after `import distnorm`, expects. (Where
    # distnorm is imported first, the first use of a layer or of distnorm.functional does it.)
    _importlib.import_module("distnorm._ops")


if _TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from distnorm import bnp, functional
    from distnorm._collectives import norm_group
    from distnorm._debug import debug
    from distnorm.config import DistNormConfig, add_arguments
    from distnorm.consistency import check_consistency
    from distnorm.convert import PreNorm, conversion_summary, convert, revert
    from distnorm.errors import (
        CollectiveFailedError,
        CollectiveMismatchError,
        ConfigurationMismatchError,
        DistNormError,
        InconsistentStateError,
        NonFiniteStatisticsError,
    )
    from distnorm.layers import CBN, GroupNorm, POPNorm, SyncBatchNorm, name_layers, set_lr
    from distnorm.plugin import DistNormPlugin, ddp_kwargs
    from distnorm.serving import freeze
    from distnorm.specs import BNPSpec, CBNSpec, GNSpec, POPNormSpec, SyncBNSpec

__version__ = "0.1.0"

__all__ = [
    "CBN",
    "POPNorm",
    "GroupNorm",
    "SyncBatchNorm",
    "set_lr",
    "name_layers",
    "check_consistency",
    "convert",
    "revert",
    "freeze",
    "conversion_summary",
    "PreNorm",
    "DistNormConfig",
    "CBNSpec",
    "POPNormSpec",
    "SyncBNSpec",
    "GNSpec",
    "BNPSpec",
    "DistNormPlugin",
    "add_arguments",
    "ddp_kwargs",
    "norm_group",
    "debug",
    "functional",
    "bnp",
    "DistNormError",
    "ConfigurationMismatchError",
    "InconsistentStateError",
    "CollectiveMismatchError",
    "CollectiveFailedError",
    "NonFiniteStatisticsError",
]
