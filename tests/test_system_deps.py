"""The install step of the system tools (.ci/system-deps.sh) and how tests read it
(tests/system.py)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.system import REPO, need, status


@pytest.mark.processes
def test_install_step_reports_every_tool_it_lists(tmp_path):
    """The install step reports every tool it lists and claims none that is not there: as root
    (CI, these machines) every tool is present afterwards; otherwise it names what is missing.
    A green run does not hide a missing install."""
    out = tmp_path / "status"
    proc = subprocess.run([str(REPO / ".ci" / "system-deps.sh"), str(out)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr
    reported = status(out)
    assert {"sbatch", "munged", "sshd", "pdsh", "ip", "tc", "unshare"} <= set(reported)
    if os.geteuid() == 0:
        assert set(reported.values()) == {"installed"}, reported
        need(*reported, path=out)  # and each is really found
    else:
        assert "missing" not in reported.values() or "apt-get install" in proc.stderr


def test_a_tool_claimed_installed_but_missing_fails_instead_of_skipping(tmp_path):
    """A tool the install step reported installed but that is missing fails the test that
    needs it instead of skipping it; one reported missing, or with no report at all, is a skip
    that says why."""
    claimed = tmp_path / "status"
    claimed.write_text("no-such-tool-xyz=installed\n")
    with pytest.raises(pytest.fail.Exception, match="reported installed"):
        need("no-such-tool-xyz", path=claimed)
    claimed.write_text("no-such-tool-xyz=missing\n")
    with pytest.raises(pytest.skip.Exception, match="could not install"):
        need("no-such-tool-xyz", path=claimed)
    with pytest.raises(pytest.skip.Exception, match="make system-deps"):
        need("no-such-tool-xyz", path=tmp_path / "absent")
    need("sh", path=tmp_path / "absent")  # present: nothing to say
