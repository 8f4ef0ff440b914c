"""distnorm under a real ``lightning.Trainer(strategy="ddp", accelerator="cpu", devices=2)``:
Lightning starts the second process itself; 2 ranks on split batches must match one plain
PyTorch process on the concatenated batch (float64).

Importing Lightning takes ~25 s per process on a loaded 2-core machine, so one launch
(``tests/engines/lightning_train.py``) trains every run below in turn in the same two
processes, and the tests read its records.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distnorm

pytest.importorskip("lightning")

from tests.engines.lightning_train import run_reference  # noqa: E402
from tests.test_ddp_buffers import assert_no_buffer_broadcast, broadcasts_per_step, checks_per_step  # noqa: E402

SCRIPT = Path(__file__).parent / "engines" / "lightning_train.py"
pytestmark = pytest.mark.processes  # every test here reads a Lightning launch on 2 processes

REPO = Path(__file__).resolve().parents[1]
TOL = dict(atol=1e-10, rtol=1e-10)  # float64: measured <= 2e-15


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Every run's records (rank order), from one 2-process Lightning launch."""
    out = tmp_path_factory.mktemp("lightning")
    plan = {
        "cbn": "--distnorm cbn --distnorm-check-every 2",
        "popnorm_bnp": "--distnorm popnorm --distnorm-bnp --distnorm-check-every 3",
        "first": f"--distnorm cbn --distnorm-bnp --steps 3 --save {out}/cbn_bnp.ckpt",
        "resumed": f"--distnorm cbn --distnorm-bnp --steps 6 --ckpt {out}/cbn_bnp.ckpt --resume",
        "off": f"--steps 4 --save {out}/off.ckpt",
        "plain": f"--steps 4 --no-plugin --save {out}/plain.ckpt",
        "two_optimizers": "--distnorm cbn --two-optimizers --steps 6",
        "refit": "--distnorm cbn --steps 3 --refit",
        "plugin_only": "--distnorm cbn --plugin-only",  # raises: last
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(SCRIPT), str(out), *(f"{name}:{flags}" for name, flags in plan.items())]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    records = {}
    for name in plan:  # a run that raised ended the list: the later ones left no record
        files = [out / f"{name}.rank{r}.pt" for r in range(2)]
        records[name] = [torch.load(f, weights_only=False) for f in files] if all(f.exists() for f in files) else None
    return records


def _records(runs: dict, name: str, error_expected: bool = False) -> list[dict]:
    """The records of run ``name``; fails naming the run that raised instead."""
    for earlier, recs in runs.items():
        failed = recs is not None and "error" in recs[0]
        if earlier == name:
            assert recs is not None, f"run {name!r} never ran"
            assert failed == error_expected, recs[0].get("error")
            return recs
        assert not failed, f"run {earlier!r} raised, so {name!r} never ran: {recs[0]['error']}"
    raise KeyError(name)


def _assert_matches_reference(split: list[dict], ref: dict, first_step: int = 0) -> None:
    for rank in split:
        assert rank["world"] == 2 and rank["steps"] == ref["steps"][first_step:]
        torch.testing.assert_close(torch.tensor(rank["lrs"]), torch.tensor(ref["lrs"][first_step:]))
        torch.testing.assert_close(torch.tensor(rank["etas"]), torch.tensor(ref["etas"][first_step:]))
        for kind in ("params", "buffers"):
            assert rank[kind].keys() == ref[kind].keys(), kind
            for name, value in ref[kind].items():
                torch.testing.assert_close(rank[kind][name], value, **TOL, msg=name)
    losses = [torch.tensor(r["losses"], dtype=torch.float64) for r in (*split, ref)]
    torch.testing.assert_close((losses[0] + losses[1]) / 2, losses[2][first_step:], **TOL)
    # the rank losses average to the loss of the concatenated batch (checked above); the
    # buffers are computed from all-reduced statistics: bit-identical
    for name, value in split[0]["buffers"].items():
        assert torch.equal(value, split[1]["buffers"][name]), f"buffer {name} differs across ranks"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run, flags", [
    ("cbn", dict(norm="cbn", check_every=2)),
    ("popnorm_bnp", dict(norm="popnorm", bnp=True, check_every=3)),
])
def test_two_lightning_ranks_match_one_process(runs, run, flags):
    """Two Lightning DDP ranks match one process: AMAT reads the learning rate Lightning's
    scheduler left for the step (eta not off by one step), the statistics are synchronized
    across the ranks, BNP's moments are not computed per rank, and DDP does not broadcast rank
    0's buffers every forward (which would hide per-rank buffers instead of proving them equal).

    Counted, every collective of each training batch: no buffer broadcast (setting
    ``broadcast_buffers = False`` on the built wrapper really stops it on torch 2.14), and the
    consistency check at every ``check_every``-th batch only, not twice as often (as when the
    plugin's per-forward hook counted Lightning's forward redirection and the ``self(x)``
    inside ``training_step`` as two forwards a step)."""
    split = _records(runs, run)
    assert split[0]["distnorm_file"].startswith(str(REPO)), split[0]["distnorm_file"]  # the tree under test
    for rank, record in enumerate(split):
        steps = record["collectives"]
        assert_no_buffer_broadcast(steps, f"Lightning {run}, rank {rank}")
        every = flags["check_every"]
        want = [int((i + 1) % every == 0) for i in range(len(steps))]
        assert checks_per_step(steps) == want, (
            f"Lightning {run}, rank {rank}: consistency checks per batch {checks_per_step(steps)}, expected "
            f"{want} (check_every={every}); collectives of the first two batches: {steps[:2]}")
    assert split[0]["wrapper"] == "DistributedDataParallel" and split[0]["broadcast_buffers"] is False
    if run == "cbn":  # eta = 1 - omega * lr for the lr applied at every step
        assert [e[0] for e in split[0]["etas"]] == pytest.approx([1 - 10 * lr for lr in split[0]["lrs"]])
    _assert_matches_reference(split, run_reference(distnorm.DistNormConfig(**flags)))
    if "bnp" in flags:
        assert any(k.endswith("bnp_var") for k in split[0]["buffers"])


