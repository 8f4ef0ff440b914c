"""The training loop of the recipe: data, engine, evaluation, metrics, checkpoints, resume."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
import warnings
from datetime import timedelta
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import distnorm
from distnorm import _collectives, models
from distnorm._collectives import assert_same_across_ranks
from distnorm.data import EvalLoader, ShardIndex, TrainLoader, evaluate, to_device
from distnorm.data.specs import DataError
from distnorm.errors import InconsistentStateError, NonFiniteStatisticsError
from distnorm.monitors import TheoryMonitor
from distnorm.settings import keyed_lines
from distnorm.specs import KEEP
from distnorm.train.checkpoint import CheckpointManager
from distnorm.train.checks import SetupMismatchError, check_setup, local_world
from distnorm.train.config import ConfigError, TrainConfig
from distnorm.train.engines import make_engine
from distnorm.train.frozen import evaluate_frozen, write_frozen
from distnorm.train.metrics import MetricsWriter

__all__ = ["train", "train_one_epoch", "Position", "Reporting", "build_model", "build_loaders", "check_setup",
           "SyntheticLoader", "SetupMismatchError"]

logger = logging.getLogger(__name__)


def init_distributed(cfg: TrainConfig) -> None:
    """Create the default process group with the configured timeout, before any engine.

    Accelerate and DeepSpeed reuse an existing group, so every collective of the run —
    distnorm's, DDP's, ZeRO's — fails after ``train.collective_timeout_s`` instead of the
    backend defaults (30 min for gloo), and the start-up agreement checks run before the
    engine's first collective.
    """
    _, world = local_world()
    if world <= 1 or dist.is_initialized():
        return
    cuda = torch.cuda.is_available() and not cfg.train.cpu
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=cfg.train.collective_timeout_s))


def agree_on_setup(cfg: TrainConfig, model: nn.Module, world: int) -> None:
    """Start-up mismatch detection: one fixed-size hash all-reduce per item, before the
    engine's first collective; a mismatch is a :class:`SetupMismatchError` on every rank
    naming the item, the keys that differ and each rank's value."""
    def digest(path: str | None) -> str:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16] if path and Path(path).is_file() else "-"

    # Data locations may legitimately differ per node (node-local copies, per-node object-store
    # endpoints); the data itself is compared through the index files' contents.
    config = cfg.to_dict()
    config["data"] = {k: v for k, v in config["data"].items() if not k.endswith(("_shards", "_index"))}
    items = {
        "the training configuration": ("\n".join(keyed_lines(config)),
                                       "Every process must run the same config file with the same overrides (a "
                                       "node whose launcher got other overrides, or its own edited copy of the YAML)."),
        "the world size and per-rank batch": (f"world={world} per_rank={cfg.per_rank_batch(world)}", ""),
        "the dataset index files": (f"data.train_index.sha256 = {json.dumps(digest(cfg.data.train_index))}\n"
                                    f"data.val_index.sha256 = {json.dumps(digest(cfg.data.val_index))}",
                                    "Every node must read the same index (copy it again from one place)."),
        "the model structure": ("\n".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in model.state_dict().items()), ""),
    }
    for what, (text, hint) in items.items():
        try:
            assert_same_across_ranks(text, what, error=SetupMismatchError)
        except SetupMismatchError as err:  # raised on every rank alike: adding the hint keeps them alike
            raise SetupMismatchError(f"{err}\n{hint}".rstrip()) from None


def _gather_texts(text: str) -> list[str]:
    """Every rank's ``text`` (a collective over the default group)."""
    return _collectives.gather_texts(text, _collectives.sync_group(None))


