"""What a training step costs in collectives on the paths that claim "no buffer broadcast".

distnorm's buffers are computed from all-reduced statistics, so they are identical on every
rank without DDP's per-forward buffer broadcast; ``distnorm.ddp_kwargs()``, the plugin path
and the integrations switch that broadcast off. Leaving it on changes no number — the
buffers stay equal — it only adds collectives, so the tests that compare values cannot see
it. These tests count: every collective of a training step (forward, backward, optimizer
step), of any kind, through the dispatcher (:class:`tests.dispatch.CollectiveCounter`), on
2 real gloo ranks. One launch runs every path below in turn in the same two processes; the
tests read its records. Accelerate and Lightning are counted inside their own launches
(``test_integrations.py::test_two_ranks_match_one_process[accelerate]``,
``test_lightning.py``), which already start the processes those engines need.

What a step of the small CNN (``tests/engines/small_train.py``: 2 CBN after conversion)
costs with the broadcast off:

* forward: one all-reduce per synchronized layer (CBN and BNP: ``(3, C)``); the plugin's
  consistency check adds its two all-reduces every ``check_every`` training forwards only;
* backward: one all-reduce per CBN (``(2, C)``) and DDP's gradient buckets (flat, together
  one element per parameter element);
* optimizer step: nothing;
* once, in the second training forward: DDP rebuilds its gradient buckets in the order the
  first backward produced the gradients and broadcasts the new bucket assignment from rank 0
  (``Reducer::sync_bucket_indices``: two broadcasts). That is DDP's, whatever the buffers.

With the broadcast on, every forward also broadcasts the buffers (one broadcast per dtype of
coalesced buffers: three here).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distnorm
from tests.dispatch import CollectiveCounter
from tests.distributed import run_distributed
from tests.engines.small_train import global_batch, make_model

#: DDP's one-time bucket rebuild in the second training forward: two broadcasts.
REBUILD = 2
LR = 0.05
PLUGIN_STEPS, CHECK_EVERY = 4, 2


def expected_broadcasts(steps: int) -> list[int]:
    """Broadcasts per training step when no buffer is broadcast: DDP's bucket rebuild only."""
    return [REBUILD if i == 1 else 0 for i in range(steps)]


def broadcasts_per_step(steps: list[list[tuple]]) -> list[int]:
    """The number of ``broadcast_`` collectives in each step's list of calls."""
    return [sum(op == "broadcast_" for op, _ in calls) for calls in steps]


def checks_per_step(steps: list[list[tuple]]) -> list[int]:
    """Consistency checks in each step, counted by their first collective: the structure's
    hash, one MAX all-reduce of ``[h, ~h]`` (2 int64). No other collective of a step has
    that shape (distnorm's frames hold 3 x C + 2 x world_size, DDP's buckets every parameter)."""
    return [calls.count(("allreduce_", ((2,),))) for calls in steps]


def assert_no_buffer_broadcast(steps: list[list[tuple]], path: str) -> None:
    """Fail naming the collectives seen when any step broadcasts more than DDP's bucket rebuild."""
    got, want = broadcasts_per_step(steps), expected_broadcasts(len(steps))
    assert got == want, (
        f"{path}: broadcasts per training step {got}, expected {want} (only DDP's one-time bucket "
        f"rebuild in step 2): the buffers are broadcast every step. Collectives of step 1: "
        f"{dict(Counter(op for op, _ in steps[0]))}: {steps[0]}")


def _step_calls(model: nn.Module, ddp: nn.Module, opt: torch.optim.Optimizer, steps: int, rank: int,
                world: int, set_lr: bool) -> list[dict[str, list]]:
    """Train ``steps`` steps on this rank's slice; every step's collectives by phase."""
    loss_fn, per_rank = nn.CrossEntropyLoss(), 8 // world
    out = []
    with CollectiveCounter() as counter:
        for step in range(steps):
            x, y = global_batch(step, 8)
            x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
            if set_lr:  # the path without the plugin: AMAT's learning rate by hand
                distnorm.set_lr(model, opt.param_groups[0]["lr"])
            start = counter.mark()
            loss = loss_fn(ddp(x), y)
            forward = counter.calls[start:]
            start = counter.mark()
            loss.backward()
            backward = counter.calls[start:]
            start = counter.mark()
            opt.step()
            opt.zero_grad()
            out.append({"forward": forward, "backward": backward, "optimizer": counter.calls[start:]})
    return out


