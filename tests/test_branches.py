"""Ranks that run the synchronized layers in another order or number are named at the step.

Collectives pair by the order ranks issue them, never by layer: a branch taken on one rank
only pairs unrelated statistics (same sizes: silently) or collectives of different sizes
(gloo aborts the process, NCCL may hang). distnorm's collectives are frames of one size
with every rank's fingerprint (``distnorm._frames``): every rank raises
:class:`distnorm.CollectiveMismatchError` naming each rank's layer — on the CPU at the
collective itself, on a GPU a few collectives later or at the plugin's next check.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import distnorm
from distnorm import _frames
from tests.distributed import run_distributed
from tests.dispatch import CollectiveCounter, OpCounter

#: Each case: what rank 1 does differently, and the two slots the error must name.
CASES = {
    "other_layer": ("CBN 'b'|forward", "CBN 'c'|forward"),  # rank 1 runs c where rank 0 runs b
    "skipped_layer": ("CBN 'b'|forward", "CBN 'a'|backward"),  # rank 1 skips b
    "other_channels": ("CBN 'b'|forward", "CBN 'c'|forward"),  # ... and c has 8 channels, b 4
    "backward": ("CBN 'b'|backward", "CBN 'a'|backward"),  # rank 1's loss does not use b
}


def _layers(case: str) -> nn.ModuleDict:
    model = nn.ModuleDict({"a": distnorm.CBN(4), "b": distnorm.CBN(4),
                           "c": distnorm.CBN(8 if case == "other_channels" else 4)})
    distnorm.set_lr(model, 0.01)  # also names the layers 'a', 'b', 'c'
    return model


def _step(model: nn.ModuleDict, case: str, rank: int) -> None:
    x = torch.randn(8, 4, requires_grad=True)
    y = model["a"](x)
    if case == "backward":
        z = model["b"](y)
        (z.sum() if rank == 0 else y.sum() + 0 * z.detach().sum()).backward()
        return
    if rank == 0:
        y = model["b"](y)
    elif case == "other_layer":
        y = model["c"](y)
    elif case == "other_channels":
        y = model["c"](torch.randn(8, 8))
    y.square().sum().backward()


def _branch_worker(rank: int, world: int, debug: bool) -> dict[str, str | None]:
    """Every case in turn on the same two ranks: after an error both ranks stand at the same
    collective again (each raised at the frame it paired), so the next case starts aligned."""
    distnorm.debug(debug)
    messages: dict[str, str | None] = {}
    for case in CASES:
        model = _layers(case)
        try:
            _step(model, case, rank)
            messages[case] = None
        except distnorm.CollectiveMismatchError as err:
            messages[case] = str(err)
    return messages


@pytest.mark.world_size(2)
@pytest.mark.parametrize("debug", [False, True], ids=["debug_off", "debug_on"])
def test_every_rank_names_both_layers(tmp_path, debug):
    """Whatever rank 1 does differently (another layer of the same shape, one of other
    channels, a layer skipped, a layer left out of its loss), every rank raises
    CollectiveMismatchError naming both ranks' layers and phases, with debug mode off and on.
    With debug off this rules out a skipped layer aborting rank 1 in gloo's size check while
    rank 0 raises ``CollectiveFailedError``, another layer of the same shape mixing statistics
    with no error, and an error that names only the raising rank's layer."""
    per_rank = run_distributed(_branch_worker, 2, tmp_path, debug, timeout=120)
    for rank, messages in enumerate(per_rank):
        for case, names in CASES.items():
            message = messages[case]
            assert message is not None, f"rank {rank}, {case}: no error"
            for name in names:
                layer, phase = name.split("|")
                assert layer in message and phase in message, (rank, case, name, message)


