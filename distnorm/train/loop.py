"""The training loop of the recipe: data, engine, evaluation, metrics, checkpoints, resume."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distnorm import models
from distnorm.data import EvalLoader, ShardIndex, TrainLoader, evaluate, expand_urls
from distnorm.data.loaders import DataError
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


def init_distributed(cfg: TrainConfig) -> None:
    """Create the default process group with the configured timeout, before any engine.

    Accelerate and DeepSpeed reuse an existing group, so every collective of the run —
    distnorm's, DDP's, ZeRO's — fails after ``train.collective_timeout_s`` instead of the
    backend defaults (30 min for gloo), and the start-up agreement checks run before the
    engine's first collective.
    """
    import os
    from datetime import timedelta

    import torch.distributed as dist

    _, world = local_world()
    if world <= 1 or dist.is_initialized():
        return
    cuda = torch.cuda.is_available() and not cfg.train.cpu
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=cfg.train.collective_timeout_s))


def agree_on_setup(cfg: TrainConfig, model: nn.Module, world: int) -> None:
    """Start-up mismatch detection: one fixed-size hash all-reduce per item, before the
    engine's first collective; a mismatch is a ConfigError on every rank naming the item
    and what each rank has."""
    import hashlib

    from distnorm.consistency import assert_same_across_ranks

    def digest(path: str | None) -> str:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16] if path and Path(path).is_file() else "-"

    # Data locations may legitimately differ per node (node-local copies, per-node object-store
    # endpoints); the data itself is compared through the index files' contents.
    config = cfg.to_dict()
    config["data"] = {k: v for k, v in config["data"].items() if not k.endswith(("_shards", "_index"))}
    items = {
        "the training configuration": json.dumps(config, sort_keys=True, default=str),
        "the world size and per-rank batch": f"world={world} per_rank={cfg.per_rank_batch(world)}",
        "the dataset index files": f"train={digest(cfg.data.train_index)} val={digest(cfg.data.val_index)}",
        "the model structure": "\n".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in model.state_dict().items()),
    }
    for what, text in items.items():
        assert_same_across_ranks(text, what, error=ConfigError)


def _gather_texts(text: str) -> list[str]:
    """Every rank's ``text`` (a collective over the default group)."""
    from distnorm import _collectives

    return _collectives.gather_texts(text, _collectives.sync_group(None))


def _agree_on_resume(found: tuple[Path, dict[str, Any]] | None, world: int) -> None:
    """Every rank resumes from the same checkpoint, written by as many ranks as this run has.

    Each rank verifies the checkpoints itself, so a node that sees a different (or damaged)
    copy would otherwise resume from a different step. A different world size changes which
    rank reads which shards and where each rank's data position is, so an exact resume is
    impossible; it is refused rather than silently resumed inexactly.
    """
    from distnorm.consistency import assert_same_across_ranks

    where = str(found[0]) if found is not None else "no checkpoint"
    assert_same_across_ranks(
        where, "the checkpoint to resume from (every rank must see the same checkpoint directory, e.g. on a "
        "shared file system, and the same files in it)", error=ConfigError)
    if found is not None:
        saved = found[1].get("world_size", world)  # checkpoints from before this field: not checked
        if saved != world:
            raise ConfigError(
                f"checkpoint {found[0]} was written by {saved} process(es) but this run has {world}: its data "
                f"position and per-rank state only resume exactly with {saved}. Restart with {saved} processes, "
                "or start a new run in another output.dir (loading only the weights is a fine-tuning job, not a resume)."
            )


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


class _phase:
    """Re-raise a failure inside a training phase naming the phase and the step (a dead or
    stalled peer surfaces as an error of whichever collective was running)."""

    def __init__(self, name: str, epoch: int, step: int):
        self.name, self.epoch, self.step = name, epoch, step

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, tb) -> bool:
        from distnorm.errors import InconsistentStateError, NonFiniteStatisticsError

        passthrough = (NonFiniteStatisticsError, InconsistentStateError, DataError)
        if isinstance(err, passthrough) and hasattr(err, "add_note"):  # keep the type, add where
            err.add_note(f"(during the {self.name} of epoch {self.epoch}, step {self.step})")
        elif isinstance(err, RuntimeError):
            raise RuntimeError(f"{self.name} of epoch {self.epoch}, step {self.step} failed: {err}") from err
        return False


