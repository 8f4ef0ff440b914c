"""The plugin's own promises, without an engine: the configuration is compared across ranks
when the plugin is created, and ``follow(optimizer)`` hands each AMAT layer the learning rate
of the parameter group that holds its weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import distnorm
from distnorm.specs import CBNSpec
from tests.distributed import run_distributed


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 6 * 6, 3))


def _configuration_worker(rank, world):
    config = distnorm.DistNormConfig(norm="cbn", cbn=CBNSpec(rho=2.0 if rank == 1 else 1.0))
    with pytest.raises(ValueError) as info:
        distnorm.DistNormPlugin(_model(), config)
    return str(info.value)


@pytest.mark.world_size(2)
def test_ranks_with_different_configurations_are_refused(tmp_path):
    """At attach time the configuration is hashed and compared across ranks; if they differ,
    every rank raises a ``ValueError`` naming the key that differs and each rank's value (as
    ``distnorm-train`` does), none is left waiting in a collective. Were the comparison
    skipped, rank 1 would train with rho = 2 next to rank 0's rho = 1."""
    for message in run_distributed(_configuration_worker, 2, tmp_path, timeout=60):
        assert message.startswith("the distnorm configuration differs across ranks in 1 key:"), message
        assert "cbn.rho: rank 0: 1.0; rank 1: 2.0" in message and len(message) < 200, message


def test_each_amat_layer_follows_the_group_holding_its_weight():
    """README: "``follow(optimizer)`` makes AMAT read, before every training forward, the
    learning rate of the parameter group holding each layer". Each layer follows its own
    group, not group 0: the second CBN, in a group of its own, does not run on the backbone's
    lr."""
    model = _model()
    plugin = distnorm.DistNormPlugin(model, distnorm.DistNormConfig(norm="cbn"))
    first, second = plugin.amat_layers
    own = {id(first.weight), id(first.bias)}
    opt = torch.optim.SGD([{"params": [p for p in model.parameters() if id(p) not in own], "lr": 0.05},
                           {"params": [first.weight, first.bias], "lr": 0.01}])
    plugin.follow(opt)
    for lrs in [(0.05, 0.01), (0.02, 0.08), (0.0, 0.2)]:  # a scheduler moving each group its own way
        for group, lr in zip(opt.param_groups, lrs):
            group["lr"] = lr
        model(torch.randn(4, 3, 6, 6))
        assert (second.lr, first.lr) == lrs
        for layer, lr in ((second, lrs[0]), (first, lrs[1])):
            assert float(layer.amat_eta) == pytest.approx(min(max(1 - 10 * lr, 0.0), 1.0))
