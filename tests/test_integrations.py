"""The plugin under real Accelerate (MULTI_CPU) and DeepSpeed (CPU accelerator, ZeRO 0-3),
launched with torchrun: 2 ranks on split batches must match 1 rank on the whole batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distnorm

pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from tests.helpers import free_port

SCRIPT = Path(__file__).parent / "engines" / "small_train.py"
REPO = Path(__file__).resolve().parents[1]
TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(scope="module", autouse=True)
def _build_deepspeed_cpu_ops():
    """DeepSpeed's CPU accelerator JIT-compiles a C++ op on first use; build it once here,
    in one process, instead of in two racing ranks of the first launched test. Not in
    ``make check``'s tier, which launches nothing."""
    if os.environ.get("DISTNORM_TEST_TIER") == "check":
        return
    code = ("from deepspeed.accelerator import get_accelerator; "
            "get_accelerator().create_op_builder('ShareMemCommBuilder').load()")
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "DS_ACCELERATOR": "cpu"},
                   check=True, capture_output=True, timeout=600)



def launch_many(nproc: int, runs: list[tuple[Path, list[str]]], expect: int | None = 0,
                timeout: int = 300) -> list[list[dict]]:
    """Run tests/engines/small_train.py under torchrun once for several trainings, one after
    the other in the same ranks (``--then``): ``runs`` is ``(out, args)`` per training.
    Returns each training's per-rank records. One launch costs ~10 s of start-up on 2 cores
    (torchrun, ``import torch`` / ``deepspeed``, rendezvous), a training of the small CNN
    well under one, so trainings that need no fresh processes share one. ``expect``: the exit
    code, nonzero for "fails", ``None`` to leave it to the records (each training records its
    own refusal or inconsistency and the next one runs)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "ACCELERATE_USE_CPU": "true"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(SCRIPT)]
    for i, (out, args) in enumerate(runs):
        cmd += [*(["--then"] if i else []), "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    said = f"torchrun exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    if expect == 0 and proc.returncode != 0:
        raise AssertionError(said)
    if expect:
        assert proc.returncode != 0, "the run was expected to fail"
    missing = [f"{out}.rank{r}.pt" for out, _ in runs for r in range(nproc) if not Path(f"{out}.rank{r}.pt").exists()]
    assert not missing, f"no record {missing[0]} (a training raised where it should have recorded):\n{said}"
    return [[torch.load(f"{out}.rank{r}.pt", weights_only=False) for r in range(nproc)] for out, _ in runs]


def _assert_same_training(split: list[dict], single: dict) -> None:
    for rank_result in split:
        assert rank_result["world"] == len(split)
        torch.testing.assert_close(torch.tensor(rank_result["lrs"]), torch.tensor(single["lrs"]))
        for name, value in single["params"].items():
            torch.testing.assert_close(rank_result["params"][name], value, **TOL, msg=name)
        for name, value in single["buffers"].items():
            torch.testing.assert_close(rank_result["buffers"][name], value, **TOL, msg=name)
    # the loss of the global batch is the mean of the per-rank losses (equal splits)
    mean_loss = torch.tensor([r["losses"] for r in split]).mean(0)
    torch.testing.assert_close(mean_loss, torch.tensor(single["losses"]), **TOL)
    # buffers are bit-identical across ranks without any broadcast
    for name, value in split[0]["buffers"].items():
        assert torch.equal(value, split[1]["buffers"][name]), name


def _assert_eta_follows_lr(result: dict, omega: float = 10.0) -> None:
    assert len(set(result["lrs"])) > 2  # the schedule really moves (warm-up, then decay)
    for lr, etas in zip(result["lrs"], result["etas"]):
        for eta in etas:
            assert eta == pytest.approx(max(1 - omega * lr, 0.0), abs=1e-12)


CONFIGS = [
    pytest.param(["--engine", "accelerate"], id="accelerate"),
    pytest.param(["--engine", "accelerate", "--distnorm-bnp", "--ddp-kwargs-handler"], id="accelerate-bnp"),
    *[pytest.param(["--engine", "deepspeed", "--zero", str(z)], id=f"deepspeed-zero{z}") for z in range(4)],
    pytest.param(["--engine", "deepspeed", "--zero", "2", "--distnorm-bnp"], id="deepspeed-zero2-bnp"),
    pytest.param(["--engine", "deepspeed", "--zero", "3", "--distnorm-bnp"], id="deepspeed-zero3-bnp"),
]


#: The configurations of test_two_ranks_match_one_process, by engine: one launch per engine
#: and world size trains them all (trainings in one process group one after the other).
BY_ENGINE = {
    "accelerate": [c for c in CONFIGS if "accelerate" in c.id],
    "deepspeed": [c for c in CONFIGS if "deepspeed" in c.id],
}


#: The engine's configurations in test_off_is_off and test_periodic_check_catches_a_perturbed_buffer.
OFF_IS_OFF = {"accelerate": CONFIGS[0], "deepspeed": CONFIGS[3]}
PERTURBED = {"accelerate": CONFIGS[0], "deepspeed": CONFIGS[5]}


def _split_args(engine: str) -> dict[str, list[str]]:
    """test_two_ranks_match_one_process's trainings of ``engine``, by configuration id."""
    extra = ["--distnorm", "cbn", "--distnorm-cbn-rho", "2", "--steps", "6", "--distnorm-check-every", "2",
             *(["--count-collectives"] if engine == "accelerate" else [])]
    return {c.id: [*c.values[0], *extra] for c in BY_ENGINE[engine]}


