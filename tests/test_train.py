"""The recipe end to end: the demo path, two simulated nodes, dry runs of every shipped
ImageNet config, crash + resume, and configuration errors before any worker starts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distnorm.train.checkpoint import verify_checkpoint
from distnorm.train.config import ConfigError, load_config

from tests.helpers import digits_overrides, free_port

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo" / "digits.yaml"
IMAGENET_CONFIGS = sorted((REPO / "configs" / "imagenet").glob("*.yaml"))




_data_overrides = digits_overrides


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port()), **extra}


def _torchrun_sh(*args: str, env: dict, timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(REPO / "launch" / "torchrun.sh"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def _records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


#: The demo run shared by the tests below: 2 epochs (46 steps) on 2 processes, every step
#: logged, a checkpoint every 6 steps (mid-epoch ones for the resume test), the monitors on.
def _demo_args(digits: Path) -> list[str]:
    return [str(DEMO), *_data_overrides(digits), "train.epochs=2", "output.log_every=1", "output.checkpoint_every_steps=6",
            "output.progress=false", "output.monitors=true", "output.monitor_every=10"]


@pytest.fixture(scope="module")
def demo_run(digits, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One uninterrupted demo run through launch/torchrun.sh, read by the end-to-end test, the
    kill -9 test (its reference) and the two-node test (its first 8 steps): ~40 s of training
    on 2 cores, run once instead of three times."""
    run = tmp_path_factory.mktemp("demo") / "demo"
    return run, _torchrun_sh(*_demo_args(digits), f"output.dir={run}", env=_env(NPROC="2"))


