"""The benchmark scripts run end to end (tiny sizes) and what they measure is checked where
it can be checked exactly: collective counts (every kind, ``tests.dispatch.CollectiveCounter``),
dispatched-op counts, memory accounts, sample counts, the report's schema. No time and no
ratio of times is held to a bound: on a shared 2-core machine a median moves with whatever
else runs (a 10x band failed under the suite's own load), so a timing is only checked to be
a measurement -- a finite, positive number where the schema says. Benchmarks measure speed;
their figures live in bench/results/*.json and the docs, with their commands.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.processes  # every test here runs a benchmark script

REPO = Path(__file__).resolve().parents[1]

def _measured(ratios: dict) -> None:
    """Every ratio is a measurement: a finite float above zero (a timer that never ran gives
    0, nan or inf). Its size is not checked: it depends on the machine's load."""
    for name, value in ratios.items():
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, value)


def _stable_malloc_env() -> dict:
    """This process's environment with ``bench/_common.STABLE_MALLOC`` set: a script's
    ``use_stable_allocator()`` then runs it as it is instead of re-executing it, which costs
    a second interpreter and ``import torch`` (~1.3 CPU-seconds a run) and changes nothing the
    tests read: the script runs in the environment the re-execution gives it. The
    re-execution itself: ``test_use_stable_allocator_reexecutes_once``."""
    spec = importlib.util.spec_from_file_location("_bench_common_for_env", REPO / "bench" / "_common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    return {**os.environ, **common.STABLE_MALLOC}


def _run(script: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, str(REPO / "bench" / script), "--quick", "--json", str(out), *extra],
                   check=True, cwd=REPO, timeout=600, env=_stable_malloc_env())
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def layers_through_all(tmp_path_factory) -> Path:
    """bench/all.py --quick --only layers, once: its summary holds the layer benchmark's whole
    JSON, so one run serves the layer test and the collector's (the layer benchmark starts
    two gloo ranks of its own: one run instead of two)."""
    out = tmp_path_factory.mktemp("all")
    subprocess.run([sys.executable, str(REPO / "bench" / "all.py"), "--quick", "--only", "layers", "--out", str(out)],
                   check=True, cwd=REPO, timeout=600, env=_stable_malloc_env())  # layers.py inherits it
    (summary,) = out.glob("*-quick.json")
    return summary


@pytest.mark.timeout(600)
def test_bench_layers_quick(layers_through_all):
    result = json.loads(layers_through_all.read_text())["results"]["layers"]
    assert set(result["ratios"]) == {"cbn_vs_batchnorm2d", "popnorm_vs_batchnorm2d", "syncbn_vs_batchnorm2d", "naive_vs_cbn"}
    _measured(result["ratios"])
    counts = result["collectives_2_ranks"]["per_layer_per_step"]
    assert {name: (c["forward"], c["backward"], tuple(c["kinds"])) for name, c in counts.items()} == {
        "cbn": (1, 1, ("allreduce_",)), "popnorm": (1, 1, ("allreduce_",)), "syncbn": (1, 1, ("allreduce_",))}
    channels = result["collectives_2_ranks"]["channels"]
    # each all-reduce a frame (distnorm._frames): 3 x the widest layer in float64, 2 header entries per rank
    assert counts["cbn"]["forward_bytes"] == counts["cbn"]["backward_bytes"] == 8 * (3 * channels + 2 * 2)
    shape = result["shapes"][0]
    # saved for backward: the input and per-channel vectors, nothing of the input's size more
    assert shape["input_bytes"] <= shape["saved_for_backward_bytes"]["cbn"] < 1.1 * shape["input_bytes"]
    # the op counts the README reports: within the budgets of tests/test_step_cost.py, no host sync
    from tests.test_step_cost import BUDGET

    local = result["shapes"][0]["dispatched_ops_per_step"]
    assert local["batchnorm2d"] == {"ops": 7, "activation_passes": 5.0, "host_syncs": 0}
    assert local["cbn"]["activation_passes"] == 8.0  # the floor of a synchronized layer (tests/test_step_cost.py)
    assert local["cbn"]["ops"] <= BUDGET["cbn", "history"][0] and local["syncbn"]["ops"] <= BUDGET["syncbn", "no_history"][0]
    assert counts["cbn"]["dispatched_ops"]["ops"] <= BUDGET["cbn", "history"][1]
    assert all(c["dispatched_ops"]["host_syncs"] == 0 for c in counts.values())
    assert result["machine"]["torch"]


@pytest.mark.timeout(600)
def test_bench_bnp_quick(tmp_path):
    result = _run("bnp.py", tmp_path)
    assert {"step_bnp_vs_plain", "mem_bnp_vs_plain"} <= set(result["ratios"])
    _measured(result["ratios"])
    # memory is an exact account: BNP adds its moments and the biases it gives bias-free layers
    assert 1.0 < result["ratios"]["mem_bnp_vs_plain"] < 1.05
    assert result["models"]["resnet18"]["bnp_layers"] == 21
    assert result["models"]["resnet20"]["bnp_layers"] == 20
    assert "step_bnp_vs_plain_resnet20" in result["ratios"]
    # on the CPU: the step with ATen's calls instead of the C kernels, and the transform alone both ways
    assert "step_bnp_aten_vs_plain" in result["ratios"]
    for entry in result["models"].values():
        assert set(entry["median_step_ms"]) == {"plain", "bnp", "bnp_aten"}
        assert set(entry["transform_ms"]) == {"kernel", "aten"} and min(entry["transform_ms"].values()) > 0