@pytest.fixture(scope="module")
def two_rank_launch(tmp_path_factory):
    """One 2-rank launch per engine holds every training of the tests below that needs no fresh
    processes, in this order: test_off_is_off's run without the plugin's lines (first, so that
    nothing the plugin does in a process can reach it) and with them; every configuration of
    test_two_ranks_match_one_process; the uninterrupted runs and the first parts of
    test_resume_in_fresh_processes_equals_uninterrupted (their checkpoints in ``ckpt<i>``
    beside the records); the run whose buffer is perturbed
    (test_periodic_check_catches_a_perturbed_buffer: last, it raises on both ranks). One launch
    instead of four per engine: ~10 CPU-seconds of start-up each (torchrun, two ranks importing
    torch and the engine). ``two_rank_launch(engine)``: each training's per-rank records, by
    name, and ``"root"``: the launch's directory."""
    done: dict[str, dict] = {}

    def get(engine: str) -> dict:
        if engine not in done:
            root = tmp_path_factory.mktemp(f"launch-{engine}")
            off = [*OFF_IS_OFF[engine].values[0], "--steps", "4"]
            runs = {"off-without": [*off, "--no-plugin"], "off-with": off,
                    **{f"split-{name}": a for name, a in _split_args(engine).items()},
                    **{f"{part}{i}": a for i, parts in enumerate(_resume_args(engine, root))
                       for part, a in parts.items() if part in ("full", "first")},
                    "perturbed": [*PERTURBED[engine].values[0], "--distnorm", "cbn", "--steps", "6",
                                  "--distnorm-check-every", "1", "--perturb-step", "2"]}
            # The perturbed run exits 3 on both ranks; every training's outcome is in its records.
            records = launch_many(2, [(root / name, a) for name, a in runs.items()], expect=None)
            done[engine] = {"root": root, **dict(zip(runs, records))}
        return done[engine]

    return get


@pytest.mark.timeout(900)
@pytest.mark.world_size(2)
@pytest.mark.parametrize("engine", list(BY_ENGINE))
def test_two_ranks_match_one_process(tmp_path, engine, two_rank_launch):
    """Every configuration of the engine (Accelerate with and without BNP; DeepSpeed ZeRO 0-3,
    ZeRO 2 and 3 with BNP): 2 ranks on split batches equal 1 rank on the whole batch.

    Accelerate's 2-rank steps are also counted (every collective of each training step):
    ``prepare`` makes Accelerate build DDP without the per-forward buffer broadcast, with no
    DDP handler (``accelerate``) and with the script's own (``accelerate-bnp``), and the
    consistency check runs every second step (``check_every=2``). Left on in either case, the
    broadcast would keep the buffers equal with one more collective per forward, invisible to
    the comparison of values."""
    from tests.test_ddp_buffers import assert_no_buffer_broadcast, checks_per_step

    args = _split_args(engine)
    splits = [two_rank_launch(engine)[f"split-{name}"] for name in args]
    singles = launch_many(1, [(tmp_path / f"single-{name}", a) for name, a in args.items()])
    for name, split, (single,) in zip(args, splits, singles):
        if engine == "accelerate":
            for rank, record in enumerate(split):
                assert_no_buffer_broadcast(record["collectives"], f"{name}, rank {rank}")
                assert checks_per_step(record["collectives"]) == [0, 1] * 3, (name, rank, record["collectives"])
        _assert_same_training(split, single)
        _assert_eta_follows_lr(split[0])
        if "--distnorm-bnp" in args[name]:
            assert any(k.endswith("bnp_var") for k in split[0]["buffers"])


