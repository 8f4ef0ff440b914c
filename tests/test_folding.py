"""A CBN before a convolution whose input needs no gradient (the stem) is folded into it
(``distnorm._folding``): the float64 reference's values and gradients, one process and two
ranks, without the convolution's input gradient; and it folds only where that is safe.

Each test says the behaviour it holds; tests/README.md and tests/mutants.py name the bugs they catch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import distnorm
from distnorm import _folding
from distnorm import functional as F
from distnorm.convert import PreNorm
from tests import reference as ref
from tests.distributed import run_distributed

LRS = [0.2, 0.05, 0.005, 0.05]  # eta 0, 0.5, 0.95, 0.5: AMAT's no-history and history paths
ATOL = 1e-10
GAMMA, BETA = [0.7, 1.3, 1.0], [0.2, -0.4, 0.1]

#: (convolution, input shape after the batch dimension): the ResNet stem, 1-D and 3-D, a
#: padding mode the convolution applies itself, and no padding.
CONVS = {
    "2d-stem": (lambda: nn.Conv2d(3, 5, 7, stride=2, padding=3), (3, 11, 9)),
    "2d-reflect": (lambda: nn.Conv2d(3, 5, 3, padding=1, padding_mode="reflect"), (3, 6, 7)),
    "2d-unpadded": (lambda: nn.Conv2d(3, 5, 3, bias=False), (3, 6, 6)),
    "1d": (lambda: nn.Conv1d(3, 4, 5, stride=2, padding=2, dilation=2), (3, 13)),
    "3d": (lambda: nn.Conv3d(3, 2, 3, padding=1), (3, 4, 5, 3)),
}


def _pre_norm(kind: str, conv: str, group=None) -> PreNorm:
    torch.manual_seed(0)
    norm = (distnorm.CBN(3, rho=1.5, process_group=group) if kind == "cbn"
            else distnorm.POPNorm(3, process_group=group))
    pre = PreNorm(norm, CONVS[conv][0]()).double()
    with torch.no_grad():
        pre.norm.weight.copy_(torch.tensor(GAMMA, dtype=torch.float64))
        pre.norm.bias.copy_(torch.tensor(BETA, dtype=torch.float64))
    return pre


def _batch(step: int, n: int, tail: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch with per-channel offsets (so the mean ratios of AMAT are not 1) and the
    weights of a loss that reads every output element."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(n, *tail, generator=gen, dtype=torch.float64) * 1.5
    x = x + torch.tensor([2.0, -1.5, 0.01], dtype=torch.float64).view([1, -1] + [1] * (len(tail) - 1))
    return x, torch.randn(1, generator=gen, dtype=torch.float64)


class ConvInputGradients(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the batch size of every convolution backward that computes an input gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution_backward.default and args[-1][0]:
            self.batches.append(args[1].shape[0])
        return func(*args, **(kwargs or {}))


def _loss(y: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(-1.0, 2.0, y.numel(), dtype=y.dtype, device=y.device).view_as(y) + seed.to(y)
    return (y * weights).sum()


def _reference_run(pre: PreNorm, kind: str, conv: str, n: int, lrs=LRS):
    """The float64 reference of ``pre`` on the whole batch: ``tests.reference.cbn_train``,
    then the convolution, by autograd. Yields (y, grads, buffers) per step."""
    state = ref.CBNState(3)
    op = copy.deepcopy(pre.op)
    amat = kind == "cbn"
    for step, lr in enumerate(lrs):
        x, seed = _batch(step, n, CONVS[conv][1])
        gamma = torch.tensor(GAMMA, dtype=torch.float64, requires_grad=True)
        beta = torch.tensor(BETA, dtype=torch.float64, requires_grad=True)
        op.zero_grad()
        y = op(ref.cbn_train(x, gamma, beta, state, eta=F.amat_eta(lr, 10.0) if amat else 0.0,
                             rho=1.5 if amat else 4.0, amat=amat))
        _loss(y, seed).backward()
        grads = [gamma.grad, beta.grad] + [p.grad for p in op.parameters()]
        buffers = {"running_mean": state.running_mean, "running_var": state.running_var}
        if amat:
            buffers.update(amat_mean=state.amat_mean, amat_var=state.amat_var)
        yield y.detach(), grads, buffers


def _step(pre: PreNorm, x: torch.Tensor, seed: torch.Tensor, lr: float):
    distnorm.set_lr(pre, lr)
    pre.zero_grad()
    y = pre(x)
    _loss(y, seed).backward()
    return y.detach(), [p.grad for p in pre.parameters()]


@pytest.mark.parametrize("conv", list(CONVS))
@pytest.mark.parametrize("kind", ["cbn", "popnorm"])
def test_folded_stem_equals_the_float64_reference(kind, conv):
    """The folded stem equals the float64 reference at every step: its output, the gradients of
    gamma, beta, the weight and the bias, and the buffers. A fold that drops beta's path
    through the statistics (beta moves ``mean(x1^2)``), or the border terms of the padding,
    gives gradients off by percents."""
    pre = _pre_norm(kind, conv)
    for step, (y_ref, grads_ref, buffers_ref) in enumerate(_reference_run(pre, kind, conv, 6)):
        x, seed = _batch(step, 6, CONVS[conv][1])
        y, grads = _step(pre, x, seed, LRS[step])
        torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=0, msg=f"step {step}: output")
        for name, got, want in zip(["gamma", "beta", "weight", "bias"], grads, grads_ref):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=f"step {step}: {name}'s gradient")
        for name, want in buffers_ref.items():
            torch.testing.assert_close(getattr(pre.norm, name), want, atol=ATOL, rtol=0, msg=name)


def test_the_folded_stem_computes_no_input_gradient():
    """The folded stem computes no convolution gradient with respect to the images: the only
    input gradient is the one-image convolution's (batch 1), and the batch's (8) only when the
    images require one. Otherwise the stem CBN's gamma and beta ask for the stem convolution's
    gradient with respect to the images, a full convolution backward that BatchNorm's model
    never pays (``docs/reference/benchmarks.md``)."""
    x, seed = _batch(0, 8, CONVS["2d-stem"][1])
    for requires_grad, expected in ((False, [1]), (True, [8])):  # folded: only the one-image convolution's
        pre = _pre_norm("cbn", "2d-stem")
        with ConvInputGradients() as spy:
            _step(pre, x.clone().requires_grad_(requires_grad), seed, 0.05)
        assert spy.batches == expected, f"input requires grad: {requires_grad}"


def _convolutions(pre: PreNorm, x: torch.Tensor) -> int:
    calls = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(func is torch.ops.aten.convolution.default)
            return func(*args, **(kwargs or {}))

    with Count():
        pre(x)
    return sum(calls)


class _Conv2dSubclass(nn.Conv2d):
    pass


class _CBNSubclass(distnorm.CBN):
    pass


def test_it_folds_only_where_the_result_is_the_layers():
    """A stem is folded only where the result is what its layers compute: not around a hooked
    module's call (DeepSpeed ZeRO-3 gathers a convolution's weight in a pre-forward hook, FSDP2
    a CBN's; BNP reads the convolution's input in one), nor an instance's replaced ``forward``
    (Accelerate's ``cpu_offload``: folded, the weight stayed on ``meta`` and the output was
    garbage, without an error), nor a subclass's forward (timm's ``StdConv2d`` standardizes its
    weight), nor in eval, nor under ``no_grad`` where it saves nothing."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    x = _batch(0, 4, CONVS["2d-stem"][1])[0]
    assert _convolutions(_pre_norm("cbn", "2d-stem"), x) == 2  # folded: the batch and the one image

    def unfolded(pre: PreNorm, x: torch.Tensor = x) -> bool:
        return _convolutions(pre, x) == 1

    assert unfolded(_pre_norm("cbn", "2d-stem"), x.clone().requires_grad_())
    with torch.no_grad():
        assert unfolded(_pre_norm("cbn", "2d-stem"))
    for owner in ("op", "norm"):
        hooked = _pre_norm("cbn", "2d-stem")
        getattr(hooked, owner).register_forward_pre_hook(lambda module, args: None)
        assert unfolded(hooked), owner

    class Doubled(ModelHook):  # Accelerate's hooks replace the instance's forward
        def post_forward(self, module, output):
            return 2 * output

    for owner in ("op", "norm"):
        plain, accelerated = _pre_norm("cbn", "2d-stem"), _pre_norm("cbn", "2d-stem")
        add_hook_to_module(getattr(accelerated, owner), Doubled())
        assert not _folding.folds(accelerated.norm, accelerated.op, x), owner
        for pre in (plain, accelerated):
            distnorm.set_lr(pre, 0.2)
        expected = 2 * plain(x) if owner == "op" else plain.op(2 * plain.norm(x))
        torch.testing.assert_close(accelerated(x), expected, atol=1e-10, rtol=0, msg=owner)  # the hook ran
    grouped = PreNorm(distnorm.CBN(4), nn.Conv2d(4, 4, 3, groups=2))
    assert unfolded(grouped, torch.randn(4, 4, 5, 5))
    for subclass in (PreNorm(distnorm.CBN(3), _Conv2dSubclass(3, 4, 3)), PreNorm(_CBNSubclass(3), nn.Conv2d(3, 4, 3))):
        assert unfolded(subclass, torch.randn(4, 3, 5, 5))
    frozen = _pre_norm("cbn", "2d-stem")
    frozen.norm.requires_grad_(False)
    assert unfolded(frozen)
    assert unfolded(_pre_norm("cbn", "2d-stem").eval())
    with pytest.raises(TypeError, match="expected a torch.Tensor input"):
        _pre_norm("cbn", "2d-stem")([x])
    linear = PreNorm(distnorm.CBN(3), nn.Linear(3, 2))
    assert not _folding.folds(linear.norm, linear.op, torch.randn(4, 3))
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        assert unfolded(_pre_norm("cbn", "2d-stem"))  # a global hook runs for every module's call
    finally:
        handle.remove()