def test_bench_loader_step_quick(tmp_path, monkeypatch):
    """bench/loader_step.py at its tiny size: a ResNet-18 step fed by the real loader from the
    shards it writes, against the same step on a resident batch, per worker count; the CPU's
    cost per image by stage, and the loader's scaling from 1 to 2 workers (the schema, not a
    speed)."""
    result = _run("loader_step.py", tmp_path)
    assert result["shards"]["images"] == 64 and result["shards"]["jpeg_quality"] == 90
    assert result["shards"]["mean_jpeg_bytes"] > 0
    (run,) = result["results"]
    assert run == "resnet18_eager"
    variants = result["results"][run]
    assert set(variants) == {"synthetic", "pil_1w", "pil_2w"}
    _measured(result["ratios"])
    assert set(result["ratios"]) == {"resnet18_eager_pil_1w", "resnet18_eager_pil_2w"}
    for key, entry in variants.items():
        numbers = {k: v for k, v in entry.items() if isinstance(v, float)}
        assert set(numbers) >= {"step_ms", "images_per_s", "cores"}, key
        _measured({k: v for k, v in numbers.items() if k != "cores"})
        assert entry["cores"] >= 0
    for key in ("pil_1w", "pil_2w"):
        assert len(variants[key]["slowdown_per_round"]) == result["rounds"]
        _measured({"alone": variants[key]["loader_alone_images_per_s"]})
    costs = result["cost_per_image_us"]
    assert set(costs) == {"read", "decode", "geometry", "normalize", "rest", "transfer", "total"}
    assert costs["transfer"] == 0.0 and costs["decode"] > 0 and costs["total"] > 0
    assert math.isclose(costs["total"], sum(v for k, v in costs.items() if k != "total"))
    _measured({str(k): v for k, v in result["workers_scaling"]["images_per_s"].items()})
    # the GPU report's table of it: a row per run and feed
    md = "\n".join(_bench_module("gpu_report", monkeypatch)._loader_lines(
        {"status": "ran", "command": "python bench/loader_step.py", "result": result}))
    assert "| resnet18_eager | synthetic | " in md and "| resnet18_eager | pil_2w | " in md
    assert f"{variants['pil_1w']['slowdown']:.3f}" in md and "CPU per image (pil, one worker thread)" in md


@pytest.mark.timeout(600)
def test_bench_data_quick(tmp_path):
    result = _run("data.py", tmp_path)
    assert set(result["ratios"]) == {f"{a}_{w}" for a in ("wds_vs_imagefolder", "wds_vs_imagefolder_preset",
                                                         "reduced_vs_full_decode") for w in ("1worker", "2workers")}
    _measured(result["ratios"])
    assert result["images_per_pass"]["wds_1"] == result["images_per_pass"]["imagefolder_1"]
    assert result["same_tensors_as_torchvision_compose"] is True
    assert set(result["decode_only_images_per_second_1_core"]) == {"pil", "torchvision_io"}
    _measured({"loader_1worker_fraction_of_pil_decode": result["loader_1worker_fraction_of_pil_decode"]})
    profile = result["profile_fraction_0_workers"]
    assert set(profile) == {"decode", "geometry", "normalization", "tar", "rest"} and profile["decode"] > 0
    assert set(result["batch_buffer_write_ms"]) == {"fresh_shared", "reused_shared"}


@pytest.mark.timeout(900)
def test_bench_step_quick(tmp_path):
    result = _run("step.py", tmp_path)
    keys = {f"step_{v}_vs_local_bn{s}" for v in ("cbn", "popnorm", "syncbn", "naive_syncbn", "bnp")
            for s in ("", "_resnet20")}
    keys |= {f"step_{v}_vs_{peer}{s}" for v in ("cbn", "syncbn") for peer in ("naive_syncbn", "floor")
             for s in ("", "_resnet20")}
    assert set(result["ratios"]) == keys
    _measured(result["ratios"])
    counts = result["models"]["resnet20"]["distnorm_collectives_per_step"]
    # one forward + one backward collective per synchronized layer (19 pre-op CBNs, of which the
    # first sees the image and needs no input gradient); one per BNP layer (20)
    assert counts["cbn"]["collectives"] == 2 * 19 - 1 and counts["bnp"]["collectives"] == 20
    # the peer synchronizes the same 19 BatchNorms with the same count (its first layer's input
    # needs a gradient: it follows a conv)
    assert counts["naive_syncbn"]["collectives"] == counts["syncbn"]["collectives"] == 2 * 19
    r = result["models"]["resnet20"]
    for v in ("cbn", "syncbn"):
        floor = r["median_step_ms"]["local_bn"] + counts[v]["collectives"] * result["small_all_reduce_latency_ms"]
        assert r["collective_floor_ms"][v] == pytest.approx(floor, rel=1e-12)  # the JSON rounds nothing
    _measured({"small_all_reduce_latency_ms": result["small_all_reduce_latency_ms"]})
    for model in result["models"].values():  # exact accounts: synchronizing costs no memory
        for variant in ("cbn", "syncbn", "naive_syncbn"):
            assert 0.95 < model["memory_ratio_vs_local_bn"][variant] < 1.05


@pytest.mark.timeout(600)
def test_bench_all_collects_json_and_markdown(layers_through_all):
    summary = json.loads(layers_through_all.read_text())
    assert summary["quick"] is True and set(summary["results"]) == {"layers"} and summary["machine"]["torch"]
    assert "cbn_vs_batchnorm2d" in summary["results"]["layers"]["ratios"]
    assert "`cbn_vs_batchnorm2d`" in layers_through_all.with_suffix(".md").read_text()


