"""The WebDataset pipeline: real tar files in tmp_path, real multi-process loaders."""

from __future__ import annotations

import io
import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image
from torch import nn

from distnorm import data as D
from tests.distributed import run_distributed


def _read_shards(paths) -> list[dict]:
    return list(wds.DataPipeline(wds.SimpleShardList([str(p) for p in paths]), wds.tarfile_to_samples()))


def _image_tree(root: Path) -> None:
    """3 classes of real images: JPEGs (one with dots in its name) and a PNG."""
    rng = np.random.default_rng(0)
    for cls in ("n001", "n002", "n003"):
        (root / cls).mkdir(parents=True)
        for i in range(4):
            img = Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8))
            name = f"img.{i}.v2.JPEG" if i == 1 else f"{cls}_{i}.JPEG"
            path = root / cls / name
            img.save(path, format="JPEG", quality=90)
        Image.fromarray(rng.integers(0, 255, (10, 10, 3), dtype=np.uint8)).save(root / cls / "extra.png")


@pytest.mark.processes  # the writer's worker processes
def test_imagefolder_round_trip_is_byte_identical(tmp_path):
    _image_tree(tmp_path / "train")
    source = D.ImageFolderSource(str(tmp_path / "train"))
    index = D.write_shards(source, str(tmp_path / "out" / "train"), maxcount=4, workers=2, progress=False)
    assert index.total == 15 and [s.count for s in index.shards] == [4, 4, 4, 3]
    assert index.classes == ["n001", "n002", "n003"]
    assert D.ShardIndex.load(tmp_path / "out" / "train-index.json") == index
    assert not list((tmp_path / "out").glob("*.tmp*"))
    samples = _read_shards(sorted((tmp_path / "out").glob("train-*.tar")))
    order = D.shards.sample_order(15, 0)  # the seeded write order, recorded in the index
    assert index.shuffle_seed == 0 and sorted(order) == list(range(15)) and order != list(range(15))
    assert [s["__key__"] for s in samples] == [source.key(i) for i in order]
    assert all("." not in s["__key__"] for s in samples)
    for i, s in zip(order, samples):
        path = Path(source.files[i][0])
        assert int(s["cls"]) == source.files[i][1]
        if path.suffix == ".JPEG":
            assert s["jpg"] == path.read_bytes()  # original bytes, never re-encoded
        else:
            assert D.sources.is_jpeg(s["jpg"])  # a PNG becomes a JPEG
            assert Image.open(io.BytesIO(s["jpg"])).size == (10, 10)


def test_writer_resumes_and_rewrites_only_bad_shards(tmp_path):
    source = D.SyntheticSource(num_samples=20, num_classes=3, image_size=16)
    prefix = str(tmp_path / "s")
    D.write_shards(source, prefix, maxcount=5, progress=False)
    shards = sorted(tmp_path.glob("s-*.tar"))
    good_mtime = os.stat(shards[0]).st_mtime_ns
    shards[1].unlink()
    shards[2].write_bytes(shards[2].read_bytes()[:1000])  # truncated
    os.utime(shards[3], ns=(1, 1))  # complete and verified shards are kept as they are
    D.write_shards(source, prefix, maxcount=5, progress=False)
    assert os.stat(shards[0]).st_mtime_ns == good_mtime and os.stat(shards[3]).st_mtime_ns == 1
    samples = _read_shards(sorted(tmp_path.glob("s-*.tar")))
    assert [s["__key__"] for s in samples] == [source.key(i) for i in D.shards.sample_order(20, 0)]


def test_maxsize_plans_smaller_shards():
    source = D.SyntheticSource(num_samples=30, num_classes=3, image_size=32)
    sizes = [source.size_hint(i) for i in range(30)]
    plan = D.plan_shards(source, maxcount=1000, maxsize=4 * 4096)
    assert len(plan) > 1 and sum(len(r) for r in plan) == 30
    for r in plan[:-1]:
        assert sum(D.shards._tar_bytes(sizes[i]) for i in r) <= 4 * 4096
    with pytest.raises(ValueError, match="maxcount"):
        D.plan_shards(source, maxcount=0)


def test_digits_demo_and_synthetic_sources():
    train, val = D.DigitsSource("train"), D.DigitsSource("val")
    assert (len(train), len(val)) == (1437, 360)
    assert {train.key(i) for i in range(len(train))}.isdisjoint(val.key(i) for i in range(len(val)))
    img = Image.open(io.BytesIO(train.jpeg(0)))
    assert img.size == (32, 32) and img.mode == "RGB"
    synth = D.SyntheticSource(num_samples=10, num_classes=4, image_size=64, seed=3)
    assert synth.jpeg(5) == synth.jpeg(5) and synth.label(5) == 1
    assert Image.open(io.BytesIO(synth.jpeg(5))).size == (64, 64)


@pytest.mark.processes
def test_cli(tmp_path):
    out = subprocess.run([sys.executable, "-m", "distnorm.data.shards", "digits", str(tmp_path / "d" / "val"),
                          "--split", "val", "--maxcount", "100", "--quiet"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "360 samples, 10 classes, 4 shards" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "distnorm.data.shards", str(tmp_path / "missing"), str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "is not a directory" in bad.stderr


def test_index_gets_the_mode_of_the_shards(tmp_path):
    """The index is created like the shards, ``0666`` less the umask, so whoever can read a
    shared shard set can read its index. Before, ``tempfile`` created it ``0600``: other
    users of a shared dataset got "Permission denied" on the index alone."""
    source = D.SyntheticSource(num_samples=6, num_classes=2, image_size=16)
    previous = os.umask(0o022)
    try:
        for umask, mode in ((0o022, 0o644), (0o027, 0o640)):
            os.umask(umask)
            D.write_shards(source, str(tmp_path / f"u{umask:o}" / "s"), maxcount=4, progress=False)
            modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / f"u{umask:o}").iterdir()}
            assert modes == {"s-000000.tar": mode, "s-000001.tar": mode, "s-index.json": mode}, (oct(umask), modes)
    finally:
        os.umask(previous)


