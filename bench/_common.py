"""Shared helpers for the benchmark scripts: machine description, interleaved timing with
medians, JSON output. Every script compares against a baseline measured in the same run."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import tempfile
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python bench/x.py` from a checkout, without installing
    sys.path.insert(0, str(REPO))


# glibc returns large freed blocks to the OS and maps them again on the next allocation;
# the resulting page faults (tens of thousands per step for 25 MB activations) swamp the
# differences being measured and make them depend on allocation order. Production setups
# avoid this with jemalloc/tcmalloc (and on GPU the caching allocator); the benchmarks keep
# freed memory in the process instead, identically for every variant and the baseline.
STABLE_MALLOC = {
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TOP_PAD_": str(256 << 20),
}


def use_stable_allocator() -> None:
    """Re-execute this script once with :data:`STABLE_MALLOC` in the environment."""
    if sys.platform.startswith("linux") and any(os.environ.get(k) != v for k, v in STABLE_MALLOC.items()):
        env = {**os.environ, **STABLE_MALLOC}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def machine() -> dict:
    """What the figures were measured on."""
    info = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "malloc_env": {k: os.environ.get(k) for k in STABLE_MALLOC},
    }
    return info


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(fns: dict[str, Callable[[], None]], repeats: int, device: torch.device,
                        warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each function, timed round-robin so that machine noise
    (other tenants, frequency changes) hits every variant alike."""
    return {name: statistics.median(ts) for name, ts in interleaved_times(fns, repeats, device, warmup).items()}


def ratio_spread(times: dict[str, list[float]], base: str) -> dict[str, list[float]]:
    """Each variant's per-round ratio to ``base`` (the same round of an interleaved run) as
    ``[25th percentile, median, 75th percentile]``: how far the load moved the ratio."""
    def quartiles(values: list[float]) -> list[float]:
        return statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3

    return {name: quartiles([t / b for t, b in zip(ts, times[base])]) for name, ts in times.items() if name != base}


def interleaved_times(fns: dict[str, Callable[[], None]], repeats: int, device: torch.device,
                      warmup: int = 2, before: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Seconds of every call of each function, timed round-robin (round ``i`` of each list
    ran together). Each round starts one function later than the one before (round ``i``
    runs them from the ``i mod k``-th on): which function runs after which changes what
    the caches and the allocator hand it, for memory-bound layers on the CPU more than the
    layers differ, so no function keeps one neighbour (``docs/reference/benchmarks.md``).
    ``before``: run, untimed, before each timed call (e.g. evicting the caches)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            fn = fns[name]
            if before is not None:
                before()
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return times


def shown(value: Any, digits: int = 3) -> Any:
    """``value`` with every float in it rounded to ``digits`` decimals, for printing.

    The JSON the scripts write keeps every figure at full precision, so that what a reader
    or a test computes from it (images/s from a step time, a ratio from two medians) is exact;
    only what is printed for people is rounded, here or in a format string."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: shown(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(shown(v, digits) for v in value)
    return value


def write_json(path: str | None, payload: dict) -> None:
    text = json.dumps(payload, indent=2, sort_keys=False)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
        print(f"wrote {path}")


def training_memory_bytes(model, optimizer, compute_loss, device: torch.device) -> int:
    """Memory one training step needs (runs one step: forward, backward, optimizer step).

    CUDA: the peak allocated during the step above what was allocated before it. CPU (no
    allocator statistics): an exact account of what training keeps — parameters, buffers,
    gradients, optimizer state, and the distinct storages autograd saves for backward —
    which excludes transient temporaries of the backward pass.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        optimizer.zero_grad(set_to_none=True)
        compute_loss().backward()
        optimizer.step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    optimizer.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compute_loss()
    loss.backward()
    optimizer.step()
    kept = [*model.parameters(), *model.buffers()]
    kept += [p.grad for p in model.parameters() if p.grad is not None]
    kept += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum(storages.values()) + sum(t.numel() * t.element_size() for t in kept)


def run_ranks(target: Callable[..., None], world_size: int, *args: Any, inline: bool = False,
              timeout: float = 3600) -> Any:
    """``target(rank, world_size, store, *args, queue)`` on ``world_size`` ranks of a real gloo
    group (each a spawned process; ``store``: a file under a temporary directory); the first
    result a rank puts on ``queue``. ``inline`` (the scripts' ``--quick``): this process is rank
    0 and only the others are spawned -- one interpreter and ``import torch`` fewer; each rank
    builds its own models and layers, so what it counts is the same."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store, queue = str(Path(tmp) / "store"), ctx.Queue()
        procs = [ctx.Process(target=target, args=(r, world_size, store, *args, queue))
                 for r in range(1 if inline else 0, world_size)]
        for p in procs:
            p.start()
        if inline:
            threads = torch.get_num_threads()  # the rank sets its own threads: this process's back after
            try:
                target(0, world_size, store, *args, queue)
            except BaseException:
                for p in procs:
                    p.kill()  # not left waiting for a rank 0 that is gone
                raise
            finally:
                torch.set_num_threads(threads)
        result = queue.get(timeout=timeout)
        for p in procs:
            p.join(timeout=120)
    return result
