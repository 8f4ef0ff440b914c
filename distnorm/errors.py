"""Exceptions raised by distnorm.

Each names what went wrong and where (layer, buffer, rank), so a failing multi-node run
says what to fix instead of hanging or drifting.
"""

from __future__ import annotations

__all__ = [
    "DistNormError",
    "InconsistentStateError",
    "CollectiveMismatchError",
    "NonFiniteStatisticsError",
    "CollectiveFailedError",
]


class DistNormError(RuntimeError):
    """Base class of distnorm's runtime errors."""


class InconsistentStateError(DistNormError):
    """Buffers that must be bit-identical on every rank are not.

    Raised by :func:`distnorm.check_consistency`. ``mismatches`` maps each divergent
    buffer's qualified name to the groups of ranks that agree with one another.
    """

    def __init__(self, message: str, mismatches: dict[str, list[list[int]]] | None = None):
        super().__init__(message)
        self.mismatches = mismatches or {}


class CollectiveMismatchError(DistNormError):
    """Ranks paired a collective from different layers, phases, shapes or dtypes.

    Raised on every rank, naming each rank's layer, from the fingerprints every statistics
    all-reduce carries (:mod:`distnorm._frames`): at the collective on the CPU; on a GPU a few
    collectives later or at the next :func:`distnorm.check_consistency`. Debug mode
    (``DISTNORM_DEBUG=1``) checks before the payload instead, with a collective of its own.
    """


class NonFiniteStatisticsError(DistNormError, FloatingPointError):
    """A normalization layer produced NaN/Inf batch statistics (debug mode only)."""


class CollectiveFailedError(DistNormError):
    """A distnorm collective failed (a peer died, timed out or raised); names the layer and phase."""


class ConfigurationMismatchError(DistNormError, ValueError):
    """Ranks, or a checkpoint and this run, hold other distnorm configurations: the message
    names each key that differs and its values (a ``ValueError`` too: a refused value)."""
