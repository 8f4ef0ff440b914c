"""Multi-node WebDataset loaders: equal-length training epochs and exact-once evaluation.

**Training** (:class:`TrainLoader`). Shards are *resampled* from one deterministic stream
per epoch (seed from ``(seed, epoch)``), split explicitly by rank (``rank::world``) and
then by DataLoader worker, read, shuffled in a buffer, decoded with PIL, augmented and
batched inside the workers. Every rank yields exactly ``ceil(num_samples / global_batch)``
batches per epoch, whatever the number or sizes of the shards: data-parallel training with
unequal batch counts hangs in the last collective.

**Evaluation** (:class:`EvalLoader`). Shards are split by rank, then by worker, and each is
read once, so every validation sample is seen by exactly one rank. The shard index gives
each rank's and worker's sample counts up front, so every rank yields the *same* number of
batches (engines such as DeepSpeed ZeRO-3 issue collectives in every forward): short
workers and ranks pad with fully masked batches. Batches are ``(images, labels, mask,
keys)``; :func:`distnorm.data.evaluate` reduces top-1 / top-5 / loss over real samples.

**Paths** are anything WebDataset opens: local paths, ``file://``, or ``pipe:`` commands
(``pipe:aws s3 cp s3://bucket/train-000000.tar -``, ``pipe:curl -s -L https://...``), as a
list or a brace pattern (``/shards/train-{000000..001281}.tar``).

**Batch memory**: inside DataLoader workers a batch is written into a shared-memory buffer
the worker reuses once the main process no longer refers to the batch
(:mod:`distnorm.data.batches`). A batch you keep stays as it is; ``clone()`` one before
*sending* it to another process (a ``multiprocessing`` queue, pipe or pool task).

**Bad data**: with ``on_error="raise"`` (default) an unreadable shard or undecodable
sample raises :class:`DataError` naming the shard and key; with ``on_error="skip"`` it is
skipped (in evaluation: replaced by a masked placeholder, keeping batch counts exact),
counted, and reported at the end of the epoch (``loader.skipped``).

**Settings**: both loaders take their shards, batch and place in the job as arguments, and
everything else as keywords of :class:`LoaderSpec` (the image pipeline of
:class:`~distnorm.data.specs.ImageSpec`, the DataLoader workers, bad data), whose fields
own the defaults; the recipe's ``data`` section extends it, so ``distnorm-train`` and a
script calling the loaders start from the same values.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import math
import random
import sys
import warnings
from dataclasses import dataclass
from multiprocessing import resource_sharer
from types import TracebackType
from typing import Any, Callable, Iterator, Sequence

import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from distnorm.data.bad_data import ClassOrderWatch, ErrorLog
from distnorm.data.batches import BatchPool, BatchReturns
from distnorm.data.index import ShardIndex, expand_urls
from distnorm.data.tars import tarfile_to_samples
from distnorm.data.specs import TRANSFORM_PRESETS, DataError, LoaderSpec
from distnorm.data.transforms import ImageTransform, batch_tensor, build_transform, spec_transform

__all__ = [
    "DataError",
    "TrainLoader",
    "EvalLoader",
    "LoaderSpec",
    "build_transform",
    "expand_urls",
    "TRANSFORM_PRESETS",
]

logger = logging.getLogger(__name__)

def _wds():
    try:
        import webdataset
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the WebDataset loaders need `pip install distnorm[data]`") from err
    return webdataset


def _seed(*parts: Any) -> int:
    """A 63-bit seed from ``parts`` that is the same in every process."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _decode(sample: dict, transform: Callable, log: ErrorLog):
    """``(image, label, key)`` or ``None`` (recorded in ``log``) for one raw sample.

    ``image`` is an :class:`ImageTransform`'s ``uint8`` pixels (normalized per batch by
    :func:`_collate`), or what another transform returns for the PIL image.
    """
    key, url = sample.get("__key__", "?"), sample.get("__url__", "?")
    try:
        if "jpg" not in sample or "cls" not in sample:
            raise KeyError(f"expected .jpg and .cls members, found {sorted(k for k in sample if not k.startswith('__'))}")
        label = int(sample["cls"])
        if isinstance(transform, ImageTransform):
            image = transform.pixels(sample["jpg"])
        else:
            with Image.open(io.BytesIO(sample["jpg"])) as pil:
                image = transform(pil.convert("RGB"))
    except Exception as err:  # noqa: BLE001 - reported with shard and key
        log.failure(f"shard {url} sample {key}", err)
        return None
    log.success()
    return image, label, key


