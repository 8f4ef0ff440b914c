"""A small spawn helper for real multi-process tests on CPU (gloo).

``run_distributed(fn, world_size, tmp_path, *args)`` starts ``world_size`` processes that
each join a gloo process group through a ``FileStore`` in ``tmp_path`` (loopback only),
call ``fn(rank, world_size, *args)`` and send back its result. Any rank's exception is
re-raised in the test with that rank's traceback, and the other ranks are killed at once;
a deadline bounds the whole run, so a hang fails the test instead of the suite.

Children come from a fork server that has imported torch (and ``torch._dynamo``, which DDP
imports) once, so each test pays process start-up in milliseconds, not seconds. ``fn`` must
be a module-level function.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

_CTX = mp.get_context("forkserver")
# torch._dynamo too: DistributedDataParallel's constructor reads
# torch._dynamo.utils.get_optimize_ddp_mode() (torch/nn/parallel/distributed.py), which
# imports it in every rank that wraps a model (tests/README.md, "CPU seconds", has its cost);
# imported once in the server, the children inherit it. (`import distnorm` is lazy: it preloads nothing else.)
_CTX.set_forkserver_preload(["torch", "torch._dynamo", "distnorm"])


def _child(fn: Callable, rank: int, world_size: int, store_path: str, results: Any,
           args: tuple, kwargs: dict, timeout: float, backend: str) -> None:
    try:
        # A rank started by torchrun is an ordinary process whose DataLoader workers fork;
        # children of a fork server would otherwise inherit "forkserver" and re-import torch.
        mp.set_start_method("fork", force=True)
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        value = fn(rank, world_size, *args, **kwargs)
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, tmp_path: Path, *args: Any,
                    timeout: float = 120.0, backend: str = "gloo", **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks (gloo, or
    ``backend="nccl"`` with one GPU per rank).

    Returns the per-rank return values (rank order). Raises ``AssertionError`` with the
    failing rank's traceback, or ``TimeoutError`` naming the ranks that did not finish.
    """
    store_path = str(Path(tmp_path) / f"store-{os.getpid()}-{time.monotonic_ns()}")
    results = _CTX.Queue()
    procs = [
        _CTX.Process(target=_child, args=(fn, r, world_size, store_path, results, args, kwargs, timeout, backend),
                     daemon=False)  # ranks may start DataLoader workers of their own
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            try:
                rank, status, payload = results.get(timeout=max(remaining, 0.01))
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(outputs))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f}s") from None
            if status == "error":
                raise AssertionError(f"rank {rank} of {world_size} failed:\n{payload}")
            outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5 if len(outputs) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [outputs[r] for r in range(world_size)]
