"""What synchronization costs at scale: a latency model, and a check of it on simulated hosts.

    sudo .venv/bin/python bench/scale.py --json bench/results/scale-cpu.json --plot docs/scale.png
    .venv/bin/python bench/scale.py --predict-only --json /tmp/scale.json   # the model alone
    .venv/bin/python bench/scale.py --quick --loopback --json /tmp/q.json   # what the tests run

A synchronized normalization layer waits, per training step, for two small all-reduces: the
forward statistics (3 C float64: sums, squares, counts) and the backward sums (2 C float32).
Both sit on the critical path: the layer's output, or its input gradient, needs the result.
So a step spends about ``sum over collectives of t_allreduce(bytes, group)`` waiting, and
``sync_group_size`` decides the group: its size, and whether it leaves the node.

**Predict** (no processes; :func:`predict`): the layers and channels of ResNet-50 and
EfficientNet-B0 counted from the zoo's torchvision models, each all-reduce timed with NCCL's
own cost model (``src/graph/tuning.cc`` of NVIDIA/nccl: base + per-hop latencies of the tree
and ring algorithms with the LL protocol, plus bytes over the LL bandwidth caps; tree latency
grows with log2 of the nodes, ring latency with the ranks), 8 GPUs per node, and a compute
step from NVIDIA's published single-GPU training throughput (A100 80GB, AMP) times an assumed
H100 speed-up. The share of a step spent waiting, per world size and ``sync_group_size``.

**Measure** (root: the simulated hosts of ``tests/cluster.py``, as ``bench/network.py``):
2 hosts x {1, 2, 4} gloo processes (2, 4, 8 ranks) under each link setting (``tc tbf``: this
kernel has no ``sch_netem``, so a link's delay comes from its rate -- a message of n bytes
waits 8n/rate on each host's interface). In each run: the median time of one all-reduce of
8 B .. 64 KiB over all ranks and within a host; the median DDP step of the CIFAR ResNet-20
with local BatchNorm, BatchNorm synchronized over all ranks, and per host; distnorm's
collectives of one step, counted. The check: the synchronization time the same model
predicts (each counted collective timed by the alpha-beta fit of the all-reduce
measurements) against the measured difference of the synchronized and the local step.
``--loopback``: the ranks on this machine's loopback instead (no root needed; one "host").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# ----------------------------------------------------------------------------- the model
#: NCCL's cost model for all-reduce (microseconds, GB/s), from ``src/graph/tuning.cc`` of
#: NVIDIA/nccl at commit b6475625fbcaa2c3c0e50eed2fa1255d7514d4a2 (the Hopper-aware tables).
#: Small messages run with the LL protocol: LL128 and Simple start from higher base latencies
#: (14.0 and 8.4 us) and the NVLS algorithms from 23 us, so they lose below ~64 KiB.
NCCL = {
    "source": "NVIDIA/nccl src/graph/tuning.cc @ b6475625fbcaa2c3c0e50eed2fa1255d7514d4a2",
    "base_us": {"tree": 6.8, "ring": 6.6},  # baseLat, LL
    "nvlink_hop_us": {"tree": 0.6, "ring": 0.6},  # hwLat[NVLINK], LL
    "net_hop_us": {"tree": 5.0, "ring": 2.7},  # hwLat[NET], LL (graph latencyInter taken as 0)
    "net_overhead_us": 1.0,  # getNetOverhead, x86 Intel: a ring step that leaves the node
    # LL bandwidth caps (llMaxBws): Hopper in one node; x86 Intel with 2, and > 2 nodes.
    # The model takes min(nChannels * bw / 4 (ring) or / 3.8 (tree), cap): assumed at the cap.
    "ll_max_bw_gbs": {"1": 87.7, "2": 39.0, "more": 20.4},
    "tree_bw_ratio": 0.5,  # bus -> algorithm bandwidth, tree
}
GPUS_PER_NODE = 8
#: What a synchronized layer sends per step: two frames (distnorm/_frames.py), each one
#: float64 all-reduce of the widest layer's forward payload (3 C_max: sum, sum of squares,
#: count) and 2 header entries per rank of the group (every rank's fingerprint), whatever
#: the layer's own C -- as tests/test_branches.py counts them.
FRAME_ROWS = 3
FRAME_HEADER_PER_RANK = 2
FLOAT64_BYTES = 8
#: One A100 80GB, AMP, images/s (NVIDIA DeepLearningExamples, PyTorch, pytorch-21.03 NGC):
#: PyTorch/Classification/ConvNets/resnet50v1.5/README.md and .../efficientnet/README.md,
#: "Training performance: NVIDIA DGX A100 (8x A100 80GB)", 1 GPU, mixed precision.
A100_IMAGES_PER_S = {"resnet50": 2470.0, "efficientnet_b0": 2489.0}
#: An assumption, not a citation: an H100 SXM trains these convnets 2x as fast as an A100.
H100_OVER_A100 = 2.0
WORLDS = (8, 64, 256, 1024)
GROUPS = (1, 2, 4, 8, 16, 64, 256, 1024)
BATCHES = (32, 128, 256)  # per GPU; 32: the ImageNet recipes' 256 on 8 GPUs
THRESHOLD = 0.05


def nccl_allreduce_us(nbytes: float, ranks: int, per_node: int = GPUS_PER_NODE) -> tuple[float, str]:
    """NCCL's predicted time of one all-reduce of ``nbytes`` over ``ranks`` GPUs (``per_node``
    on each node), LL protocol, the faster of tree and ring: ``(microseconds, algorithm)``."""
    if ranks <= 1:
        return 0.0, "none"
    nodes = max(1, ranks // per_node)
    ppn = ranks // nodes
    cap = NCCL["ll_max_bw_gbs"]["1" if nodes == 1 else "2" if nodes == 2 else "more"]
    intra = {a: NCCL["nvlink_hop_us"][a] for a in ("tree", "ring")}
    # tree: up and down the chain inside the node, then log2(nodes) network hops each way
    tree_lat = NCCL["base_us"]["tree"] + 2 * ((ppn - 1) * intra["tree"] + math.log2(nodes) * NCCL["net_hop_us"]["tree"])
    tree = tree_lat + nbytes / (1000 * cap * NCCL["tree_bw_ratio"])
    # ring: 2 (ranks - 1) steps, 2 nodes of them over the network
    steps = 2 * (ranks - 1)
    inter_steps = 2 * nodes if nodes > 1 else 0
    hop = max(intra["ring"], NCCL["net_overhead_us"]) if nodes > 1 else intra["ring"]
    ring_lat = NCCL["base_us"]["ring"] + (steps - inter_steps) * hop + inter_steps * NCCL["net_hop_us"]["ring"]
    ring = ring_lat + nbytes / (1000 * cap * ranks / steps)
    return (tree, "tree") if tree <= ring else (ring, "ring")


def synced_layers(model: str, norm: str = "bn") -> list[int]:
    """The channels of every synchronized layer of a zoo model, in order."""
    from distnorm import models

    net = models.create(model, num_classes=1000, norm=norm, activation=None)
    return [m.num_features for m in net.modules() if hasattr(m, "num_features") and hasattr(m, "process_group")]


def frame_bytes(channels: list[int], group: int) -> int:
    """Bytes of every distnorm all-reduce of the model in groups of ``group`` ranks."""
    return FLOAT64_BYTES * (FRAME_ROWS * max(channels) + FRAME_HEADER_PER_RANK * group)


def collective_bytes(channels: list[int], group: int) -> list[int]:
    """Bytes of each all-reduce of one step: one forward and one backward frame per layer."""
    return [frame_bytes(channels, group)] * (2 * len(channels))


def sync_ms(channels: list[int], group: int) -> float:
    """Milliseconds per step waiting for the layers' all-reduces in groups of ``group`` GPUs."""
    return sum(nccl_allreduce_us(n, group)[0] for n in collective_bytes(channels, group)) / 1e3


