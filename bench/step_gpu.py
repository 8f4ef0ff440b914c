"""One training step of the mission's models on one GPU: distnorm's layers against local
BatchNorm, eager, ``torch.compile``d and captured as CUDA graphs, in the same run.

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
``gn_torch`` / ``bnp_gn_torch``: PyTorch's GroupNorm in place of distnorm's (NCHW copies and
float32 under CUDA autocast; ``bench/step.py``'s ``TorchGroupNorm``). ``--variants`` keeps the order given
(local BN always first). Each runs in up to three modes (``--modes``): ``eager``;
``compile``, the model ``torch.compile``d in inductor's default mode; ``reduce_overhead``, the
model ``torch.compile(mode="reduce-overhead")``d (inductor's kernels replayed as CUDA graphs;
each step starts with ``torch.compiler.cudagraph_mark_step_begin()``). The optimizer step
stays eager. With another ``--compile-backend`` than inductor (the tests: ``eager``, dynamo's
tracing alone), ``compile`` uses that backend and ``reduce_overhead`` dynamo's ``cudagraphs``
backend (AOTAutograd and CUDA graph trees without inductor; on a CPU it captures nothing, and
counts the skip). ``--memory-format contiguous`` runs the models and the batch NCHW instead
of channels_last (CUDA's ``group_norm`` copies a channels_last input to NCHW:
``aten/src/ATen/native/group_norm.cpp``). One process: the synchronized layers have no peers
and skip their collectives, so this measures what the layers cost in compute and kernel
launches; ``bench/step.py`` measures the collectives under DDP.

The work comes in blocks, the models in the order given (ResNet-50 first by default) and
every eager block before any compiled one, so a run cut short keeps the cheap figures. A
model's eager block builds every variant eager, then times them round-robin (median of
``--repeats``; ``_common.interleaved_medians``), so machine noise hits all alike. Its compiled
block builds local BN eager and in every compiled mode asked (the baselines), then variant
by variant each compiled mode; right after a variant's builds it is timed round-robin with
the block's local BN members, so a run stopped mid-block keeps a ratio for every variant it
built, each against local BN timed in the same rounds. The compiled members of a block share
dynamo's cache for the model's ``forward`` (one entry each), so the recompile limit is raised
to :data:`RECOMPILE_LIMIT` (at 8, dynamo's default, a ninth entry would run eager unnoticed).
``--json`` is rewritten after every build and every timing (``"complete": false`` until the
end), so a killed run leaves what it finished.

Reported per variant and mode: median step ms; ``ratio_vs_local_bn_same_mode``, against local
BN in the same mode and rounds, the figure :data:`GOALS` bounds (lower is better), and
``ratio_vs_local_bn_eager``, with the two local BN medians they divide by; images/s (batch /
median step); ``first_step_s`` (compiled: the compile) and ``second_step_s``
(``reduce_overhead``: the CUDA graphs' capture); on CUDA ``peak_memory_bytes``, the most
``torch.cuda.max_memory_allocated`` reached in one step (reset before it) above what was
allocated before the variant was built (its parameters, gradients, optimizer state and
activations, and a CUDA graph's pool; not the input batch, not the other variants). For a
compiled mode, what dynamo did over the member's steps (``dynamo``, from
``torch._dynamo.utils.counters``, counted around each of its steps): the frames compiled at
its first step, its graphs, its graph breaks with their reasons, and its recompiles (frames
compiled at any later step: the AMAT buffers' initialisation, a guard on a Python value); for
``reduce_overhead`` also what inductor did with CUDA graphs (``cudagraphs``: the increase of
its ``cudagraph*`` counters, e.g. ``cudagraph_skips`` and ``cudagraph_partitions``, and its
messages, e.g. why it skipped). A member whose build, first steps or timing raises is recorded
with its ``error`` and the ``phase`` it was in, and the block goes on without it. Nothing in
the JSON is rounded (the printed table is).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import logging
import os
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from _common import interleaved_medians, machine, shown, synchronize  # noqa: I001  (sets sys.path)
from step import build  # noqa: I001

import distnorm
from distnorm import models
from distnorm._kernel_choice import triton_state

MODELS = ("resnet50", "resnet18", "efficientnet_b0")
#: Every variant, and the ones run when none are named.
VARIANTS = ("local_bn", "syncbn", "cbn", "popnorm", "bnp_gn", "cbn_unfolded", "bnp", "gn", "gn_torch", "bnp_gn_torch")
DEFAULT_VARIANTS = VARIANTS[:6]
MEMORY_FORMATS = {"channels_last": torch.channels_last, "contiguous": torch.contiguous_format}
MODES = ("eager", "compile", "reduce_overhead")
COMPILED_MODES = MODES[1:]
#: The goal for each mode's step against local BN's in the same mode (issue 55), None where
#: none is set: the report prints each ratio next to it.
GOALS = {"eager": None, "compile": 1.05, "reduce_overhead": 1.05}
#: The baseline variant: every ratio divides by its step in the same rounds.
BASELINE = "local_bn"
#: Dynamo's limit on compiled entries per code object, for the compiled blocks (see above).
RECOMPILE_LIMIT = 64
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
                        help=f"local_bn is always included, first (the baseline); default {list(DEFAULT_VARIANTS)}")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="eager blocks run before compiled ones; local BN is timed in every mode of a block "
                             "(the baselines)")
    parser.add_argument("--batch", type=int, help=f"default {FULL['batch']}")
    parser.add_argument("--size", type=int, help=f"input side in pixels, default {FULL['size']}")
    parser.add_argument("--repeats", type=int, help=f"timed steps per variant (median), default {FULL['repeats']}")
    parser.add_argument("--no-amp", dest="amp", action="store_false", help="float32 instead of bf16 autocast")
    parser.add_argument("--memory-format", choices=MEMORY_FORMATS, default="channels_last",
                        help="the layout of the models and the batch, default channels_last")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend (eager: tracing only; then reduce_overhead is dynamo's "
                             "cudagraphs backend)")
    parser.add_argument("--time-budget-s", type=float,
                        help="seconds for the run from its start: no build is started that the longest build of its "
                             "mode so far (x1.25) and a timing would not finish in; the rest is listed as not run, so "
                             "a caller's time limit ends the run cleanly (default: no limit)")
    parser.add_argument("--smoke", action="store_true", help=f"tiny run for the tests: {SMOKE}")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = get_args_parser()
    args = parser.parse_args(argv)
    for key, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.variants = [BASELINE, *dict.fromkeys(v for v in args.variants if v != BASELINE)]
    args.modes = [m for m in MODES if m in args.modes]  # eager first
    if min(args.batch, args.size, args.repeats) < 1:
        parser.error("--batch, --size and --repeats must be >= 1")
    if args.time_budget_s is not None and args.time_budget_s <= 0:
        parser.error(f"--time-budget-s must be > 0, got {args.time_budget_s}")
    return args


def compiled(model: nn.Module, mode: str, backend: str) -> nn.Module:
    """``model`` as ``mode`` runs it: itself, or compiled as the module docstring says."""
    if mode == "eager":
        return model
    if backend != "inductor":
        return torch.compile(model, backend=backend if mode == "compile" else "cudagraphs")
    return torch.compile(model, mode="reduce-overhead" if mode == "reduce_overhead" else None)


def compile_call(mode: str, backend: str) -> str:
    """The call :func:`compiled` makes for ``mode``, for the report."""
    if backend != "inductor":
        return f'torch.compile(model, backend="{backend if mode == "compile" else "cudagraphs"}")'
    return 'torch.compile(model, mode="reduce-overhead")' if mode == "reduce_overhead" else "torch.compile(model)"


def make_step(model: nn.Module, forward: nn.Module, x: torch.Tensor, y: torch.Tensor, amp: bool,
              cudagraphs: bool = False):
    """One SGD step of ``model`` through ``forward`` (the model itself or its compiled form);
    ``cudagraphs``: ``forward`` replays CUDA graphs, and each step is a new iteration of them."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        if cudagraphs:  # the last step's graph outputs are dead: their memory may be reused
            torch.compiler.cudagraph_mark_step_begin()
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


