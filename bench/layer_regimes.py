"""What the order of a layer benchmark decides: one shape, three ways of timing the same steps.

    python bench/layer_regimes.py --json bench/results/layer-regimes-cpu.json [--threads 1] [--quick]

A training step (forward + backward) of ``nn.BatchNorm2d``, CBN (AMAT history), POP-Norm and
SyncBatchNorm on one input, median milliseconds and the ratio to BatchNorm2d, timed

* ``back_to_back``: each layer's steps in a row, one layer after the other;
* ``rotated``: interleaved rounds, each starting one layer later (``bench/layers.py``'s way);
* ``evicted``: ``rotated`` with a write of four times the last-level cache before each step
  (untimed), so every step starts from memory, whatever ran before it.

On the CPU at memory-bound shapes the three disagree by more than the layers differ (the
benchmarks page, "Channels-last CBN"): which data the caches and the allocator hold when a
step starts is part of what a layer benchmark measures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _common import interleaved_times, machine, use_stable_allocator, write_json  # noqa: I001  (sets sys.path)
from layers import LR, layer_steps, make_layers


def _summary(times: dict[str, list[float]]) -> dict:
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"median_ms": {k: v * 1e3 for k, v in medians.items()},
            "ratio_vs_batchnorm2d": {k: v / medians["batchnorm2d"] for k, v in medians.items()}}


def measure(shape: tuple[int, ...], channels_last: bool, repeats: int, evict_bytes: int) -> dict:
    cpu = torch.device("cpu")
    layers = make_layers(shape[1], cpu)
    del layers["naive_cbn"]  # the test reference: bench/layers.py times it
    steps, _, _ = layer_steps(layers, shape, channels_last, cpu)
    back_to_back = {}
    for name, fn in steps.items():
        fn(), fn()  # warm-up
        back_to_back[name] = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            back_to_back[name].append(time.perf_counter() - start)
    scratch = torch.empty(evict_bytes, dtype=torch.uint8)
    return {
        "shape": list(shape), "memory_format": "channels_last" if channels_last else "contiguous",
        "repeats": repeats, "evict_bytes": evict_bytes,
        "back_to_back": _summary(back_to_back),
        "rotated": _summary(interleaved_times(steps, repeats, cpu)),
        "evicted": _summary(interleaved_times(steps, repeats, cpu, before=lambda: scratch.fill_(1))),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (default 1)")
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--contiguous", action="store_true", help="the contiguous layout, not channels_last")
    parser.add_argument("--evict-mib", type=int, default=128, help="bytes written before each evicted step (MiB)")
    parser.add_argument("--quick", action="store_true", help="a tiny shape, 3 repeats (for tests)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape, repeats = ((4, 8, 6, 6), 3) if args.quick else ((32, 64, 56, 56), args.repeats)
    payload = {"benchmark": "layer_regimes", "machine": machine(), "threads": args.threads, "lr": LR,
               **measure(shape, not args.contiguous, repeats, args.evict_mib << 20)}
    for regime in ("back_to_back", "rotated", "evicted"):
        print(f"{regime:>12}: " + ", ".join(f"{k} {v:.3f}x" for k, v in payload[regime]["ratio_vs_batchnorm2d"].items()))
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    use_stable_allocator()
    main()