def _collate(transform: Callable, pool: BatchPool | None, rows: list[tuple]) -> tuple:
    """``(images, labels, mask, keys, lease)``; inside a worker the images are written into a
    shared buffer from ``pool`` (``lease`` says which, for :meth:`BatchReturns.claim`)."""
    samples, lease = [r[0] for r in rows], None
    if isinstance(transform, ImageTransform) and transform.decode_device is not None:
        images = transform.batch(samples)  # Deferred rows: decoded in the main process
    else:
        if isinstance(transform, ImageTransform):
            shape, dtype = transform.batch_shape(samples), torch.float32
        else:
            shape, dtype = (len(samples), *samples[0].shape), samples[0].dtype
        out, lease = pool.take(shape, dtype) if pool is not None else (batch_tensor(shape, dtype), None)
        images = transform.batch(samples, out=out) if isinstance(transform, ImageTransform) \
            else torch.stack(samples, out=out)
    labels = torch.tensor([r[1] for r in rows], dtype=torch.long)
    mask = torch.tensor([r[2] for r in rows], dtype=torch.bool)
    return images, labels, mask, [r[3] for r in rows], lease


def _finish(transform: Callable, images: Any) -> torch.Tensor:
    """Main process: decode a deferred batch on the transform's ``decode_device``."""
    return transform.finish(images) if isinstance(transform, ImageTransform) and transform.decode_device else images


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def _pool(returns: BatchReturns | None) -> BatchPool | None:
    """This DataLoader worker's batch buffers (``None`` in the main process)."""
    info = get_worker_info()
    return None if returns is None or info is None else returns.pool(info.id)


def _role_counts(total: int, skip: int, role: int, workers: int) -> tuple[int, int]:
    """Batches ``b`` with ``b % workers == role``: how many lie before ``skip``, how many after."""
    before = len(range(role, min(skip, total), workers))
    return before, len(range(role, total, workers)) - before


@dataclass
class _Demand:
    """Samples a worker's epoch still needs: ``needed`` minus those ``delivered`` (decoded, or
    dropped by a resume), counted by the stages after the shuffle buffer."""

    needed: int
    delivered: int = 0

    def outstanding(self) -> int:
        return self.needed - self.delivered


def _shuffle_on_demand(src: Iterator, *, bufsize: int, initial: int, seed: int, demand: _Demand) -> Iterator:
    """WebDataset's shuffle buffer (``webdataset.shuffle``: start yielding at ``initial``,
    then take up to two samples per sample given, up to ``bufsize``), except that it never
    holds more samples than the epoch still needs. ``webdataset.shuffle`` over the endless
    resampled stream keeps its buffer full to the end: each worker read up to a buffer's
    worth of samples per epoch it never used (8 workers x 5,000 per rank at the recipes'
    defaults: a quarter of an ImageNet epoch's reading per rank). A sample that fails to
    decode is replaced (the count of delivered samples does not move).
    """
    rng = random.Random(seed)
    source = iter(src)
    buffer: list = []
    alive = True

    def pull() -> bool:
        try:
            buffer.append(next(source))
            return True
        except StopIteration:
            return False

    while alive and len(buffer) < min(initial, demand.outstanding()):
        alive = pull()
    while True:
        target = min(bufsize, demand.outstanding())
        for _ in range(2):
            if alive and len(buffer) < target:
                alive = pull()
        if not buffer:
            return
        k = rng.randint(0, len(buffer) - 1)
        buffer[k], buffer[-1] = buffer[-1], buffer[k]
        yield buffer.pop()


def _every(src: Iterator[Any], step: int, offset: int) -> Iterator[Any]:
    """Items ``offset``, ``offset + step``, ... of ``src``: an explicit split by rank or worker."""
    for i, item in enumerate(src):
        if i % step == offset:
            yield item


