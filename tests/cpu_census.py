"""Every Python interpreter a command starts, and how much of its CPU its imports are.

    python tests/cpu_census.py run DIR -- python -m pytest ...   # record, one JSON file per process
    python tests/cpu_census.py report DIR                         # by kind; their imports' cost

``tests/cpu_seconds.py`` says how much CPU the suite takes; this says how much of it the
processes the tests start pay for their imports, whatever the test does. ``run`` puts a ``.pth`` hook in this interpreter's
site-packages for the length of the command (removed after, whatever happens): each Python
process started with ``CPU_CENSUS_OUT`` in its environment writes, at exit (``atexit`` and
``os._exit``), its ``argv``, its own CPU seconds, the heavy modules it imported and whether
it is a forked child (no interpreter start of its own: a fork server's rank, a DataLoader
worker). What it cannot see: a process killed by a signal it does not handle (SIGKILL, or
SIGTERM without a handler: ``torchrun`` stopping the other ranks), the image a launcher
replaces with ``os.exec*`` (the new image is recorded), interpreters of another venv, and
every process that is not Python (shells, daemons, compilers); ``tests/cpu_seconds.py``
around the same command counts them all. Right after the command, ``run`` measures, once per
distinct set of heavy modules, what a fresh interpreter pays to import that set (median of
three; ``DIR/import-costs.json``); ``report`` groups the interpreters by kind and charges
each that cost, capped at its own CPU. Process accounting beside it
(``accton``, ``dump-acct``) adds each process's CPU to its very end (its teardown, after the
last ``atexit`` handler), the killed ones and the rest (``tests/README.md``, "CPU seconds").

A measurement tool, not run by ``make test``: while ``run`` holds the hook, every Python
process of that venv started with ``CPU_CENSUS_OUT`` set pays for a few small imports.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

#: What a test's process may import that costs start-up, cheapest last.
HEAVY = ("torch", "torch._dynamo", "torchvision", "accelerate", "deepspeed", "lightning", "timm", "webdataset", "distnorm")

#: Where ``run`` keeps the import costs it measured right after the command.
COSTS = "import-costs.json"

HOOK = '''\
import os
if os.environ.get("CPU_CENSUS_OUT"):
    import atexit, json, resource, sys, uuid
    _born, _written = os.getpid(), []

    def _census_write():
        if os.getpid() in _written:
            return
        _written.append(os.getpid())
        try:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            record = {"argv": sys.argv[:4], "cpu": usage.ru_utime + usage.ru_stime, "forked": os.getpid() != _born,
                      "pytest": "_pytest" in sys.modules, "modules": [m for m in %r if m in sys.modules]}
            name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}.json"  # pids wrap in a long run
            with open(os.path.join(os.environ["CPU_CENSUS_OUT"], name), "x") as f:
                json.dump(record, f)
        except Exception:
            pass

    def _census_exit(status, _exit=os._exit):  # os._exit takes status by name too
        _census_write()
        _exit(status)

    atexit.register(_census_write)
    os._exit = _census_exit
''' % (HEAVY,)


def run(directory: Path, command: list[str]) -> int:
    """Run ``command`` with the hook installed and ``CPU_CENSUS_OUT=directory``; the hook goes
    when the command ends, fails, or this process gets Ctrl-C or SIGTERM."""
    packages = Path(sysconfig.get_path("purelib"))  # this interpreter's site-packages, venv or not
    module, pth = packages / "_distnorm_cpu_census.py", packages / "_distnorm_cpu_census.pth"
    if pth.exists():
        raise SystemExit(f"{pth} exists: another census runs in this Python, or one was killed; "
                         f"remove it (and {module.name}) if none runs")
    directory.mkdir(parents=True, exist_ok=True)
    module.write_text(HOOK)
    pth.write_text(f"import {module.stem}\n")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # so that finally runs
    try:
        code = subprocess.call(command, env={**os.environ, "CPU_CENSUS_OUT": str(directory.resolve())})
    finally:
        pth.unlink(missing_ok=True)
        module.unlink(missing_ok=True)
    if not _records(directory):
        print(f"cpu_census: no process wrote a record in {directory} (is the command's Python "
              f"{sys.executable}?)", file=sys.stderr)
        return code
    # Right after the run: this machine's speed drifts by tens of percent within an hour, so
    # the import costs are only comparable with the run's own CPU seconds if taken beside it.
    print("cpu_census: measuring what each set of imports costs a fresh interpreter", file=sys.stderr)
    (directory / COSTS).write_text(json.dumps(_measure_costs(_records(directory)), indent=1) + "\n")
    return code


def _records(directory: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(directory.glob("[0-9]*-*.json"))]


def _measure_costs(records: list[dict]) -> list[list]:
    """``[modules, CPU seconds]`` for each distinct set of heavy modules an interpreter imported."""
    sets = sorted({tuple(r["modules"]) for r in records if not r["forked"]})
    return [[list(mods), import_cost(mods)] for mods in sets]


def kind(record: dict) -> str:
    """What this interpreter ran, from its script (``argv[0]``)."""
    script = record["argv"][0] if record["argv"] else "?"
    name = Path(script).name
    if record.get("pytest"):
        return "pytest (the suite, its workers, sessions tests start)"
    if name == "torchrun" or script.endswith("torch/distributed/run.py"):
        return "torchrun agent"
    if name == "distnorm-train" or script.endswith("distnorm/train/__main__.py"):
        return "recipe training or its check"
    if name == "deepspeed" or "/deepspeed/launcher/" in script:
        return "DeepSpeed runner or launcher"
    if name == "accelerate":
        return "accelerate launch"
    if "/bench/" in script:
        return "benchmark script"
    if "/examples/" in script or "/tests/engines/" in script:
        return "example or engine script"
    return f"other ({name})"


def import_cost(modules: tuple[str, ...], python: str = sys.executable, repeats: int = 3) -> float:
    """CPU seconds a fresh interpreter pays to import ``modules`` (median of ``repeats``)."""
    # distnorm's own import is lazy (no torch); what its modules pull in that is heavy is in
    # the list already, the rest (yaml, PIL, ...) left out: the figure stays a lower bound
    code = "".join(f"import {m}\n" for m in modules if m != "distnorm")
    code += "import resource\nu = resource.getrusage(resource.RUSAGE_SELF)\nprint(u.ru_utime + u.ru_stime)\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("CPU_CENSUS_OUT", None)
    times = [float(subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)
             for _ in range(repeats)]
    return statistics.median(times)


def report(directory: Path) -> str:
    """The interpreters of a ``run`` by kind: count, their own CPU seconds, their
    imports' cost (each one's, capped at its own CPU seconds: a lower bound), with the import
    costs ``run`` measured right after the command (now, if it did not)."""
    records = _records(directory)
    started = [r for r in records if not r["forked"]]
    forked = [r for r in records if r["forked"]]
    measured = directory / COSTS
    when = "right after the run" if measured.exists() else "now, not beside the run"
    pairs = json.loads(measured.read_text()) if measured.exists() else _measure_costs(records)
    costs = {tuple(mods): cpu for mods, cpu in pairs}

    def imports(group: list[dict]) -> float:
        return sum(min(costs[tuple(r["modules"])], r["cpu"]) for r in group)

    def own(group: list[dict]) -> float:
        return sum(r["cpu"] for r in group)

    groups = collections.defaultdict(list)
    for record in started:
        groups[kind(record)].append(record)
    lines = [f"{len(started)} interpreters: {own(started):.1f} CPU-s of their own, "
             f"{imports(started):.1f} of them their imports",
             f"{len(forked)} forked children (no start-up of their own): {own(forked):.1f} CPU-s",
             "", f"{'started by':54} {'count':>5} {'CPU-s':>7} {'imports':>7}"]
    for name, group in sorted(groups.items(), key=lambda item: -own(item[1])):
        lines.append(f"{name:54} {len(group):5} {own(group):7.1f} {imports(group):7.1f}")
    lines += ["", f"count  import CPU-s  modules (import costs measured {when})"]
    counts = collections.Counter(tuple(r["modules"]) for r in started)
    lines += [f"{n:5}  {costs[mods]:12.2f}  {', '.join(mods) or '-'}" for mods, n in counts.most_common()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    record = sub.add_parser("run", help="run a command, recording every Python process it starts")
    record.add_argument("directory", type=Path)
    record.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    show = sub.add_parser("report", help="the recorded interpreters by kind, and what their imports cost")
    show.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    if args.action == "report":
        print(report(args.directory))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --, e.g. -- python -m pytest tests")
    return run(args.directory, command)


if __name__ == "__main__":
    sys.exit(main())
