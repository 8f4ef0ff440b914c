"""``make test-gpu`` collects its tests on the bare GPU image, and ``make test`` still needs Sybil.

The GPU machines we are lent have torch, torchvision, accelerate, timm and pytest, and no
Sybil, DeepSpeed, WebDataset, Lightning or pytest plugins (no pytest-timeout, no xdist), and
nothing can be installed there. These tests run pytest in a process where those packages
cannot be imported -- a ``sitecustomize`` on ``PYTHONPATH`` wraps the import system's finders
so that they find nothing under those names, as on a machine without them; nothing is put in
their place -- and with pytest's plugin autoloading off.

The root ``conftest.py`` imports Sybil only where it can be imported: on 2026-11-26 it
imported Sybil unguarded, and the GPU tier stopped at collection (exit 4), the report
holding nothing but that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # each test starts pytest or the report script

REPO = Path(__file__).resolve().parents[1]
#: What the GPU image lacks (top-level import names).
ABSENT = ("sybil", "deepspeed", "webdataset", "lightning", "pytorch_lightning", "lightning_fabric")

SITECUSTOMIZE = '''\
"""Written by tests/test_gpu_image.py: the import system finds none of ABSENT, as where they
are not installed (find_spec returns None, import raises ModuleNotFoundError)."""
import sys

ABSENT = {absent!r}


class _Without:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find is not None else None

    def invalidate_caches(self):
        if hasattr(self.finder, "invalidate_caches"):
            self.finder.invalidate_caches()


sys.meta_path[:] = [_Without(finder) for finder in sys.meta_path]
'''


def bare_image_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a process that sees what the GPU image has and nothing more."""
    site = tmp_path / "bare-image"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(absent=ABSENT))
    env = {k: v for k, v in os.environ.items() if k not in ("DISTNORM_TEST_TIER", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # no pytest-timeout, no xdist: the image has none
    return {**env, **extra}


def _run(cmd: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_gpu_tests_are_collected_where_sybil_deepspeed_webdataset_lightning_are_absent(tmp_path):
    """The tests part of ``bench/gpu_report.py`` (its own command and environment), run with
    ``--collect-only`` on the simulated image: it collects every CUDA test of the GPU files,
    says once that the docs' blocks are not collected, and the report names what is missing."""
    env = bare_image_env(tmp_path)
    probe = _run([sys.executable, "-c", "import importlib.util as u, torch\n"
                  f"print(sorted(n for n in {ABSENT!r} if u.find_spec(n) is not None))\n"
                  "import sybil"], env)
    assert probe.stdout.strip() == "[]" and "ModuleNotFoundError: No module named 'sybil'" in probe.stderr, \
        f"the simulated image still imports what it must lack:\n{probe.stdout}{probe.stderr}"

    out = tmp_path / "report"
    proc = _run([sys.executable, "bench/gpu_report.py", "--only", "tests", "--out", str(out), "--name", "r",
                 "--pytest-args=--collect-only"], env)
    log = (out / "r.tests.log").read_text() if (out / "r.tests.log").exists() else ""
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    report = json.loads((out / "r.json").read_text())
    tests = report["parts"]["tests"]
    assert tests["status"] == "ran" and tests["rc"] == 0, tests
    assert all(report["packages"][name] is None for name in ("sybil", "deepspeed", "webdataset", "lightning"))
    collected = [line for line in log.splitlines() if "::" in line and line.startswith("tests/")]
    assert any(line.startswith("tests/test_cuda.py::test_empty_rank_on_one_device[cuda-") for line in collected), log
    assert any(line.startswith("tests/test_fused.py::") for line in collected), log
    assert not any("[cpu-" in line for line in collected), "a CPU test in the GPU tier"
    assert log.count("are not collected: Sybil is not installed") == 1, log


@pytest.mark.timeout(300)
def test_without_sybil_make_test_stops_naming_it(tmp_path):
    """Outside the GPU tier a missing Sybil is an error before collection, naming the package
    and the fix -- not a suite that silently stops running the docs' examples."""
    proc = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "tests/test_cuda.py"],
                bare_image_env(tmp_path))
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert "Sybil is not installed" in proc.stderr and 'pip install -e ".[docs]"' in proc.stderr, proc.stderr
