"""Every shipped launcher, run by its real software on CPU ranks: launch/torchrun.sh, the
DeepSpeed runner through launch/deepspeed.sh, `accelerate launch` with the shipped YAMLs
(one machine, and two machines on loopback), and launch/slurm.sbatch under a real Slurm
(launch/slurm/local_cluster.sh; runs where `sbatch` is installed and we are root).

Each test asserts the number of processes the launcher promises (the checkpoint manifest
records the world size; Accelerate writes one random_states file per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import digits_overrides, free_port
from tests.system import need

pytestmark = pytest.mark.processes  # every test here runs a launcher (torchrun, DeepSpeed, Accelerate, Slurm)

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo" / "digits.yaml"
VENV_BIN = Path(sys.executable).parent


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RDZV_ID", "SLURM_JOB_ID")}
    return {**env, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
            "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", **extra}


def _common(digits: Path, run: Path, steps: int = 4) -> list[str]:
    return [*digits_overrides(digits), f"train.max_steps={steps}", f"output.checkpoint_every_steps={steps}",
            f"output.dir={run}", "output.progress=false", "output.log_every=1"]


def _run(cmd: list[str], env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _manifest(run: Path) -> dict:
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text()
    return json.loads((latest / "manifest.json").read_text())


def _losses(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


# ------------------------------------------------------------------------- torchrun.sh
def test_torchrun_sh_refuses_several_nodes_without_master_addr(digits, tmp_path):
    proc = subprocess.run([str(REPO / "launch" / "torchrun.sh"), str(DEMO)], cwd=REPO, capture_output=True, text=True,
                          env=_env(NNODES="2", NPROC="1"), timeout=60)
    assert proc.returncode == 2 and "NNODES=2 needs MASTER_ADDR" in proc.stderr


@pytest.mark.timeout(600)
def test_torchrun_sh_two_jobs_on_one_host_do_not_collide(digits, tmp_path):
    """No MASTER_PORT / RDZV_ID given: the old fixed 29500 and id 'distnorm' made the second
    job join (or fail on) the first one's rendezvous."""
    runs = [tmp_path / "a", tmp_path / "b"]
    procs = [subprocess.Popen([str(REPO / "launch" / "torchrun.sh"), str(DEMO), *_common(digits, run)], cwd=REPO,
                              env=_env(NPROC="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for run in runs]
    outputs = [p.communicate(timeout=500) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    for run in runs:
        assert _manifest(run)["state"]["world_size"] == 1 and len(_losses(run)) == 4


# ------------------------------------------------------------------------ deepspeed.sh
@pytest.mark.timeout(600)
@pytest.mark.world_size(2)
def test_deepspeed_sh_one_host_hostfile_runs_two_cpu_ranks(digits, tmp_path):
    """The real DeepSpeed runner with a one-host hostfile (2 slots, a comment and a blank
    line): it starts its local launcher, so the shard pattern must reach the workers as
    written. Before, deepspeed.sh escaped the arguments whenever HOSTFILE was set (the
    workers got `digits-train-\\{000000..000005\\}.tar`, "1 shard(s) missing"), and
    distnorm-train rejected the runner's --local_rank=N. The command built without a hostfile and
    with two hosts: test_deepspeed_sh_decides_by_the_number_of_hosts; two real hosts:
    tests/test_cluster.py."""
    run = tmp_path / "ds"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# one host, two CPU processes\n\nlocalhost slots=2\n")
    # The runner checks passwordless ssh to the first host of any hostfile (runner.py l.483),
    # then starts the local launcher: a stand-in ssh that runs the command here.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text('#!/bin/sh\nwhile [ "$1" = -o ] || [ "$1" = -p ]; do shift 2; done\nshift\nexec "$@"\n')
    (bin_dir / "ssh").chmod(0o755)
    env = _env(HOSTFILE=str(hostfile), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    proc = _run([str(REPO / "launch" / "deepspeed.sh"), str(DEMO), *_common(digits, run), "train.engine=deepspeed",
                 "train.deepspeed_config=configs/deepspeed/zero2_fp32.json", "train.cpu=true"], env=env)
    assert proc.stdout.count("exits successfully") + proc.stderr.count("exits successfully") == 2
    manifest = _manifest(run)
    assert manifest["state"]["world_size"] == 2 and len(_losses(run)) == 4
    assert any("zero_pp_rank_1" in f for f in manifest["files"])  # rank 1's ZeRO shard: a real second rank
    # the trained model as plain torch.nn, from the module DeepSpeed trained (its own hooks left behind)
    frozen = torch.load(run / "model-frozen.pt", weights_only=False)
    assert not any(type(m).__module__.startswith(("distnorm.layers", "deepspeed")) for m in frozen.modules())


_SHARDS = "data.train_shards=d/train-{000000..000005}.tar"
_HOSTFILES = {
    "one host, comments, blank lines": "# cluster A\n\n   node1 slots=4   # the only one\n# node2 slots=4\n",
    "two hosts": "node1 slots=2\nnode2\tslots=3\n",
    "two hosts, comments": "# head\nnode1 slots=1\n\n# worker\nnode2 slots=1 extra words\n",
}


@pytest.mark.parametrize("hostfile_text", list(_HOSTFILES.values()), ids=list(_HOSTFILES))
@pytest.mark.parametrize("num_gpus", [None, 2])
def test_deepspeed_sh_decides_by_the_number_of_hosts(tmp_path, hostfile_text, num_gpus):
    """What deepspeed.sh hands the runner, against DeepSpeed's own parsing of the same
    hostfile: arguments escaped for pdsh's remote shell exactly when more than one host
    remains (runner.py: multi-node iff len(active_resources) > 1), left as written for one
    host; --check told the world size the runner will start. Stand-ins for python and the
    runner record their arguments (no training, milliseconds).
    So the arguments are not escaped merely because HOSTFILE is set, `slots=` in comment lines
    is not counted, and a hostfile with NUM_GPUS is not counted as its slots."""
    runner = pytest.importorskip("deepspeed.launcher.runner")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(hostfile_text)
    pool = runner._parse_hostfile(hostfile_text.splitlines())
    active = runner.apply_num_nodes_and_gpus(runner.parse_inclusion_exclusion(pool, "", ""), -1, num_gpus or -1)
    several, world = len(active) > 1, sum(len(slots) for slots in active.values())

    env = {"HOSTFILE": str(hostfile), **({"NUM_GPUS": str(num_gpus)} if num_gpus else {})}
    check, launched = _deepspeed_sh(tmp_path, env)
    assert check[check.index("--world-size") + 1] == str(world)
    assert launched[launched.index("--hostfile") + 1] == str(hostfile)
    shards, spaced = launched[-2:]
    assert shards == (r"data.train_shards=d/train-\{000000..000005\}.tar" if several else _SHARDS)
    assert spaced == "output.dir=a b"  # the runner double-quotes arguments with a space itself



def _deepspeed_sh(tmp_path: Path, env: dict[str, str]) -> tuple[list[str], list[str]]:
    """Run launch/deepspeed.sh with stand-ins for PYTHON and the runner beside it; return
    the arguments of the --check call and of the runner."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("python", "deepspeed"):
        (bin_dir / name).write_text(f"#!/bin/sh\nprintf '%s\\0' \"$@\" > \"$(dirname \"$0\")/{name}.args\"\n")
        (bin_dir / name).chmod(0o755)
    proc = subprocess.run([str(REPO / "launch" / "deepspeed.sh"), "cfg.yaml", _SHARDS, "output.dir=a b"], cwd=REPO,
                          env={**_env(), "PYTHON": str(bin_dir / "python"), **env}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [(bin_dir / f"{name}.args").read_text().split("\0")[:-1] for name in ("python", "deepspeed")]


def test_deepspeed_sh_without_a_hostfile_and_bad_hostfiles(tmp_path):
    """No HOSTFILE (and no /job/hostfile, DeepSpeed's default): this node, arguments as
    written. A hostfile DeepSpeed would refuse (a line without slots=, a host twice, no
    host) or a missing one is refused before --check, naming the problem."""
    if Path("/job/hostfile").exists():
        pytest.skip("/job/hostfile exists: the DeepSpeed runner (and deepspeed.sh) would use it")
    check, launched = _deepspeed_sh(tmp_path, {"NUM_GPUS": "3"})
    assert check[check.index("--world-size") + 1] == "3"
    assert "--hostfile" not in launched and launched[-2:] == [_SHARDS, "output.dir=a b"]
    for text, message in [("node1 slot=2\n", 'line "node1 slot=2" is not "HOST slots=N"'),
                          ("node1 slots=2\nnode1 slots=1\n", "host node1 is listed twice"),
                          ("# nothing\n\n", "it lists no host"), (None, "does not exist")]:
        hostfile = tmp_path / "hostfile"
        hostfile.unlink(missing_ok=True)
        if text is not None:
            hostfile.write_text(text)
        proc = subprocess.run([str(REPO / "launch" / "deepspeed.sh"), "cfg.yaml"], cwd=REPO, capture_output=True,
                              text=True, timeout=60, env={**_env(), "HOSTFILE": str(hostfile),
                                                          "PYTHON": str(tmp_path / "bin" / "python")})
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


# ---------------------------------------------------------------------- accelerate launch
def _accelerate(config: str, *extra: str) -> list[str]:
    return [str(VENV_BIN / "accelerate"), "launch", "--config_file", str(REPO / "launch" / "accelerate" / config),
            *extra, "-m", "distnorm.train", "--config", str(DEMO)]


@pytest.fixture(scope="module")
def accelerate_two_processes(digits, tmp_path_factory):
    """multi_cpu.yaml: the 2-process reference run."""
    run = tmp_path_factory.mktemp("acc") / "multi_cpu"
    _run([*_accelerate("multi_cpu.yaml", "--main_process_port", str(free_port())), *_common(digits, run)], _env())
    return run


@pytest.mark.timeout(600)
@pytest.mark.world_size(2)
def test_accelerate_multi_cpu_yaml_starts_two_processes(accelerate_two_processes):
    """`accelerate launch` with the multi-CPU YAML starts the 2 processes the YAML promises:
    the checkpoint holds a world size of 2 and one random state per process. Before, it
    started 1."""
    manifest = _manifest(accelerate_two_processes)
    assert manifest["state"]["world_size"] == 2
    assert sorted(f for f in manifest["files"] if f.startswith("random_states")) == ["random_states_0.pkl",
                                                                                   "random_states_1.pkl"]


@pytest.mark.timeout(600)
@pytest.mark.world_size(2)
def test_accelerate_multi_node_yaml_two_machines_on_loopback(digits, tmp_path, accelerate_two_processes):
    """multi_node.yaml's rendezvous (static) as two machines x 1 process: it trains exactly as
    the 2-process single-machine run."""
    run = tmp_path / "multi_node"
    port = str(free_port())
    procs = [subprocess.Popen([*_accelerate("multi_node_cpu.yaml", "--machine_rank", str(rank), "--main_process_ip",
                                            "127.0.0.1", "--main_process_port", port), *_common(digits, run)],
                              cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    outputs = [p.communicate(timeout=500) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outputs]
    assert _manifest(run)["state"]["world_size"] == 2
    assert _losses(run) == _losses(accelerate_two_processes)


# ----------------------------------------------------------------------------- Slurm
def _sacct_state(job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    return next((w.split("=")[1] for w in out.split() if w.startswith("JobState=")), "GONE")


@pytest.mark.timeout(900)
@pytest.mark.world_size(2)
def test_slurm_sbatch_runs_and_requeues(digits, tmp_path):
    """launch/slurm.sbatch under a real slurmctld + slurmd: the job runs 2 processes through
    srun + torchrun.sh; SIGUSR1 (what --signal sends before the time limit) makes it requeue
    itself, and the requeued run resumes from its last checkpoint and finishes."""
    need("sbatch", "slurmctld", "slurmd", "munged")
    subprocess.run([str(REPO / "launch" / "slurm" / "local_cluster.sh"), "start"], check=True, timeout=300,
                   capture_output=True)
    run = tmp_path / "slurm"
    log = tmp_path / "slurm-%j.out"
    overrides = [*digits_overrides(digits), "train.max_steps=20", "output.checkpoint_every_steps=4",
                 f"output.dir={run}", "output.progress=false", "output.log_every=1"]
    submit = _run(["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2", "--time=15:00",
                   f"--output={log}", str(REPO / "launch" / "slurm.sbatch"), str(DEMO), *overrides],
                  _env(NPROC="2"))
    job = submit.stdout.strip().split(";")[0]
    log = tmp_path / f"slurm-{job}.out"
    try:
        deadline = time.time() + 400
        while not (run / "checkpoints" / "step_000000008").is_dir():
            assert time.time() < deadline, log.read_text()[-3000:] if log.exists() else "no log"
            time.sleep(0.5)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
        # Slurm holds a requeued job back for about two minutes (its begin time moves); an
        # administrator's "start it now" is what a test can afford.
        while _sacct_state(job) != "PENDING":
            assert time.time() < deadline + 120 and _sacct_state(job) in ("RUNNING", "COMPLETING", "PENDING", "REQUEUED"), \
                log.read_text()[-3000:]
            time.sleep(0.5)
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
        while _sacct_state(job) not in ("COMPLETED", "FAILED", "CANCELLED", "GONE"):
            assert time.time() < deadline + 300, log.read_text()[-3000:]
            time.sleep(1)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    text = log.read_text()
    assert _sacct_state(job) == "COMPLETED", text[-3000:]
    assert "requeueing job" in text and "(restart 1)" in text
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    resumes = [r for r in records if r["kind"] == "resume"]
    assert resumes and resumes[-1]["global_step"] >= 8  # resumed from a checkpoint, not from scratch
    assert max(r["step"] for r in records if r["kind"] == "train") == 20
    assert _manifest(run)["state"]["world_size"] == 2
    assert f"head {os.uname().nodename.split('.')[0]}:{20000 + int(job) % 20000}" in text  # port from the job id
