"""The equivalence tests on CUDA: local paths with one GPU, NCCL synchronization with two or
more, and an empty rank on one GPU (two gloo ranks sharing it). Skipped cleanly on machines
without CUDA (as on CI); the same assertions as the CPU tests, with float32 tolerances where
the GPU kernels accumulate differently. Every CUDA test is marked ``cuda`` (what ``make
test-gpu`` selects); the one test here without it is the CPU twin of the empty-rank test,
which runs in ``make test`` and checks the same comparison on the CPU."""

from __future__ import annotations

import copy
import importlib.util
import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distnorm
from distnorm import functional as F
from tests import reference as ref
from tests.distributed import run_distributed
from tests.test_layers_distributed import (ATOL, LRS, _assert_bit_identical, _batch, _buffers, _equivalence_worker,
                                           _make)

# Each skip names what the machine lacks (``make test-gpu`` reports the reasons with their counts).
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NO_GPU = (f"needs a CUDA device: torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
          else "needs a CUDA device: none visible")
needs_gpu = pytest.mark.skipif(GPUS < 1, reason=NO_GPU)
needs_two_gpus = pytest.mark.skipif(GPUS < 2 or not dist.is_nccl_available(),
                                    reason=f"needs 2 CUDA devices for NCCL (found {GPUS})" if GPUS < 2
                                    else "needs NCCL: this torch build has none")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs triton (torch.compile's inductor on CUDA): not installed")


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("make", [lambda: distnorm.CBN(8), lambda: distnorm.POPNorm(8), lambda: distnorm.SyncBatchNorm(8)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_local_matches_cpu_float64(make, dtype, channels_last):
    cpu = make().double()
    gpu = copy.deepcopy(cpu).to(device="cuda", dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    for m in (cpu, gpu):
        distnorm.set_lr(m, 0.02)
    tol = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    for step in range(3):
        x = torch.randn(8, 8, 6, 6, dtype=torch.float64) * 2 + 1
        gy = torch.randn_like(x)
        xc = x.clone().requires_grad_()
        xg = x.to("cuda", dtype)
        if channels_last:
            xg = xg.to(memory_format=torch.channels_last)
        xg.requires_grad_()
        yc, yg = cpu(xc), gpu(xg)
        assert yg.dtype == dtype
        if channels_last:
            assert yg.is_contiguous(memory_format=torch.channels_last)
        yc.backward(gy)
        yg.backward(gy.to("cuda", dtype))
        torch.testing.assert_close(yg.double().cpu(), yc, atol=tol, rtol=tol)
        torch.testing.assert_close(xg.grad.double().cpu(), xc.grad, atol=tol * 10, rtol=tol * 10)
        for name, buf in cpu.named_buffers():
            other = dict(gpu.named_buffers())[name]
            if buf.is_floating_point():
                torch.testing.assert_close(other.double().cpu(), buf, atol=tol, rtol=tol)


@pytest.mark.cuda
@needs_gpu
def test_cuda_cbn_matches_reference_over_steps():
    m = distnorm.CBN(3, rho=1.5).double().cuda()
    state = ref.CBNState(3)
    for step, lr in enumerate(LRS):
        x = torch.randn(16, 3, 4, 4, dtype=torch.float64) + torch.tensor([2.0, -1.0, 0.0]).view(1, 3, 1, 1)
        gy = torch.randn_like(x)
        xr = x.clone().requires_grad_()
        gr = torch.ones(3, dtype=torch.float64, requires_grad=True)
        br = torch.zeros(3, dtype=torch.float64, requires_grad=True)
        y_ref = ref.cbn_train(xr, gr, br, state, eta=max(1 - 10 * lr, 0), rho=1.5)
        y_ref.backward(gy)
        distnorm.set_lr(m, lr)
        m.zero_grad()
        xg = x.cuda().requires_grad_()
        y = m(xg)
        y.backward(gy.cuda())
        torch.testing.assert_close(y.cpu(), y_ref, atol=1e-10, rtol=0)
        torch.testing.assert_close(xg.grad.cpu(), xr.grad, atol=1e-10, rtol=0)
        torch.testing.assert_close(m.amat_var.cpu(), state.amat_var, atol=1e-10, rtol=0)


@pytest.mark.cuda
@needs_two_gpus
@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", ["cbn", "popnorm", "syncbn"])
@pytest.mark.parametrize("splits", [[4, 4], [3, 5], [4, 0]])
def test_nccl_two_ranks_equal_one_process(tmp_path, kind, splits):
    out = run_distributed(_equivalence_worker, 2, tmp_path, kind, splits, (3, 3), LRS,
                          device="cuda", backend="nccl")
    _assert_bit_identical(out)


#: Tolerances against the float64 reference: (outputs and buffers, gradients).
SPLIT_TOLERANCES = {torch.float64: (ATOL, ATOL), torch.float32: (1e-4, 1e-3)}


def _split_batch_worker(rank: int, world: int, splits: list[int], device: str) -> dict[str, torch.Tensor]:
    """Every layer kind, in float64 and float32, on this rank's part of a batch split
    ``splits`` across the ranks, every rank on ``device`` (``cuda``: all on GPU 0, gloo
    carrying the layers' collectives), against the float64 reference on the whole batch (as
    ``test_layers_distributed._equivalence_worker``, whose ranks each need a device of their
    own): the rank's slice of the output and input gradient, the sum over ranks of the
    parameter gradients (what the data-parallel engine reduces), the buffers. Returns the last
    buffers of every kind and dtype, to compare across ranks."""
    dev = torch.device(device)
    lo, hi, total = sum(splits[:rank]), sum(splits[:rank + 1]), sum(splits)
    gamma = torch.tensor([0.7, 1.3, 1.0], dtype=torch.float64)
    beta = torch.tensor([0.2, -0.4, 0.1], dtype=torch.float64)
    out = {}
    for dtype, kind in itertools.product(SPLIT_TOLERANCES, ("cbn", "popnorm", "syncbn")):
        tol, grad_tol = SPLIT_TOLERANCES[dtype]
        module = _make(kind).to(dev, dtype)
        reference_bn, state = nn.BatchNorm2d(3).double(), ref.CBNState(3)
        with torch.no_grad():
            for m in (module, reference_bn):
                m.weight.copy_(gamma)
                m.bias.copy_(beta)
        for step, lr in enumerate(LRS):
            where = f"{kind}, {dtype}, step {step}, rank {rank} of splits {splits} on {device}"
            x_all, gy_all = _batch(step, total, (2, 2))
            xr, gr, br = x_all.clone().requires_grad_(), gamma.clone().requires_grad_(), beta.clone().requires_grad_()
            if kind == "syncbn":
                reference_bn.zero_grad()
                y_ref = reference_bn(xr)
                y_ref.backward(gy_all)
                ref_grads = torch.stack([reference_bn.weight.grad, reference_bn.bias.grad])
                expected = {"running_mean": reference_bn.running_mean, "running_var": reference_bn.running_var}
            else:
                amat = kind == "cbn"
                y_ref = ref.cbn_train(xr, gr, br, state, eta=F.amat_eta(lr, 10.0) if amat else 0.0,
                                      rho=1.5 if amat else 4.0, amat=amat)
                y_ref.backward(gy_all)
                ref_grads = torch.stack([gr.grad, br.grad])
                expected = {"amat_mean": state.amat_mean, "amat_var": state.amat_var,
                            "running_mean": state.running_mean, "running_var": state.running_var}
            module.zero_grad()
            distnorm.set_lr(module, lr)
            x = x_all[lo:hi].to(dev, dtype).requires_grad_()
            y = module(x)
            y.backward(gy_all[lo:hi].to(dev, dtype))
            assert y.shape == x.shape and y.device == x.device and y.dtype == dtype, where
            close = dict(msg=lambda m: f"{where}: {m}", atol=tol, rtol=tol)
            torch.testing.assert_close(y.double().cpu(), y_ref[lo:hi].detach(), **close)
            close_grad = dict(msg=lambda m: f"{where}: {m}", atol=grad_tol, rtol=grad_tol)
            torch.testing.assert_close(x.grad.double().cpu(), xr.grad[lo:hi], **close_grad)
            grads = torch.stack([module.weight.grad, module.bias.grad]).double().cpu()
            dist.all_reduce(grads)
            torch.testing.assert_close(grads, ref_grads, **close_grad)
            buffers = _buffers(module)
            for name, value in expected.items():
                torch.testing.assert_close(buffers[name].double(), value, **close)
        out.update({f"{kind}/{dtype}/{name}": value for name, value in buffers.items()})
    return out


@pytest.mark.world_size(2)
@pytest.mark.parametrize("splits", [[8, 0], [0, 8]])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_gpu])])
def test_empty_rank_on_one_device(tmp_path, device, splits):
    """One GPU never runs the NCCL tests, so their empty rank (N = 0) never meets the CUDA
    kernels there; two gloo ranks sharing the GPU do. Per split, every layer kind, forward and
    backward, float64 and float32 (where the fused operators take their Triton kernels):
    equal to one process on the whole batch, buffers bit-identical across the ranks. The CPU
    case is the same comparison in ``make test``. Bugs caught: an empty rank handed to a CUDA
    kernel that rejects N = 0; an empty rank that skips a collective (the other rank waits
    until the deadline) or adds to the statistics."""
    out = run_distributed(_split_batch_worker, 2, tmp_path, splits, device)
    _assert_bit_identical(out)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_gpu])])
