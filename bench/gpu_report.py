"""What ``make test-gpu`` runs on a GPU machine, in the time one is lent: the CUDA tests, then
the benchmarks (eager before compiled, ResNet-50 first), gathered into one report,
``<out>/gpu-<date>.json`` plus ``.md``, rewritten before and after every part.

    python bench/gpu_report.py [--quick] [--out DIR] [--name gpu-<date>] [--budget-s S]
                               [--only tests step_eager ...] [--part-timeout step_compile=240]
                               [--pytest-args='-k compile'] [--step-args='--repeats 5'] [--host-args='--rounds 3']

Runs with the interpreter it is given and installs nothing (a bare GPU machine: torch,
torchvision, accelerate, timm, pytest; no Sybil, DeepSpeed, WebDataset, Lightning,
pytest-timeout or network). ``<out>`` is ``--out``, else ``$OUT`` when it is set (the folder a
lent machine sends back), else ``bench/results``. With ``--bundle`` (the default when the
report goes to ``$OUT``: such a machine sends back few files) the parts write into a folder of
their own, packed into ``<out>/<name>.parts.tar.gz`` at every rewrite of the report, so
``<out>`` holds three files. The parts, in this order, each in its own process (its whole
output also goes to ``<out>/<name>.<part>.log`` as it runs, or into the bundle):

* **tests**: ``pytest -m cuda tests/test_cuda.py tests/test_fused.py tests/test_group_norm.py tests/test_step_cost.py tests/test_compile.py tests/test_checkpointing.py tests/test_prefetch.py``
  with ``DISTNORM_TEST_TIER=gpu`` (conftest.py then does without Sybil): the CUDA tests only,
  passed / failed / skipped counts, every skip reason with its count (what the machine lacks:
  a CUDA device, a second GPU, triton), the failures by name (pytest's JUnit XML,
  ``<out>/<name>.tests.xml``).
* **step_eager**: ``bench/step_gpu.py --modes eager``: ResNet-50 first, then ResNet-18 and
  EfficientNet-B0 (``--quick``: ResNet-50 only), 224 px, batch 256, bf16, channels_last,
  SGD; local BN against distnorm's SyncBatchNorm, CBN, POP-Norm and GN + BNP: step-time
  ratio, images/s, peak memory.
* **step_compile**: ``bench/step_gpu.py --modes compile reduce_overhead --models resnet50
  --variants local_bn cbn syncbn popnorm``: ResNet-50 ``torch.compile``d (inductor's default
  mode) and ``torch.compile(mode="reduce-overhead")``d (CUDA graphs), variant by variant in
  that order, each timed against local BN in the same mode as soon as it is built; per
  variant also dynamo's graph breaks and recompiles, and what inductor did with CUDA graphs
  (its skip counters and messages), or the error it raised (not in ``--quick``).
* **step_compile_more**: the same for ResNet-18, then EfficientNet-B0, local BN and CBN only
  (not in ``--quick``).
* **host**: ``bench/host_cost.py --device cuda --profile cbn --replay``: each layer's host
  time to issue one training step, its first host sync (CUDA's sync debug mode), how much of
  it the step's operators take called alone (the rest: Python, autograd, the layer's logic),
  CBN's costliest Python functions.
* **profile**: ``bench/profile_step.py --device cuda --variants local_bn cbn --repeats 5``:
  where a ResNet-50 step's time goes, local BN against CBN: the step, the host's time to
  issue it, the GPU's kernels summed, the kernel count (not in ``--quick``).
* **layers**: ``bench/layers.py --device cuda``: each layer's forward+backward against
  ``nn.BatchNorm2d``.
* **decode**: ``bench/decode_gpu.py --device cuda``: the data pipeline's ``decode_device:
  cuda`` path (batched nvJPEG decode, crop, flip, normalize on the GPU) against PIL on one core.
* **loader**: ``bench/loader_step.py --device cuda``: ResNet-50 and ResNet-18 steps (eager,
  compiled) fed by the recipes' loader from shards it writes, against the same steps on a
  batch already on the GPU; last in the default plan, which it fits only when the parts before
  it end early: run it alone with ``--only loader``. It needs WebDataset, which a lent machine
  lacks: ``make gpu-deps`` copies it (pure Python) into ``.gpu-deps/``, which the run carries
  and this report puts on ``PYTHONPATH``.

The report opens with the step ratios of the three step parts against local BN in the same
mode, each next to its goal (``step_gpu.GOALS``: compiled and CUDA graphs at most 1.05x
local BN in the same mode; eager has none).

**Time.** The run has a budget (``--budget-s``: 470 s, ``--quick`` 210 s) and each part a
limit (:data:`PLANS`); a part gets the smaller of its limit and what is left of the budget,
is stopped with every process it started when that runs out (status ``timed out``), and is
not started with less left than it needs to finish anything (its ``min_s`` in the plan, at
least :data:`MIN_PART_S`; ``skipped``). The step parts are told their time
(``--time-budget-s``, :data:`STEP_MARGIN_S` less) and start no build they would not finish:
what they did not build is listed as not run and the part ends ``ran``. The benchmarks write
their JSON as they go (``<out>/<name>.<part>.json``), so a stopped part keeps what it
finished, and the report is rewritten before each part (``running``) and after it, so a run
killed from outside keeps every part that finished.

**Triton.** The report records the facts that decide whether Triton kernels can run: whether
``triton`` imports and its version, the C compiler Triton builds its launchers with (``$CC``,
else ``gcc``, else ``clang`` on ``PATH``, as ``triton/runtime/build.py`` picks it) and its
version, ``DISTNORM_TRITON``; and, per part, the lines of its output that report a Triton
warning or failure (distnorm warns once when its kernels fall back to the ATen composite).

Without CUDA the benchmarks are marked "skipped: no CUDA device" (the tests skip their CUDA
cases themselves, and say so), and the report is still written. Each part's ``status`` is
``ran``, ``skipped`` (with its ``reason``), ``failed`` or ``timed out``; the exit status is 1
when a test failed or a part failed or timed out, else 0.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from pathlib import Path

import torch

from _common import REPO, machine

HERE = Path(__file__).resolve().parent
PARTS = ("tests", "step_eager", "step_compile", "step_compile_more", "host", "profile", "layers", "decode", "loader")
#: The parts that run bench/step_gpu.py.
STEP_PARTS = ("step_eager", "step_compile", "step_compile_more")
TESTS = ["tests/test_cuda.py", "tests/test_fused.py", "tests/test_group_norm.py", "tests/test_step_cost.py", "tests/test_compile.py",
         "tests/test_checkpointing.py", "tests/test_prefetch.py"]
#: Only the tests that need CUDA (the CPU tests of these files run in ``make test``).
TEST_MARKER = "cuda"
#: What the tests' process gets: conftest.py collects without Sybil in this tier.
TEST_ENV = {"DISTNORM_TEST_TIER": "gpu"}
#: Packages whose absence some tests skip over, or that the report should name.
OPTIONAL = ("torchvision", "timm", "accelerate", "deepspeed", "webdataset", "lightning", "sybil", "triton",
            "pytest", "pytest_timeout")
NO_CUDA = "no CUDA device"
#: A part is not started with less than this many seconds of the budget left (or its plan's ``min_s``).
MIN_PART_S = 15.0
#: A step part stops starting builds this many seconds before its limit: the interpreter's
#: start and imports before its clock starts, and its last timing and JSON after.
STEP_MARGIN_S = 20.0
#: An output line that reports a Triton warning or failure (distnorm's fallback warning included).
TRITON_MESSAGE = re.compile(r"(?i)triton.*(warn|error|fail|fall)|(warn|error|fail).*triton")


@dataclass(frozen=True)
class Plan:
    """One way to run the report: its time budget, and per part a time limit, the least time
    worth starting it with (default :data:`MIN_PART_S`) and arguments."""

    budget_s: float
    limits_s: dict[str, float]
    args: dict[str, tuple[str, ...]]
    min_s: dict[str, float] = field(default_factory=dict)


_COMPILED = ("--modes", "compile", "reduce_overhead")
#: The default fits 8 minutes on one H100 or H200 and ``--quick`` 4 (docs/reference/gpu.md:
#: how these limits were estimated). A part absent from ``limits_s`` is not run in that plan.
#: ``min_s``: a step part's first figures (the compiled parts: local BN's builds and a
#: variant's), the others' whole run on the H100 / H200 of 2026-11-26/27.
PLANS = {
    "default": Plan(
        budget_s=470,
        limits_s={"tests": 150, "step_eager": 130, "step_compile": 240, "step_compile_more": 200, "host": 60,
                  "profile": 90, "layers": 90, "decode": 90, "loader": 400},
        args={"step_eager": ("--modes", "eager"),
              "step_compile": (*_COMPILED, "--models", "resnet50", "--variants", "local_bn", "cbn", "syncbn", "popnorm"),
              "step_compile_more": (*_COMPILED, "--models", "resnet18", "efficientnet_b0", "--variants", "local_bn", "cbn"),
              "host": ("--profile", "cbn", "--replay"), "profile": ("--variants", "local_bn", "cbn", "--repeats", "5")},
        min_s={"step_compile": 150, "step_compile_more": 90, "host": 20, "profile": 40, "layers": 40, "decode": 45,
               "loader": 120}),
    "quick": Plan(
        budget_s=210,
        limits_s={"tests": 150, "step_eager": 60, "host": 30, "layers": 45, "decode": 30},
        args={"step_eager": ("--modes", "eager", "--models", "resnet50"), "host": ("--rounds", "3", "--replay"),
              "layers": ("--repeats", "5"),
              "decode": ("--repeats", "1")}),
}
SCRIPTS = {"step_eager": "step_gpu.py", "step_compile": "step_gpu.py", "step_compile_more": "step_gpu.py",
           "host": "host_cost.py", "profile": "profile_step.py", "layers": "layers.py", "decode": "decode_gpu.py",
           "loader": "loader_step.py"}


def default_out() -> str:
    """``$OUT`` (what a lent GPU machine sends back) when set, else ``bench/results``."""
    return os.environ.get("OUT") or str(HERE / "results")


def _part_timeout(text: str) -> tuple[str, float]:
    part, _, seconds = text.partition("=")
    if part not in PARTS:
        raise argparse.ArgumentTypeError(f"unknown part {part!r} in {text!r}: choose from {', '.join(PARTS)}")
    try:
        value = float(seconds)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give PART=SECONDS with SECONDS > 0, e.g. step_compile=240")
    return part, value


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the 4-minute plan: no compiled step, ResNet-50 only")
    parser.add_argument("--out", help="folder of the report (default: $OUT when set, else bench/results)")
    parser.add_argument("--bundle", action=argparse.BooleanOptionalAction, default=None,
                        help="put every part's log and JSON into one <name>.parts.tar.gz beside the report, so the "
                             "folder holds three files (default: on when the report goes to $OUT)")
    parser.add_argument("--name", default=f"gpu-{date.today().isoformat()}", help="file stem of the report")
    parser.add_argument("--only", nargs="+", choices=PARTS, help="parts to run (default: the plan's)")
    parser.add_argument("--budget-s", type=float, help="seconds for the whole run (default: 450, --quick 210)")
    parser.add_argument("--part-timeout", type=_part_timeout, action="append", default=[], metavar="PART=SECONDS",
                        help="override one part's time limit (repeatable)")
    parser.add_argument("--tests", nargs="+", default=TESTS, help="test files (relative to the repository)")
    parser.add_argument("--pytest-args", default="", help="more pytest arguments, one string (use --pytest-args=...)")
    parser.add_argument("--host-args", default="", help="more bench/host_cost.py arguments, one string")
    parser.add_argument("--profile-args", default="", help="more bench/profile_step.py arguments, one string")
    parser.add_argument("--layers-args", default="", help="more bench/layers.py arguments, one string")
    parser.add_argument("--step-args", default="", help="more bench/step_gpu.py arguments (every step part)")
    parser.add_argument("--decode-args", default="", help="more bench/decode_gpu.py arguments, one string")
    parser.add_argument("--loader-args", default="", help="more bench/loader_step.py arguments, one string")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = get_args_parser()
    args = parser.parse_args(argv)
    plan = PLANS["quick" if args.quick else "default"]
    args.budget_s = plan.budget_s if args.budget_s is None else args.budget_s
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be > 0, got {args.budget_s}")
    args.plan_parts = [part for part in PARTS if part in plan.limits_s]
    args.limits_s = {**plan.limits_s, **dict(args.part_timeout)}
    args.plan_args = plan.args
    args.min_s = plan.min_s
    if args.bundle is None:  # a lent machine sends back few files from $OUT: three, then
        args.bundle = args.out is None and bool(os.environ.get("OUT"))
    args.out = args.out or default_out()
    args.parts_dir = Path(args.out)  # main() gives --bundle a folder of its own
    if not args.name or "/" in args.name:
        parser.error(f"--name must be a file stem without '/', got {args.name!r}")
    return args


# ------------------------------------------------------------------------ environment
def cuda_info() -> dict:
    """The CUDA devices this process sees, or why there are none."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count:
        reason = None
    elif torch.version.cuda is None:
        reason = f"{NO_CUDA} (torch {torch.__version__} is a CPU-only build)"
    else:
        reason = f"{NO_CUDA} (torch built for CUDA {torch.version.cuda}, but no device is visible)"
    return {"device_count": count, "devices": [torch.cuda.get_device_name(i) for i in range(count)],
            "torch_cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if count else None,
            "reason": reason}