#: test_resume_in_fresh_processes_equals_uninterrupted, by engine: Accelerate; DeepSpeed ZeRO-1
#: and ZeRO-3 in the same launches.
RESUME = {"accelerate": [CONFIGS[0]], "deepspeed": [CONFIGS[3], CONFIGS[5]]}


def _resume_args(engine: str, root: Path) -> list[dict[str, list[str]]]:
    """test_resume_in_fresh_processes_equals_uninterrupted's trainings of ``engine``, per
    configuration: the uninterrupted run, the first part (saved at step 3 into
    ``root/ckpt<i>``), the resume, and the resume with another distnorm configuration."""
    out = []
    for i, config in enumerate(RESUME[engine]):
        args = [*config.values[0], "--distnorm", "cbn", "--distnorm-bnp", "--steps", "6", "--ckpt", str(root / f"ckpt{i}")]
        out.append({
            "full": args,
            "first": [*args, "--save-at", "3"],
            "resumed": [*args, "--save-at", "3", "--resume"],
            "refused": [*args, "--save-at", "3", "--resume", "--distnorm-cbn-rho", "3", "--expect-refused-resume"],
        })
    return out


@pytest.mark.processes
@pytest.mark.timeout(900)
@pytest.mark.parametrize("engine", [pytest.param("accelerate"), pytest.param("deepspeed", id="deepspeed-zero1-zero3")])
def test_resume_in_fresh_processes_equals_uninterrupted(tmp_path, engine, two_rank_launch):
    """Save at step 3, resume in fresh processes: the same losses, LRs and final state as the
    uninterrupted run. The uninterrupted run and the first part need no fresh processes: they
    run in the engine's shared launch (``two_rank_launch``); the resumed part is a launch of
    its own.

    The plugin's state rides in each engine's own checkpoint hook (Accelerate's
    ``register_for_checkpointing``, DeepSpeed's ``client_state``): the resumed plugin counts
    on from the saved training forwards, and a resume with another distnorm configuration
    (CBN's rho 3 instead of 1) is refused on every rank in one line naming the key and both
    values. Without the plugin's entry
    in the checkpoint, the count would restart at 0 and the other configuration would resume
    silently."""
    shared = two_rank_launch(engine)
    trainings = _resume_args(engine, shared["root"])
    full = [shared[f"full{i}"] for i in range(len(trainings))]
    for i in range(len(trainings)):  # the shared launch leaves each training's outcome to its records
        for part in ("full", "first"):
            assert all("error" not in r for r in shared[f"{part}{i}"]), shared[f"{part}{i}"]
    resumed = [(tmp_path / f"resumed{i}", parts["resumed"]) for i, parts in enumerate(trainings)]
    refused = [(tmp_path / f"refused{i}", parts["refused"]) for i, parts in enumerate(trainings)]
    after = launch_many(2, [*resumed, *refused])  # the refused resumes last: each raises on its ranks
    for full_run, resumed_run, refused_run in zip(full, after, after[len(trainings):]):
        _assert_resumed_equals_full(full_run, resumed_run)
        for a, b, c in zip(full_run, resumed_run, refused_run):
            assert a["plugin_state"]["training_forwards"] == b["plugin_state"]["training_forwards"] == 6
            assert "another distnorm configuration (cbn.rho: " in c.get("error", ""), c.get("error")
            assert len(c["error"].splitlines()) == 1, c["error"]  # one line, naming the key and both values
            assert "cbn.rho: 1.0 in the checkpoint, 3.0 in this run" in c["error"], c["error"]


