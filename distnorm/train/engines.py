"""The two engines the recipe runs on, behind one small interface.

Both build on the plugin API (:mod:`distnorm.integrations`) — the recipe has no second code
path for distnorm: the model is created with PyTorch's BatchNorm and the plugin converts
it exactly as it would in a user's script.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from distnorm.plugin import DistNormPlugin
from distnorm.train.checks import require_engine
from distnorm.train.config import ConfigError, TrainConfig

__all__ = ["Engine", "AccelerateEngine", "DeepSpeedEngine", "make_engine", "require_engine"]


class Engine:
    """What the training loop needs from an engine."""

    rank: int
    world_size: int
    device: torch.device
    plugin: DistNormPlugin
    model: nn.Module  # what to call for training forwards

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def lr(self) -> float:
        raise NotImplementedError

    def eval_model(self) -> nn.Module:
        raise NotImplementedError

    def cast_inputs(self, images: torch.Tensor) -> torch.Tensor:
        return images

    def save(self, directory: Path, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def load(self, directory: Path) -> dict[str, Any]:
        raise NotImplementedError

    #: Whether a checkpoint written by another number of processes loads (train.resume_world_size).
    resumes_on_any_world_size = False

    def barrier(self) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()


def _optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    o = cfg.optim
    return torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, nesterov=o.nesterov,
                           weight_decay=o.weight_decay)


def lr_multiplier(cfg: TrainConfig, steps_per_epoch: int) -> Callable[[int], float]:
    """Step-wise multiplier: linear warm-up, then ÷(1/gamma) at each milestone epoch."""
    o = cfg.optim
    warmup_steps = int(round(o.warmup_epochs * steps_per_epoch))

    def multiplier(step: int) -> float:
        epoch = step // steps_per_epoch
        decay = o.gamma ** sum(epoch >= m for m in o.milestones)
        if step < warmup_steps:
            return decay * (o.warmup_start_factor + (1 - o.warmup_start_factor) * step / warmup_steps)
        return decay

    return multiplier


def deepspeed_input_dtype(model: Any) -> torch.dtype | None:
    """The input dtype a DeepSpeed engine running in bf16 / fp16 expects (its weights are in
    it), or ``None`` for fp32 or any other model. Applies to a DeepSpeed engine built by
    Accelerate too (``launch/accelerate/deepspeed.yaml``)."""
    if not callable(getattr(model, "bfloat16_enabled", None)):
        return None
    if model.bfloat16_enabled():
        return torch.bfloat16
    return torch.float16 if model.fp16_enabled() else None


class AccelerateEngine(Engine):
    name = "accelerate"
    # Accelerate writes the (DDP-replicated) model and optimizer state once; only its
    # per-process RNG files are per rank, and a missing one is skipped at load.
    resumes_on_any_world_size = True

    def __init__(self, cfg: TrainConfig, model: nn.Module, steps_per_epoch: int):
        from accelerate import Accelerator

        import distnorm.integrations.accelerate as dn  # imports accelerate (optional)

        cpu = cfg.train.cpu or not torch.cuda.is_available()
        # One scheduler step per optimizer step (Accelerate's default steps it once per
        # process), so the schedule is the same for every number of processes.
        self.accelerator = Accelerator(cpu=cpu, mixed_precision={"fp32": "no"}.get(cfg.train.precision, cfg.train.precision),
                                       step_scheduler_with_optimizer=False)
        self.plugin = dn.prepare(model, cfg.distnorm, self.accelerator)
        optimizer = _optimizer(cfg, model)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(cfg, steps_per_epoch))
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self.plugin.follow(self.optimizer)
        self.rank, self.world_size = self.accelerator.process_index, self.accelerator.num_processes
        self.device = self.accelerator.device
        # Accelerate driving DeepSpeed with bf16 / fp16 (launch/accelerate/deepspeed.yaml) hands
        # back a model whose weights are in that dtype and which expects inputs in it too.
        self._input_dtype = deepspeed_input_dtype(self.model)

    def cast_inputs(self, images: torch.Tensor) -> torch.Tensor:
        return images if self._input_dtype is None else images.to(self._input_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def eval_model(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model)

    def save(self, directory: Path, state: dict[str, Any]) -> None:
        self.accelerator.save_state(str(directory))
        if self.is_main:
            (directory / "trainer_state.json").write_text(json.dumps(state))

    def load(self, directory: Path) -> dict[str, Any]:
        self.accelerator.load_state(str(directory))
        return json.loads((directory / "trainer_state.json").read_text())

    def state_digest(self) -> str:
        """SHA-256 of the model's and the optimizer's state (what a checkpoint carries)."""
        return state_digest(self.eval_model().state_dict(), self.optimizer.state_dict())


class DeepSpeedEngine(Engine):
    name = "deepspeed"

    def __init__(self, cfg: TrainConfig, model: nn.Module, steps_per_epoch: int):
        import deepspeed

        import distnorm.integrations.deepspeed as dn  # imports deepspeed (optional)

        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() and not cfg.train.cpu else "gloo")
        world = torch.distributed.get_world_size()
        ds_config = json.loads(Path(cfg.train.deepspeed_config).read_text())
        # The recipe owns batch size, optimizer and schedule; the JSON owns ZeRO and precision.
        ds_config["train_micro_batch_size_per_gpu"] = cfg.per_rank_batch(world)
        ds_config["gradient_accumulation_steps"] = 1
        ds_config.pop("train_batch_size", None)
        for owned in ("optimizer", "scheduler"):
            if owned in ds_config:
                raise ConfigError(
                    f"{cfg.train.deepspeed_config}: remove the {owned!r} section; the recipe's optim section "
                    "defines the optimizer and learning-rate schedule"
                )
        ds_config.setdefault("zero_allow_untested_optimizer", True)
        # DeepSpeed clips the global gradient norm to 1.0 unless told otherwise; the recipe
        # does not clip on the other engines, so the same config trains the same way on each.
        ds_config.setdefault("gradient_clipping", 0.0)
        self.plugin = dn.prepare(model, cfg.distnorm)
        optimizer = _optimizer(cfg, model)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(cfg, steps_per_epoch))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
        self.plugin.follow(self.engine)
        self.model = self.engine
        self.rank, self.world_size = self.engine.global_rank, self.engine.world_size
        self.device = self.engine.device

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def eval_model(self) -> nn.Module:
        return self.engine  # ZeRO-3 gathers parameters in the engine's hooks

    def cast_inputs(self, images: torch.Tensor) -> torch.Tensor:
        dtype = deepspeed_input_dtype(self.engine)
        return images if dtype is None else images.to(dtype)

    def save(self, directory: Path, state: dict[str, Any]) -> None:
        # The checkpoint manager keeps its own `latest` pointer (to complete checkpoints only).
        import distnorm.integrations.deepspeed as dn

        # DeepSpeed's own hook for a script's state: the trainer's entry and the plugin's.
        self.engine.save_checkpoint(str(directory.parent), tag=directory.name,
                                    client_state=dn.client_state(self.plugin, {"trainer": state}),
                                    save_latest=False)

    def load(self, directory: Path) -> dict[str, Any]:
        import distnorm.integrations.deepspeed as dn

        path, client_state = self.engine.load_checkpoint(str(directory.parent), tag=directory.name)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint {directory}")
        return dn.restore(self.plugin, client_state)["trainer"]


def state_digest(*states: Any) -> str:
    """SHA-256 over nested state dicts: every key, and every tensor's dtype, shape and bytes."""
    digest = hashlib.sha256()

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                digest.update(str(key).encode())
                walk(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        else:
            digest.update(repr(value).encode())

    for state in states:
        walk(state)
    return digest.hexdigest()


def make_engine(cfg: TrainConfig, model: nn.Module, steps_per_epoch: int) -> Engine:
    require_engine(cfg.train.engine)
    cls = next(c for c in (AccelerateEngine, DeepSpeedEngine) if c.name == cfg.train.engine)
    return cls(cfg, model, steps_per_epoch)
