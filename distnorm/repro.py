"""A scaled-down reproduction of paper 002's Table 1 / paper 001's Table 1 on the digits data.

    python -m distnorm.repro digits --out runs/repro [--seeds 3] [--epochs 8] [--workers 2]
    python -m distnorm.repro digits --out runs/repro --publish docs/results     # also copy table + figures
    python -m distnorm.repro digits --out /tmp/r --quick                         # a smoke-test budget

The CIFAR-style ResNet-20 of :mod:`distnorm.models`, built with each normalization —
``bn`` (BatchNorm after each conv), ``cbn`` (complete BN with AMAT before each conv),
``popnorm`` and ``bnp_gn`` (GroupNorm + BNP) — and each of the papers' five activations
(sigmoid, tanh, relu, selu, swish), trained from several seeds with the same small budget:
SGD momentum 0.9, weight decay 5e-4, batch 64, lr 0.1 divided by 10 at 50 % and 75 % of the
epochs (so AMAT's eta turns on after the first decay), random 2-pixel shifts. Every model
goes through ``distnorm.models.create`` → ``distnorm.convert`` (and ``distnorm.bnp.attach``),
the code users run. One process per run, ``--workers`` runs at a time, one thread each.

Writes ``results.json`` (every run: final / best test accuracy, training loss per epoch),
``table.md`` (mean ± std test accuracy per normalization × activation) and
``loss_curves.png`` (mean training loss per epoch, one panel per activation).
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Sequence

import torch
from PIL import Image
from torch import nn

import distnorm
from distnorm import models
from distnorm.data.sources import DigitsSource

__all__ = ["NORMS", "ACTIVATIONS", "run_one", "main"]

NORMS = ("bn", "cbn", "popnorm", "bnp_gn")
ACTIVATIONS = ("sigmoid", "tanh", "relu", "selu", "swish")
BATCH = 64


def load_digits_tensors(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The demo digits as normalized (N, 3, 32, 32) float tensors, decoded from their JPEGs."""
    source = DigitsSource(split)
    images = torch.stack([
        torch.frombuffer(bytearray(Image.open(io.BytesIO(source.jpeg(i))).convert("RGB").tobytes()), dtype=torch.uint8)
        .view(32, 32, 3).permute(2, 0, 1)
        for i in range(len(source))
    ]).float().div(255.0).sub(0.5).div(0.5)
    labels = torch.tensor([source.label(i) for i in range(len(source))])
    return images, labels


def _shift(images: torch.Tensor, gen: torch.Generator, pad: int = 2) -> torch.Tensor:
    """Random translations by up to ``pad`` pixels (zero padding), per sample."""
    n, _, h, w = images.shape
    padded = nn.functional.pad(images, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=gen)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=gen)
    return torch.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])


def build_model(norm: str, activation: str) -> nn.Module:
    if norm == "bnp_gn":
        model = models.create("resnet20", num_classes=10, norm="gn", activation=activation,
                              norm_kwargs={"num_groups": 8})
        distnorm.bnp.attach(model)
        return model
    return models.create("resnet20", num_classes=10, norm=norm, activation=activation)


