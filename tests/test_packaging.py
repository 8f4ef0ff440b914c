"""The package is the product: the wheel, installed outside the repository, runs the recipes
and launchers it ships, and a missing optional dependency names the extra to install.

The wheel is built from a copy of what ``pyproject.toml`` reads (``pip wheel --no-deps``, this
environment's setuptools, nothing downloaded) and installed with ``--no-deps`` into a fresh
virtualenv outside the repository. That virtualenv reaches this environment's
site-packages (torch, PyYAML, Accelerate, DeepSpeed: a 5 GB torch is not installed twice)
through a ``.pth`` file, which puts them after its own site-packages: the wheel's
``distnorm`` is the one imported (asserted), not the clone's. Every command runs in a
directory outside the clone, with no ``PYTHONPATH``.

The wheel holds the recipes, the DeepSpeed JSON and the launchers (when it held the Python
package only, ``distnorm-train --config configs/demo/digits.yaml`` said "does not exist"
outside a clone) and every subpackage (none left out of pyproject.toml's package list);
without PyYAML, ``distnorm-train --help`` does not end in a ``ModuleNotFoundError`` traceback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import digits_overrides
from tests.test_gpu_image import SITECUSTOMIZE

pytestmark = pytest.mark.processes  # builds a wheel, installs it, runs its commands

REPO = Path(__file__).resolve().parents[1]
#: What the build reads (pyproject.toml: the readme, the licence, the packages and their data).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "distnorm", "configs", "launch")
#: The launcher files of launch/ that ship (every file there but the package marker).
LAUNCH_FILES = sorted(p.relative_to(REPO / "launch").as_posix() for p in (REPO / "launch").rglob("*")
                      if p.is_file() and p.name != "__init__.py" and "__pycache__" not in p.parts)


@dataclass(frozen=True)
class Install:
    venv: Path
    site: Path  # the venv's own site-packages, where the wheel went
    elsewhere: Path  # a working directory outside the clone

    def run(self, *argv: str, blocked: tuple[str, ...] = (), timeout: float = 240,
            **env: str) -> subprocess.CompletedProcess:
        """``argv`` with the venv's bin/ first on PATH, from outside the clone; ``blocked``:
        top-level modules its Python cannot import (a sitecustomize on PYTHONPATH)."""
        full = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHON", "VIRTUAL_ENV")}
        full["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{full['PATH']}"
        full["OMP_NUM_THREADS"] = "1"
        if blocked:
            site = self.elsewhere / f"without-{'-'.join(blocked)}"
            site.mkdir(exist_ok=True)
            (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(absent=blocked))
            full["PYTHONPATH"] = str(site)
        return subprocess.run(list(argv), cwd=self.elsewhere, env={**full, **env}, capture_output=True, text=True,
                              timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(REPO / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(src)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("distnorm-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Install:
    root = tmp_path_factory.mktemp("install")
    assert not root.is_relative_to(REPO)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # This environment's packages, after the venv's own (a path line of a .pth is appended to
    # sys.path; the .pth files of that directory, the clone's editable install among them, are
    # not read).
    (site / "zz_test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True, timeout=300)
    elsewhere = root / "work"
    elsewhere.mkdir()
    return Install(venv, site, elsewhere)


def test_the_wheel_holds_the_package_its_recipes_and_its_launchers(wheel):
    """Every module of distnorm/, every recipe and DeepSpeed JSON of configs/ and every file of
    launch/ is in the wheel (the scripts executable)."""
    with zipfile.ZipFile(wheel) as archive:
        modes = {info.filename: info.external_attr >> 16 for info in archive.infolist()}
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "distnorm").rglob("*.py")}
    assert modules - set(modes) == set(), "modules missing from the wheel: add their package to pyproject.toml"
    recipes = {f"distnorm/recipes/{p.relative_to(REPO / 'configs').as_posix()}"
               for ext in ("yaml", "json") for p in (REPO / "configs").rglob(f"*.{ext}")}
    assert recipes - set(modes) == set(), "recipes missing from the wheel"
    launchers = {f"distnorm/launch/scripts/{name}" for name in LAUNCH_FILES}
    assert launchers - set(modes) == set(), "launcher files missing from the wheel"
    for name in launchers:
        if name.endswith((".sh", ".sbatch")):
            assert modes[name] & 0o111, f"{name} is not executable in the wheel"
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in modes)


def test_the_installed_commands_run_shipped_recipes_outside_the_clone(installed, digits):
    """From a directory outside the clone: the wheel's distnorm is imported; ``--help``,
    ``--list-configs``, ``--check`` of shipped recipes by name (the demo; the DeepSpeed
    recipe, whose JSON is found in the package) and by a clone's path; a misspelt name lists
    the closest; ``python -m distnorm.launch path`` gives the shipped Accelerate config."""
    out = _ok(installed.run("python", "-c", "import distnorm, distnorm.recipes, distnorm.launch.scripts as s; "
                                            "print(distnorm.__file__, distnorm.recipes.__file__, s.__file__)"))
    for path in out.split():
        assert Path(path).is_relative_to(installed.site), f"{path} is not the wheel's (under {installed.site})"
    assert not installed.elsewhere.is_relative_to(REPO)

    assert "--list-configs" in _ok(installed.run("distnorm-train", "--help"))
    listing = _ok(installed.run("distnorm-train", "--list-configs"))
    assert str(installed.site / "distnorm" / "recipes") in listing
    for name in ("demo/digits", "imagenet/resnet50_cbn", "imagenet/resnet50_cbn_deepspeed", "cifar/vgg16_cbn",
                 "deepspeed/zero2_bf16.json"):
        assert f"  {name}\n" in listing + "\n", f"{name} not listed:\n{listing}"

    data = digits_overrides(digits)
    out = _ok(installed.run("distnorm-train", "--config", "demo/digits", "--check", *data))
    assert "demo/digits: OK for 1 process(es)" in out
    out = _ok(installed.run("distnorm-train", "--config", "configs/demo/digits.yaml", "--check", "--world-size", "2",
                            *data))
    assert "OK for 2 process(es)" in out
    out = _ok(installed.run("distnorm-train", "--config", "imagenet/resnet50_cbn_deepspeed", "--check",
                            "--world-size", "2", *data, "model.num_classes=10", "data.transform=digits"))
    assert "OK for 2 process(es)" in out

    wrong = installed.run("distnorm-train", "--config", "imagenet/resnet50_cbm", "--check")
    assert wrong.returncode == 2 and "the closest: imagenet/resnet50_cbn" in wrong.stderr, wrong.stderr
    assert "Traceback" not in wrong.stderr

    path = Path(_ok(installed.run("python", "-m", "distnorm.launch", "path", "accelerate/multi_cpu.yaml")).strip())
    assert path.is_file() and path.is_relative_to(installed.site)


@pytest.mark.timeout(300)
def test_the_installed_launcher_runs_torchrun_sh_from_the_package(installed, digits, tmp_path):
    """``python -m distnorm.launch torchrun demo/digits`` runs the shipped launch/torchrun.sh:
    its check refuses a batch 3 processes do not split before any worker; 1 process trains 2
    steps and checkpoints, with the wheel's distnorm in the workers."""
    data = digits_overrides(digits)
    refused = installed.run("python", "-m", "distnorm.launch", "torchrun", "demo/digits", *data, NPROC="3")
    assert refused.returncode == 2 and "does not split over 3 processes" in refused.stderr, refused.stderr

    run_dir = tmp_path / "run"
    out = _ok(installed.run("python", "-m", "distnorm.launch", "torchrun", "demo/digits", *data, "train.max_steps=2",
                            f"output.dir={run_dir}", "output.progress=false", NPROC="1"))
    assert "demo/digits: OK for 1 process(es)" in out and "checkpoint: " in out
    assert (run_dir / "checkpoints" / "step_000000002").is_dir()