def test_empty_class_folders_are_refused_naming_them(tmp_path):
    """Writing shards from a class-folder tree with empty class folders is refused before
    anything is written, naming those folders (2 of 5 here, one holding only a text file).
    Accepted silently, an empty folder gives a class index with no sample: a model asked to
    predict a class it never sees."""
    _image_tree(tmp_path / "train")
    for name in ("n000_empty", "n004_empty"):
        (tmp_path / "train" / name).mkdir()
    (tmp_path / "train" / "n004_empty" / "notes.txt").write_text("not an image")
    with pytest.raises(ValueError, match=r"2 of 5 class folder\(s\) hold no images .*: n000_empty, n004_empty\. "
                                         r"Every folder is a class"):
        D.write_shards(D.ImageFolderSource(str(tmp_path / "train")), str(tmp_path / "out" / "train"), progress=False)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_index_records_each_shards_size_and_sha256(tmp_path):
    """The index records what was written (size, SHA-256) and ``verify_files`` finds a shard
    that differs: by size always, by content only when asked. The checksums are compared, not
    only recorded: a same-size damaged shard fails a checksum verification. A rerun of
    the writer over an index without them (an older distnorm-shards) adds them, rewriting no
    shard — what ``--check --verify-checksums`` tells such an index's user to do."""
    import hashlib
    import json

    source = D.SyntheticSource(num_samples=20, num_classes=3, image_size=16)
    index = D.write_shards(source, str(tmp_path / "s"), maxcount=6, progress=False)
    shards = sorted(tmp_path.glob("s-*.tar"))
    assert [(s.size, s.sha256) for s in index.shards] == \
        [(p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) for p in shards]
    assert D.ShardIndex.load(tmp_path / "s-index.json") == index
    assert index.verify_files(shards, checksum=True) == []
    whole = shards[1].read_bytes()
    damaged = bytearray(whole)
    damaged[len(damaged) // 2] ^= 0x01
    shards[1].write_bytes(bytes(damaged))  # same size
    assert index.verify_files(shards) == []  # sizes only: not seen
    (problem,) = index.verify_files(shards, checksum=True, workers=2)
    assert problem.startswith(f"{shards[1]}: SHA-256 ") and "differs from the index's" in problem
    shards[1].write_bytes(whole[:1000])
    assert index.verify_files(shards) == [f"{shards[1]}: 1000 bytes, the index records {len(whole)}"]
    (tmp_path / "s-000009.tar").write_bytes(b"")
    assert index.verify_files([tmp_path / "s-000009.tar"]) == [f"{tmp_path / 's-000009.tar'}: not listed in the index"]
    (tmp_path / "s-000009.tar").unlink()
    shards[1].write_bytes(whole)
    # an index from before the checksums: nothing to compare, said so; the writer adds them
    old = json.loads((tmp_path / "s-index.json").read_text())
    for shard in old["shards"]:
        del shard["size"], shard["sha256"]
    (tmp_path / "s-index.json").write_text(json.dumps(old))
    assert D.ShardIndex.load(tmp_path / "s-index.json").unchecked(checksum=True) == [p.name for p in shards]
    mtimes = [p.stat().st_mtime_ns for p in shards]
    assert D.write_shards(source, str(tmp_path / "s"), maxcount=6, progress=False) == index
    assert [p.stat().st_mtime_ns for p in shards] == mtimes
    assert D.ShardIndex.load(tmp_path / "s-index.json") == index


# ------------------------------------------------------------------------ loaders
@pytest.fixture(scope="module")
def synth_shards(tmp_path_factory):
    """100 samples in 7 shards of uneven size (15 x 6 + 10)."""
    root = tmp_path_factory.mktemp("synth")
    index = D.write_shards(D.SyntheticSource(num_samples=100, num_classes=5, image_size=16), str(root / "train"),
                           maxcount=15, progress=False)
    return str(root), index


def _train_worker(rank, world, root, total, batch, workers, epochs):
    loader = D.TrainLoader(f"{root}/train-{{000000..000006}}.tar", num_samples=total, batch_size=batch,
                           rank=rank, world_size=world, num_workers=workers, transform="digits", image_size=16,
                           shuffle_buffer=20, seed=7, return_keys=True)
    out = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        batches = [(x.shape, keys) for x, _, keys in loader]
        assert all(shape == (batch, 3, 16, 16) for shape, _ in batches)
        out.append([k for _, keys in batches for k in keys])
    return len(loader), out


@pytest.mark.world_size(3)
@pytest.mark.parametrize("world,workers", [(2, 0), (3, 2)])
def test_train_loader_equal_batches_and_deterministic(tmp_path, synth_shards, world, workers):
    root, index = synth_shards
    batch = 8
    runs = [run_distributed(_train_worker, world, tmp_path, root, index.total, batch, workers, [0, 1, 0])
            for _ in range(2)]
    want = math.ceil(100 / (batch * world))
    for results in runs:
        for n, epochs in results:
            assert n == want and all(len(keys) == want * batch for keys in epochs)
        for rank_a in range(world):
            for rank_b in range(rank_a + 1, world):
                assert results[rank_a][1][0] != results[rank_b][1][0]  # ranks read different data
        for _, epochs in results:
            assert epochs[0] == epochs[2] and epochs[0] != epochs[1]  # the stream depends on (seed, epoch)
    assert runs[0] == runs[1]  # same seed, same stream, across fresh processes


def _eval_model(classes: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, classes))
    for p in model.parameters():
        nn.init.normal_(p, std=0.05)
    return model


def _plain_metrics(model: nn.Module, samples: list[tuple[bytes, int]]) -> dict:
    """top-1 / top-5 / loss of ``model`` on ``(jpeg, label)`` samples, one at a time in float64,
    written independently of ``evaluate`` (ranks by sorting, loss by log-sum-exp)."""
    transform = D.build_transform("digits", train=False, image_size=16)
    top1 = top5 = 0
    loss = 0.0
    for jpeg, label in samples:
        with Image.open(io.BytesIO(jpeg)) as image:
            logits = model(transform(image.convert("RGB"))[None]).double()[0]
        order = sorted(range(len(logits)), key=lambda c: -float(logits[c]))
        top1 += order[0] == label
        top5 += label in order[:5]
        loss += float(torch.logsumexp(logits, 0) - logits[label])
    n = len(samples)
    return {"top1": 100.0 * top1 / n, "top5": 100.0 * top5 / n, "loss": loss / n, "count": n}


def _assert_metrics_equal(got: dict, want: dict) -> None:
    assert got["count"] == want["count"]
    for key in ("top1", "top5", "loss"):
        assert got[key] == pytest.approx(want[key], abs=1e-5), key


