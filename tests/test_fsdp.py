"""distnorm inside torch FSDP on 2 CPU ranks (gloo): ``fully_shard`` (FSDP2) and
``FullyShardedDataParallel`` (FSDP1, ``device_id=torch.device("cpu")``, with and without
``use_orig_params``), each PreNorm (CBN + conv) its own FSDP unit. Converted before
sharding, trained on split batches, the ranks must match one plain process on the
concatenated batch (float64): losses, AMAT's eta, the full state dict gathered through
``torch.distributed.checkpoint.state_dict`` (every parameter and buffer), and distnorm's
buffers bit-identical on every rank.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import distnorm
from distnorm.convert import PreNorm
from tests.distributed import run_distributed
from tests.engines.lightning_train import global_batch, make_model, warmup_decay

TOL = dict(atol=1e-10, rtol=1e-10)  # float64: measured <= 2e-15
STEPS, BATCH = 4, 8


def _optimizer(model: nn.Module, groups: int):
    """SGD with momentum and a warm-up schedule; with ``groups=2`` the norms' parameters get
    their own group at a third of the learning rate (AMAT must follow that group)."""
    params = list(model.named_parameters())
    if groups == 1:
        spec = [{"params": [p for _, p in params]}]
    else:
        is_norm = [".norm." in f".{n}" for n, _ in params]
        spec = [{"params": [p for (_, p), norm in zip(params, is_norm) if norm], "lr": 0.05 / 3},
                {"params": [p for (_, p), norm in zip(params, is_norm) if not norm]}]
    optimizer = torch.optim.SGD(spec, lr=0.05, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_decay)


def _shard(model: nn.Module, kind: str) -> nn.Module:
    """Wrap ``model`` (already converted) as ``kind``; each PreNorm and the classifier is an
    FSDP unit of its own, the rest goes to the root unit."""
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for module in model.modules():
            if isinstance(module, (PreNorm, nn.Linear)):
                fully_shard(module, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=kind == "fsdp1-orig",
                                    auto_wrap_policy=ModuleWrapPolicy({PreNorm, nn.Linear}))


def _full_state(wrapped: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _train(model, wrapped, optimizer, scheduler, rank, world, steps):
    seen = {"losses": [], "lrs": [], "etas": []}
    per_rank = BATCH // world
    amat = [m for m in model.modules() if isinstance(m, distnorm.CBN)]
    for step in steps:
        x, y = global_batch(step, BATCH)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        loss = nn.functional.cross_entropy(wrapped(x), y)
        loss.backward()
        seen["losses"].append(loss.item())
        seen["lrs"].append([g["lr"] for g in optimizer.param_groups])
        seen["etas"].append([m.eta for m in amat])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return seen


def _sharded_run(rank: int, world: int, kind: str, flags: dict, groups: int, resume_at: int | None) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)

    full = StateDictOptions(full_state_dict=True)

    def build(seed_noise: bool):
        model = make_model()
        if seed_noise:  # a fresh process's different initial weights: the load must replace them
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        plugin = distnorm.DistNormPlugin(model, distnorm.DistNormConfig(check_every=1, **flags))
        wrapped = _shard(model, kind)
        optimizer, scheduler = _optimizer(wrapped, groups)
        plugin.follow(optimizer)
        return model, plugin, wrapped, optimizer, scheduler

    model, plugin, wrapped, optimizer, scheduler = build(False)
    first = range(STEPS) if resume_at is None else range(resume_at)
    seen = _train(model, wrapped, optimizer, scheduler, rank, world, first)
    if resume_at is not None:  # checkpoint through FSDP's state-dict API, then a fresh model
        buf = io.BytesIO()
        torch.save({"model": _full_state(wrapped), "optimizer": get_optimizer_state_dict(wrapped, optimizer, options=full),
                    "scheduler": scheduler.state_dict(), "distnorm": plugin.state_dict()}, buf)
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=False)
        model, plugin, wrapped, optimizer, scheduler = build(True)
        set_model_state_dict(wrapped, ckpt["model"], options=full)
        set_optimizer_state_dict(wrapped, optimizer, ckpt["optimizer"], options=full)
        scheduler.load_state_dict(ckpt["scheduler"])
        plugin.load_state_dict(ckpt["distnorm"])
        seen = _train(model, wrapped, optimizer, scheduler, rank, world, range(resume_at, STEPS))
    checked = distnorm.check_consistency(model, parameters=True, optimizer=optimizer)
    local = {n: b.detach().clone() for n, b in model.named_buffers()}
    return {**seen, "state": _full_state(wrapped), "local_buffers": local, "checked": checked,
            "sharded": [n for n, p in model.named_parameters() if isinstance(p, torch.distributed.tensor.DTensor)
                        or getattr(p, "_fsdp_flattened", False)]}


def _reference(flags: dict, groups: int) -> dict:
    """One plain process on the concatenated batch."""
    model = make_model()
    plugin = distnorm.DistNormPlugin(model, distnorm.DistNormConfig(**flags))
    optimizer, scheduler = _optimizer(model, groups)
    plugin.follow(optimizer)
    seen = _train(model, model, optimizer, scheduler, 0, 1, range(STEPS))
    return {**seen, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


CASES = [
    pytest.param("fsdp2", dict(norm="cbn"), 2, None, id="fully_shard-cbn-2groups"),
    pytest.param("fsdp2", dict(norm="popnorm", bnp=True), 1, 2, id="fully_shard-popnorm-bnp-resume"),
    pytest.param("fsdp1-orig", dict(norm="cbn", bnp=True), 2, 2, id="FSDP1-orig_params-cbn-bnp-2groups-resume"),
    pytest.param("fsdp1-flat", dict(norm="cbn", bnp=True), 1, None, id="FSDP1-flat-cbn-bnp"),
]


@pytest.mark.timeout(120)
@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind, flags, groups, resume_at", CASES)
def test_sharded_ranks_match_one_process(tmp_path, kind, flags, groups, resume_at):
    """Layers inside FSDP units, on two ranks, train as one process on the whole batch
    (learning rates, etas, losses, state), with the local buffers equal across the ranks: the
    statistics are synchronized once, BNP preconditions the gathered weight (not a shard or a
    stale weight: FSDP1 puts plain views where the Parameters were), AMAT follows its
    parameter group after FSDP wrapped or flattened the parameters, the periodic consistency
    check does not compare each rank's shard as if replicated (a false
    InconsistentStateError), and a checkpoint written / read through FSDP's state-dict API
    keeps distnorm's buffers."""
    ranks = run_distributed(_sharded_run, 2, tmp_path, kind, flags, groups, resume_at, timeout=110)
    ref = _reference(flags, groups)
    first = 0 if resume_at is None else resume_at
    for r in ranks:
        assert r["sharded"], "nothing was sharded"
        assert r["checked"] > 0
        torch.testing.assert_close(torch.tensor(r["lrs"]), torch.tensor(ref["lrs"][first:]))
        torch.testing.assert_close(torch.tensor(r["etas"]), torch.tensor(ref["etas"][first:]))
        assert r["state"].keys() == ref["state"].keys()
        for name, value in ref["state"].items():
            torch.testing.assert_close(r["state"][name], value, **TOL, msg=name)
    if groups == 2 and flags["norm"] == "cbn":  # eta from the norms' group, a third of the lr
        assert ranks[0]["etas"][-1][0] == pytest.approx(1 - 10 * ranks[0]["lrs"][-1][0])
    losses = [torch.tensor(r["losses"], dtype=torch.float64) for r in (*ranks, ref)]
    torch.testing.assert_close((losses[0] + losses[1]) / 2, losses[2][first:], **TOL)
    for name, value in ranks[0]["local_buffers"].items():
        assert torch.equal(value, ranks[1]["local_buffers"][name]), f"buffer {name} differs across ranks"
    if flags.get("bnp"):
        assert any(k.endswith("bnp_var") for k in ranks[0]["state"])