def _two_rank_worker(rank, world, kind, splits):
    pre = _pre_norm(kind, "2d-stem")
    lo, hi = sum(splits[:rank]), sum(splits[:rank + 1])
    buffers = None
    for step, (y_ref, grads_ref, buffers_ref) in enumerate(_reference_run(pre, kind, "2d-stem", sum(splits))):
        x, seed = _batch(step, sum(splits), CONVS["2d-stem"][1])
        distnorm.set_lr(pre, LRS[step])
        pre.zero_grad()
        y = pre(x[lo:hi])
        # the reference's loss on this rank's rows: the same weights, sliced
        weights = torch.linspace(-1.0, 2.0, y_ref.numel(), dtype=y.dtype).view_as(y_ref) + seed
        (y * weights[lo:hi]).sum().backward()
        torch.testing.assert_close(y.detach(), y_ref[lo:hi], atol=ATOL, rtol=0, msg=f"step {step}: output")
        grads = torch.cat([p.grad.flatten() for p in pre.parameters()])
        dist.all_reduce(grads)  # the sum of the ranks' gradients is the whole batch's
        want = torch.cat([g.flatten() for g in grads_ref])
        torch.testing.assert_close(grads, want, atol=ATOL, rtol=0, msg=f"step {step}: gradients")
        for name, value in buffers_ref.items():
            torch.testing.assert_close(getattr(pre.norm, name), value, atol=ATOL, rtol=0, msg=name)
        buffers = {k: v.clone() for k, v in pre.norm.state_dict().items()}
    return buffers


