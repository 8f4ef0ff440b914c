"""distnorm in a Hugging Face Accelerate script — the whole change::

    import distnorm.integrations.accelerate as dn                # + import
    dn.add_arguments(parser)                                      # + 1: the --distnorm flags
    ...
    accelerator = Accelerator()
    model = build_model()
    plugin = dn.prepare(model, args, accelerator)                 # + 2: before the optimizer
    optimizer, loader, scheduler = build_rest(model)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    plugin.follow(optimizer)                                      # + 3

``prepare`` converts the bare model (and attaches BNP) per ``cfg``, makes Accelerate build
DDP with ``broadcast_buffers=False`` (distnorm's buffers are identical on every rank by
construction, so DDP's per-step buffer broadcast is pure cost) — unless BatchNorms with
per-rank running statistics remain unconverted (BNP alone on a BN model), in which case the
broadcast stays on and a warning says why — and registers the plugin with Accelerate's own
checkpoint hook, ``accelerator.register_for_checkpointing``, so ``save_state`` / ``load_state``
carry its state (the model's buffers, AMAT's and BNP's statistics, travel with the model);
after a load the buffers are broadcast and verified at the first training forward. ``follow(optimizer)`` makes AMAT read the
learning rate the optimizer applies at each step. Without ``--distnorm`` and BNP, the plugin
lines change nothing at all (no conversion, no DDP setting, no hook, no checkpoint entry).

On CPU, Accelerate selects MULTI_CPU only with ``Accelerator(cpu=True)`` (or ``--cpu``);
without it every ``torchrun`` rank silently trains alone.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from torch import nn

from distnorm._engines import Engine, register_engine
from distnorm.config import DistNormConfig, add_arguments
from distnorm.plugin import DistNormPlugin, buffer_broadcast_needed

__all__ = ["prepare", "add_arguments", "ENGINE"]

logger = logging.getLogger(__name__)


def _accelerate():
    try:
        import accelerate
    except ImportError as err:
        raise ImportError("distnorm's Accelerate integration needs `pip install distnorm[accelerate]`") from err
    return accelerate


def prepare(model: nn.Module, config: DistNormConfig | argparse.Namespace | None, accelerator: Any) -> DistNormPlugin:
    """Convert ``model`` for ``accelerator`` and return the plugin.

    Call it on the bare model, before building the optimizer (conversion adds parameters)
    and before ``accelerator.prepare``. ``config`` may be the namespace of a parser that
    went through :func:`add_arguments`.
    """
    accelerate = _accelerate()
    if not isinstance(accelerator, accelerate.Accelerator):
        raise TypeError(f"prepare(): expected an accelerate.Accelerator, got {type(accelerator).__name__}")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes == 1:
        raise RuntimeError(
            f"the launcher started {launched} processes but Accelerate runs this one alone "
            f"(distributed type {accelerator.distributed_type}); on CPU pass Accelerator(cpu=True) / --cpu, "
            "otherwise every rank would train its own model with unsynchronized statistics"
        )
    if isinstance(config, argparse.Namespace):
        config = DistNormConfig.from_args(config)
    plugin = DistNormPlugin(model, config)
    if not plugin.config.active:
        return plugin  # off is off: nothing converted, DDP and checkpoints untouched
    keep_broadcast = buffer_broadcast_needed(plugin)
    handler = accelerator.ddp_handler
    if keep_broadcast is not None:
        logger.warning("distnorm: DDP keeps broadcasting buffers every forward: %s", keep_broadcast)
    elif handler is None:
        accelerator.ddp_handler = accelerate.utils.DistributedDataParallelKwargs(broadcast_buffers=False)
    elif handler.broadcast_buffers:
        logger.info("distnorm: turning off DDP broadcast_buffers (buffers are rank-consistent by construction)")
        handler.broadcast_buffers = False
    _carry_in_checkpoints(plugin, accelerator)
    return plugin


def _carry_in_checkpoints(plugin: DistNormPlugin, accelerator: Any) -> None:
    """Accelerate's own hook: ``save_state`` stores ``plugin.state_dict()`` and ``load_state``
    calls ``plugin.load_state_dict()``, which compares the configuration and has the buffers
    broadcast and verified at the next training forward."""
    accelerator.register_for_checkpointing(plugin)


#: Everything distnorm knows about Accelerate, registered once. Accelerate wraps the model in
#: torch's DDP / FSDP or DeepSpeed's engine (registered by their own owners), and its optimizer
#: wrapper has the ``param_groups`` the plugin follows; what is Accelerate's own is the
#: checkpoint hook.
ENGINE = register_engine(Engine(name="Accelerate", library="accelerate"))