@pytest.mark.timeout(300)
def test_lightning_resume_from_checkpoint_equals_uninterrupted(runs):
    """A fresh process resuming ``fit(ckpt_path=...)`` equals the uninterrupted run from step 3
    on, the plugin's state (its count of training forwards included) carried in the checkpoint
    by DistNormSync. The DDP strategy restores a checkpoint's weights before LayerSync.apply;
    the resumed process must not load the converted model's keys into the bare model (missing
    CBN / BNP keys)."""
    first, resumed = _records(runs, "first"), _records(runs, "resumed")
    assert first[0]["ckpt_callbacks"] == ["DistNormSync"]
    assert any(k.endswith("amat_mean") for k in first[0]["ckpt_keys"])
    assert any(k.endswith("bnp_mean") for k in first[0]["ckpt_keys"])
    assert resumed[0]["steps"] == [3, 4, 5]
    _assert_matches_reference(resumed, run_reference(distnorm.DistNormConfig(norm="cbn", bnp=True)), first_step=3)
    assert resumed[0]["plugin_state"]["plugin"]["config"]["norm"] == "cbn"
    # the callback state, Lightning's own checkpoint hook, carried the count: 3 saved + 3 resumed
    assert [r["plugin_state"]["plugin"]["training_forwards"] for r in resumed] == [6, 6]


@pytest.mark.timeout(300)
def test_lightning_amat_follows_the_optimizer_holding_its_weight(runs):
    """With several Lightning optimizers (manual optimization), AMAT follows the learning rate
    of the optimizer that updates the norm's parameters, not the first optimizer's."""
    for rank in _records(runs, "two_optimizers"):
        assert len(rank["etas"]) >= 3
        for (rest_lr, norm_lr), etas in zip(rank["lrs"], rank["etas"]):
            assert norm_lr == pytest.approx(rest_lr / 3)
            assert etas == pytest.approx([1 - 10 * norm_lr] * 2)


@pytest.mark.timeout(300)
def test_lightning_second_fit_follows_the_new_optimizer(runs):
    """A second fit of the same module (a new Trainer, new optimizers) has AMAT follow the new
    optimizer's learning rate at every step. Before, revert() at the end of fit stopped AMAT
    following the optimizer, and the second fit never resumed it: AMAT kept the last learning
    rate of the first fit."""
    for rank in _records(runs, "refit"):
        assert rank["steps"] == [0, 1, 2, 0, 1, 2] and rank["broadcast_buffers"] is False
        assert [e[0] for e in rank["etas"]] == pytest.approx([1 - 10 * lr for lr in rank["lrs"]])


@pytest.mark.timeout(300)
def test_lightning_off_is_off(runs):
    """DistNormSync with a configuration that changes nothing changes nothing: it does not
    convert the model, leaves DDP's buffer broadcast on (without it per-rank BatchNorm
    statistics would drift), adds no collective to a step and writes no entry into Lightning's
    checkpoints. The collectives are counted: the same with the lines as without, the buffer
    broadcast in every batch (so the counter sees it)."""
    off, plain = _records(runs, "off"), _records(runs, "plain")
    for a, b in zip(off, plain):
        assert a["collectives"] == b["collectives"], (a["collectives"], b["collectives"])
        assert all(n > 0 for n in broadcasts_per_step(a["collectives"])), a["collectives"]
        assert a["broadcast_buffers"] is True and b["broadcast_buffers"] is True
        assert a["conversion"] == {} and a["losses"] == b["losses"]
        for kind in ("params", "buffers"):
            assert a[kind].keys() == b[kind].keys()
            for name in a[kind]:
                assert torch.equal(a[kind][name], b[kind][name]), (kind, name)
    assert off[0]["ckpt_callbacks"] == plain[0]["ckpt_callbacks"] == []
    assert off[0]["ckpt_keys"] == plain[0]["ckpt_keys"]


@pytest.mark.timeout(300)
def test_lightning_plugin_without_callback_is_refused(runs):
    """DistNormSync given only in ``plugins=[...]`` is refused, the error showing
    ``plugins=[sync], callbacks=[sync]``. Given there alone, it converted the model but AMAT
    never learned the learning rate and the checkpoint could not be resumed — silently."""
    for rank in _records(runs, "plugin_only", error_expected=True):
        assert "plugins=[sync], callbacks=[sync]" in rank["error"], rank["error"]


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_lightning_example_runs_on_two_processes(tmp_path):
    """examples/lightning_train.py (what the guide shows) runs on two processes with the
    integration as it is: 3 steps done, and a checkpoint holding distnorm's state and the
    converted layers. A renamed class or flag, or the sync missing from callbacks, fails here:
    the example cannot drift from the integration."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(REPO / "examples" / "lightning_train.py"), "--accelerator", "cpu", "--devices", "2",
           "--distnorm", "cbn", "--distnorm-bnp", "--max-steps", "3", "--batch-size", "8",
           "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "done: 3 steps" in proc.stdout
    ckpt = torch.load(tmp_path / "out" / "last.ckpt", weights_only=False)
    assert ckpt["callbacks"]["DistNormSync"]["plugin"]["config"]["norm"] == "cbn"
    assert any(k.endswith("amat_mean") for k in ckpt["state_dict"])
    assert any(k.endswith("bnp_var") for k in ckpt["state_dict"])
