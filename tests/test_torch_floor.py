"""distnorm refuses a torch older than it needs, at import, with the install that fixes it;
the floor it checks is the one pyproject.toml declares."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from distnorm._torch_floor import TORCH_FLOOR, require_torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["2.4.0", "2.4.0a0+git1234abc", "2.11.0+cu126", "2.14.1+cu130", "3.0.0", "10.1"])
def test_supported_versions_pass(version):
    require_torch(version)


@pytest.mark.parametrize("version", ["2.3.1", "2.3.0+cu121", "2.0.0", "1.13.1+cpu"])
def test_older_versions_are_refused_with_the_fix(version):
    with pytest.raises(ImportError, match=re.escape(f"distnorm needs torch>=2.4 (found {version}): pip install 'torch>=2.4'")):
        require_torch(version)


def test_unparsable_version_is_let_through():
    require_torch("unknown")


def test_floor_is_the_one_pyproject_declares():
    (declared,) = re.findall(r'"torch>=(\d+)\.(\d+)"', (REPO / "pyproject.toml").read_text())
    assert tuple(map(int, declared)) == TORCH_FLOOR


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_import_refuses_an_old_torch():
    """The check runs before anything that would fail on an old torch with a confusing error."""
    code = "import torch; torch.__version__ = '2.3.1'; import distnorm"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "ImportError: distnorm needs torch>=2.4 (found 2.3.1): pip install 'torch>=2.4'" in done.stderr
