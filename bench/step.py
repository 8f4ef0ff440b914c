"""One data-parallel training step: distnorm's layers and BNP against local BatchNorm, a
synchronized peer and the collective floor, under DDP.

    python bench/step.py --json bench/results/step-cpu.json [--quick] [--world-size 2]

Two ranks (gloo on CPU, NCCL with one GPU per rank when CUDA is available) each build
ResNet-18 and the CIFAR ResNet-20 in five variants — PyTorch's local ``nn.BatchNorm2d``
(the baseline), synced CBN, synced POP-Norm, distnorm's SyncBatchNorm, detectron2's
``NaiveSyncBatchNorm`` design (``bench/peers.py``: the synchronized BN a CPU user would pick,
same collective count as ours) and local BN with BNP attached — wrap them in ``DistributedDataParallel`` (the same keyword arguments for
all: ``distnorm.ddp_kwargs()``, no per-forward buffer broadcast) and time one SGD step
(forward, backward with DDP's gradient all-reduce, optimizer step), interleaved, median of
repeats on rank 0 (``--quick``: one repeat, and this process is rank 0 itself, the other
rank spawned). It also counts distnorm's collectives per step, every kind
(``tests.dispatch.CollectiveCounter``, on the bare model so DDP's gradient buckets are not
among them) and measures training memory
(``_common.training_memory_bytes``).

The **collective floor** of a variant is what its step would cost if synchronizing were free
except for the collectives themselves: the local-BN step plus (collectives per step) x (the
measured latency of one small all-reduce). ``step_<variant>_vs_floor`` near 1 means the
layers add nothing but their unavoidable collectives.

``ratios.step_<variant>_vs_local_bn`` are ResNet-18; ``..._resnet20`` the CIFAR model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta

import torch
from torch import nn

from _common import machine, run_ranks, shown, training_memory_bytes, use_stable_allocator, write_json  # noqa: I001
from peers import naive_sync  # noqa: I001

from tests.dispatch import CollectiveCounter
import distnorm
from distnorm import models
from distnorm.convert import GroupNormAct

VARIANTS = ("local_bn", "cbn", "popnorm", "syncbn", "naive_syncbn", "bnp")
SYNCED = ("cbn", "popnorm", "syncbn", "naive_syncbn")
# name: (input side, per-rank batch, quick side, quick batch)
MODELS = {"resnet18": (128, 8, 64, 2), "resnet20": (32, 64, 32, 8)}


#: variant: the ``norm`` of ``models.create``; ``bnp`` / ``bnp_gn`` / ``bnp_gn_torch`` then attach
#: BNP (paper 004 preconditions local BN, and GroupNorm in place of BN for ResNets);
#: ``cbn_unfolded`` is CBN with the stem computed as ``conv(cbn(x))``; ``*_torch`` run PyTorch's
#: GroupNorm in place of distnorm's (:class:`TorchGroupNorm`). The variants beyond
#: :data:`VARIANTS` are for ``bench/model_choices.py`` and ``bench/step_gpu.py --variants``.
NORM_OF = {"local_bn": "keep", "cbn": "cbn", "popnorm": "popnorm", "syncbn": "bn", "naive_syncbn": "keep",
           "bnp": "keep", "bnp_gn": "gn", "gn": "gn", "gn_torch": "gn", "bnp_gn_torch": "gn", "cbn_unfolded": "cbn"}


class TorchGroupNorm(distnorm.GroupNorm):
    """distnorm's GroupNorm computed by PyTorch's ``nn.GroupNorm.forward``: the ``*_torch``
    variants' baseline. On CUDA that copies a channels_last input to NCHW
    (``aten/src/ATen/native/group_norm.cpp``) and, under autocast, runs in float32, its output
    too (autocast's float32 list, ``aten/src/ATen/autocast_mode.h``)."""

    forward = nn.GroupNorm.forward


class TorchGroupNormAct(GroupNormAct):
    """:class:`TorchGroupNorm` for a norm + activation (timm's ``BatchNormAct2d`` converted)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(nn.GroupNorm.forward(self, x)))


_TORCH_GROUP_NORM = {distnorm.GroupNorm: TorchGroupNorm, GroupNormAct: TorchGroupNormAct}


def build(name: str, variant: str, num_classes: int = 10) -> nn.Module:
    """``name`` from the zoo with its own activations, in ``variant`` (a key of NORM_OF)."""
    torch.manual_seed(0)
    model = models.create(name, num_classes=num_classes, norm=NORM_OF[variant], activation=None)
    if variant == "naive_syncbn":
        naive_sync(model)
    if variant.endswith("_torch"):
        for module in model.modules():
            module.__class__ = _TORCH_GROUP_NORM.get(type(module), type(module))
    if variant in ("bnp", "bnp_gn", "bnp_gn_torch"):
        distnorm.bnp.attach(model)
    if variant == "cbn_unfolded":
        # A convolution with hooks is never folded (distnorm._folding.folds): this no-op hook
        # gives the stem as conv(cbn(x)), which asks for the convolution's input gradient.
        stem = next(m for m in model.modules() if isinstance(m, distnorm.PreNorm))
        stem.op.register_forward_pre_hook(lambda module, args: None)
    return model


def _worker(rank: int, world: int, store: str, quick: bool, repeats: int, out) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    torch.set_num_threads(1)
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    # The floor under every synchronized layer: latency of one small all-reduce here.
    probe = torch.zeros(129, dtype=torch.float64, device=device)
    for _ in range(10):
        dist.all_reduce(probe)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(200):
        dist.all_reduce(probe)
    if cuda:
        torch.cuda.synchronize(device)
    latency_ms = (time.perf_counter() - start) / 200 * 1e3

    results = {}
    for name, (side, batch, qside, qbatch) in MODELS.items():
        side, batch = (qside, qbatch) if quick else (side, batch)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(batch, 3, side, side, generator=gen).to(device)
        y = torch.randint(0, 10, (batch,), generator=gen).to(device)
        loss_fn = nn.CrossEntropyLoss()
        runs = {}
        for variant in VARIANTS:
            model = build(name, variant).to(device)
            ddp = DDP(model, device_ids=[rank] if cuda else None, **distnorm.ddp_kwargs())
            opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
            distnorm.set_lr(ddp, 0.005)  # eta = 0.95: CBN's AMAT history path

            def step(ddp=ddp, opt=opt):
                opt.zero_grad(set_to_none=True)
                loss_fn(ddp(x), y).backward()
                opt.step()

            runs[variant] = (ddp, opt, step)
        times = {v: [] for v in VARIANTS}
        counts, mem = {}, {}
        for variant, (ddp, opt, step) in runs.items():
            step()  # warm-up
            # distnorm's collectives (every kind): one forward + backward of the bare model,
            # so DDP's gradient buckets are not among them
            with CollectiveCounter() as counter:
                loss_fn(ddp.module(x), y).backward()
            opt.zero_grad(set_to_none=True)
            counts[variant] = {"collectives": len(counter), "bytes": sum(counter.nbytes),
                               "kinds": sorted({op for op, _ in counter.calls})}
            mem[variant] = training_memory_bytes(ddp, opt, lambda ddp=ddp: loss_fn(ddp(x), y), device)
        names = list(runs)
        for i in range(repeats):  # each round one variant later (bench/_common.interleaved_times says why)
            for variant in names[i % len(names):] + names[:i % len(names)]:
                step = runs[variant][2]
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                step()
                if cuda:
                    torch.cuda.synchronize(device)
                times[variant].append(time.perf_counter() - start)
        medians = {v: statistics.median(t) for v, t in times.items()}
        # per-round ratios to the peer (same round, interleaved): how far the load moved them
        spread = {v: statistics.quantiles([a / b for a, b in zip(times[v], times["naive_syncbn"])], n=4,
                                          method="inclusive")
                  for v in ("cbn", "syncbn")} if repeats > 1 else {}
        floor = {v: medians["local_bn"] + counts[v]["collectives"] * latency_ms / 1e3 for v in SYNCED}
        results[name] = {
            "collective_floor_ms": {v: f * 1e3 for v, f in floor.items()},
            "ratio_vs_floor": {v: medians[v] / f for v, f in floor.items()},
            "input_per_rank": [batch, 3, side, side],
            "median_step_ms": {v: t * 1e3 for v, t in medians.items()},
            "ratio_vs_local_bn": {v: t / medians["local_bn"] for v, t in medians.items()},
            "ratio_vs_naive_syncbn_per_round_quartiles": spread,
            "distnorm_collectives_per_step": counts,
            "memory_bytes": mem,
            "memory_ratio_vs_local_bn": {v: m / mem["local_bn"] for v, m in mem.items()},
        }
    if rank == 0:
        out.put({"results": results, "device": str(device), "backend": dist.get_backend(), "latency_ms": latency_ms})
    dist.destroy_process_group()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 7)
    # --quick: this process is rank 0 (bench/_common.run_ranks)
    got = run_ranks(_worker, args.world_size, args.quick, repeats, inline=args.quick)
    results = got["results"]
    ratios = {}
    for name, suffix in (("resnet18", ""), ("resnet20", "_resnet20")):
        r = results[name]
        for variant in VARIANTS[1:]:
            ratios[f"step_{variant}_vs_local_bn{suffix}"] = r["ratio_vs_local_bn"][variant]
        for variant in ("cbn", "syncbn"):
            ratios[f"step_{variant}_vs_naive_syncbn{suffix}"] = (
                r["median_step_ms"][variant] / r["median_step_ms"]["naive_syncbn"])
            ratios[f"step_{variant}_vs_floor{suffix}"] = r["ratio_vs_floor"][variant]
    payload = {"benchmark": "step", "machine": machine(), "device": got["device"], "backend": got["backend"],
               "world_size": args.world_size, "repeats": repeats,
               "small_all_reduce_latency_ms": got["latency_ms"], "models": results, "ratios": ratios}
    for name, r in results.items():
        print(f"{name} {tuple(r['input_per_rank'])} per rank: step ms {shown(r['median_step_ms'])}")
        print(f"  ratio vs local BN {shown(r['ratio_vs_local_bn'])}; memory ratio {shown(r['memory_ratio_vs_local_bn'])}")
        print(f"  ratio vs collective floor {shown(r['ratio_vs_floor'])}")
        print(f"  distnorm collectives per step {r['distnorm_collectives_per_step']}")
    print(f"one all-reduce of 129 float64 values: {got['latency_ms']:.3f} ms")
    print(f"ratios: {json.dumps(shown(ratios, 4))}")
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    use_stable_allocator()
    main()
