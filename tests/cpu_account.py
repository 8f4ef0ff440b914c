"""Where the suite's CPU seconds go, test by test: a pytest plugin, and its report.

    CPU_ACCOUNT_OUT=/tmp/acct python -m pytest -p tests.cpu_account -n 2 --dist loadfile tests ...
    python tests/cpu_account.py /tmp/acct            # the files and tests that cost most

Each pytest process (an xdist worker, or pytest itself) moves into a cgroup of its own (v1
``cpuacct``, root; nested in its current one, so ``tests/cpu_seconds.py`` still counts the
whole) and reads its counter before and after each test: the CPU seconds of the test and of
every process it started, the ranks of a fork server and re-parented daemons included. A
process a test leaves running (a straggler) is charged to the tests that run after it in
the same worker. Without a writable cgroup hierarchy the plugin says so and records nothing.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path("/sys/fs/cgroup/cpuacct")


def _own_group() -> Path | None:
    """A fresh cpuacct cgroup below this process's, with this process in it, or None."""
    try:
        line = next(entry for entry in Path("/proc/self/cgroup").read_text().splitlines()
                    if "cpuacct" in entry.split(":")[1].split(","))
        group = ROOT / line.split(":", 2)[2].lstrip("/") / f"pytest-{os.getpid()}"
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
        return group
    except (OSError, StopIteration, IndexError):
        return None


class CpuAccount:
    def __init__(self, group: Path, out: Path) -> None:
        self.group, self.out, self.rows = group, out, []

    def _usage(self) -> float:
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        cpu, wall = self._usage(), time.monotonic()
        yield
        self.rows.append([item.nodeid, round(self._usage() - cpu, 3), round(time.monotonic() - wall, 3)])

    def pytest_unconfigure(self, config) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"{os.getpid()}.json").write_text(json.dumps(self.rows))


def pytest_configure(config) -> None:
    out = os.environ.get("CPU_ACCOUNT_OUT")
    if not out:
        raise pytest.UsageError("tests.cpu_account: set CPU_ACCOUNT_OUT to the directory its files go to")
    group = _own_group()
    if group is None:
        print("tests.cpu_account: no writable cpuacct cgroup (needs root and cgroup v1): nothing recorded",
              file=sys.stderr)
        return
    config.pluginmanager.register(CpuAccount(group, Path(out)), "cpu_account_recorder")


def report(directory: str, top: int = 25) -> str:
    """The CPU seconds per test file and the costliest tests of the runs recorded in ``directory``."""
    rows = [row for f in sorted(Path(directory).glob("*.json")) for row in json.loads(f.read_text())]
    by_file = collections.Counter()
    for nodeid, cpu, _ in rows:
        by_file[nodeid.split("::")[0]] += cpu
    lines = [f"{sum(cpu for _, cpu, _ in rows):.0f} CPU-s in {len(rows)} tests", "", "CPU-s  file"]
    lines += [f"{cpu:6.1f} {name}" for name, cpu in by_file.most_common(top)]
    lines += ["", "CPU-s  wall-s  test"]
    lines += [f"{cpu:6.1f} {wall:6.1f}  {nodeid}" for nodeid, cpu, wall in sorted(rows, key=lambda r: -r[1])[:top]]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} DIRECTORY (CPU_ACCOUNT_OUT of the run)")
    print(report(sys.argv[1]))