def _agree_on_resume(found: tuple[Path, dict[str, Any]] | None, world: int, *, allow_other_world: bool = False,
                     per_rank_engine: str | None = None) -> None:
    """Every rank resumes from the same checkpoint, written by as many ranks as this run has.

    Each rank verifies the checkpoints itself, so a node that sees a different (or damaged)
    copy would otherwise resume from a different step. A different world size changes which
    rank reads which shards and where each rank's data position is, so an exact resume is
    impossible: it is refused unless ``train.resume_world_size=allow`` (then :func:`_resume`
    goes on at the next epoch), and always for an engine whose checkpoints are per rank
    (``per_rank_engine``: its name).
    """
    where = str(found[0]) if found is not None else "no checkpoint"
    assert_same_across_ranks(
        where, "the checkpoint to resume from (every rank must see the same checkpoint directory, e.g. on a "
        "shared file system, and the same files in it)", error=SetupMismatchError)
    if found is not None:
        saved = found[1].get("world_size", world)  # checkpoints from before this field: not checked
        if saved != world and allow_other_world and per_rank_engine is not None:
            raise ConfigError(
                f"checkpoint {found[0]} was written by {saved} process(es) but this run has {world}, and "
                f"train.engine={per_rank_engine} keeps optimizer state per process (ZeRO partitions): it cannot resume on "
                f"another world size here. Restart with {saved} processes, or convert the checkpoint with "
                "DeepSpeed's universal-checkpoint tools (ds_to_universal) and load it yourself.")
        if saved != world and not allow_other_world:
            raise ConfigError(
                f"checkpoint {found[0]} was written by {saved} process(es) but this run has {world}: its data "
                f"position and per-rank state only resume exactly with {saved}. Restart with {saved} processes, "
                "set train.resume_world_size=allow to go on from the next epoch, or start a new run in another "
                "output.dir (loading only the weights is a fine-tuning job, not a resume)."
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
        passthrough = (NonFiniteStatisticsError, InconsistentStateError, DataError)
        if isinstance(err, passthrough) and hasattr(err, "add_note"):  # keep the type, add where
            err.add_note(f"(during the {self.name} of epoch {self.epoch}, step {self.step})")
        elif isinstance(err, RuntimeError):
            raise RuntimeError(f"{self.name} of epoch {self.epoch}, step {self.step} failed: {err}") from err
        return False


def _all_finite(loss_value: float, world: int, device: torch.device) -> bool:
    """Whether the loss is finite on every rank (one tiny all-reduce, so all ranks agree)."""
    bad = torch.tensor([0.0 if math.isfinite(loss_value) else 1.0], dtype=torch.float64, device=device)
    if world > 1:
        _collectives.all_reduce_sum(bad, _collectives.sync_group(None), slot="trainer|non-finite loss check")
    return bool(bad.item() == 0)


class SyntheticLoader:
    """Random batches with the interface of the shard loaders: what ``--dry-run`` trains and
    evaluates on, so the dry run goes through the same loop as a real run."""

    def __init__(self, batch: int, image_size: int, num_classes: int, *, batches: int, for_eval: bool = False):
        self.batch, self.image_size, self.num_classes = batch, image_size, num_classes
        self.batches, self.for_eval, self.skip = batches, for_eval, 0

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.skip = skip_batches

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        gen = torch.Generator().manual_seed(0)
        for _ in range(self.skip, self.batches):
            images = torch.randn(self.batch, 3, self.image_size, self.image_size, generator=gen)
            labels = torch.randint(0, self.num_classes, (self.batch,), generator=gen)
            if self.for_eval:  # the eval loader's (images, labels, real-sample mask, keys)
                yield images, labels, torch.ones(self.batch, dtype=torch.bool), [""] * self.batch
            else:
                yield images, labels


def build_model(cfg: TrainConfig, world: int) -> nn.Module:
    """The zoo model with PyTorch's BatchNorm (the engine's ``prepare`` converts it), the
    same on every rank (checked)."""
    torch.manual_seed(cfg.train.seed)  # the same initial model on every rank
    model = models.create(cfg.model.name, num_classes=cfg.model.num_classes, norm=KEEP, activation=None)
    agree_on_setup(cfg, model, world)
    return model


def build_loaders(cfg: TrainConfig, rank: int, world: int, per_rank: int) -> tuple[TrainLoader, EvalLoader | None]:
    """The WebDataset train loader (this rank's shards, shuffled per epoch, resumable) and the
    exact-once eval loader."""
    d = cfg.data
    index = ShardIndex.load(d.train_index)
    class_sorted = index.class_sorted_shards()
    if class_sorted and rank == 0:
        logger.warning(
            "%d of %d training shards hold only one or two classes (e.g. %s): they were written in class "
            "order, so batches are not mixed and batch statistics are biased. Rewrite them with "
            "distnorm-shards, which writes samples in a seeded random order.",
            len(class_sorted), len(index.shards), class_sorted[:3])
    options = d.loader_options()  # the data section is a LoaderSpec: every loader setting, one owner
    train_loader = TrainLoader(d.train_shards, num_samples=index.total, batch_size=per_rank, rank=rank,
                               world_size=world, seed=cfg.train.seed, **options)
    eval_loader = None
    if d.val_shards:
        eval_loader = EvalLoader(d.val_shards, index=d.val_index, batch_size=d.eval_batch_size or per_rank, rank=rank,
                                 world_size=world, **{**options, "num_workers": d.eval_workers})
    return train_loader, eval_loader


def _dry_run_config(cfg: TrainConfig) -> TrainConfig:
    """Two training steps (one short epoch), then an evaluation; no progress bar."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=2, eval_every_epochs=1),
                               output=dataclasses.replace(cfg.output, progress=False))


@dataclass
class Position:
    """Where a run is: written into every checkpoint and restored on resume."""

    epoch: int = 0
    step_in_epoch: int = 0  # batches of ``epoch`` already trained (a mid-epoch checkpoint)
    global_step: int = 0

    def snapshot(self, world: int) -> dict[str, int]:
        """What a checkpoint records (with the world size the data position belongs to)."""
        return {**dataclasses.asdict(self), "world_size": world}


@dataclass
class Reporting:
    """Where a run's records go: metrics, the console's progress bar, theory monitors, and
    checkpoints (``save(position)``)."""

    writer: MetricsWriter
    progress: _Progress
    monitor: TheoryMonitor | None
    save: Callable[[Position], None]


def train_one_epoch(cfg: TrainConfig, engine: Any, loader: Any, position: Position, report: Reporting, *,
                    world: int, max_steps: int, loss_fn: nn.Module) -> float:
    """Train ``position.epoch`` from batch ``position.step_in_epoch`` (a mid-epoch resume)
    until its end or ``max_steps``, advancing ``position``; returns the last learning rate."""
    epoch, per_rank = position.epoch, cfg.per_rank_batch(world)
    loader.set_epoch(epoch, skip_batches=position.step_in_epoch)
    engine.model.train()
    lr, seen, loss_sum, window = engine.lr(), 0, 0.0, time.time()
    amat = next((m for m in engine.plugin.model.modules() if getattr(m, "amat", False)), None)  # logs AMAT's eta
    for images, labels in to_device(loader, engine.device, cfg.data.device_prefetch):
        step = position.global_step + 1
        position.step_in_epoch += 1
        images = engine.cast_inputs(images.to(engine.device, non_blocking=True))
        labels = labels.to(engine.device, non_blocking=True)
        with _phase("forward", epoch, step):
            loss = loss_fn(engine.model(images).float(), labels)
            loss_value = loss.item()  # the step's one host sync (logging and the NaN check)
            finite = _all_finite(loss_value, world, loss.device)
        if not finite:
            if cfg.train.on_nonfinite == "stop":
                raise FloatingPointError(
                    f"non-finite loss at epoch {epoch}, step {step} (on at least one rank); "
                    "set train.debug=true to name the first layer with non-finite statistics, or "
                    "train.on_nonfinite=skip to skip such steps")
            report.writer.log("skipped_step", step=step, epoch=epoch, reason="non-finite loss")
            continue
        with _phase("backward", epoch, step):
            engine.backward(loss)
        if report.monitor is not None:
            report.monitor.after_backward(step)
        lr = engine.lr()
        with _phase("optimizer step", epoch, step):
            engine.step()
        position.global_step = step
        if report.monitor is not None:
            for record in report.monitor.records(step):
                report.writer.log("monitor", epoch=epoch, **record)
        loss_sum += loss_value
        seen += 1
        if step % cfg.output.log_every == 0 or step == max_steps:
            ips = seen * per_rank * world / max(time.time() - window, 1e-9)
            eta = {"amat_eta": amat.eta} if amat is not None else {}  # the weight AMAT gave history this step
            report.writer.log("train", step=step, epoch=epoch, loss=loss_sum / seen, lr=lr, images_per_sec=ips, **eta)
            report.progress.update(loss=f"{loss_sum / seen:.4f}", lr=f"{lr:.4g}", img_s=f"{ips:.0f}")
            seen, loss_sum, window = 0, 0.0, time.time()
        else:
            report.progress.update()
        every = cfg.output.checkpoint_every_steps
        if every and step % every == 0 and position.step_in_epoch < len(loader):
            report.save(position)
        if step >= max_steps:
            break
    _report_skipped(loader, epoch, position.global_step, report, world, engine)
    return lr


def _report_skipped(loader: Any, epoch: int, step: int, report: Reporting, world: int, engine: Any) -> None:
    """``data.on_error=skip``: the samples and shards the ranks skipped this epoch, summed (one
    tiny all-reduce on every rank, skipped or not), in metrics.jsonl and on the console."""
    count = torch.tensor([float(getattr(loader, "skipped", 0))], dtype=torch.float64, device=engine.device)
    if world > 1:
        _collectives.all_reduce_sum(count, _collectives.sync_group(None), slot="trainer|skipped samples")
    total = int(count.item())
    if total:
        first = list(getattr(loader, "skip_messages", []))[:3]
        report.writer.log("data_skipped", step=step, epoch=epoch, count=total, first=first)
        if engine.is_main:
            print(f"epoch {epoch + 1}: skipped {total} unreadable sample(s) or shard(s) on all ranks "
                  f"(data.on_error=skip); first here: {'; '.join(first) or 'on other ranks'}", flush=True)


def _synthetic_loaders(cfg: TrainConfig, batch: int) -> tuple[Any, Any]:
    """Two synthetic training batches and one evaluation batch (the dry run)."""
    size, classes = cfg.data.image_size, cfg.model.num_classes
    return (SyntheticLoader(batch, size, classes, batches=2),
            SyntheticLoader(batch, size, classes, batches=1, for_eval=True))


def _resume(cfg: TrainConfig, checkpoints: CheckpointManager, engine: Any, writer: MetricsWriter,
            world: int) -> Position:
    """The position of the newest checkpoint every rank can verify (loaded into the engine),
    or the start. A checkpoint of another world size (``train.resume_world_size=allow``)
    goes on at the start of the next epoch unless it was taken at an epoch's end."""
    found = checkpoints.find_resumable()
    _agree_on_resume(found, world, allow_other_world=cfg.train.resume_world_size == "allow",
                     per_rank_engine=None if engine.resumes_on_any_world_size else cfg.train.engine)
    if found is None:
        return Position()
    directory, _ = found
    state = engine.load(directory)
    position = Position(state["epoch"], state["step_in_epoch"], state["global_step"])
    saved_world = state.get("world_size", world)
    extra: dict[str, Any] = {}
    if saved_world != world:
        extra = {"world_size": world, "world_size_from": saved_world, "state_digest": engine.state_digest()}
        note = _other_world_note(cfg, position, saved_world, world)
        warnings.warn(note, stacklevel=2)
        if position.step_in_epoch:
            position = Position(position.epoch + 1, 0, position.global_step)
    if engine.is_main:
        logger.info("resumed from %s at epoch %d, step %d", directory, position.epoch, position.global_step)
        print(f"resumed from {directory} (epoch {position.epoch}, global step {position.global_step})", flush=True)
    writer.log("resume", checkpoint=str(directory), **{**state, **dataclasses.asdict(position), **extra})
    return position


def _other_world_note(cfg: TrainConfig, position: Position, saved: int, world: int) -> str:
    """What changes when a checkpoint of ``saved`` processes goes on with ``world``."""
    batch = cfg.train.global_batch_size
    where = (f"the rest of epoch {position.epoch} ({position.step_in_epoch} of its batches were done) is skipped: "
             f"training goes on at the start of epoch {position.epoch + 1}" if position.step_in_epoch
             else f"the checkpoint ends epoch {position.epoch - 1}: nothing is skipped")
    return (f"resuming a checkpoint of {saved} process(es) with {world} (train.resume_world_size=allow): the weights "
            f"and optimizer state carry over; the global batch stays {batch} ({batch // world} per process instead "
            f"of {batch // saved}), so the learning rate is not rescaled; each process reads other shards, so the "
            f"sample order differs from an uninterrupted run; {where}; global step {position.global_step} and the "
            "schedule continue from the checkpoint.")


def _end_of_epoch(cfg: TrainConfig, engine: Any, eval_loader: Any, position: Position, report: Reporting,
                  lr: float, started: float, last_eval: dict[str, Any]) -> dict[str, Any]:
    """After epoch ``position.epoch``: evaluate when due, print and log the summary,
    checkpoint at the start of the next epoch; returns the latest evaluation."""
    epoch = position.epoch + 1  # epochs done
    if eval_loader is not None and (epoch % cfg.train.eval_every_epochs == 0 or epoch == cfg.train.epochs):
        last_eval = evaluate(engine.eval_model(), eval_loader, device=engine.device, process_group=None,
                             cast=engine.cast_inputs, prefetch=cfg.data.device_prefetch)
        report.writer.log("eval", step=position.global_step, epoch=epoch, **last_eval)
    if engine.is_main:
        summary = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in last_eval.items())
        print(f"epoch {epoch}/{cfg.train.epochs}: lr {lr:.4g}, {summary or 'no evaluation'}", flush=True)
    report.writer.log("epoch", step=position.global_step, epoch=epoch, lr=lr, seconds=time.time() - started,
                      **{f"val_{k}": v for k, v in last_eval.items()})
    position.epoch, position.step_in_epoch = epoch, 0
    report.save(position)
    return last_eval


