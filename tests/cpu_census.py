"""Every Python interpreter a command starts, and the CPU seconds its imports alone would cost.

    python tests/cpu_census.py run DIR -- python -m pytest ...   # record, one JSON file per process
    python tests/cpu_census.py report DIR                         # by kind; the start-up floor

``tests/cpu_seconds.py`` says how much CPU the suite takes; this says how much of it no cut
inside a launched process can remove. ``run`` puts a ``.pth`` hook in this interpreter's
site-packages for the length of the command (removed after, whatever happens): each Python
process started with ``CPU_CENSUS_OUT`` in its environment writes, at exit (``atexit`` and
``os._exit``), its ``argv``, its own CPU seconds, the heavy modules it imported and whether
it is a forked child (no interpreter start of its own: a fork server's rank, a DataLoader
worker). Killed processes write nothing. ``report`` groups the interpreters by kind and
measures, once per distinct set of heavy modules, what a fresh interpreter pays to import
that set (median of three): the sum over the interpreters is the suite's start-up floor, what
it would cost if every launched process stopped right after its imports.

A measurement tool, not run by ``make test``: while ``run`` holds the hook, every Python
process of that venv started with ``CPU_CENSUS_OUT`` set pays for an ``import json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import site
import statistics
import subprocess
import sys
from pathlib import Path

#: What a test's process may import that costs start-up, cheapest last.
HEAVY = ("torch", "torch._dynamo", "torchvision", "accelerate", "deepspeed", "lightning", "timm", "webdataset", "distnorm")

HOOK = '''\
import os
if os.environ.get("CPU_CENSUS_OUT"):
    import atexit, json, resource, sys
    _born, _written = os.getpid(), []

    def _census_write():
        if os.getpid() in _written:
            return
        _written.append(os.getpid())
        try:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            record = {"argv": sys.argv[:4], "cpu": usage.ru_utime + usage.ru_stime, "forked": os.getpid() != _born,
                      "pytest": "_pytest" in sys.modules, "modules": [m for m in %r if m in sys.modules]}
            with open(os.path.join(os.environ["CPU_CENSUS_OUT"], f"{os.getpid()}.json"), "w") as f:
                json.dump(record, f)
        except Exception:
            pass

    def _census_exit(code, _exit=os._exit):
        _census_write()
        _exit(code)

    atexit.register(_census_write)
    os._exit = _census_exit
''' % (HEAVY,)


def run(directory: Path, command: list[str]) -> int:
    """Run ``command`` with the hook installed and ``CPU_CENSUS_OUT=directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    packages = Path(site.getsitepackages()[0])
    module, pth = packages / "_distnorm_cpu_census.py", packages / "_distnorm_cpu_census.pth"
    module.write_text(HOOK)
    pth.write_text("import _distnorm_cpu_census\n")
    try:
        return subprocess.call(command, env={**os.environ, "CPU_CENSUS_OUT": str(directory.resolve())})
    finally:
        pth.unlink(missing_ok=True)
        module.unlink(missing_ok=True)


def kind(record: dict) -> str:
    """What started this interpreter, from its ``argv``."""
    argv = " ".join(record["argv"])
    first = Path(record["argv"][0]).name if record["argv"] else "?"
    if "torch/distributed/run.py" in argv or first == "torchrun":
        return "torchrun agent"
    if "distnorm/train/__main__.py" in argv or first == "distnorm-train":
        return "recipe training or its check"
    if record["pytest"]:
        return "pytest (its workers: every in-process test)"
    if "deepspeed" in argv:
        return "DeepSpeed runner or launcher"
    if "accelerate" in first:
        return "accelerate launch"
    if "/bench/" in argv:
        return "benchmark script"
    return f"other ({first})"


def import_cost(modules: tuple[str, ...], python: str = sys.executable, repeats: int = 3) -> float:
    """CPU seconds a fresh interpreter pays to import ``modules`` (median of ``repeats``)."""
    code = "".join(f"import {m}\n" for m in modules if m != "distnorm")  # distnorm's import is lazy:
    # what its modules pull in is in the list already
    code += "import resource\nu = resource.getrusage(resource.RUSAGE_SELF)\nprint(u.ru_utime + u.ru_stime)\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("CPU_CENSUS_OUT", None)
    times = [float(subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)
             for _ in range(repeats)]
    return statistics.median(times)


def report(directory: Path, cost=import_cost) -> str:
    """The interpreters of a ``run`` by kind: count, their own CPU seconds, the start-up floor."""
    records = [json.loads(f.read_text()) for f in sorted(directory.glob("*.json"))]
    started = [r for r in records if not r["forked"]]
    forked = [r for r in records if r["forked"]]
    costs = {mods: cost(mods) for mods in sorted({tuple(r["modules"]) for r in started})}
    groups = collections.defaultdict(list)
    for record in started:
        groups[kind(record)].append(record)
    floor = sum(costs[tuple(r["modules"])] for r in started)
    lines = [f"{len(started)} interpreters: {sum(r['cpu'] for r in started):.0f} CPU-s of their own, "
             f"{floor:.0f} of them their imports alone (the floor)",
             f"{len(forked)} forked children (no start-up of their own): {sum(r['cpu'] for r in forked):.0f} CPU-s",
             "", f"{'started by':46} {'count':>5} {'CPU-s':>7} {'floor':>7}"]
    for name, group in sorted(groups.items(), key=lambda item: -sum(r["cpu"] for r in item[1])):
        lines.append(f"{name:46} {len(group):5} {sum(r['cpu'] for r in group):7.0f} "
                     f"{sum(costs[tuple(r['modules'])] for r in group):7.0f}")
    lines += ["", "count  import CPU-s  modules"]
    counts = collections.Counter(tuple(r["modules"]) for r in started)
    lines += [f"{n:5}  {costs[mods]:12.2f}  {', '.join(mods) or '-'}" for mods, n in counts.most_common()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    record = sub.add_parser("run", help="run a command, recording every Python process it starts")
    record.add_argument("directory", type=Path)
    record.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    show = sub.add_parser("report", help="the recorded interpreters by kind, and their start-up floor")
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
