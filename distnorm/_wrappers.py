"""Recognising models already wrapped by a data-parallel engine.

Model surgery (BNP attachment, normalization conversion) must happen before a model is
wrapped: DDP records the parameter list and its gradient buckets at construction, and
DeepSpeed / FSDP partition or flatten parameters, so parameters added or replaced afterwards
would silently not be synchronized or not be optimized.
"""

from __future__ import annotations

from torch import nn

__all__ = ["wrapper_name", "refuse_wrapped"]

# Matched by class name so that detecting them never imports the (optional) engines.
_WRAPPERS = {
    "DistributedDataParallel": "torch DistributedDataParallel",
    "DataParallel": "torch DataParallel",
    "FullyShardedDataParallel": "torch FSDP",
    "DeepSpeedEngine": "DeepSpeed",
    "PipelineEngine": "DeepSpeed",
}


def wrapper_name(model: nn.Module) -> str | None:
    """The engine that wraps ``model`` (or any of its submodules), or ``None``."""
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls.__name__ in _WRAPPERS:
                return _WRAPPERS[cls.__name__]
    return None


def refuse_wrapped(model: nn.Module, action: str) -> None:
    """Raise ``TypeError`` if ``model`` is wrapped by DDP / FSDP / DeepSpeed."""
    engine = wrapper_name(model)
    if engine is not None:
        raise TypeError(
            f"{action} needs the bare model, but it is already wrapped by {engine}. "
            f"Apply it to the model before wrapping (before DistributedDataParallel(...), "
            f"accelerator.prepare(...) or deepspeed.initialize(...)), and build the optimizer "
            f"after it."
        )
