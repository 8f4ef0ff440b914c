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
from torch import nn

import distnorm
from distnorm import _collectives
from distnorm._collectives import all_reduce_sum, check_collective_device, collective_device, group_device
from tests.distributed import run_distributed
from tests.mixed import batch

CPU, CUDA0, CUDA1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


def test_the_group_device_follows_pytorch_bound_device_else_current_device():
    """NCCL: the bound device (init_process_group(device_id=...)), else the current CUDA
    device, as torch.distributed does for the same group; gloo: the CPU whatever is bound or
    current. The device is not guessed from LOCAL_RANK: that guess put the consistency checks
    on another GPU than the training collectives after torch.cuda.set_device(another)."""
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
    """A layer whose input sits on another GPU than its NCCL group's collectives is refused
    before it joins them: the ValueError names the layer and phase, the input's device, the
    group's device and where it comes from, and how to fix it. Joining anyway would hang on
    another rank's communicator, or move data across devices."""
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


# ---------------------------------------------------------------- the paths GPU users take
def _own_communicator_worker(rank, world):
    import torch.distributed as dist

    def run(own: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                              nn.Linear(8 * 6 * 6, 3))
        plugin = distnorm.DistNormPlugin(model, distnorm.DistNormConfig(norm="bn", own_communicator=own))
        ddp = nn.parallel.DistributedDataParallel(model, **distnorm.ddp_kwargs())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        plugin.follow(opt)
        groups = []
        real = dist.all_reduce

        def spy(tensor, *args, group=None, **kwargs):
            groups.append(group)
            return real(tensor, *args, group=group, **kwargs)

        dist.all_reduce = spy
        try:
            for step in range(3):
                opt.zero_grad()
                ddp(batch(step, rank, world)).square().mean().backward()
                opt.step()
        finally:
            dist.all_reduce = real
        layers = [m for m in model.modules() if isinstance(m, distnorm.SyncBatchNorm)]
        return model.state_dict(), groups, layers[0].process_group

    plain, plain_groups, plain_group = run(False)
    own, own_groups, own_group = run(True)
    assert plain_group is None and own_group is distnorm.norm_group() and own_group is not dist.group.WORLD
    # 3 steps x (fwd + bwd), and each group's vote on the kernels at its first step
    assert len(own_groups) == 7 and all(g is own_group for g in own_groups)
    assert len(plain_groups) == 7 and all(g in (None, dist.group.WORLD) for g in plain_groups)
    for name in plain:
        assert torch.equal(plain[name], own[name]), name  # same training, other communicator


@pytest.mark.world_size(2)
def test_own_communicator_carries_the_layers_collectives(tmp_path):
    """With the configuration's own-communicator flag, the layers' collectives run on a
    communicator of their own, not the default one that DDP's buckets use (a flag that did not
    reach the layers would show no difference in results)."""
    run_distributed(_own_communicator_worker, 2, tmp_path)


# ------------------------------------------------------- a GPU frame's read-back, modelled
def test_a_gpu_frames_read_back_stays_on_the_frames_device(monkeypatch):
    """A GPU frame's deferred header check (``distnorm._frames._Pending.record``) stays on the
    frame's device. For a frame on ``cuda:1`` while ``cuda:0`` is current --
    ``init_process_group(device_id=cuda:1)`` without ``torch.cuda.set_device`` (which the NCCL
    device error above offers), or gloo handed another GPU's tensors -- the event is recorded
    on the copy's stream, nothing runs on GPU 0, and the current device stays as it was. No
    GPU here: the CUDA calls ``record`` makes are stood in for by a model of what PyTorch does
    with them -- a current device; ``Event.record()`` on the current device's current stream
    unless given one (``torch/cuda/streams.py``); a device-to-host copy on its *source's*
    current stream (ATen's ``copy_kernel_cuda``); a pinned allocation and an event's recording
    touching the device current then, or the stream's -- while ``record`` itself runs as it is.
    gpu-reading-2026-11-28 (finding 1) found the event recorded on cuda:0's stream while the
    copy ran on cuda:1's, so the event was done at once and the host compared pinned bytes not
    yet copied (a false CollectiveMismatchError at step 1), and the pinned buffer opening a
    CUDA context on GPU 0 in every rank. The same on real GPUs, without a model:
    ``tests/test_cuda.py::test_a_gpu_frame_is_compared_once_its_copy_arrived``."""
    from types import SimpleNamespace

    from distnorm import _frames

    header = _frames._make_header("CBN 'bn'|forward", (8, torch.float32), 0, 2, CPU)
    current = [0]  # the current CUDA device
    touched = []  # (what, the device it ran on)

    class Device:  # torch.cuda.device(d): d is current inside
        def __init__(self, device):
            self.index = torch.device(device).index

        def __enter__(self):
            self.previous, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.previous

    def current_stream(device=None):
        return ("current stream of cuda", current[0] if device is None else torch.device(device).index)

    class Event:
        def record(self, stream=None):
            self.stream = current_stream() if stream is None else stream
            touched.append(("event", self.stream[1]))

        def query(self):
            return False  # the copy is on its way

    class Pinned:
        def copy_(self, source, non_blocking=False):
            assert non_blocking
            self.stream = current_stream(source.device)  # ATen: the source's device and its current stream
            return self

    real_empty = torch.empty

    def empty(*size, pin_memory=False, **kwargs):
        if not pin_memory:
            return real_empty(*size, **kwargs)
        touched.append(("pinned", current[0]))
        return Pinned()

    received = SimpleNamespace(is_cuda=True, device=CUDA1, shape=header.mine.shape, dtype=header.mine.dtype)
    pending = _frames._Pending()
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "device", Device)
        patch.setattr(torch.cuda, "current_stream", current_stream)
        patch.setattr(torch.cuda, "Event", Event)
        patch.setattr(torch, "empty", empty)
        pending.record(received, header)
    assert len(pending) == 1  # kept until its event says the copy arrived
    (event, host, kept), = pending._frames
    assert kept is header
    assert event.stream == host.stream == ("current stream of cuda", 1)  # the event follows the copy
    assert touched == [("pinned", 1), ("event", 1)]  # nothing ran on GPU 0
    assert current[0] == 0  # the caller's current device as it was
