"""distnorm: synchronized CBN / POP-Norm / BatchNorm with AMAT, and BNP, for data-parallel PyTorch.

Quick start::

    import distnorm
    norm = distnorm.CBN(64)              # synchronized across ranks when distributed
    distnorm.set_lr(model, lr)           # AMAT follows the optimizer's learning rate
    distnorm.check_consistency(model)    # buffers are bit-identical on every rank

``import distnorm`` needs only torch (>= 2.4); integrations are imported lazily.
"""

import re as _re

from torch import __version__ as _torch_version

#: The oldest torch distnorm runs on: ``torch.library.register_fake`` (the fake kernels of
#: the operators in ``distnorm._functions``, what ``torch.compile`` sees) came with 2.4.
_TORCH_FLOOR = (2, 4)


def _require_torch(version: str, floor: tuple[int, int] = _TORCH_FLOOR) -> None:
    """Refuse a torch older than ``floor``, with the ``pip install`` that fixes it.

    ``version`` is ``torch.__version__``: local and pre-release tags are ignored, so a
    2.4 nightly passes; a string without ``major.minor`` is let through (nothing to compare).

    >>> _require_torch("2.11.0+cu126")
    >>> _require_torch("2.3.1")
    Traceback (most recent call last):
    ImportError: distnorm needs torch>=2.4 (found 2.3.1): pip install 'torch>=2.4'
    """
    match = _re.match(r"(\d+)\.(\d+)", str(version))
    if match and (int(match[1]), int(match[2])) < floor:
        need = ".".join(map(str, floor))
        raise ImportError(f"distnorm needs torch>={need} (found {version}): pip install 'torch>={need}'")


_require_torch(_torch_version)

# After the check: on an older torch, distnorm._functions fails with an AttributeError instead.
from distnorm import bnp, functional
from distnorm._collectives import norm_group
from distnorm._debug import debug
from distnorm.config import DistNormConfig, add_arguments
from distnorm.consistency import check_consistency
from distnorm.convert import PreNorm, conversion_summary, convert, revert
from distnorm.errors import (
    CollectiveFailedError,
    CollectiveMismatchError,
    DistNormError,
    InconsistentStateError,
    NonFiniteStatisticsError,
)
from distnorm.layers import CBN, POPNorm, SyncBatchNorm, name_layers, set_lr
from distnorm.plugin import DistNormPlugin, ddp_kwargs
from distnorm.specs import BNPSpec, CBNSpec, GNSpec, POPNormSpec, SyncBNSpec

__version__ = "0.1.0"

__all__ = [
    "CBN",
    "POPNorm",
    "SyncBatchNorm",
    "set_lr",
    "name_layers",
    "check_consistency",
    "convert",
    "revert",
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
    "InconsistentStateError",
    "CollectiveMismatchError",
    "CollectiveFailedError",
    "NonFiniteStatisticsError",
]
