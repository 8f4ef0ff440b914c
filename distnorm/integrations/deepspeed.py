"""distnorm in a DeepSpeed script (ZeRO stages 0–3) — the whole change::

    import distnorm.integrations.deepspeed as dn                 # + import
    dn.add_arguments(parser)                                      # + 1: the --distnorm flags
    ...
    model = build_model()
    plugin = dn.prepare(model, args)                              # + 2: before the optimizer
    engine, optimizer, _, scheduler = deepspeed.initialize(args=args, model=model,
                                                           model_parameters=model.parameters())
    plugin.follow(engine)                                         # + 3

``prepare`` converts the bare model (and attaches BNP) before DeepSpeed partitions or
flattens its parameters. ``follow(engine)`` makes AMAT read ``engine.get_lr()`` before every
training forward — whatever scheduler the JSON config defines, warm-up included — and,
because DeepSpeed does not broadcast buffers at initialisation and ZeRO-3 checkpoints keep
one copy of the buffers per rank, broadcasts distnorm's buffers from rank 0 now and after
every ``engine.load_checkpoint``, then verifies them. The plugin's own state is saved in the
checkpoint's ``client_state["distnorm"]``.

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
from typing import Any, Callable

from torch import nn

from distnorm._wrappers import register_wrapper
from distnorm.config import DistNormConfig, add_arguments
from distnorm.consistency import register_partitioned
from distnorm.plugin import DistNormPlugin, register_engine

__all__ = ["prepare", "add_arguments"]


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


def _follow_engine(plugin: DistNormPlugin, engine: Any) -> Callable[[], list[float]]:
    """AMAT reads ``engine.get_lr()[0]`` (ZeRO flattens the parameter groups); the plugin's
    state travels in DeepSpeed's checkpoints; the periodic check also compares the engine's
    optimizer state where it is replicated (ZeRO-0: the client optimizer itself)."""
    _carry_state_in_checkpoints(plugin, engine)
    plugin.optimizer = getattr(engine, "optimizer", None)
    return lambda: [engine.get_lr()[0]] * len(plugin.amat_layers)


def _zero3_partitioned(param: Any) -> bool:
    """A ZeRO-3 parameter that lives as one shard per rank. Persistent ones (small
    parameters ZeRO-3 keeps whole on every rank, ``ds_persist``) are replicated and are
    compared. Both attributes are set alike on every rank when the engine partitions the
    model, whatever is gathered at the moment of a check."""
    return hasattr(param, "ds_id") and not getattr(param, "ds_persist", False)


def _carry_state_in_checkpoints(plugin: DistNormPlugin, engine: Any) -> None:
    """Carry the plugin state in DeepSpeed's ``client_state`` and re-synchronize the
    buffers after every load (ZeRO-3 checkpoints keep one copy per rank)."""
    if getattr(engine, "_distnorm_wrapped", False):
        return
    save, load = engine.save_checkpoint, engine.load_checkpoint

    def save_checkpoint(save_dir, tag=None, client_state=None, *args, **kwargs):
        client_state = dict(client_state or {})
        client_state["distnorm"] = plugin.state_dict()
        return save(save_dir, tag, client_state, *args, **kwargs)

    def load_checkpoint(load_dir, tag=None, *args, **kwargs):
        path, client_state = load(load_dir, tag, *args, **kwargs)
        if client_state and "distnorm" in client_state:
            plugin.load_state_dict(client_state.pop("distnorm"))
        if path is not None:
            plugin.resync_now()  # every rank loads together: synchronize right here
        return path, client_state

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint
    engine._distnorm_wrapped = True


try:
    from deepspeed import DeepSpeedEngine
except ImportError:  # prepare() says what to install
    pass
else:
    register_engine(DeepSpeedEngine, _follow_engine)
    register_partitioned(_zero3_partitioned)
    register_wrapper(DeepSpeedEngine, "DeepSpeed")  # PipelineEngine is a DeepSpeedEngine
