"""Debug mode turns silent NaNs and would-be hangs into errors raised on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import distnorm
from tests.distributed import run_distributed


def _expect(exc, match, fn):
    try:
        fn()
    except exc as err:
        assert match in str(err), str(err)
        return str(err)
    raise AssertionError(f"expected {exc.__name__}")


def _slot_mismatch_worker(rank, world):
    distnorm.debug(True)
    model = nn.Sequential(distnorm.CBN(4), distnorm.CBN(4))
    distnorm.set_lr(model, 0.01)  # also records layer names
    x = torch.randn(8, 4, requires_grad=True)
    # rank 1 skips the first layer: both ranks reach the same collective from different
    # layers; the frames name both at that collective.
    run = (lambda: model(x)) if rank == 0 else (lambda: model[1](x))
    return _expect(distnorm.CollectiveMismatchError, "different layers", run)


def _shape_mismatch_worker(rank, world):
    distnorm.debug(True)
    layer = distnorm.SyncBatchNorm(4 if rank == 0 else 6)
    return _expect(distnorm.CollectiveMismatchError, "C=6", lambda: layer(torch.randn(8, layer.num_features)))


def _nan_worker(rank, world):
    distnorm.debug(True)
    layer = distnorm.CBN(3)
    distnorm.name_layers(nn.Sequential(layer))
    x = torch.randn(8, 3)
    if rank == 1:
        x[2, 1] = float("nan")
    return _expect(distnorm.NonFiniteStatisticsError, "channels [1]", lambda: layer(x))


def _tiny_batch_worker(rank, world):
    distnorm.debug(True)
    layer = distnorm.SyncBatchNorm(3)
    x = torch.randn(1 if rank == 0 else 0, 3)
    return _expect(ValueError, "more than 1 value per channel", lambda: layer(x))


@pytest.mark.world_size(2)
@pytest.mark.parametrize("worker", [_slot_mismatch_worker, _shape_mismatch_worker, _nan_worker, _tiny_batch_worker])
def test_debug_errors_raise_on_every_rank(tmp_path, worker):
    messages = run_distributed(worker, 2, tmp_path, timeout=60)
    assert len(messages) == 2


def test_debug_local_nan_and_toggle():
    layer = distnorm.SyncBatchNorm(2)
    x = torch.tensor([[0.0, float("inf")], [1.0, 2.0]])
    assert not torch.isfinite(layer(x)).all()  # default: no host sync, no check
    assert distnorm.debug(True) is False
    with pytest.raises(distnorm.NonFiniteStatisticsError, match=r"SyncBatchNorm\(2\).*channels \[1\]"):
        layer(x)
    assert distnorm.debug() is True