class _TrainStream(IterableDataset):
    """One epoch of a :class:`TrainLoader`'s batches, made inside each DataLoader worker (a
    copy of the loader's plain values: what a ``spawn`` worker receives pickled)."""

    def __init__(self, loader: "TrainLoader", returns: BatchReturns | None):
        self.urls, self.batch_size, self.num_batches, self.returns = loader.urls, loader.batch_size, len(loader), returns
        self.rank, self.world_size, self.seed, self.epoch = loader.rank, loader.world_size, loader.seed, loader.epoch
        self.shuffle_buffer, self.transform, self.on_error = loader.shuffle_buffer, loader.transform, loader.on_error
        self.skip = loader.skip_batches

    def __iter__(self) -> Iterator[tuple]:
        wds = _wds()
        worker, workers = _worker()
        # The DataLoader takes batch b from worker b % workers. When resuming after `skip`
        # batches, worker w plays the role of the worker that produced batch skip + w, so
        # the remaining batches come out in exactly the uninterrupted order.
        role = (worker + self.skip) % workers
        skipped, remaining = _role_counts(self.num_batches, self.skip, role, workers)
        if remaining == 0:
            return
        stream_seed = _seed(self.seed, self.epoch)
        role_seed = _seed(self.seed, self.epoch, self.rank, role)
        log = ErrorLog(self.on_error)
        watch = ClassOrderWatch(self.shuffle_buffer)
        demand = _Demand(needed=(skipped + remaining) * self.batch_size)
        def decode(src):
            # Augmentations draw from torch's RNG, seeded per sample: the stream is the same
            # whether or not earlier samples were skipped (resume) or transformed.
            for index, sample in enumerate(src, start=skipped * self.batch_size):
                # The CPU generator alone: torch.manual_seed also seeds every accelerator
                # and records a stack trace per call, a large share of a decode pass
                # (docs/reference/benchmarks.md, "Data"). The transforms run on the CPU
                # and draw only from it.
                torch.default_generator.manual_seed(_seed(role_seed, index))
                row = _decode(sample, self.transform, log)
                if row is not None:
                    demand.delivered += 1
                    yield row[0], row[1], True, row[2]

        def skip_raw(src):  # resume: drop already-trained samples before decoding them
            for index, sample in enumerate(src):
                if index >= skipped * self.batch_size:
                    yield sample
                else:
                    demand.delivered += 1  # delivered in the interrupted run

        pipeline = wds.DataPipeline(
            # One infinite, seeded stream of shards, identical on every rank and worker
            # (worker_seed=0), then split: deterministic, disjoint per (rank, worker).
            wds.ResampledShards(self.urls, seed=stream_seed, deterministic=True, worker_seed=lambda: 0),
            functools.partial(_every, step=self.world_size, offset=self.rank),  # rank r: r, r+W, r+2W, ...
            functools.partial(_every, step=workers, offset=role),
            tarfile_to_samples(log.tar_handler),
            watch.passing,  # in shard order, before the shuffle buffer
            functools.partial(_shuffle_on_demand, bufsize=self.shuffle_buffer, initial=min(self.shuffle_buffer, 1000),
                              seed=role_seed, demand=demand),
            skip_raw,
            decode,
            wds.batched(self.batch_size, collation_fn=functools.partial(_collate, self.transform, _pool(self.returns)),
                        partial=False),
        )
        for batch in pipeline:
            yield (*batch, *log.drain())
            remaining -= 1
            if remaining == 0:
                break


