"""Recognising models already wrapped by a data-parallel engine.

Model surgery (BNP attachment, normalization conversion) must happen before a model is
wrapped: DDP records the parameter list and its gradient buckets at construction, and
sharding engines partition or flatten parameters, so parameters added or replaced afterwards
would silently not be synchronized or not be optimized.

Which types wrap a model is each engine's own fact, registered once with the rest of what
distnorm knows about it (:class:`distnorm._engines.Engine`); this module only asks.
"""

from __future__ import annotations

from torch import nn

from distnorm._engines import engine_of

__all__ = ["refuse_wrapped", "wrapper_name"]


def wrapper_name(model: nn.Module) -> str | None:
    """The engine that wraps ``model`` (or any of its submodules), or ``None``."""
    for module in model.modules():
        engine = engine_of(module)
        if engine is not None:
            return engine.name
    return None


def refuse_wrapped(model: nn.Module, action: str) -> None:
    """Raise ``TypeError`` if ``model`` is wrapped by a registered engine (DDP, FSDP, ...)."""
    engine = wrapper_name(model)
    if engine is not None:
        raise TypeError(
            f"{action} needs the bare model, but it is already wrapped by {engine}. "
            f"Apply it to the model before wrapping (before DistributedDataParallel(...) or the "
            f"engine's own prepare / initialize call), and build the optimizer after it."
        )
