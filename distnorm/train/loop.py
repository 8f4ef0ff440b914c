"""The training loop of the recipe: data, engine, evaluation, metrics, checkpoints, resume."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distnorm import models
from distnorm.data import EvalLoader, ShardIndex, TrainLoader, evaluate, expand_urls
from distnorm.train.checkpoint import CheckpointManager
from distnorm.train.config import ConfigError, TrainConfig
from distnorm.train.engines import local_world, make_engine, require_engine
from distnorm.train.metrics import MetricsWriter

__all__ = ["train", "check_setup"]

logger = logging.getLogger(__name__)


def _local_shards_missing(pattern: str) -> list[str]:
    """Local shard files that do not exist (remote / pipe: URLs cannot be checked here)."""
    urls = expand_urls(pattern)
    local = [u[len("file://"):] if u.startswith("file://") else u for u in urls if "://" not in u or u.startswith("file://")]
    local = [u for u in local if not u.startswith("pipe:")]
    return [u for u in local if not Path(u).is_file()]


def check_setup(cfg: TrainConfig, world_size: int, *, data: bool = True) -> None:
    """Everything that can be checked before any worker starts; raises ConfigError."""
    require_engine(cfg.train.engine)
    cfg.per_rank_batch(world_size)
    if cfg.train.engine == "deepspeed" and not Path(cfg.train.deepspeed_config).is_file():
        raise ConfigError(f"train.deepspeed_config {cfg.train.deepspeed_config} does not exist")
    if not data:
        return
    for split in ("train", "val"):
        shards, index = getattr(cfg.data, f"{split}_shards"), getattr(cfg.data, f"{split}_index")
        if shards is None:
            if split == "train":
                raise ConfigError("data.train_shards is not set")
            continue
        if index is None:
            raise ConfigError(f"data.{split}_index is not set (distnorm-shards writes it beside the shards)")
        if not Path(index).is_file():
            raise ConfigError(f"data.{split}_index {index} does not exist; write the shards with distnorm-shards first")
        missing = _local_shards_missing(shards)
        if missing:
            raise ConfigError(f"data.{split}_shards: {len(missing)} shard(s) missing, e.g. {missing[0]}")
        classes = len(ShardIndex.load(index).classes)
        if classes != cfg.model.num_classes:
            raise ConfigError(f"model.num_classes={cfg.model.num_classes} but {index} lists {classes} classes")


class _Progress:
    """A tqdm bar on rank 0 with images/s, loss, LR and the ETA."""

    def __init__(self, enabled: bool, total: int, initial: int, desc: str):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)

    def update(self, **postfix: Any) -> None:
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train(cfg: TrainConfig, *, dry_run: bool = False, dry_run_batch: int | None = None) -> dict[str, Any]:
    """Run the recipe; returns the last evaluation metrics (and run facts)."""
    rank, world = local_world()
    check_setup(cfg, world, data=not dry_run)
    per_rank = cfg.per_rank_batch(world)
    torch.manual_seed(cfg.train.seed)  # the same initial model on every rank
    model = models.create(cfg.model.name, num_classes=cfg.model.num_classes, norm="local_bn", activation=None)

    d = cfg.data
    if dry_run:
        batch = dry_run_batch or per_rank
        steps_per_epoch = 2
        train_loader = eval_loader = None
    else:
        index = ShardIndex.load(d.train_index)
        train_loader = TrainLoader(
            d.train_shards, num_samples=index.total, batch_size=per_rank, rank=rank, world_size=world,
            seed=cfg.train.seed, num_workers=d.num_workers, prefetch_factor=d.prefetch_factor,
            shuffle_buffer=d.shuffle_buffer, transform=d.transform, image_size=d.image_size, on_error=d.on_error,
        )
        eval_loader = None
        if d.val_shards:
            eval_loader = EvalLoader(
                d.val_shards, index=d.val_index, batch_size=d.eval_batch_size or per_rank, rank=rank,
                world_size=world, num_workers=d.eval_workers, prefetch_factor=d.prefetch_factor,
                transform=d.transform, image_size=d.image_size, on_error=d.on_error,
            )
        steps_per_epoch = len(train_loader)

    engine = make_engine(cfg, model, steps_per_epoch)
    run_dir = Path(cfg.output.dir)
    main = engine.is_main
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.save(run_dir / "config.yaml")
    writer = MetricsWriter(run_dir, enabled=main and not dry_run, tensorboard=cfg.output.tensorboard)
    checkpoints = CheckpointManager(run_dir / "checkpoints", cfg.output.keep_last, main, engine.barrier)
    loss_fn = nn.CrossEntropyLoss()

    state = {"epoch": 0, "step_in_epoch": 0, "global_step": 0}
    if not dry_run:
        found = checkpoints.find_resumable()
        if found is not None:
            directory, _ = found
            state = engine.load(directory)
            if main:
                logger.info("resumed from %s at epoch %d, step %d", directory, state["epoch"], state["global_step"])
                print(f"resumed from {directory} (epoch {state['epoch']}, global step {state['global_step']})", flush=True)
            writer.log("resume", checkpoint=str(directory), **state)

    def save(epoch: int, step_in_epoch: int, global_step: int) -> None:
        if dry_run:
            return
        snapshot = {"epoch": epoch, "step_in_epoch": step_in_epoch, "global_step": global_step}
        path = checkpoints.save(global_step, snapshot, engine.save)
        writer.log("checkpoint", step=global_step, epoch=epoch, path=str(path))

    last_eval: dict[str, Any] = {}
    total_steps = cfg.train.epochs * steps_per_epoch
    max_steps = min(total_steps, cfg.train.max_steps or total_steps)
    if dry_run:
        max_steps = 2
    global_step = state["global_step"]
    progress = _Progress(main and cfg.output.progress and not dry_run, max_steps, global_step, cfg.model.name)
    ckpt_every = cfg.output.checkpoint_every_steps
    monitor = None
    if cfg.output.monitors and main and not dry_run:
        from distnorm.monitors import TheoryMonitor

        monitor = TheoryMonitor(engine.plugin.model, every=cfg.output.monitor_every)
    started = time.time()
    try:
        for epoch in range(state["epoch"], cfg.train.epochs):
            if global_step >= max_steps:
                break
            skip = state["step_in_epoch"] if epoch == state["epoch"] else 0
            if dry_run:
                images = torch.randn(batch, 3, d.image_size, d.image_size)
                labels = torch.randint(0, cfg.model.num_classes, (batch,))
                batches = [(images, labels)] * steps_per_epoch
            else:
                train_loader.set_epoch(epoch, skip_batches=skip)
                batches = train_loader
            engine.model.train()
            step_in_epoch, seen, loss_sum, window = skip, 0, 0.0, time.time()
            for images, labels in batches:
                images = engine.cast_inputs(images.to(engine.device, non_blocking=True))
                labels = labels.to(engine.device, non_blocking=True)
                loss = loss_fn(engine.model(images).float(), labels)
                engine.backward(loss)
                if monitor is not None:
                    monitor.after_backward(global_step + 1)
                lr = engine.lr()
                engine.step()
                global_step += 1
                if monitor is not None:
                    for record in monitor.records(global_step):
                        writer.log("monitor", epoch=epoch, **record)
                step_in_epoch += 1
                loss_value = loss.item()
                if not math.isfinite(loss_value):
                    raise FloatingPointError(f"loss is {loss_value} at epoch {epoch}, global step {global_step}")
                loss_sum += loss_value
                seen += 1
                if global_step % cfg.output.log_every == 0 or global_step == max_steps:
                    elapsed = max(time.time() - window, 1e-9)
                    ips = seen * per_rank * world / elapsed
                    writer.log("train", step=global_step, epoch=epoch, loss=loss_sum / seen, lr=lr, images_per_sec=ips)
                    progress.update(loss=f"{loss_sum / seen:.4f}", lr=f"{lr:.4g}", img_s=f"{ips:.0f}")
                    seen, loss_sum, window = 0, 0.0, time.time()
                else:
                    progress.update()
                if ckpt_every and global_step % ckpt_every == 0 and step_in_epoch < steps_per_epoch:
                    save(epoch, step_in_epoch, global_step)
                if global_step >= max_steps:
                    break
            epoch_done = step_in_epoch >= steps_per_epoch
            if eval_loader is not None and epoch_done and ((epoch + 1) % cfg.train.eval_every_epochs == 0 or epoch + 1 == cfg.train.epochs):
                last_eval = evaluate(engine.eval_model(), eval_loader, device=engine.device,
                                     process_group=None, cast=engine.cast_inputs)
                writer.log("eval", step=global_step, epoch=epoch + 1, **last_eval)
            elif dry_run:
                fake = [(torch.randn(batch, 3, d.image_size, d.image_size), torch.zeros(batch, dtype=torch.long),
                         torch.ones(batch, dtype=torch.bool), [""] * batch)]
                last_eval = evaluate(engine.eval_model(), fake, device=engine.device, cast=engine.cast_inputs)
            if main and epoch_done:
                summary = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in last_eval.items())
                print(f"epoch {epoch + 1}/{cfg.train.epochs}: lr {lr:.4g}, {summary or 'no evaluation'}", flush=True)
            if epoch_done:
                writer.log("epoch", step=global_step, epoch=epoch + 1, lr=lr, seconds=time.time() - started,
                           **{f"val_{k}": v for k, v in last_eval.items()})
                save(epoch + 1, 0, global_step)
            state["step_in_epoch"] = 0
    finally:
        progress.close()
        writer.close()
    return {"eval": last_eval, "global_step": global_step, "run_dir": str(run_dir),
            "checkpoint": str(checkpoints.root / "latest") if not dry_run else None,
            "world_size": world, "per_rank_batch": per_rank}