def test_bnp_on_the_device_matches_cpu_float64(device, monkeypatch):
    """BNP in float32 on ``device`` against the same model in float64 on the CPU computed by
    ATen's calls (``DISTNORM_CPU_KERNEL=0``), over three steps: the running moments, and the
    preconditioned gradients of a convolution (BNP's added bias), a grouped one and a linear
    layer. On ``device`` the transform is ATen's calls on CUDA and the C kernel on the CPU
    (whose case runs in ``make test``). Bugs caught on the CPU: the C kernel's group rows and
    its bias sum (bnp-kernel-group-rows, bnp-kernel-bias-sum)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5))
    reference = copy.deepcopy(model).double()
    model = model.to(device)
    for m in (model, reference):
        distnorm.bnp.attach(m, decay=0.5)
    for step in range(3):
        x = torch.randn(4, 3, 6, 6, dtype=torch.float64) * (1 + step) + 0.5
        model.zero_grad()
        model(x.float().to(device)).square().mean().backward()
        with monkeypatch.context() as env:
            env.setenv("DISTNORM_CPU_KERNEL", "0")  # read at each call by a layer without a group
            reference.zero_grad()
            reference(x).square().mean().backward()
        for (name, got), want in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(got.grad.double().cpu(), want.grad, rtol=1e-4, atol=1e-6, msg=name)
        for (name, got), want in zip(model.named_buffers(), reference.buffers()):
            torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.cuda
@needs_gpu
@needs_triton
def test_cuda_compile_equals_eager():
    """torch.compile (inductor, fullgraph) of every layer kind and BNP equals eager on CUDA."""
    from tests.test_compile import _check_compile, _compile_run

    _check_compile(_compile_run(device="cuda"))


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_cuda_checkpointing_updates_buffers_once(use_reentrant):
    from tests.test_checkpointing import _checkpoint_run

    _checkpoint_run(use_reentrant, device="cuda")  # equal to the plain run, buffers updated once


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_folded_stem_matches_cpu_float64(channels_last):
    """The CBN folded into the stem convolution (``distnorm._folding``) on CUDA, float32,
    against the float64 reference on the CPU over AMAT's phases (``tests/test_folding.py``)."""
    from tests.test_folding import CONVS, LRS as FOLD_LRS, _batch as stem_batch, _loss, _pre_norm, _reference_run

    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    pre = _pre_norm("cbn", "2d-stem")
    gpu = copy.deepcopy(pre).to(device="cuda", dtype=torch.float32, memory_format=memory_format)
    for step, (y_ref, grads_ref, _) in enumerate(_reference_run(pre, "cbn", "2d-stem", 8)):
        x, seed = stem_batch(step, 8, CONVS["2d-stem"][1])
        distnorm.set_lr(gpu, FOLD_LRS[step])
        gpu.zero_grad()
        y = gpu(x.to(device="cuda", dtype=torch.float32, memory_format=memory_format))
        _loss(y, seed).backward()
        assert y.is_contiguous(memory_format=memory_format)
        for got, want in zip([y] + [p.grad for p in gpu.parameters()], [y_ref] + grads_ref):
            torch.testing.assert_close(got.detach().cpu().double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


class _PooledBatches(torch.utils.data.IterableDataset):
    """Batch ``i`` filled with ``i``, written into the worker's pooled shared buffers."""

    def __init__(self, returns, batches: int):
        self.returns, self.batches = returns, batches

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        pool = self.returns.pool(info.id)
        for i in range(info.id, self.batches, info.num_workers):
            out, lease = pool.take((4, 3, 8, 8), torch.float32)
            yield out.fill_(i), i, lease


@pytest.mark.cuda
@needs_gpu
def test_pinned_batches_give_their_shared_buffers_back_at_once():
    """With ``pin_memory`` the DataLoader copies each batch into pinned memory, so the
    worker's shared buffer is free as soon as the batch arrives (distnorm.data.batches; what
    the loaders do with ``pin_memory``, the default on GPU hosts). Bugs caught: a pinned batch
    that is the worker's buffer after all (kept batches change), buffers held until the
    pinned batch is dropped (every batch fresh). Needs no WebDataset."""
    from distnorm.data.batches import BatchReturns

    returns = BatchReturns(2, capacity=5)
    loader = torch.utils.data.DataLoader(_PooledBatches(returns, 40), batch_size=None, num_workers=2,
                                         pin_memory=True)
    kept = [(returns.claim(images, lease), i) for images, i, lease in loader]  # every pinned batch held
    assert len(kept) == 40 and all(images.is_pinned() for images, _ in kept)
    assert returns.fresh < 40  # buffers went back although every batch is held
    assert all(bool((images == i).all()) for images, i in kept)
