"""Fault injection: dead and stalled ranks, mismatched start-up, corrupt checkpoints, bad
data and non-finite losses. Ranks are started directly (RANK / WORLD_SIZE / MASTER_* as a
launcher sets them) rather than under torchrun, whose agent would kill the survivors itself
and hide what distnorm does. Each test prints a ``FIGURE`` line with what it measured
(collected into docs/reliability.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


from tests.helpers import digits_overrides, free_port

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo" / "digits.yaml"




def _overrides(root: Path, run: Path, *extra: str) -> list[str]:
    return [*digits_overrides(root), f"output.dir={run}", "output.progress=false", "output.log_every=1", *extra]


def _start(world: int, args_of_rank, tmp: Path) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "distnorm.train", "--config", str(DEMO), *args_of_rank(rank)],
                                      cwd=REPO, env=env, stdout=open(tmp / f"out{rank}.txt", "w"),
                                      stderr=open(tmp / f"err{rank}.txt", "w"), start_new_session=True))
    return procs


def _wait_for_step(run: Path, step: int, procs, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while True:
        metrics = run / "metrics.jsonl"
        if metrics.is_file() and any(json.loads(line).get("step", 0) >= step for line in metrics.read_text().splitlines()
                                     if line.startswith("{") and line.endswith("}")):
            return
        assert time.time() < deadline, "training did not reach the step"
        assert all(p.poll() is None for p in procs), "a rank exited early"
        time.sleep(0.1)


def _finish(procs, timeout: float) -> list[int]:
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            codes.append(None)
    return codes


def _no_orphans(run: Path) -> bool:
    time.sleep(1)
    return subprocess.run(["pgrep", "-f", f"output.dir={run}"], capture_output=True).stdout == b""


@pytest.mark.timeout(600)
def test_dead_rank_makes_the_survivor_exit_fast(tmp_path, digits):
    run = tmp_path / "run"
    procs = _start(2, lambda r: _overrides(digits, run, "train.collective_timeout_s=60"), tmp_path)
    _wait_for_step(run, 3, procs)
    killed = time.time()
    os.killpg(procs[1].pid, signal.SIGKILL)  # rank 1 and its data workers
    code = _finish(procs[:1], timeout=120)[0]
    elapsed = time.time() - killed
    print(f"FIGURE dead-rank: survivor exited with code {code} {elapsed:.1f} s after the kill (timeout 60 s)")
    assert code not in (0, None) and elapsed < 60
    err = (tmp_path / "err0.txt").read_text()
    assert "failed" in err and ("all-reduce failed" in err or "of epoch 0, step" in err), err[-2000:]
    assert _no_orphans(run)


@pytest.mark.timeout(600)
def test_stalled_rank_hits_the_collective_timeout(tmp_path, digits):
    run = tmp_path / "run"
    procs = _start(2, lambda r: _overrides(digits, run, "train.collective_timeout_s=15"), tmp_path)
    _wait_for_step(run, 3, procs)
    stalled = time.time()
    os.killpg(procs[1].pid, signal.SIGSTOP)  # alive but silent: no socket is closed
    code = _finish(procs[:1], timeout=180)[0]
    elapsed = time.time() - stalled
    os.killpg(procs[1].pid, signal.SIGKILL)
    print(f"FIGURE stalled-rank: survivor exited with code {code} {elapsed:.1f} s after the stall (timeout 15 s)")
    assert code not in (0, None) and elapsed < 15 + 45
    assert "failed" in (tmp_path / "err0.txt").read_text()
    assert _no_orphans(run)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("what", ["config", "index"])
def test_mismatch_is_detected_before_the_first_training_collective(tmp_path, digits, what):
    run = tmp_path / "run"
    other_index = tmp_path / "other-index.json"
    index = json.loads((digits / "digits-train-index.json").read_text())
    index["classes"][0] = "zero"  # a stale or different copy of the index on one node
    other_index.write_text(json.dumps(index))

    def args(rank):
        extra = []
        if rank == 1:
            extra = ["distnorm.rho=2.0"] if what == "config" else [f"data.train_index={other_index}"]
        return _overrides(digits, run, *extra)

    started = time.time()
    codes = _finish(_start(2, args, tmp_path), timeout=120)
    print(f"FIGURE mismatch-{what}: both ranks exited with {codes} after {time.time() - started:.1f} s")
    assert codes == [2, 2]
    expected = "the training configuration differs" if what == "config" else "the dataset index files differs"
    for rank in range(2):
        assert expected in (tmp_path / f"err{rank}.txt").read_text()
    assert not (run / "metrics.jsonl").exists()  # no step was taken


@pytest.mark.timeout(600)
def test_corrupt_latest_checkpoint_falls_back_to_the_previous(tmp_path, digits):
    run = tmp_path / "run"
    base = _overrides(digits, run, "output.checkpoint_every_steps=4", "output.keep_last=2")
    assert _finish(_start(1, lambda r: [*base, "train.max_steps=8"], tmp_path), timeout=300) == [0]
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_000000008"
    victim = max((ckpts / "step_000000008").rglob("*.safetensors"), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # truncated
    assert _finish(_start(1, lambda r: [*base, "train.max_steps=10"], tmp_path), timeout=300) == [0]
    err = (tmp_path / "err0.txt").read_text()
    assert "step_000000008 is unusable" in err and "falling back" in err
    resume = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"resume"' in l][-1]
    print(f"FIGURE corrupt-checkpoint: resumed from {Path(resume['checkpoint']).name} after truncating step_000000008")
    assert resume["global_step"] == 4


@pytest.mark.timeout(600)
def test_corrupt_shard_fails_all_ranks_or_is_skipped(tmp_path, digits):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in digits.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    shard = bad / "digits-train-000002.tar"
    shard.write_bytes(shard.read_bytes()[:20000])  # truncated mid-sample
    run = tmp_path / "run"
    started = time.time()
    codes = _finish(_start(2, lambda r: _overrides(bad, run, "train.max_steps=30"), tmp_path), timeout=180)
    print(f"FIGURE corrupt-shard raise: exit codes {codes} after {time.time() - started:.1f} s")
    assert None not in codes and all(c != 0 for c in codes)
    assert any("digits-train-000002.tar" in (tmp_path / f"err{r}.txt").read_text() for r in range(2))
    run2 = tmp_path / "run2"
    codes = _finish(_start(2, lambda r: _overrides(bad, run2, "train.max_steps=30", "data.on_error=skip"), tmp_path),
                    timeout=300)
    assert codes == [0, 0]
    assert any("skipped" in (tmp_path / f"err{r}.txt").read_text() for r in range(2))


@pytest.mark.timeout(600)
def test_non_finite_loss_stops_every_rank_naming_the_step_and_layer(tmp_path, digits):
    run = tmp_path / "run"
    codes = _finish(_start(2, lambda r: _overrides(digits, run, "optim.lr=1.0e12", "train.debug=true"), tmp_path), 180)
    assert None not in codes and all(c != 0 for c in codes)
    err = (tmp_path / "err0.txt").read_text()
    print("FIGURE non-finite: " + [l for l in err.splitlines() if "non-finite" in l][-1][:300])
    assert "non-finite batch statistics" in err and "CBN '" in err and "(during the forward of epoch 0, step" in err
    run2 = tmp_path / "run2"
    codes = _finish(_start(2, lambda r: _overrides(digits, run2, "optim.lr=1.0e12", "train.max_steps=6"), tmp_path), 180)
    assert all(c not in (0, None) for c in codes)
    assert "non-finite loss at epoch 0, step" in (tmp_path / "err0.txt").read_text()
    run3 = tmp_path / "run3"
    codes = _finish(_start(2, lambda r: _overrides(digits, run3, "optim.lr=1.0e12", "train.on_nonfinite=skip",
                                                  "train.epochs=1"), tmp_path), 300)
    assert codes == [0, 0]
    skipped = [l for l in (run3 / "metrics.jsonl").read_text().splitlines() if '"skipped_step"' in l]
    print(f"FIGURE non-finite skip: {len(skipped)} of 22 steps skipped on both ranks, run completed")
    assert skipped
