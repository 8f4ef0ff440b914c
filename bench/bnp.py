"""Cost of BNP: one training step with BNP attached against the same step without.

    python bench/bnp.py --json bench/results/bnp-cpu.json [--quick] [--device cuda]

For each model (torchvision ResNet-18, and the CIFAR ResNet-20 of ``distnorm.models``, both
with PyTorch's local BatchNorm), times one SGD training step (forward, backward, optimizer
step) with and without BNP on the same batch, interleaved, median of repeats; and measures
the memory of training (see :func:`_common.training_memory_bytes`).

In the same interleaved rounds, a third step: BNP with ATen's calls where distnorm's kernels
would run (``bnp_aten``; the CPU: ``DISTNORM_CPU_KERNEL=0``, BNP's statistics and its gradient
transform, :mod:`distnorm._cpu_kernels`; CUDA: ``DISTNORM_TRITON=0``, the transform); and the
gradient transform alone over the model's preconditioned weights (``transform_ms``:
``distnorm::bnp_precondition``'s kernel — C on the CPU, Triton on CUDA — against ATen's
calls, interleaved, median).

``ratios.step_bnp_vs_plain`` / ``ratios.mem_bnp_vs_plain`` refer to ResNet-18.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
from typing import Iterable

import torch
from torch import nn

from _common import (interleaved_times, machine, ratio_spread, shown, training_memory_bytes,  # noqa: I001
                     use_stable_allocator, write_json)

import distnorm
from distnorm._bnp_functions import bnp_precondition

MODELS = {
    # name: (builder, input size, quick input size, batch, quick batch)
    "resnet18": ("torchvision", 224, 64, 16, 4),
    "resnet20": ("distnorm", 32, 32, 64, 8),
}


def build(name: str) -> nn.Module | None:
    torch.manual_seed(0)
    if name == "resnet18":
        import torchvision

        return torchvision.models.resnet18(num_classes=1000)
    try:
        from distnorm import models
    except ImportError:
        return None
    return models.create(name, num_classes=10, norm="keep")  # same BatchNorm as torchvision's


#: The setting that turns distnorm's own kernels off, per device type (``bnp_aten``).
ATEN_ONLY = {"cpu": "DISTNORM_CPU_KERNEL", "cuda": "DISTNORM_TRITON"}


class Step:
    """One training step of a model copy with its own optimizer; ``own_kernels=False``: with
    :data:`ATEN_ONLY`'s setting ``0`` during the step (read at the first call by a layer
    without a process group, as here, and kept)."""

    def __init__(self, model: nn.Module, use_bnp: bool, x: torch.Tensor, y: torch.Tensor, own_kernels: bool = True):
        self.model = model.to(x.device).train()
        self.handle = distnorm.bnp.attach(self.model) if use_bnp else None
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
        self.x, self.y = x, y
        self.loss = nn.CrossEntropyLoss()
        self.setting = None if own_kernels else ATEN_ONLY[x.device.type]

    def __call__(self) -> None:
        before = os.environ.get(self.setting) if self.setting else None
        if self.setting:
            os.environ[self.setting] = "0"
        try:
            self.opt.zero_grad(set_to_none=True)
            self.loss(self.model(self.x), self.y).backward()
            self.opt.step()
        finally:
            if self.setting and before is None:
                os.environ.pop(self.setting, None)
            elif self.setting:
                os.environ[self.setting] = before


def transform_ms(layers: Iterable[nn.Module], repeats: int, device: torch.device) -> dict[str, float]:
    """Median milliseconds of BNP's gradient transform over the weights of ``layers`` (the
    layers ``attach`` preconditions: random gradients of their shapes, a bias each), computed
    by the device's kernel (``"kernel"``: C on the CPU, Triton on CUDA) and by ATen's calls, in
    interleaved rounds."""
    torch.manual_seed(0)
    args = []
    for layer in layers:
        shape, channels, groups = layer.weight.shape, layer.bnp_mean.numel(), getattr(layer, "groups", 1)
        args.append(tuple(t.to(device) for t in (torch.randn(shape), torch.randn(shape[0]), torch.randn(channels),
                                                 torch.rand(channels) + 0.5, torch.tensor(3.0))) + (groups,))
    kernel, name = torch.ops.distnorm.bnp_precondition, "cpu" if device.type == "cpu" else "triton"
    ways = {"kernel": lambda: [kernel(*a, name) for a in args],
            "aten": lambda: [bnp_precondition(*a[:5], groups=a[5]) for a in args]}
    times = interleaved_times(ways, repeats, device)
    return {way: statistics.median(t) * 1e3 for way, t in times.items()}


def bench_model(name: str, quick: bool, repeats: int, device: torch.device) -> dict | None:
    model = build(name)
    if model is None:
        return None
    _, size, qsize, batch, qbatch = MODELS[name]
    size, batch = (qsize, qbatch) if quick else (size, batch)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    steps = {"plain": Step(copy.deepcopy(model), False, x, y), "bnp": Step(copy.deepcopy(model), True, x, y)}
    steps["bnp_aten"] = Step(copy.deepcopy(model), True, x, y, own_kernels=False)
    times = interleaved_times(steps, repeats, device, warmup=1)
    medians = {k: statistics.median(v) for k, v in times.items()}
    mem = {variant: training_memory_bytes(step.model, step.opt, lambda s=step: s.loss(s.model(s.x), s.y), device)
           for variant, step in steps.items() if variant != "bnp_aten"}
    entry = {
        "input": [batch, 3, size, size],
        "median_step_ms": {k: v * 1e3 for k, v in medians.items()},
        "step_bnp_vs_plain": medians["bnp"] / medians["plain"],
        "step_bnp_vs_plain_per_round_quartiles": ratio_spread(times, "plain")["bnp"],
        "memory_bytes": mem,
        "memory_method": "cuda peak allocated" if device.type == "cuda" else "params+buffers+grads+optimizer state+saved for backward",
        "mem_bnp_vs_plain": mem["bnp"] / mem["plain"],
        "bnp_layers": len(steps["bnp"].handle.layers),
    }
    entry["step_bnp_aten_vs_plain"] = medians["bnp_aten"] / medians["plain"]
    entry["step_bnp_aten_vs_plain_per_round_quartiles"] = ratio_spread(times, "plain")["bnp_aten"]
    entry["transform_ms"] = transform_ms(steps["bnp"].handle.layers.values(), max(repeats, 5), device)
    return entry


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    repeats = args.repeats or (1 if args.quick else 9)
    results = {}
    for name in MODELS:
        entry = bench_model(name, args.quick, repeats, device)
        if entry is None:
            print(f"{name}: not available (distnorm.models missing)")
            continue
        results[name] = entry
        print(f"{name} {tuple(entry['input'])}: step ms {shown(entry['median_step_ms'])} -> "
              f"{entry['step_bnp_vs_plain']:.4f}x; memory {entry['memory_bytes']} -> "
              f"{entry['mem_bnp_vs_plain']:.4f}x ({entry['bnp_layers']} BNP layers)")
        if "transform_ms" in entry:
            print(f"  with {ATEN_ONLY[device.type]}=0: {entry['step_bnp_aten_vs_plain']:.4f}x; the gradient transform alone, "
                  f"ms: {shown(entry['transform_ms'])}")
    ratios = {
        "step_bnp_vs_plain": results["resnet18"]["step_bnp_vs_plain"],
        "mem_bnp_vs_plain": results["resnet18"]["mem_bnp_vs_plain"],
    }
    if "step_bnp_aten_vs_plain" in results["resnet18"]:
        ratios["step_bnp_aten_vs_plain"] = results["resnet18"]["step_bnp_aten_vs_plain"]
    if "resnet20" in results:
        ratios["step_bnp_vs_plain_resnet20"] = results["resnet20"]["step_bnp_vs_plain"]
        ratios["mem_bnp_vs_plain_resnet20"] = results["resnet20"]["mem_bnp_vs_plain"]
    payload = {"benchmark": "bnp", "machine": machine(), "device": str(device), "repeats": repeats,
               "models": results, "ratios": ratios}
    print(f"ratios: {json.dumps(shown(ratios, 4))}")
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    use_stable_allocator()
    main()
