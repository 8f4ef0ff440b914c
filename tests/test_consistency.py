"""Rank consistency: buffers stay bit-identical under DDP without buffer broadcasts, and
check_consistency catches (and names) any divergence."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distnorm
from tests.distributed import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)  # identical initial parameters on every rank
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.Tanh(),
        distnorm.CBN(8, rho=2.0),
        nn.Conv2d(8, 8, 3, padding=1),
        distnorm.SyncBatchNorm(8),
        nn.ReLU(),
        distnorm.POPNorm(8),
        nn.Conv2d(8, 4, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )


def _ddp_worker(rank, world, perturb_rank=None):
    model = DDP(_model(), **distnorm.ddp_kwargs())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)
    gen = torch.Generator().manual_seed(rank)  # different data on every rank
    for _ in range(6):
        distnorm.set_lr(model, opt.param_groups[0]["lr"])
        x = torch.randn(6 + rank, 3, 8, 8, generator=gen)  # unequal batch sizes too
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    assert distnorm.check_consistency(model, parameters=True) > 0
    buffers = {k: v.clone() for k, v in model.module.named_buffers()}
    if perturb_rank is not None:
        if rank == perturb_rank:
            with torch.no_grad():
                model.module[2].amat_mean[3] += 1e-6
        try:
            distnorm.check_consistency(model)
        except distnorm.InconsistentStateError as err:
            return buffers, str(err), err.mismatches
        raise AssertionError("perturbed buffer was not detected")
    return buffers, None, None


@pytest.mark.world_size(2)
def test_ddp_buffers_bit_identical_without_broadcast(tmp_path):
    out = run_distributed(_ddp_worker, 2, tmp_path)
    (b0, _, _), (b1, _, _) = out
    assert b0.keys() == b1.keys() and len(b0) > 10
    for name in b0:
        assert torch.equal(b0[name], b1[name]), name
    assert int(b0["2.num_batches_tracked"]) == 6 and bool(b0["2.amat_initialized"])


@pytest.mark.world_size(3)
def test_perturbed_buffer_is_named_with_ranks(tmp_path):
    out = run_distributed(_ddp_worker, 3, tmp_path, perturb_rank=1)
    for _, message, mismatches in out:  # every rank raises, none is left waiting
        assert "module.2.amat_mean" in message
        assert mismatches == {"module.2.amat_mean": [[0, 2], [1]]}


def _drift_worker(rank, world):
    """Train 2 steps under DDP, then let rank 1 alone change a weight, then a momentum
    buffer: every rank must raise, naming the tensor (none left waiting in a collective)."""
    model = DDP(_model(), **distnorm.ddp_kwargs())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        distnorm.set_lr(model, opt.param_groups[0]["lr"])
        model(torch.randn(4, 3, 8, 8, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    buffers, params = distnorm.check_consistency(model), len(list(model.parameters()))
    # replicated state agrees: buffers + parameters + one momentum buffer per parameter
    assert distnorm.check_consistency(model, parameters=True, optimizer=opt) == buffers + 2 * params
    errors = []
    for tensor in (model.module[3].weight, opt.state[model.module[3].weight]["momentum_buffer"]):
        saved = tensor.detach().clone()
        if rank == 1:
            with torch.no_grad():
                tensor.view(-1)[5] += 1e-7 * max(1.0, float(tensor.view(-1)[5].abs()))
        with pytest.raises(distnorm.InconsistentStateError) as info:
            distnorm.check_consistency(model, parameters=True, optimizer=opt)
        errors.append((str(info.value), info.value.mismatches))
        with torch.no_grad():
            tensor.copy_(saved)
    assert distnorm.check_consistency(model, parameters=True, optimizer=opt) > 0  # restored: agrees again
    return errors


@pytest.mark.world_size(2)
@pytest.mark.timeout(120)
def test_drifted_parameter_and_optimizer_state_are_named_on_every_rank(tmp_path):
    out = run_distributed(_drift_worker, 2, tmp_path, timeout=90)
    for (param_msg, param_groups), (state_msg, state_groups) in out:
        assert param_groups == {"module.3.weight": [[0], [1]]}, param_msg
        assert "module.3.weight: ranks [0] | [1]" in param_msg and "skipped or repeated a step" in param_msg
        assert state_groups == {"optimizer[module.3.weight].momentum_buffer": [[0], [1]]}, state_msg


def _structure_worker(rank, world):
    model = nn.Sequential(distnorm.CBN(4), *([distnorm.CBN(4)] if rank == 1 else []))
    with pytest.raises(distnorm.InconsistentStateError, match="the model structure"):
        distnorm.check_consistency(model)
    return True


@pytest.mark.world_size(2)
def test_structural_mismatch_is_an_error_not_a_hang(tmp_path):
    assert run_distributed(_structure_worker, 2, tmp_path, timeout=60) == [True, True]


def test_check_consistency_local_is_a_count():
    model = nn.Sequential(distnorm.CBN(4), nn.Linear(4, 4), distnorm.SyncBatchNorm(4))
    assert distnorm.check_consistency(model) == 7 + 3  # CBN: 7 buffers (amat_eta included)
    assert distnorm.check_consistency(model, parameters=True) == 7 + 3 + 6
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert distnorm.check_consistency(model, parameters=True, optimizer=opt) == 7 + 3 + 6  # no state yet
    distnorm.set_lr(model, 0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    assert distnorm.check_consistency(model, optimizer=opt) == 7 + 3 + 6  # one momentum buffer each
