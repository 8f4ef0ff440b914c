"""The small CNN with every layer kind (CBN with AMAT, SyncBatchNorm, POP-Norm, BNP) that the
tests of the paths GPU users take train: compile, activation checkpointing, CUDA."""

from __future__ import annotations

import torch
from torch import nn

import distnorm


LAYERS = {
    "cbn": lambda c: distnorm.CBN(c, rho=1.5),
    "popnorm": lambda c: distnorm.POPNorm(c),
    "syncbn": lambda c: distnorm.SyncBatchNorm(c),
    "syncbn_no_affine": lambda c: distnorm.SyncBatchNorm(c, affine=False),
}


def mixed_model(seed: int = 0) -> nn.Module:
    """Every layer kind in one small CNN: CBN (AMAT), SyncBatchNorm, POP-Norm, BNP."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.Tanh(), distnorm.CBN(8, rho=1.5),
        nn.Conv2d(8, 8, 3, padding=1), distnorm.SyncBatchNorm(8), nn.ReLU(),
        distnorm.POPNorm(8), nn.Conv2d(8, 4, 1, bias=False), nn.Flatten(), nn.Linear(4 * 6 * 6, 3),
    )
    distnorm.bnp.attach(model, exclude=["0", "3"], decay=0.5)
    return model


STEPS = [0.2, 0.05, 0.01, 0.05, 0.01, 0.2]  # eta: 0, 0.5, 0.9, 0.5, 0.9, 0


def batch(step: int, rank: int = 0, world: int = 1, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(4 * world, 3, 6, 6, generator=gen) + 0.5
    return x[rank * 4:(rank + 1) * 4].to(device)


def train_state(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {f"grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    out.update({f"buffer.{n}": b.detach().clone() for n, b in model.named_buffers()})
    return out


def assert_states_close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name].double(), b[name].double(), atol=tol, rtol=tol, msg=name)
