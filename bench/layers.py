"""Forward+backward cost of distnorm's layers against torch.nn.BatchNorm2d, same run.

    python bench/layers.py --json bench/results/layers.json [--quick] [--device cuda] [--threads N]

Measures, for each input shape, the median time of one training forward+backward of
``CBN`` (AMAT with history, eta = 0.9), ``POPNorm``, ``SyncBatchNorm`` (one process) and a
naive autograd CBN (the float64 test reference of SPEC §1, run in float32) against
``torch.nn.BatchNorm2d``; the bytes each saves for backward; and, in a real 2-rank gloo
run (two spawned ranks; with ``--quick`` this process is rank 0 and one is spawned), how
many collectives each layer issues per step and how many bytes they carry; and the
ATen ops each layer dispatches per training step and the activation passes they make
(``tests/dispatch.OpCounter``: bytes of activation-sized tensors read and written, over the
input's size; 8 is a synchronized layer's floor): on a GPU each op is a kernel launch, which
for small per-channel work costs more than the work, and each pass is memory traffic. The
counts, local and on 2 ranks, must stay within the budgets ``tests/test_step_cost.py``
enforces. Shapes: ResNet's first stage and a late one, and the first again in channels_last.

Reported ratios (time of the layer / time of BatchNorm2d; lower is better) use the first
(largest) shape; ``naive_vs_cbn`` is how many times faster CBN is than the naive version.
``ratio_per_round_quartiles``: the quartiles of each round's ratio (the layers of one round
ran back to back), how far a loaded machine moved the medians' ratio.
"""

from __future__ import annotations

import argparse
import statistics
from datetime import timedelta
from typing import Callable

import torch
from torch import nn

from _common import (interleaved_times, machine, ratio_spread, run_ranks, shown,  # noqa: I001  (sets sys.path)
                     use_stable_allocator, write_json)

import distnorm
from tests.dispatch import CollectiveCounter, OpCounter
from tests.reference import CBNState, cbn_train

SHAPES = [(32, 64, 56, 56), (32, 256, 14, 14), (32, 64, 56, 56, "channels_last")]
QUICK_SHAPES = [(8, 16, 16, 16)]
LR = 0.01  # eta = 1 - 10 * 0.01 = 0.9: the AMAT history path, the most expensive one


class NaiveCBN(nn.Module):
    """CBN with AMAT written with plain torch ops and autograd (the test reference)."""

    def __init__(self, channels: int, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels, device=device))
        self.bias = nn.Parameter(torch.zeros(channels, device=device))
        self.state = CBNState(channels, dtype=torch.float32, device=device)

    def forward(self, x):
        return cbn_train(x, self.weight, self.bias, self.state, eta=1 - 10 * LR)


def make_layers(channels: int, device: torch.device) -> dict[str, nn.Module]:
    layers = {
        "batchnorm2d": nn.BatchNorm2d(channels),
        "cbn": distnorm.CBN(channels),
        "popnorm": distnorm.POPNorm(channels),
        "syncbn": distnorm.SyncBatchNorm(channels),
        "naive_cbn": NaiveCBN(channels, device),
    }
    for layer in layers.values():
        layer.to(device)
        distnorm.set_lr(layer, LR)
    return layers


def saved_bytes(layer: nn.Module, x: torch.Tensor) -> int:
    """Bytes of distinct storages autograd keeps for this layer's backward."""
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    del y
    return sum(storages.values())