def _refusals(rank: int, world: int) -> dict[str, str]:
    """Each refused combination's message (or "accepted")."""
    def message(fn, error):
        try:
            fn()
        except error as err:
            return str(err)
        return "accepted"

    model = make_model()
    plugin = distnorm.DistNormPlugin(model, distnorm.DistNormConfig(norm="cbn"))
    wrapped = _shard(model, "fsdp1-flat")
    flat = list(wrapped.parameters())
    optimizer = torch.optim.SGD([{"params": flat[:1]}, {"params": flat[1:], "lr": 0.01}], lr=0.05)
    found = {"flat-groups": message(lambda: plugin.follow(optimizer), ValueError)}
    for kind in ("fsdp1-orig", "fsdp2"):  # conversion after sharding: parameters FSDP never sees
        sharded = _shard(make_model(), kind)
        found[f"{kind}-convert"] = message(lambda: distnorm.convert(sharded, norm="cbn"), TypeError)
        found[f"{kind}-bnp"] = message(lambda: distnorm.bnp.attach(sharded), TypeError)
    return found


@pytest.mark.timeout(60)
@pytest.mark.world_size(2)
def test_combinations_that_cannot_work_are_refused(tmp_path):
    """Combinations with FSDP that cannot work are refused, saying why: ``follow()`` under FSDP1
    without use_orig_params when the optimizer's groups have different learning rates (the
    AMAT layers' weights are hidden in FlatParameters, so every layer would silently follow
    group 0), and convert or BNP applied to a model FSDP already sharded (new parameters FSDP
    never gathers, reduces or shards)."""
    for found in run_distributed(_refusals, 2, tmp_path, timeout=50):
        assert "use_orig_params=True" in found["flat-groups"] and "2 parameter groups" in found["flat-groups"], found
        assert "wrapped by torch FSDP" in found["fsdp1-orig-convert"], found
        assert "wrapped by torch FSDP (fully_shard)" in found["fsdp2-convert"], found
        assert "wrapped by torch FSDP" in found["fsdp1-orig-bnp"] and "torch FSDP" in found["fsdp2-bnp"], found