# ------------------------------------------------------------- what the compiler did
class CudagraphMessages(logging.Handler):
    """Inductor's log messages about CUDA graphs (why it skipped or split them), in order."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "cudagraph" in text.lower():
            self.messages.append(text)


def _counts() -> tuple[int, Counter, int, Counter]:
    """Dynamo's frames compiled, graph breaks by reason and graphs so far, and inductor's
    ``cudagraph*`` counters (``torch._dynamo.utils.counters``: process-wide totals)."""
    from torch._dynamo.utils import counters

    return (counters["frames"]["total"], Counter(counters["graph_break"]), counters["stats"]["unique_graphs"],
            Counter({k: v for k, v in counters["inductor"].items() if "cudagraph" in k}))


class Tracked:
    """A compiled member's step, counting what dynamo and inductor did while it ran: the
    counters' increase around each call is this member's (one step runs at a time). A few
    dictionary reads per step: microseconds against the milliseconds of a step."""

    def __init__(self, step: Callable[[], None], log: CudagraphMessages) -> None:
        self.step, self.log = step, log
        self.calls = self.frames_first_step = self.recompiles = self.graphs = 0
        self.graph_breaks: Counter = Counter()
        self.cudagraph_counters: Counter = Counter()
        self.cudagraph_messages: list[str] = []

    def __call__(self) -> None:
        frames, breaks, graphs, cudagraph = _counts()
        logged = len(self.log.messages)
        try:
            self.step()
        finally:
            frames_after, breaks_after, graphs_after, cudagraph_after = _counts()
            if self.calls == 0:
                self.frames_first_step += frames_after - frames
            else:  # a frame compiled at a later step: a recompile
                self.recompiles += frames_after - frames
            self.calls += 1
            self.graphs += graphs_after - graphs
            self.graph_breaks += breaks_after - breaks
            self.cudagraph_counters += cudagraph_after - cudagraph
            for text in self.log.messages[logged:]:
                if text[:500] not in self.cudagraph_messages and len(self.cudagraph_messages) < 5:
                    self.cudagraph_messages.append(text[:500])

    def facts(self, mode: str) -> dict:
        dynamo = {"frames_first_step": self.frames_first_step, "graphs": self.graphs,
                  "graph_breaks": sum(self.graph_breaks.values()),
                  "graph_break_reasons": {reason[:300]: n for reason, n in self.graph_breaks.most_common(5)},
                  "recompiles": self.recompiles, "steps": self.calls}
        if mode != "reduce_overhead":
            return {"dynamo": dynamo}
        return {"dynamo": dynamo, "cudagraphs": {"counters": dict(self.cudagraph_counters),
                                                 "messages": self.cudagraph_messages}}


# ----------------------------------------------------------------------------- blocks
@dataclass(eq=False)
class Member:
    """One (variant, mode) of a block: its step once built, and its JSON entry so far."""

    variant: str
    mode: str
    step: Callable[[], None] | None = None
    entry: dict = field(default_factory=dict)

    def fail(self, err: BaseException, phase: str) -> None:
        self.refresh()
        print(f"  {self.variant} {self.mode}: {phase} failed", flush=True)
        traceback.print_exception(err)
        self.entry.update(error=f"{type(err).__name__}: {err}"[:2000], phase=phase)
        self.step = None

    def refresh(self) -> None:
        if isinstance(self.step, Tracked):
            self.entry.update(self.step.facts(self.mode))


class MemberFailed(Exception):
    """A member's step raised while the block was timed."""

    def __init__(self, key: tuple[str, str], error: Exception) -> None:
        super().__init__(key, error)
        self.key, self.error = key, error