def _assert_resumed_equals_full(full: list[dict], resumed: list[dict]) -> None:
    for a, b in zip(full, resumed):
        assert b["first_step"] == 3
        torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"][3:]), **TOL)
        torch.testing.assert_close(torch.tensor(b["lrs"]), torch.tensor(a["lrs"][3:]))
        assert b["next_lr"] == pytest.approx(a["next_lr"])
        for kind in ("params", "buffers"):
            for name, value in a[kind].items():
                torch.testing.assert_close(b[kind][name], value, **TOL, msg=name)
        if "optimizer" in a:  # Accelerate: the torch optimizer state (momentum buffers)
            for key, state in a["optimizer"]["state"].items():
                torch.testing.assert_close(b["optimizer"]["state"][key]["momentum_buffer"], state["momentum_buffer"], **TOL)


@pytest.mark.processes
@pytest.mark.timeout(900)
@pytest.mark.parametrize("engine", [pytest.param(e, id=c.id) for e, c in PERTURBED.items()])
def test_periodic_check_catches_a_perturbed_buffer(engine, two_rank_launch):
    """Rank 1 changes a buffer at step 2; the check every forward raises on both ranks."""
    for r in two_rank_launch(engine)["perturbed"]:  # both ranks stop, naming the buffer and the ranks
        error = r.get("error", "(no error: the training ran to its end)")
        assert "0.norm.amat_mean" in error and "[0] | [1]" in error, error


def test_follow_rejects_optimizer_built_before_conversion():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    plugin = distnorm.DistNormPlugin(model, distnorm.DistNormConfig(norm="cbn"))
    with pytest.raises(ValueError, match="built before"):
        plugin.follow(early)
    with pytest.raises(TypeError, match="optimizer"):
        plugin.follow("0.1")


def test_missing_optional_dependency_message(monkeypatch):
    # A None entry in sys.modules is Python's own way of making an import fail.
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    from distnorm.integrations import deepspeed as dn_deepspeed

    with pytest.raises(ImportError, match=r"pip install distnorm\[deepspeed\]"):
        dn_deepspeed.prepare(torch.nn.Linear(2, 2))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("script,extra", [
    ("accelerate_train.py", ["--cpu", "--batch-size", "8"]),
    ("deepspeed_train.py", ["--deepspeed_config", "configs/deepspeed/example_cpu_zero2.json"]),
])
@pytest.mark.processes
def test_examples_run_under_torchrun(tmp_path, script, extra):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(REPO / "examples" / script), *extra, "--distnorm", "cbn",
           "--distnorm-bnp", "--max-steps", "4", "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "done: 4 steps" in proc.stdout


@pytest.mark.timeout(900)
@pytest.mark.world_size(2)
@pytest.mark.parametrize("engine", [pytest.param(e, id=c.id) for e, c in OFF_IS_OFF.items()])
def test_off_is_off(engine, two_rank_launch):
    """With the plugin lines but no --distnorm flag, a run equals one without the lines: the
    same losses, parameters and buffers. Before, prepare() still turned DDP's buffer broadcast
    off, so plain BatchNorm running statistics drifted apart per rank. The run without the
    plugin is the launch's first: nothing the plugin does can reach it."""
    runs = two_rank_launch(engine)
    without, with_lines = runs["off-without"], runs["off-with"]
    for a, b in zip(with_lines, without):
        assert a["losses"] == b["losses"]
        for kind in ("params", "buffers"):
            assert a[kind].keys() == b[kind].keys()
            for name in a[kind]:
                assert torch.equal(a[kind][name], b[kind][name]), (kind, name)


def test_buffer_broadcast_stays_on_while_local_batchnorms_remain(caplog):
    from accelerate import Accelerator

    import distnorm.integrations.accelerate as dn

    def handler_after(cfg):
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
        plugin = dn.prepare(model, cfg, accelerator)
        return accelerator.ddp_handler, plugin

    handler, plugin = handler_after(distnorm.DistNormConfig())  # off
    assert handler is None and plugin._hook is None
    with caplog.at_level("WARNING"):
        handler, plugin = handler_after(distnorm.DistNormConfig(bnp=True))  # BNP, the BN stays local
    assert (handler is None or handler.broadcast_buffers) and "keeps broadcasting buffers" in caplog.text
    assert plugin.local_running_stats == ["1"]
    handler, _ = handler_after(distnorm.DistNormConfig(norm="bn"))
    assert handler.broadcast_buffers is False


