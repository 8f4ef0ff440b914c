"""distnorm: synchronized CBN / POP-Norm / BatchNorm with AMAT, and BNP, for data-parallel PyTorch.

Quick start::

    import distnorm
    norm = distnorm.CBN(64)              # synchronized across ranks when distributed
    distnorm.set_lr(model, lr)           # AMAT follows the optimizer's learning rate
    distnorm.check_consistency(model)    # buffers are bit-identical on every rank

``import distnorm`` needs only torch; integrations are imported lazily.
"""

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
