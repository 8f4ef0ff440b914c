"""The oldest torch distnorm runs on, checked without importing torch.

``import distnorm`` checks the installed torch's metadata (:func:`torch_version`); the
operators' module (:mod:`distnorm._ops`) checks the torch it really imports, before it
declares anything. No torch import here: the command line's configuration check runs
without it.
"""

from __future__ import annotations

import re as _re
import sys as _sys

__all__ = ["TORCH_FLOOR", "require_torch", "torch_version"]

#: The oldest torch distnorm runs on: ``torch.library.register_fake`` (the fake kernels of
#: the operators in ``distnorm._ops``) came with 2.4.
TORCH_FLOOR = (2, 4)


def require_torch(version: str, floor: tuple[int, int] = TORCH_FLOOR) -> None:
    """Refuse a torch older than ``floor``, with the ``pip install`` that fixes it.

    ``version`` is ``torch.__version__``: local and pre-release tags are ignored, so a
    2.4 nightly passes; a string without ``major.minor`` is let through (nothing to compare).

    >>> require_torch("2.11.0+cu126")
    >>> require_torch("2.3.1")
    Traceback (most recent call last):
    ImportError: distnorm needs torch>=2.4 (found 2.3.1): pip install 'torch>=2.4'
    """
    match = _re.match(r"(\d+)\.(\d+)", str(version))
    if match and (int(match[1]), int(match[2])) < floor:
        need = ".".join(map(str, floor))
        raise ImportError(f"distnorm needs torch>={need} (found {version}): pip install 'torch>={need}'")


def torch_version() -> str:
    """The installed torch's version, without importing it (its distribution metadata; a torch
    already imported answers for itself). ``""`` where neither says: nothing to compare, and
    :mod:`distnorm._ops` checks the torch it imports, before any operator is declared."""
    torch = _sys.modules.get("torch")
    if torch is not None:
        return str(torch.__version__)
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:  # not installed, or not as a distribution: the import says
        return ""