def packages() -> dict[str, str | None]:
    """Version of each optional package, None where it is not installed."""
    found = {}
    for name in OPTIONAL:
        if importlib.util.find_spec(name) is None:
            found[name] = None
            continue
        try:
            found[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            found[name] = "installed"
    return found


def c_compiler() -> dict:
    """The C compiler Triton would build its launchers with, as ``triton/runtime/build.py``
    picks it (``$CC``, else ``gcc``, else ``clang`` on ``PATH``), and its ``--version`` line."""
    if os.environ.get("CC"):
        path, source = shutil.which(os.environ["CC"]) or os.environ["CC"], "$CC"
    else:
        found = [(shutil.which(name), f"{name} on PATH") for name in ("gcc", "clang")]
        path, source = next(((p, s) for p, s in found if p), (None, "none: no $CC, gcc or clang on PATH"))
    version = None
    if path:
        try:
            proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
            version = (proc.stdout or proc.stderr).strip().splitlines()[0] if (proc.stdout or proc.stderr).strip() \
                else f"exit {proc.returncode}"
        except (OSError, subprocess.SubprocessError) as err:
            version = f"cannot run: {err}"
    return {"path": path, "source": source, "version": version}


def triton_info() -> dict:
    """Whether ``triton`` imports here (not just whether it is installed), its version, the
    C compiler for its launchers, and ``DISTNORM_TRITON``."""
    try:
        triton = importlib.import_module("triton")
        imported = {"imports": True, "version": getattr(triton, "__version__", "unknown"), "error": None}
    except Exception as err:  # noqa: BLE001 - any import failure is a fact to report
        imported = {"imports": False, "version": None, "error": f"{type(err).__name__}: {err}"}
    return {**imported, "cc": c_compiler(), "DISTNORM_TRITON": os.environ.get("DISTNORM_TRITON")}


# ---------------------------------------------------------------------------- running
@dataclass
class Finished:
    """How a part's process ended."""

    rc: int | None  # None: stopped at its time limit
    tail: list[str]
    wall_s: float
    triton_messages: list[str]


def run_part(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> Finished:
    """Run ``cmd`` in the repository in a session of its own, echoing its output and writing
    it to ``log`` line by line; at ``timeout_s`` stop it and every process it started (the
    whole session: pytest's ranks, inductor's compile workers). Returns how it ended."""
    print(f"$ {shlex.join(cmd)}", flush=True)
    start = time.perf_counter()
    tail: deque[str] = deque(maxlen=40)
    triton: list[str] = []
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as sink:
        sink.write(f"$ {shlex.join(cmd)}\n")
        sink.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env={**os.environ, **(env or {})}, start_new_session=True)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                print(line, end="", flush=True)
                sink.write(line)
                sink.flush()
                tail.append(line.rstrip("\n"))
                if TRITON_MESSAGE.search(line) and len(triton) < 20:
                    triton.append(line.strip()[:400])

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # also on an interrupt of this process: nothing it started keeps the GPU
            _stop_session(proc)
        reader.join(timeout=10)
        if rc is None:
            sink.write(f"[gpu_report: stopped after {timeout_s:.0f} s, its time limit]\n")
    return Finished(rc, list(tail), round(time.perf_counter() - start, 1), triton)


def _stop_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def junit_summary(path: Path) -> dict:
    """Counts, skip reasons and failures from pytest's JUnit XML."""
    counts = Counter()
    reasons: Counter[str] = Counter()
    failures = []
    for case in ET.parse(path).getroot().iter("testcase"):
        node = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag == "skipped":
                outcome = "skipped"
                reasons[child.get("message", "").removeprefix("Skipped: ") or "(no reason given)"] += 1
            elif child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
                failures.append({"test": node, "kind": child.tag, "message": (child.get("message") or "")[:500]})
        counts[outcome] += 1
    return {"passed": counts["passed"], "failed": counts["failed"], "errors": counts["errors"],
            "skipped": counts["skipped"], "skip_reasons": dict(reasons.most_common()), "failures": failures}


def pytest_command(args: argparse.Namespace, junit: Path) -> list[str]:
    """The tests part's command: the CUDA tests of ``args.tests``, a JUnit report."""
    return [sys.executable, "-m", "pytest", "-q", "-rs", "-m", TEST_MARKER, *args.tests, *shlex.split(args.pytest_args),
            "-p", "no:cacheprovider", f"--junitxml={junit}"]


def run_tests(args: argparse.Namespace, timeout_s: float) -> dict:
    if importlib.util.find_spec("pytest") is None:
        return {"status": "skipped", "reason": f"pytest is not installed for {sys.executable}"}
    out = Path(args.parts_dir)
    xml = out / f"{args.name}.tests.xml"
    xml.unlink(missing_ok=True)  # a report from an earlier run of the same name is not this run's
    cmd = pytest_command(args, xml)
    done = run_part(cmd, out / f"{args.name}.tests.log", timeout_s, env=TEST_ENV)
    part = {"command": shlex.join(["python", *cmd[1:-3]]), "rc": done.rc, "wall_s": done.wall_s,
            "log": f"{args.name}.tests.log", "triton_messages": done.triton_messages}
    if done.rc is None:
        return {**part, "status": "timed out", "reason": f"stopped after {timeout_s:.0f} s (its time limit)",
                "output_tail": done.tail}
    if not xml.exists():  # pytest did not get as far as running tests (a usage error, a crash)
        return {**part, "status": "failed", "reason": f"pytest exited {done.rc} without a report",
                "output_tail": done.tail}
    part.update(junit_summary(xml))
    bad = part["failed"] or part["errors"] or done.rc not in (0, 5)  # 5: nothing collected
    return {**part, "status": "failed" if bad else "ran", **({"output_tail": done.tail} if bad else {})}


def run_benchmark(name: str, args: argparse.Namespace, timeout_s: float) -> dict:
    out = Path(args.parts_dir)
    result = out / f"{args.name}.{name}.json"
    result.unlink(missing_ok=True)
    extra = {**dict.fromkeys(STEP_PARTS, args.step_args), "host": args.host_args, "profile": args.profile_args,
             "layers": args.layers_args, "decode": args.decode_args, "loader": args.loader_args}[name]
    # a step part is told its time, so that it ends by itself with what it finished
    told = ("--time-budget-s", f"{timeout_s - STEP_MARGIN_S:.0f}") if name in STEP_PARTS \
        and timeout_s > 2 * STEP_MARGIN_S else ()
    shown = [f"bench/{SCRIPTS[name]}", "--device", "cuda", *args.plan_args.get(name, ()), *told, *shlex.split(extra)]
    cmd = [sys.executable, str(REPO / shown[0]), *shown[1:], "--json", str(result)]
    done = run_part(cmd, out / f"{args.name}.{name}.log", timeout_s)
    part = {"command": shlex.join(["python", *shown]), "rc": done.rc, "wall_s": done.wall_s,
            "log": f"{args.name}.{name}.log", "triton_messages": done.triton_messages}
    payload = json.loads(result.read_text()) if result.exists() else None
    if done.rc is None:
        return {**part, "status": "timed out", "reason": f"stopped after {timeout_s:.0f} s (its time limit)",
                "output_tail": done.tail, **({"result": payload} if payload else {})}
    if done.rc != 0 or payload is None:  # what it wrote before it failed is kept
        return {**part, "status": "failed", "reason": f"exited {done.rc}", "output_tail": done.tail,
                **({"result": payload} if payload else {})}
    return {**part, "status": "ran", "result": payload}


# ----------------------------------------------------------------------------- report
def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _status_line(part: dict) -> str:
    return f"{part['status']}: {part.get('reason', '')}".rstrip(": ")


def _goal_cell(ratio: float | None, goal: float | None) -> str:
    if goal is None:
        return "—"
    if ratio is None:
        return f"≤ {goal:.2f}"
    return f"≤ {goal:.2f}: {'met' if ratio <= goal else 'not met'}"


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _step_lines(step: dict) -> list[str]:
    """A step part's table: every (model, variant, mode) it timed, each ratio next to its goal,
    and what the compiler did; then what failed, what it did not build, what it did not time."""
    if "result" not in step:
        return [_status_line(step), ""]
    result = step["result"]
    cfg = result["config"]
    goals = result.get("goals", {})
    lines = [] if step["status"] == "ran" else [_status_line(step) + "; what it finished:", ""]
    compiled_as = "; ".join(f"{mode}: `{call}`" for mode, call in cfg.get("compiled_as", {}).items())
    lines += [f"`{step['command']}`: batch {cfg['batch']}, {cfg['size']} px, {cfg['amp'] or 'float32'}, "
              f"{'channels_last' if cfg.get('channels_last', True) else 'NCHW'}, {cfg['optimizer']}, median of "
              f"{cfg['repeats']} interleaved steps{'; ' + compiled_as if compiled_as else ''}. Each ratio is against "
              "local BN in the same mode, or eager, timed in the same rounds (lower is better).", "",
              "| model | variant | mode | step ms | × local BN, same mode | goal | × local BN eager | images/s | peak GiB "
              "| first step s | graph breaks | recompiles |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for model, r in result["models"].items():
        for variant, modes in r["variants"].items():
            for mode, e in modes.items():
                what = f"{model} {variant} {mode}"
                dynamo = e.get("dynamo", {})
                counts = f"{dynamo['graph_breaks']} | {dynamo['recompiles']}" if dynamo else "— | —"
                if "error" in e:
                    lines.append(f"| {model} | {variant} | {mode} | failed ({e['phase']}) | | {_goal_cell(None, goals.get(mode))} "
                                 f"| | | | {_ms(e.get('first_step_s'))} | {counts} |")
                    notes.append(f"* {what} failed at its {e['phase']}: `{e['error'].splitlines()[0][:300]}`")
                else:
                    same = e.get("ratio_vs_local_bn_same_mode")
                    goal = "baseline" if variant == "local_bn" else _goal_cell(same, goals.get(mode))
                    lines.append(f"| {model} | {variant} | {mode} | {e['median_step_ms']:.1f} | {_x(same)} | "
                                 f"{goal} | {_x(e.get('ratio_vs_local_bn_eager'))} | "
                                 f"{e['images_per_s']:.0f} | {_gib(e['peak_memory_bytes'])} | {e['first_step_s']:.1f} "
                                 f"| {counts} |")
                if dynamo.get("graph_break_reasons"):
                    notes.append(f"* {what}, graph breaks: " + "; ".join(
                        f"`{reason.splitlines()[0][:200]}` ×{n}" for reason, n in dynamo["graph_break_reasons"].items()))
                graphs = e.get("cudagraphs")
                if graphs and (graphs["counters"] or graphs["messages"]):
                    notes.append(f"* {what}, CUDA graphs: counters {graphs['counters'] or 'none'}"
                                 + "".join(f"; `{m.splitlines()[0][:200]}`" for m in graphs["messages"][:3]))
    lines += [""] + notes if notes else []
    timed = {(m, v, mode) for m, r in result["models"].items() for v, modes in r["variants"].items() for mode in modes}
    untimed = [b for b in result.get("built", []) if (b["model"], b["variant"], b["mode"]) not in timed]
    if untimed and not result.get("complete", True):
        lines.append("")
        lines += [f"* built, not timed (the run stopped first): {b['model']} {b['variant']} {b['mode']}, "
                  f"first step {_ms(b['first_step_s'])} s" for b in untimed]
    if result.get("not_run"):
        lines += ["", f"* not run ({result['not_run'][0]['reason']}): "
                  + ", ".join(f"{n['model']} {n['variant']} {n['mode']}" for n in result["not_run"])]
    lines += [f"* {mode} skipped: {why}" for mode, why in result.get("skipped", {}).items()]
    if result.get("triton"):
        lines.append(f"* after the run: {result['triton']}")
    return lines + [""]


def _ratio_lines(parts: dict) -> list[str]:
    """One table of the step parts' ratios against local BN in the same mode, per model and
    distnorm variant, each next to its goal: what issue 55 asks of the compiled path."""
    entries: dict[tuple[str, str], dict[str, dict]] = {}
    goals: dict[str, float | None] = {}
    modes: list[str] = []
    for name in STEP_PARTS:
        result = parts.get(name, {}).get("result")
        if not result:
            continue
        goals.update(result.get("goals", {}))
        modes += [m for m in result["config"]["modes"] if m not in modes]
        for model, r in result["models"].items():
            for variant, by_mode in r["variants"].items():
                entries.setdefault((model, variant), {}).update(by_mode)
        for n in result.get("not_run", []):
            entries.setdefault((n["model"], n["variant"]), {}).setdefault(n["mode"], {"not_run": True})
    if not entries:
        return []
    order = ["eager", "compile", "reduce_overhead"]
    modes = sorted(modes, key=lambda m: order.index(m) if m in order else len(order))
    lines = ["## Step ratios against local BN in the same mode (one GPU)", "",
             "Each distnorm variant's training step against local `nn.BatchNorm2d`'s in the same mode, timed in "
             "the same rounds (the step parts below), next to its goal; local BN's own step in ms.", "",
             "| model | variant | " + " | ".join(modes) + " |", "|---|---|" + "---|" * len(modes)]
    for (model, variant), by_mode in entries.items():
        cells = []
        for mode in modes:
            e = by_mode.get(mode)
            if e is None:
                cells.append("")
            elif e.get("not_run"):
                cells.append("not run (time)")
            elif "error" in e:
                cells.append(f"failed ({e['phase']})")
            elif variant == "local_bn":
                cells.append(f"{e['median_step_ms']:.1f} ms")
            else:
                same = e.get("ratio_vs_local_bn_same_mode")
                goal = goals.get(mode)
                cells.append(f"{_x(same)}" + ("" if goal is None else f" ({_goal_cell(same, goal)})"))
        lines.append(f"| {model} | {variant} | " + " | ".join(cells) + " |")
    goal_text = "; ".join(f"{mode}: {'≤ ' + format(g, '.2f') + '×' if g is not None else 'none'}"
                          for mode, g in goals.items() if mode in modes)
    return lines + ["", f"Goals: {goal_text}.", ""]


def _host_lines(host: dict) -> list[str]:
    lines = ["## Host cost of a layer step (one GPU)", ""]
    if host["status"] != "ran":
        return lines + [_status_line(host), ""]
    r = host["result"]
    lines += [f"`{host['command']}`: forward + backward at {tuple(r['config']['shape'])} channels_last, where the "
              "GPU's work is negligible: the host's time to issue one step (a layer whose host cost exceeds its "
              "GPU time makes the GPU wait).", "",
              "| layer | host µs per step | × BatchNorm2d | first host sync |", "|---|---|---|---|"]
    base = r["us_per_step"]["batchnorm2d"]
    lines += [f"| {name} | {us:.0f} | {us / base:.2f} | {r['host_syncs'].get(name)} |"
              for name, us in r["us_per_step"].items()]
    if r.get("replay"):
        lines += ["", "Its operators called again alone (`--replay`), and the rest of the step (Python, autograd, "
                  "the layer's host logic): " + "; ".join(
                      f"{name} {rep['ops']} operators {rep['ops_us']:.0f} µs, rest {rep['rest_us']:.0f} µs"
                      for name, rep in r["replay"].items())]
    for name, rows in r.get("profiles", {}).items():
        lines += ["", f"{name}: costliest Python functions (own µs per step, calls per step): " + "; ".join(
            f"`{row['function']}` {row['own_us_per_step']:.0f} ({row['calls_per_step']:g})" for row in rows[:8])]
    return lines + [""]


def _profile_lines(profile: dict) -> list[str]:
    lines = ["## Where a step's time goes (one GPU, the profiler)", ""]
    if "result" not in profile:
        return lines + [_status_line(profile), ""]
    r = profile["result"]
    cfg = r["config"]
    lines += [] if profile["status"] == "ran" else [_status_line(profile) + "; what it finished:", ""]
    lines += [f"`{profile['command']}`: batch {cfg['batch']}, {cfg['size']} px, {'bf16' if cfg['amp'] else 'float32'}, "
              f"{'channels_last' if cfg.get('channels_last', True) else 'NCHW'}, eager, median of {cfg['repeats']} steps; "
              "the step (synchronized), the host's time to issue it, the GPU's kernels summed (a step whose host time "
              "nears its wall time is bound by the host).", "",
              "| model | variant | step ms | host ms | kernels ms | kernels |", "|---|---|---|---|---|---|"]
    for model, variants in r["models"].items():
        lines += [f"| {model} | {variant} | {e['wall_ms']:.1f} | {e['host_ms']:.1f} | {_ms(e['device_kernel_ms'])} | "
                  f"{e['kernels']} |" for variant, e in variants.items()]
    return lines + [""]


def markdown(report: dict) -> str:
    m, cuda, triton = report["machine"], report["cuda"], report["triton"]
    gpus = ", ".join(cuda["devices"]) or cuda["reason"]
    missing = [name for name, version in report["packages"].items() if version is None]
    cc = triton["cc"]
    lines = [f"# GPU report, {report['name']}", "",
             f"Machine: {gpus}; torch {m['torch']} (CUDA {cuda['torch_cuda'] or 'none'}), Python {m['python']}, "
             f"{m['cpu_count']} CPUs. Not installed: {', '.join(missing) or 'nothing missing'}. "
             f"Command: `{report['command']}`; budget {report['budget_s']:.0f} s, started {report['started']}.", "",
             f"Triton: {'imports, ' + triton['version'] if triton['imports'] else 'does not import: ' + str(triton['error'])}; "
             f"C compiler for its launchers: {cc['path'] or 'none'} ({cc['source']}; {cc['version'] or 'no version'}); "
             f"DISTNORM_TRITON={triton['DISTNORM_TRITON'] or 'unset'}.", "",
             "| part | status | s | Triton warnings / failures in its output |", "|---|---|---|---|"]
    for name, part in report["parts"].items():
        messages = "; ".join(f"`{line[:120]}`" for line in part.get("triton_messages", [])[:3]) or "none"
        lines.append(f"| {name} | {_status_line(part)} | {part.get('wall_s', '')} | "
                     f"{messages if 'triton_messages' in part else ''} |")
    lines.append("")
    lines += _ratio_lines(report["parts"])
    tests = report["parts"]["tests"]
    lines += ["## Tests", ""]
    if "passed" not in tests:
        lines += [_status_line(tests), ""]
    else:
        lines += [f"`{tests['command']}` ({tests['wall_s']} s)", "",
                  "| passed | failed | errors | skipped |", "|---|---|---|---|",
                  f"| {tests['passed']} | {tests['failed']} | {tests['errors']} | {tests['skipped']} |", ""]
        if tests["skip_reasons"]:
            lines += ["| skipped | reason |", "|---|---|"]
            lines += [f"| {n} | {reason} |" for reason, n in tests["skip_reasons"].items()] + [""]
        lines += [f"* FAILED `{f['test']}`: {f['message'].splitlines()[0] if f['message'] else f['kind']}"
                  for f in tests["failures"]] + ([""] if tests["failures"] else [])
    lines += ["## Training step, eager (one GPU)", "", *_step_lines(report["parts"]["step_eager"])]
    for name, title in (("step_compile", "compiled and CUDA graphs, ResNet-50"),
                        ("step_compile_more", "compiled and CUDA graphs, ResNet-18 and EfficientNet-B0")):
        lines += [f"## Training step, {title} (one GPU)", "",
                  *_step_lines(report["parts"].get(name, {"status": "skipped", "reason": "not in this report"}))]
    lines += _host_lines(report["parts"].get("host", {"status": "skipped", "reason": "not in this report"}))
    lines += _profile_lines(report["parts"].get("profile", {"status": "skipped", "reason": "not in this report"}))
    layers = report["parts"]["layers"]
    lines += ["## Layer benchmark (forward + backward, one GPU)", ""]
    if layers["status"] != "ran":
        lines += [_status_line(layers), ""]
    else:
        lines += [f"`{layers['command']}`", "", "| shape | layer | median ms | × BatchNorm2d |", "|---|---|---|---|"]
        for entry in layers["result"]["shapes"]:
            for name, ms in entry["median_ms"].items():
                lines.append(f"| {tuple(entry['shape'])} | {name} | {ms:.3f} | {entry['ratio_vs_batchnorm2d'][name]:.3f} |")
        lines.append("")
    lines += _loader_lines(report["parts"].get("loader", {"status": "skipped", "reason": "not in this report"}))
    decode = report["parts"]["decode"]
    lines += ["## JPEG decode + ImageNet transform (data.decode_device)", ""]
    if decode["status"] != "ran":
        lines += [_status_line(decode), ""]
    else:
        r = decode["result"]
        lines += [f"`{decode['command']}`: {r['images']} images, batch {r['batch_size']}, crop {r['crop']}; "
                  f"mean |device - PIL| {r['mean_abs_diff_vs_pil']:.5f} (normalized units).", "",
                  "| path | images/s | × PIL on 1 core |", "|---|---|---|"]
        ips = r["images_per_second"]
        lines += [f"| {name} | {ips[name]:.0f} | {ips[name] / ips['pil_1_core']:.2f} |" for name in ips] + [""]
    return "\n".join(lines)


def _loader_lines(part: dict) -> list[str]:
    """The loader part: each loader-fed step against the step on a resident batch."""
    lines = ["## Training step fed by the loader (WebDataset shards, one GPU)", ""]
    if part["status"] != "ran":
        return lines + [_status_line(part), ""]
    r = part["result"]
    shards = r["shards"]
    lines += [f"`{part['command']}`: {shards['images']} synthetic JPEGs (quality {shards['jpeg_quality']}, "
              f"mean {shards['mean_shape_hw'][0]:.0f} x {shards['mean_shape_hw'][1]:.0f}), batch {r['batch_size']}, "
              f"crop {r['image_size']}, prefetch {r['prefetch']}, {r['cpu_count']} cores.", "",
              "| run | fed by | ms / step | images/s | × resident batch | loader alone, images/s | cores |",
              "|---|---|---|---|---|---|---|"]
    for run, variants in r["results"].items():
        for key, e in variants.items():
            lines.append(f"| {run} | {key} | {e['step_ms']:.1f} | {e['images_per_s']:.0f} | "
                         f"{e.get('slowdown', 1.0):.3f} | {e.get('loader_alone_images_per_s', float('nan')):.0f} | "
                         f"{e['cores']:.1f} |")
    costs = r["cost_per_image_us"]
    return lines + ["", "CPU per image (pil, one worker thread), µs: "
                    + ", ".join(f"{k} {v:.0f}" for k, v in costs.items()), ""]


def write_report(report: dict, out: Path, parts_dir: Path | None = None) -> None:
    """``<name>.json`` and ``<name>.md`` in ``out``, each through a rename: a kill mid-write
    leaves the previous version. With ``parts_dir`` (``--bundle``): also
    ``<name>.parts.tar.gz``, every file the parts wrote there so far, the same way."""
    out.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(report, indent=2) + "\n"), (".md", markdown(report))):
        target = out / f"{report['name']}{suffix}"
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, target)
    if parts_dir is not None:
        target = out / report["parts_bundle"]
        tmp = target.with_name(target.name + ".tmp")
        with tarfile.open(tmp, "w:gz") as bundle:
            for path in sorted(parts_dir.iterdir()):
                if path.is_file():
                    bundle.add(path, arcname=path.name)
        os.replace(tmp, target)