# ------------------------------------------------------------- make test-gpu, on a CPU
def _bench_module(name: str, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # the scripts import their neighbours by name
    import importlib

    return importlib.import_module(name)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the allocator variables are glibc's")
def test_use_stable_allocator_reexecutes_once(monkeypatch):
    """The scripts' tests run with ``STABLE_MALLOC`` already set (``_stable_malloc_env``), so
    here, in this process, the re-execution they skip: without the variables, the same
    interpreter and arguments again with them added; with them, nothing."""
    common = _bench_module("_common", monkeypatch)
    calls = []
    monkeypatch.setattr(os, "execve", lambda *args: calls.append(args))
    monkeypatch.setattr(sys, "argv", ["bench/step.py", "--quick", "--json", "out.json"])
    for key in common.STABLE_MALLOC:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("DISTNORM_TEST_KEPT", "1")
    common.use_stable_allocator()
    ((executable, argv, env),) = calls
    assert executable == sys.executable and argv == [sys.executable, "bench/step.py", "--quick", "--json", "out.json"]
    assert env == {**os.environ, **common.STABLE_MALLOC} and env["DISTNORM_TEST_KEPT"] == "1"
    for key, value in common.STABLE_MALLOC.items():
        monkeypatch.setenv(key, value)
    common.use_stable_allocator()
    assert len(calls) == 1


@pytest.fixture(scope="module")
def step_gpu_smoke(tmp_path_factory) -> dict:
    """bench/step_gpu.py in its smoke sizes on the CPU, local BN and CBN in every mode, asked
    for compiled first; compiled with dynamo's ``eager`` backend (tracing only: inductor on 2
    cores takes minutes; tests/test_compile.py checks compiled layers against eager), and so
    ``reduce_overhead`` with dynamo's ``cudagraphs`` backend (AOTAutograd; on a CPU no graph is
    captured and inductor counts the skip). One distnorm variant: the path is the same for
    each, and each compiled build costs seconds here."""
    out = tmp_path_factory.mktemp("step_gpu") / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # bf16 on a shared 2-core CPU: threads only contend
    subprocess.run([sys.executable, str(REPO / "bench" / "step_gpu.py"), "--smoke", "--device", "cpu",
                    "--modes", "reduce_overhead", "compile", "eager", "--variants", "cbn", "--compile-backend", "eager",
                    "--json", str(out)], check=True, cwd=REPO, timeout=300, env=env)
    return json.loads(out.read_text())


MODES = ["eager", "compile", "reduce_overhead"]


def _exact_step_figures(table: dict, batch: int) -> None:
    """The JSON rounds nothing, so each timed entry's figures follow from each other exactly;
    a failed one has its error and phase instead."""
    for modes in table.values():
        for mode, e in modes.items():
            if "error" in e:
                assert "median_step_ms" not in e and e["phase"] in ("build", "first step", "second step",
                                                                   "peak memory step", "timing"), e
                continue
            assert e["images_per_s"] == pytest.approx(batch / (e["median_step_ms"] / 1e3), rel=1e-12)
            assert e["ratio_vs_local_bn_same_mode"] == pytest.approx(e["median_step_ms"] / e["local_bn_same_mode_ms"],
                                                                     rel=1e-12)
            assert e["ratio_vs_local_bn_eager"] == pytest.approx(e["median_step_ms"] / e["local_bn_eager_ms"], rel=1e-12)
            if mode == "eager":
                assert e["local_bn_same_mode_ms"] == e["local_bn_eager_ms"]
            assert e["peak_memory_bytes"] is None  # no allocator statistics on the CPU
            _measured({f"{mode} {k}": e[k] for k in ("median_step_ms", "local_bn_eager_ms", "first_step_s",
                                                     "second_step_s")})


@pytest.mark.timeout(300)
def test_bench_step_gpu_smoke(step_gpu_smoke):
    """Every eager build before any compiled one (a run cut short keeps the cheap figures), the
    compiled block variant by variant (local BN first: the baselines), each ratio against local
    BN in the same mode and eager, timed in the same rounds, the goals, and per compiled member
    what dynamo and inductor did, counted over every one of its steps. The blocks run in that
    order even when asked for compiled first, and every figure still follows from the others
    once rounded (images/s from the step time: a figure rounded further failed that check for a
    slow step)."""
    step_gpu = step_gpu_smoke
    cfg = step_gpu["config"]
    assert cfg | {"batch": 2, "size": 32, "repeats": 1} == cfg and cfg["amp"] == "bf16"
    assert step_gpu["complete"] is True and cfg["modes"] == MODES and cfg["variants"] == ["local_bn", "cbn"]
    assert cfg["compiled_as"] == {"compile": 'torch.compile(model, backend="eager")',
                                  "reduce_overhead": 'torch.compile(model, backend="cudagraphs")'}
    assert cfg["recompile_limit"] >= 64 and cfg["time_budget_s"] is None and step_gpu["not_run"] == []
    assert step_gpu["goals"] == {"eager": None, "compile": 1.05, "reduce_overhead": 1.05}
    (name,) = step_gpu["models"]
    # the eager block, then the compiled block variant by variant (its local BN eager baseline unreported)
    assert [(b["model"], b["variant"], b["mode"]) for b in step_gpu["built"]] == (
        [(name, "local_bn", "eager"), (name, "cbn", "eager"), (name, "local_bn", "compile"),
         (name, "local_bn", "reduce_overhead"), (name, "cbn", "compile"), (name, "cbn", "reduce_overhead")])
    table = step_gpu["models"][name]["variants"]
    assert list(table) == ["local_bn", "cbn"] and all(list(m) == MODES for m in table.values())
    _exact_step_figures(table, batch=2)
    assert all(e["ratio_vs_local_bn_same_mode"] == 1.0 for e in table["local_bn"].values())
    for variant, modes in table.items():
        assert "dynamo" not in modes["eager"] and "cudagraphs" not in modes["compile"]
        for mode in ("compile", "reduce_overhead"):
            dynamo = modes[mode]["dynamo"]
            assert set(dynamo) == {"frames_first_step", "graphs", "graph_breaks", "graph_break_reasons", "recompiles",
                                   "steps"}
            # the first and second steps (no peak-memory step off CUDA), then each timing's warm-up
            # and one repeat: local BN is timed with itself and again with CBN
            assert dynamo["steps"] == 2 + 2 * (2 if variant == "local_bn" else 1), (variant, mode, dynamo)
            assert dynamo["frames_first_step"] >= 1 and dynamo["graphs"] >= 1
            assert dynamo["graph_breaks"] == sum(dynamo["graph_break_reasons"].values())
        graphs = modes["reduce_overhead"]["cudagraphs"]  # on a CPU: skipped, and said why
        assert graphs["counters"]["cudagraph_skips"] >= 1 and any("cpu" in m for m in graphs["messages"]), graphs
    assert set(step_gpu["ratios"]) == {f"step_{v}_{m}_vs_local_bn_eager_{name}" for v in table for m in MODES
                                       if (v, m) != ("local_bn", "eager")} | {
        f"step_cbn_{m}_vs_local_bn_{m}_{name}" for m in ("compile", "reduce_overhead")}
    _measured(step_gpu["ratios"])
    assert step_gpu["triton"] is None  # recorded on CUDA only


def test_step_gpu_records_failures_and_stops_for_time(monkeypatch):
    """A member that raises at its build or while timed is recorded with its error and phase,
    and the block goes on without it; with ``--time-budget-s``, no build starts that the time
    left would not finish, and what was not built is listed (the GPU report's part then ends by
    itself instead of at its limit). Neither a failing variant nor a stop for time loses the
    figures the block has already taken."""
    step_gpu = _bench_module("step_gpu", monkeypatch)
    build, make_step = step_gpu.build, step_gpu.make_step
    # the budget itself: the longest build of a mode so far, x1.25, and the longest timing
    budget = step_gpu.TimeBudget(time.monotonic() + 100)
    assert budget.allows("compile") and step_gpu.TimeBudget(None).allows("compile")
    budget.built("compile", 90)
    assert not budget.allows("compile") and budget.allows("eager") and not budget.allows("eager", "compile")
    budget.timing_s = 150
    assert not budget.allows("eager")

    def failing_build(name, variant, num_classes):
        if variant == "popnorm":
            raise RuntimeError("no POP-Norm here")
        return build(name, variant, num_classes=num_classes)

    def failing_step(model, forward, x, y, amp, **kwargs):
        step, calls = make_step(model, forward, x, y, amp, **kwargs), []

        def run():
            calls.append(None)
            if len(calls) == 3 and any(isinstance(m, distnorm.CBN) for m in model.modules()):
                raise RuntimeError("CBN fails at its third step")  # the timing's warm-up
            step()
        return run

    import distnorm

    monkeypatch.setattr(step_gpu, "build", failing_build)
    monkeypatch.setattr(step_gpu, "make_step", failing_step)
    allowed = iter([True] * 5)  # the block, local BN, SyncBatchNorm, POP-Norm, CBN; then no more time
    monkeypatch.setattr(step_gpu.TimeBudget, "allows", lambda self, *modes: next(allowed, False))
    result = step_gpu.main(["--smoke", "--device", "cpu", "--modes", "eager", "compile", "--compile-backend", "eager",
                            "--variants", "syncbn", "popnorm", "cbn", "bnp_gn", "--time-budget-s", "600"])
    table = result["models"]["resnet20"]["variants"]
    assert {v: modes["eager"].get("phase") for v, modes in table.items()} == {
        "local_bn": None, "syncbn": None, "popnorm": "build", "cbn": "timing"}
    assert table["popnorm"]["eager"] == {"error": "RuntimeError: no POP-Norm here", "phase": "build"}
    assert table["cbn"]["eager"]["error"] == "RuntimeError: CBN fails at its third step"
    _exact_step_figures(table, batch=2)
    assert [(n["variant"], n["mode"]) for n in result["not_run"]] == [("bnp_gn", "eager"), ("local_bn", "compile"), (
        "syncbn", "compile"), ("popnorm", "compile"), ("cbn", "compile"), ("bnp_gn", "compile")]
    assert all(n["reason"].startswith("out of time: --time-budget-s 600") for n in result["not_run"])
    assert result["complete"] is True and set(result["ratios"]) == {"step_syncbn_eager_vs_local_bn_eager_resnet20"}
    # the GPU report's table of it
    lines = "\n".join(_bench_module("gpu_report", monkeypatch)._step_lines(
        {"status": "ran", "command": "python bench/step_gpu.py", "result": result}))
    assert "| resnet20 | popnorm | eager | failed (build) |" in lines
    assert "* resnet20 cbn eager failed at its timing: `RuntimeError: CBN fails at its third step`" in lines
    assert "* not run (out of time: --time-budget-s 600 would have run out first): resnet20 bnp_gn eager, " in lines


def test_step_gpu_takes_gn_and_bnp_apart_in_either_layout(monkeypatch):
    """The variants that take GN + BNP apart build what they name (GroupNorm without BNP's
    hooks, local BN with them, PyTorch's GroupNorm in place of distnorm's) and run only when
    asked; ``--memory-format contiguous`` gives the models and the batch NCHW, and the report
    records it. So GN alone is never measured with BNP still attached, the ``*_torch`` baseline
    runs ATen's ``native_group_norm`` on the input as it comes (distnorm's runs its own
    operator), and the layout option is neither ignored nor recorded as channels_last for an
    NCHW run."""
    from distnorm._bnp_functions import BNPLayerState

    step_gpu = _bench_module("step_gpu", monkeypatch)
    step = _bench_module("step", monkeypatch)
    assert "gn" not in step_gpu.parse_args(["--smoke"]).variants  # the report's default stays six

    def kinds(model):
        bnp = sum(isinstance(getattr(m, "_distnorm_bnp", None), BNPLayerState) for m in model.modules())
        return (sum(isinstance(m, nn.GroupNorm) for m in model.modules()) > 0,
                sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) > 0, bnp > 0)

    assert kinds(step.build("resnet20", "gn")) == (True, False, False)
    assert kinds(step.build("resnet20", "bnp")) == (False, True, True)
    assert kinds(step.build("resnet20", "bnp_gn")) == (True, False, True)
    assert kinds(step.build("resnet20", "bnp_gn_torch")) == (True, False, True)

    class GroupNormCalls(torch.utils._python_dispatch.TorchDispatchMode):
        """The GroupNorm operators called, with their input's dtype."""

        def __init__(self) -> None:
            super().__init__()
            self.seen: set[tuple[str, torch.dtype]] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.native_group_norm.default, torch.ops.distnorm.group_norm.default):
                self.seen.add((func.__name__, args[0].dtype))
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 3, 32, 32)
    ours, theirs = step.build("resnet20", "gn"), step.build("resnet20", "gn_torch")
    torch.testing.assert_close(ours(x), theirs(x))
    for model, expected in ((ours, "group_norm.default"), (theirs, "native_group_norm.default")):
        with GroupNormCalls() as spy, torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)
        assert spy.seen == {(expected, torch.bfloat16)}, (type(model), spy.seen)

    seen = []
    make_step = step_gpu.make_step
    monkeypatch.setattr(step_gpu, "make_step", lambda model, forward, x, y, amp, **kwargs: seen.append((model, x))
                        or make_step(model, forward, x, y, amp, **kwargs))
    result = step_gpu.main(["--smoke", "--device", "cpu", "--modes", "eager", "--variants", "gn",
                            "--memory-format", "contiguous"])
    assert result["config"]["channels_last"] is False and len(seen) == 2  # local BN and GN
    for model, batch in seen:
        convs = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]
        assert batch.is_contiguous() and all(w.is_contiguous() for w in convs)
        assert not batch.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.timeout(120)
