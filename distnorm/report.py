"""Pictures of runs: ``distnorm-report RUN_DIR [RUN_DIR ...] [--out DIR]``.

Reads each run's ``metrics.jsonl`` (written by ``distnorm-train``) and writes PNG plots —
training loss, learning rate (as steps), AMAT's eta (when the run had AMAT) and images/s
against the step, validation top-1 / top-5 and
loss against the epoch, and the theory monitors when a run logged them — with the runs
overlaid, plus ``summary.md`` (a table of each run's final and best numbers). Needs
matplotlib (``pip install distnorm[report]``); no display is used.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

__all__ = ["load_metrics", "write_report", "main"]


def load_metrics(run_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Records of ``run_dir/metrics.jsonl`` grouped by kind (a truncated last line is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (is {run_dir} a distnorm-train run directory?)")
    records: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a run killed mid-write
        records[record.get("kind", "?")].append(record)
    # A resumed run repeats steps after its checkpoint: keep the last record per step.
    for kind, rows in records.items():
        if kind in ("train", "eval", "epoch", "monitor"):
            last: dict[Any, dict] = {}
            for row in rows:
                last[(row.get("step"), row.get("epoch"), row.get("layer"))] = row
            records[kind] = sorted(last.values(), key=lambda r: (r.get("step", 0), r.get("epoch", 0)))
    return dict(records)


def _label(run_dir: Path) -> str:
    return run_dir.name or str(run_dir)


PANELS = [
    ("train", "step", "loss", "training loss", "loss.png", True),
    ("train", "step", "lr", "learning rate", "lr.png", False),
    ("train", "step", "amat_eta", "AMAT's weight on history, eta = clip(1 - omega lr, 0, 1)", "amat_eta.png", False),
    ("train", "step", "images_per_sec", "images / s (all ranks; moves with the machine's load)", "throughput.png",
     False),
    ("eval", "epoch", "top1", "validation top-1 (%)", "top1.png", False),
    ("eval", "epoch", "top5", "validation top-5 (%)", "top5.png", False),
    ("eval", "epoch", "loss", "validation loss", "val_loss.png", True),
]

#: The panels drawn as steps (values set by a schedule, held between logged steps).
STEPWISE = ("lr", "amat_eta")


def write_report(run_dirs: Sequence[str | Path], out: str | Path) -> dict[str, Any]:
    """Write the plots and ``summary.md`` to ``out``; returns what was written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {Path(d): load_metrics(d) for d in run_dirs}
    written = []
    for kind, xkey, ykey, title, filename, logy in PANELS:
        series = {
            _label(d): ([r[xkey] for r in m.get(kind, []) if ykey in r], [r[ykey] for r in m.get(kind, []) if ykey in r])
            for d, m in runs.items()
        }
        series = {k: v for k, v in series.items() if v[0]}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
        # A schedule holds its value until the next logged step: drawn as steps, a drop is a drop, not a ramp.
        style = "steps-post" if ykey in STEPWISE else "default"
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, label=label, marker="o" if kind == "eval" else None, markersize=3, drawstyle=style)
        ax.set_xlabel(xkey)
        ax.set_title(title)
        if logy and all(y > 0 for _, ys in series.values() for y in ys):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / filename)
        plt.close(fig)
        written.append(str(out / filename))
    written += _monitor_plots(runs, out, plt)

    lines = ["| run | steps | final loss | final top-1 | best top-1 | final top-5 |", "|---|---|---|---|---|---|"]
    rows = {}
    for d, m in runs.items():
        train, evals = m.get("train", []), m.get("eval", [])
        row = {
            "steps": train[-1]["step"] if train else 0,
            "final_loss": train[-1]["loss"] if train else None,
            "final_top1": evals[-1]["top1"] if evals else None,
            "best_top1": max(e["top1"] for e in evals) if evals else None,
            "final_top5": evals[-1]["top5"] if evals else None,
        }
        rows[_label(d)] = row
        fmt = lambda v, p="{:.2f}": "–" if v is None else p.format(v)  # noqa: E731
        lines.append(f"| {_label(d)} | {row['steps']} | {fmt(row['final_loss'], '{:.4f}')} | {fmt(row['final_top1'])} | "
                     f"{fmt(row['best_top1'])} | {fmt(row['final_top5'])} |")
    plots = "\n".join(f"![{Path(p).stem}]({Path(p).name})" for p in written)
    (out / "summary.md").write_text("# Runs\n\n" + "\n".join(lines) + "\n\n" + plots + "\n")
    written.append(str(out / "summary.md"))
    return {"files": written, "runs": rows}


def _monitor_plots(runs: dict[Path, dict], out: Path, plt: Any) -> list[str]:
    """Theory monitors (distnorm.monitors): one panel per logged quantity."""
    written = []
    keys = sorted({k for m in runs.values() for r in m.get("monitor", []) for k in r
                   if k not in ("kind", "time", "step", "epoch", "layer")})
    for key in keys:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
        for d, m in runs.items():
            by_layer = defaultdict(list)
            for r in m.get("monitor", []):
                if key in r:
                    by_layer[r.get("layer", "")].append((r["step"], r[key]))
            for layer, points in sorted(by_layer.items()):
                xs, ys = zip(*points)
                ax.plot(xs, ys, label=f"{_label(d)} {layer}".strip(), linewidth=1)
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
        if len(ax.lines) <= 12:
            ax.legend(fontsize=6)
        fig.tight_layout()
        path = out / f"monitor_{key}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(str(path))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distnorm-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    parser.add_argument("--out", default=None, help="output directory (default: RUN_DIR/report for one run, ./report otherwise)")
    args = parser.parse_args(argv)
    out = args.out or (str(Path(args.runs[0]) / "report") if len(args.runs) == 1 else "report")
    try:
        result = write_report(args.runs, out)
    except FileNotFoundError as err:
        print(f"distnorm-report: error: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        if err.name is None or err.name.partition(".")[0] != "matplotlib":
            raise
        print(f"distnorm-report: error: the plots need the optional dependency {err.name!r}, which is not installed; "
              'install the [report] extra: pip install "distnorm[report]" (from a clone: pip install -e ".[report]")',
              file=sys.stderr)
        return 2
    for name, row in result["runs"].items():
        top1 = "–" if row["final_top1"] is None else f"{row['final_top1']:.2f}%"
        print(f"{name}: {row['steps']} steps, final top-1 {top1}")
    print(f"plots and summary: {out}/ ({len(result['files'])} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
