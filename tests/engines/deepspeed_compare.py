"""DeepSpeed on 2 ranks against one plain-PyTorch process, for every model kind distnorm
offers a DeepSpeed user, with the plugin and without it.

Without the plugin ("bare"), the natural script: build the model, :func:`distnorm.convert`
it (and :func:`distnorm.bnp.attach`), hand it to ``deepspeed.initialize``, and give AMAT the
engine's learning rate with ``distnorm.set_lr(engine, engine.get_lr()[0])`` before each
step. With it: ``dn.prepare(model, config)`` then ``plugin.follow(engine)``.

:func:`worker` runs in each of 2 gloo ranks (``tests.distributed.run_distributed``) and trains
every kind on both paths in that one process group — one DeepSpeed import and one spawn
for eight trainings. :func:`reference` trains the same kind in a plain process on the
concatenated batches: ``torch.optim.SGD`` and ``LambdaLR``, nothing of DeepSpeed's.

Gradient clipping is part of the comparison: DeepSpeed 0.19 clips the global gradient norm
to 1.0 unless the config says otherwise (``GRADIENT_CLIPPING_DEFAULT = 1.0`` in
``deepspeed/runtime/constants.py``), a plain loop does not. Left at that default, a
DeepSpeed run equals one process only if the reference clips too — the whole of the
"synchronized CBN under DeepSpeed differs from one process" report
(``shared/evidence/deepspeed-cbn-mismatch.md``). Each run states its ``clip``; the
reference applies the same with ``clip_grad_norm_``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import distnorm
from distnorm.specs import BNPSpec, CBNSpec
from tests.engines.small_train import NUM_CLASSES
from tests.engines.small_train import make_model as base_model  # the same small CNN

#: Model kinds: what ``dn.prepare`` is given (a DistNormConfig's norm / spec and BNP) and
#: what the bare script does by hand with the same objects.
KINDS: dict[str, dict[str, Any]] = {
    "syncbn": {"norm": "bn", "bnp": None},                      # synchronized BatchNorm
    "cbn": {"norm": CBNSpec(rho=2.0), "bnp": None},             # CBN with AMAT (eta 0.5 -> 0.83)
    "popnorm": {"norm": "popnorm", "bnp": None},                # POP-Norm
    "bnp+gn": {"norm": "gn", "bnp": BNPSpec()},                 # BNP on a GroupNorm model
}
STEPS = 4
GLOBAL_BATCH = 8
LR = 0.05


def lr_factor(step: int) -> float:
    return 0.7 ** step  # lr 0.05, 0.035, ...: AMAT's eta = 1 - 10 lr moves every step


def bare_model(kind: str) -> nn.Module:
    """The model as a script without the plugin builds it."""
    spec = KINDS[kind]
    model = distnorm.convert(base_model(), norm=spec["norm"])
    if spec["bnp"] is not None:
        spec["bnp"].attach(model)
    return model


def plugin_config(kind: str) -> distnorm.DistNormConfig:
    spec = KINDS[kind]
    norm = spec["norm"]
    fields: dict[str, Any] = {"bnp": spec["bnp"], "check_every": 1}  # the full check at every step
    if isinstance(norm, CBNSpec):
        fields.update(norm="cbn", cbn=norm)
    else:
        fields["norm"] = norm
    return distnorm.DistNormConfig(**fields)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    scale = torch.tensor([1.0, 2.0, 0.5]).view(1, 3, 1, 1)  # per-channel scales and offsets
    shift = torch.tensor([0.3, -1.0, 2.0]).view(1, 3, 1, 1)
    x = torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=gen) * scale + shift
    return x, torch.randint(0, NUM_CLASSES, (GLOBAL_BATCH,), generator=gen)


def record(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    return {"params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "buffers": {k: v.detach().clone() for k, v in model.named_buffers()}}


def reference(kind: str, clip: float) -> dict[str, Any]:
    """One plain process on the whole batches (call it where torch.distributed is not
    initialised, so the layers run locally)."""
    model = bare_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    losses, lrs, norms = [], [], []
    for step in range(STEPS):
        x, y = global_batch(step)
        lrs.append(opt.param_groups[0]["lr"])
        distnorm.set_lr(model, lrs[-1])
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        sched.step()
        losses.append(loss.item())
    return {"losses": losses, "lrs": lrs, "grad_norms": norms, **record(model)}


def _train(rank: int, world: int, kind: str, use_plugin: bool, zero: int, clip: float) -> dict[str, Any]:
    import deepspeed

    import distnorm.integrations.deepspeed as dn

    if use_plugin:
        model = base_model()
        plugin = dn.prepare(model, plugin_config(kind))
    else:
        model, plugin = bare_model(kind), None
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": zero, "stage3_param_persistence_threshold": 0},  # ZeRO-3: shard every parameter
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=config)
    if plugin is not None:
        plugin.follow(engine)
    per_rank = GLOBAL_BATCH // world
    losses, lrs = [], []
    for step in range(STEPS):
        x, y = global_batch(step)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        lrs.append(engine.get_lr()[0])
        if plugin is None:
            distnorm.set_lr(engine, lrs[-1])  # the bare script's one distnorm line per step
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    out: dict[str, Any] = {"losses": losses, "lrs": lrs}
    # What the consistency check compares here: every buffer always; parameters where they
    # are replicated (not ZeRO-3's shards); SGD's momentum where the client optimizer keeps it.
    out["checked"] = distnorm.check_consistency(model, parameters=True, optimizer=engine.optimizer)
    out["buffers_checked"] = distnorm.check_consistency(model)
    if zero == 3:
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            out.update(record(model))
    else:
        out.update(record(model))
    if use_plugin and zero == 0 and kind == "cbn":
        out["drift_error"] = _drift_is_caught(rank, engine, model)
    return out


def _drift_is_caught(rank: int, engine: Any, model: nn.Module) -> tuple[str, str]:
    """Rank 1 alone changes a conv weight; the plugin's check at the next training forward
    must stop both ranks, naming it. Returns the weight's name and the error."""
    name, weight = next((n, p) for n, p in model.named_parameters() if p.dim() == 4)
    if rank == 1:
        with torch.no_grad():
            weight.view(-1)[0] += 1e-6
    x, _ = global_batch(0)
    try:
        engine(x[:4])
    except distnorm.InconsistentStateError as err:
        return name, str(err)
    raise AssertionError("a weight changed on one rank was not detected")


def worker(rank: int, world: int, zero: int, clip: float) -> dict[str, dict[str, Any]]:
    """Every kind, bare and with the plugin, under DeepSpeed ZeRO-``zero``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world))
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return {f"{kind}/{'plugin' if use_plugin else 'bare'}": _train(rank, world, kind, use_plugin, zero, clip)
            for kind in KINDS for use_plugin in (False, True)}