def _eval_worker(rank, world, root, workers, batch):
    index = D.ShardIndex.load(f"{root}/train-index.json")
    loader = D.EvalLoader(index.local_urls(root), index=index, batch_size=batch, rank=rank, world_size=world,
                          num_workers=workers, transform="digits", image_size=16)
    keys = [k for _, _, mask, ks in loader for k, m in zip(ks, mask.tolist()) if m]
    metrics = D.evaluate(_eval_model(5), loader)
    return len(loader), keys, metrics


_DROPPED_HANDOFF = """
import os, sys
from multiprocessing.resource_sharer import DupFd
from distnorm.data.loaders import _worker_init

def dropped_handoff():
    # A descriptor served by this process's resource-sharer thread, as a worker serves a
    # batch's; the test connects to the thread and hangs up mid-handshake, as a main process
    # stopped by Ctrl-C does. Fetching it here afterwards returns once the thread has dealt
    # with that connection (it serves one at a time).
    handoff = DupFd(os.open(os.devnull, os.O_RDONLY))
    print(handoff._id[0], flush=True)
    sys.stdin.readline()
    os.close(handoff.detach())

dropped_handoff()
print("--- the worker's hook installed ---", file=sys.stderr, flush=True)
_worker_init(0)
dropped_handoff()
sys.excepthook(ValueError, ValueError("any other error"), None)
"""


@pytest.mark.processes
def test_a_worker_prints_no_traceback_when_the_main_process_drops_a_batch_handoff(synth_shards):
    """A DataLoader worker hands each batch's shared memory over as a file descriptor, which
    the main process fetches from the worker's resource-sharer thread. A main process stopped
    in that handshake (Ctrl-C under ``torchrun``) left the thread printing a
    ``BrokenPipeError`` / ``ConnectionResetError`` / ``EOFError`` traceback after the run's
    one-line report. The loaders' workers start with a hook that drops exactly those errors
    of that thread and passes every other on. The traceback was seen by
    ``test_train.py::test_ctrl_c_under_torchrun_says_where_to_resume_in_one_line``
    (tests/README.md has how often)."""
    import socket

    from distnorm.data.loaders import _worker_init

    root, index = synth_shards
    loader = D.TrainLoader(f"{root}/train-{{000000..000006}}.tar", num_samples=index.total, batch_size=4,
                           num_workers=2, transform="digits", image_size=16)
    assert loader._dataloader([]).worker_init_fn is _worker_init  # every worker of these loaders runs it

    child = subprocess.Popen([sys.executable, "-c", _DROPPED_HANDOFF], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(2):  # without the hook, then with it
            address = child.stdout.readline().strip()
            assert address, child.stderr.read()
            with socket.socket(socket.AF_UNIX) as s:  # connect, then hang up unanswered
                s.connect(address)
            child.stdin.write("\n")
            child.stdin.flush()
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0, err
    before, after = err.split("--- the worker's hook installed ---")
    assert "resource_sharer.py" in before and "Traceback" in before, before  # the scenario happens
    assert "Traceback" not in after and "resource_sharer" not in after, after
    assert "ValueError: any other error" in after  # other errors still reach the previous hook


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.processes),
                                     pytest.param(3, marks=pytest.mark.processes)])
def test_train_loader_resumes_mid_epoch_exactly(synth_shards, workers):
    root, index = synth_shards
    loader = D.TrainLoader(f"{root}/train-{{000000..000006}}.tar", num_samples=index.total, batch_size=4,
                           num_workers=workers, transform="digits", image_size=16, shuffle_buffer=20, seed=3,
                           return_keys=True)
    loader.set_epoch(2)
    full = list(loader)
    for skip in (1, 5, len(loader) - 1):
        loader.set_epoch(2, skip_batches=skip)
        resumed = list(loader)
        assert len(resumed) == len(full) - skip
        for (xa, ya, ka), (xb, yb, kb) in zip(full[skip:], resumed):
            assert ka == kb and torch.equal(ya, yb)
            assert torch.equal(xa, xb)  # augmentations too: seeded per sample
    with pytest.raises(ValueError, match="skip_batches"):
        loader.set_epoch(0, skip_batches=len(loader) + 1)


@pytest.mark.world_size(3)
@pytest.mark.parametrize("world,workers", [(2, 0), (3, 2)])
def test_eval_loader_covers_every_key_exactly_once(tmp_path, synth_shards, world, workers):
    root, index = synth_shards
    results = run_distributed(_eval_worker, world, tmp_path, root, workers, 6)
    lengths = {n for n, _, _ in results}
    assert len(lengths) == 1  # the same number of batches on every rank
    keys = [k for _, ks, _ in results for k in ks]
    source = D.SyntheticSource(num_samples=100, num_classes=5, image_size=16)
    assert sorted(keys) == sorted(source.key(i) for i in range(100))  # each exactly once
    metrics = [m for _, _, m in results]
    assert all(m == metrics[0] for m in metrics) and metrics[0]["count"] == 100
    # by value: padding (ranks and workers with fewer batches) counts nowhere
    _assert_metrics_equal(metrics[0], _plain_metrics(_eval_model(5), [(source.jpeg(i), source.label(i)) for i in range(100)]))


# ----------------------------------------------------------------------- bad data
def _write_raw_shard(path: Path, samples: list[dict]) -> None:
    with wds.TarWriter(str(path)) as writer:
        for s in samples:
            writer.write(s)


@pytest.fixture()
def bad_shards(tmp_path):
    good = D.SyntheticSource(num_samples=12, num_classes=3, image_size=16)
    D.write_shards(good, str(tmp_path / "b"), maxcount=6, progress=False)
    raw = [{"__key__": good.key(i), "jpg": good.jpeg(i), "cls": good.label(i)} for i in range(4)]
    raw[1]["jpg"] = b"\xff\xd8\xffnot really a jpeg"
    raw[2]["cls"] = "abc"
    _write_raw_shard(tmp_path / "b-000002.tar", raw)
    index = D.ShardIndex(classes=good.classes, shards=[D.ShardInfo("b-000000.tar", 6), D.ShardInfo("b-000001.tar", 6),
                                                       D.ShardInfo("b-000002.tar", 4)])
    return tmp_path, index, good