def _paths_worker(rank: int, world: int) -> dict:
    records: dict = {}
    # README's plain-DDP line without the plugin (converted model), and DDP's default (control).
    for name, kwargs in (("ddp_kwargs", distnorm.ddp_kwargs()), ("ddp_default", {})):
        model = make_model()
        distnorm.convert(model, norm="cbn")
        ddp = DDP(model, **kwargs)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
        records[name] = _step_calls(model, ddp, opt, 3, rank, world, set_lr=True)
        records[f"{name}/params"] = sum(p.numel() for p in model.parameters())
    # The plugin path (README, docs/guides/ddp.md): CBN + BNP, checked every CHECK_EVERY forwards.
    model = make_model()
    plugin = distnorm.DistNormPlugin(model, distnorm.DistNormConfig(norm="cbn", bnp=True, check_every=CHECK_EVERY))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ddp = DDP(model, **distnorm.ddp_kwargs())
    plugin.follow(opt)
    records["plugin"] = _step_calls(model, ddp, opt, PLUGIN_STEPS, rank, world, set_lr=False)
    records["plugin/layers"] = len(plugin.amat_layers) + len(plugin.bnp_handle.layers)
    with CollectiveCounter() as counter:  # the call the plugin's periodic check makes
        records["check/tensors"] = distnorm.check_consistency(model, plugin.group, parameters=True, optimizer=opt)
    records["check"] = counter.calls
    # sync_group_size=1 on 2 ranks: the statistics stay on each rank, only DDP's gradients travel.
    model = make_model()
    plugin = distnorm.DistNormPlugin(model, distnorm.DistNormConfig(norm="cbn", bnp=True, sync_group_size=1,
                                                                    check_every=1))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ddp = DDP(model, **distnorm.ddp_kwargs())
    plugin.follow(opt)
    records["subgroup"] = _step_calls(model, ddp, opt, 3, rank, world, set_lr=False)
    records["subgroup/params"] = sum(p.numel() for p in model.parameters())
    return records


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> list[dict]:
    """Every path's per-step collectives, per rank, from one 2-rank launch."""
    return run_distributed(_paths_worker, 2, tmp_path_factory.mktemp("ddp_buffers"), timeout=120)


def _flat(step: dict) -> list[tuple]:
    return step["forward"] + step["backward"] + step["optimizer"]


#: distnorm's collectives in these runs: frames of one size (distnorm._frames), the widest
#: layer's payload (3 x 8 channels) and 2 fingerprint entries per rank (2 ranks).
FRAME = ((3 * 8 + 2 * 2,),)


def _gradient_buckets(calls: list[tuple]) -> list[tuple]:
    """DDP's gradient all-reduces: flat (1-D) buckets other than distnorm's frames."""
    return [c for c in calls if c[0] == "allreduce_" and c[1] != FRAME and all(len(shape) == 1 for shape in c[1])]


def _bucket_elements(calls: list[tuple]) -> int:
    return sum(shape[0] for _, shapes in _gradient_buckets(calls) for shape in shapes)


@pytest.mark.timeout(300)
@pytest.mark.world_size(2)
def test_ddp_kwargs_step_broadcasts_no_buffers(paths):
    """README: ``DistributedDataParallel(model, **distnorm.ddp_kwargs())  # no buffer
    broadcast``. A training step (forward, backward, optimizer step) on 2 gloo ranks: the
    forward carries only the CBN all-reduces, the backward the CBN all-reduces and DDP's
    gradient buckets, the optimizer step nothing. DDP's default on the same model is counted
    too: its buffer broadcast is there in every step, so this counter sees it.
    ``ddp_kwargs()`` must turn the broadcast off: with ``{}`` or ``{"broadcast_buffers": True}``
    the buffers stay equal, with one more collective per forward that no value test sees."""
    for rank, records in enumerate(paths):
        steps = records["ddp_kwargs"]
        assert_no_buffer_broadcast([_flat(s) for s in steps], f"rank {rank}, DDP(**ddp_kwargs())")
        for i, step in enumerate(steps):
            # the group's vote on the kernels at its first step (the first path of the launch), then
            # the two CBN layers' statistics
            layers = 3 if i == 0 else 2
            forward = [c for c in step["forward"] if c[0] != "broadcast_"]
            assert [op for op, shapes in forward] == ["allreduce_"] * layers, (rank, i, step["forward"])
            assert [shapes for _, shapes in forward] == [FRAME] * layers, (rank, i, forward)
            assert [c for c in step["backward"] if c not in _gradient_buckets(step["backward"])] == \
                [("allreduce_", FRAME)], (rank, i, step["backward"])
            assert _bucket_elements(step["backward"]) == records["ddp_kwargs/params"], (rank, i, step["backward"])
            assert step["optimizer"] == [], (rank, i, step["optimizer"])
        default = broadcasts_per_step([_flat(s) for s in records["ddp_default"]])
        assert all(g > w for g, w in zip(default, expected_broadcasts(len(default)))), (
            f"rank {rank}: DDP's default did not broadcast the buffers in every step ({default}): the "
            "counter no longer sees DDP's buffer broadcast, so the test above proves nothing")


