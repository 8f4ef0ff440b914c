"""What two model choices cost in a training step, in one process: CBN's stem and BNP's biases.

    python bench/model_choices.py --json bench/results/model-choices-cpu.json
    python bench/model_choices.py --smoke                  # the small sizes, for the tests

Both layers cost more in a model than on their own, for a reason of the model, not of the
layer (``docs/reference/benchmarks.md``):

* **CBN's stem.** ``distnorm.convert`` puts a CBN before every convolution, the stem's too: a
  CBN on the image. Computed as ``conv(cbn(x))``, its gamma and beta need the stem
  convolution's gradient with respect to its input, which a BatchNorm after the stem never
  asks for; ``distnorm.PreNorm`` folds that CBN into the convolution instead
  (``distnorm._folding``). ``cbn`` is the model as converted (folded),
  ``cbn_stem_unfolded`` the stem as ``conv(cbn(x))``, ``cbn_stem_frozen`` the stem CBN's gamma
  and beta frozen (``requires_grad_(False)``: no gradient asked for, the floor). Against local
  BatchNorm; the zoo's ResNet-18 at ``bench/step.py``'s per-rank input.
* **BNP's biases.** ``distnorm.bnp.attach`` gives each bias-free layer a zero bias by default
  (``add_bias=True``), for the centring part of its preconditioner (paper 004): each
  convolution's backward then reduces its output gradient for that bias too.
  ``bnp_no_bias`` attaches with ``add_bias=False``. Against the plain step; torchvision's
  ResNet-18 at ``bench/bnp.py``'s input.

One SGD step each, timed in interleaved rounds (``bench/_common.interleaved_times``); the
median step and each variant's per-round ratio quartiles against its baseline.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

import distnorm
from distnorm import _folding
from _common import interleaved_times, machine, ratio_spread, shown, use_stable_allocator, write_json  # noqa: I001
from step import build

#: Each part: its model, and its input (batch, side) at full size and in the smoke sizes.
PARTS = {
    "cbn_stem": {"model": "resnet18 (distnorm.models)", "input": (8, 128), "smoke_input": (2, 32)},
    "bnp_biases": {"model": "resnet18 (torchvision)", "input": (16, 224), "smoke_input": (2, 32)},
}


def _cbn_models() -> dict[str, nn.Module]:
    models = {"local_bn": build("resnet18", "local_bn"), "cbn": build("resnet18", "cbn"),
              "cbn_stem_unfolded": build("resnet18", "cbn_unfolded"), "cbn_stem_frozen": build("resnet18", "cbn")}
    stem = next(m for m in models["cbn_stem_frozen"].modules() if isinstance(m, distnorm.PreNorm))
    stem.norm.requires_grad_(False)
    for name in ("cbn", "cbn_stem_unfolded", "cbn_stem_frozen"):
        distnorm.set_lr(models[name], 0.005)  # eta = 0.95: AMAT's history path, as bench/step.py
    return models


def _bnp_models() -> dict[str, nn.Module]:
    import torchvision

    models = {}
    for name, add_bias in (("plain", None), ("bnp", True), ("bnp_no_bias", False)):
        torch.manual_seed(0)
        models[name] = torchvision.models.resnet18(num_classes=1000)
        if add_bias is not None:
            distnorm.bnp.attach(models[name], add_bias=add_bias)
    return models


def _stem_folded(model: nn.Module, x: torch.Tensor) -> bool | None:
    """Whether the model's first CBN is folded into its convolution (None: no PreNorm)."""
    pre = next((m for m in model.modules() if isinstance(m, distnorm.PreNorm)), None)
    return None if pre is None else _folding.folds(pre.norm, pre.op, x)


def _frozen(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if not p.requires_grad]


def measure(part: str, models: dict[str, nn.Module], batch: int, side: int, classes: int, repeats: int) -> dict:
    """One SGD step of each model on the same batch, interleaved; the first model is the baseline."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 3, side, side, generator=gen), torch.randint(0, classes, (batch,), generator=gen)
    loss_fn = nn.CrossEntropyLoss()
    steps = {}
    for name, model in models.items():
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01, momentum=0.9)

        def step(model=model, opt=opt) -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()

        steps[name] = step
    times = interleaved_times(steps, repeats, torch.device("cpu"))
    base = next(iter(models))
    medians = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    return {
        "model": PARTS[part]["model"], "input": [batch, 3, side, side], "baseline": base,
        "median_step_ms": medians,
        "ratio": {name: ms / medians[base] for name, ms in medians.items() if name != base},
        "ratio_per_round_quartiles": ratio_spread(times, base),
        "parameters": {name: sum(1 for _ in model.parameters()) for name, model in models.items()},
        "frozen": {name: _frozen(model) for name, model in models.items()},
        "stem_folded": {name: _stem_folded(model, x) for name, model in models.items()},
    }


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="small inputs, 2 rounds (the tests)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 15; smoke 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: as each rank of bench/step.py)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = get_args_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (2 if args.smoke else 15)
    result = {"benchmark": "model_choices", "machine": machine(), "repeats": repeats, "parts": {}}
    for part, make, classes in (("cbn_stem", _cbn_models, 10), ("bnp_biases", _bnp_models, 1000)):
        batch, side = PARTS[part]["smoke_input" if args.smoke else "input"]
        result["parts"][part] = r = measure(part, make(), batch, side, classes, repeats)
        print(f"{part} {tuple(r['input'])}: step ms {shown(r['median_step_ms'])} -> {shown(r['ratio'], 4)} "
              f"vs {r['baseline']}")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    use_stable_allocator()
    main()