@pytest.mark.processes
def test_undecodable_image_and_bad_label(bad_shards):
    root, index, good = bad_shards
    urls = index.local_urls(root)
    with pytest.raises(D.DataError, match=rf"b-000002.tar sample {good.key(1)}.*on_error='skip'"):
        list(D.EvalLoader(urls, index=index, batch_size=4, num_workers=0, transform="digits", image_size=16))
    loader = D.EvalLoader(urls, index=index, batch_size=4, num_workers=2, transform="digits", image_size=16,
                          on_error="skip")
    with pytest.warns(UserWarning, match="skipped 2"):
        batches = list(loader)
    assert len(batches) == len(loader) and loader.skipped == 2
    assert sum(int(m.sum()) for _, _, m, _ in batches) == 14
    # by value: the two placeholders (label 0, zero image) and nothing else are left out
    good_samples = [(good.jpeg(i), good.label(i)) for i in range(12)] + [(good.jpeg(i), good.label(i)) for i in (0, 3)]
    model = _eval_model(3)
    _assert_metrics_equal(D.evaluate(model, loader), _plain_metrics(model, good_samples))


def _cut_points(shard: Path) -> tuple[int, int]:
    """Byte offsets that truncate ``shard`` inside the second JPEG's data, and inside the
    header of the member after the first sample."""
    import tarfile

    with tarfile.open(shard) as tar:
        members = tar.getmembers()
    jpegs = [m for m in members if m.name.endswith(".jpg")]
    return jpegs[1].offset_data + jpegs[1].size // 2, members[2].offset + 100


@pytest.mark.processes
def test_truncated_shard(bad_shards):
    """A shard cut short fails with a DataError naming it: cut inside a member, in training and
    in evaluation; cut inside a header, in evaluation. With ``on_error="skip"`` it is skipped
    with a warning, and evaluation still gives all its batches (padded) with every whole
    sample. Python's tarfile takes a header cut short for the end of the archive: read as if
    whole, such a shard would leave validation samples out without a word."""
    root, index, good = bad_shards
    shard = root / "b-000001.tar"
    whole = shard.read_bytes()
    in_data, in_header = _cut_points(shard)
    shard.write_bytes(whole[:in_data])
    urls = index.local_urls(root)[:2]
    with pytest.raises(D.DataError, match="b-000001.tar"):
        list(D.TrainLoader(urls, num_samples=12, batch_size=4, num_workers=0, transform="digits",
                           image_size=16, shuffle_buffer=4))
    loader = D.TrainLoader(urls, num_samples=12, batch_size=4, num_workers=2, transform="digits",
                           image_size=16, shuffle_buffer=4, on_error="skip")
    with pytest.warns(UserWarning, match="skipped"):
        assert len(list(loader)) == len(loader) == 3
    assert loader.skipped > 0
    short = D.ShardIndex(index.classes, index.shards[:2])
    for cut in (in_data, in_header):
        shard.write_bytes(whole[:cut])
        with pytest.raises(D.DataError, match="b-000001.tar"):
            list(D.EvalLoader(urls, index=short, batch_size=4, num_workers=0, transform="digits", image_size=16))
        eval_loader = D.EvalLoader(urls, index=short, batch_size=4, num_workers=0,
                                   transform="digits", image_size=16, on_error="skip")
        with pytest.warns(UserWarning, match="b-000001.tar"):
            batches = list(eval_loader)
        # reported once for a cut header (WebDataset reports a cut member more than once)
        assert eval_loader.skipped == 1 if cut == in_header else eval_loader.skipped >= 1
        assert len(batches) == len(eval_loader) == 3  # a short shard is padded, not a hang
        assert sum(int(m.sum()) for _, _, m, _ in batches) == 7  # 6 + the one whole sample before the cut


def test_truncated_webdataset_shard_is_reported_in_evaluation(bad_shards):
    """Shards not written by ``distnorm-shards`` (here WebDataset's ``TarWriter``: a PAX
    header per member) go through ``tarfile``, which takes a header cut short for the end of
    the archive. Evaluation counts each shard's samples against the index, so the samples
    after the cut are not left out without a word (distnorm's own ustar reader raises at the
    cut itself, which ``test_truncated_shard`` sees)."""
    root, index, good = bad_shards
    shard = root / "b-000001.tar"
    _write_raw_shard(shard, [{"__key__": good.key(i), "jpg": good.jpeg(i), "cls": good.label(i)} for i in range(6, 12)])
    assert b"ustar" in shard.read_bytes()[:512] and shard.read_bytes()[156:157] == b"x"  # a PAX header first
    shard.write_bytes(shard.read_bytes()[:_cut_points(shard)[1]])
    urls, short = index.local_urls(root)[:2], D.ShardIndex(index.classes, index.shards[:2])
    with pytest.raises(D.DataError, match="b-000001.tar"):
        list(D.EvalLoader(urls, index=short, batch_size=4, num_workers=0, transform="digits", image_size=16))
    loader = D.EvalLoader(urls, index=short, batch_size=4, num_workers=0, transform="digits", image_size=16,
                          on_error="skip")
    with pytest.warns(UserWarning, match="b-000001.tar"):
        batches = list(loader)
    assert loader.skipped == 1 and len(batches) == len(loader) == 3
    assert sum(int(m.sum()) for _, _, m, _ in batches) == 7  # 6 + the one whole sample before the cut


def test_bad_arguments(synth_shards):
    root, index = synth_shards
    with pytest.raises(ValueError, match="rank"):
        D.TrainLoader(f"{root}/train-000000.tar", num_samples=10, batch_size=2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="on_error"):
        D.TrainLoader(f"{root}/train-000000.tar", num_samples=10, batch_size=2, on_error="ignore")
    with pytest.raises(ValueError, match="preset"):
        D.TrainLoader(f"{root}/train-000000.tar", num_samples=10, batch_size=2, transform="mnist")
    with pytest.raises(ValueError, match="not listed"):
        D.EvalLoader(f"{root}/other-000000.tar", index=index, batch_size=2)
    with pytest.raises(FileNotFoundError, match="distnorm-shards"):
        D.ShardIndex.load(f"{root}/missing-index.json")


# ------------------------------------------------------------------ class mixing
def _class_sorted_tree(root: Path, classes: int = 40, per_class: int = 100) -> Path:
    """An ImageFolder tree at ImageNet's proportions (shard of 100 ~ 1,000 images of 1,000
    classes): listed class by class, as ImageFolder lists ImageNet."""
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(buf, format="JPEG")
    for c in range(classes):
        d = root / f"n{c:04d}"
        d.mkdir(parents=True)
        for i in range(per_class):
            (d / f"{i}.JPEG").write_bytes(buf.getvalue())
    return root