@pytest.mark.processes
@pytest.mark.timeout(900)
def test_demo_path_end_to_end(demo_run, digits):
    run, proc = demo_run
    assert "final top-1" in proc.stdout and (f"checkpoint: {run}/checkpoints/step_000000046; frozen model: "
                                             f"{run}/model-frozen.pt, {run}/model-frozen.onnx\n") in proc.stdout
    # A quiet console (output.log_level=warning): one summary line per epoch, no library INFO
    # lines (Accelerate's checkpointing printed 76 of them around the progress bar).
    assert [line[:9] for line in proc.stdout.splitlines() if line.startswith("epoch ")] == ["epoch 1/2", "epoch 2/2"]
    assert " INFO " not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    evals = _records(run, "eval")
    # Learning, not a figure: 2 epochs at lr 0.1 amplify rounding. 84.2 % (2026-11-23), 60.3 % with
    # the backward's one-pass element-wise kernel (2026-11-26), whose losses match the two-pass
    # form's to 1e-6 at step 3 and drift apart after; chance is 10 %.
    assert len(evals) == 2 and evals[-1]["count"] == 360 and evals[-1]["top1"] > 40
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text()
    assert verify_checkpoint(latest) is None
    assert (run / "config.yaml").is_file()
    report = subprocess.run([sys.executable, "-m", "distnorm.report", str(run)], capture_output=True, text=True, timeout=300)
    assert report.returncode == 0 and (run / "report" / "top1.png").is_file()
    # The frozen model the run wrote: distnorm-train --evaluate reads it and finds the run's last
    # evaluation (the same samples; outputs equal to 1e-6, so at most a tie flips a sample).
    done = subprocess.run([sys.executable, "-m", "distnorm.train", "--config", str(DEMO),
                           *_data_overrides(digits),
                           "data.eval_workers=0", "--evaluate", str(run / "model-frozen.pt")],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    top1 = float(done.stdout.split("top-1 ")[1].split("%")[0])
    assert abs(top1 - evals[-1]["top1"]) <= 100 / 360 + 1e-9 and "over 360 samples" in done.stdout
    monitors = _records(run, "monitor")
    layers = {r["layer"] for r in monitors}
    assert "model" in layers and "conv1.norm" in layers and {r["step"] for r in monitors} == {10, 20, 30, 40}
    assert all("eta_q50" in r and "tau_q50" in r for r in monitors if r["layer"] != "model")
    assert (run / "report" / "monitor_tau_q50.png").is_file() and (run / "report" / "monitor_grad_variance.png").is_file()


@pytest.mark.processes
@pytest.mark.timeout(900)
def test_two_nodes_on_loopback_equal_one_node(tmp_path, digits, demo_run):
    """Two torchrun.sh "nodes" of 1 process each (static rendezvous on loopback) train their
    first 8 steps as the one-node 2-process demo run does (the schedule does not depend on
    the number of steps asked for)."""
    one, _ = demo_run
    common = [str(DEMO), *_data_overrides(digits), "train.max_steps=8", "output.log_every=1", "output.progress=false",
              "train.epochs=1"]
    two = tmp_path / "two"
    env = _env(NPROC="1", NNODES="2", RDZV="static", MASTER_ADDR="127.0.0.1")
    nodes = [subprocess.Popen([str(REPO / "launch" / "torchrun.sh"), *common, f"output.dir={two}"], cwd=REPO,
                              env={**env, "NODE_RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outputs = [n.communicate(timeout=600) for n in nodes]
    assert all(n.returncode == 0 for n in nodes), outputs
    a, b = _records(one, "train")[:8], _records(two, "train")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 9))
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6, abs=1e-7) and ra["lr"] == rb["lr"]


_DRY_RUN = ["--dry-run", "--dry-run-batch", "2", "train.cpu=true", "data.image_size=64", "output.dir=/tmp/distnorm-dry-run"]

#: Runs ``distnorm.train``'s command line once per config given, in this one process, and
#: prints each one's exit code and output as a JSON line.
_DRY_RUNS_IN_ONE_PROCESS = """
import contextlib, io, json, logging, sys, traceback
from distnorm.train.cli import main
logging.basicConfig(level=logging.WARNING)  # bound to the real stderr, not to the first redirection below
for config in sys.argv[1:]:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(["--config", config, *%r])
    except BaseException:
        code, out = 1, io.StringIO(traceback.format_exc())
    print(json.dumps({"config": config, "code": code, "output": out.getvalue()[-4000:]}), flush=True)
""" % (_DRY_RUN,)


@pytest.fixture(scope="module")
def dry_runs() -> dict[str, dict]:
    """The dry runs of every ImageNet config but the DeepSpeed one, one after the other in one
    Python process: 12 configs pay one interpreter start and one ``import torch`` / Accelerate
    (~5 s each on 2 cores) instead of twelve. The DeepSpeed config runs in its own process,
    as a launcher starts it (its process group)."""
    configs = [str(c) for c in IMAGENET_CONFIGS if "deepspeed" not in c.stem]
    proc = subprocess.run([sys.executable, "-c", _DRY_RUNS_IN_ONE_PROCESS, *configs], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {Path(r["config"]).stem: r for r in map(json.loads, proc.stdout.splitlines()) if r.get("config")}


@pytest.mark.processes
@pytest.mark.timeout(900)
@pytest.mark.parametrize("config", IMAGENET_CONFIGS, ids=[p.stem for p in IMAGENET_CONFIGS])
def test_dry_run_every_imagenet_config(config, request):
    """Every ImageNet recipe builds its model, norm and engine and trains 2 synthetic steps.
    At 64 px instead of 224 (12x less compute; ResNet-50 under DeepSpeed took 98 s): the
    models are the configured ones, only the synthetic images are smaller."""
    if "deepspeed" not in config.stem:
        result = request.getfixturevalue("dry_runs")[config.stem]
        assert result["code"] == 0, result["output"]
        assert "dry run OK: 2 steps" in result["output"], result["output"]
        return
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # as a launcher sets it up
    proc = subprocess.run([sys.executable, "-m", "distnorm.train", "--config", str(config), *_DRY_RUN],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "dry run OK: 2 steps" in proc.stdout


@pytest.mark.processes
@pytest.mark.timeout(900)
def test_kill_mid_epoch_and_resume_continues_exactly(tmp_path, digits, demo_run):
    """The demo run killed with -9 after its mid-epoch checkpoint at step 12, then started
    again: it resumes there and continues as the uninterrupted demo run (``demo_run``),
    data position included (with ``skip_batches=0`` it would not)."""
    args = _demo_args(digits)
    full, _ = demo_run

    crashed = tmp_path / "crashed"
    env = _env(NPROC="2")
    proc = subprocess.Popen([str(REPO / "launch" / "torchrun.sh"), *args, f"output.dir={crashed}"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not (crashed / "checkpoints" / "step_000000012").is_dir():  # mid epoch 1 (23 steps/epoch)
        assert time.time() < deadline and proc.poll() is None, "no mid-epoch checkpoint appeared"
        time.sleep(0.2)
    # kill -9 of the whole job, as a scheduler does (torchrun starts each rank in its own
    # session, so the launcher's process group alone does not reach them).
    subprocess.run(["pkill", "-9", "-f", f"output.dir={crashed}"], check=False)
    proc.wait(timeout=60)
    time.sleep(1)
    assert subprocess.run(["pgrep", "-f", f"output.dir={crashed}"], capture_output=True).stdout == b""

    _torchrun_sh(*args, f"output.dir={crashed}", env=_env(NPROC="2"))
    resume = _records(crashed, "resume")
    assert resume and resume[-1]["global_step"] >= 12
    assert resume[-1]["epoch"] == 0 and 0 < resume[-1]["step_in_epoch"] < 23  # it resumed mid-epoch
    start = resume[-1]["global_step"]
    reference = {r["step"]: r for r in _records(full, "train")}
    after = [r for r in _records(crashed, "train") if r["time"] > resume[-1]["time"]]
    assert after[0]["step"] == start + 1 and after[-1]["step"] == 46
    for r in after:  # same data, same augmentations, same LR schedule position
        assert r["lr"] == reference[r["step"]]["lr"]
        assert r["loss"] == pytest.approx(reference[r["step"]]["loss"], rel=1e-5, abs=1e-6)
    assert _records(crashed, "eval")[-1]["top1"] == pytest.approx(_records(full, "eval")[-1]["top1"], abs=1e-9)
    # the final state itself: every parameter, buffer (distnorm's included) and optimizer tensor
    final = "step_000000046"
    a, b = _checkpoint_tensors(full / "checkpoints" / final), _checkpoint_tensors(crashed / "checkpoints" / final)
    assert a.keys() == b.keys() and any(".amat_var" in k for k in a) and any(k.startswith("optimizer") for k in a)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


def _checkpoint_tensors(directory: Path) -> dict[str, "torch.Tensor"]:
    """Every tensor of a checkpoint's model (safetensors) and optimizer (torch.save) files."""
    from safetensors.torch import load_file

    out = {}
    for path in sorted(directory.rglob("*.safetensors")):
        out.update({f"{path.stem}/{k}": v for k, v in load_file(path).items()})
    for path in sorted(directory.rglob("optimizer*.bin")):
        def walk(prefix, value):
            if isinstance(value, torch.Tensor):
                out[prefix] = value
            elif isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}/{k}", v)
            elif isinstance(value, (list, tuple)):
                for i, v in enumerate(value):
                    walk(f"{prefix}/{i}", v)
        walk(path.stem, torch.load(path, map_location="cpu", weights_only=False))
    return out


# ------------------------------------------------------------------ bad input
@pytest.mark.processes
def test_unknown_key_and_bad_values(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"extends: {DEMO}\ntrain:\n  epohcs: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['train.epohcs'\]"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"must be <section>.<key>"):
        load_config(DEMO, ["trainer.epochs=3"])
    bad.write_text(f"extends: {DEMO}\ntrainer:\n  epochs: 3\n")
    with pytest.raises(ConfigError, match=r"unknown section\(s\) \['trainer'\]"):
        load_config(bad)
    bad.write_text(f"extends: {DEMO}\ntrain:\n  epohcs: 3\n")
    with pytest.raises(ValueError, match="distnorm.*nrom"):
        load_config(DEMO, ["distnorm.nrom=cbn"])
    with pytest.raises(ConfigError, match="train.engine"):
        load_config(DEMO, ["train.engine=megatron"])
    with pytest.raises(ConfigError, match="train.epochs='two' is not a valid int"):
        load_config(DEMO, ["train.epochs=two"])
    assert load_config(DEMO, ["optim.weight_decay=1e-4"]).optim.weight_decay == 1e-4  # YAML 1.1 reads a string
    proc = subprocess.run([sys.executable, "-m", "distnorm.train", "--config", str(bad), "--dry-run"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "train.epohcs" in proc.stderr


def test_missing_shards_and_engine_and_batch_split(tmp_path, digits, monkeypatch):
    from distnorm.train.checks import check_setup

    cfg = load_config(DEMO, _data_overrides(digits))
    check_setup(cfg, 2)
    with pytest.raises(ConfigError, match="does not split over 3 processes"):
        check_setup(cfg, 3)
    missing = load_config(DEMO, [*_data_overrides(digits)[1:], f"data.train_shards={digits}/digits-train-{{000000..000009}}.tar"])
    with pytest.raises(ConfigError, match="4 shard.s. missing"):
        check_setup(missing, 2)
    # a relative data path's error says where it was looked for
    monkeypatch.chdir(tmp_path)
    relative = load_config(DEMO, ["data.train_index=data/nowhere-index.json"])
    with pytest.raises(ConfigError, match=f"a relative path: looked up from the current directory, {tmp_path}"):
        check_setup(relative, 2)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # Python's own "not installed"
    ds = load_config(DEMO, [*_data_overrides(digits), "train.engine=deepspeed",
                            "train.deepspeed_config=configs/deepspeed/zero0_bf16.json"])
    with pytest.raises(ConfigError, match=r"pip install distnorm\[deepspeed\]"):
        check_setup(ds, 2)


def test_a_key_given_twice_is_refused_naming_the_shell_expansion(digits):
    """What an unquoted brace pattern becomes after a (remote) shell: six arguments for one key.
    Refused, not "the last one wins" (which trained on one shard out of six)."""
    expanded = [f"data.train_shards={digits}/digits-train-{i:06d}.tar" for i in range(6)]
    with pytest.raises(ConfigError, match=r"data.train_shards given 6 times .*a shell expanded it: quote"):
        load_config(DEMO, [*_data_overrides(digits)[1:], *expanded])


@pytest.mark.processes
def test_launcher_refuses_bad_split_before_starting_workers(tmp_path, digits):
    proc = _torchrun_sh(str(DEMO), *_data_overrides(digits), f"output.dir={tmp_path / 'x'}",
                        env=_env(NPROC="3"), check=False, timeout=120)
    assert proc.returncode == 2
    assert "does not split over 3 processes" in proc.stderr
    assert "torch.distributed" not in proc.stderr and not (tmp_path / "x").exists()  # no worker started


# ------------------------------------------------------------------ shipped recipes, by name
def test_a_shipped_recipe_by_name_from_any_directory(tmp_path, monkeypatch):
    """Outside the clone a recipe is found by name (``imagenet/resnet50_cbn``) or by a clone's
    path (``configs/imagenet/resnet50_cbn.yaml``) in the package (``distnorm.recipes``), its
    ``extends:`` followed there, its DeepSpeed JSON (``configs/deepspeed/...`` or
    ``deepspeed/...``) found there too; a file that exists here wins over a shipped name.
    Before, a clone's path gave "does not exist" outside the clone (issue 38), and the
    DeepSpeed JSON was looked up in the working directory only."""
    reference = load_config(REPO / "configs" / "imagenet" / "resnet50_cbn.yaml").to_dict()
    monkeypatch.chdir(tmp_path)
    for name in ("imagenet/resnet50_cbn", "imagenet/resnet50_cbn.yaml", "configs/imagenet/resnet50_cbn.yaml"):
        assert load_config(name).to_dict() == reference, name
    shipped = REPO / "configs" / "deepspeed"
    deepspeed = load_config("configs/imagenet/resnet50_cbn_deepspeed.yaml").train.deepspeed_config
    assert Path(deepspeed).read_bytes() == (shipped / "zero2_bf16.json").read_bytes()
    deepspeed = load_config("demo/digits", ["train.engine=deepspeed",
                                            "train.deepspeed_config=deepspeed/zero2_fp32.json"]).train.deepspeed_config
    assert Path(deepspeed).read_bytes() == (shipped / "zero2_fp32.json").read_bytes()
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "digits.yaml").write_text("model: {name: resnet20, num_classes: 7}\n")
    assert load_config("demo/digits.yaml").model.num_classes == 7  # the file here
    assert load_config("demo/digits").model.num_classes == 10  # no such file: the shipped recipe


def test_an_unknown_recipe_name_lists_the_closest_and_list_configs_lists_every_one(capsys):
    """A name that matches nothing is a configuration error naming the closest recipes (a
    misspelling; a name without its directory); ``--list-configs`` lists every shipped recipe
    and DeepSpeed JSON by the name ``--config`` / ``train.deepspeed_config`` take."""
    from distnorm.train import cli

    with pytest.raises(ConfigError, match=r"'imagenet/resnet50_cbm' is neither a file nor .* the closest: "
                                          r"imagenet/resnet50_cbn, .*--list-configs"):
        load_config("imagenet/resnet50_cbm")
    with pytest.raises(ConfigError, match=r"the closest: imagenet/resnet50_cbn, "):
        load_config("resnet50_cbn")
    assert cli.main(["--config", "imagenet/resnet50_cbm", "--check"]) == 2
    assert "the closest: imagenet/resnet50_cbn" in capsys.readouterr().err
    assert cli.main(["--list-configs"]) == 0
    listed = set(capsys.readouterr().out.split())
    configs = REPO / "configs"
    names = {p.relative_to(configs).with_suffix("").as_posix() for p in configs.rglob("*.yaml")}
    names |= {p.relative_to(configs).as_posix() for p in configs.rglob("*.json")}
    assert names - listed == set()


# ------------------------------------------------------------------ shards against their index
def _copy_shards(digits: Path, to: Path) -> Path:
    to.mkdir()
    for f in digits.iterdir():
        shutil.copy(f, to / f.name)
    return to


def test_check_compares_shard_sizes_and_on_request_checksums(tmp_path, digits, capsys):
    """``distnorm-train --check`` (what the launchers run before any worker) compares every
    local shard with its index: its size always, its SHA-256 with ``--verify-checksums``. A
    truncated shard fails the check (it passed, and the run then failed mid-epoch, issue 38),
    and a damaged shard of the right size fails ``--verify-checksums``."""
    from distnorm.train import cli

    data = _copy_shards(digits, tmp_path / "data")

    def check(*extra: str) -> int:  # overrides, then flags
        overrides = [e for e in extra if "=" in e]
        flags = [e for e in extra if "=" not in e]
        return cli.main(["--config", str(DEMO), *_data_overrides(data), *overrides, "--check", "--world-size", "2", *flags])

    assert check() == 0 and check("--verify-checksums") == 0
    assert "OK for 2 process(es), 32 samples each per step (shards, sizes and checksums checked)" in capsys.readouterr().out
    shard = data / "digits-train-000002.tar"
    whole = shard.read_bytes()
    shard.write_bytes(whole[:20000])  # an interrupted copy
    assert check() == 2
    err = capsys.readouterr().err
    assert f"data.train_shards: 1 of 6 shard(s) differ from data.train_index {data}/digits-train-index.json: " \
           f"{shard}: 20000 bytes, the index records {len(whole)}." in err and "set data.on_error=skip" in err, err
    with pytest.warns(UserWarning, match=r"digits-train-000002.tar: 20000 bytes.*\(data.on_error=skip\)"):
        assert check("data.on_error=skip") == 0  # let through: the loaders skip what they cannot read
    damaged = bytearray(whole)
    damaged[len(whole) // 2] ^= 0x01
    shard.write_bytes(bytes(damaged))  # bit rot: the size is right
    assert check() == 0  # sizes only, a stat per shard (the launchers' check: fast on ImageNet)
    capsys.readouterr()
    assert check("--verify-checksums") == 2
    assert f"{shard}: SHA-256 " in capsys.readouterr().err
    # an index without checksums (an older distnorm-shards): said, with what to run
    index = json.loads((data / "digits-train-index.json").read_text())
    for info in index["shards"]:
        info.pop("sha256")
    (data / "digits-train-index.json").write_text(json.dumps(index))
    assert check("--verify-checksums") == 2
    assert "records no checksum for 6 shard(s)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--config", str(DEMO), "--verify-checksums"])
    assert "--verify-checksums goes with --check" in capsys.readouterr().err


#: Runs distnorm-train's main in a process where torch and torchvision are installed (the
#: check looks them up) but importing them fails.
_WITHOUT_TORCH = """
import importlib.util, sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "torchvision"):
            return importlib.util.spec_from_loader(name, self)
    def create_module(self, spec):
        raise ImportError(f"{spec.name} imported on the check path")
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, NoTorch())
from distnorm.train.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_check_and_a_refused_configuration_run_without_torch(tmp_path, digits):
    """``distnorm-train --check`` (every launcher runs it first), a refused key, ``--help-config``
    and ``--list-configs`` never import torch: a tenth of a second instead of ``import torch``'s
    second or more, on a login node and in every process of a launch. The check path imports
    neither the loaders, the zoo's networks, the engines nor the training loop
    (``tests/test_structure.py`` checks the imports without running them)."""
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})

    checked = run("--config", str(DEMO), *_data_overrides(digits), "--check", "--world-size", "2")
    assert checked.returncode == 0 and "OK for 2 process(es)" in checked.stdout, checked.stderr
    refused = run("--config", str(DEMO), *_data_overrides(digits), "train.epochs=two")
    assert refused.returncode == 2 and "train.epochs='two' is not a valid int" in refused.stderr, refused.stderr
    split = run("--config", str(DEMO), *_data_overrides(digits), "--check", "--world-size", "3")
    assert split.returncode == 2 and "does not split over 3 processes" in split.stderr, split.stderr
    deepspeed = run("--config", "imagenet/resnet50_cbn_deepspeed", "--check")
    assert deepspeed.returncode == 2 and "data.train_index" in deepspeed.stderr, deepspeed.stderr  # past the engine
    for listing in ("--help-config", "--list-configs"):
        assert run(listing).returncode == 0
    trains = run("--config", str(DEMO), *_data_overrides(digits), "--dry-run")  # the one path that needs torch
    assert trains.returncode != 0 and "torch imported on the check path" in trains.stderr


@pytest.mark.processes
def test_launcher_refuses_a_truncated_shard_before_starting_workers(tmp_path, digits):
    data = _copy_shards(digits, tmp_path / "data")
    shard = data / "digits-val-000001.tar"
    shard.write_bytes(shard.read_bytes()[:5000])
    proc = _torchrun_sh(str(DEMO), *_data_overrides(data), f"output.dir={tmp_path / 'x'}",
                        env=_env(NPROC="2"), check=False, timeout=120)
    assert proc.returncode == 2 and "data.val_shards: 1 of 3 shard(s) differ" in proc.stderr, proc.stderr
    assert f"{shard}: 5000 bytes" in proc.stderr
    assert "torch.distributed" not in proc.stderr and not (tmp_path / "x").exists()  # no worker started


# ------------------------------------------------------------------ how a run ends
@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_max_steps_stop_writes_a_checkpoint_there(tmp_path, digits):
    """As Lightning does, a run stopped by ``train.max_steps`` mid-epoch saves its state there
    and names that checkpoint; the same command with a larger ``max_steps`` continues from it.
    Before, the last line named ``checkpoints/latest`` when no checkpoint existed (issue 38)."""
    run = tmp_path / "run"

    def train(steps: int) -> str:
        proc = subprocess.run([sys.executable, "-m", "distnorm.train", "--config", str(DEMO), *_data_overrides(digits),
                               f"output.dir={run}", f"train.max_steps={steps}", "output.progress=false",
                               "output.log_every=1", "data.num_workers=0"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    assert f"checkpoint: {run / 'checkpoints' / 'step_000000003'}" in train(3)  # no other checkpoint before 50
    assert (run / "checkpoints" / "latest").read_text() == "step_000000003"
    assert verify_checkpoint(run / "checkpoints" / "step_000000003") is None
    assert f"checkpoint: {run / 'checkpoints' / 'step_000000005'}" in train(5)
    assert _records(run, "resume")[-1]["global_step"] == 3
    assert [r["step"] for r in _records(run, "train")] == [1, 2, 3, 4, 5]
    # the same directory with another distnorm configuration: refused in one line naming the key
    other = subprocess.run([sys.executable, "-m", "distnorm.train", "--config", str(DEMO), *_data_overrides(digits),
                            f"output.dir={run}", "train.max_steps=7", "output.progress=false", "data.num_workers=0",
                            "distnorm.cbn.rho=2"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-3000:]
    assert ("distnorm-train: configuration error: distnorm: the checkpoint was written with another distnorm "
            "configuration (cbn.rho: 1.0 in the checkpoint, 2 in this run)") in other.stderr, other.stderr[-3000:]


@pytest.mark.processes
@pytest.mark.timeout(900)
def test_ctrl_c_under_torchrun_says_where_to_resume_in_one_line(tmp_path, digits):
    """SIGINT to ``launch/torchrun.sh`` (what Ctrl-C sends it; torchrun forwards it to its
    workers, which run in sessions of their own): exit status 130, no traceback from any
    process, one line naming the last checkpoint and the command to resume; that command, run
    as printed, resumes there. Before, every rank printed a traceback and torchrun one more
    (issue 38). The resume command keeps the NPROC it was launched with (without it, it starts
    one process, and refuses the checkpoint of two)."""
    run = tmp_path / "run"
    args = [str(DEMO), *_data_overrides(digits), f"output.dir={run}", "train.epochs=2", "train.max_steps=40",
            "output.checkpoint_every_steps=4", "output.progress=false", "output.log_every=1"]
    env = _env(NPROC="2")
    proc = subprocess.Popen([str(REPO / "launch" / "torchrun.sh"), *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not (run / "checkpoints" / "step_000000004").is_dir():
            assert time.time() < deadline and proc.poll() is None, "no checkpoint appeared"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    said = out + err
    assert proc.returncode == 130, said[-3000:]
    assert "Traceback" not in said, said[-5000:]
    lines = [line for line in said.splitlines() if "interrupted" in line]
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text()
    assert len(lines) == 1 and lines[0].startswith(f"distnorm-train: interrupted; the last checkpoint is {latest} (step "), lines
    assert verify_checkpoint(latest) is None
    command = lines[0].split("to resume from it, run the same command again: ", 1)[1]
    assert command.startswith("NPROC=2 ")
    resumed = subprocess.run(["bash", "-c", command], cwd=REPO, env={k: v for k, v in env.items() if k != "NPROC"},
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _records(run, "resume")[-1]["checkpoint"] == str(latest)
    assert _records(run, "train")[-1]["step"] == 40
    print(f"FIGURE ctrl-c: {len(said.splitlines())} lines of output after the SIGINT's launch, exit 130; {lines[0][:80]}...")


def test_the_first_process_of_a_node_to_claim_a_shared_error_says_it(tmp_path, monkeypatch):
    """Under torchrun, an error every process of a node shares is printed by the first process
    to reach it, whichever its local rank: torchrun stops the others as soon as one exits, and a
    refused command takes a tenth of a second, so a local rank 0 that came second was stopped
    before it printed (seen in ``make test``). One claim per launch, node and restart (the
    directory of the attempt's error files); outside torchrun, local rank 0. The code before
    had only local rank 0 print."""
    from distnorm.train import cli

    def says(local_rank: int, attempt: Path, **env: str) -> bool:
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / str(local_rank) / "error.json"))
        for key, value in {"TORCHELASTIC_RUN_ID": "run", "LOCAL_WORLD_SIZE": "2", **env}.items():
            monkeypatch.setenv(key, value)
        return cli._says_it_for_the_node()

    first, second = tmp_path / "attempt_0", tmp_path / "attempt_1"
    first.mkdir(), second.mkdir()
    assert says(1, first) and not says(0, first)  # local rank 1 came first: it says it, once
    assert says(0, second) and not says(1, second)  # a restart claims afresh
    alone = tmp_path / "alone"
    alone.mkdir()
    assert says(0, alone, LOCAL_WORLD_SIZE="1") and says(0, alone, LOCAL_WORLD_SIZE="1")  # one process: it says it
    # not under torchrun (no run id): the node's first process
    assert says(0, alone, TORCHELASTIC_RUN_ID="") and not says(1, alone, TORCHELASTIC_RUN_ID="")


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_bad_command_under_torchrun_is_said_once_and_named_as_the_root_cause():
    """The recipe's ``--distnorm cbm`` (issue 38: the argparse message buried in 108 lines of
    launcher output): under torchrun as ``launch/torchrun.sh`` runs it
    (``distnorm/train/torchrun.py``), a bad value and an unknown flag are printed once (the first
    process of the node; every process has the same command line), torchrun's summary names
    them as the root cause (the error file), and no process prints a traceback."""
    torchrun = [sys.executable, "-c", "from distnorm.train.torchrun import main; main()", "-m", "torch.distributed.run",
                "--standalone", "--nproc_per_node=2", "-m", "distnorm.train", "--config", str(DEMO)]
    for extra, message in ((["distnorm.norm=cbm"], "distnorm-train: configuration error: distnorm config: norm must be "
                                                   "one of ('cbn', 'popnorm', 'bn', 'gn', 'none', 'keep'), got 'cbm'"),
                           (["--dryrun"], "distnorm-train: error: unrecognized arguments: --dryrun")):
        proc = subprocess.run([*torchrun, *extra], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
        said = proc.stdout + proc.stderr
        assert proc.returncode == 1, said[-3000:]
        printed, _, summary = said.partition("distnorm.train FAILED")  # what the processes printed; the summary
        assert printed.count(message) == 1, said  # the failures listed in the summary aside
        assert f"traceback : {message}" in summary.split("Root Cause (first observed failure):")[1], said
        assert "Traceback" not in said and "To enable traceback" not in said, said
        print(f"FIGURE bad command under torchrun ({extra[0]}): {len(said.splitlines())} lines of output")
