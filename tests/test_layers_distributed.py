"""N ranks with split batches must equal one process on the concatenated batch.

Real processes, real gloo collectives (see tests/distributed.py). Each rank builds the same
global batch from a shared seed, runs its own slice through the distnorm layer, and checks
against the float64 reference (or torch.nn.BatchNorm) run on the whole batch:

* outputs and input gradients: equal to the rank's slice of the reference;
* parameter gradients: their *sum over ranks* equals the reference (the data-parallel
  engine averages them; the test losses are sums, so the average is the sum / W);
* buffers: equal to the reference, and bit-identical across ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distnorm
from distnorm import functional as F
from tests import reference as ref
from tests.dispatch import CollectiveCounter
from tests.distributed import run_distributed

LRS = [0.2, 0.05, 0.02, 0.005, 0.001]
ATOL = 1e-10


def _batch(step: int, n: int, shape_tail, channels=3):
    gen = torch.Generator().manual_seed(1000 + step)
    offsets = torch.tensor([2.0, -1.5, 0.01][:channels], dtype=torch.float64)
    x = torch.randn(n, channels, *shape_tail, generator=gen, dtype=torch.float64) * 1.5
    x = x + offsets.view([1, -1] + [1] * len(shape_tail))
    gy = torch.randn(n, channels, *shape_tail, generator=gen, dtype=torch.float64)
    return x, gy


def _make(kind: str, group=None) -> nn.Module:
    if kind == "cbn":
        return distnorm.CBN(3, rho=1.5, process_group=group).double()
    if kind == "popnorm":
        return distnorm.POPNorm(3, process_group=group).double()
    return distnorm.SyncBatchNorm(3, process_group=group).double()


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if k not in ("weight", "bias")}


def _equivalence_worker(rank, world, kind, splits, shape_tail, lrs, sub_groups=None, device="cpu"):
    """Compare this rank's slice against the reference on its group's concatenated batch.

    The reference always runs on the CPU; with ``device="cuda"`` the layer runs on this
    rank's GPU (NCCL) and its results are compared on the CPU.
    """
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    group, members = None, list(range(world))
    if sub_groups is not None:
        for ranks in sub_groups:  # every rank must take part in creating every group
            g = dist.new_group(ranks)
            if rank in ranks:
                group, members = g, ranks
    offsets = [sum(splits[:r]) for r in range(world + 1)]
    lo = sum(splits[r] for r in members if r < rank)
    hi = lo + splits[rank]

    module = _make(kind, group).to(dev)
    gamma = torch.tensor([0.7, 1.3, 1.0], dtype=torch.float64)
    beta = torch.tensor([0.2, -0.4, 0.1], dtype=torch.float64)
    with torch.no_grad():
        module.weight.copy_(gamma)
        module.bias.copy_(beta)
    state = ref.CBNState(3)
    reference_bn = nn.BatchNorm1d(3).double() if len(shape_tail) <= 1 else nn.BatchNorm2d(3).double()
    with torch.no_grad():
        reference_bn.weight.copy_(gamma)
        reference_bn.bias.copy_(beta)

    for step, lr in enumerate(lrs):
        x_all, gy_all = _batch(step, offsets[-1], shape_tail)
        idx = torch.cat([torch.arange(offsets[r], offsets[r + 1]) for r in members])
        x_grp, gy_grp = x_all[idx], gy_all[idx]

        xr, gr, br = x_grp.clone().requires_grad_(), gamma.clone().requires_grad_(), beta.clone().requires_grad_()
        if kind == "syncbn":
            reference_bn.zero_grad()
            y_ref = reference_bn(xr)
            y_ref.backward(gy_grp)
            ref_grads = (reference_bn.weight.grad, reference_bn.bias.grad)
        else:
            amat = kind == "cbn"
            eta = F.amat_eta(lr, 10.0) if amat else 0.0
            y_ref = ref.cbn_train(xr, gr, br, state, eta=eta, rho=1.5 if amat else 4.0, amat=amat)
            y_ref.backward(gy_grp)
            ref_grads = (gr.grad, br.grad)

        module.zero_grad()
        distnorm.set_lr(module, lr)
        x = x_grp[lo:hi].to(dev).requires_grad_()
        y = module(x)
        y.backward(gy_grp[lo:hi].to(dev))

        assert y.shape == x.shape
        torch.testing.assert_close(y.cpu(), y_ref[lo:hi].detach(), atol=ATOL, rtol=0)
        torch.testing.assert_close(x.grad.cpu(), xr.grad[lo:hi], atol=ATOL, rtol=0)
        grads = torch.stack([module.weight.grad, module.bias.grad])
        if group is not None or len(members) > 1:
            dist.all_reduce(grads, group=group)
        torch.testing.assert_close(grads[0].cpu(), ref_grads[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(grads[1].cpu(), ref_grads[1], atol=ATOL, rtol=0)
        buffers = _buffers(module)
        if kind == "syncbn":
            expected = {"running_mean": reference_bn.running_mean, "running_var": reference_bn.running_var}
        else:
            expected = {"amat_mean": state.amat_mean, "amat_var": state.amat_var,
                        "running_mean": state.running_mean, "running_var": state.running_var}
        for name, value in expected.items():
            torch.testing.assert_close(buffers[name], value, atol=ATOL, rtol=0)
    return buffers


def _assert_bit_identical(buffers: list[dict[str, torch.Tensor]]) -> None:
    for name, value in buffers[0].items():
        for rank, other in enumerate(buffers[1:], start=1):
            assert torch.equal(other[name], value), f"{name} differs between rank 0 and rank {rank}"


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", ["cbn", "popnorm", "syncbn"])
@pytest.mark.parametrize("shape_tail", [(), (4, 4)], ids=["NC", "NCHW"])
def test_two_ranks_equal_one_process(tmp_path, kind, shape_tail):
    out = run_distributed(_equivalence_worker, 2, tmp_path, kind, [4, 4], shape_tail, LRS)
    _assert_bit_identical(out)


@pytest.mark.world_size(3)
@pytest.mark.parametrize("kind", ["cbn", "syncbn"])
def test_three_ranks_unequal_splits(tmp_path, kind):
    out = run_distributed(_equivalence_worker, 3, tmp_path, kind, [3, 5, 2], (3,), LRS)
    _assert_bit_identical(out)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", ["cbn", "popnorm", "syncbn"])
def test_uneven_three_five_split(tmp_path, kind):
    out = run_distributed(_equivalence_worker, 2, tmp_path, kind, [3, 5], (2, 2), LRS)
    _assert_bit_identical(out)


@pytest.mark.world_size(3)
@pytest.mark.parametrize("kind", ["cbn", "popnorm", "syncbn"])
def test_empty_rank_joins_and_contributes_nothing(tmp_path, kind):
    out = run_distributed(_equivalence_worker, 3, tmp_path, kind, [4, 0, 5], (2, 2), LRS)
    _assert_bit_identical(out)
    for buffers in out:
        for name, value in buffers.items():
            assert torch.isfinite(value.double()).all(), name


def _every_rank_empty_worker(rank, world):
    """An ordinary step, then one in which no rank holds a sample."""
    out = {}
    gen = torch.Generator().manual_seed(rank)
    for kind in ("cbn", "popnorm", "syncbn", "bnp"):
        if kind == "bnp":
            module = nn.Conv2d(3, 4, 1).double()
            distnorm.bnp.attach(module)
        else:
            module = _make(kind)
            distnorm.set_lr(module, 0.01)  # eta = 0.9: the second step takes AMAT's history path
        module(torch.randn(4, 3, 2, 2, generator=gen, dtype=torch.float64)).square().sum().backward()
        before = _buffers(module)
        module.zero_grad()
        empty = torch.zeros(0, 3, 2, 2, dtype=torch.float64, requires_grad=True)
        y = module(empty)
        y.square().sum().backward()
        assert y.shape[0] == 0 and empty.grad.shape == empty.shape, kind
        for name, value in _buffers(module).items():
            assert torch.equal(value, before[name]), (kind, name, before[name], value)
        for name, p in module.named_parameters():
            assert torch.isfinite(p.grad).all() and not p.grad.any(), (kind, name, p.grad)
        out[kind] = before
    return out


@pytest.mark.world_size(2)
def test_every_rank_empty_changes_nothing(tmp_path):
    """A global batch without a single sample (every rank empty) changes no buffer and gives
    zero, finite parameter gradients. The 0 / 0 guard of the all-reduced count keeps them so:
    without it the statistics are NaN, hidden from the buffers by the validity mask but not
    from CBN / POP-Norm's bias gradient or BNP's moments (``lerp(buffer, NaN, 0)`` is NaN)."""
    run_distributed(_every_rank_empty_worker, 2, tmp_path)


@pytest.mark.world_size(3)
def test_sub_group_process_group(tmp_path):
    """Ranks {0, 1} synchronize with each other; rank 2 alone runs locally."""
    out = run_distributed(_equivalence_worker, 3, tmp_path, "cbn", [4, 3, 5], (2, 2), LRS,
                          sub_groups=[[0, 1], [2]])
    _assert_bit_identical(out[:2])
    assert not torch.equal(out[0]["amat_mean"], out[2]["amat_mean"])


# --------------------------------------------------------------------- collective count
# One frame each (distnorm._frames): float64, the widest payload the process reserved (the
# forward's 3 x 5: per channel sum, sum of squares, count; the backward's 2 x 5 sum(g),
# sum(g * xhat) travel in a frame of the same size), then 2 fingerprint entries per rank.
FORWARD = [("allreduce_", ((3 * 5 + 2 * 2,),))]
BACKWARD = FORWARD
#: The group's vote on the kernels: once per group and device type, before its first statistics.
VOTE = FORWARD


def _phases(layer: nn.Module, counter: CollectiveCounter, conv: nn.Module | None = None) -> dict:
    """Collectives of each phase a layer goes through: the first training step, a step with
    AMAT initialised, a training step whose input needs no gradient, evaluation."""
    out = {}
    net = nn.Sequential(layer, conv) if conv is not None else layer
    for phase, grad in (("first", True), ("amat_initialised", True), ("input_needs_no_grad", False)):
        x = torch.randn(4, 5, 3, 3, requires_grad=grad)
        start = counter.mark()
        y = net(x)
        forward = counter.calls[start:]
        start = counter.mark()
        y.square().sum().backward()
        out[phase] = (forward, counter.calls[start:])
    net.eval()
    start = counter.mark()
    with torch.no_grad():
        net(torch.randn(4, 5, 3, 3))
    out["eval"] = (counter.calls[start:], [])
    return out


def _count_worker(rank, world):
    counts = {}
    with CollectiveCounter() as counter:
        for make in (lambda: distnorm.CBN(5), lambda: distnorm.POPNorm(5), lambda: distnorm.SyncBatchNorm(5)):
            layer = make()
            distnorm.set_lr(layer, 0.01)  # eta = 0.9: the second step takes AMAT's history path
            counts[type(layer).__name__] = _phases(layer, counter)
        conv = nn.Conv2d(5, 4, 3)
        distnorm.bnp.attach(conv)
        counts["BNP"] = _phases(nn.Identity(), counter, conv)
    return counts


@pytest.mark.world_size(2)
def test_one_collective_forward_one_backward(tmp_path):
    """Every collective of any kind (all-reduce, broadcast, all-gather, barrier, object
    collectives) on every rank, in every phase: one all-reduce forward and one backward, and
    once per group, before the first layer's first statistics, the ranks' vote on the kernels.
    An extra ``dist.broadcast`` in the synchronized forward is counted too (a wrapper around
    ``dist.all_reduce`` missed it)."""
    per_rank = run_distributed(_count_worker, 2, tmp_path)
    assert per_rank[0] == per_rank[1]
    for rank, counts in enumerate(per_rank):
        for name in ("CBN", "POPNorm", "SyncBatchNorm"):
            phases = counts[name]
            for phase in ("first", "amat_initialised"):  # CBN's first step is the group's first: its vote
                forward = VOTE + FORWARD if (name, phase) == ("CBN", "first") else FORWARD
                assert phases[phase] == (forward, BACKWARD), (rank, name, phase, phases[phase])
            assert phases["input_needs_no_grad"] == (FORWARD, []), (rank, name, phases["input_needs_no_grad"])
            assert phases["eval"] == ([], []), (rank, name)
        # BNP: the statistics of the layer's input in the forward; the backward only rescales
        for phase in ("first", "amat_initialised", "input_needs_no_grad"):
            assert counts["BNP"][phase] == (FORWARD, []), (rank, phase, counts["BNP"][phase])
        assert counts["BNP"]["eval"] == ([], [])


# ------------------------------------------------- every rank takes the same arithmetic path
def _arithmetic_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.Tanh(), distnorm.CBN(64, rho=1.5),
        nn.Conv2d(64, 48, 3, padding=1), distnorm.SyncBatchNorm(48), nn.ReLU(),
        distnorm.POPNorm(48), nn.Conv2d(48, 4, 1), nn.Flatten(), nn.Linear(4 * 6 * 6, 3),
    )


ARITHMETIC_LRS = [0.2, 0.2, 0.05, 0.02, 0.01, 0.01, 0.005, 0.2, 0.01, 0.002]  # eta 0, 0.5, ..., 0.98


def _same_arithmetic_worker(rank, world, modes, monitor_rank=None, break_rank=None, cpu_kernel="1"):
    """Train the small CNN under DDP with this rank's ``DISTNORM_TRITON`` (and every rank's
    ``DISTNORM_CPU_KERNEL``); the theory monitor on ``monitor_rank`` only; ``break_rank``'s
    Triton a real one that cannot run here (Triton's compiled kernels on CPU tensors, no GPU
    driver) in place of the interpreter. Returns the buffers, what this rank ran, its
    warnings and records — or the error it raised, for the ranks that must raise."""
    import importlib
    import os
    import warnings

    from distnorm import _kernel_choice, _kernels
    from distnorm.monitors import TheoryMonitor

    os.environ["DISTNORM_TRITON"] = modes[rank]
    os.environ["DISTNORM_CPU_KERNEL"] = cpu_kernel
    if rank == break_rank:
        _kernels.interpreted_kernels = lambda: importlib.import_module("distnorm._triton")
    model = _arithmetic_model()
    ddp = nn.parallel.DistributedDataParallel(model, **distnorm.ddp_kwargs())
    monitor = TheoryMonitor(model, every=2) if rank == monitor_rank else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    records = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, lr in enumerate(ARITHMETIC_LRS):
            x = torch.randn(8 * world, 3, 6, 6, generator=torch.Generator().manual_seed(step)) + 0.3
            distnorm.set_lr(model, lr)
            opt.zero_grad()
            try:
                ddp(x[8 * rank:8 * (rank + 1)]).square().mean().backward()
            except RuntimeError as err:
                if break_rank is None:
                    raise
                return {"error": str(err)}
            if monitor is not None:
                monitor.after_backward(step)
                records += monitor.records(step)
            opt.step()
    return {"buffers": _buffers(model), "state": tuple(_kernel_choice.triton_state()), "records": records,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]}


@pytest.mark.world_size(2)
@pytest.mark.timeout(300)
def test_a_monitored_rank_runs_the_arithmetic_of_the_others(tmp_path):
    """Both ranks' fused operators through Triton's kernels (the interpreter standing in for
    the GPU), the theory monitor on rank 0 only: after ten steps across AMAT's phases every
    buffer is bit-identical on both ranks. Before, the monitor's statistics sink sent its
    rank's layers through the ATen composite while the other ranks ran Triton (not
    bit-identical: a multi-GPU run with monitors failed its consistency check at forward
    200 with InconsistentStateError)."""
    pytest.importorskip("triton")
    r0, r1 = run_distributed(_same_arithmetic_worker, 2, tmp_path, ("interpret", "interpret"), 0, timeout=240)
    assert r0["state"] == r1["state"] == (True, "")  # the fused operators ran the Triton kernels
    _assert_bit_identical([r0["buffers"], r1["buffers"]])
    assert len(r0["records"]) == 5 * 3 and r1["records"] == []  # 5 recording steps x (CBN, POP-Norm, model)


@pytest.mark.world_size(2)
@pytest.mark.timeout(300)
def test_ranks_that_differ_on_triton_agree_on_the_composite(tmp_path):
    """One rank would run Triton, the other has ``DISTNORM_TRITON=0``: the group agrees, at
    its first step and in the collective it issues anyway, on the composite for both (rank 0
    warns, naming rank 1), and their buffers stay bit-identical, where each process choosing
    its kernels alone (as a per-process Triton fallback does) would break that. The CPU's C
    kernels are off on both ranks: they run Triton's program and can give its bits, where
    ATen's composite, which this group agrees on, does not."""
    pytest.importorskip("triton")
    r0, r1 = run_distributed(_same_arithmetic_worker, 2, tmp_path, ("interpret", "0"), cpu_kernel="0", timeout=240)
    for r in (r0, r1):
        assert not r["state"][0] and "rank 1: off: DISTNORM_TRITON=0" in r["state"][1], r["state"]
    assert len(r0["warnings"]) == 1 and "the composite on all 2 ranks" in r0["warnings"][0], r0["warnings"]
    assert r1["warnings"] == []
    _assert_bit_identical([r0["buffers"], r1["buffers"]])


@pytest.mark.world_size(2)
@pytest.mark.timeout(300)
def test_a_rank_whose_triton_fails_makes_every_rank_raise(tmp_path):
    """Rank 1's Triton cannot launch (a real failure: its compiled kernels on CPU tensors,
    no GPU driver), rank 0's works: both raise at the first step, after the same collective,
    naming rank 1 and its error — neither waits for the other, neither falls back. If only
    the failing rank raised, rank 0 would wait in the next collective until the timeout."""
    pytest.importorskip("triton")
    r0, r1 = run_distributed(_same_arithmetic_worker, 2, tmp_path, ("interpret", "interpret"), None, 1, timeout=120)
    for r in (r0, r1):
        assert "error" in r, r.keys()
        assert "Triton failed on 1 of the 2 ranks of the group" in r["error"], r["error"]
        assert "rank 1: failed: RuntimeError: 0 active drivers" in r["error"] or "rank 1: failed:" in r["error"]
        assert "DISTNORM_TRITON=0 on every rank" in r["error"]