@pytest.mark.world_size(2)
@pytest.mark.parametrize("splits", [[3, 5], [4, 0]], ids=["3-5", "empty-rank"])
def test_folded_on_two_ranks_equals_one_process(tmp_path, splits):
    """The folded stem on two ranks, an empty rank included, equals one process on the whole
    batch: each rank's output is its rows of the reference's, the ranks' gradients sum to the
    whole batch's, and the buffers are the reference's on both. So the folded beta gradient
    sums over the rows the layer's does (a global sum where the layer's is local, or the
    reverse, misses the whole batch's by the other ranks' share), and a rank without samples
    runs no convolution kernel on an empty batch and still joins the statistics' collective
    (skipping it would leave the other rank waiting)."""
    b0, b1 = run_distributed(_two_rank_worker, 2, tmp_path, "cbn", splits)
    for name in b0:
        assert torch.equal(b0[name], b1[name]), f"{name} differs between the ranks"


def _stem_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 5 * 5, 3))
    return distnorm.convert(model, norm="cbn")


def _train(model: nn.Module, run=lambda model, x: model(x), steps=LRS) -> list[dict[str, torch.Tensor]]:
    states = []
    for step, lr in enumerate(steps):
        x = torch.randn(6, 3, 10, 10, generator=torch.Generator().manual_seed(step)) + 0.5
        distnorm.set_lr(model, lr)
        model.zero_grad()
        run(model, x).square().mean().backward()
        module = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
        state = {f"grad.{n}": p.grad.clone() for n, p in module.named_parameters()}
        state.update({f"buffer.{n}": b.clone() for n, b in module.named_buffers()})
        states.append(state)
    return states


