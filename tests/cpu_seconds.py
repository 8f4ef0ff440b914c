"""CPU seconds (user + system) of a command and of every process it starts.

    python tests/cpu_seconds.py [--json FILE] -- make test
    make cpu-seconds                      # the same for `make test`

CPU seconds travel between machines and loads better than wall time: a loaded machine
stretches the wall clock, not (much) the work done. Counting them needs every process the
command starts, and ``getrusage(RUSAGE_CHILDREN)`` (what ``/usr/bin/time`` reports) misses
processes that are never waited for by a waited-for parent: the fork server's gloo ranks,
daemons, anything re-parented to init. So the command runs in a fresh cgroup (v1
``cpuacct``, or v2 with the ``cpu`` controller), which keeps every descendant, and its
counters are read at the end. Without a writable cgroup hierarchy (not root, a container)
it falls back to ``RUSAGE_CHILDREN`` and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import uuid
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpuacct")
V2 = Path("/sys/fs/cgroup/unified")


def _make_group() -> tuple[str, Path] | None:
    """A fresh cgroup this process may move children into, or None."""
    name = f"cpu-seconds-{uuid.uuid4().hex[:8]}"
    for kind, root in (("v1", V1), ("v2", V2)):
        try:
            if kind == "v2" and "cpu" not in (root / "cgroup.controllers").read_text().split():
                continue
            path = root / name
            path.mkdir()
            return kind, path
        except OSError:
            continue
    return None


def _read(kind: str, path: Path) -> tuple[float, float]:
    """(user, system) seconds of everything that ran in the group."""
    if kind == "v1":
        ticks = os.sysconf("SC_CLK_TCK")
        stat = dict(line.split() for line in (path / "cpuacct.stat").read_text().splitlines())
        return int(stat["user"]) / ticks, int(stat["system"]) / ticks
    stat = dict(line.split() for line in (path / "cpu.stat").read_text().splitlines())
    return int(stat["user_usec"]) / 1e6, int(stat["system_usec"]) / 1e6


def _processes(group: Path) -> list[str]:
    """The processes in ``group`` and in the groups nested in it (a daemon a test started, e.g.
    Slurm's munged, stays in the nested group of the pytest worker that started it)."""
    return [pid for procs in group.rglob("cgroup.procs") for pid in procs.read_text().split()]


def _remove(group: Path) -> None:
    """Remove an emptied cgroup and the groups nested in it (a tool the suite runs may nest its
    own), deepest first: the kernel refuses (EBUSY) a group that has children."""
    for child in sorted((p for p in group.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        child.rmdir()
    group.rmdir()


def measure(command: list[str]) -> dict:
    """Run ``command``; its exit code, wall seconds and the CPU seconds of all it started."""
    group = _make_group()
    procs_file = None if group is None else group[1] / "cgroup.procs"

    def enter() -> None:  # in the child, before exec: it and all it starts stay in the group
        procs_file.write_text(str(os.getpid()))

    start = time.monotonic()
    code = subprocess.call(command, preexec_fn=enter if group else None)
    wall = time.monotonic() - start
    if group is None:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        user, system, how = usage.ru_utime, usage.ru_stime, "getrusage(RUSAGE_CHILDREN): misses processes never waited for"
    else:
        deadline = time.monotonic() + 60  # processes the command left behind: their CPU counts too
        while _processes(group[1]) and time.monotonic() < deadline:
            time.sleep(0.2)
        user, system = _read(*group)
        left = _processes(group[1])
        how = f"cgroup {group[0]}" + (f"; {len(left)} process(es) still running in {group[1]}" if left else "")
        if not left:
            _remove(group[1])
    return {"command": command, "exit_code": code, "wall_s": round(wall, 1), "user_s": round(user, 1),
            "system_s": round(system, 1), "cpu_s": round(user + system, 1), "counted_by": how}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --, e.g. -- make test")
    result = measure(command)
    print(f"cpu-seconds: {result['cpu_s']} s CPU (user {result['user_s']} + system {result['system_s']}) in "
          f"{result['wall_s']} s wall, exit {result['exit_code']}; counted by {result['counted_by']}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