def predict(models_: tuple[str, ...] = ("resnet50", "efficientnet_b0"), worlds=WORLDS, groups=GROUPS,
            batches=BATCHES, speedup: float = H100_OVER_A100) -> dict:
    """The share of a step spent in the layers' all-reduces, per model, per-GPU batch, world
    size and ``sync_group_size``; the largest group under :data:`THRESHOLD` at each scale."""
    out = {}
    for name in models_:
        channels = synced_layers(name)
        images_per_s = A100_IMAGES_PER_S[name] * speedup
        per_group = {g: round(sync_ms(channels, g), 4) for g in groups}
        by_batch = {}
        for b in batches:
            compute = b / images_per_s * 1e3
            share = {g: round(s / (s + compute), 4) for g, s in per_group.items()}
            table = {}
            for w in worlds:
                fitting = [g for g in groups if g <= w and w % g == 0]
                under = [g for g in fitting if share[g] < THRESHOLD]
                table[w] = {"share_full_sync": share[w],
                            "share_per_group": {g: share[g] for g in fitting},
                            "largest_group_under_threshold": max(under) if under else 1}
            by_batch[b] = {"compute_ms": round(compute, 3), "share_per_group": share, "worlds": table}
        out[name] = {"synced_layers": len(channels), "channels": sum(channels),
                     "collectives_per_step": 2 * len(channels),
                     "bytes_per_step_per_group": {g: sum(collective_bytes(channels, g)) for g in groups},
                     "images_per_s_assumed": images_per_s,
                     "sync_ms_per_group": per_group,
                     "allreduce_us_per_group": {g: {"mean": round(per_group[g] * 1e3 / (2 * len(channels)), 2),
                                                    "algorithm": nccl_allreduce_us(frame_bytes(channels, g), g)[1]}
                                                for g in groups},
                     "per_gpu_batch": by_batch}
    return {"threshold": THRESHOLD, "gpus_per_node": GPUS_PER_NODE, "nccl_model": NCCL,
            "frame": {"rows": FRAME_ROWS, "header_per_rank": FRAME_HEADER_PER_RANK, "dtype_bytes": FLOAT64_BYTES},
            "compute": {"a100_images_per_s": A100_IMAGES_PER_S, "h100_over_a100_assumed": speedup,
                        "source": "NVIDIA/DeepLearningExamples PyTorch ConvNets READMEs (resnet50v1.5, efficientnet): "
                                  "1x A100 80GB, mixed precision, pytorch-21.03 NGC"},
            "models": out}