# ------------------------------------------- DeepSpeed against one plain process
@pytest.mark.timeout(300)
@pytest.mark.world_size(2)
@pytest.mark.parametrize("zero, clip", [
    pytest.param(0, 0.2, id="zero0-clip"),     # clipping that bites for every kind (norms 0.2-0.7)
    pytest.param(3, 0.0, id="zero3-noclip"),   # every parameter sharded, no clipping
])
def test_deepspeed_equals_one_plain_process_with_and_without_plugin(tmp_path, zero, clip):
    """DeepSpeed, with and without the plugin, equals one plain-PyTorch process at every ZeRO
    stage. A CBN model given to ``deepspeed.initialize`` without the plugin once ended 4
    steps 0.1-0.7 relative away from one process. The cause was DeepSpeed's default gradient
    clipping at norm 1.0 (DeepSpeed 0.19), which the plain reference did not apply; the plugin
    tests compared DeepSpeed with DeepSpeed on one rank, which clips alike. Here one
    plain-PyTorch process (SGD, LambdaLR, ``clip_grad_norm_`` where DeepSpeed clips) is the
    reference for every model kind, on the bare path and the plugin path, in one 2-rank
    process group per ZeRO stage."""
    from tests.distributed import run_distributed
    from tests.engines import deepspeed_compare as C

    ranks = run_distributed(C.worker, 2, tmp_path, zero, clip, timeout=240)
    for kind in C.KINDS:
        single = C.reference(kind, clip)
        if clip:  # the clipping is exercised, not idle
            assert max(single["grad_norms"]) > clip, (kind, single["grad_norms"])
        for path in ("bare", "plugin"):
            split = [r[f"{kind}/{path}"] for r in ranks]
            where = f"{kind}, {path}, ZeRO-{zero}"
            for r in split:
                assert r["lrs"] == pytest.approx(single["lrs"], rel=1e-12), where
                for part in ("params", "buffers"):
                    assert r[part].keys() == single[part].keys(), where
                    for name, value in single[part].items():
                        torch.testing.assert_close(r[part][name], value, **TOL, msg=f"{where}: {name}")
            mean_loss = torch.tensor([r["losses"] for r in split]).mean(0)
            torch.testing.assert_close(mean_loss, torch.tensor(single["losses"]), **TOL, msg=where)
            for name, value in split[0]["buffers"].items():  # no broadcast needed
                assert torch.equal(value, split[1]["buffers"][name]), f"{where}: {name}"
            # The check compares buffers, replicated parameters and replicated optimizer
            # state: ZeRO-0 keeps all of them on every rank, ZeRO-3 shards the parameters
            # (and their optimizer state), which are then left out rather than compared.
            params = len(single["params"])
            expected = split[0]["buffers_checked"] + (2 * params if zero == 0 else 0)
            assert split[0]["checked"] == expected, where
    if zero == 0:  # a weight drifted on rank 1: the plugin's check stops both ranks, naming it
        for r in ranks:
            name, message = r["cbn/plugin"]["drift_error"]
            assert f"{name}: ranks [0] | [1]" in message, message


@pytest.mark.processes
def test_the_deepspeed_integration_builds_deepspeeds_ops_in_its_venv():
    """A script that imports the DeepSpeed integration (the examples, distnorm-train's workers
    on every node) builds DeepSpeed's ops in its venv's own directory, not in the cache every
    venv of the user shares; a ``TORCH_EXTENSIONS_DIR`` the user set wins."""
    import hashlib

    show = "import os, distnorm.integrations.deepspeed; print(os.environ['TORCH_EXTENSIONS_DIR'])"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    own = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True, timeout=120)
    want = Path(sys.prefix) / "torch_extensions" / hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    assert own.returncode == 0 and own.stdout.strip() == str(want), own.stderr[-2000:]
    mine = subprocess.run([sys.executable, "-c", show], env={**env, "TORCH_EXTENSIONS_DIR": "/tmp/mine"},
                          capture_output=True, text=True, timeout=120)
    assert mine.stdout.strip() == "/tmp/mine", mine.stderr[-2000:]
