"""The plugin: distnorm in an existing training script, whatever engine runs it.

:class:`DistNormPlugin` owns everything distnorm adds to a run:

1. at construction, on the bare model: :func:`distnorm.convert` (norm, activation) and
   optionally :func:`distnorm.bnp.attach`, with the synchronization group of the config;
2. :meth:`follow` — where AMAT reads the learning rate the optimizer applies at each step
   (an optimizer's ``param_groups``, a training engine its integration registered, or any
   callable); it also broadcasts distnorm's buffers from the group's first rank and
   verifies them (not every engine broadcasts buffers at initialisation);
3. a forward pre-hook on the model that, before every training forward, hands AMAT the
   learning rate, re-synchronizes buffers after a checkpoint load, and every
   ``check_every`` training forwards runs :func:`distnorm.check_consistency` over the
   buffers, the replicated parameters and the followed optimizer's replicated state, which
   raises :class:`~distnorm.InconsistentStateError` naming the divergent tensor instead of
   letting a run drift;
4. ``state_dict()`` / ``load_state_dict()`` for the engines' checkpointing.

Nothing here names an engine: what differs between engines (which types wrap a model, how
``follow`` reads one, which parameters it partitions) is one
:class:`~distnorm._engines.Engine` per engine, registered by its module under
:mod:`distnorm.integrations`, whose functions also carry the plugin's state in the engine's
own checkpoints.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.parallel import DistributedDataParallel

from distnorm import _collectives
from distnorm._collectives import assert_same_across_ranks
from distnorm.errors import ConfigurationMismatchError
from distnorm.settings import differing_keys
from distnorm._engines import engine_of, engines, fsdp_flat
from distnorm.config import DistNormConfig
from distnorm.consistency import check_consistency, consistent_tensors
from distnorm.convert import convert
from distnorm.layers import _CompleteNorm, _DistNormLayer, set_lrs

__all__ = ["DistNormPlugin", "ddp_kwargs", "buffer_broadcast_needed", "unsynchronized_running_stats"]

logger = logging.getLogger(__name__)


def ddp_kwargs() -> dict[str, bool]:
    """``DistributedDataParallel`` keyword arguments that skip the per-forward buffer
    broadcast (distnorm's buffers are identical on every rank by construction):
    ``forward_sync_buffers=False`` where this torch has it, else ``broadcast_buffers=False``.

    Example:
        >>> import inspect, torch, distnorm
        >>> kwargs = distnorm.ddp_kwargs()   # {'forward_sync_buffers': False} on torch 2.14
        >>> set(kwargs) <= set(inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters)
        True
        >>> any(kwargs.values())             # every buffer broadcast switched off
        False
    """
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def _subgroup(size: int, timeout_s: float | None = None) -> Any:
    """This rank's group of ``size`` consecutive ranks (created collectively on every rank)."""
    if not _collectives.is_distributed():
        raise RuntimeError(
            "distnorm: sync_group_size needs torch.distributed to be initialised before the plugin is "
            "created (init_process_group(), or the engine's own initialisation)"
        )
    world = dist.get_world_size()
    if world % size:
        raise ValueError(f"distnorm: sync_group_size={size} does not divide the world size {world}")
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    group, _ = dist.new_subgroups(group_size=size, timeout=timeout)
    return group


def unsynchronized_running_stats(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` whose running statistics are computed per rank
    (``torch.nn`` BatchNorm / InstanceNorm with ``track_running_stats`` that distnorm did
    not convert): their buffers drift apart unless DDP broadcasts buffers."""
    return [name for name, m in model.named_modules()
            if isinstance(m, _NormBase) and not isinstance(m, _DistNormLayer) and m.track_running_stats]


def buffer_broadcast_needed(plugin: "DistNormPlugin") -> str | None:
    """Why DDP's per-forward buffer broadcast must stay on for this plugin's model, or ``None``
    when it is pure cost (every buffer with running statistics is distnorm's, identical on
    every rank by construction)."""
    if not plugin.config.active:
        return "distnorm is off (no --distnorm / BNP): the script runs exactly as without the plugin"
    if plugin.local_running_stats:
        names = plugin.local_running_stats
        return (f"{len(names)} BatchNorm layer(s) keep per-rank running statistics (e.g. {names[:3]}); "
                "convert them (norm=bn|cbn|popnorm) to drop the broadcast")
    return None


class DistNormPlugin:
    """distnorm's layers, BNP, AMAT learning rate and consistency checks for one model.

    Args:
        model: the bare model, before any engine wraps it. It is converted in place.
        config: what to do (default: :class:`DistNormConfig()`, which changes nothing).

    Example:
        >>> import torch, distnorm
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        >>> plugin = distnorm.DistNormPlugin(net, distnorm.DistNormConfig(norm="cbn"))
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.05)
        >>> plugin.follow(opt)                      # AMAT now reads opt's learning rate
        DistNormPlugin(norm='cbn', bnp=False, amat_layers=1)
    """

    def __init__(self, model: nn.Module, config: DistNormConfig | None = None):
        self.config = config if config is not None else DistNormConfig()
        self.model = model
        self.local_running_stats = []  # filled below: BatchNorms whose statistics stay per rank
        self.group = (_subgroup(self.config.sync_group_size, self.config.collective_timeout_s)
                      if self.config.sync_group_size else None)
        if self.config.own_communicator and self.group is None:
            # sync_group_size already gives the layers communicators of their own
            self.group = _collectives.norm_group()
        self._config_checked = False
        self._verify_config()
        cfg = self.config
        # The selected norm's spec carries its hyper-parameters ("none", "keep": a label, no spec).
        convert(model, norm=cfg.norm_spec or cfg.norm, activation=cfg.activation, process_group=self.group)
        self.bnp_handle = cfg.bnp.attach(model, process_group=self.group) if cfg.bnp is not None else None
        self.amat_layers = [m for m in model.modules() if isinstance(m, _CompleteNorm) and m.amat]
        self.local_running_stats = unsynchronized_running_stats(model)
        self._lr_of_layer: Callable[[], list[float]] | None = None
        #: Optimizer whose replicated state the periodic check compares (set by follow()).
        self.optimizer: Any | None = None
        self.training_forwards = 0
        self._resync = False
        # Off is off: a configuration that changes nothing adds no hook, check or collective.
        # Runs eagerly even inside ``torch.compile(model)``: the learning rate is a Python float
        # that changes every step, and tracing it would recompile the model at every change. The
        # layers read it from their ``amat_eta`` buffer, which the compiled graph takes as input.
        # (Disabled here, not with a decorator: ``torch.compiler.disable`` imports torch._dynamo,
        # about 1 s of CPU that every ``import distnorm`` would pay.)
        self._hook = (model.register_forward_pre_hook(torch.compiler.disable(self._before_forward))
                      if self.config.active else None)

    def __repr__(self) -> str:
        return (f"DistNormPlugin(norm={self.config.norm!r}, bnp={self.config.bnp is not None}, "
                f"amat_layers={len(self.amat_layers)})")

    # ------------------------------------------------------------------ setup
    def _verify_config(self) -> None:
        """Every rank must run the same configuration (checked once the group exists)."""
        if self._config_checked or not _collectives.is_distributed():
            return
        assert_same_across_ranks(self.config.fingerprint(), "the distnorm configuration", self.group,
                                 error=ConfigurationMismatchError)
        self._config_checked = True

    def follow(self, source: Any) -> "DistNormPlugin":
        """Read AMAT's learning rate from ``source`` before every training forward.

        ``source`` is a torch optimizer (or an engine's wrapper of one: anything with
        ``param_groups``) — each AMAT layer follows the group holding its weight, or group 0
        — a training engine whose integration registered how to read it
        (:attr:`Engine.follow <distnorm._engines.Engine>`), or a callable returning the
        learning rate. Also broadcasts and verifies distnorm's buffers.
        """
        if not self.config.active:
            return self  # nothing of distnorm's to follow, broadcast or verify
        engine = engine_of(source)
        if engine is not None and engine.follow is not None:  # its integration knows how to read it
            self._lr_of_layer = engine.follow(self, source)
        elif hasattr(source, "param_groups"):
            groups = source.param_groups
            where = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
            trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
            missing = [n for n, p in trainable if id(p) not in where]
            if len(missing) == len(trainable):
                # An engine's optimizer over flattened / sharded copies of the parameters:
                # layers cannot be matched to groups; follow group 0.
                logger.info("distnorm: optimizer holds copies of the parameters; AMAT follows param group 0")
            elif missing:
                raise ValueError(
                    f"DistNormPlugin.follow(): the optimizer does not hold {len(missing)} trainable parameter(s) "
                    f"of the model (e.g. {missing[:3]}): it was built before distnorm converted the model. "
                    "Create the plugin first, then the optimizer."
                )
            flat = [p for g in groups for p in g["params"] if fsdp_flat(p)]
            if flat and len(groups) > 1 and any(id(m.weight) not in where for m in self.amat_layers):
                # FSDP1 without use_orig_params: the layers' weights live inside flat
                # parameters, and which group's learning rate applies to which layer is lost.
                raise ValueError(
                    f"DistNormPlugin.follow(): the optimizer has {len(groups)} parameter groups over FSDP "
                    "FlatParameters, so AMAT cannot tell which group's learning rate each layer follows. "
                    "Wrap with FullyShardedDataParallel(..., use_orig_params=True) (or use fully_shard), "
                    "or use one parameter group."
                )
            index = [where.get(id(m.weight), 0) for m in self.amat_layers]
            self._lr_of_layer = lambda: [source.param_groups[i]["lr"] for i in index]
            self.optimizer = source
        elif callable(source):  # a float, or a tensor the layers read on the device (no host sync)
            self._lr_of_layer = lambda: [source()] * len(self.amat_layers)
        else:
            followed = ", ".join(e.name for e in engines() if e.follow is not None) or "see distnorm.integrations"
            raise TypeError(
                f"DistNormPlugin.follow(): expected an optimizer, a training engine ({followed}) or a callable "
                f"returning the learning rate, got {type(source).__name__}"
            )
        self._verify_config()
        self.sync_buffers()
        return self

    def sync_buffers(self) -> int:
        """Broadcast distnorm's buffers from the group's first rank, then verify them.

        Collective. Returns the number of buffers. A no-op when not distributed.
        """
        group = _collectives.sync_group(self.group)
        tensors = [t for _, t in consistent_tensors(self.model)]
        if group is None:
            return len(tensors)
        with torch.no_grad():
            _collectives.broadcast_from_first(tensors, group)
        return check_consistency(self.model, self.group)

    # ------------------------------------------------------------- per step
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        if self._resync:  # first training forward after a checkpoint load: a safe point
            self._resync = False
            self.sync_buffers()
        if self._lr_of_layer is not None:
            # As the optimizer holds it: a float, or a tensor (capturable / fused optimizers),
            # which set_lrs turns into eta on the device, without reading it on the host.
            set_lrs(self.amat_layers, self._lr_of_layer())
        elif self.amat_layers and self.training_forwards == 0:
            warnings.warn(
                "distnorm: AMAT layers have no learning-rate source; call plugin.follow(optimizer) "
                "(or the training engine) once after the engine has prepared the optimizer",
                stacklevel=3,
            )
        self.training_forwards += 1
        every = self.config.check_every
        if every and self.training_forwards % every == 0:
            # Parameters and optimizer state too: a replica whose weights drifted (a rank that
            # skipped a step, a per-rank load) trains on silently otherwise. Parameters an
            # engine partitions are left out by check_consistency itself.
            check_consistency(self.model, self.group, parameters=True, optimizer=self.optimizer)

    # ---------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plugin state (the model's buffers travel in the model's own state dict)."""
        return {"config": self.config.to_dict(), "training_forwards": self.training_forwards}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = DistNormConfig.from_dict(state["config"], where="checkpoint")
        differ = differing_keys(saved.to_dict(), self.config.to_dict())
        if differ:
            listed = "; ".join(f"{key}: {then} in the checkpoint, {now} in this run" for key, (then, now) in differ.items())
            raise ConfigurationMismatchError(
                f"distnorm: the checkpoint was written with another distnorm configuration ({listed}); "
                "resume with the checkpoint's values, or start a new run in another directory")
        self.training_forwards = int(state["training_forwards"])
        self._resync = True  # broadcast + verify at the next training forward

    def resync_now(self) -> None:
        """Broadcast and verify the buffers at once (every rank calls it together, e.g. right
        after an engine loaded a checkpoint), instead of at the next training forward."""
        self._resync = False
        self.sync_buffers()

    def remove(self) -> None:
        """Stop following the optimizer and checking (the converted layers stay)."""
        if self._hook is not None:
            self._hook.remove()
        self._lr_of_layer = None
        self.optimizer = None