# --------------------------------------------------------------------------- measuring
LINKS = {  # name: root qdisc on every host's eth0 (None: no shaping)
    "none": None,
    "100mbit": "tbf rate 100mbit burst 64kb latency 200ms",
    "20mbit": "tbf rate 20mbit burst 32kb latency 400ms",
}
SIZES = (8, 512, 2048, 8192, 65536)  # bytes per all-reduce (ResNet-20's: 128 B to 1.5 KiB)


def _local_norm() -> str:
    """The zoo's name for PyTorch's own, unsynchronized BatchNorm (``"keep"``; formerly
    ``"local_bn"``)."""
    try:
        from distnorm.specs import NORM_LABELS
    except ImportError:
        return "local_bn"
    return "keep" if "keep" in NORM_LABELS else "local_bn"


LOCAL = _local_norm()
QUICK = {"links": ("none",), "per_host": (1,), "steps": 2, "reps": 5}
FULL = {"links": ("none", "100mbit", "20mbit"), "per_host": (1, 2, 4), "steps": 7, "reps": 25}


def worker(out: str, steps: int, reps: int, batch: int) -> None:
    """One rank: all-reduce latencies, then DDP steps of ResNet-20 (local / synced over all /
    synced per host), interleaved; rank 0 writes the medians and the counted collectives."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distnorm
    from distnorm import models
    from tests.dispatch import CollectiveCounter

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    host_group, _ = dist.new_subgroups(group_size=local)
    groups = {"world": None, **({"host": host_group} if 1 < local < world else {})}

    # one all-reduce at a time, after a barrier; every size and group in turn (round-robin),
    # so that the machine's other load falls on all of them alike
    buffers = {n: torch.zeros(max(n // 4, 1)) for n in SIZES}
    lat = {(g, n): [] for g in groups for n in SIZES}
    for rep in range(reps + 2):
        for gname, group in groups.items():
            for nbytes, t in buffers.items():
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(t, group=group)
                if rep >= 2:  # two warm-up rounds
                    lat[gname, nbytes].append(time.perf_counter() - start)
    latency_us = {g: {n: statistics.median(lat[g, n]) * 1e6 for n in SIZES} for g in groups}

    # distnorm's layer in a group of one: its own arithmetic, no collective -- the baseline of
    # the synchronized variants, so that what they add is communication and waiting only
    alone, _ = dist.new_subgroups(group_size=1)
    variants = {"local_bn": (LOCAL, None), "unsynced": ("bn", alone), "sync_world": ("bn", None)}
    if "host" in groups:
        variants["sync_host"] = ("bn", host_group)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (batch,), generator=gen)
    loss_fn = nn.CrossEntropyLoss()
    runs, counted = {}, {}
    for variant, (norm, group) in variants.items():
        torch.manual_seed(0)
        model = models.create("resnet20", num_classes=10, norm=norm, activation=None,
                              **({"process_group": group} if group is not None else {}))
        ddp = DDP(model, **distnorm.ddp_kwargs())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

        def step(ddp=ddp, opt=opt):
            opt.zero_grad(set_to_none=True)
            loss_fn(ddp(x), y).backward()
            opt.step()

        step()  # warm-up
        with CollectiveCounter() as counter:  # the bare model: DDP's gradient buckets left out
            loss_fn(ddp.module(x), y).backward()
        opt.zero_grad(set_to_none=True)
        counted[variant] = {"collectives": len(counter), "bytes": list(counter.nbytes),
                            "kinds": sorted({op for op, _ in counter.calls}),
                            "channels": [m.num_features for m in model.modules()
                                         if hasattr(m, "num_features") and hasattr(m, "process_group")]}
        runs[variant] = step
    times = {v: [] for v in runs}
    for _ in range(steps):
        for variant, step in runs.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            times[variant].append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps({
            "world": world, "per_host": local, "latency_us": latency_us, "collectives": counted,
            "median_step_ms": {v: statistics.median(t) * 1e3 for v, t in times.items()}}))
    dist.destroy_process_group()


def fit_alpha_beta(points: dict) -> tuple[float, float]:
    """Least squares ``t = alpha + beta * bytes`` (us, us per byte) over ``{bytes: us}``."""
    xs, ys = [float(k) for k in points], list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - beta * mx, beta


def check(run: dict) -> dict:
    """Predicted synchronization time of each synced variant (the counted collectives timed by
    the alpha-beta fit of the same run's all-reduces) against the measured step difference."""
    fits = {g: fit_alpha_beta({int(k): v for k, v in lat.items()}) for g, lat in run["latency_us"].items()}
    result = {"alpha_beta": {g: {"alpha_us": round(a, 2), "beta_us_per_kib": round(b * 1024, 4)} for g, (a, b) in fits.items()}}
    for variant, group in (("sync_world", "world"), ("sync_host", "host")):
        if variant not in run["median_step_ms"]:
            continue
        alpha, beta = fits[group]
        predicted = sum(alpha + beta * n for n in run["collectives"][variant]["bytes"]) / 1e3
        measured = run["median_step_ms"][variant] - run["median_step_ms"]["unsynced"]
        result[variant] = {"predicted_sync_ms": round(predicted, 2), "measured_sync_ms": round(measured, 2),
                           "error": round(predicted / measured - 1, 3) if measured > 0 else None}
    return result


def drive(args) -> dict:
    plan = dict(QUICK if args.quick else FULL)
    if args.links:
        plan["links"] = tuple(args.links)
    if args.per_host:
        plan["per_host"] = tuple(args.per_host)
    steps, reps = args.steps or plan["steps"], args.reps or plan["reps"]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.loopback:
            for world in (2 * p for p in plan["per_host"]):
                out = Path(tmp) / f"loop-{world}.json"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                       str(Path(__file__).resolve()), "--worker", "--out", str(out), "--steps", str(steps),
                       "--reps", str(reps), "--batch", str(args.batch)]
                env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
                subprocess.run(cmd, check=True, env=env, timeout=900, stdout=subprocess.DEVNULL)
                runs.setdefault("loopback", {})[world] = json.loads(out.read_text())
            hosts = 1
        else:
            from tests.cluster import Cluster

            hosts = 2
            port = 29700
            with Cluster(hosts) as cluster:
                head = cluster.hosts[0].name
                for link in plan["links"]:
                    for h in cluster.hosts:
                        h.shape(LINKS[link])
                    for per_host in plan["per_host"]:
                        out = Path(tmp) / f"{link}-{per_host}.json"
                        port += 1
                        cmd = " ".join([sys.executable, "-m", "torch.distributed.run", f"--nnodes={hosts}",
                                        f"--nproc_per_node={per_host}", "--node_rank=$NODE_RANK",
                                        f"--master_addr={head}", f"--master_port={port}", str(Path(__file__).resolve()),
                                        "--worker", "--out", str(out), "--steps", str(steps), "--reps", str(reps),
                                        "--batch", str(args.batch)])
                        env_of = lambda h: {**os.environ, "NODE_RANK": str(h.index), "OMP_NUM_THREADS": "1",  # noqa: E731
                                            "PYTHONPATH": str(REPO)}
                        codes = cluster.run_everywhere(cmd, env_of=env_of, logs=Path(tmp), timeout=900)
                        if codes != [0] * hosts:
                            raise RuntimeError(f"{link}, {per_host}/host: exit codes {codes}\n"
                                               + (Path(tmp) / f"{head}.log").read_text()[-3000:])
                        run = json.loads(out.read_text())
                        runs.setdefault(link, {})[run["world"]] = run
                        print(link, run["world"], {k: round(v, 1) for k, v in run["median_step_ms"].items()}, flush=True)
                for h in cluster.hosts:
                    h.shape(None)
    checks = {link: {w: check(r) for w, r in by_world.items()} for link, by_world in runs.items()}
    return {"alpha_growth": {link: alpha_growth(c) for link, c in checks.items()},"hosts": hosts, "steps": steps, "reps": reps, "per_rank_batch": args.batch, "model": "resnet20",
            "links": {link: LINKS.get(link) for link in runs}, "runs": runs, "checks": checks,
            "errors": summarize(checks)}