@pytest.mark.timeout(300)
@pytest.mark.world_size(2)
def test_plugin_step_broadcasts_no_buffers_and_checks_every_n_forwards(paths):
    """README / docs/guides/ddp.md: the plugin path (``DistNormPlugin`` + DDP with
    ``ddp_kwargs()`` + ``follow``) broadcasts no buffer, and compares buffers, parameters and
    optimizer state "every ``check_every`` training forwards": the check's collectives appear
    in forwards 2 and 4 of 4 (``check_every=2``) and nowhere else; the other forwards carry
    only the layers' all-reduces (CBN and BNP). So the buffer broadcast is off, the check does
    not run at every forward, and the buffers are not re-broadcast at every forward (the
    after-a-load resynchronisation is cleared once done)."""
    for rank, records in enumerate(paths):
        steps, check, layers = records["plugin"], records["check"], records["plugin/layers"]
        assert_no_buffer_broadcast([_flat(s) for s in steps], f"rank {rank}, plugin + DDP(**ddp_kwargs())")
        first = steps[0]["forward"]
        assert [op for op, _ in first] == ["allreduce_"] * layers, (
            f"rank {rank}: the first forward should carry one all-reduce per synchronized layer ({layers}), "
            f"no consistency check (check_every={CHECK_EVERY}); got {first}")
        for i, step in enumerate(steps):
            forward = [c for c in step["forward"] if c[0] != "broadcast_"]
            checked = (i + 1) % CHECK_EVERY == 0
            want = (check if checked else []) + first
            assert forward == want, (
                f"rank {rank}, forward {i + 1} (check_every={CHECK_EVERY}): expected "
                f"{'the consistency check, then ' if checked else ''}the layers' all-reduces {want}; got {forward}")
            assert step["backward"] == steps[0]["backward"] and step["optimizer"] == [], (rank, i, step)


@pytest.mark.timeout(300)
@pytest.mark.world_size(2)
def test_consistency_check_costs_two_all_reduces(paths):
    """docs/reference/layers.md: ``check_consistency`` — "one fixed-size collective compares
    the model structure, one compares a 64-bit fingerprint of every buffer, and only on a
    mismatch are the divergent tensors gathered". Counted for the plugin's periodic check
    (buffers, parameters and the optimizer's state) on consistent ranks. Nothing is gathered
    when every fingerprint agrees (the answers would be right, at the cost of the whole model's
    traffic at every check)."""
    for rank, records in enumerate(paths):
        check, tensors = records["check"], records["check/tensors"]
        # all_agree: one MAX all-reduce of [v, ~v] for int64 v: the structure's hash (2 elements),
        # then one 64-bit fingerprint per compared tensor (2 x tensors elements)
        assert check == [("allreduce_", ((2,),)), ("allreduce_", ((2 * tensors,),))], (
            f"rank {rank}: a passing check of {tensors} tensors should cost two all-reduces (the structure's "
            f"hash, then the fingerprints); got {check}")


@pytest.mark.timeout(300)
@pytest.mark.world_size(2)
def test_sync_group_size_keeps_the_statistics_inside_the_group(paths):
    """docs/reference/plugin.md: "``sync_group_size=k`` synchronizes within groups of ``k``
    consecutive ranks". With ``k = 1`` on 2 ranks — the cheapest split that makes a collective
    across groups visible — CBN, BNP and the consistency check (every forward here) stay on
    each rank: a step's only collectives are DDP's gradient buckets (and its one-time bucket
    rebuild). The plugin's subgroup reaches the layers and BNP; without it they all-reduce
    across every rank: the per-node traffic the option exists to avoid."""
    for rank, records in enumerate(paths):
        steps = records["subgroup"]
        assert_no_buffer_broadcast([_flat(s) for s in steps], f"rank {rank}, sync_group_size=1")
        for i, step in enumerate(steps):
            calls = [c for c in _flat(step) if c[0] != "broadcast_"]
            assert calls == _gradient_buckets(step["backward"]), (
                f"rank {rank}, step {i + 1}: with sync_group_size=1 only DDP's gradient buckets may cross "
                f"ranks; got {calls}")
            assert _bucket_elements(step["backward"]) == records["subgroup/params"], (rank, i, step["backward"])
