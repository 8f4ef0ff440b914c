"""Probe: the autograd engine's device threads and CBN's host cost on CUDA (temporary)."""
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import interleaved_medians  # noqa: E402
from layers import layer_steps, make_layers  # noqa: E402
from step import build  # noqa: E402
from step_gpu import make_step  # noqa: E402

dev = torch.device(os.environ.get("DEV", "cuda"))


def with_mt(step, mt):
    def run():
        prev = torch._C._is_multithreading_enabled()
        torch._C._set_multithreading_enabled(mt)
        try:
            step()
        finally:
            torch._C._set_multithreading_enabled(prev)
    return run


class Ident(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


layers = {k: v for k, v in make_layers(64, dev).items() if k in ("batchnorm2d", "cbn")}
steps, x, grad = layer_steps(layers, [8, 64, 8, 8], channels_last=True, device=dev)
steps["py_identity"] = lambda: Ident.apply(x).backward(grad)
steps["cpp_identity"] = lambda: x.clone().backward(grad)
runs = {(n, mt): with_mt(s, mt) for n, s in steps.items() for mt in (True, False)}
for s in runs.values():
    for _ in range(5):
        s()
times = {k: [] for k in runs}
for r in range(7):
    for k, s in runs.items():
        torch.cuda.synchronize() if dev.type == "cuda" else None
        t = time.perf_counter()
        for _ in range(200):
            s()
        torch.cuda.synchronize() if dev.type == "cuda" else None
        times[k].append((time.perf_counter() - t) / 200 * 1e6)
layer_us = {f"{n}|{'threads' if mt else 'caller'}": round(statistics.median(v), 1) for (n, mt), v in times.items()}
print("host us per layer step:", json.dumps(layer_us), flush=True)
out = {"layer_host_us": layer_us}
gen = torch.Generator().manual_seed(0)
torch.backends.cudnn.benchmark = True
for model_name in os.environ.get("MODELS", "resnet18 resnet50").split():
    xb = torch.randn(256, 3, 224, 224, generator=gen).to(dev, memory_format=torch.channels_last)
    yb = torch.randint(0, 1000, (256,), generator=gen).to(dev)
    msteps = {}
    for variant in ("local_bn", "cbn"):
        model = build(model_name, variant, num_classes=1000).to(dev, memory_format=torch.channels_last)
        step = make_step(model, model, xb, yb, True)
        step(); step()
        for mt in (True, False):
            msteps[f"{variant}|{'threads' if mt else 'caller'}"] = with_mt(step, mt)
    med = interleaved_medians(msteps, 10, dev, warmup=1)
    base = med["local_bn|threads"]
    out[model_name] = {k: [round(v * 1e3, 2), round(v / base, 3)] for k, v in med.items()}
    print(model_name, "ms, x local_bn threads:", json.dumps(out[model_name]), flush=True)
    del msteps, model
    torch.cuda.empty_cache() if dev.type == "cuda" else None
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "engine.json"), "w"), indent=1)
