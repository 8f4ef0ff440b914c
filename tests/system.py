"""System tools the tests use (Slurm, munge, sshd, pdsh, ...), as installed by
``.ci/system-deps.sh`` (``make system-deps``, which ``make test`` and ``make test-cluster``
run first).

``need("sbatch", "munged")`` at the top of a test: returns when the tools are there; skips
when the install step could not install them (not root: it says so in its status file) or
did not run (pytest started by hand: the skip names ``make system-deps``); and FAILS when the
install step reported a tool installed that is not to be found — a green run must never hide
a missing install.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

__all__ = ["need", "status"]

REPO = Path(__file__).resolve().parents[1]
STATUS = Path(os.environ.get("DISTNORM_SYSTEM_DEPS_STATUS", REPO / ".venv" / ".system-deps"))


def _found(tool: str) -> bool:
    return shutil.which(tool) is not None or os.access(f"/usr/sbin/{tool}", os.X_OK)


def status(path: Path = STATUS) -> dict[str, str]:
    """``tool -> "installed" | "missing"`` as the install step last wrote it ({} if it did not run)."""
    if not path.is_file():
        return {}
    lines = [line.split("=", 1) for line in path.read_text().splitlines() if "=" in line and not line.startswith("#")]
    return {tool.strip(): state.strip() for tool, state in lines}


def need(*tools: str, path: Path = STATUS) -> None:
    """Skip (tool not installable here) or fail (install step claims it) unless every tool is found."""
    missing = [t for t in tools if not _found(t)]
    if not missing:
        return
    reported = status(path)
    claimed = [t for t in missing if reported.get(t) == "installed"]
    if claimed:
        pytest.fail(f"{claimed} reported installed by .ci/system-deps.sh ({path}) but not found on PATH or in "
                    "/usr/sbin: the install step and the tests disagree")
    if not reported:
        pytest.skip(f"needs {missing}: run `make system-deps` (as root it installs them), or `make test`")
    pytest.skip(f"needs {missing}, which .ci/system-deps.sh could not install here (not root?): "
                "as root, run `make system-deps`")
