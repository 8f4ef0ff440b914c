"""Activation checkpointing (reentrant and not): a recomputed forward reuses its first
forward's statistics, buffers update once per step, nothing is left behind.

Each test says the behaviour it holds; tests/README.md and tests/mutants.py name the bugs they catch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import distnorm
from tests.distributed import run_distributed
from tests.mixed import STEPS, assert_states_close, batch, mixed_model, train_state


class _Checkpointed(nn.Module):
    def __init__(self, body: nn.Module, head: nn.Module, use_reentrant: bool | None):
        super().__init__()
        self.body, self.head, self.use_reentrant = body, head, use_reentrant

    def forward(self, x):
        h = self.body(x) if self.use_reentrant is None else checkpoint(self.body, x, use_reentrant=self.use_reentrant)
        return self.head(h)


def _split(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    return model[:8], model[8:]


def _checkpoint_run(use_reentrant: bool | None, rank: int = 0, world: int = 1, device: str = "cpu"):
    plain = _Checkpointed(*_split(mixed_model().to(device)), use_reentrant=None)
    ckpt = copy.deepcopy(plain)
    ckpt.use_reentrant = use_reentrant
    for step, lr in enumerate(STEPS):
        x = batch(step, rank, world, device).requires_grad_(bool(use_reentrant))  # reentrant needs an input that requires grad
        for model in (plain, ckpt):
            distnorm.set_lr(model, lr)
            model.zero_grad()
            model(x).square().mean().backward()
        assert_states_close(train_state(plain), train_state(ckpt), 0.0)
    cbn = ckpt.body[2]
    assert int(cbn.num_batches_tracked) == len(STEPS)  # updated once per step
    assert len(cbn._state.stash) == 0  # nothing left behind
    return train_state(ckpt)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointing_equals_plain_and_updates_buffers_once(use_reentrant):
    """Under activation checkpointing a model trains as without it: the recomputed forward does
    not update AMAT, the running statistics, ``num_batches_tracked`` or BNP's moments a second
    time, CBN's gradients are the plain model's (eta > 0), and the stash is left empty."""
    _checkpoint_run(use_reentrant)


def _checkpoint_worker(rank, world, use_reentrant):
    return _checkpoint_run(use_reentrant, rank, world)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointing_on_two_ranks(tmp_path, use_reentrant):
    s0, s1 = run_distributed(_checkpoint_worker, 2, tmp_path, use_reentrant)
    for name in s0:
        if name.startswith("buffer."):
            assert torch.equal(s0[name], s1[name]), name


def test_a_checkpointed_step_after_plain_steps_recomputes_with_its_own_statistics():
    """Plain training steps, then one under non-reentrant checkpointing: its recomputed
    forward takes this step's plan, and the stash keeps nothing of the plain steps. Before the
    fix the stash recorded every plan as a no-grad one (the statistics step, which decided it,
    runs under ``no_grad``) and kept the plain steps' plans, and the checkpointed step
    recomputed with the oldest of them: gradients wrong by 10³; BNP's stash grew by one dead
    reference per step."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), distnorm.CBN(4), nn.Linear(4, 3))
    distnorm.bnp.attach(plain, exclude=["0"])
    ckpt = copy.deepcopy(plain)
    for step in range(4):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step)) * (step + 1)
        for model, checkpointed in ((plain, False), (ckpt, step == 3)):
            distnorm.set_lr(model, 0.01)
            model.zero_grad()
            y = checkpoint(model, x, use_reentrant=False) if checkpointed else model(x)
            y.square().sum().backward()
        assert_states_close(train_state(plain), train_state(ckpt), 0.0)
    for model in (plain, ckpt):  # each layer's stash: at most the last step's plan, dead
        for stash in (model[2]._state.stash, model[3]._distnorm_bnp.stash):
            assert len(stash._entries) <= 1 and len(stash) == 0


def test_recomputation_without_a_first_forward_is_an_error():
    layer = distnorm.CBN(4)
    distnorm.set_lr(layer, 0.01)
    x = torch.randn(8, 4, requires_grad=True)

    class Recompute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            layer(torch.randn(8, 4))  # a training forward inside a backward pass
            return g

    with pytest.raises(RuntimeError, match="no statistics of an earlier forward"):
        Recompute.apply(x).sum().backward()