def alpha_growth(by_world: dict) -> dict | None:
    """The ring's latency law checked across world sizes: gloo's all-reduce is a ring of
    2 (p - 1) steps, so ``alpha(p) = a + 2 (p - 1) h``; ``a``, ``h`` fitted on the two smallest
    worlds, the largest predicted."""
    worlds = sorted(by_world)
    if len(worlds) < 3:
        return None
    (p1, p2), p3 = worlds[:2], worlds[-1]
    a1, a2 = (by_world[p]["alpha_beta"]["world"]["alpha_us"] for p in (p1, p2))
    h = (a2 - a1) / (2 * (p2 - p1))
    predicted = a1 + 2 * (p3 - p1) * h
    measured = by_world[p3]["alpha_beta"]["world"]["alpha_us"]
    return {"fit_on": [p1, p2], "hop_us": round(h, 2), "world": p3, "predicted_alpha_us": round(predicted, 1),
            "measured_alpha_us": measured, "error": round(predicted / measured - 1, 3)}


def summarize(checks: dict) -> dict:
    """Every model-vs-measurement error, and the largest in absolute value."""
    errors = {f"{link}/{w}/{v}": c[v]["error"] for link, by_world in checks.items() for w, c in by_world.items()
              for v in ("sync_world", "sync_host") if v in c and c[v]["error"] is not None}
    return {"each": errors, "max_abs": max((abs(e) for e in errors.values()), default=None)}


