"""What ``make test-gpu`` runs: the CUDA tests, the layer benchmark and the one-GPU step
benchmark, gathered into one report, ``bench/results/gpu-<date>.json`` plus ``.md``.

    python bench/gpu_report.py [--out bench/results] [--name gpu-<date>] [--only tests step]
                               [--pytest-args='-k compile'] [--step-args='--models resnet50']

Runs with the interpreter it is given and installs nothing (a bare GPU machine: torch,
torchvision, pytest; perhaps no DeepSpeed, no WebDataset, no network). Three parts, each in
its own process:

* **tests**: ``pytest tests/test_cuda.py tests/test_fused.py tests/test_gpu_paths.py tests/test_kernel_contracts.py``: passed / failed /
  skipped counts, every skip reason with its count (what the machine lacks: a CUDA device,
  a second GPU, an optional package), the failures by name (from pytest's JUnit XML).
* **layers**: ``bench/layers.py --device cuda``: each layer's forward+backward against
  ``nn.BatchNorm2d``.
* **step**: ``bench/step_gpu.py``: ResNet-18 / ResNet-50 / EfficientNet-B0, 224 px, batch
  256, bf16, channels_last, SGD; local BN against distnorm's SyncBatchNorm, CBN, POP-Norm
  and GN + BNP, eager and compiled: step-time ratio, images/s, peak memory.
* **decode**: ``bench/decode_gpu.py``: the data pipeline's ``decode_device: cuda`` path
  (batched nvJPEG decode, crop, flip, normalize on the GPU) against PIL on one core.

Without CUDA the benchmarks are marked "skipped: no CUDA device" (the tests skip their CUDA
cases themselves, and say so), and the report is still written. Each part's ``status`` is
``ran``, ``skipped`` (with its ``reason``) or ``failed``; the exit status is 1 when a test
failed or a part crashed, else 0.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter, deque
from datetime import date
from pathlib import Path

import torch

from _common import REPO, machine, write_json

HERE = Path(__file__).resolve().parent
PARTS = ("tests", "layers", "step", "decode")
TESTS = ["tests/test_cuda.py", "tests/test_fused.py", "tests/test_gpu_paths.py", "tests/test_kernel_contracts.py"]
#: Packages whose absence some tests skip over, or that the report should name.
OPTIONAL = ("torchvision", "timm", "accelerate", "deepspeed", "webdataset", "triton", "pytest", "pytest_timeout")
NO_CUDA = "no CUDA device"


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE / "results"), help="folder of the report")
    parser.add_argument("--name", default=f"gpu-{date.today().isoformat()}", help="file stem of the report")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run")
    parser.add_argument("--tests", nargs="+", default=TESTS, help="test files (relative to the repository)")
    parser.add_argument("--pytest-args", default="", help="more pytest arguments, one string (use --pytest-args=...)")
    parser.add_argument("--layers-args", default="", help="more bench/layers.py arguments, one string")
    parser.add_argument("--step-args", default="", help="more bench/step_gpu.py arguments, one string")
    return parser


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


# ---------------------------------------------------------------------------- running
def run_streamed(cmd: list[str]) -> tuple[int, list[str], float]:
    """Run ``cmd`` in the repository, echoing its output; return code, last lines, seconds."""
    print(f"$ {shlex.join(cmd)}", flush=True)
    start = time.perf_counter()
    tail: deque[str] = deque(maxlen=40)
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            tail.append(line.rstrip("\n"))
    return proc.returncode, list(tail), round(time.perf_counter() - start, 1)


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


def run_tests(args: argparse.Namespace) -> dict:
    if importlib.util.find_spec("pytest") is None:
        return {"status": "skipped", "reason": f"pytest is not installed for {sys.executable}"}
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        shown = ["-m", "pytest", "-q", "-rs", *args.tests, *shlex.split(args.pytest_args)]
        rc, tail, wall = run_streamed([sys.executable, *shown, "-p", "no:cacheprovider", f"--junitxml={xml}"])
        part = {"command": shlex.join(["python", *shown]), "rc": rc, "wall_s": wall}
        if not xml.exists():  # pytest did not get as far as running tests (a usage error, a crash)
            return {**part, "status": "failed", "reason": f"pytest exited {rc} without a report", "output_tail": tail}
        part.update(junit_summary(xml))
    bad = part["failed"] or part["errors"] or rc not in (0, 5)  # 5: nothing collected
    return {**part, "status": "failed" if bad else "ran", **({"output_tail": tail} if bad else {})}


def run_benchmark(script: str, extra: str, *fixed: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(HERE / script), *fixed, *shlex.split(extra), "--json", str(out)]
        rc, tail, wall = run_streamed(cmd)
        part = {"command": shlex.join(["python", f"bench/{script}", *cmd[2:-2]]), "rc": rc, "wall_s": wall}
        if rc != 0 or not out.exists():
            return {**part, "status": "failed", "reason": f"exited {rc}", "output_tail": tail}
        return {**part, "status": "ran", "result": json.loads(out.read_text())}


# ----------------------------------------------------------------------------- report
def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def markdown(report: dict) -> str:
    m, cuda = report["machine"], report["cuda"]
    gpus = ", ".join(cuda["devices"]) or cuda["reason"]
    missing = [name for name, version in report["packages"].items() if version is None]
    lines = [f"# GPU report, {report['name']}", "",
             f"Machine: {gpus}; torch {m['torch']} (CUDA {cuda['torch_cuda'] or 'none'}), Python {m['python']}, "
             f"{m['cpu_count']} CPUs. Not installed: {', '.join(missing) or 'nothing missing'}. "
             f"Command: `{report['command']}`.", ""]
    tests = report["parts"]["tests"]
    lines += ["## Tests", ""]
    if tests["status"] == "skipped" or "passed" not in tests:
        lines += [f"{tests['status']}: {tests.get('reason', '')}", ""]
    else:
        lines += [f"`{tests['command']}` ({tests['wall_s']} s)", "",
                  "| passed | failed | errors | skipped |", "|---|---|---|---|",
                  f"| {tests['passed']} | {tests['failed']} | {tests['errors']} | {tests['skipped']} |", ""]
        if tests["skip_reasons"]:
            lines += ["| skipped | reason |", "|---|---|"]
            lines += [f"| {n} | {reason} |" for reason, n in tests["skip_reasons"].items()] + [""]
        lines += [f"* FAILED `{f['test']}`: {f['message'].splitlines()[0] if f['message'] else f['kind']}"
                  for f in tests["failures"]] + ([""] if tests["failures"] else [])
    layers = report["parts"]["layers"]
    lines += ["## Layer benchmark (forward + backward, one GPU)", ""]
    if layers["status"] != "ran":
        lines += [f"{layers['status']}: {layers.get('reason', '')}", ""]
    else:
        lines += [f"`{layers['command']}`", "", "| shape | layer | median ms | × BatchNorm2d |", "|---|---|---|---|"]
        for entry in layers["result"]["shapes"]:
            for name, ms in entry["median_ms"].items():
                lines.append(f"| {tuple(entry['shape'])} | {name} | {ms:.3f} | {entry['ratio_vs_batchnorm2d'][name]:.3f} |")
        lines.append("")
    step = report["parts"]["step"]
    lines += ["## Training step (one GPU)", ""]
    if step["status"] != "ran":
        lines += [f"{step['status']}: {step.get('reason', '')}", ""]
    else:
        cfg = step["result"]["config"]
        lines += [f"`{step['command']}`: batch {cfg['batch']}, {cfg['size']} px, {cfg['amp'] or 'float32'}, "
                  f"channels_last, {cfg['optimizer']}, median of {cfg['repeats']} interleaved steps; "
                  f"ratio against local BN eager in the same run (lower is better).", "",
                  "| model | variant | mode | step ms | × local BN eager | images/s | peak GiB | first step s |",
                  "|---|---|---|---|---|---|---|---|"]
        for model, r in step["result"]["models"].items():
            for variant, modes in r["variants"].items():
                for mode, e in modes.items():
                    lines.append(f"| {model} | {variant} | {mode} | {e['median_step_ms']:.1f} | "
                                 f"{e['ratio_vs_local_bn_eager']:.3f} | {e['images_per_s']:.0f} | "
                                 f"{_gib(e['peak_memory_bytes'])} | {e['first_step_s']:.1f} |")
        lines += [f"* {mode} skipped: {why}" for mode, why in step["result"].get("skipped", {}).items()]
        lines.append("")
    decode = report["parts"]["decode"]
    lines += ["## JPEG decode + ImageNet transform (data.decode_device)", ""]
    if decode["status"] != "ran":
        lines += [f"{decode['status']}: {decode.get('reason', '')}", ""]
    else:
        r = decode["result"]
        lines += [f"`{decode['command']}`: {r['images']} images, batch {r['batch_size']}, crop {r['crop']}; "
                  f"mean |device - PIL| {r['mean_abs_diff_vs_pil']} (normalized units).", "",
                  "| path | images/s | × PIL on 1 core |", "|---|---|---|"]
        ips = r["images_per_second"]
        lines += [f"| {name} | {ips[name]:.0f} | {ips[name] / ips['pil_1_core']:.2f} |" for name in ips] + [""]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = get_args_parser().parse_args(argv)
    cuda = cuda_info()
    report = {"report": "gpu", "name": args.name,
              "command": shlex.join(["python", "bench/gpu_report.py", *(sys.argv[1:] if argv is None else argv)]),
              "machine": machine(), "cuda": cuda, "packages": packages(), "parts": {}}
    parts = report["parts"]
    for part in PARTS:
        if part not in args.only:
            parts[part] = {"status": "skipped", "reason": "not asked for (--only)"}
        elif part == "tests":  # with or without CUDA: the tests skip what the machine lacks themselves
            parts[part] = run_tests(args)
        elif not cuda["device_count"]:
            parts[part] = {"status": "skipped", "reason": cuda["reason"]}
            print(f"{part}: skipped: {cuda['reason']}")
        elif part == "layers":
            parts[part] = run_benchmark("layers.py", args.layers_args, "--device", "cuda")
        elif part == "decode":
            parts[part] = run_benchmark("decode_gpu.py", "", "--device", "cuda")
        else:
            parts[part] = run_benchmark("step_gpu.py", args.step_args, "--device", "cuda")
    out = Path(args.out)
    write_json(str(out / f"{args.name}.json"), report)
    (out / f"{args.name}.md").write_text(markdown(report))
    print(f"wrote {out / (args.name + '.md')}")
    for name, part in parts.items():
        summary = {k: part[k] for k in ("passed", "failed", "errors", "skipped") if k in part}
        print(f"{name}: {part['status']}{': ' + part['reason'] if part.get('reason') else ''} {summary or ''}".rstrip())
    return 1 if any(p["status"] == "failed" for p in parts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
