"""Every call distnorm makes into ATen's batch-norm kernels meets the contract of the CUDA
kernel, checked on the CPU by :class:`tests.dispatch.CudaContractChecker`.

The CPU kernels accept more than their CUDA twins (an empty batch, undefined
``save_mean``, mixed parameter dtypes), so a CPU-only suite passes calls that fail on the
first GPU run. Each path a user takes is exercised here under the checker: every layer,
every input dtype, inputs of 2 to 5 dims in every memory layout (channels_last,
channels_last_3d, sliced), training forward and backward, evaluation, the functional API,
an empty batch in evaluation and an empty rank in synchronized training.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import distnorm
from distnorm import functional
from tests.dispatch import CudaContractChecker

#: The CPU's kernels with the arguments CUDA's take: the backward's element-wise pass, the
#: forward's output and the backward's local sums.
ELEMT = "distnorm.batch_norm_backward_elemt.default"
OUTPUT = "distnorm.batch_norm_elemt.default"
SUMS = "distnorm.batch_norm_backward_reduce.default"
from tests.distributed import run_distributed

LAYERS = {
    "cbn": lambda c: distnorm.CBN(c, rho=1.5),
    "popnorm": lambda c: distnorm.POPNorm(c),
    "syncbn": lambda c: distnorm.SyncBatchNorm(c),
    "syncbn_no_affine": lambda c: distnorm.SyncBatchNorm(c, affine=False),
}


def _layout(name: str, channels: int, batch: int = 4) -> torch.Tensor:
    """An input of the named layout: dims 2-5, channels_last(_3d), or a non-contiguous slice."""
    gen = torch.Generator().manual_seed(0)
    shape = {"2d": (batch, channels), "3d": (batch, channels, 7), "4d": (batch, channels, 5, 5),
             "channels_last": (batch, channels, 5, 5), "channels_last_3d": (batch, channels, 3, 4, 4),
             "sliced": (batch, channels, 5, 10)}[name]
    x = torch.randn(*shape, generator=gen) * 2 + 1
    if name == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    elif name == "channels_last_3d":
        x = x.to(memory_format=torch.channels_last_3d)
    elif name == "sliced":
        x = x[..., ::2]
        assert batch == 0 or not x.is_contiguous()
    return x


LAYOUTS = ["2d", "3d", "4d", "channels_last", "channels_last_3d", "sliced"]


def _exercise(layer: nn.Module, dtype: torch.dtype, x: torch.Tensor, lr: float) -> CudaContractChecker:
    """One initialising step, then a checked training step (forward and backward) and a
    checked evaluation, on the given input."""
    layer = layer.to(torch.float64 if dtype == torch.float64 else torch.float32)
    distnorm.set_lr(layer, lr)
    x = x.to(dtype)
    layer(x)  # initialise AMAT: the second step takes the history path
    x = x.detach().requires_grad_()
    with CudaContractChecker() as checker:
        y = layer(x)
        y.float().square().sum().backward()
        layer.eval()
        layer(x.detach())
    return checker


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_call_meets_the_cuda_kernel_contract(kind, dtype):
    """Every batch-norm kernel call a layer makes, in every layout, with and without AMAT
    history, meets the CUDA kernels' argument contract, and the paths are taken (the output
    and the local sums once each, by the CPU's twins of CUDA's kernels, unsynchronized BN's
    backward by ATen's; the one-pass element-wise backward where it applies). Before,
    native_batch_norm_backward was called with undefined save_mean / weight: every CUDA
    backward failed with 'save_mean should always be defined'."""
    for layout in LAYOUTS:
        for lr in (0.2, 0.01):  # no AMAT history, history
            checker = _exercise(LAYERS[kind](6), dtype, _layout(layout, 6), lr)
            assert checker.violations == [], (layout, lr, checker.violations)
            local_bn = kind.startswith("syncbn")  # one process: ATen's training backward
            assert checker.calls[OUTPUT] == 1, layout  # the paths were taken
            assert checker.calls[SUMS] == (0 if local_bn else 1), layout
            assert checker.calls["aten.native_batch_norm_backward.default"] == (1 if local_bn else 0), layout
            # the one-pass element-wise backward (CUDA's kernel, here its CPU twin), checked
            # against CUDA's contract; unsynchronized BN runs ATen's training backward instead
            assert checker.calls[ELEMT] == (0 if kind.startswith("syncbn") else 1), layout


@pytest.mark.parametrize("kind", list(LAYERS))
def test_an_empty_batch_calls_no_kernel_that_cuda_rejects(kind):
    """Evaluation on an empty batch, in every layout, calls no kernel that CUDA rejects and
    gives an output and an input gradient of the input's shape, and zero weight gradients.
    Before, it called native_batch_norm with N = 0, which CUDA's kernels reshape to (0, C, -1)
    and reject (the CPU kernel returns early)."""
    layer = LAYERS[kind](6)
    distnorm.set_lr(layer, 0.01)
    layer(_layout("4d", 6))  # trained once: AMAT and running statistics are set
    layer.eval()
    for layout in LAYOUTS:
        x = _layout(layout, 6, batch=0).requires_grad_()
        with CudaContractChecker() as checker:
            y = layer(x)
            y.sum().backward()
        assert checker.violations == [], (layout, checker.violations)
        assert y.shape == x.shape and x.grad.shape == x.shape
        if layer.weight is not None:  # connected to the parameters: zero gradients, not None
            assert torch.equal(layer.weight.grad, torch.zeros(6))


def test_the_functional_api_meets_the_contract():
    x = _layout("channels_last", 6).requires_grad_()
    weight, bias = torch.ones(6, requires_grad=True), torch.zeros(6, requires_grad=True)
    with CudaContractChecker() as checker:
        buffers = functional.CBNBuffers.fresh(6)
        for training in (True, False):
            functional.cbn(x, weight, bias, buffers, training=training, eta=0.5).sum().backward()
            functional.pop_norm(x, weight, bias, *buffers[3:], training=training).sum().backward()
            functional.sync_batch_norm(x, buffers.running_mean, buffers.running_var, weight, bias,
                                       training=training).sum().backward()
        empty = x[:0]
        functional.cbn(empty, weight, bias, buffers, training=False).sum().backward()
    assert checker.violations == [], checker.violations


def test_bnp_calls_meet_the_cuda_kernel_contract():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Tanh(), distnorm.CBN(8), nn.Conv2d(8, 4, 1),
                          nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    distnorm.bnp.attach(model, exclude=["0"])
    distnorm.set_lr(model, 0.01)
    with CudaContractChecker() as checker:
        model(torch.randn(4, 3, 6, 6)).square().sum().backward()
    assert checker.violations == []


def test_the_folded_stem_meets_the_cuda_kernel_contract():
    """The CBN folded into the stem convolution (``distnorm._folding``) normalizes through
    ``native_batch_norm`` without weight and bias: every dtype and layout a stem sees,
    autocast included."""
    for dtype, layout, autocast in ((torch.float32, "4d", False), (torch.float32, "channels_last", False),
                                    (torch.float64, "4d", False), (torch.float32, "channels_last", True)):
        stem = distnorm.PreNorm(distnorm.CBN(6), nn.Conv2d(6, 4, 3, padding=1)).to(dtype)
        distnorm.set_lr(stem, 0.01)
        x = _layout(layout, 6).to(dtype)
        stem(x)  # initialise AMAT: the second step takes the history path
        with CudaContractChecker() as checker, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            stem(x).float().square().sum().backward()
        assert checker.violations == [], (dtype, layout, checker.violations)
        assert checker.calls["aten.native_batch_norm.default"] == 1  # the fold's x_hat
        assert checker.calls["aten.native_batch_norm_backward.default"] == 0  # folded: no input gradient


def test_the_checker_rejects_what_cuda_rejects():
    """The contract test can fail: each rule catches the call it stands for."""
    x, g = torch.randn(4, 3, 2, 2), torch.randn(4, 3, 2, 2)
    c = torch.ones(3)
    calls = {
        # the backward call every layer made before the save_mean fix
        "save_mean / save_invstd undefined": lambda: torch.ops.aten.native_batch_norm_backward(
            g, x, None, torch.zeros(3), c, None, None, False, 1e-5, [False, True, True]),
        "weight undefined": lambda: torch.ops.aten.native_batch_norm_backward(
            g, x, None, torch.zeros(3), c, None, None, False, 1e-5, [False, True, True]),
        "empty input": lambda: torch.ops.aten.native_batch_norm(x[:0], c, c, c, c, False, 0.0, 1e-5),
        "grad_out dtype": lambda: torch.ops.aten.native_batch_norm_backward(
            g.double(), x, c, None, None, c, c, True, 1e-5, [True, True, True]),
        "differs from weight's": lambda: torch.ops.aten.native_batch_norm_backward(
            g.bfloat16(), x.bfloat16(), c, c.bfloat16(), c.bfloat16(), c, c, False, 1e-5, [True, True, True]),
        "both be given": lambda: torch.ops.aten.native_batch_norm(x, c, c, c, None, True, 0.1, 1e-5),
        # batch_norm_backward_elemt: a float count (CUDA reads count.data_ptr<int>()), an
        # empty input, a float64 statistic for float32 input, and the CUDA kernel on the CPU
        "count must be a 1-D int32": lambda: torch.ops.distnorm.batch_norm_backward_elemt(
            g, x, c, c, c, c, c, torch.tensor([16.0])),
        "empty input of shape (0, 3, 2, 2)": lambda: torch.ops.distnorm.batch_norm_backward_elemt(
            g[:0], x[:0], c, c, c, c, c, torch.tensor([16], dtype=torch.int32)),
        "sum_dy has dtype torch.float64": lambda: torch.ops.distnorm.batch_norm_backward_elemt(
            g, x, c, c, c, c.double(), c, torch.tensor([16], dtype=torch.int32)),
        "CUDA-only kernel": lambda: torch.ops.aten.batch_norm_backward_elemt(
            g, x, c, c, c, c, c, torch.tensor([16], dtype=torch.int32)),
    }
    for reason, call in calls.items():
        with CudaContractChecker() as checker:
            try:
                call()
            except (RuntimeError, ValueError):
                pass  # the CPU may reject it too; the checker must have seen it first
        reasons = " | ".join(r for _, r in checker.violations)
        assert reason in reasons, (reason, reasons)


def _contract_worker(rank, world):
    """Rank 1 runs channels_last inputs; in the last round it holds no samples at all."""
    found = []
    for kind, make in LAYERS.items():
        for dtype in (torch.float32, torch.bfloat16):
            for lr in (0.2, 0.01):
                checker = _exercise(make(6), dtype, _layout("channels_last" if rank else "4d", 6), lr)
                found += checker.violations
        layer = make(6)
        distnorm.set_lr(layer, 0.01)
        x = _layout("channels_last", 6, batch=0 if rank == 1 else 4).requires_grad_()
        with CudaContractChecker() as checker:
            for _ in range(2):  # initialise AMAT, then the history path
                layer(x).square().sum().backward()
            layer.eval()
            layer(x.detach())
        found += [(kind, "empty rank", v) for v in checker.violations]
    return found


@pytest.mark.world_size(2)
def test_cuda_kernel_contract_when_synchronized(tmp_path):
    """Synchronized on two ranks, with channels_last inputs on rank 1 and then no samples
    there at all, every call meets the CUDA kernels' contract. Before, a rank without samples
    called native_batch_norm with N = 0 after the forward all-reduce (CUDA raises; the other
    ranks would wait in the backward all-reduce until the timeout)."""
    assert run_distributed(_contract_worker, 2, tmp_path) == [[], []]
