"""Debug mode: extra checks that cost a host synchronisation, off by default.

Turned on by the environment variable ``DISTNORM_DEBUG=1`` (read at import) or at run time
with :func:`distnorm.debug`. When on, every synchronized layer

* sends every collective's frame header (:mod:`distnorm._frames`: each rank's layer, phase,
  channel count and dtype) ahead of it, alone, and compares it at once, on a GPU too: ranks
  that paired different layers raise :class:`~distnorm.errors.CollectiveMismatchError` at
  that collective (without debug mode a GPU finds it a few collectives later), and so do
  ranks whose frames would differ in width (they built layers of other widths), before the
  backend sees an all-reduce of two sizes;
* raises :class:`~distnorm.errors.NonFiniteStatisticsError` on NaN/Inf batch statistics;
* raises ``ValueError`` when a training batch has at most one value per channel globally.

Every check is evaluated on values that are identical on all ranks (results of the same
all-reduce), so when one rank raises, every rank raises: nobody is left in a collective.
"""

from __future__ import annotations

import os

__all__ = ["debug", "is_debug"]

_ENABLED = os.environ.get("DISTNORM_DEBUG", "0").strip().lower() not in ("", "0", "false", "no", "off")


def debug(enabled: bool | None = None) -> bool:
    """Query or set distnorm's debug mode.

    Args:
        enabled: ``True``/``False`` to switch debug mode on/off; ``None`` to only query.

    Returns:
        The previous setting (the current one when ``enabled`` is ``None``).

    Example:
        >>> import distnorm
        >>> previous = distnorm.debug(True)       # on; returns the earlier setting
        >>> distnorm.debug()                      # query
        True
        >>> distnorm.debug(previous)              # restore; returns the setting it replaces
        True
        >>> distnorm.debug() == previous
        True
    """
    global _ENABLED
    previous = _ENABLED
    if enabled is not None:
        _ENABLED = bool(enabled)
    return previous


def is_debug() -> bool:
    """Whether debug mode is on."""
    return _ENABLED