def _guarded(key: tuple[str, str], step: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            step()
        except Exception as err:  # noqa: BLE001 - any failure of a member is a fact to report
            raise MemberFailed(key, err) from err
    return run


def _timed_step(step: Callable[[], None], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - start


@dataclass
class TimeBudget:
    """``--time-budget-s``: whether a build of ``mode`` is likely to finish, with the block's
    timing after it, before the deadline (the longest build of that mode so far, x1.25, plus
    the longest timing so far; nothing known yet: it is tried)."""

    deadline: float | None
    builds_s: dict[str, float] = field(default_factory=dict)
    timing_s: float = 0.0

    def allows(self, *modes: str) -> bool:
        """Whether a build of each of ``modes``, one after the other, and a timing fit."""
        if self.deadline is None:
            return True
        need = 1.25 * sum(self.builds_s.get(mode, 0.0) for mode in modes) + self.timing_s
        return time.monotonic() + need < self.deadline

    def built(self, mode: str, seconds: float) -> None:
        self.builds_s[mode] = max(self.builds_s.get(mode, 0.0), seconds)


def build_member(name: str, variant: str, mode: str, args: argparse.Namespace, device: torch.device,
                 batch: tuple[torch.Tensor, torch.Tensor], log: CudagraphMessages) -> Member:
    """Build ``variant`` of model ``name`` in ``mode`` and run its first three steps: the
    first (compiled: the compile), the second (after the first step's lazy state: optimizer
    momentum, AMAT's history, autotuning; reduce_overhead: the CUDA graphs' capture) and one
    that measures the peak memory. A failure is recorded in the member's entry."""
    member = Member(variant, mode)
    phase = "build"
    before = _allocated(device)
    try:
        model = build(name, variant, num_classes=NUM_CLASSES).to(device, memory_format=MEMORY_FORMATS[args.memory_format])
        step = make_step(model, compiled(model, mode, args.compile_backend), *batch, args.amp,
                         cudagraphs=mode == "reduce_overhead")
        member.step = Tracked(step, log) if mode != "eager" else step
        phase = "first step"
        member.entry["first_step_s"] = _timed_step(member.step, device)
        phase = "second step"
        member.entry["second_step_s"] = _timed_step(member.step, device)
        phase = "peak memory step"
        member.entry["peak_memory_bytes"] = peak_step_bytes(member.step, device, before)
    except Exception as err:  # noqa: BLE001 - recorded, and the block goes on without it
        member.fail(err, phase)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return member
    member.refresh()
    return member


def time_members(members: list[Member], args: argparse.Namespace, device: torch.device) -> dict:
    """Median seconds per step of each member, round-robin; a member that raises is recorded
    and dropped, and the rest timed again."""
    live = {(m.variant, m.mode): m for m in members if m.step is not None}
    while live:
        try:
            return interleaved_medians({key: _guarded(key, m.step) for key, m in live.items()}, args.repeats,
                                       device, warmup=1)
        except MemberFailed as failed:
            live.pop(failed.key).fail(failed.error, "timing")
    return {}


def _fill(member: Member, medians: dict, batch: int) -> None:
    t = medians[member.variant, member.mode]
    same, eager = medians.get((BASELINE, member.mode)), medians.get((BASELINE, "eager"))
    member.entry.update({
        "median_step_ms": t * 1e3,
        "ratio_vs_local_bn_same_mode": t / same if same else None,
        "ratio_vs_local_bn_eager": t / eager if eager else None,
        "local_bn_same_mode_ms": same * 1e3 if same else None,
        "local_bn_eager_ms": eager * 1e3 if eager else None,
        "images_per_s": batch / t,
    })


def block_groups(modes: list[str], variants: list[str]) -> list[list[tuple[str, str]]]:
    """The (variant, mode) members of a block in ``modes``, in the groups built and then
    timed together (see the module docstring)."""
    if modes == ["eager"]:  # builds take seconds: all of them, then one timing
        return [[(variant, "eager") for variant in variants]]
    # builds take a minute: each variant timed as soon as it is built, against the baselines
    return [[(BASELINE, "eager"), *[(BASELINE, mode) for mode in modes]],
            *[[(variant, mode) for mode in modes] for variant in variants if variant != BASELINE]]


def run_block(name: str, modes: list[str], args: argparse.Namespace, device: torch.device, budget: TimeBudget,
              built: Callable[[Member], None], done: Callable[[Member], None]) -> list[tuple[str, str]]:
    """Model ``name``'s block in ``modes`` (``["eager"]``, or compiled modes: local BN eager is
    added as a baseline, timed in every round and not reported: the eager block reports it).
    ``built(member)`` is called after the build of each member in ``modes``, ``done(member)``
    whenever the entry of a member in ``modes`` changed (timed, failed, its compile counts after a later timing).
    Returns the members in ``modes`` not built for want of time (``budget``): from the first
    refused on, none is built."""
    groups = block_groups(modes, args.variants)
    if not budget.allows(*{mode for _, mode in groups[0]}):  # not even the first group (the baselines)
        return [key for group in groups for key in group if key[1] in modes]
    gen = torch.Generator().manual_seed(0)
    layout = MEMORY_FORMATS[args.memory_format]
    x = torch.randn(args.batch, 3, args.size, args.size, generator=gen).to(device, memory_format=layout)
    y = torch.randint(0, NUM_CLASSES, (args.batch,), generator=gen).to(device)
    log = CudagraphMessages()
    inductor_log = logging.getLogger("torch._inductor")
    inductor_log.addHandler(log)
    baselines: list[Member] = []
    not_run: list[tuple[str, str]] = []
    try:
        for group in groups:
            members = []
            for variant, mode in group:
                if not_run or not budget.allows(mode):
                    not_run.append((variant, mode))
                    continue
                start = time.monotonic()
                member = build_member(name, variant, mode, args, device, (x, y), log)
                budget.built(mode, time.monotonic() - start)
                first = member.entry.get("first_step_s")
                print(f"  {name} {variant} {mode}: first step {'failed' if first is None else f'{first:.1f} s'}"
                      + "".join(f", {k} {v}" for k, v in member.entry.get("dynamo", {}).items()
                                if k in ("graph_breaks", "recompiles")), flush=True)
                members.append(member)
                if mode in modes:  # not a compiled block's eager baseline: the eager block reports it
                    built(member)
            if not members:
                continue
            timed = members if not baselines else [*baselines, *members]
            baselines = baselines or members
            start = time.monotonic()
            medians = time_members(timed, args, device)
            budget.timing_s = max(budget.timing_s, time.monotonic() - start)
            for member in timed:
                member.refresh()
                if (member.variant, member.mode) in medians and member in members:
                    _fill(member, medians, args.batch)
                if member.mode in modes:
                    done(member)
    finally:
        inductor_log.removeHandler(log)
    return [key for key in not_run if key[1] in modes]


# ----------------------------------------------------------------------------- output
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


def ratios(results: dict) -> dict[str, float]:
    """The flat list of ratios: each step against local BN eager, and each compiled step of a
    distnorm variant against local BN in its mode (``step_<variant>_<mode>_vs_local_bn_<mode>_<model>``)."""
    flat = {}
    for model, r in results.items():
        for variant, modes in r["variants"].items():
            for mode, e in modes.items():
                if e.get("ratio_vs_local_bn_eager") is not None and (variant, mode) != (BASELINE, "eager"):
                    flat[f"step_{variant}_{mode}_vs_local_bn_eager_{model}"] = e["ratio_vs_local_bn_eager"]
                if mode != "eager" and variant != BASELINE and e.get("ratio_vs_local_bn_same_mode") is not None:
                    flat[f"step_{variant}_{mode}_vs_local_bn_{mode}_{model}"] = e["ratio_vs_local_bn_same_mode"]
    return flat


def _row(variant: str, mode: str, e: dict) -> str:
    if "error" in e:
        return f"  {variant:12s} {mode:15s} failed at its {e['phase']}: {e['error'].splitlines()[0][:120]}"
    mem = f"{e['peak_memory_bytes'] / 2**30:.2f} GiB" if e.get("peak_memory_bytes") is not None else "n/a"
    same = e["ratio_vs_local_bn_same_mode"]
    goal = GOALS[mode]
    text = (f"  {variant:12s} {mode:15s} {e['median_step_ms']:10.2f} ms  x{same:.3f} local BN {mode}"
            if same is not None else f"  {variant:12s} {mode:15s} {e['median_step_ms']:10.2f} ms  (no local BN {mode})")
    text += f" (goal {goal:.2f})" if goal is not None and variant != BASELINE else ""
    eager = e["ratio_vs_local_bn_eager"]
    text += f"  x{eager:.3f} local BN eager" if eager is not None and mode != "eager" else ""
    text += f"  {e['images_per_s']:9.1f} img/s  peak {mem}"
    if "dynamo" in e:
        text += f"  graph breaks {e['dynamo']['graph_breaks']}, recompiles {e['dynamo']['recompiles']}"
    if "cudagraphs" in e:
        text += f", cudagraph counters {e['cudagraphs']['counters'] or '{}'}"
    return text


def main(argv=None) -> dict:
    start = time.monotonic()
    args = parse_args(argv)
    device = torch.device(args.device)
    out_of_time = f"out of time: --time-budget-s {args.time_budget_s:g} would have run out first" \
        if args.time_budget_s is not None else ""
    skipped = {}
    if any(m in args.modes for m in COMPILED_MODES) and device.type == "cuda" and args.compile_backend == "inductor" \
            and importlib.util.find_spec("triton") is None:
        for mode in COMPILED_MODES:
            if mode in args.modes:
                args.modes.remove(mode)
                skipped[mode] = "inductor on CUDA needs triton, which is not installed"
                print(f"{mode}: skipped ({skipped[mode]})")
    compiled_modes = [m for m in args.modes if m in COMPILED_MODES]
    limit = None
    if compiled_modes:  # see the module docstring: the members of a block share forward's cache
        name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        limit = max(getattr(torch._dynamo.config, name), RECOMPILE_LIMIT)
        setattr(torch._dynamo.config, name, limit)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # as training recipes do; the warm-up steps absorb the tuning
    results = {name: {"input": [args.batch, 3, args.size, args.size], "variants": {}} for name in args.models}
    payload = {
        "benchmark": "step_gpu",
        "machine": machine(),
        "device": str(device),
        "config": {"batch": args.batch, "size": args.size, "repeats": args.repeats, "amp": "bf16" if args.amp else None,
                   "channels_last": args.memory_format == "channels_last", "optimizer": "SGD(lr=0.01, momentum=0.9, weight_decay=1e-4)",
                   "compile_backend": args.compile_backend, "cudnn_benchmark": device.type == "cuda",
                   "compiled_as": {mode: compile_call(mode, args.compile_backend) for mode in compiled_modes},
                   "recompile_limit": limit, "time_budget_s": args.time_budget_s,
                   "smoke": args.smoke, "models": args.models, "variants": args.variants, "modes": args.modes},
        "goals": {mode: GOALS[mode] for mode in args.modes},
        "complete": False,
        "built": [],  # every build as it finishes: what a run cut short got as far as
        "not_run": [],  # members not built for want of time (--time-budget-s)
        "models": results,
        "skipped": skipped,
        "ratios": {},
    }

    def save() -> None:
        payload["ratios"] = ratios(results)
        write_atomically(args.json, payload)

    def built(name: str, member: Member) -> None:
        payload["built"].append({"model": name, "variant": member.variant, "mode": member.mode,
                                 "first_step_s": member.entry.get("first_step_s"),
                                 **({"error": member.entry["error"]} if "error" in member.entry else {})})
        save()

    def done(name: str, member: Member) -> None:
        results[name]["variants"].setdefault(member.variant, {})[member.mode] = member.entry
        save()

    blocks = [(name, ["eager"]) for name in args.models if "eager" in args.modes]
    blocks += [(name, compiled_modes) for name in args.models if compiled_modes]
    budget = TimeBudget(None if args.time_budget_s is None else start + args.time_budget_s)
    for name, modes in blocks:  # every eager block before any compiled one
        if payload["not_run"]:  # out of time: none of the rest is started
            payload["not_run"] += [{"model": name, "variant": v, "mode": m, "reason": out_of_time}
                                   for group in block_groups(modes, args.variants) for v, m in group if m in modes]
            continue
        refused = run_block(name, modes, args, device, budget, lambda m, name=name: built(name, m),
                            lambda m, name=name: done(name, m))
        payload["not_run"] += [{"model": name, "variant": v, "mode": m, "reason": out_of_time} for v, m in refused]
        if modes != ["eager"]:
            torch._dynamo.reset()  # this model's compiled code and CUDA graphs: free them, and the cache's slots
        if device.type == "cuda":
            torch.cuda.empty_cache()
        payload["triton"] = _triton_state(device)  # after steps: what ran, for a report a kill cuts short
        save()
    payload["complete"] = True
    payload["triton"] = _triton_state(device)
    for name, r in results.items():
        print(f"{name} {tuple(r['input'])}:")
        for variant, modes in r["variants"].items():
            for mode, e in modes.items():
                print(_row(variant, mode, e))
    for skipped_member in payload["not_run"]:
        print(f"  not run: {skipped_member['model']} {skipped_member['variant']} {skipped_member['mode']} "
              f"({skipped_member['reason']})")
    print(f"ratios: {json.dumps(shown(payload['ratios'], 4))}")
    save()
    if args.json:
        print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()  # no _common.use_stable_allocator(): the GPU's memory comes from PyTorch's caching allocator
