"""Recognising models already wrapped by a data-parallel engine.

Model surgery (BNP attachment, normalization conversion) must happen before a model is
wrapped: DDP records the parameter list and its gradient buckets at construction, and
DeepSpeed / FSDP partition or flatten parameters, so parameters added or replaced afterwards
would silently not be synchronized or not be optimized.

PyTorch's own wrappers are registered here; an engine library's integration
(``distnorm.integrations.<library>``) registers that library's wrappers with
:func:`register_wrapper`, and is imported the first time a module of that library is met,
so the core never names an engine it does not ship with.

torch's FSDP is known here too, down to its parameters: :func:`fsdp_sharded` (one shard per
rank, left out of consistency checks) and :func:`fsdp_flat` (FSDP1's ``FlatParameter``).
Importing ``torch.distributed.fsdp`` (and DTensor with it) costs about 0.4 s of CPU, paid by
every process that imports distnorm if done here; a model cannot be wrapped by FSDP, nor hold
a DTensor, before the user's code has imported them, so both are looked up in
``sys.modules`` when needed instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import torch
from torch import nn

__all__ = ["register_wrapper", "refuse_wrapped", "wrapper_name", "fsdp_sharded", "fsdp_flat"]

_WRAPPERS: list[tuple[type, str]] = []
_LIBRARIES_SEEN: set[str] = {"torch", "builtins", "__main__"}


def register_wrapper(kind: type, label: str) -> None:
    """Treat instances of ``kind`` (and subclasses) as a wrapped model named ``label``."""
    if all(k is not kind for k, _ in _WRAPPERS):
        _WRAPPERS.append((kind, label))


register_wrapper(nn.parallel.DistributedDataParallel, "torch DistributedDataParallel")
register_wrapper(nn.DataParallel, "torch DataParallel")


def _register_torch_fsdp() -> None:
    """torch's FSDP wrappers, once the user's code has imported ``torch.distributed.fsdp``."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not hasattr(fsdp, "FullyShardedDataParallel"):  # not imported (or not yet whole)
        return
    register_wrapper(fsdp.FullyShardedDataParallel, "torch FSDP")
    if hasattr(fsdp, "FSDPModule"):  # fully_shard (FSDP2), torch >= 2.6
        register_wrapper(fsdp.FSDPModule, "torch FSDP (fully_shard)")


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


def _load_integration(module: nn.Module) -> None:
    """Import ``distnorm.integrations.<library>`` for the library ``module`` comes from, once,
    so that it has registered its wrappers."""
    library = type(module).__module__.partition(".")[0]
    if library in _LIBRARIES_SEEN:
        return
    _LIBRARIES_SEEN.add(library)
    name = f"distnorm.integrations.{library}"
    if importlib.util.find_spec(name) is not None:
        importlib.import_module(name)


def wrapper_name(model: nn.Module) -> str | None:
    """The engine that wraps ``model`` (or any of its submodules), or ``None``."""
    _register_torch_fsdp()
    for module in model.modules():
        _load_integration(module)
        for kind, label in _WRAPPERS:
            if isinstance(module, kind):
                return label
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