def _run_part(part: str, args: argparse.Namespace, timeout_s: float, report: dict, save) -> dict:
    """Mark ``part`` running in the report on disk (a run killed from outside shows where it
    was; ``save()`` writes it), then run it."""
    report["parts"][part] = {"status": "running", "reason": f"started with a {timeout_s:.0f} s limit; a report that "
                                                            "still says so was stopped from outside"}
    save()
    return run_tests(args, timeout_s) if part == "tests" else run_benchmark(part, args, timeout_s)


def _stop_on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # run_part stops its part's session on the way out


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    deps = REPO / ".gpu-deps"  # make gpu-deps: pure-Python packages a lent machine lacks (WebDataset)
    if deps.is_dir():
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(deps), os.environ.get("PYTHONPATH")]))
    # --bundle: the parts write into a folder of their own, packed beside the report after each
    args.parts_dir = Path(tempfile.mkdtemp(prefix=f"{args.name}-parts-")) if args.bundle else out
    deadline = time.monotonic() + args.budget_s
    cuda = cuda_info()
    report = {"report": "gpu", "name": args.name,
              "command": shlex.join(["python", "bench/gpu_report.py", *(sys.argv[1:] if argv is None else argv)]),
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "budget_s": args.budget_s,
              "limits_s": args.limits_s, "machine": machine(), "cuda": cuda, "packages": packages(),
              "triton": triton_info(), "parts": {}}
    if args.bundle:
        report["parts_bundle"] = f"{args.name}.parts.tar.gz"  # where each part's "log" and JSON are
    parts = report["parts"]

    def save() -> None:
        write_report(report, out, args.parts_dir if args.bundle else None)

    wanted = [p for p in PARTS if p in (args.only or args.plan_parts)]
    for part in PARTS:
        parts[part] = {"status": "pending"} if part in wanted else \
            {"status": "skipped", "reason": "not asked for (--only)" if args.only else "not in this plan (--quick)"}
    save()
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        for part in wanted:
            left = deadline - time.monotonic()
            needed = max(MIN_PART_S, args.min_s.get(part, 0.0))
            if left < needed:
                parts[part] = {"status": "skipped", "reason": f"no time left: {left:.0f} s of the {args.budget_s:.0f} s "
                                                              f"budget (--budget-s), under the {needed:.0f} s it needs"}
            elif part == "tests":  # with or without CUDA: the tests skip what the machine lacks themselves
                parts[part] = _run_part(part, args, min(args.limits_s.get(part, left), left), report, save)
            elif not cuda["device_count"]:
                parts[part] = {"status": "skipped", "reason": cuda["reason"]}
            else:
                parts[part] = _run_part(part, args, min(args.limits_s.get(part, left), left), report, save)
            print(f"{part}: {_status_line(parts[part])}", flush=True)
            save()
    except KeyboardInterrupt as stop:
        for part in PARTS:
            if parts[part]["status"] in ("pending", "running"):
                parts[part] = {"status": "skipped" if parts[part]["status"] == "pending" else "failed",
                               "reason": f"gpu_report was stopped ({stop or 'interrupt'})"}
        save()
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        if args.bundle:  # packed into <name>.parts.tar.gz at every save
            shutil.rmtree(args.parts_dir, ignore_errors=True)
    print(f"wrote {out / (args.name + '.md')}")
    for name, part in parts.items():
        summary = {k: part[k] for k in ("passed", "failed", "errors", "skipped") if k in part}
        print(f"{name}: {_status_line(part)} {summary or ''}".rstrip())
    return 1 if any(p["status"] in ("failed", "timed out") for p in parts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