def test_gpu_report_without_cuda(tmp_path, monkeypatch):
    """The report is written when CUDA is absent: the CUDA tests only, with their skip reasons,
    the benchmarks skipped, the environment's Triton facts, each part's log."""
    gpu_report = _bench_module("gpu_report", monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # for the pytest it starts, on a machine with GPUs too
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_report.main(["--tests", "tests/test_cuda.py", "--out", str(tmp_path), "--name", "report"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["cuda"]["device_count"] == 0 and report["cuda"]["reason"].startswith("no CUDA device")
    tests = report["parts"]["tests"]
    # CUDA tests only: test_cuda.py's CPU twin is not selected, so nothing runs here
    assert tests["status"] == "ran" and tests["passed"] == tests["failed"] == tests["errors"] == 0 and tests["skipped"] > 0
    assert sum(tests["skip_reasons"].values()) == tests["skipped"]
    assert all("CUDA" in reason for reason in tests["skip_reasons"])
    assert "-m cuda" in tests["command"] and (tmp_path / "report.tests.xml").is_file()
    assert (tmp_path / tests["log"]).read_text().startswith("$ ")
    for part in ("step_eager", "step_compile", "step_compile_more", "host", "profile", "layers", "decode", "loader"):
        assert report["parts"][part] == {"status": "skipped", "reason": report["cuda"]["reason"]}
    triton = report["triton"]
    assert set(triton) == {"imports", "version", "error", "cc", "DISTNORM_TRITON"} and set(triton["cc"]) == {"path", "source", "version"}
    assert triton["imports"] == (importlib.util.find_spec("triton") is not None)
    md = (tmp_path / "report.md").read_text()
    assert f"| step_eager | skipped: {report['cuda']['reason']} |" in md and "| 0 | 0 | 0 | " in md
    assert "C compiler for its launchers" in md


@pytest.mark.timeout(120)
def test_gpu_report_to_out_bundles_the_parts(tmp_path, monkeypatch):
    """Sent to ``$OUT`` (a lent machine sends back a few files from it), the report is three
    files: its JSON, its Markdown and every part's log and JSON in one archive, rewritten with
    the report. The parts' files do not lie beside the report: there, one per part, they went
    past the number of files a lent machine sends back, and some were left behind."""
    import tarfile

    gpu_report = _bench_module("gpu_report", monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_report.main(["--tests", "tests/test_cuda.py", "--only", "tests", "--name", "r"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md", "r.parts.tar.gz"]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["parts_bundle"] == "r.parts.tar.gz" and report["parts"]["tests"]["status"] == "ran"
    with tarfile.open(tmp_path / "r.parts.tar.gz") as bundle:
        assert sorted(bundle.getnames()) == ["r.tests.log", "r.tests.xml"]
        assert bundle.extractfile(report["parts"]["tests"]["log"]).read().startswith(b"$ ")
    assert gpu_report.parse_args(["--out", str(tmp_path)]).bundle is False  # a folder of one's own: as before


@pytest.mark.timeout(300)
def test_gpu_report_tells_the_step_parts_their_time(tmp_path, monkeypatch):
    """A step part is given ``--time-budget-s`` (its limit less the margin for its start and
    its last timing), so it ends by itself; a part is not started with less time left than
    its plan says it needs to finish anything. Otherwise a compiled part started with a minute
    left is stopped at its limit before its first figure."""
    gpu_report = _bench_module("gpu_report", monkeypatch)
    monkeypatch.setattr(gpu_report, "cuda_info", lambda: {"device_count": 1, "devices": ["a GPU stand-in"],
                                                          "torch_cuda": None, "cudnn": None, "reason": None})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # the step parts on this CPU (the last --device wins), eager only: local BN and CBN
    assert gpu_report.main(["--only", "step_eager", "step_compile", "--out", str(tmp_path), "--name", "r", "--budget-s",
                            "120", "--part-timeout", "step_eager=100",
                            "--step-args=--device cpu --smoke --variants cbn"]) == 0
    parts = json.loads((tmp_path / "r.json").read_text())["parts"]
    eager = parts["step_eager"]
    assert eager["status"] == "ran", eager
    assert " --modes eager --time-budget-s 80 --device cpu --smoke --variants cbn" in eager["command"]
    assert eager["result"]["config"]["time_budget_s"] == 80 and eager["result"]["not_run"] == []
    assert list(eager["result"]["models"]["resnet20"]["variants"]) == ["local_bn", "cbn"]
    left = parts["step_compile"]
    assert left["status"] == "skipped" and left["reason"].startswith("no time left: "), left
    assert left["reason"].endswith(f"under the {gpu_report.PLANS['default'].min_s['step_compile']:.0f} s it needs")


def test_gpu_report_tables_and_failures(tmp_path, monkeypatch, step_gpu_smoke):
    """The report's summary of a JUnit file (a failure fails the part), its step tables, and a
    step part stopped at its limit: what it finished, and what it built but did not time."""
    gpu_report = _bench_module("gpu_report", monkeypatch)
    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.test_cuda" name="a"/>'
                   '<testcase classname="tests.test_cuda" name="b"><skipped message="needs a CUDA device: none visible"/></testcase>'
                   '<testcase classname="tests.test_cuda" name="c"><failure message="AssertionError: 1 != 2">tb</failure></testcase>'
                   '</testsuite></testsuites>')
    summary = gpu_report.junit_summary(xml)
    assert summary == {"passed": 1, "failed": 1, "errors": 0, "skipped": 1,
                       "skip_reasons": {"needs a CUDA device: none visible": 1},
                       "failures": [{"test": "tests.test_cuda::c", "kind": "failure", "message": "AssertionError: 1 != 2"}]}
    host = _bench_module("host_cost", monkeypatch).main(["--device", "cpu", "--iters", "2", "--rounds", "1",
                                                           "--profile", "cbn", "--top", "3"])
    cut = json.loads(json.dumps(step_gpu_smoke))  # as a run stopped after one more build
    cut["complete"] = False
    cut["built"].append({"model": "resnet50", "variant": "cbn", "mode": "compile", "first_step_s": 75.25})
    report = {"name": "t", "command": "python bench/gpu_report.py", "machine": step_gpu_smoke["machine"],
              "cuda": gpu_report.cuda_info(), "packages": {"deepspeed": None}, "budget_s": 450.0, "started": "now",
              "triton": gpu_report.triton_info(),
              "parts": {"tests": {"status": "failed", "command": "pytest", "wall_s": 1.0, **summary},
                        "step_eager": {"status": "ran", "command": "python bench/step_gpu.py", "result": step_gpu_smoke,
                                       "triton_messages": []},
                        "host": {"status": "ran", "command": "python bench/host_cost.py", "result": host},
                        "layers": {"status": "skipped", "reason": "not asked for (--only)"},
                        "decode": {"status": "skipped", "reason": "not asked for (--only)"},
                        "step_compile": {"status": "ran", "command": "python bench/step_gpu.py --modes compile",
                                         "result": step_gpu_smoke, "triton_messages": []},
                        "step_compile_more": {"status": "timed out", "reason": "stopped after 200 s (its time limit)",
                                              "command": "python bench/step_gpu.py --modes compile", "result": cut,
                                              "triton_messages": ["RuntimeWarning: distnorm: the Triton kernel failed"]}}}
    md = gpu_report.markdown(report)
    assert "Not installed: deepspeed" in md and "* FAILED `tests.test_cuda::c`: AssertionError: 1 != 2" in md
    assert "| resnet20 | local_bn | eager | " in md and "| resnet20 | cbn | reduce_overhead | " in md
    assert "timed out: stopped after 200 s (its time limit); what it finished:" in md
    assert "* built, not timed (the run stopped first): resnet50 cbn compile, first step 75.2 s" in md
    assert "| step_compile_more | timed out: stopped after 200 s (its time limit) |" in md
    # each ratio next to its goal: in the parts' tables, and in the summary that opens the report
    cbn = step_gpu_smoke["models"]["resnet20"]["variants"]["cbn"]
    local_bn = step_gpu_smoke["models"]["resnet20"]["variants"]["local_bn"]

    def goal(mode: str) -> str:
        ratio = cbn[mode]["ratio_vs_local_bn_same_mode"]
        return f"≤ 1.05: {'met' if ratio <= 1.05 else 'not met'}"

    assert (f"| resnet20 | cbn | compile | {cbn['compile']['median_step_ms']:.1f} | "
            f"{cbn['compile']['ratio_vs_local_bn_same_mode']:.3f} | {goal('compile')} | ") in md
    assert f"| resnet20 | cbn | eager | {cbn['eager']['median_step_ms']:.1f} | " in md
    assert md.index("## Step ratios against local BN in the same mode") < md.index("## Tests")
    assert "| model | variant | eager | compile | reduce_overhead |" in md
    assert ("| resnet20 | local_bn | " + " | ".join(f"{local_bn[m]['median_step_ms']:.1f} ms" for m in MODES) + " |") in md
    assert (f"| resnet20 | cbn | {cbn['eager']['ratio_vs_local_bn_same_mode']:.3f} | "
            + " | ".join(f"{cbn[m]['ratio_vs_local_bn_same_mode']:.3f} ({goal(m)})" for m in MODES[1:]) + " |") in md
    assert "Goals: eager: none; compile: ≤ 1.05×; reduce_overhead: ≤ 1.05×." in md
    assert "* resnet20 cbn reduce_overhead, CUDA graphs: counters {'cudagraph_skips': " in md
    assert "`RuntimeWarning: distnorm: the Triton kernel failed`" in md
    assert "| batchnorm2d | " in md and "| 1.00 | None |" in md and "| cbn | " in md  # host part: every layer
    assert "cbn: costliest Python functions" in md


def test_gpu_report_stops_a_part_and_everything_it_started_at_its_limit(tmp_path, monkeypatch):
    """A part that outlives its limit is stopped with the processes it started (pytest's
    ranks, inductor's compile workers), and its output so far is in its log. Stopping only the
    part's own process is not enough: a grandchild kept the GPU."""
    gpu_report = _bench_module("gpu_report", monkeypatch)
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            "print('grandchild started', flush=True)\n"
            "print('triton: UserWarning: a Triton warning', flush=True)\n"
            "time.sleep(600)\n")
    log = tmp_path / "part.log"
    done = gpu_report.run_part([sys.executable, "-c", code], log, timeout_s=10)
    assert done.rc is None and "grandchild started" in done.tail, done
    assert done.triton_messages == ["triton: UserWarning: a Triton warning"]
    text = log.read_text()
    assert "grandchild started" in text and "stopped after 10 s" in text
    grandchild = int(pid_file.read_text())
    for _ in range(100):  # SIGKILL is delivered at once; reaping an orphan by init may lag
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild), "the part's grandchild survived its stop"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"  # a zombie is dead, waiting to be reaped
    except FileNotFoundError:
        return False


@pytest.mark.timeout(300)
def test_gpu_report_stopped_from_outside_keeps_its_report(tmp_path):
    """The report is on disk before a part starts (``running``): a run killed from outside
    (the lent machine's time ending) keeps what finished and shows where it stopped; SIGTERM
    stops the running part and its processes and rewrites the report. The report is not
    written only at the end, and no part is left running after gpu_report ends."""
    hang = tmp_path / "hang" / "test_hang.py"
    hang.parent.mkdir()
    hang.write_text("import os, time\nimport pytest\n\n\n@pytest.mark.cuda\ndef test_hang():\n"
                    "    print('hang started', os.getpid(), flush=True)\n    time.sleep(600)\n")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "bench/gpu_report.py", "--only", "tests", "--tests", str(hang),
                             "--pytest-args=-s", "--out", str(out), "--name", "r"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        log = out / "r.tests.log"
        for _ in range(1200):  # up to 120 s for the script and pytest to start
            if log.exists() and "hang started" in log.read_text():
                break
            assert proc.poll() is None, f"gpu_report ended early, exit {proc.returncode}"
            time.sleep(0.1)
        pytest_pid = int(log.read_text().split("hang started ")[1].split()[0])
        running = json.loads((out / "r.json").read_text())["parts"]
        assert running["tests"]["status"] == "running" and running["step_eager"]["status"] == "skipped", running
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    parts = json.loads((out / "r.json").read_text())["parts"]
    assert parts["tests"] == {"status": "failed", "reason": "gpu_report was stopped (signal 15)"}, parts["tests"]
    assert not _alive(pytest_pid), "the tests' pytest outlived gpu_report"
    assert "failed: gpu_report was stopped (signal 15)" in (out / "r.md").read_text()


@pytest.mark.timeout(300)
def test_bench_decode_quick(tmp_path, monkeypatch):
    """``bench/decode_gpu.py`` on the CPU (the deferred path with ``decode_device="cpu"``), and
    the GPU report's table of it."""
    result = _run("decode_gpu.py", tmp_path, "--device", "cpu")
    assert result["device"] == "cpu" and set(result["images_per_second"]) == {"pil_1_core", "deferred", "finish_only"}
    _measured(result["ratios"])
    assert 0 < result["mean_abs_diff_vs_pil"] < 0.05  # the same crops; another decoder path and resize
    gpu_report = _bench_module("gpu_report", monkeypatch)
    md = gpu_report.markdown({"name": "t", "command": "c", "machine": result["machine"], "cuda": gpu_report.cuda_info(),
                              "packages": {}, "budget_s": 1.0, "started": "now", "triton": gpu_report.triton_info(),
                              "parts": {
                                  "tests": {"status": "skipped", "reason": "-"},
                                  "step_eager": {"status": "skipped", "reason": "-"},
                                  "layers": {"status": "skipped", "reason": "-"},
                                  "decode": {"status": "ran", "command": "python bench/decode_gpu.py", "result": result},
                                  "step_compile": {"status": "skipped", "reason": "-"}}})
    assert "| deferred | " in md and "| pil_1_core | " in md


# -------------------------------------------------- where a step's host time goes
@pytest.mark.timeout(300)
def test_profile_step_and_host_cost_name_what_runs(tmp_path, monkeypatch):
    """bench/profile_step.py and bench/host_cost.py in their CPU sizes, in this process: every
    figure a measurement, no device figures off CUDA, and the profiles name what really ran
    (distnorm's operators and functions in CBN's step, none in local BatchNorm's)."""
    profile_step = _bench_module("profile_step", monkeypatch)
    result = profile_step.main(["--smoke", "--device", "cpu", "--variants", "local_bn", "cbn", "--repeats", "1",
                                "--top", "60", "--json", str(tmp_path / "profile.json")])
    steps = result["models"]["resnet20"]
    assert list(steps) == ["local_bn", "cbn"] and json.loads((tmp_path / "profile.json").read_text()) == result
    for r in steps.values():
        _measured({"wall_ms": float(r["wall_ms"]), "host_ms": float(r["host_ms"])})
        assert r["device_kernel_ms"] is None and r["kernels"] is None and r["device_kernels"] == []
    ops = {name: {o["op"] for o in r["host_ops"]} for name, r in steps.items()}
    assert {"distnorm::cbn_plan", "distnorm::backward_sums"} <= ops["cbn"]
    assert not any(op.startswith("distnorm::") for op in ops["local_bn"])
    gpu_report = _bench_module("gpu_report", monkeypatch)  # the GPU report's table of it
    lines = gpu_report._profile_lines({"status": "ran", "command": "python bench/profile_step.py", "result": result})
    assert [line.split(" | ")[:3] for line in lines if line.startswith("| resnet20 ")] == [
        ["| resnet20", variant, f"{steps[variant]['wall_ms']:.1f}"] for variant in ("local_bn", "cbn")]

    host_cost = _bench_module("host_cost", monkeypatch)
    cost = host_cost.main(["--device", "cpu", "--iters", "3", "--rounds", "2", "--profile", "cbn", "--top", "80",
                           "--replay"])
    assert list(cost["us_per_step"]) == ["batchnorm2d", "cbn", "popnorm", "syncbn"]
    _measured({k: float(v) for k, v in cost["us_per_step"].items()})
    assert cost["extra_us_vs_batchnorm2d"]["batchnorm2d"] == 0.0
    assert cost["host_syncs"] == dict.fromkeys(cost["us_per_step"])  # the sync check is CUDA's
    assert any("distnorm/_functions.py" in row["function"] for row in cost["profiles"]["cbn"])
    # --replay: the operators each step dispatched, each timed alone, and the step split in two
    replayed = cost["replay"]
    assert list(replayed) == list(cost["us_per_step"])
    for name, r in replayed.items():
        assert r["ops"] == len(r["per_op_us"]) > 0
        _measured({"ops": float(r["ops_us"]), **{f"{i}": float(us) for i, (_, us) in enumerate(r["per_op_us"])}})
        assert r["ops_us"] + r["rest_us"] == pytest.approx(cost["us_per_step"][name], rel=1e-12)  # nothing rounded
    names = {name: [op for op, _ in r["per_op_us"]] for name, r in replayed.items()}
    assert {"distnorm.cbn_plan.default", "distnorm.backward_sums.default"} <= set(names["cbn"])
    assert "aten.native_batch_norm_backward.default" in names["batchnorm2d"]
    assert not any(op.startswith("distnorm.") for op in names["batchnorm2d"])
    lines = gpu_report._host_lines({"status": "ran", "command": "python bench/host_cost.py", "result": cost})
    assert any(f"cbn {replayed['cbn']['ops']} operators" in line for line in lines)
    # what --replay times is the recorded operators themselves, all of them, in their order
    x = torch.randn(4, 3, 2, 2, requires_grad=True)
    calls = host_cost.recorded_ops(lambda: torch.nn.functional.batch_norm(x, None, None, training=True).sum().backward())
    again = host_cost.recorded_ops(host_cost.replay(calls))
    assert [str(op) for op, _, _ in again] == [str(op) for op, _, _ in calls] and len(calls) > 3


def test_model_choices_measures_what_it_names(tmp_path, monkeypatch):
    """bench/model_choices.py in its smoke sizes, in this process: each part's variants against
    its baseline, every figure a measurement, and each variant the model it names: the stem CBN
    (the first, on the image) folded into its convolution as converted, not with a hook on the
    convolution, its gamma and beta frozen in the third; BNP's zero biases added by default,
    none with add_bias=False."""
    choices = _bench_module("model_choices", monkeypatch)
    result = choices.main(["--smoke", "--json", str(tmp_path / "choices.json")])
    assert json.loads((tmp_path / "choices.json").read_text()) == result
    stem, biases = result["parts"]["cbn_stem"], result["parts"]["bnp_biases"]
    assert (stem["baseline"], list(stem["ratio"])) == ("local_bn", ["cbn", "cbn_stem_unfolded", "cbn_stem_frozen"])
    assert (biases["baseline"], list(biases["ratio"])) == ("plain", ["bnp", "bnp_no_bias"])
    for part in (stem, biases):
        _measured(part["ratio"])
        _measured({name: float(ms) for name, ms in part["median_step_ms"].items()})
    assert stem["frozen"] == {"local_bn": [], "cbn": [], "cbn_stem_unfolded": [],
                              "cbn_stem_frozen": ["conv1.norm.weight", "conv1.norm.bias"]}
    assert stem["stem_folded"] == {"local_bn": None, "cbn": True, "cbn_stem_unfolded": False, "cbn_stem_frozen": False}
    assert biases["stem_folded"] == dict.fromkeys(biases["ratio"] | {"plain": 0}, None)
    # torchvision's ResNet-18: 20 bias-free convolutions; the fc has its own bias
    assert biases["parameters"]["bnp"] == biases["parameters"]["plain"] + 20
    assert biases["parameters"]["bnp_no_bias"] == biases["parameters"]["plain"]
