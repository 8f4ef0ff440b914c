"""A small CNN trained by a real ``lightning.Trainer`` with :class:`DistNormSync`.

Run by tests/test_lightning.py in a subprocess: ``--devices 2`` lets Lightning's DDP
strategy start the second process itself (CPU, gloo). :func:`run_reference` trains the same
model in one plain PyTorch process on the concatenated batch, with the plugin following a
torch optimizer (the test calls it in its own process). Every rank writes what it saw to ``{out}.rank{r}.pt``: per step the loss, the
learning rate the optimizer applied and AMAT's eta; the final parameters and buffers; how
the DDP wrapper was built and every collective of each training batch (forward, backward,
optimizer step: ``tests.dispatch.CollectiveCounter``); where distnorm was imported from.

The data of step ``s`` is ``global_batch(s)`` whatever the epoch or a resume, so a run
resumed from a checkpoint sees the batches the uninterrupted run saw.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

import distnorm
from tests.dispatch import CollectiveCounter
from tests.engines.small_train import NUM_CLASSES
from tests.engines.small_train import make_model as base_model

LR = 0.05


def make_model() -> nn.Module:
    """small_train's CNN (the engines' tests share it), in float64."""
    return base_model().double()


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, 3, 10, 10, generator=gen, dtype=torch.float64) + 0.5
    return x, torch.randint(0, NUM_CLASSES, (size,), generator=gen)


def warmup_decay(step: int) -> float:
    """LR multiplier: linear warm-up over 3 steps, then 0.7x per step."""
    return (0.2 + 0.8 * step / 3) if step < 3 else 0.7 ** (step - 3)


def make_optimizer(params, lr: float = LR) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_decay)


def _amat(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, distnorm.CBN)]


def _record(model: nn.Module) -> dict:
    return {"params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "buffers": {k: v.detach().clone() for k, v in model.named_buffers()}}


def run_lightning(args, cfg) -> tuple[int, dict]:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    import distnorm.integrations.lightning as dn

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()
            self.loss_fn = nn.CrossEntropyLoss()
            self.seen = {"losses": [], "lrs": [], "etas": [], "steps": []}
            self.automatic_optimization = not args.two_optimizers

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            if args.two_optimizers:
                return self.manual_step(batch_idx)
            world, rank = self.trainer.world_size, self.trainer.global_rank
            step = self.trainer.global_step
            x, y = global_batch(step, args.global_batch)
            per_rank = args.global_batch // world
            x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
            loss = self.loss_fn(self(x), y)
            self.seen["losses"].append(loss.item())
            self.seen["lrs"].append(self.trainer.optimizers[0].param_groups[0]["lr"])
            self.seen["etas"].append([m.eta for m in _amat(self)])
            self.seen["steps"].append(step)
            return loss

        def train_dataloader(self):
            return torch.utils.data.DataLoader(list(range(100)), batch_size=None)

        def manual_step(self, step):
            """Two optimizers (manual optimization): the rest first, the norms' parameters
            second at a third of the learning rate; AMAT must follow the second."""
            world, rank = self.trainer.world_size, self.trainer.global_rank
            x, y = global_batch(step, args.global_batch)
            per_rank = args.global_batch // world
            loss = self.loss_fn(self(x[rank * per_rank:(rank + 1) * per_rank]), y[rank * per_rank:(rank + 1) * per_rank])
            self.manual_backward(loss)
            self.seen["lrs"].append([opt.param_groups[0]["lr"] for opt in self.trainer.optimizers])
            self.seen["etas"].append([m.eta for m in _amat(self)])
            self.seen["steps"].append(step)
            for opt in self.optimizers():
                opt.step()
                opt.zero_grad()
            for scheduler in self.lr_schedulers():
                scheduler.step()

        def configure_optimizers(self):
            if args.two_optimizers:
                norms = [p for n, p in self.named_parameters() if ".norm." in n]
                rest = [p for n, p in self.named_parameters() if ".norm." not in n]
                (rest_opt, rest_sched), (norm_opt, norm_sched) = make_optimizer(rest), make_optimizer(norms, LR / 3)
                return [rest_opt, norm_opt], [rest_sched, norm_sched]
            optimizer, scheduler = make_optimizer(self.parameters())
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    module = Module()
    sync = dn.DistNormSync(cfg)
    extra = {} if args.no_plugin else {"plugins": [sync], "callbacks": [] if args.plugin_only else [sync]}
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0, **extra,
    )
    ddp_seen = {"collectives": []}

    class Spy(L.Callback):  # how the DDP wrapper runs, once distnorm's callback has set it up
        def on_train_start(self, trainer, pl_module):
            wrapper = trainer.strategy.model
            ddp_seen["wrapper"] = type(wrapper).__name__
            ddp_seen["broadcast_buffers"] = getattr(wrapper, "broadcast_buffers", None)

        # What the wrapper really does, whatever its attributes say: the collectives of each
        # training batch (forward, backward and optimizer step happen between these hooks).
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.counter = CollectiveCounter()
            self.counter.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.counter.__exit__(None, None, None)
            ddp_seen["collectives"].append(self.counter.calls)

    trainer.callbacks.insert(0, Spy())  # first: its counter sees the other callbacks' batch-start work
    trainer.fit(module, ckpt_path=args.ckpt if args.resume else None)
    if args.refit:  # fit the same module again: a new Trainer, new optimizers, the same sync
        trainer = L.Trainer(
            accelerator="cpu", devices=args.devices, strategy=DDPStrategy(process_group_backend="gloo"),
            max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0, **extra,
        )
        trainer.fit(module)
    saved = {}
    if args.save:
        trainer.save_checkpoint(args.save)  # rank 0 writes, then every rank waits for it
        ckpt = torch.load(args.save, weights_only=False)
        saved = {"ckpt_callbacks": sorted(ckpt.get("callbacks", {})), "ckpt_keys": sorted(ckpt["state_dict"])}
    result = {**saved, **module.seen, **_record(module), **ddp_seen, "world": trainer.world_size,
              "distnorm_file": distnorm.__file__, "plugin_state": sync.state_dict(),
              "conversion": distnorm.conversion_summary(module)}
    return trainer.global_rank, result


def run_reference(cfg: distnorm.DistNormConfig, steps: int = 6, global_batch_size: int = 8) -> dict:
    """One plain PyTorch process on the concatenated batch (the oracle; the test calls it)."""
    model = make_model()
    plugin = distnorm.DistNormPlugin(model, cfg)
    optimizer, scheduler = make_optimizer(model.parameters())
    plugin.follow(optimizer)
    loss_fn = nn.CrossEntropyLoss()
    seen = {"losses": [], "lrs": [], "etas": [], "steps": []}
    for step in range(steps):
        x, y = global_batch(step, global_batch_size)
        loss = loss_fn(model(x), y)
        loss.backward()
        seen["losses"].append(loss.item())
        seen["lrs"].append(optimizer.param_groups[0]["lr"])
        seen["etas"].append([m.eta for m in _amat(model)])
        seen["steps"].append(step)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    # the LightningModule holds the model as ``net``
    record = {kind: {f"net.{k}": v for k, v in values.items()} for kind, values in _record(model).items()}
    return {**seen, **record, "world": 1}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--no-plugin", action="store_true", help="plain Lightning, no distnorm lines")
    p.add_argument("--plugin-only", action="store_true", help="DistNormSync as a plugin but not as a callback")
    p.add_argument("--two-optimizers", action="store_true", help="manual optimization with two optimizers")
    p.add_argument("--refit", action="store_true", help="fit the module a second time with a new Trainer")
    p.add_argument("--save", default=None, help="write a checkpoint here after fit")
    p.add_argument("--ckpt", default=None)
    p.add_argument("--resume", action="store_true")
    distnorm.add_arguments(p)
    return p


def main() -> int:
    """``lightning_train.py OUT NAME:ARGS [NAME:ARGS ...]``: train every run in turn in the
    same processes (Lightning starts the second rank once, and it runs the same list) and
    write ``OUT/NAME.rank{r}.pt``; ``ARGS`` are the flags of :func:`parser`, space-separated.
    A run that raises records ``{"error": message}`` and ends the list."""
    torch.set_num_threads(1)
    out, runs = sys.argv[1], sys.argv[2:]
    for run in runs:
        name, _, flags = run.partition(":")
        args = parser().parse_args(flags.split())
        cfg = distnorm.DistNormConfig.from_args(args)
        try:
            rank, result = run_lightning(args, cfg)
        except Exception as err:  # noqa: BLE001 - the test reads the message
            rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.save({"error": f"{type(err).__name__}: {err}"}, f"{out}/{name}.rank{rank}.pt")
            return 0
        torch.save(result, f"{out}/{name}.rank{rank}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
