"""Where one training step's time goes, per variant: the host (Python, dispatch, kernel
launches) or the device (kernels), and which operators and kernels cost the most.

    python bench/profile_step.py --json bench/results/profile-gpu.json              # ResNet-50, on CUDA
    python bench/profile_step.py --smoke --device cpu                               # tiny, for the tests

The step is ``bench/step_gpu.py``'s (SGD, bf16 autocast, channels_last unless
``--memory-format contiguous``; the variants built by ``bench/step.py``'s ``build``), eager,
one process. Each variant is warmed up, then three
figures are taken per step, from separate steps so that the profiler's own cost stays out
of the first two:

* ``wall_ms``: the step, synchronized (median of ``--repeats``);
* ``host_ms``: the same step with the device left running (the host's time to issue its
  work: on CUDA the launches are asynchronous, so when ``host_ms`` is close to ``wall_ms``
  the step is bound by the host, not by the GPU; on the CPU both are the whole step);
* from one profiled step (``torch.profiler``, CPU + CUDA activities): ``device_kernel_ms``
  (the sum of every kernel's time; on CUDA its gap to ``wall_ms`` is time the GPU waits for
  the host), ``kernels`` (how many were launched), and the ``--top`` operators by self host
  time and the ``--top`` kernels by device time, each with its calls per step.

A variant whose ``device_kernel_ms`` is close to local BN's but whose ``wall_ms`` is not is
paying in the host, and the operator table says where.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from _common import machine, synchronize, write_json  # noqa: I001  (sets sys.path)
from step_gpu import MEMORY_FORMATS, NUM_CLASSES, VARIANTS, make_step
from step import build

from distnorm import models

FULL = {"models": ["resnet50"], "batch": 256, "size": 224, "repeats": 10}
SMOKE = {"models": ["resnet20"], "batch": 2, "size": 32, "repeats": 2}


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", choices=models.available(), help=f"default {FULL['models']}")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["local_bn", "syncbn", "cbn"])
    parser.add_argument("--batch", type=int)
    parser.add_argument("--size", type=int)
    parser.add_argument("--repeats", type=int, help="timed steps per figure (median)")
    parser.add_argument("--top", type=int, default=12, help="rows of each table")
    parser.add_argument("--no-amp", dest="amp", action="store_false", help="float32 instead of bf16 autocast")
    parser.add_argument("--memory-format", choices=MEMORY_FORMATS, default="channels_last",
                        help="the layout of the models and the batch, default channels_last")
    parser.add_argument("--smoke", action="store_true", help=f"tiny run for the tests: {SMOKE}")
    return parser


def _kernel_us(event) -> float:
    """A kernel event's time on the device (torch >= 2.4 names it ``device_time_total``)."""
    return float(getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0))


def profile_variant(step, device: torch.device, repeats: int, top: int) -> dict:
    walls, hosts = [], []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        step()
        hosts.append(time.perf_counter() - start)
        synchronize(device)
        walls.append(time.perf_counter() - start)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        step()
        synchronize(device)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_kernel: dict[str, list[float]] = {}
    for e in kernels:
        by_kernel.setdefault(e.name, []).append(_kernel_us(e))
    top_kernels = sorted(by_kernel.items(), key=lambda kv: sum(kv[1]), reverse=True)[:top]
    return {
        "wall_ms": statistics.median(walls) * 1e3,
        "host_ms": statistics.median(hosts) * 1e3,
        # the kernels themselves: the operator table would count each twice (under its op and as itself)
        "device_kernel_ms": sum(map(_kernel_us, kernels)) / 1e3 if device.type == "cuda" else None,
        "kernels": len(kernels) if device.type == "cuda" else None,
        "host_ops": [{"op": e.key, "self_host_ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in ops],
        "device_kernels": [{"kernel": name[:120], "device_ms": sum(ts) / 1e3, "calls": len(ts)}
                           for name, ts in top_kernels],
    }


def main(argv=None) -> dict:
    args = get_args_parser().parse_args(argv)
    for key, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    payload = {"benchmark": "profile_step", "machine": machine(), "device": str(device),
               "config": {"batch": args.batch, "size": args.size, "repeats": args.repeats, "amp": args.amp,
                          "channels_last": args.memory_format == "channels_last", "smoke": args.smoke},
               "models": {}}
    gen = torch.Generator().manual_seed(0)
    for name in args.models:
        layout = MEMORY_FORMATS[args.memory_format]
        x = torch.randn(args.batch, 3, args.size, args.size, generator=gen).to(device, memory_format=layout)
        y = torch.randint(0, NUM_CLASSES, (args.batch,), generator=gen).to(device)
        results = payload["models"][name] = {}
        for variant in args.variants:
            model = build(name, variant, num_classes=NUM_CLASSES).to(device, memory_format=layout)
            step = make_step(model, model, x, y, args.amp)
            for _ in range(3):  # lazy state, cudnn's autotuning, Triton's compiles
                step()
            synchronize(device)
            r = results[variant] = profile_variant(step, device, args.repeats, args.top)
            kernel_ms = "n/a" if r["device_kernel_ms"] is None else f"{r['device_kernel_ms']:.2f}"
            print(f"{name} {variant}: wall {r['wall_ms']:.2f} ms, host {r['host_ms']:.2f} ms, "
                  f"device kernels {kernel_ms} ms in {r['kernels']} kernels", flush=True)
            print("  host ops:", ", ".join(f"{o['op']} {o['self_host_ms']:.3f}ms/{o['calls']}" for o in r["host_ops"]))
            print("  kernels:", ", ".join(f"{k['kernel'][:60]} {k['device_ms']:.3f}ms/{k['calls']}"
                                          for k in r["device_kernels"]), flush=True)
            del model, step
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