def _worker_init(worker_id: int) -> None:
    """What each DataLoader worker of these loaders runs first: a hook that keeps the worker
    from printing a traceback when the main process stops in the middle of fetching a batch.

    A worker hands each batch's shared memory to the main process as a file descriptor. The
    worker's ``multiprocessing`` resource-sharer thread serves it, and the main process
    connects to that thread to fetch it. If the main process stops during that handshake
    (Ctrl-C, which ``torchrun`` forwards to it; a crash), the thread finds the connection
    closed. It then passes ``BrokenPipeError``, ``ConnectionResetError`` or ``EOFError`` to
    ``sys.excepthook``, which prints a traceback after the main process's one-line report.

    That connection's only reader is gone and reports its own reason, so this hook drops
    exactly those errors: a connection error raised in the resource sharer's serving loop.
    Every other exception still reaches the previous hook.
    """
    # A private class of the standard library (3.6 to 3.13 checked); without it there is
    # nothing to recognise, and nothing is filtered.
    serve = getattr(getattr(resource_sharer, "_ResourceSharer", None), "_serve", None)
    if serve is None:
        return
    previous, serving_loop = sys.excepthook, serve.__code__

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, (ConnectionError, EOFError)) and tb is not None and tb.tb_frame.f_code is serving_loop:
            return
        previous(kind, value, tb)

    sys.excepthook = hook


class _LoaderBase:
    """DataLoader construction shared by the train and eval loaders."""

    def __init__(self, spec: LoaderSpec, train: bool):
        self.spec = spec
        self.num_workers, self.prefetch_factor = spec.num_workers, spec.prefetch_factor
        self.pin_memory = torch.cuda.is_available() if spec.pin_memory is None else spec.pin_memory
        self.transform = spec_transform(spec, train)
        self.skipped = 0
        self.skip_messages: list[str] = []
        # Batches of the last epoch that workers wrote into a newly allocated shared buffer;
        # the others reused one (distnorm.data.batches). A diagnostic.
        self.fresh_batch_buffers = 0

    def _returns(self) -> BatchReturns | None:
        """This epoch's way back for the workers' batch buffers (:mod:`distnorm.data.batches`).
        Pooled buffers per worker: its batches in flight (``prefetch_factor``), the one being
        written, and two a training loop still holds (its loop variable holds the last
        batch while the next one is fetched)."""
        in_flight = 2 if self.prefetch_factor is None else self.prefetch_factor  # None: the DataLoader's 2
        return BatchReturns(self.num_workers, capacity=in_flight + 3) if self.num_workers else None

    def _claim(self, returns: BatchReturns | None, images: Any, lease: Any) -> Any:
        """Hand a batch on (its buffer goes back to its worker once dropped)."""
        if returns is None:
            return images
        images = returns.claim(images, lease)
        self.fresh_batch_buffers = returns.fresh
        return images

    def _dataloader(self, dataset: IterableDataset) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=None,  # batches are formed in the workers
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor if self.num_workers else None,
            persistent_workers=False,  # new workers each epoch pick up set_epoch()
            worker_init_fn=_worker_init,
        )

    def _account(self, skipped: int, messages: list[str]) -> None:
        self.skipped += skipped
        self.skip_messages.extend(messages[: max(0, 20 - len(self.skip_messages))])

    def _report(self, what: str) -> None:
        if self.skipped:
            warnings.warn(
                f"{what}: skipped {self.skipped} unreadable sample(s)/shard(s) this epoch; first: "
                + "; ".join(self.skip_messages[:3]),
                stacklevel=3,
            )