@pytest.mark.processes  # torch.compile's workers
@pytest.mark.timeout(600)
def test_the_folded_stem_compiles_and_checkpoints_as_eager():
    """The folded stem trains compiled (``fullgraph=True``) as eager, to 1e-5, and under
    non-reentrant checkpointing bit for bit, leaving nothing in the stash. Before, the fold's
    stashed statistics were kept by nothing once the forward returned, so the checkpointed
    recomputation found no plan (or the stash grew a plan per step), and under
    ``torch.compile`` the fold traced a host decision into the graph."""
    model = _stem_model()
    assert isinstance(model[0], PreNorm)
    eager = _train(copy.deepcopy(model))
    compiled = _train(torch.compile(copy.deepcopy(model), fullgraph=True))
    ckpt_model = copy.deepcopy(model)
    checkpointed = _train(ckpt_model, lambda m, x: checkpoint(m, x, use_reentrant=False))
    assert len(ckpt_model[0].norm._state.stash) == 0  # nothing left behind
    for step, (e, c, k) in enumerate(zip(eager, compiled, checkpointed)):
        assert e.keys() == c.keys() == k.keys()
        for name in e:
            torch.testing.assert_close(c[name], e[name], atol=1e-5, rtol=1e-5, msg=f"compiled, step {step}: {name}")
            assert torch.equal(k[name], e[name]), f"checkpointed, step {step}: {name}"


def test_the_folded_stem_keeps_channels_last_and_bf16_autocast():
    """The folded stem keeps a channels_last output channels_last, though the one-image
    convolution's output is contiguous, and runs under bf16 autocast without meeting a float32
    operand it cannot cast. Values and gradients against the unfolded float32 layer: to float32
    rounding in channels_last, to bf16's under autocast."""
    model = _stem_model()
    distnorm.set_lr(model, 0.05)
    x = torch.randn(6, 3, 10, 10) + 0.5
    weights = torch.randn(6, 8, 5, 5)

    def run(stem: nn.Module, x: torch.Tensor, folded: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        y = stem(x) if folded else stem.op(stem.norm(x))
        (y.float() * weights).sum().backward()
        return y, [p.grad for p in stem.parameters()]

    y_ref, grads_ref = run(copy.deepcopy(model[0]), x, folded=False)
    cl = copy.deepcopy(model[0]).to(memory_format=torch.channels_last)
    y, grads = run(cl, x.to(memory_format=torch.channels_last), folded=True)
    assert y.is_contiguous(memory_format=torch.channels_last)
    for got, want in zip([y] + grads, [y_ref] + grads_ref):
        torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_bf16, grads_bf16 = run(copy.deepcopy(model[0]), x, folded=True)
    assert y_bf16.dtype == torch.bfloat16
    for got, want in zip([y_bf16] + grads_bf16, [y_ref] + grads_ref):
        torch.testing.assert_close(got.float(), want, atol=2e-2 * float(want.abs().max()), rtol=2e-2)