def dispatched_ops(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict[str, float]:
    """ATen ops (kernel launches on a GPU), activation passes (bytes of activation-sized
    tensors read and written, over the input's size) and host syncs of one training
    forward + backward (``tests/dispatch.OpCounter``)."""
    x = x.detach().requires_grad_()
    with OpCounter(x) as counter:
        layer(x).backward(grad)
    return {"ops": len(counter), "activation_passes": counter.passes, "host_syncs": counter.host_syncs}


def layer_steps(layers: dict[str, nn.Module], shape, channels_last: bool,
                device: torch.device) -> tuple[dict[str, Callable[[], None]], torch.Tensor, torch.Tensor]:
    """One training step (forward + backward) of each layer on one input: ``(steps, x, grad)``.
    Each layer runs once first, so CBN's AMAT is initialised and every timed step uses history."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = (torch.randn(*shape, device=device) * 2 + 0.5).to(memory_format=fmt).requires_grad_()
    grad = torch.randn(*shape, device=device).to(memory_format=fmt)
    for layer in layers.values():
        layer(x.detach())

    def step(layer):
        def run():
            x.grad = None
            layer(x).backward(grad)
        return run

    return {name: step(layer) for name, layer in layers.items()}, x, grad


def time_layers(shape, device, repeats) -> dict:
    *shape, layout = shape if isinstance(shape[-1], str) else (*shape, "contiguous")
    layers = make_layers(shape[1], device)
    steps, x, grad = layer_steps(layers, shape, layout == "channels_last", device)
    times = interleaved_times(steps, repeats, device)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    base = medians["batchnorm2d"]
    return {
        "shape": list(shape),
        "memory_format": layout,
        "median_ms": {k: v * 1e3 for k, v in medians.items()},
        "ratio_vs_batchnorm2d": {k: v / base for k, v in medians.items()},
        "ratio_per_round_quartiles": ratio_spread(times, "batchnorm2d"),
        "naive_vs_cbn": medians["naive_cbn"] / medians["cbn"],
        "saved_for_backward_bytes": {name: saved_bytes(layer, x) for name, layer in layers.items()},
        "dispatched_ops_per_step": {name: dispatched_ops(layer, x, grad) for name, layer in layers.items()
                                    if name != "naive_cbn"},
        "input_bytes": x.numel() * x.element_size(),
    }


# ------------------------------------------------------------- 2-rank collective count
def _count_collectives(rank: int, world: int, store: str, channels: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    result = {}
    layers = nn.ModuleDict({"cbn": distnorm.CBN(channels), "popnorm": distnorm.POPNorm(channels),
                            "syncbn": distnorm.SyncBatchNorm(channels)})
    # Named: with --quick, rank 0 (this process) built the timing's layers before, rank 1 did not,
    # so their construction-order names differ.
    distnorm.name_layers(layers)
    for name, layer in layers.items():
        distnorm.set_lr(layer, LR)
        x = torch.randn(4, channels, 8, 8, requires_grad=True)
        layer(x.detach())  # initialise AMAT: the counted step takes the history path
        with CollectiveCounter() as counter:  # every collective of any kind
            y = layer(x)
            forward = counter.mark()
            y.sum().backward()
        result[name] = {"forward": forward, "backward": len(counter) - forward,
                        "kinds": sorted({op for op, _ in counter.calls}),
                        "forward_bytes": sum(counter.nbytes[:forward]), "backward_bytes": sum(counter.nbytes[forward:]),
                        "dispatched_ops": dispatched_ops(layer, x, torch.ones_like(x))}
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def collectives_two_ranks(channels: int = 64, inline: bool = False) -> dict:
    """The per-layer counts of a real 2-rank gloo group. ``inline`` (``--quick``): this process
    is rank 0 and only rank 1 is spawned -- one interpreter, ``import torch`` and first layer
    call fewer; each rank builds its own fresh layers, so the counts are the same."""
    result = run_ranks(_count_collectives, 2, channels, inline=inline, timeout=120)
    return {"channels": channels, "per_layer_per_step": result}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="tiny shape, few repeats (for tests)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's own)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    repeats = args.repeats or (3 if args.quick else 15)

    per_shape = [time_layers(s, device, repeats) for s in shapes]
    main_shape = per_shape[0]
    payload = {
        "benchmark": "layers",
        "machine": machine(),
        "device": str(device),
        "repeats": repeats,
        "lr": LR,
        "shapes": per_shape,
        "collectives_2_ranks": collectives_two_ranks(inline=args.quick),
        "ratios_per_shape": {f"{tuple(e['shape'])} {e['memory_format']}": {
            k: e["ratio_vs_batchnorm2d"][k] for k in ("cbn", "popnorm", "syncbn")} for e in per_shape},
        "ratios": {
            "cbn_vs_batchnorm2d": main_shape["ratio_vs_batchnorm2d"]["cbn"],
            "popnorm_vs_batchnorm2d": main_shape["ratio_vs_batchnorm2d"]["popnorm"],
            "syncbn_vs_batchnorm2d": main_shape["ratio_vs_batchnorm2d"]["syncbn"],
            "naive_vs_cbn": main_shape["naive_vs_cbn"],
        },
    }
    for entry in per_shape:
        print(f"shape {tuple(entry['shape'])} {entry['memory_format']}: median fwd+bwd ms {shown(entry['median_ms'], 4)}")
        print(f"  ratio vs BatchNorm2d {shown(entry['ratio_vs_batchnorm2d'], 4)}; "
              f"CBN is {entry['naive_vs_cbn']:.3f}x faster than naive")
        print(f"  per-round ratio quartiles {shown(entry['ratio_per_round_quartiles'], 4)}")
        print(f"  saved for backward (input {entry['input_bytes']} B): {entry['saved_for_backward_bytes']}")
        print(f"  dispatched ATen ops, activation passes per step: {entry['dispatched_ops_per_step']}")
    print(f"collectives per layer per step, 2 ranks: {payload['collectives_2_ranks']['per_layer_per_step']}")
    print(f"ratios: {shown(payload['ratios'], 4)}")
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    use_stable_allocator()
    main()
