"""Resuming on another number of processes (``train.resume_world_size=allow``), both ways."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distnorm.train.config import ConfigError
from distnorm.train.engines import state_digest
from distnorm.train.loop import _agree_on_resume
from tests.helpers import digits_overrides, free_port

pytestmark = pytest.mark.processes  # the test runs distnorm-train on 2, 1 and 2 ranks

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo" / "digits.yaml"


def _launch(nproc: int, run: Path, digits: Path, *overrides: str) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port()),
           "NPROC": str(nproc)}
    proc = subprocess.run([str(REPO / "launch" / "torchrun.sh"), str(DEMO), *digits_overrides(digits),
                           f"output.dir={run}", "output.checkpoint_every_steps=3", "output.progress=false",
                           "output.log_every=1", "output.keep_last=10", *overrides], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def _checkpoint_digest(directory: Path) -> str:
    """The model and optimizer state an Accelerate checkpoint holds, digested as the run does."""
    return state_digest(load_file(directory / "model.safetensors"),
                        torch.load(directory / "optimizer.bin", weights_only=False))


@pytest.mark.timeout(900)
@pytest.mark.world_size(2)
def test_resume_on_another_world_size_when_allowed_both_ways(tmp_path, digits):
    """2 -> 1 and 1 -> 2 processes: refused by default (naming the option); with
    ``train.resume_world_size=allow`` the run finishes, the model and optimizer state carry
    over exactly (digest of the loaded state = digest of the checkpoint's files), training
    goes on at the start of the next epoch (the checkpoints are mid-epoch) with the global
    step and the global batch of the checkpoint.
    Such a resume never silently restarts from scratch, loads another checkpoint, drops the
    optimizer state, or keeps the old mid-epoch data position."""
    run = tmp_path / "run"
    _launch(2, run, digits, "train.max_steps=6")
    latest = (run / "checkpoints" / "step_000000006", {"world_size": 2})
    with pytest.raises(ConfigError, match="train.resume_world_size=allow"):  # the default: refused
        _agree_on_resume(latest, 1)
    with pytest.raises(ConfigError, match="ds_to_universal"):  # ZeRO keeps per-rank optimizer shards
        _agree_on_resume(latest, 1, allow_other_world=True, per_rank_engine="deepspeed")

    _launch(1, run, digits, "train.max_steps=12", "train.resume_world_size=allow")  # 2 -> 1
    _launch(2, run, digits, "train.max_steps=15", "train.resume_world_size=allow")  # 1 -> 2

    steps_per_epoch = -(-1437 // 64)  # digits train set, global batch 64
    resumes = _records(run, "resume")
    assert [(r["world_size_from"], r["world_size"]) for r in resumes] == [(2, 1), (1, 2)]
    # The newest checkpoint of the previous run: steps 6 (epoch 0) and 12 (epoch 1), mid-epoch.
    assert [r["global_step"] for r in resumes] == [6, 12]
    assert [(r["epoch"], r["step_in_epoch"]) for r in resumes] == [(1, 0), (2, 0)]
    for record in resumes:
        assert record["state_digest"] == _checkpoint_digest(Path(record["checkpoint"]))
    train = _records(run, "train")
    assert train[-1]["step"] == 15 and train[-1]["epoch"] == 2  # the last run finished where asked
    # Each resumed run trained from the checkpoint's step on, in the next epoch (no step redone).
    steps = [r["step"] for r in train]
    assert steps == sorted(set(steps)) == list(range(1, 16))
    assert {r["epoch"] for r in train if 7 <= r["step"] <= 12} == {1} and 12 < steps_per_epoch * 2
