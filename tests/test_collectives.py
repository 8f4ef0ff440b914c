"""Which device a group's collectives use, and the check that a synchronized layer's input
sits there (distnorm/_collectives.py). No GPU here: the rule is a pure function of the
group's backend, bound device and current CUDA device, tested with ``torch.device``
objects; the wiring runs on a one-process gloo group told it is NCCL."""

from __future__ import annotations

import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from distnorm import _collectives
from distnorm._collectives import all_reduce_sum, check_collective_device, collective_device, group_device

CPU, CUDA0, CUDA1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


def test_the_group_device_follows_pytorch_bound_device_else_current_device():
    """NCCL: the bound device (init_process_group(device_id=...)), else the current CUDA
    device, as torch.distributed does for the same group; gloo: the CPU whatever is bound or
    current. Bug caught: the LOCAL_RANK guess, which put the consistency checks on another
    GPU than the training collectives after torch.cuda.set_device(another)."""
    assert collective_device("nccl", None, 1) == CUDA1
    assert collective_device("nccl", CUDA1, 0) == CUDA1  # bound wins over current
    assert collective_device("nccl", CUDA0, None) == CUDA0  # bound: the current device is not needed
    assert collective_device("gloo", None, None) == CPU
    assert collective_device("gloo", None, None, CUDA1) == CPU  # gloo takes CUDA tensors as before
    assert collective_device("nccl", None, 1, CUDA1) == CUDA1  # input where the group is: fine


@pytest.mark.parametrize("bound, current, input_device, source", [
    (None, 0, CUDA1, "the current CUDA device"),
    (CUDA1, 1, CUDA0, "bound to (init_process_group(device_id=...))"),
    (None, 0, CPU, "the current CUDA device"),
], ids=["set_device elsewhere", "bound elsewhere", "input on the CPU"])
def test_an_input_off_the_nccl_group_device_is_refused(bound, current, input_device, source):
    """Bug caught: a layer whose input sits on another GPU than its NCCL group's joins the
    collective anyway (a hang on another rank's communicator, or cross-device traffic)."""
    with pytest.raises(ValueError) as info:
        collective_device("nccl", bound, current, input_device, what="CBN 'layer1.0.bn1' (forward)")
    message = str(info.value)
    group_dev = bound if bound is not None else torch.device("cuda", current)
    for part in ("CBN 'layer1.0.bn1' (forward)", f"is on {input_device}", f"collectives on {group_dev}", source,
                 "torch.cuda.set_device(local_rank)", "device_id=", "timeout"):
        assert part in message, (part, message)


@pytest.fixture
def one_rank_gloo(tmp_path, monkeypatch):
    """A one-process gloo WORLD and an empty device-check cache; destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    monkeypatch.setattr(_collectives, "_DEVICES_CHECKED", weakref.WeakKeyDictionary())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_gloo_path_unchanged_and_checked_once(one_rank_gloo, monkeypatch):
    """gloo: the CPU, the all-reduce runs; the check is done once per group and device (a
    dictionary lookup afterwards: it runs every step)."""
    group = one_rank_gloo
    assert group_device(group) == CPU
    t = torch.ones(3, 4, dtype=torch.float64)
    assert torch.equal(all_reduce_sum(t, group, slot="CBN 'bn'|forward|C=4|torch.float64"), torch.ones(3, 4))
    monkeypatch.setattr(_collectives, "_device_facts", lambda g: pytest.fail("checked again"))
    all_reduce_sum(t, group, slot="CBN 'bn'|backward|C=4|torch.float64")


def test_nccl_group_uses_the_current_device_not_local_rank_and_refuses_before_any_collective(one_rank_gloo,
                                                                                           monkeypatch):
    """The wiring, on a gloo group that reports NCCL: group_device reads the current CUDA
    device (LOCAL_RANK says otherwise and is ignored), and all_reduce_sum raises, naming
    the layer and phase, before it reaches any collective (debug mode's fingerprint
    all-reduce included)."""
    group = one_rank_gloo
    monkeypatch.setattr(_collectives.dist, "get_backend", lambda g=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert group_device(group) == CUDA1
    monkeypatch.setattr(_collectives.dist, "all_reduce", lambda *a, **k: pytest.fail("collective reached"))
    _collectives._debug.debug(True)
    with pytest.raises(ValueError, match=r"CBN 'bn' \(backward\): the tensor to all-reduce is on cpu.*on cuda:1"):
        all_reduce_sum(torch.zeros(2, 4), group, slot="CBN 'bn'|backward|C=4|torch.float32")
    with pytest.raises(ValueError, match=r"CBN 'bn' \(forward\)"):  # a refusal is not cached as a pass
        check_collective_device(torch.zeros(2, 4), group, "CBN 'bn'|forward|C=4|torch.float32")