class TrainLoader(_LoaderBase):
    """Training batches ``(images, labels)`` from WebDataset shards; see the module docs.

    Args:
        shards: shard URLs (list or brace pattern).
        num_samples: samples in the training set (e.g. ``ShardIndex.total``).
        batch_size: per-rank batch size; the global batch is ``batch_size * world_size``.
        rank, world_size: this process's data-parallel coordinates.
        seed: base seed; the shard stream depends on ``(seed, epoch)`` only (the epoch:
            :meth:`set_epoch`).
        return_keys: also yield the sample keys (for debugging and tests).
        **options: fields of :class:`LoaderSpec`, its defaults for the rest: ``transform``
            (a preset name or a callable on PIL images), ``image_size``, ``reduced_decode``,
            ``decoder``, ``decode_device`` (with a device, batches are decoded there, in the
            main process, and arrive on it: :mod:`distnorm.data.transforms`),
            ``num_workers``, ``prefetch_factor``, ``pin_memory``, ``shuffle_buffer``,
            ``on_error`` (``"raise"`` or ``"skip"``).

    Example (``digits_shards``: the folder ``make demo`` writes the demo digits' shards to;
    for ImageNet, ``data/imagenet/train-{000000..001281}.tar`` and its index):
        >>> import math
        >>> from distnorm.data import ShardIndex
        >>> index = ShardIndex.load(f"{digits_shards}/digits-train-index.json")
        >>> loader = TrainLoader(f"{digits_shards}/digits-train-{{000000..000005}}.tar", num_samples=index.total,
        ...                      batch_size=32, rank=1, world_size=2, num_workers=0, transform="digits", image_size=32)
        >>> len(loader) == math.ceil(index.total / 64)  # batches per epoch, the same on every rank
        True
        >>> loader.set_epoch(0)                        # then once per epoch, before iterating
        >>> images, labels = next(iter(loader))
        >>> tuple(images.shape), labels.dtype
        ((32, 3, 32, 32), torch.int64)
    """

    def __init__(self, shards: str | Sequence[str], *, num_samples: int, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, return_keys: bool = False, **options: Any):
        super().__init__(LoaderSpec.of("TrainLoader", options), train=True)
        _check_common(batch_size, rank, world_size)
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.urls = expand_urls(shards)
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world_size, self.seed, self.epoch = rank, world_size, seed, 0
        self.skip_batches = 0
        self.shuffle_buffer, self.on_error, self.return_keys = self.spec.shuffle_buffer, self.spec.on_error, return_keys

    def __len__(self) -> int:
        """Batches per epoch, identical on every rank: ``ceil(num_samples / global batch)``."""
        return math.ceil(self.num_samples / (self.batch_size * self.world_size))

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Select the epoch; ``skip_batches`` resumes it after that many batches, yielding
        exactly the batches an uninterrupted epoch would have yielded next (skipped samples
        are read but not decoded)."""
        if not 0 <= skip_batches <= len(self):
            raise ValueError(f"skip_batches must be in [0, {len(self)}], got {skip_batches}")
        self.epoch, self.skip_batches = epoch, skip_batches

    def __iter__(self) -> Iterator[tuple]:
        self.skipped, self.skip_messages, self.fresh_batch_buffers = 0, [], 0
        returns = self._returns()
        stream = _TrainStream(self, returns)
        produced = self.skip_batches
        for images, labels, _mask, keys, lease, skipped, messages in self._dataloader(stream):
            self._account(skipped, messages)
            images = _finish(self.transform, self._claim(returns, images, lease))
            produced += 1
            yield (images, labels, keys) if self.return_keys else (images, labels)
        if produced != len(self):
            raise DataError(f"rank {self.rank}: epoch produced {produced} batches instead of {len(self)}")
        self.skip_batches = 0  # a resumed epoch resumes once
        self._report(f"train loader (rank {self.rank}, epoch {self.epoch})")


class _EvalStream(IterableDataset):
    """An :class:`EvalLoader`'s batches, made inside each DataLoader worker from the loader's
    plan (a copy of its plain values)."""

    def __init__(self, loader: "EvalLoader", returns: BatchReturns | None):
        self.worker_urls, self.planned, self.extra = loader._worker_urls, loader._planned, loader._extra
        self.counts, self.returns = loader._counts, returns
        self.batch_size, self.transform, self.on_error = loader.batch_size, loader.transform, loader.on_error
        self.image_size = loader.image_size

    def _placeholder_row(self) -> tuple:
        return torch.zeros(3, self.image_size, self.image_size), 0, False, ""

    def __iter__(self) -> Iterator[tuple]:
        wds = _wds()
        worker, workers = _worker()
        if workers != len(self.worker_urls):
            raise RuntimeError("eval loader planned for a different number of workers")
        log = ErrorLog(self.on_error)
        pool = _pool(self.returns)

        seen: dict[str, int] = {}

        def decode(src):
            for sample in src:
                url = sample.get("__url__", "?")
                seen[url] = seen.get(url, 0) + 1
                row = _decode(sample, self.transform, log)
                # A bad sample becomes a masked placeholder, so batch counts stay as planned.
                yield (row[0], row[1], True, row[2]) if row is not None else self._placeholder_row()

        urls = self.worker_urls[worker]
        produced, held = 0, None
        if urls:
            pipeline = wds.DataPipeline(
                wds.SimpleShardList(urls),
                tarfile_to_samples(log.tar_handler),
                decode,
                wds.batched(self.batch_size, collation_fn=functools.partial(_collate, self.transform, pool), partial=True),
            )
            for batch in pipeline:
                produced += 1
                if produced > self.planned[worker]:
                    raise DataError(
                        f"shards {urls} hold more samples than the shard index says; rewrite the index"
                    )
                if held is not None:
                    yield (*held, *log.drain())
                held = batch  # the last batch carries the shortfall report below
        for url in urls:
            # Python's tarfile ends a shard quietly at a header cut short (a truncated copy):
            # count against the index, so that no validation sample goes missing unreported.
            if seen.get(url, 0) < self.counts[url] and url not in log.failed_shards:
                log.failure(f"shard {url}", DataError(f"{seen.get(url, 0)} of the {self.counts[url]} samples the "
                                                      "shard index lists were read (a truncated shard?)"))
        if held is not None:
            yield (*held, *log.drain())
        # Pad: this worker's planned batches (a truncated shard yields fewer), then on
        # worker 0 the batches this rank lacks to match the longest rank.
        pad = self.planned[worker] - produced + (self.extra if worker == 0 else 0)
        for _ in range(pad):
            yield (*_collate(self.transform, pool, [self._placeholder_row()]), *log.drain())


class EvalLoader(_LoaderBase):
    """Exact-once evaluation batches ``(images, labels, mask, keys)``; see the module docs.

    Args:
        shards: shard URLs (list or brace pattern).
        index: the :class:`ShardIndex` (or its path) giving each shard's sample count.
        batch_size: per-rank batch size.
        rank, world_size: data-parallel coordinates.
        **options: fields of :class:`LoaderSpec`, as for :class:`TrainLoader`
            (``shuffle_buffer`` is not used; with ``on_error="skip"`` bad samples become
            masked placeholders).
    """

    def __init__(self, shards: str | Sequence[str], *, index: ShardIndex | str, batch_size: int, rank: int = 0,
                 world_size: int = 1, **options: Any):
        super().__init__(LoaderSpec.of("EvalLoader", options), train=False)
        _check_common(batch_size, rank, world_size)
        self.index = ShardIndex.load(index) if isinstance(index, str) else index
        self.urls = expand_urls(shards)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.on_error, self.image_size = self.spec.on_error, self.spec.image_size
        workers = max(self.num_workers, 1)
        counts = [self.index.count_for(u) for u in self.urls]
        self._counts = dict(zip(self.urls, counts))

        def plan(r: int) -> tuple[list[list[str]], list[int]]:
            positions = list(range(r, len(self.urls), world_size))  # shards of rank r
            per_worker = [positions[w::workers] for w in range(workers)]
            return ([[self.urls[i] for i in ps] for ps in per_worker],
                    [math.ceil(sum(counts[i] for i in ps) / batch_size) for ps in per_worker])

        # Every rank computes every rank's plan from the index: no communication needed to
        # agree on the common number of batches.
        self._worker_urls, self._planned = plan(rank)
        self._num_batches = max(sum(plan(r)[1]) for r in range(world_size))
        self._extra = self._num_batches - sum(self._planned)
        self.num_samples = sum(counts[rank::world_size])  # real samples this rank will see

    def __len__(self) -> int:
        return self._num_batches

    def __iter__(self) -> Iterator[tuple]:
        self.skipped, self.skip_messages, self.fresh_batch_buffers = 0, [], 0
        returns = self._returns()
        stream = _EvalStream(self, returns)
        produced = 0
        for images, labels, mask, keys, lease, skipped, messages in self._dataloader(stream):
            self._account(skipped, messages)
            images = _finish(self.transform, self._claim(returns, images, lease))
            produced += 1
            yield images, labels, mask, keys
        if produced != len(self):
            raise DataError(f"rank {self.rank}: evaluation produced {produced} batches instead of {len(self)}")
        self._report(f"eval loader (rank {self.rank})")


def _check_common(batch_size: int, rank: int, world_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