def train(cfg: TrainConfig, *, dry_run: bool = False, dry_run_batch: int | None = None) -> dict[str, Any]:
    """Run the recipe; returns the last evaluation metrics (and run facts).

    ``dry_run``: build everything (model, engine, conversion), train two steps on synthetic
    batches and evaluate one; no metrics, checkpoints or resume. A run stopped by
    ``train.max_steps`` writes a checkpoint there (as Lightning does), so rerunning the
    command with a larger ``max_steps`` continues from it.
    """
    rank, world = local_world()
    check_setup(cfg, world, data=not dry_run, warn=rank == 0)
    if dry_run:
        cfg = _dry_run_config(cfg)
    per_rank = cfg.per_rank_batch(world)
    if cfg.train.debug:
        distnorm.debug(True)
    init_distributed(cfg)
    model = build_model(cfg, world)
    train_loader, eval_loader = (_synthetic_loaders(cfg, dry_run_batch or per_rank) if dry_run
                                 else build_loaders(cfg, rank, world, per_rank))
    engine = make_engine(cfg, model, len(train_loader))

    run_dir, main, outputs = Path(cfg.output.dir), engine.is_main, not dry_run
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.save(run_dir / "config.yaml")
    writer = MetricsWriter(run_dir, enabled=main and outputs, tensorboard=cfg.output.tensorboard)
    checkpoints = CheckpointManager(run_dir / "checkpoints", cfg.output.keep_last, main, engine.barrier,
                                    gather=_gather_texts if world > 1 else None)
    position = _resume(cfg, checkpoints, engine, writer, world) if outputs else Position()

    def save(at: Position) -> None:
        path = checkpoints.save(at.global_step, at.snapshot(world), engine.save)
        writer.log("checkpoint", step=at.global_step, epoch=at.epoch, path=str(path))

    total_steps = cfg.train.epochs * len(train_loader)
    max_steps = min(total_steps, cfg.train.max_steps or total_steps)
    monitor = (TheoryMonitor(engine.plugin.model, every=cfg.output.monitor_every)
               if cfg.output.monitors and main and outputs else None)
    report = Reporting(writer, _Progress(main and cfg.output.progress, max_steps, position.global_step, cfg.model.name),
                       monitor, save if outputs else (lambda _: None))
    last_eval: dict[str, Any] = {}
    lr, started = engine.lr(), time.time()
    try:
        while position.epoch < cfg.train.epochs and position.global_step < max_steps:
            lr = train_one_epoch(cfg, engine, train_loader, position, report, world=world, max_steps=max_steps,
                                 loss_fn=nn.CrossEntropyLoss())
            if position.step_in_epoch < len(train_loader):
                break  # max_steps reached mid-epoch
            last_eval = _end_of_epoch(cfg, engine, eval_loader, position, report, lr, started, last_eval)
        # Stopped by max_steps mid-epoch (an epoch's end has just saved): keep the work done.
        if outputs and position.global_step and checkpoints.latest_step() != position.global_step:
            report.save(position)
    finally:
        report.progress.close()
        writer.close()
    latest = checkpoints.latest() if outputs else None
    # The trained model as plain torch.nn beside the checkpoints (distnorm.train.frozen).
    frozen = write_frozen(engine.eval_model(), run_dir, cfg.data.image_size) if outputs and main else []
    return {"eval": last_eval, "global_step": position.global_step, "run_dir": str(run_dir),
            "checkpoint": str(latest) if latest else None, "world_size": world, "per_rank_batch": per_rank,
            "frozen": [str(path) for path in frozen]}


def evaluate_only(cfg: TrainConfig, path: str) -> dict[str, Any]:
    """``distnorm-train --evaluate PATH``: the frozen model at ``path`` (written by a run,
    :mod:`distnorm.train.frozen`) over the recipe's evaluation shards, on this process's
    device, the ranks of a launcher sharing the shards exactly once."""
    rank, world = local_world()
    d = cfg.data
    if not d.val_shards:
        raise ConfigError("--evaluate needs evaluation shards: set data.val_shards and data.val_index")
    if world > 1:
        init_distributed(cfg)
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available()
              else torch.device("cpu"))
    loader = EvalLoader(d.val_shards, index=d.val_index, batch_size=d.eval_batch_size or cfg.per_rank_batch(world),
                        rank=rank, world_size=world, **{**d.loader_options(), "num_workers": d.eval_workers})
    return evaluate_frozen(path, loader, device)
