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
"""

from __future__ import annotations

from torch import nn

import argparse

from distnorm.config import DistNormConfig, add_arguments
from distnorm.plugin import DistNormPlugin

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
