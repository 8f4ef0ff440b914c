"""The host's cost of one layer's training step: Python, dispatch and kernel launches.

    python bench/host_cost.py --json bench/results/host-cost-gpu.json --profile cbn
    python bench/host_cost.py --device cpu --iters 50 --rounds 3          # the CPU, for the tests
    python bench/host_cost.py --replay                                    # ops against the rest

On a GPU a layer whose step issues its kernels slower than the GPU runs them makes the
whole training step wait for the host (``bench/profile_step.py`` shows when that happens).
This times ``bench/layers.py``'s layers (``nn.BatchNorm2d``, CBN, POP-Norm, distnorm's
SyncBatchNorm, one process) on an input small enough that the device's work is negligible:
``--iters`` forward + backward steps issued back to back, synchronized once at the end, so
the figure per step is the host's (on the CPU, the whole step at a tiny size). Median of
``--rounds`` interleaved rounds. ``--profile LAYER`` also runs that layer's steps under
``cProfile`` and lists the Python functions that take the most time of their own
(``--top``), which names where the host time goes (distnorm's code, torch's dispatch,
Triton's launcher). On CUDA each layer's step also runs once under
``torch.cuda.set_sync_debug_mode("error")``: ``host_syncs`` names the first operation that
waits for the GPU, or ``"none"``.

``--replay`` splits each layer's step into the operators it dispatches and the rest: it
records the step's dispatcher-level operators once (a ``TorchDispatchMode``: the ATen
calls and distnorm's own operators, each one call however many kernels it launches) and
times them called again alone, with the same arguments, in the same interleaved rounds.
``ops_us`` is that; ``rest_us = step - ops`` is what the step costs beyond its operators'
own dispatch and launches (Python, the autograd engine, the layer's host logic); ``per_op_us``
times each operator alone. Calling the recorded operators again updates the buffers they
update (the statistics), which changes no figure here.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _common import machine, shown, synchronize, write_json  # noqa: I001  (sets sys.path)
from layers import layer_steps, make_layers

LAYERS = ("batchnorm2d", "cbn", "popnorm", "syncbn")


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", type=int, nargs=4, default=[8, 64, 8, 8], metavar=("N", "C", "H", "W"))
    parser.add_argument("--iters", type=int, default=200, help="steps per round")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median)")
    parser.add_argument("--profile", choices=LAYERS, action="append", default=[],
                        help="list this layer's costliest Python functions (repeatable)")
    parser.add_argument("--top", type=int, default=25, help="rows of each profile")
    parser.add_argument("--replay", action="store_true",
                        help="also time each step's dispatched operators called again alone (ops_us, rest_us)")
    return parser


def host_us(step, iters: int, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    synchronize(device)
    return (time.perf_counter() - start) / iters * 1e6


def first_host_sync(step, device: torch.device) -> str | None:
    """``"none"``, or the error CUDA's sync debug mode raises at the step's first host sync;
    None off CUDA."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError as err:
        return str(err).splitlines()[0][:300]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return "none"


class _Recorder(TorchDispatchMode):
    """The dispatcher-level operators a step calls, with their arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def recorded_ops(step) -> list[tuple]:
    """``(op, args, kwargs)`` of every operator one call of ``step`` dispatches, in order."""
    with _Recorder() as recorder:
        step()
    return recorder.calls


def replay(calls: list[tuple]):
    """A function that calls ``calls`` again, in order."""
    def run() -> None:
        for func, args, kwargs in calls:
            func(*args, **kwargs)
    return run


def python_profile(step, iters: int, top: int) -> list[dict]:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(iters):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = []
    for (path, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = path.split("site-packages/")[-1].split("/work/main/")[-1]
        rows.append({"function": f"{where}:{line}({name})", "calls_per_step": calls / iters,
                     "own_us_per_step": tottime / iters * 1e6, "cumulative_us_per_step": cumtime / iters * 1e6})
    return sorted(rows, key=lambda r: r["own_us_per_step"], reverse=True)[:top]


def main(argv=None) -> dict:
    args = get_args_parser().parse_args(argv)
    device = torch.device(args.device)
    layers = {name: layer for name, layer in make_layers(args.shape[1], device).items() if name in LAYERS}
    steps, _, _ = layer_steps(layers, args.shape, channels_last=True, device=device)
    for step in steps.values():  # Triton's compiles, the kernel votes, lazy state
        for _ in range(5):
            step()
    # --replay: each step's operators, all together and one by one, timed in the same rounds
    calls = {name: recorded_ops(step) for name, step in steps.items()} if args.replay else {}
    timed = dict(steps)
    timed.update({("ops", name): replay(ops) for name, ops in calls.items()})
    timed.update({("op", name, i): replay([op]) for name, ops in calls.items() for i, op in enumerate(ops)})
    times: dict = {key: [] for key in timed}
    for r in range(args.rounds):
        order = list(timed)[r % len(timed):] + list(timed)[:r % len(timed)]
        for key in order:
            times[key].append(host_us(timed[key], args.iters, device))
    medians = {key: statistics.median(ts) for key, ts in times.items()}
    base = medians["batchnorm2d"]
    replayed = {name: {"ops": len(ops), "ops_us": medians["ops", name], "rest_us": medians[name] - medians["ops", name],
                       "per_op_us": [[str(op[0]), medians["op", name, i]] for i, op in enumerate(ops)]}
                for name, ops in calls.items()}
    payload = {"benchmark": "host_cost", "machine": machine(), "device": str(device),
               "config": {"shape": args.shape, "channels_last": True, "iters": args.iters, "rounds": args.rounds,
                          "replay": args.replay},
               "us_per_step": {k: medians[k] for k in steps},
               "extra_us_vs_batchnorm2d": {k: medians[k] - base for k in steps},
               "host_syncs": {name: first_host_sync(step, device) for name, step in steps.items()},
               "replay": replayed,
               "profiles": {}}
    print(f"host us per forward+backward, {tuple(args.shape)} channels_last on {device}: {shown(payload['us_per_step'], 1)}")
    print(f"first host sync per step: {payload['host_syncs']}")
    for name, r in replayed.items():
        print(f"{name}: its {r['ops']} operators alone {r['ops_us']:.1f} us, the rest {r['rest_us']:.1f} us; "
              + ", ".join(f"{op} {us:.1f}" for op, us in r["per_op_us"]))
    for name in args.profile:
        rows = payload["profiles"][name] = python_profile(steps[name], args.iters, args.top)
        print(f"{name}: costliest Python functions (own us per step, calls per step)")
        for row in rows:
            print(f"  {row['own_us_per_step']:8.2f} {row['calls_per_step']:6.2f}  {row['function']}")
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
