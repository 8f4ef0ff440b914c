"""One training step of the mission's models on one GPU: distnorm's layers against local
BatchNorm, eager and ``torch.compile``d, in the same run.

    python bench/step_gpu.py --json bench/results/step-gpu.json [--models resnet50] [--modes eager]
    python bench/step_gpu.py --smoke --device cpu --modes eager    # tiny sizes, for the tests

ResNet-50, ResNet-18 and EfficientNet-B0 (torchvision, 1000 classes, their own activations)
at 224 px, batch 256, bf16 autocast, channels_last, SGD (momentum 0.9, weight decay 1e-4,
lr 0.01 so that AMAT's eta = 0.9: CBN's history path, the most expensive one; ``set_lr`` is
called before every step, as a recipe does), by default in six variants built by ``bench/step.py``'s
``build``: PyTorch's local ``nn.BatchNorm2d`` (the model as built: the baseline), distnorm's
``SyncBatchNorm`` (``norm="bn"``), CBN, POP-Norm, GroupNorm + BNP (``norm="gn"`` then
``bnp.attach``), and CBN with its stem computed as ``conv(cbn(x))`` (``cbn_unfolded``: what
folding the stem CBN into its convolution saves, ``distnorm._folding``); on request also
``bnp`` (local BN + BNP) and ``gn`` (GroupNorm alone), which take GN + BNP apart, and
``gn_lowp`` / ``bnp_gn_lowp``: GroupNorm in the autocast dtype instead of CUDA autocast's
float32 (``bench/step.py``'s ``LowPrecisionGroupNorm``). Each runs
eager and with the model ``torch.compile``d (the optimizer step stays eager).
``--memory-format contiguous`` runs the models and the batch NCHW instead of channels_last
(CUDA's ``group_norm`` copies a channels_last input to NCHW:
``aten/src/ATen/native/group_norm.cpp``). One process: the synchronized layers have no peers
and skip their collectives, so this measures what the layers cost in compute and kernel
launches; ``bench/step.py`` measures the collectives under DDP.

The work comes in blocks, every eager block before any compiled one and the models in the
order given (ResNet-50 first by default), so a run cut short keeps the cheap figures: a
model's eager block builds every variant eager; its compiled block builds local BN eager
(the baseline) and every variant compiled. In a block each model is built once and kept, and
the steps are timed round-robin (median of ``--repeats``; ``_common.interleaved_medians``),
so machine noise hits all alike (the compiled variants of a model share dynamo's cache for
the model's ``forward``: one entry each, within its recompile limit of 8; no recompiles
after the first step). ``--json`` is rewritten after every build and every block
(``"complete": false`` until the end), so a killed run leaves what it finished.
Reported per variant and mode: median step ms, ``ratio_vs_local_bn_eager`` (against local BN
eager timed in the same block; lower is better), images/s (batch / median step),
``first_step_s`` (for a compiled variant: the compile), and on CUDA ``peak_memory_bytes``: the most
``torch.cuda.max_memory_allocated`` reached in one step (reset before it) above what was
allocated before the variant was built (its parameters, gradients, optimizer state and
activations; not the input batch, not the other variants).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from _common import interleaved_medians, machine, shown, synchronize  # noqa: I001  (sets sys.path)
from step import build  # noqa: I001

import distnorm
from distnorm import models
from distnorm._fused import triton_state

MODELS = ("resnet50", "resnet18", "efficientnet_b0")
#: Every variant, and the ones run when none are named.
VARIANTS = ("local_bn", "syncbn", "cbn", "popnorm", "bnp_gn", "cbn_unfolded", "bnp", "gn", "gn_lowp", "bnp_gn_lowp")
DEFAULT_VARIANTS = VARIANTS[:6]
MEMORY_FORMATS = {"channels_last": torch.channels_last, "contiguous": torch.contiguous_format}
MODES = ("eager", "compile")
BASELINE = ("local_bn", "eager")
LR = 0.01
NUM_CLASSES = 1000
#: Sizes of a real run, and of --smoke: the zoo's CIFAR ResNet-20, tiny inputs (the same
#: variants and code paths, in seconds on a CPU). Options given on the command line win.
FULL = {"models": list(MODELS), "batch": 256, "size": 224, "repeats": 10}
SMOKE = {"models": ["resnet20"], "batch": 2, "size": 32, "repeats": 1}


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", choices=models.available(), help=f"default {FULL['models']}")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS),
                        help=f"local_bn is always included (the baseline); default {list(DEFAULT_VARIANTS)}")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="eager blocks run before compiled ones; local BN eager is timed in every block (the baseline)")
    parser.add_argument("--batch", type=int, help=f"default {FULL['batch']}")
    parser.add_argument("--size", type=int, help=f"input side in pixels, default {FULL['size']}")
    parser.add_argument("--repeats", type=int, help=f"timed steps per variant (median), default {FULL['repeats']}")
    parser.add_argument("--no-amp", dest="amp", action="store_false", help="float32 instead of bf16 autocast")
    parser.add_argument("--memory-format", choices=MEMORY_FORMATS, default="channels_last",
                        help="the layout of the models and the batch, default channels_last")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (eager: tracing only)")
    parser.add_argument("--smoke", action="store_true", help=f"tiny run for the tests: {SMOKE}")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = get_args_parser()
    args = parser.parse_args(argv)
    for key, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.variants = ["local_bn", *[v for v in args.variants if v != "local_bn"]]
    args.modes = [m for m in MODES if m in args.modes]  # eager first
    if min(args.batch, args.size, args.repeats) < 1:
        parser.error("--batch, --size and --repeats must be >= 1")
    return args


def make_step(model: nn.Module, forward: nn.Module, x: torch.Tensor, y: torch.Tensor, amp: bool):
    """One SGD step of ``model`` through ``forward`` (the model itself or its compiled form)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        distnorm.set_lr(model, LR)  # AMAT follows the optimizer's lr: every step, as in a recipe
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
            loss = loss_fn(forward(x), y)
        loss.backward()
        optimizer.step()

    return step


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def peak_step_bytes(step, device: torch.device, before: int) -> int | None:
    """Peak allocated during one ``step`` above ``before``; None without CUDA allocator stats."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def run_block(name: str, mode: str, args: argparse.Namespace, device: torch.device, built) -> dict:
    """Build every variant of model ``name`` in ``mode`` (and, for a compiled block, local BN
    eager as the baseline), then time them round-robin. ``built(variant, mode, first_step_s)``
    is called after each build."""
    gen = torch.Generator().manual_seed(0)
    layout = MEMORY_FORMATS[args.memory_format]
    x = torch.randn(args.batch, 3, args.size, args.size, generator=gen).to(device, memory_format=layout)
    y = torch.randint(0, NUM_CLASSES, (args.batch,), generator=gen).to(device)
    members = [(variant, mode) for variant in args.variants]
    if BASELINE not in members:
        members.insert(0, BASELINE)
    steps, first, peak = {}, {}, {}
    for variant, member_mode in members:
        before = _allocated(device)
        model = build(name, variant, num_classes=NUM_CLASSES).to(device, memory_format=layout)
        forward = torch.compile(model, backend=args.compile_backend) if member_mode == "compile" else model
        step = make_step(model, forward, x, y, args.amp)
        start = time.perf_counter()
        step()  # compiled: the compile
        synchronize(device)
        first[variant, member_mode] = time.perf_counter() - start
        step()  # after the first step's lazy state (optimizer momentum, AMAT history, autotuning)
        peak[variant, member_mode] = peak_step_bytes(step, device, before)
        steps[variant, member_mode] = step
        print(f"  {name} {variant} {member_mode}: first step {first[variant, member_mode]:.1f} s", flush=True)
        built(variant, member_mode, first[variant, member_mode])
    medians = interleaved_medians(steps, args.repeats, device, warmup=1)
    base = medians[BASELINE]
    table = {variant: {member_mode: {"median_step_ms": medians[variant, member_mode] * 1e3,
                                     "ratio_vs_local_bn_eager": medians[variant, member_mode] / base,
                                     "images_per_s": args.batch / medians[variant, member_mode],
                                     "peak_memory_bytes": peak[variant, member_mode],
                                     "first_step_s": first[variant, member_mode]}}
             for variant, member_mode in steps if member_mode == mode}
    return {"baseline_ms": base * 1e3, "variants": table}


def write_atomically(path: str | None, payload: dict) -> None:
    """Write ``payload`` as JSON to ``path`` (if given) through a temporary file and a rename,
    so that a run killed mid-write leaves the previous version, never half a file."""
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, target)


def _triton_state(device: torch.device) -> dict | None:
    """Whether distnorm's fused operators run their Triton kernels on ``device`` (what the
    group agreed at its first synchronized step, else this process's own verdict; a Triton
    that cannot run raises, it is never replaced silently), why not, and the Triton version;
    None on other devices."""
    if device.type != "cuda":
        return None
    version = importlib.metadata.version("triton") if importlib.util.find_spec("triton") else None
    state = triton_state(device=device)
    return {"triton": version, "distnorm_fused_ops_on_triton": state.used, "reason": state.reason}


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    skipped = {}
    if "compile" in args.modes and device.type == "cuda" and args.compile_backend == "inductor" \
            and importlib.util.find_spec("triton") is None:
        args.modes.remove("compile")
        skipped["compile"] = "inductor on CUDA needs triton, which is not installed"
        print(f"compile: skipped ({skipped['compile']})")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # as training recipes do; the warm-up steps absorb the tuning
    results = {name: {"input": [args.batch, 3, args.size, args.size], "variants": {}, "baseline_ms": {}}
               for name in args.models}
    payload = {
        "benchmark": "step_gpu",
        "machine": machine(),
        "device": str(device),
        "config": {"batch": args.batch, "size": args.size, "repeats": args.repeats, "amp": "bf16" if args.amp else None,
                   "channels_last": args.memory_format == "channels_last", "optimizer": "SGD(lr=0.01, momentum=0.9, weight_decay=1e-4)",
                   "compile_backend": args.compile_backend, "cudnn_benchmark": device.type == "cuda",
                   "smoke": args.smoke, "models": args.models, "variants": args.variants, "modes": args.modes},
        "complete": False,
        "built": [],  # every build as it finishes: what a run cut short got as far as
        "models": results,
        "skipped": skipped,
        "ratios": {},
    }

    def built(name: str, variant: str, mode: str, first_step_s: float) -> None:
        payload["built"].append({"model": name, "variant": variant, "mode": mode, "first_step_s": first_step_s})
        write_atomically(args.json, payload)

    for mode in args.modes:  # every eager block before any compiled one
        for name in args.models:
            block = run_block(name, mode, args, device, lambda v, m, s, name=name: built(name, v, m, s))
            results[name]["baseline_ms"][mode] = block["baseline_ms"]
            for variant, entry in block["variants"].items():
                results[name]["variants"].setdefault(variant, {}).update(entry)
            if mode == "compile":
                torch._dynamo.reset()  # this model's compiled code: free it, and its cache slots
            if device.type == "cuda":
                torch.cuda.empty_cache()
            payload["ratios"] = {f"step_{variant}_{m}_vs_local_bn_eager_{model}": entry["ratio_vs_local_bn_eager"]
                                 for model, r in results.items() for variant, modes in r["variants"].items()
                                 for m, entry in modes.items() if (variant, m) != BASELINE}
            payload["triton"] = _triton_state(device)  # after steps: what ran, for a report a kill cuts short
            write_atomically(args.json, payload)
    payload["complete"] = True
    payload["triton"] = _triton_state(device)
    for name, r in results.items():
        print(f"{name} {tuple(r['input'])}:")
        for variant, modes in r["variants"].items():
            for mode, e in modes.items():
                mem = f"{e['peak_memory_bytes'] / 2**30:.2f} GiB" if e["peak_memory_bytes"] is not None else "n/a"
                print(f"  {variant:9s} {mode:8s} {e['median_step_ms']:10.2f} ms  x{e['ratio_vs_local_bn_eager']:.3f}  "
                      f"{e['images_per_s']:9.1f} img/s  peak {mem}")
    print(f"ratios: {json.dumps(shown(payload['ratios'], 4))}")
    write_atomically(args.json, payload)
    if args.json:
        print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()  # no _common.use_stable_allocator(): the GPU's memory comes from PyTorch's caching allocator