def _distinct_classes_per_batch(prefix: str, index: "D.ShardIndex", batches: int | None = None) -> list[int]:
    """Distinct classes in each batch of 32 of epoch 0 (the first ``batches`` only, if given:
    a whole epoch of 4,000 samples costs ~10 s on 2 cores)."""
    loader = D.TrainLoader(f"{prefix}-{{000000..{len(index.shards) - 1:06d}}}.tar", num_samples=index.total,
                           batch_size=32, num_workers=0, shuffle_buffer=500, transform="digits", image_size=8)
    loader.set_epoch(0)
    return [len(set(labels.tolist())) for _, labels in itertools.islice(loader, batches)]


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_shards_mix_classes_from_the_first_batch(tmp_path, caplog):
    """Shards written from a class-sorted tree mix the classes: a shard of 100 holds more than
    25 of the 40 classes, and batches of 32 hold nearly as many distinct classes as an i.i.d.
    draw (22.2) from the first batch on; the shards are the same whatever the number of writer
    processes, and on a rerun. Shards in source order (``shuffle_seed=None``) are reported as
    written in class order, by the index and by the loader. Cut from ImageFolder's
    class-by-class order, shards held one or two classes each, and batches of 32 held 10.5
    distinct classes (6.4 at the start of the epoch): biased batch statistics."""
    tree = _class_sorted_tree(tmp_path / "train")
    iid = 40 * (1 - (39 / 40) ** 32)  # expected distinct classes in 32 i.i.d. draws: 22.2
    source = D.ImageFolderSource(str(tree))
    index = D.write_shards(source, str(tmp_path / "mixed"), maxcount=100, progress=False)
    assert index.shuffle_seed == 0 and not index.class_sorted_shards()
    assert min(s.classes_held() for s in index.shards) > 25  # ~37 classes per shard of 100
    with caplog.at_level("WARNING"):
        mixed = _distinct_classes_per_batch(str(tmp_path / "mixed"), index)
    assert sum(mixed) / len(mixed) >= 0.9 * iid and sum(mixed[:5]) / 5 >= 0.9 * iid, (mixed[:5], iid)
    assert "class order" not in caplog.text

    # the same order whatever the number of writer processes, and on a rerun
    again = D.write_shards(source, str(tmp_path / "again"), maxcount=100, progress=False, workers=2)
    assert [s.class_counts for s in again.shards] == [s.class_counts for s in index.shards]
    for a, b in zip(sorted(tmp_path.glob("mixed-*.tar")), sorted(tmp_path.glob("again-*.tar"))):
        assert a.read_bytes() == b.read_bytes()

    # source order reproduces the bias; the index and the loader both say so
    plain = D.write_shards(source, str(tmp_path / "sorted"), maxcount=100, progress=False, shuffle_seed=None)
    assert len(plain.class_sorted_shards()) == 40
    with caplog.at_level("WARNING"):  # the loader warns when its first shard ends, before the first batch
        biased = _distinct_classes_per_batch(str(tmp_path / "sorted"), plain, batches=5)
    assert len(biased) == 5 and sum(biased) / 5 < 0.6 * iid
    assert "look written in class order" in caplog.text


# ------------------------------------------------------------------------ transforms
def _jpeg(height: int, width: int, seed: int = 0, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@pytest.mark.parametrize("preset,size", [("imagenet", 224), ("cifar", 32), ("digits", 16)])
def test_preset_transforms_equal_torchvision_compose_bit_for_bit(preset, size):
    """Each preset's transform equals torchvision's Compose of its geometry, ToTensor and
    Normalize bit for bit, in training and evaluation, for a batch and for one image: the
    batch normalization rounds as ToTensor + Normalize do (no fused multiply-add, mean / std
    not in float64), the geometry draws its random numbers in the same order, and a grayscale
    JPEG gets three channels."""
    from torchvision import transforms as T

    images = [_jpeg(375, 500, 0), _jpeg(500, 333, 1), _jpeg(40, 48, 2), _jpeg(300, 400, 3, mode="L")]
    for train in (True, False):
        transform = D.build_transform(preset, train=train, image_size=size)
        compose = T.Compose([*transform.geometry, T.ToTensor(), T.Normalize(transform.mean, transform.std)])
        expected, rows = [], []
        for seed, data in enumerate(images):
            torch.manual_seed(seed)
            with Image.open(io.BytesIO(data)) as image:
                expected.append(compose(image.convert("RGB")))
            torch.manual_seed(seed)
            rows.append(transform.pixels(data))
        assert torch.equal(transform.batch(rows), torch.stack(expected)), (preset, train)
        torch.manual_seed(0)
        with Image.open(io.BytesIO(images[0])) as image:
            assert torch.equal(transform(image), expected[0])  # the one-image call too


def test_reduced_decode_decodes_smaller_and_keeps_the_crop():
    """With ``reduced_decode`` a large JPEG is decoded at a reduced scale (1/4 of 1600 x 1200
    here) that leaves the crop no smaller than the output, so nothing is upsampled; the
    training crop is drawn as on the full image, so it is the crop taken without reduction;
    an image with nothing to reduce gives the same pixels."""
    from torchvision import transforms as T

    big = _jpeg(1200, 1600)
    full = D.build_transform("imagenet", train=False, image_size=224)
    reduced = D.build_transform("imagenet", train=False, image_size=224, reduced_decode=True)
    image, _ = reduced._decode_reduced(big)
    assert image.size == (400, 300)  # 1/4: the short side 300 >= 256, 1/8 would give 150
    a, b = full.pixels(big).astype(float), reduced.pixels(big).astype(float)
    assert a.shape == b.shape == (224, 224, 3) and np.abs(a - b).mean() < 8  # noise image: the worst case

    train_full = D.build_transform("imagenet", train=True, image_size=224)
    train_reduced = D.build_transform("imagenet", train=True, image_size=224, reduced_decode=True)
    for seed in range(6):
        torch.manual_seed(seed)
        top, left, h, w = T.RandomResizedCrop.get_params(Image.open(io.BytesIO(big)), (0.08, 1.0), (3 / 4, 4 / 3))
        torch.manual_seed(seed)
        image, steps = train_reduced._decode_reduced(big)
        factor = 1600 // image.size[0]
        assert min(h, w) / factor >= 224 and (factor == 8 or min(h, w) / (2 * factor) < 224), (h, w, factor)
        assert len(steps) == 2  # the drawn crop, then the flip
        torch.manual_seed(seed)
        a = train_full.pixels(big).astype(float)
        torch.manual_seed(seed)
        b = train_reduced.pixels(big).astype(float)
        assert np.abs(a - b).mean() < 8, seed  # the same crop (another crop differs by ~60 here)
    small = _jpeg(300, 400)  # ImageNet-sized: nothing to reduce, the same pixels
    torch.manual_seed(0)
    a = train_full.pixels(small)
    torch.manual_seed(0)
    assert np.array_equal(a, train_reduced.pixels(small))



def _progressive(data: bytes) -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(data)).save(buf, format="JPEG", quality=90, progressive=True)
    return buf.getvalue()


