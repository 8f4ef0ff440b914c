"""Multi-node runs across simulated hosts (tests/cluster.py: network namespaces, each host
with its own address, name and /etc/hosts), where `localhost` is not the head node.

The fast part — two hosts through launch/torchrun.sh (c10d) against one host, and a link cut
mid-step — runs in `make test` where root allows it; the rest is marked `cluster` and runs
in `make test-cluster` (static rendezvous, Accelerate's multi-node configuration, a killed
host, a restart that resumes, and what the network costs under `tc netem`)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster import Cluster, available, wait_all
from tests.helpers import digits_overrides, merged_overrides
from tests.system import need

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo" / "digits.yaml"
REASON = available()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=f"simulated cluster: {REASON}"),
              pytest.mark.processes]  # simulated hosts, launchers


@pytest.fixture(scope="module")
def cluster():
    with Cluster(2) as c:
        yield c


def _env(node_rank: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RDZV", "SLURM_"))}
    return {**env, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "NODE_RANK": str(node_rank), **extra}


def _overrides(digits: Path, run: Path, steps: int, *extra: str) -> list[str]:
    return merged_overrides(*digits_overrides(digits), f"train.max_steps={steps}", f"output.checkpoint_every_steps={steps}",
                            f"output.dir={run}", "output.progress=false", "output.log_every=1", *extra)


def _torchrun_cmd(overrides: list[str]) -> str:
    return shlex.join([str(REPO / "launch" / "torchrun.sh"), str(DEMO), *overrides])


def _records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def _final_model(run: Path) -> dict:
    """Every parameter and buffer of the newest checkpoint (Accelerate's safetensors file, or
    DeepSpeed's module states: ZeRO-0..2 keep whole parameters there)."""
    import torch
    from safetensors.torch import load_file

    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text()
    if (latest / "model.safetensors").exists():
        return load_file(latest / "model.safetensors")
    return torch.load(latest / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]


@pytest.fixture(scope="module")
def one_host(digits, tmp_path_factory):
    """The reference: one host, 2 processes, the same global batch."""
    run = tmp_path_factory.mktemp("one") / "run"
    proc = subprocess.run([str(REPO / "launch" / "torchrun.sh"), str(DEMO), *_overrides(digits, run, 6)], cwd=REPO,
                          env=_env(0, NPROC="2"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def _assert_same_training(run: Path, reference: Path, steps: int = 6) -> None:
    import torch

    a, b = _records(run, "train"), _records(reference, "train")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, steps + 1))
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6, abs=1e-7) and ra["lr"] == rb["lr"]
    final, ref = _final_model(run), _final_model(reference)
    assert final.keys() == ref.keys() and any("amat_var" in k for k in final)
    for name in ref:  # every parameter and buffer (AMAT, running statistics) at the end
        torch.testing.assert_close(final[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def _train_on_both(cluster, cmd: str, logs: Path, **env: str) -> None:
    """Run ``cmd`` on both hosts (NODE_RANK per host, ``env`` on each) and require success."""
    codes = cluster.run_everywhere(cmd, cwd=REPO, logs=logs, env_of=lambda h: _env(h.index, **env))
    assert codes == [0, 0], {h.name: (logs / f"{h.name}.log").read_text()[-2000:] for h in cluster.hosts}


@pytest.mark.timeout(900)
@pytest.mark.world_size(2)
def test_torchrun_c10d_across_two_hosts_equals_one_host(cluster, digits, tmp_path, one_host):
    """launch/torchrun.sh on each host with MASTER_ADDR = the head's name: the c10d store is
    hosted by the node whose name matches, found through each host's own /etc/hosts."""
    run = tmp_path / "run"
    _train_on_both(cluster, _torchrun_cmd(_overrides(digits, run, 6)), tmp_path, NNODES="2", NPROC="1",
                   MASTER_ADDR=cluster.hosts[0].name, MASTER_PORT="29500")
    _assert_same_training(run, one_host)


@pytest.mark.timeout(600)
@pytest.mark.world_size(2)
def test_link_cut_mid_step_ends_both_hosts(cluster, digits, tmp_path):
    """The cable of host 1 pulled while it trains: the head host's job ends (non-zero) within
    the collective timeout plus margins, and the cut-off host's worker raises the collective
    timeout naming the layer (its torchrun agent then waits on the unreachable c10d store —
    torchrun's behaviour, ended here by killing it, on a cluster by the scheduler)."""
    run = tmp_path / "run"
    head = cluster.hosts[0].name
    timeout_s = 20
    procs = [h.start(_torchrun_cmd(_overrides(digits, run, 400, f"train.collective_timeout_s={timeout_s}")), cwd=REPO,
                     log=tmp_path / f"{h.name}.log",
                     env=_env(h.index, NNODES="2", NPROC="1", MASTER_ADDR=head, MASTER_PORT="29501"))
             for h in cluster.hosts]
    deadline = time.time() + 300
    while not ((run / "metrics.jsonl").exists() and len(_records(run, "train")) >= 3):
        assert time.time() < deadline and all(p.poll() is None for p in procs), "training did not start"
        time.sleep(0.2)
    cut = time.time()
    cluster.hosts[1].cut()
    cut_log = tmp_path / f"{cluster.hosts[1].name}.log"
    try:
        head_code = wait_all(procs[:1], timeout=timeout_s + 120)[0]
        head_elapsed = time.time() - cut
        while "failed on rank 1" not in cut_log.read_text():  # the cut-off worker's own error
            assert time.time() - cut < timeout_s + 120, cut_log.read_text()[-2000:]
            time.sleep(0.5)
        cut_elapsed = time.time() - cut
    finally:
        cluster.hosts[1].kill()  # its torchrun agent waits on the unreachable rendezvous store
        cluster.hosts[1].restore()
    print(f"FIGURE link-cut: head's job exited {head_code} {head_elapsed:.1f} s after the cut; the cut-off "
          f"host's worker raised its collective-timeout error within {cut_elapsed:.1f} s (timeout {timeout_s} s)")
    assert head_code not in (0, None) and head_elapsed < timeout_s + 90
    text = cut_log.read_text()
    assert "the forward all-reduce failed on rank 1" in text or "all-reduce failed on rank 1" in text, text[-2000:]


# ------------------------------------------------------------- make test-cluster only
@pytest.mark.cluster
@pytest.mark.timeout(900)
@pytest.mark.world_size(2)
def test_torchrun_static_across_two_hosts_equals_one_host(cluster, digits, tmp_path, one_host):
    run = tmp_path / "run"
    _train_on_both(cluster, _torchrun_cmd(_overrides(digits, run, 6)), tmp_path, NNODES="2", NPROC="1",
                   RDZV="static", MASTER_ADDR=cluster.hosts[0].name, MASTER_PORT="29502")
    _assert_same_training(run, one_host)


@pytest.mark.cluster
@pytest.mark.timeout(900)
@pytest.mark.world_size(2)
def test_accelerate_multi_node_across_two_hosts_equals_one_host(cluster, digits, tmp_path, one_host):
    """launch/accelerate/multi_node_cpu.yaml (multi_node.yaml's rendezvous) on two hosts."""
    run = tmp_path / "run"
    head = cluster.hosts[0].name
    accelerate = Path(sys.executable).parent / "accelerate"
    cmd = (f"{accelerate} launch --config_file {REPO}/launch/accelerate/multi_node_cpu.yaml --machine_rank $NODE_RANK "
           f"--main_process_ip {head} --main_process_port 29503 -m distnorm.train --config {DEMO} "
           + shlex.join(_overrides(digits, run, 6)))
    _train_on_both(cluster, cmd, tmp_path)
    _assert_same_training(run, one_host)


@pytest.mark.cluster
@pytest.mark.timeout(900)
@pytest.mark.world_size(2)
def test_killed_host_then_restart_resumes_exactly(cluster, digits, tmp_path):
    """Every process of host 1 killed mid-training (the machine died): host 0's job ends; the
    job restarted on both hosts (the machine came back) resumes from the last good checkpoint
    and finishes with the losses of an uninterrupted run."""
    head = cluster.hosts[0].name
    args = lambda run, port: (_torchrun_cmd(_overrides(digits, run, 30, "output.checkpoint_every_steps=5",  # noqa: E731
                                                        "train.collective_timeout_s=20")),
                              lambda h: _env(h.index, NNODES="2", NPROC="1", MASTER_ADDR=head, MASTER_PORT=port))
    full = tmp_path / "full"
    cmd, env_of = args(full, "29504")
    assert cluster.run_everywhere(cmd, cwd=REPO, env_of=env_of) == [0, 0]

    run = tmp_path / "run"
    cmd, env_of = args(run, "29505")
    procs = [h.start(cmd, env=env_of(h), cwd=REPO, log=tmp_path / f"{h.name}.log") for h in cluster.hosts]
    deadline = time.time() + 400
    while not (run / "checkpoints" / "step_000000010").is_dir():
        assert time.time() < deadline and all(p.poll() is None for p in procs), "no checkpoint appeared"
        time.sleep(0.2)
    killed = time.time()
    cluster.hosts[1].kill()
    code = wait_all(procs[:1], timeout=240)[0]
    elapsed = time.time() - killed
    print(f"FIGURE host-killed: head's job exited {code} {elapsed:.1f} s after host 1 died")
    assert code not in (0, None)

    cmd, env_of = args(run, "29506")  # the host is back: the same command on both
    assert cluster.run_everywhere(cmd, cwd=REPO, env_of=env_of, logs=tmp_path) == [0, 0]
    resume = _records(run, "resume")[-1]
    assert resume["global_step"] >= 10
    reference = {r["step"]: r for r in _records(full, "train")}
    after = [r for r in _records(run, "train") if r["time"] > resume["time"]]
    assert after[0]["step"] == resume["global_step"] + 1 and after[-1]["step"] == 30
    for r in after:
        assert r["loss"] == pytest.approx(reference[r["step"]]["loss"], rel=1e-5, abs=1e-6)
    print(f"FIGURE host-killed restart: resumed at step {resume['global_step']}, losses equal to the uninterrupted run")


@pytest.mark.cluster
@pytest.mark.timeout(900)
@pytest.mark.world_size(2)
def test_deepspeed_runner_with_a_hostfile_over_ssh(cluster, digits, tmp_path):
    """launch/deepspeed.sh with HOSTFILE on the head: the DeepSpeed runner reaches both hosts
    over ssh (pdsh; sshd on every host, a key made for this test) and trains as the same
    runner does with 2 processes on one host."""
    need("sshd", "ssh", "pdsh")
    overrides = lambda run: [*_overrides(digits, run, 4), "train.engine=deepspeed",  # noqa: E731
                             "train.deepspeed_config=configs/deepspeed/zero2_fp32.json", "train.cpu=true"]
    reference = tmp_path / "one"
    local = subprocess.run([str(REPO / "launch" / "deepspeed.sh"), str(DEMO), *overrides(reference)], cwd=REPO,
                           env=_env(0, NUM_GPUS="2", DS_ACCELERATOR="cpu", MASTER_PORT="29520",
                                    PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"),
                           capture_output=True, text=True, timeout=600)
    assert local.returncode == 0, local.stderr[-3000:]

    cluster.start_ssh(tmp_path / "ssh")
    head, other = cluster.hosts
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{head.name} slots=1\n{other.name} slots=1\n")
    ds_env = tmp_path / "ds_env"  # what the runner exports to every host (DeepSpeed reads DS_ENV_FILE)
    ds_env.write_text("DS_ACCELERATOR=cpu\nOMP_NUM_THREADS=1\n")
    run = tmp_path / "two"
    proc = head.start(shlex.join([str(REPO / "launch" / "deepspeed.sh"), str(DEMO), *overrides(run)]), cwd=REPO,
                      log=tmp_path / "runner.log",
                      env=_env(0, HOSTFILE=str(hostfile), MASTER_ADDR=head.name, MASTER_PORT="29521",
                               DS_ACCELERATOR="cpu", DS_ENV_FILE=str(ds_env)))
    assert wait_all([proc], timeout=600) == [0], (tmp_path / "runner.log").read_text()[-3000:]
    log = (tmp_path / "runner.log").read_text()
    assert f"{other.name}: " in log  # pdsh prefixes each remote host's output with its name
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text()
    assert json.loads((latest / "manifest.json").read_text())["state"]["world_size"] == 2
    # Same data, same initial model, same global batch: the same training as one host. (Before
    # launch/deepspeed.sh escaped the arguments for pdsh's remote shell, the shard pattern was
    # brace-expanded there and the run trained on one shard of six: losses ~3 % off.)
    _assert_same_training(run, reference, steps=4)


# ----------------------------------------------------------- Slurm across the hosts
# Last in this file: the killed-host tests above kill every process of host 1, slurmd too.
@pytest.fixture(scope="module")
def slurm(cluster, tmp_path_factory):
    need("sbatch", "slurmctld", "slurmd", "munged")
    return cluster.start_slurm(tmp_path_factory.mktemp("slurm"))


def _sbatch(cluster, slurm_env: dict, log_dir: Path, overrides: list[str]) -> str:
    """launch/slurm.sbatch --nodes=2 submitted from the head host (the login node here); the
    CPU twin of the GPU job: 1 process per node, no GPUs."""
    cmd = shlex.join(["sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", f"--cpus-per-task={os.cpu_count()}",
                      "--time=15:00", f"--output={log_dir}/slurm-%j.out", str(REPO / "launch" / "slurm.sbatch"),
                      str(DEMO), *overrides])
    submit = cluster.hosts[0].run(f"cd {REPO} && {cmd}", env={**slurm_env, **_env(0, NPROC="1")})
    assert submit.returncode == 0, submit.stderr
    return submit.stdout.strip().split(";")[0]


def _job_state(cluster, slurm_env: dict, job: str) -> str:
    out = cluster.hosts[0].run(f"scontrol show job {job}", env=slurm_env).stdout
    return next((w.split("=")[1] for w in out.split() if w.startswith("JobState=")), "GONE")


def _wait_job(cluster, slurm_env: dict, job: str, states: tuple[str, ...], log: Path, timeout: float) -> str:
    deadline = time.time() + timeout
    while (state := _job_state(cluster, slurm_env, job)) not in states:
        assert time.time() < deadline, f"job {job} still {state}:\n" + (log.read_text()[-3000:] if log.exists() else "no log")
        time.sleep(0.5)
    return state


@pytest.mark.cluster
@pytest.mark.timeout(900)
@pytest.mark.world_size(2)
def test_slurm_sbatch_two_nodes_equals_one_host(cluster, slurm, digits, tmp_path, one_host):
    """launch/slurm.sbatch --nodes=2 under slurmctld + one slurmd per host: one srun task per
    node, each a torchrun.sh whose c10d rendezvous is on the first host of the allocation."""
    run = tmp_path / "run"
    job = _sbatch(cluster, slurm, tmp_path, _overrides(digits, run, 6))
    log = tmp_path / f"slurm-{job}.out"
    try:
        state = _wait_job(cluster, slurm, job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), log, 600)
    finally:
        cluster.hosts[0].run(f"scancel {job}", env=slurm)
    text = log.read_text()
    assert state == "COMPLETED", text[-3000:]
    head = cluster.hosts[0].name
    assert f"on {head.rsplit('-', 1)[0]}-h[0-1], head {head}:" in text, text[:500]
    _assert_same_training(run, one_host)


@pytest.mark.cluster
@pytest.mark.timeout(900)
@pytest.mark.world_size(2)
def test_slurm_node_failure_requeues_and_resumes(cluster, slurm, digits, tmp_path):
    """Host 1 fails mid-training (its link cut, then every process on it killed, slurmd too):
    Slurm marks the node DOWN after SlurmdTimeout, ends the job's step on the head and requeues
    the batch job; when the host comes back (link up, slurmd restarted) the requeued job runs
    again on both nodes and resumes from the last checkpoint to the end, the steps it redoes
    with the losses they had before the failure."""
    run = tmp_path / "run"
    job = _sbatch(cluster, slurm, tmp_path, _overrides(digits, run, 30, "output.checkpoint_every_steps=5",
                                                       "train.collective_timeout_s=300"))
    log = tmp_path / f"slurm-{job}.out"
    failed = cluster.hosts[1]
    try:
        deadline = time.time() + 400
        while not ((run / "checkpoints" / "step_000000010").is_dir() and (run / "metrics.jsonl").exists()
                   and max((r["step"] for r in _records(run, "train")), default=0) >= 12):
            assert time.time() < deadline and _job_state(cluster, slurm, job) in ("PENDING", "RUNNING"), \
                log.read_text()[-3000:] if log.exists() else "no log"
            time.sleep(0.2)
        failed.cut()  # the machine dies: no packet leaves it any more, then nothing runs on it
        failed.kill()
        t0 = time.time()
        state = _wait_job(cluster, slurm, job, ("PENDING", "REQUEUED", "FAILED", "COMPLETED", "CANCELLED"), log, 300)
        requeued_after = time.time() - t0
        print(f"FIGURE slurm node failure: job {job} left RUNNING for {state} {requeued_after:.1f} s after host 1 died "
              "(SlurmdTimeout=10)")
        assert state in ("PENDING", "REQUEUED"), log.read_text()[-3000:]
        failed.restore()  # the machine is back
        cluster.start_slurmd(failed)
        # Slurm holds a requeued job back (its begin time moves); "start it now" as an admin would.
        _wait_job(cluster, slurm, job, ("PENDING",), log, 120)
        cluster.hosts[0].run(f"scontrol update JobId={job} StartTime=now", env=slurm)
        state = _wait_job(cluster, slurm, job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), log, 600)
    finally:
        cluster.hosts[0].run(f"scancel {job}", env=slurm)
        failed.restore()
    text = log.read_text()
    assert state == "COMPLETED", text[-3000:]
    assert "(restart 1)" in text and "DUE TO NODE FAILURE" in text
    resume = _records(run, "resume")[-1]
    assert resume["global_step"] >= 10  # from its checkpoint, not from scratch
    after = [r for r in _records(run, "train") if r["time"] > resume["time"]]
    assert after[0]["step"] == resume["global_step"] + 1 and after[-1]["step"] == 30
    before = {r["step"]: r["loss"] for r in _records(run, "train") if r["time"] < resume["time"]}
    redone = [r for r in after if r["step"] in before]  # steps trained before the failure and again after
    assert redone and all(r["loss"] == pytest.approx(before[r["step"]], rel=1e-5, abs=1e-6) for r in redone)
    print(f"FIGURE slurm node failure: requeued run resumed at step {resume['global_step']}, redid steps "
          f"{redone[0]['step']}-{redone[-1]['step']} with the same losses, finished at step 30")
