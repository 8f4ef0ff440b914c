"""distnorm in a PyTorch Lightning run — the whole change::

    import distnorm
    import distnorm.integrations.lightning as dn                           # + import

    sync = dn.DistNormSync(distnorm.DistNormConfig(norm="cbn", bnp=True))  # + 1
    trainer = L.Trainer(strategy="ddp", devices=2,
                        plugins=[sync], callbacks=[sync])                  # + 2: both lists
    trainer.fit(model)

:class:`DistNormSync` is Lightning's own hook for synchronized normalization, a
:class:`~lightning.pytorch.plugins.LayerSync` (what ``Trainer(sync_batchnorm=True)`` uses,
and as exclusive: Lightning refuses both together), and a
:class:`~lightning.pytorch.callbacks.Callback` for what a LayerSync cannot reach:

* **conversion** — :meth:`apply` converts the LightningModule (any norm, BNP too) through
  :class:`~distnorm.DistNormPlugin`. The callback's ``setup`` hook applies it already, in
  every stage, because the DDP strategy restores a checkpoint's weights *before* it calls
  ``LayerSync.apply``: a resumed ``fit(ckpt_path=...)`` or a ``test(ckpt_path=...)`` must
  find the converted modules the checkpoint was written from. Conversion is idempotent; the
  optimizer is built by Lightning afterwards, so it holds the new parameters;
* **learning rate** — ``on_fit_start`` makes the plugin :meth:`~distnorm.DistNormPlugin.follow`
  ``trainer.optimizers`` (all of them, as one list of parameter groups): before every
  training batch (``on_train_batch_start``) each AMAT layer reads the learning rate of the
  group holding its weight, as Lightning's schedulers left it (``interval="step"`` or
  ``"epoch"``, warm-up included), and every ``check_every`` batches the plugin checks
  consistency. The first ``follow`` also broadcasts distnorm's buffers from rank 0 and
  verifies them;
* **once per batch** — not per call of the module: under DDP, Lightning runs
  ``training_step`` through the LightningModule's own ``__call__`` (its forward
  redirection), and ``training_step`` usually calls ``self(x)`` again, so the plugin's
  per-forward hook would count two forwards a step (the consistency check, and its
  collectives, twice as often as ``check_every`` says); on one device a ``training_step``
  that calls ``self.net(x)`` never calls the module at all. The callback's
  ``on_train_batch_start`` runs the plugin's per-step work instead of that hook;
* **buffers** — distnorm's buffers are bit-identical on every rank by construction, so
  ``on_fit_start`` turns the DDP wrapper's per-forward buffer broadcast off
  (``DistributedDataParallel.broadcast_buffers = False``), unless BatchNorms with per-rank
  running statistics remain (BNP alone on a BN model: a warning says why it stays on);
* **checkpoints** — through Lightning's own hook for a callback's state: the plugin state
  travels in the checkpoint's ``callbacks`` entry (the callback's ``state_dict`` /
  ``load_state_dict``, which Lightning calls); the buffers (AMAT's and BNP's statistics)
  travel with the module's own state dict and are broadcast and verified at the first
  training forward after a load.

:meth:`revert`, which Lightning calls when ``fit`` ends, keeps the converted layers: they
*are* the trained model (:func:`distnorm.revert` would put the untrained BatchNorms back);
it stops following the optimizer and checking, as ``TorchSyncBatchNorm.revert`` stops the
synchronization. Without ``norm`` / BNP in the configuration nothing changes at all: no
conversion, no per-batch work, no DDP setting, no checkpoint entry.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Iterable

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distnorm._engines import Engine, register_engine
from distnorm.config import DistNormConfig, add_arguments
from distnorm.plugin import DistNormPlugin, buffer_broadcast_needed

try:
    from lightning.pytorch import Callback
    from lightning.pytorch.plugins import LayerSync
except ImportError as err:  # the extra is missing: say which one
    raise ImportError("distnorm's Lightning integration needs `pip install distnorm[lightning]`") from err

__all__ = ["DistNormSync", "add_arguments", "ENGINE"]

logger = logging.getLogger(__name__)


class _AllOptimizers:
    """Several optimizers seen as one: their parameter groups in order, their state merged.

    ``DistNormPlugin.follow`` maps each AMAT layer to the group holding its weight, so with
    Lightning's multiple optimizers (GANs, manual optimization) every layer follows the
    optimizer that actually updates it.
    """

    def __init__(self, optimizers: Iterable[Any]):
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        merged: dict[Any, Any] = {}
        for opt in self.optimizers:
            merged.update(opt.state)
        return merged


class DistNormSync(LayerSync, Callback):
    """distnorm's layers, BNP and AMAT for a Lightning ``Trainer``.

    Pass the same object as a plugin and as a callback:
    ``Trainer(plugins=[sync], callbacks=[sync])``.

    Args:
        config: what to do (default: :class:`~distnorm.DistNormConfig()`, which changes
            nothing), or the namespace of a parser that went through :func:`add_arguments`.

    Attributes:
        plugin: the :class:`~distnorm.DistNormPlugin` of the converted LightningModule
            (``None`` before the trainer set the model up).

    Example:
        >>> import torch, distnorm
        >>> from distnorm.integrations.lightning import DistNormSync
        >>> sync = DistNormSync(distnorm.DistNormConfig(norm="cbn"))
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        >>> net = sync.apply(net)      # what the trainer does at setup
        >>> sync.plugin
        DistNormPlugin(norm='cbn', bnp=False, amat_layers=1)
    """

    def __init__(self, config: DistNormConfig | argparse.Namespace | None = None):
        if isinstance(config, argparse.Namespace):
            config = DistNormConfig.from_args(config)
        self.config = config if config is not None else DistNormConfig()
        self.plugin: DistNormPlugin | None = None
        self._reverted = False

    # ------------------------------------------------------------- LayerSync
    def apply(self, model: nn.Module) -> nn.Module:
        """Convert ``model`` in place (once; later calls only resume following and checking)."""
        if self.plugin is not None and self.plugin.model is model:
            self._reverted = False  # fit again: on_train_batch_start follows and checks again
            return model
        if self.plugin is not None:
            raise ValueError(
                "DistNormSync: this instance already converted another model; create one DistNormSync per model"
            )
        self._require_callback(model)
        plugin = DistNormPlugin(model, self.config)
        # The plugin's per-forward hook would run once per call of the LightningModule (twice
        # a step under DDP, see the module docstring): on_train_batch_start runs it instead.
        plugin.remove()
        self.plugin = plugin
        return model

    def revert(self, model: nn.Module) -> nn.Module:
        """Stop following the optimizer and checking; keep the converted (trained) layers."""
        if self.plugin is not None and self.plugin.model is model and not self._reverted:
            self.plugin.remove()
            self._reverted = True
        return model

    def _require_callback(self, model: nn.Module) -> None:
        """A DistNormSync given only as a plugin converts but never learns the learning
        rate, and a resumed run fails to load its own checkpoint: refuse it."""
        trainer = getattr(model, "_trainer", None)
        if trainer is not None and not any(cb is self for cb in trainer.callbacks):
            raise ValueError(
                "DistNormSync must be passed as a plugin and as a callback: "
                "Trainer(plugins=[sync], callbacks=[sync]) — the callback gives AMAT the learning rate, "
                "keeps distnorm's state in checkpoints and converts the model before a checkpoint is restored"
            )

    # -------------------------------------------------------------- Callback
    def setup(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        # Before the strategy restores a checkpoint (DDP restores before LayerSync.apply):
        # the module must already have the converted layers the checkpoint holds.
        self.apply(pl_module)

    def on_fit_start(self, trainer: Any, pl_module: nn.Module) -> None:
        plugin = self.plugin
        if plugin is None or not plugin.config.active:
            return  # off is off
        wrapper = trainer.strategy.model
        if isinstance(wrapper, DistributedDataParallel):
            keep = buffer_broadcast_needed(plugin)
            if keep is not None:
                logger.warning("distnorm: DDP keeps broadcasting buffers every forward: %s", keep)
            else:
                # A public attribute of DDP (a property over forward_sync_buffers on torch
                # >= 2.13), read at every forward: the wrapper was built a moment ago.
                wrapper.broadcast_buffers = False
        optimizers = trainer.optimizers
        if optimizers:
            plugin.follow(optimizers[0] if len(optimizers) == 1 else _AllOptimizers(optimizers))

    def on_train_batch_start(self, trainer: Any, pl_module: nn.Module, batch: Any, batch_idx: int) -> None:
        plugin = self.plugin
        if plugin is None or not plugin.config.active or self._reverted:
            return
        # What the plugin's forward pre-hook does in other engines (learning rate, resync
        # after a load, periodic check), once per training batch.
        plugin._before_forward(plugin.model, ())

    def state_dict(self) -> dict[str, Any]:
        if self.plugin is None or not self.plugin.config.active:
            return {}  # Lightning stores no entry for an empty state
        return {"plugin": self.plugin.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.plugin is not None and "plugin" in state_dict:
            self.plugin.load_state_dict(state_dict["plugin"])


#: Everything distnorm knows about Lightning, registered once. Its strategies wrap the module
#: in torch's DDP / FSDP (registered by torch's own entry); it reaches distnorm through
#: :class:`DistNormSync`, whose callback state Lightning saves and restores itself (no hook to
#: install: ``checkpoint`` / ``restore`` stay empty).
ENGINE = register_engine(Engine(name="Lightning", library="lightning"))