def test_decoding_down_to_the_crop_gives_the_pixels_of_a_full_decode(monkeypatch):
    """The RandomResizedCrop preset stops the JPEG decoder at the crop's bottom edge, and the
    rows it decodes are a full decode's, pixel for pixel, down to the crop; grayscale,
    progressive and non-JPEG files, and files with trailing bytes, are decoded in full. The
    preset's tensors equal torchvision's Compose (the crop drawn as RandomResizedCrop draws it),
    most of them through the shortened decode, and a truncated file, one cut inside its header
    or one with a bad Huffman table fails as a full decode fails."""
    from torchvision import transforms as T

    from distnorm.data import transforms as DT

    photos = [D.SyntheticSource(num_samples=3, shapes=((375, 500), (500, 333), (37, 50))).jpeg(i) for i in range(3)]
    noise, digits = _jpeg(300, 400, 5), [D.DigitsSource(split="val").jpeg(i) for i in range(8)]
    for data in [*photos, noise, digits[0]]:
        with Image.open(io.BytesIO(data)) as image:
            full = np.asarray(image.convert("RGB"))
        height = full.shape[0]
        for rows in sorted({1, 7, 8, 9, 16, height // 2, height - 1}):
            with Image.open(io.BytesIO(data)) as image:
                top = DT._jpeg_rows(image, data, rows)
            assert top is not None and top.mode == "RGB" and np.array_equal(np.asarray(top), full[:rows]), rows
        for rows in (0, height):  # nothing to save: the caller decodes in full
            assert DT._jpeg_rows(Image.open(io.BytesIO(data)), data, rows) is None
    png = io.BytesIO()
    Image.open(io.BytesIO(noise)).save(png, format="PNG")
    for other in (_jpeg(300, 400, 1, mode="L"), _progressive(noise), noise + b"trailing", png.getvalue()):
        assert DT._jpeg_rows(Image.open(io.BytesIO(other)), other, 10) is None

    # the preset: the Compose's tensors, most of them through the shortened decode
    transform = D.build_transform("imagenet", train=True, image_size=24)
    compose = T.Compose([*transform.geometry, T.ToTensor(), T.Normalize(transform.mean, transform.std)])
    real, used = DT._jpeg_rows, []

    def spy(*args):
        used.append(real(*args))
        return used[-1]

    monkeypatch.setattr(DT, "_jpeg_rows", spy)
    for seed, data in enumerate([*photos, noise, *digits] * 3):
        torch.manual_seed(seed)
        with Image.open(io.BytesIO(data)) as image:
            expected = compose(image.convert("RGB"))
        torch.manual_seed(seed)
        assert torch.equal(transform.batch([transform.pixels(data)])[0], expected), seed
    assert sum(u is not None for u in used) >= len(used) // 2, used

    # a cut file, or one whose Huffman table libjpeg rejects (Image.open does not parse it),
    # fails as a full decode fails, even where the crop lies above the damage
    header = Image.open(io.BytesIO(noise)).fp.tell()
    dht = noise.index(b"\xff\xc4")
    bad_table = noise[:dht + 4] + b"\x2f" + noise[dht + 5:]  # table index 15: JERR_DHT_INDEX
    for broken in (noise[:len(noise) // 2], noise[:-2], noise[:header - 3], bad_table):
        for seed in range(4):
            torch.manual_seed(seed)
            with pytest.raises(OSError):
                transform.pixels(broken)



def test_tar_reader_reads_what_webdataset_reads(tmp_path, synth_shards, monkeypatch):
    """The fast ustar reader reads what WebDataset reads: every member, long (prefixed) names,
    the padding after a member and each sample's grouping; PAX, GNU and compressed shards
    (written by other tools, or by distnorm-shards before 2026-11-23) read as WebDataset reads
    them; and a shard cut inside a member or a header gives one error naming it instead of
    being read as if whole."""
    import tarfile

    from distnorm.data import tars

    def both(urls: list[str]) -> tuple[list[dict], list[dict]]:
        def reraise(err):
            raise err
        return (list(wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples(handler=reraise))),
                list(wds.DataPipeline(wds.SimpleShardList(urls), tars.tarfile_to_samples(reraise))))

    root, index = synth_shards
    plain, fast = both(index.local_urls(root))
    assert len(fast) == index.total and fast == plain
    fallback = wds.tariterators.tar_file_iterator
    monkeypatch.setattr(wds.tariterators, "tar_file_iterator", None)  # distnorm-shards' shards: no fallback
    first = index.local_urls(root)[:1]
    assert list(tars.tarfile_to_samples(None)([{"url": u} for u in first])) == fast[:index.shards[0].count]
    monkeypatch.setattr(wds.tariterators, "tar_file_iterator", fallback)
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        for mode in ("w", "w:gz"):
            path = tmp_path / f"other-{fmt}-{mode[-2:]}.tar"
            with tarfile.open(path, mode, format=fmt) as tar:
                def add(name, data=b"", kind=tarfile.REGTYPE, mtime=0):
                    info = tarfile.TarInfo(name)
                    info.size, info.type, info.mtime = len(data), kind, mtime
                    tar.addfile(info, io.BytesIO(data))
                add("a_dir", kind=tarfile.DIRTYPE)
                add("__meta__", b"skipped")
                for i in range(4):
                    add(f"k{i}.jpg", bytes(range(256)) * (3 * i) + b"x" * i)  # 0 to 772 bytes
                    add(f"k{i}.cls", str(i).encode(), mtime=1.5 if fmt == tarfile.PAX_FORMAT else 0)
                add("p" * 120 + "/k.txt" if fmt == tarfile.USTAR_FORMAT else "long/" + "n" * 150 + ".txt", b"named")
            plain, fast = both([str(path)])
            assert len(fast) == 5 and fast == plain, (fmt, mode)
    # cut inside a member's data, inside a header: an error naming the shard
    shard = Path(index.local_urls(root)[0])
    whole = shard.read_bytes()
    for cut in _cut_points(shard):
        (tmp_path / "cut.tar").write_bytes(whole[:cut])
        errors = []
        list(tars.tarfile_to_samples(lambda err: errors.append(err) or True)([{"url": str(tmp_path / "cut.tar")}]))
        assert len(errors) == 1 and errors[0].args[-1] == str(tmp_path / "cut.tar"), (cut, errors)


def test_shards_have_no_pax_headers(tmp_path):
    """Written shards have no PAX header: a float mtime in the writer adds one to every
    member, which doubled the cost of reading the shards (Python's tarfile parses each
    header)."""
    import tarfile

    source = D.SyntheticSource(num_samples=4, num_classes=2, image_size=16)
    D.write_shards(source, str(tmp_path / "s"), maxcount=4, progress=False)
    with tarfile.open(next(tmp_path.glob("s-*.tar"))) as tar:
        members = tar.getmembers()
    assert len(members) == 8 and all(not m.pax_headers for m in members)


@pytest.fixture(scope="module")
def photo_shards(tmp_path_factory):
    """24 non-square JPEGs (ImageNet's frame shapes, scaled down) in 3 shards."""
    from distnorm.data.sources import IMAGENET_SHAPES

    root = tmp_path_factory.mktemp("photos")
    shapes = tuple((h // 8, w // 8) for h, w in IMAGENET_SHAPES)
    index = D.write_shards(D.SyntheticSource(num_samples=24, num_classes=4, shapes=shapes), str(root / "train"),
                           maxcount=8, progress=False)
    return f"{root}/train-{{000000..000002}}.tar", index


def _batches(loader) -> list:
    loader.set_epoch(0) if hasattr(loader, "set_epoch") else None
    return [(b[0].clone(), b[1].clone(), list(b[-1])) for b in loader]


@pytest.mark.processes
def test_torchvision_decoder_in_workers_and_deferred_to_the_main_process_agree(photo_shards):
    """The torchvision decoder gives the same batches in the workers and deferred to the main
    process: the same crops and flips (drawn in the same order, and PIL's), the same mode (not
    grey or RGBA), every deferred batch decoded before it is yielded, and in evaluation every
    sample exactly once on the deferred path too. (``decode_device="cuda"`` runs this path with
    nvJPEG: measured by ``make test-gpu``.)"""
    urls, index = photo_shards
    common = dict(num_samples=index.total, batch_size=4, num_workers=2, transform="imagenet", image_size=24,
                  shuffle_buffer=8, seed=3, return_keys=True)
    pil = _batches(D.TrainLoader(urls, **common))
    worker = _batches(D.TrainLoader(urls, decoder="torchvision", **common))
    deferred = _batches(D.TrainLoader(urls, decoder="torchvision", decode_device="cpu", **common))
    assert len(worker) == len(deferred) == len(pil) == math.ceil(index.total / 4)
    for (a, la, ka), (b, lb, kb), (c, lc, kc) in zip(worker, deferred, pil):
        assert ka == kb == kc and torch.equal(la, lb) and torch.equal(la, lc)
        assert b.dtype == torch.float32 and torch.equal(a, b)
        # the same crops and flips as PIL; torch's antialiased resize is not Pillow's to the bit
        assert (a - c).abs().mean() < 0.05, (a - c).abs().mean()

    evals = [D.EvalLoader(urls, index=index, batch_size=5, num_workers=2, transform="imagenet", image_size=24, **kw)
             for kw in ({"decoder": "torchvision"}, {"decoder": "torchvision", "decode_device": "cpu"})]
    (worker, deferred) = ([(x, y, m, k) for x, y, m, k in loader] for loader in evals)
    keys = [k for _, _, m, ks in deferred for k, real in zip(ks, m.tolist()) if real]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == index.total
    for (a, _, ma, ka), (b, _, mb, kb) in zip(worker, deferred):
        assert ka == kb and torch.equal(ma, mb) and torch.equal(a, b)


def test_decoder_settings_refused_with_the_setting_to_change():
    with pytest.raises(ValueError, match="decode_device needs decoder='torchvision'"):
        D.build_transform("imagenet", train=True, image_size=32, decode_device="cpu")
    with pytest.raises(ValueError, match="decode_device supports the presets .* not 'cifar'"):
        D.build_transform("cifar", train=True, image_size=32, decoder="torchvision", decode_device="cpu")
    with pytest.raises(ValueError, match="reduced_decode .* needs decoder='pil'"):
        D.build_transform("imagenet", train=True, image_size=32, decoder="torchvision", reduced_decode=True)
    with pytest.raises(ValueError, match="decoder must be one of"):
        D.build_transform("imagenet", train=True, image_size=32, decoder="nvjpeg")


@pytest.mark.parametrize("preset", ["imagenet", "cifar", "digits"])
def test_the_presets_decode_device_accepts_are_those_whose_geometry_it_applies(preset):
    """The configuration refuses ``decode_device`` with a preset before torch is imported
    (``distnorm.data.specs.DEFERRED_PRESETS``); the geometry the preset builds says the same.
    A preset's steps cannot change without the list (the device path would then refuse at the
    first batch, or apply steps it does not implement)."""
    from distnorm.data.specs import DEFERRED_PRESETS, TRANSFORM_PRESETS, _check_decoding
    from distnorm.data.transforms import _preset

    assert set(TRANSFORM_PRESETS) == {"imagenet", "cifar", "digits"}
    supported = []
    for train in (True, False):
        try:
            _check_decoding(_preset(preset, train, 32)[0], False, "torchvision", "cpu")
            supported.append(True)
        except ValueError:
            supported.append(False)
    assert all(supported) == (preset in DEFERRED_PRESETS)  # a preset serves training and evaluation


def test_recipe_data_settings_reach_the_loaders(photo_shards):
    """The recipe's ``data.*`` decoding settings (``decoder``, ``decode_device``,
    ``reduced_decode``) reach the loaders, and a value they cannot take is refused when the
    configuration is read, before any worker starts. A setting parsed from the recipe but
    never handed to the loaders would change nothing."""
    from distnorm.train.config import from_dict
    from distnorm.train.loop import build_loaders

    urls, index = photo_shards
    index_path = str(Path(urls.split("/train-")[0]) / "train-index.json")
    cfg = from_dict({"model": {"name": "resnet18"}, "data": {
        "train_shards": urls, "train_index": index_path, "val_shards": urls, "val_index": index_path,
        "image_size": 24, "num_workers": 0, "eval_workers": 0, "decoder": "torchvision", "decode_device": "cpu"}})
    train, evaluation = build_loaders(cfg, rank=0, world=1, per_rank=4)
    for loader in (train, evaluation):
        assert (loader.transform.decoder, str(loader.transform.decode_device)) == ("torchvision", "cpu")
    train.set_epoch(0)
    images, labels = next(iter(train))
    assert images.shape == (4, 3, 24, 24) and images.dtype == torch.float32
    cfg = from_dict({"model": {"name": "resnet18"}, "data": {
        "train_shards": urls, "train_index": index_path, "image_size": 24, "num_workers": 0, "reduced_decode": True}})
    assert build_loaders(cfg, rank=0, world=1, per_rank=4)[0].transform.reduced_decode is True
    with pytest.raises(ValueError, match="decode_device"):
        from_dict({"model": {"name": "resnet18"}, "data": {"decode_device": "tpu"}})
    with pytest.raises(ValueError, match="data: decode_device needs decoder='torchvision'"):
        from_dict({"model": {"name": "resnet18"}, "data": {"decode_device": "cuda"}})  # refused before any worker
    with pytest.raises(ValueError, match="data: decode_device supports the presets .* not 'cifar'"):
        from_dict({"model": {"name": "resnet18"}, "data": {"transform": "cifar", "decoder": "torchvision",
                                                           "decode_device": "cuda"}})


def test_shuffle_buffer_reads_no_sample_the_epoch_does_not_use():
    """The shuffle buffer over the endless resampled stream reads no sample the epoch does not
    use: it pulls what the epoch needs (and a replacement for each sample that fails), and
    yields each sample it read once, shuffled. ``webdataset.shuffle`` keeps its buffer full to
    the end of the epoch, so each worker read up to a buffer's worth of samples it never used
    (a quarter of an ImageNet epoch's reading at the recipes' defaults)."""
    from distnorm.data.loaders import _Demand, _shuffle_on_demand

    for needed, bufsize, failing in ((100, 30, set()), (100, 500, set()), (50, 20, {3, 17, 18, 40})):
        pulled = []

        def endless():
            i = 0
            while True:
                pulled.append(i)
                yield i
                i += 1

        demand = _Demand(needed)
        out = []
        for item in _shuffle_on_demand(endless(), bufsize=bufsize, initial=min(bufsize, 10), seed=1, demand=demand):
            out.append(item)
            if item not in failing:  # what the decode stage counts
                demand.delivered += 1
            if demand.outstanding() == 0:  # the epoch's last batch: the loader stops here
                break
        assert demand.delivered == needed and len(pulled) == needed + len(failing & set(pulled))
        assert sorted(out) == pulled and out != pulled  # every sample read is used once, shuffled


@pytest.mark.processes
def test_batch_buffers_reused_only_once_nothing_refers_to_them(photo_shards):
    """Workers write batches into shared buffers the main process gave back
    (:mod:`distnorm.data.batches`). A buffer goes back only once nothing holds the batch, a
    view of it or a NumPy array of it (the kept values would change under the caller), and
    buffers are reused, not allocated fresh for each batch (the cost the pool removes)."""
    urls, index = photo_shards
    loader = D.TrainLoader(urls, num_samples=index.total, batch_size=1, num_workers=2, transform="imagenet",
                           image_size=24, shuffle_buffer=8, seed=3, pin_memory=False)
    capacity = 2 * (loader.prefetch_factor + 3)
    assert len(loader) > capacity  # more batches than buffers: reuse is needed to stay pooled
    expected = [x.clone() for x, _ in loader]  # each batch dropped at once: buffers come back
    assert 2 <= loader.fresh_batch_buffers <= capacity  # 7 of 24 when written
    kept = {
        "batches": [x for x, _ in loader],
        "views": [x[0, 1:, 3:9] for x, _ in loader],
        "arrays": [x.numpy()[0, 0] for x, _ in loader],
    }
    assert loader.fresh_batch_buffers == len(loader)  # every batch held: nothing to reuse
    pixels = np.zeros((24, 24, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"float32 output of shape \(1, 3, 24, 24\)"):
        loader.transform.batch([pixels], out=torch.empty(1, 3, 24, 23))
    for how, held in kept.items():
        assert len(held) == len(expected), how
        for want, got in zip(expected, held):
            assert torch.equal(torch.as_tensor(got), want[0, 1:, 3:9] if how == "views" else
                               want[0, 0] if how == "arrays" else want), how


def _sum_when_told(images, go, out) -> None:
    go.wait(60)
    out.put(float(images.double().sum()))


@pytest.mark.processes
def test_batches_a_forked_process_inherits_keep_their_buffers(photo_shards):
    """A process forked while a batch is held shares its buffer: that buffer must never go
    back to its worker (distnorm.data.batches._before_fork), or the child would read later
    batches' values. Also: ``prefetch_factor=None`` (the DataLoader's 2) is accepted."""
    import multiprocessing

    urls, index = photo_shards
    loader = D.TrainLoader(urls, num_samples=index.total, batch_size=1, num_workers=2, transform="imagenet",
                           image_size=24, shuffle_buffer=8, seed=3, pin_memory=False, prefetch_factor=None)
    fork = multiprocessing.get_context("fork")
    go, out, children, sums = fork.Event(), fork.SimpleQueue(), [], []
    for step, (images, _) in enumerate(loader):
        if step % 6 == 0:
            sums.append(float(images.double().sum()))
            children.append(fork.Process(target=_sum_when_told, args=(images, go, out)))
            children[-1].start()  # fork: the child shares the batch's buffer, dropped here next step
    go.set()  # the epoch is over: every pooled buffer has been written again if given back
    got = sorted(out.get() for _ in children)
    for child in children:
        child.join(60)
    assert got == sorted(sums) and len(got) == 4