# ---------------------------------------------------------------------------- output
def markdown(prediction: dict) -> str:
    """The docs' tables: per model, each group's all-reduce and share of a step per per-GPU
    batch; then the largest group under the threshold at each world size."""
    prediction = json.loads(json.dumps(prediction))  # the same keys (text) fresh or read back from the JSON
    lines = []
    for name, m in prediction["models"].items():
        batches = list(m["per_gpu_batch"])
        lines += [f"{name}: {m['synced_layers']} synchronized layers, {m['channels']} channels, "
                  f"{m['collectives_per_step']} all-reduces per step; compute "
                  + ", ".join(f"{p['compute_ms']:.1f} ms at batch {b}" for b, p in m["per_gpu_batch"].items()), "",
                  "| `sync_group_size` | mean all-reduce | waiting per step | "
                  + " | ".join(f"share, batch {b}/GPU" for b in batches) + " |",
                  "|---" * (3 + len(batches)) + "|"]
        for g in GROUPS[1:]:
            ar = m["allreduce_us_per_group"][str(g)]
            shares = " | ".join(f"{m['per_gpu_batch'][b]['share_per_group'][str(g)] * 100:.1f} %" for b in batches)
            lines.append(f"| {g} | {ar['mean']:.1f} us ({ar['algorithm']}) | {m['sync_ms_per_group'][str(g)]:.2f} ms | {shares} |")
        lines.append("")
    names = list(prediction["models"])
    batches = list(prediction["models"][names[0]]["per_gpu_batch"])
    lines += ["| GPUs | " + " | ".join(f"{n}, batch {b}" for n in names for b in batches) + " |",
              "|---" * (1 + len(names) * len(batches)) + "|"]
    worlds = list(prediction["models"][names[0]]["per_gpu_batch"][batches[0]]["worlds"])
    for w in worlds:
        cells = []
        for n in names:
            for b in batches:
                row = prediction["models"][n]["per_gpu_batch"][b]["worlds"][w]
                cells.append(f"{row['largest_group_under_threshold']} (all: {row['share_full_sync'] * 100:.0f} %)")
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    payload = json.loads(json.dumps(payload))  # the same keys (text) fresh or read back from the JSON
    prediction = payload["prediction"]
    panels = list(prediction["models"]) + (["measured"] if payload.get("measured") else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8))
    for ax, name in zip(axes, panels):
        if name == "measured":
            checks = payload["measured"]["checks"]
            labels, pred, meas = [], [], []
            for link, by_world in checks.items():
                for w, c in by_world.items():
                    for v in ("sync_world", "sync_host"):
                        if v in c:
                            labels.append(f"{link}\n{w} {'all' if v == 'sync_world' else 'host'}")
                            pred.append(c[v]["predicted_sync_ms"])
                            meas.append(c[v]["measured_sync_ms"])
            xs = range(len(labels))
            ax.bar([x - 0.2 for x in xs], meas, 0.4, label="measured (synced - unsynced step)")
            ax.bar([x + 0.2 for x in xs], pred, 0.4, label="model (counted all-reduces x fit)")
            ax.set_xticks(list(xs), labels, fontsize=6, rotation=90)
            ax.set_ylabel("sync time per step (ms)")
            ax.set_title("simulated hosts, gloo, ResNet-20", fontsize=9)
            ax.legend(fontsize=7)
            continue
        m = prediction["models"][name]
        groups = [g for g in GROUPS if g > 1]
        for b, p in m["per_gpu_batch"].items():
            ax.plot(groups, [p["share_per_group"][str(g)] * 100 for g in groups], marker="o", label=f"batch {b}/GPU")
        ax.axhline(prediction["threshold"] * 100, color="grey", linestyle="--", linewidth=1)
        ax.axvline(GPUS_PER_NODE, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(groups, [str(g) for g in groups])
        ax.set_xlabel("sync_group_size (GPUs; 8 = one node)")
        ax.set_ylabel("share of the step waiting (%)")
        ax.set_title(f"{name}: {m['synced_layers']} synced layers, H100 (model)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the prediction and the measurements here")
    parser.add_argument("--plot", help="write the figure (PNG) here")
    parser.add_argument("--predict-only", action="store_true", help="the model alone: no processes")
    parser.add_argument("--quick", action="store_true", help=f"one short run: {QUICK}")
    parser.add_argument("--loopback", action="store_true", help="ranks on this machine's loopback, no simulated hosts")
    parser.add_argument("--links", nargs="+", choices=list(LINKS))
    parser.add_argument("--per-host", nargs="+", type=int, help="processes per host, one run each")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--reps", type=int)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.out, args.steps, args.reps, args.batch)
        return None
    from _common import machine

    payload = {"benchmark": "scale", "command": " ".join(["bench/scale.py", *(argv if argv is not None else sys.argv[1:])]),
               "machine": machine(), "prediction": predict()}
    if not args.predict_only:
        payload["measured"] = drive(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=1))
    if args.plot:
        plot(payload, Path(args.plot))
    print(markdown(payload["prediction"]))
    if "measured" in payload:
        print(json.dumps(payload["measured"]["errors"], indent=1))
    return payload


if __name__ == "__main__":
    main()