@pytest.mark.parametrize("command, hidden, extra", [
    (("distnorm-train", "--help"), "yaml", "train"),
    (("distnorm-train", "--list-configs"), "yaml", "train"),
    (("python", "-m", "distnorm.launch", "torchrun", "demo/digits"), "yaml", "train"),
    (("distnorm-train", "--config", "demo/digits", "--check"), "PIL", "train"),
    (("distnorm-train", "--config", "demo/digits", "--dry-run"), "PIL", "train"),
    (("distnorm-shards", "digits", "shards/digits", "--maxcount", "100"), "PIL", "data"),
    (("distnorm-report", "."), "matplotlib", "report"),
], ids=["train-help", "train-list", "launch-torchrun", "train-check", "train-dry-run", "shards", "report"])
def test_a_missing_optional_dependency_names_the_extra_to_install(installed, command, hidden, extra):
    """A command of the installed wheel whose extra's package cannot be imported: one line
    naming the module and ``pip install "distnorm[EXTRA]"``, no traceback. ``--check``, which
    imports none of the training's modules, looks each up (a missing one said before the queue
    wait, not by every worker after it): without Pillow, the check does not pass."""
    proc = installed.run(*command, blocked=(hidden,))
    assert proc.returncode != 0
    assert f'pip install "distnorm[{extra}]"' in proc.stderr and repr(hidden) in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
