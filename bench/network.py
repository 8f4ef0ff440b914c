"""What the network costs: a data-parallel step across two simulated hosts with a shaped link.

    sudo .venv/bin/python bench/network.py --json bench/results/network-cpu.json [--quick]

Two hosts (tests/cluster.py: network namespaces joined by a bridge), 2 processes each
(torchrun, static rendezvous, gloo), the CIFAR ResNet-20 under DDP. For each link setting
— no shaping; `tc netem` delays of 0.2, 1 and 5 ms; rate limits of 10 Gbit/s, 1 Gbit/s and
100 Mbit/s (`tc tbf`) on every host's interface — it times one SGD step (median of
interleaved repeats) of:
local BatchNorm (the baseline), distnorm's synchronized BatchNorm, synced CBN, local BN +
BNP, and CBN synchronized per node only (``group_size=2``: the two processes of a host).

The step of a synchronized layer waits for two small all-reduces per layer (forward and
backward), so its cost grows with latency; per-node synchronization keeps those
all-reduces on the host. A delay of d ms on each host's interface adds about 2d to every
round trip between hosts. Settings whose qdisc this kernel lacks (``sch_netem`` is often not
built into container kernels) are reported as not measured, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS = ("local_bn", "syncbn", "cbn", "bnp", "cbn_per_node")
SETTINGS = {  # name: root qdisc on every host's eth0 (None: no shaping)
    "none": None,
    "0.2ms": "netem delay 0.2ms",
    "1ms": "netem delay 1ms",
    "5ms": "netem delay 5ms",
    "10gbit": "tbf rate 10gbit burst 1mb latency 50ms",
    "1gbit": "tbf rate 1gbit burst 256kb latency 50ms",
    "100mbit": "tbf rate 100mbit burst 64kb latency 200ms",
}
QUICK_SETTINGS = ("none", "1gbit")


def worker(out: str, steps: int, batch: int) -> None:
    """One rank: time a DDP step of every variant, interleaved; rank 0 writes the medians."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distnorm
    from distnorm import models

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    node_group, _ = dist.new_subgroups(group_size=local)

    def build(variant: str) -> nn.Module:
        torch.manual_seed(0)
        norm = {"syncbn": "bn", "cbn": "cbn", "cbn_per_node": "cbn"}.get(variant, "keep")
        model = models.create("resnet20", num_classes=10, norm=norm, activation=None,
                              **({"process_group": node_group} if variant == "cbn_per_node" else {}))
        if variant == "bnp":
            distnorm.bnp.attach(model)
        return model

    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (batch,), generator=gen)
    loss_fn = nn.CrossEntropyLoss()
    runs = {}
    for variant in VARIANTS:
        ddp = DDP(build(variant), **distnorm.ddp_kwargs())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        distnorm.set_lr(ddp, 0.005)

        def step(ddp=ddp, opt=opt):
            opt.zero_grad(set_to_none=True)
            loss_fn(ddp(x), y).backward()
            opt.step()

        step()  # warm-up
        runs[variant] = step
    times = {v: [] for v in VARIANTS}
    for _ in range(steps):
        for variant, step in runs.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            times[variant].append(time.perf_counter() - start)
    if rank == 0:
        medians = {v: statistics.median(t) * 1e3 for v, t in times.items()}
        Path(out).write_text(json.dumps({"world": world, "per_node": local, "median_step_ms": medians}))
    dist.destroy_process_group()


def drive(args) -> dict:
    from tests.cluster import Cluster, qdisc_available

    wanted = QUICK_SETTINGS if args.quick else tuple(SETTINGS)
    unavailable = {name: qdisc_available(SETTINGS[name]) for name in wanted if SETTINGS[name]}
    unavailable = {name: why for name, why in unavailable.items() if why}
    settings = [name for name in wanted if name not in unavailable]
    for name, why in unavailable.items():
        print(f"{name}: not measured ({SETTINGS[name].split()[0]}: {why})", flush=True)
    steps = args.steps or (3 if args.quick else 9)
    results = {}
    with Cluster(2) as cluster, tempfile.TemporaryDirectory() as tmp:
        head = cluster.hosts[0].name
        for i, name in enumerate(settings):
            for host in cluster.hosts:
                host.shape(SETTINGS[name])
            out = Path(tmp) / f"{name}.json"
            cmd = " ".join([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
                            "--node_rank=$NODE_RANK", f"--master_addr={head}", f"--master_port={29600 + i}",
                            str(Path(__file__).resolve()), "--worker", "--out", str(out), "--steps", str(steps),
                            "--batch", str(args.batch)])
            env_of = lambda h: {**os.environ, "NODE_RANK": str(h.index), "OMP_NUM_THREADS": "1",  # noqa: E731
                                "PYTHONPATH": str(REPO)}
            codes = cluster.run_everywhere(cmd, env_of=env_of, logs=Path(tmp), timeout=1200)
            if codes != [0, 0]:
                raise RuntimeError(f"{name}: exit codes {codes}\n" + (Path(tmp) / f"{head}.log").read_text()[-3000:])
            results[name] = json.loads(out.read_text())["median_step_ms"]
            print(name, {k: round(v, 1) for k, v in results[name].items()}, flush=True)
        for host in cluster.hosts:
            host.shape(None)
    ratios = {s: {v: r[v] / r["local_bn"] for v in VARIANTS} for s, r in results.items()}
    return {"benchmark": "network", "hosts": 2, "processes_per_host": 2, "model": "resnet20",
            "per_rank_batch": args.batch, "steps": steps, "qdisc": {s: SETTINGS[s] for s in settings},
            "not_measured": {s: f"{SETTINGS[s].split()[0]} unavailable: {why}" for s, why in unavailable.items()},
            "median_step_ms": results,
            "ratio_vs_local_bn": ratios}


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(payload["median_step_ms"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(VARIANTS)
    for k, variant in enumerate(VARIANTS):
        ax.bar([i + k * width for i in range(len(settings))], [payload["median_step_ms"][s][variant] for s in settings],
               width, label=variant)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(settings))], settings)
    ax.set_xlabel("link between the two hosts (tc qdisc on each host)")
    ax.set_ylabel("median step (ms)")
    ax.set_title("ResNet-20, 2 hosts x 2 processes (gloo)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--json")
    parser.add_argument("--plot", help="write the step time against delay as a PNG")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.out, args.steps, args.batch)
        return None
    payload = drive(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=1))
    if args.plot:
        plot(payload, Path(args.plot))
    print(json.dumps({s: {v: round(r, 3) for v, r in by.items()} for s, by in payload["ratio_vs_local_bn"].items()},
                     indent=1))  # rounded for reading; the JSON keeps full precision
    return payload


if __name__ == "__main__":
    main()
