"""Run every benchmark and write ``bench/results/<date>.json`` plus ``<date>.md``.

    python bench/all.py [--quick] [--out bench/results]

Each script runs in its own process (they set their own allocator environment); their
JSON outputs are collected into one file, and the headline ratios into a markdown table
that the README links to.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import date
from pathlib import Path

from _common import machine, write_json

HERE = Path(__file__).resolve().parent
SCRIPTS = ("layers", "bnp", "data", "step")
LOWER_IS_BETTER = {"layers": True, "bnp": True, "data": False, "step": True}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--only", nargs="*", choices=SCRIPTS, default=list(SCRIPTS))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = date.today().isoformat() + ("-quick" if args.quick else "")
    results = {}
    for name in args.only:
        target = out / f"{stem}-{name}.json"
        cmd = [sys.executable, str(HERE / f"{name}.py"), "--json", str(target)] + (["--quick"] if args.quick else [])
        print(f"$ {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, check=True)
        results[name] = json.loads(target.read_text())
        target.unlink()
    payload = {"machine": machine(), "quick": args.quick, "results": results}
    write_json(str(out / f"{stem}.json"), payload)
    lines = [f"# Benchmarks, {stem}", "",
             f"Machine: {payload['machine']['processor']}, {payload['machine']['cpu_count']} CPUs, "
             f"torch {payload['machine']['torch']}, CUDA: {payload['machine']['cuda'] or 'none'}. "
             f"Command: `python bench/all.py{' --quick' if args.quick else ''}`.", "",
             "| benchmark | ratio | value | better |", "|---|---|---|---|"]
    for name, result in results.items():
        for key, value in result["ratios"].items():
            lines.append(f"| {name} | `{key}` | {value:.3f} | {'lower' if LOWER_IS_BETTER[name] and not key.startswith('naive') else 'higher'} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / (stem + '.md')}")
    return payload


if __name__ == "__main__":
    main()