def _plugin_worker(rank: int, world: int) -> dict:
    """The GPU's path on the CPU: frames compared later (never at the collective), so the
    plugin's periodic check is where the mismatch surfaces."""
    _frames.compare_at_once = lambda device: False  # this process's frames go to _Pending

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = (nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(3))

        def forward(self, x: torch.Tensor, branch: str) -> torch.Tensor:
            return getattr(self, branch)(self.a(x))

    model = Branchy()
    plugin = distnorm.DistNormPlugin(model, distnorm.DistNormConfig(norm="cbn", check_every=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plugin.follow(opt)
    steps_done, error = 0, None
    try:
        for _ in range(3):
            model(torch.randn(8, 4), "b" if rank == 0 else "c").sum().backward()
            opt.step()
            steps_done += 1
    except distnorm.CollectiveMismatchError as err:
        error = str(err)
    return {"steps_done": steps_done, "error": error}


def _bare_layers_worker(rank: int, world: int) -> str:
    """Two bare SyncBatchNorm(4), no model names them: rank 0 runs the first built, then the
    second; rank 1 the other way round."""
    first, second = distnorm.SyncBatchNorm(4), distnorm.SyncBatchNorm(4)
    order = (first, second) if rank == 0 else (second, first)
    x = torch.randn(8, 4, requires_grad=True)
    try:
        order[1](order[0](x)).sum().backward()
    except distnorm.CollectiveMismatchError as err:
        return str(err)
    return ""


@pytest.mark.world_size(2)
def test_bare_layers_are_told_apart_by_the_order_they_were_built(tmp_path):
    """Layers no model named are named by the order their process built them
    (``SyncBatchNorm(4) #k``): two bare layers of one width that the ranks run in different
    orders raise on every rank, naming both, where one name for both mixed their statistics
    silently."""
    for rank, message in enumerate(run_distributed(_bare_layers_worker, 2, tmp_path)):
        names = sorted({line.split(": ", 1)[1].split("|")[0] for line in message.splitlines() if "  rank " in line})
        assert len(names) == 2 and all(name.startswith("SyncBatchNorm(4) #") for name in names), (rank, message)


@pytest.mark.world_size(2)
def test_the_plugin_check_names_both_layers_when_frames_are_compared_late(tmp_path):
    """On a GPU frames are compared without a host synchronisation, so a mismatch may go on
    until the plugin's next check (every 2 forwards here): there, before any collective of
    its own, every rank raises naming both layers. The check reads the pending frames: one
    that never read them would compare nothing."""
    for rank, out in enumerate(run_distributed(_plugin_worker, 2, tmp_path, timeout=120)):
        assert out["steps_done"] == 1, (rank, out["error"])  # the check at the second forward raised
        assert "CBN 'b.0.norm'|forward" in out["error"] and "CBN 'c.0.norm'|forward" in out["error"], (rank, out)


def _count_worker(rank: int, world: int) -> dict:
    """Ops, host syncs and collectives of a matched CBN step, frames compared at once (the
    CPU) and late (a GPU's path)."""
    counts = {}
    for mode, at_once in (("at_once", True), ("late", False)):
        _frames.compare_at_once = lambda device, at_once=at_once: at_once
        layer = distnorm.CBN(16)
        distnorm.set_lr(layer, 0.01)
        x = torch.randn(8, 16, 4, 4, requires_grad=True)
        layer(x).sum().backward()  # the group's first step (its kernel vote, the headers made) out of the count
        with OpCounter() as ops, CollectiveCounter() as collectives:
            layer(x).sum().backward()
        counts[mode] = {"ops": len(ops), "host_syncs": ops.host_syncs, "collectives": collectives.calls,
                        "equal": ops.ops.count("aten.equal.default")}
    _frames.check_pending()
    return counts


@pytest.mark.world_size(2)
def test_the_check_adds_no_collective_and_no_host_sync(tmp_path):
    """One frame forward, one backward, as before the check (a fixed size, the fingerprints
    inside); no host synchronisation on the GPU's path; on the CPU one ``aten.equal`` per
    frame, a host computation on values the host already waited for. The check adds no
    fingerprint collective of its own per layer (what debug mode does)."""
    for rank, counts in enumerate(run_distributed(_count_worker, 2, tmp_path, timeout=120)):
        frame = ("allreduce_", ((3 * 16 + 2 * 2,),))
        for mode in ("at_once", "late"):
            assert counts[mode]["collectives"] == [frame, frame], (rank, mode, counts[mode])
            assert counts[mode]["host_syncs"] == 0, (rank, mode, counts[mode])
        assert counts["at_once"]["equal"] == 2 and counts["late"]["equal"] == 0, (rank, counts)
        # at once: one aten.equal per frame; late on the CPU: one clone per frame instead
        assert counts["at_once"]["ops"] == counts["late"]["ops"], (rank, counts)
