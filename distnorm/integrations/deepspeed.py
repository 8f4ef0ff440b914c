"""distnorm in a DeepSpeed script (ZeRO stages 0–3) — the whole change::

    import distnorm.integrations.deepspeed as dn                 # + import
    dn.add_arguments(parser)                                      # + 1: the --distnorm flags
    ...
    model = build_model()
    plugin = dn.prepare(model, args)                              # + 2: before the optimizer
    engine, optimizer, _, scheduler = deepspeed.initialize(args=args, model=model,
                                                           model_parameters=model.parameters())
    plugin.follow(engine)                                         # + 3
    ...
    engine.save_checkpoint(save_dir, client_state=dn.client_state(plugin))   # + 4: where it saves
    ...
    _, client_state = engine.load_checkpoint(load_dir)
    dn.restore(plugin, client_state)                              # + 5: where it loads

``prepare`` converts the bare model (and attaches BNP) before DeepSpeed partitions or
flattens its parameters. ``follow(engine)`` makes AMAT read ``engine.get_lr()`` before every
training forward — whatever scheduler the JSON config defines, warm-up included — and,
because DeepSpeed does not broadcast buffers at initialisation, broadcasts distnorm's
buffers from rank 0 now, then verifies them.

Checkpoints go through DeepSpeed's own hook for a script's state, ``client_state``:
:func:`client_state` adds the plugin's state (its configuration, the training-forward count)
under ``"distnorm"`` to the script's own entries, and :func:`restore` reads it back from the
``client_state`` that ``engine.load_checkpoint`` returns — refusing a checkpoint written with
another distnorm configuration — and, because ZeRO-3 checkpoints keep one copy of the
buffers per rank, broadcasts the buffers from rank 0 and verifies them right there (every
rank loads together). The buffers themselves (AMAT's and BNP's statistics) travel with the
module's state, as every buffer does.

Without the plugin, a model built from distnorm's layers (or :func:`distnorm.convert`-ed,
with :func:`distnorm.bnp.attach`) given straight to ``deepspeed.initialize`` trains exactly
as well: call ``distnorm.set_lr(engine, engine.get_lr()[0])`` before each step for AMAT.
What the plugin adds is that learning rate, the buffer broadcast after checkpoint loads, the
periodic consistency check and the configuration flags — no numerical difference.

Comparing with a plain PyTorch loop: DeepSpeed 0.19 clips the global gradient norm to 1.0
unless the JSON config sets ``"gradient_clipping"`` (``0`` turns it off); a plain loop
does not clip. Set it to ``0``, or clip the reference with
``torch.nn.utils.clip_grad_norm_(params, 1.0)``, before expecting the two to agree.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

from torch import nn

from distnorm._engines import Engine, register_engine
from distnorm.config import DistNormConfig, add_arguments
from distnorm.plugin import DistNormPlugin

__all__ = ["prepare", "add_arguments", "client_state", "restore", "extensions_dir", "ENGINE"]

logger = logging.getLogger(__name__)

#: The key of the plugin's state in DeepSpeed's ``client_state``.
STATE_KEY = "distnorm"


def extensions_dir() -> str | None:
    """This venv's own directory for the ops DeepSpeed builds on first use (its CPU
    shared-memory op), or None outside a venv.

    torch puts them in ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``,
    which every venv of a user shares, so two venvs rebuild the op for each other (about a
    minute each time). One directory per venv *path as this interpreter sees it*: the build
    command names the venv's include directories by that path, so two paths to one venv (a
    symlink) must not share a directory either."""
    if sys.prefix == sys.base_prefix:
        return None
    seen_as = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    return str(Path(sys.prefix) / "torch_extensions" / seen_as)


# At import, before DeepSpeed builds anything: every script that uses this integration (the
# examples, distnorm-train's workers on every node) builds in its venv; a value you set wins.
if extensions_dir() is not None:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())


def prepare(model: nn.Module, config: DistNormConfig | argparse.Namespace | None = None) -> DistNormPlugin:
    """Convert ``model`` and return the plugin; call it on the bare model, before building
    the optimizer and before ``deepspeed.initialize``. ``config`` may be the namespace of a
    parser that went through :func:`add_arguments`."""
    try:
        import deepspeed  # noqa: F401  - fail here, with the extra to install, not mid-run
    except ImportError as err:
        raise ImportError("distnorm's DeepSpeed integration needs `pip install distnorm[deepspeed]`") from err
    if isinstance(config, argparse.Namespace):
        config = DistNormConfig.from_args(config)
    return DistNormPlugin(model, config)


def client_state(plugin: DistNormPlugin, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``client_state`` to give ``engine.save_checkpoint``: the script's own ``state``
    and the plugin's under ``"distnorm"`` (nothing added when distnorm is off).

    Example::

        engine.save_checkpoint(save_dir, client_state=dn.client_state(plugin, {"epoch": epoch}))
    """
    state = dict(state or {})
    if not plugin.config.active:
        return state  # off is off: no checkpoint entry
    if STATE_KEY in state:
        raise ValueError(f"client_state already has a {STATE_KEY!r} entry: distnorm keeps its state under that key; "
                         "rename the script's entry")
    state[STATE_KEY] = plugin.state_dict()
    return state


def restore(plugin: DistNormPlugin, client_state: dict[str, Any] | None) -> dict[str, Any] | None:
    """Read the plugin's state from what ``engine.load_checkpoint`` returned, broadcast and
    verify the buffers (collective: every rank calls it right after the load), and return the
    script's own entries. ``None`` (DeepSpeed found no checkpoint) is returned as it is.

    Raises:
        ValueError: the checkpoint was written with another distnorm configuration.
    """
    if client_state is None or not plugin.config.active:
        return client_state
    rest = dict(client_state)
    saved = rest.pop(STATE_KEY, None)
    if saved is not None:
        plugin.load_state_dict(saved)
    else:
        logger.warning("distnorm: the checkpoint holds no distnorm state (saved without dn.client_state(plugin)); "
                       "its configuration cannot be compared with this run's")
    plugin.resync_now()  # ZeRO-3 loads one copy of the buffers per rank: make them one again
    return rest


def _follow_engine(plugin: DistNormPlugin, engine: Any) -> Callable[[], list[float]]:
    """AMAT reads ``engine.get_lr()[0]`` (ZeRO flattens the parameter groups); the periodic
    check also compares the engine's optimizer state where it is replicated (ZeRO-0: the
    client optimizer itself)."""
    plugin.optimizer = getattr(engine, "optimizer", None)
    return lambda: [engine.get_lr()[0]] * len(plugin.amat_layers)


def _zero3_partitioned(param: Any) -> bool:
    """A ZeRO-3 parameter that lives as one shard per rank. Persistent ones (small
    parameters ZeRO-3 keeps whole on every rank, ``ds_persist``) are replicated and are
    compared. Both attributes are set alike on every rank when the engine partitions the
    model, whatever is gathered at the moment of a check."""
    return hasattr(param, "ds_id") and not getattr(param, "ds_persist", False)


def _engine_types() -> tuple[type, ...]:
    """``DeepSpeedEngine`` (``PipelineEngine`` is one), once the script has imported DeepSpeed:
    no engine exists before, and importing this module stays free of DeepSpeed."""
    engine = getattr(sys.modules.get("deepspeed"), "DeepSpeedEngine", None)
    return (engine,) if engine is not None else ()


#: Everything distnorm knows about DeepSpeed, registered once.
ENGINE = register_engine(Engine(
    name="DeepSpeed",
    library="deepspeed",
    wrappers=_engine_types,
    follow=_follow_engine,
    partitioned=_zero3_partitioned,
))