def run_one(norm: str, activation: str, seed: int, epochs: int, train_limit: int | None = None) -> dict[str, Any]:
    """Train one configuration; returns its record (runs in a worker process)."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    x_train, y_train = load_digits_tensors("train")
    x_val, y_val = load_digits_tensors("val")
    if train_limit:
        x_train, y_train = x_train[:train_limit], y_train[:train_limit]
    model = build_model(norm, activation)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    steps_per_epoch = len(x_train) // BATCH
    milestones = [int(epochs * steps_per_epoch * f) for f in (0.5, 0.75)]
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones, gamma=0.1)
    gen = torch.Generator().manual_seed(seed)
    losses, accuracies = [], []
    started = time.time()
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(x_train), generator=gen)
        total, count = 0.0, 0
        for b in range(steps_per_epoch):
            idx = order[b * BATCH:(b + 1) * BATCH]
            distnorm.set_lr(model, opt.param_groups[0]["lr"])
            loss = nn.functional.cross_entropy(model(_shift(x_train[idx], gen)), y_train[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() if torch.isfinite(loss) else float("nan")
            count += 1
        losses.append(total / max(count, 1))
        model.eval()
        with torch.no_grad():
            correct = sum(int((model(x_val[i:i + 180]).argmax(1) == y_val[i:i + 180]).sum()) for i in range(0, len(x_val), 180))
        accuracies.append(100.0 * correct / len(x_val))
    return {"norm": norm, "activation": activation, "seed": seed, "epochs": epochs, "train_loss": losses,
            "test_accuracy": accuracies, "final_accuracy": accuracies[-1], "best_accuracy": max(accuracies),
            "seconds": time.time() - started}


def _diverged(run: dict[str, Any]) -> bool:
    return any(not (v == v) or v > 1e3 for v in run["train_loss"])  # NaN or exploded


def _cell(runs: list[dict[str, Any]]) -> str:
    values = [r["final_accuracy"] for r in runs]
    text = f"{values[0]:.1f}" if len(values) == 1 else f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"
    diverged = sum(_diverged(r) for r in runs)
    return text + (f" ({diverged} of {len(runs)} diverged)" if diverged else "")


def summarize(runs: list[dict[str, Any]], out: Path, command: str) -> str:
    norms = [n for n in NORMS if any(r["norm"] == n for r in runs)]
    acts = [a for a in ACTIVATIONS if any(r["activation"] == a for r in runs)]
    seeds = sorted({r["seed"] for r in runs})
    epochs = runs[0]["epochs"]
    lines = [
        "| normalization | " + " | ".join(acts) + " |",
        "|---|" + "---|" * len(acts),
    ]
    for norm in norms:
        cells = [_cell([r for r in runs if r["norm"] == norm and r["activation"] == a]) for a in acts]
        lines.append(f"| {norm} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    text = (f"Final test accuracy (%) on the 360 digits validation images, ResNet-20, {epochs} epochs, "
            f"mean ± std over seeds {seeds} (a diverged run — NaN or exploding training loss — counts with "
            f"its final accuracy).\nCommand: `{command}`\n\n{table}\n")
    (out / "table.md").write_text(text)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(acts), figsize=(3.2 * len(acts), 3.0), dpi=110, sharey=True, squeeze=False)
    for ax, act in zip(axes[0], acts):
        for norm in norms:
            # The median over seeds: one diverged seed must not hide the others.
            curves = [[v if v == v else float("inf") for v in r["train_loss"]]
                      for r in runs if r["norm"] == norm and r["activation"] == act]
            median = [statistics.median(step) for step in zip(*curves)]
            ax.plot(range(1, len(median) + 1), median, label=norm, marker="o", markersize=2)
        ax.set_title(act)
        ax.set_xlabel("epoch")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training loss (median over seeds)")
    for ax in axes[0]:
        ax.set_ylim(top=5.0)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png")
    plt.close(fig)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distnorm.repro", description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", choices=["digits"])
    parser.add_argument("--out", default="runs/repro")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--norms", nargs="*", default=list(NORMS), choices=NORMS)
    parser.add_argument("--activations", nargs="*", default=list(ACTIVATIONS), choices=ACTIVATIONS)
    parser.add_argument("--quick", action="store_true", help="1 seed, relu and tanh, 1 epoch on 256 images")
    parser.add_argument("--publish", default=None, help="also copy table.md and loss_curves.png into this directory")
    parser.add_argument("--from-results", default=None, help="re-summarize an earlier results.json instead of training")
    args = parser.parse_args(argv)
    if args.from_results:
        saved = json.loads(Path(args.from_results).read_text())
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        if Path(args.from_results).resolve() != (out / "results.json").resolve():
            (out / "results.json").write_text(json.dumps(saved, indent=1))
        print(summarize(saved["runs"], out, saved["command"]))
        _publish(out, args.publish)
        return 0
    seeds, epochs, acts, limit = args.seeds, args.epochs, args.activations, None
    if args.quick:
        seeds, epochs, acts, limit = 1, 1, ["relu", "tanh"], 256
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(n, a, s, epochs, limit) for a in acts for n in args.norms for s in range(seeds)]
    started = time.time()
    runs = []
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=get_context("spawn")) as pool:
        for record in pool.map(run_one, *zip(*jobs)):
            runs.append(record)
            print(f"{record['norm']:8s} {record['activation']:8s} seed {record['seed']}: "
                  f"{record['final_accuracy']:.1f}% ({record['seconds']:.0f}s)", flush=True)
    command = "python -m distnorm.repro " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / "results.json").write_text(json.dumps({"command": command, "seconds": time.time() - started, "runs": runs},
                                                 indent=1))
    print(summarize(runs, out, command))
    print(f"{len(runs)} runs in {time.time() - started:.0f}s -> {out}/results.json, table.md, loss_curves.png")
    _publish(out, args.publish)
    return 0


def _publish(out: Path, dest: str | None) -> None:
    if dest:
        Path(dest).mkdir(parents=True, exist_ok=True)
        for name, target in (("table.md", "repro_digits_table.md"), ("loss_curves.png", "repro_digits_loss_curves.png"),
                             ("results.json", "repro_digits_results.json")):
            shutil.copy(out / name, Path(dest) / target)


if __name__ == "__main__":
    sys.exit(main())
