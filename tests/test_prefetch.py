"""distnorm.data.to_device: the batches the loaders yield, moved to the device ahead of the
step. Each test says the behaviour it holds; tests/README.md and tests/mutants.py name the bugs
they catch."""

from __future__ import annotations

import pytest
import torch

from distnorm import data as D
from tests.helpers import write_digits_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_digits_shards(tmp_path_factory.mktemp("prefetch-digits"), size=16)


def _train_loader(root):
    index = D.ShardIndex.load(str(root / "digits-train-index.json"))
    loader = D.TrainLoader(index.local_urls(root), num_samples=600, batch_size=64, rank=1, world_size=2,
                           num_workers=0, transform="digits", image_size=16, pin_memory=False)
    loader.set_epoch(3)
    return loader


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("depth", [1, 3])
def test_the_same_training_batches_in_the_same_order_whatever_the_depth(shards, depth):
    """A training epoch through ``to_device`` is the loader's epoch bit for bit: every batch,
    in order, as many as ``len(loader)`` (the equal batch counts of every rank kept)."""
    plain = list(_train_loader(shards))
    moved = list(D.to_device(_train_loader(shards), "cpu", depth=depth))
    assert len(moved) == len(plain) == len(_train_loader(shards))
    assert all(_same(a, b) for a, b in zip(plain, moved))


def test_evaluation_batches_pass_whole_and_once(shards):
    """Evaluation batches ``(images, labels, mask, keys)`` keep their keys and mask: every
    sample once, as the loader yields them."""
    index = D.ShardIndex.load(str(shards / "digits-val-index.json"))

    def loader():
        return D.EvalLoader(index.local_urls(shards), index=index, batch_size=48, num_workers=0, transform="digits",
                            image_size=16, pin_memory=False)

    plain, moved = list(loader()), list(D.to_device(loader(), "cpu", depth=2))
    assert all(_same(a, b) for a, b in zip(plain, moved)) and len(plain) == len(moved)
    keys = [k for *_, batch_keys in moved for k in batch_keys if k]
    assert len(keys) == len(set(keys)) == index.total


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_batches_are_taken_depth_ahead_of_the_step(depth):
    """While the step reads batch ``n``, batches up to ``n + depth`` have been taken from the
    loader (and their copies issued): the loader's work overlaps the step."""
    taken = []

    def batches():
        for i in range(5):
            taken.append(i)
            yield torch.full((2,), float(i)), [f"key{i}"]

    seen = []
    for images, keys in D.to_device(batches(), "cpu", depth=depth):
        seen.append((int(images[0]), keys[0], len(taken)))
    assert seen == [(i, f"key{i}", min(i + 1 + depth, 5)) for i in range(5)]


@pytest.mark.parametrize("depth", [-1, 1.5, True, "2"])
def test_a_depth_that_is_not_a_count_is_refused(depth):
    with pytest.raises(ValueError, match="depth must be a non-negative int"):
        next(D.to_device([torch.zeros(1)], "cpu", depth=depth))


@pytest.mark.cuda
@pytest.mark.parametrize("depth", [0, 2])
def test_cuda_batches_equal_their_host_batches(depth):
    """On CUDA the copies run on a side stream, the step's stream waiting for each: every batch
    equals its host batch, also when the step overwrites the previous batch in place (the
    allocator must not hand a batch's memory to the next copy before the step is done)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    host = [(torch.randn(64, 3, 32, 32).pin_memory(), torch.arange(64) + i) for i in range(6)]
    got = []
    for images, labels in D.to_device(host, "cuda", depth=depth):
        assert images.device.type == "cuda" and labels.device.type == "cuda"
        torch.cuda._sleep(1_000_000)  # a long step: the next copies run while it does
        got.append((images.clone(), labels.clone()))
        images.mul_(0)  # the step writes into its batch
    assert all(torch.equal(g.cpu(), h) and torch.equal(gl.cpu(), hl) for (g, gl), (h, hl) in zip(got, host))