def _all_finite(loss_value: float, world: int, device: torch.device) -> bool:
    """Whether the loss is finite on every rank (one tiny all-reduce, so all ranks agree)."""
    from distnorm import _collectives

    bad = torch.tensor([0.0 if math.isfinite(loss_value) else 1.0], dtype=torch.float64, device=device)
    if world > 1:
        _collectives.all_reduce_sum(bad, _collectives.sync_group(None), slot="trainer|non-finite loss check")
    return bool(bad.item() == 0)


def train(cfg: TrainConfig, *, dry_run: bool = False, dry_run_batch: int | None = None) -> dict[str, Any]:
    """Run the recipe; returns the last evaluation metrics (and run facts)."""
    rank, world = local_world()
    check_setup(cfg, world, data=not dry_run)
    per_rank = cfg.per_rank_batch(world)
    if cfg.train.debug:
        import distnorm

        distnorm.debug(True)
    init_distributed(cfg)
    torch.manual_seed(cfg.train.seed)  # the same initial model on every rank
    model = models.create(cfg.model.name, num_classes=cfg.model.num_classes, norm="local_bn", activation=None)
    agree_on_setup(cfg, model, world)

    d = cfg.data
    if dry_run:
        batch = dry_run_batch or per_rank
        steps_per_epoch = 2
        train_loader = eval_loader = None
    else:
        index = ShardIndex.load(d.train_index)
        class_sorted = index.class_sorted_shards()
        if class_sorted and rank == 0:
            logger.warning(
                "%d of %d training shards hold only one or two classes (e.g. %s): they were written in class "
                "order, so batches are not mixed and batch statistics are biased. Rewrite them with "
                "distnorm-shards, which writes samples in a seeded random order.",
                len(class_sorted), len(index.shards), class_sorted[:3])
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
    checkpoints = CheckpointManager(run_dir / "checkpoints", cfg.output.keep_last, main, engine.barrier,
                                    gather=_gather_texts if world > 1 else None)
    loss_fn = nn.CrossEntropyLoss()

    state = {"epoch": 0, "step_in_epoch": 0, "global_step": 0}
    if not dry_run:
        found = checkpoints.find_resumable()
        _agree_on_resume(found, world)
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
        snapshot = {"epoch": epoch, "step_in_epoch": step_in_epoch, "global_step": global_step, "world_size": world}
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
                step_in_epoch += 1
                images = engine.cast_inputs(images.to(engine.device, non_blocking=True))
                labels = labels.to(engine.device, non_blocking=True)
                with _phase("forward", epoch, global_step + 1):
                    loss = loss_fn(engine.model(images).float(), labels)
                    loss_value = loss.item()  # the step's one host sync (logging and the NaN check)
                    finite = _all_finite(loss_value, world, loss.device)
                if not finite:
                    if cfg.train.on_nonfinite == "stop":
                        raise FloatingPointError(
                            f"non-finite loss at epoch {epoch}, step {global_step + 1} (on at least one rank); "
                            "set train.debug=true to name the first layer with non-finite statistics, or "
                            "train.on_nonfinite=skip to skip such steps")
                    writer.log("skipped_step", step=global_step + 1, epoch=epoch, reason="non-finite loss")
                    continue
                with _phase("backward", epoch, global_step + 1):
                    engine.backward(loss)
                if monitor is not None:
                    monitor.after_backward(global_step + 1)
                lr = engine.lr()
                with _phase("optimizer step", epoch, global_step + 1):
                    engine.step()
                global_step += 1
                if monitor is not None:
                    for record in monitor.records(global_step):
                        writer.log("monitor", epoch=epoch, **record)
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
