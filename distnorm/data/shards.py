"""Write WebDataset shards: ``{prefix}-{000000..N}.tar`` plus ``{prefix}-index.json``.

    python -m distnorm.data.shards SRC OUT_PREFIX [--maxcount N] [--maxsize BYTES] [--workers N]
    distnorm-shards /data/imagenet/train /shards/imagenet-train --maxcount 1000 --workers 16
    distnorm-shards digits /shards/digits-train --split train --maxcount 256
    distnorm-shards synthetic /shards/synth --num-samples 10000 --num-classes 1000

``SRC`` is an ImageFolder tree (``train/<wnid>/*.JPEG``), ``digits`` (the embedded demo
data), ``synthetic`` (ImageNet-shaped generated images) or ``torchvision:<Dataset>:<root>``
(a torchvision dataset already on disk, e.g. ``torchvision:CIFAR10:/data/cifar``). From
Python, :func:`write_shards` takes any source of :mod:`distnorm.data.sources`, and
:class:`~distnorm.data.sources.DatasetSource` wraps any torchvision dataset object.

Each sample is ``__key__`` (no dots), ``jpg`` (the original bytes when the source is
JPEG, never re-encoded) and ``cls`` (the integer label). **Samples are written in a seeded
random order** (``--shuffle-seed``, default 0; ``--no-shuffle`` keeps the source order), so
every shard mixes classes: an ImageFolder lists ImageNet class by class, and shards cut from
that order hold one or two classes each, which a loader's shuffle buffer cannot undo (see
the README). The order depends on the seed and the number of samples only — not on
``--workers`` or on reruns — and is recorded in the index with each shard's class counts.
The assignment of samples to shards is planned up front (``--maxcount`` samples and, optionally, ``--maxsize`` bytes per shard),
so parallel workers and resumed runs produce the same shards. Every shard is written under
a temporary name, read back with WebDataset and compared with the plan (keys, labels and
payload bytes), fsynced, and only then renamed into place; a rerun skips shards that are
complete and verify. The index records each shard's size and SHA-256, which
``distnorm-train --check`` compares with the files (sizes always; checksums with
``--verify-checksums``). Shards and index get the mode of any new file (``0666`` less the
umask), so a group or everyone can read a shared copy when the umask lets them.

An ImageFolder with an empty class folder is refused, naming it: every folder is a class,
and one without images would be a class the model is asked to predict but never sees.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Sequence

from distnorm.data.index import ShardIndex, ShardInfo, file_digest, index_path
from distnorm.data.sources import (
    IMAGE_EXTENSIONS,
    DatasetSource,
    DigitsSource,
    ImageFolderSource,
    ShardSource,
    SyntheticSource,
)

__all__ = ["plan_shards", "sample_order", "write_shards", "shard_name", "main"]

TAR_BLOCK = 512
FIXED_MTIME = 0  # reproducible tar headers; an int: a float mtime costs a PAX header per member


def _wds():
    try:
        import webdataset
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("writing shards needs WebDataset: `pip install distnorm[data]`") from err
    return webdataset


def shard_name(prefix: str, index: int) -> str:
    return f"{prefix}-{index:06d}.tar"


def _tar_bytes(payload: int) -> int:
    """Bytes a sample takes in the tar: two members (``.jpg``, ``.cls``), each a 512-byte
    header plus contents padded to 512 bytes."""
    padded = lambda n: -(-n // TAR_BLOCK) * TAR_BLOCK  # noqa: E731
    return 2 * TAR_BLOCK + padded(payload) + padded(8)


def sample_order(num_samples: int, shuffle_seed: int | None) -> list[int]:
    """The order samples are written in: a permutation drawn from ``shuffle_seed`` alone
    (the same for every run and every number of writer processes), or the source order
    for ``None``."""
    order = list(range(num_samples))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    return order


def plan_shards(source: ShardSource, maxcount: int, maxsize: int | None = None, *,
                shuffle_seed: int | None = 0) -> list[list[int]]:
    """Source indices per shard: consecutive runs of :func:`sample_order`, each within
    ``maxcount`` samples and ``maxsize`` bytes."""
    if maxcount < 1:
        raise ValueError(f"maxcount must be >= 1, got {maxcount}")
    if maxsize is not None and maxsize < 1:
        raise ValueError(f"maxsize must be >= 1 byte, got {maxsize}")
    plan: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in sample_order(len(source), shuffle_seed):
        sample = _tar_bytes(source.size_hint(i)) if maxsize else 0
        if current and (len(current) >= maxcount or (maxsize and size + sample > maxsize)):
            plan.append(current)
            current, size = [], 0
        current.append(i)
        size += sample
    if current:
        plan.append(current)
    return plan


def _verify(path: str, source: ShardSource, indices: Sequence[int]) -> str | None:
    """Read ``path`` back with WebDataset; return a reason if it differs from the plan."""
    wds = _wds()
    try:
        samples = list(wds.DataPipeline(wds.SimpleShardList([path]), wds.tarfile_to_samples()))
    except Exception as err:  # noqa: BLE001 - any read failure means "not a good shard"
        return f"unreadable ({err})"
    if len(samples) != len(indices):
        return f"{len(samples)} samples instead of {len(indices)}"
    for sample, i in zip(samples, indices):
        if sample["__key__"] != source.key(i):
            return f"key {sample['__key__']!r} where {source.key(i)!r} was planned"
        if int(sample["cls"]) != source.label(i) or sample["jpg"] != source.jpeg(i):
            return f"sample {sample['__key__']!r} differs from its source"
    return None


def _write_one(source: ShardSource, path: str, indices: Sequence[int]) -> tuple[str, int]:
    """Write one shard under a temporary name, verify it, fsync, rename. Returns (path, bytes)."""
    # open() creates it 0666 less the umask (the index gets the same, ShardIndex.save).
    wds = _wds()
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as stream:
            with wds.TarWriter(stream, mtime=FIXED_MTIME) as writer:
                for i in indices:
                    writer.write({"__key__": source.key(i), "jpg": source.jpeg(i), "cls": source.label(i)})
            stream.flush()
            os.fsync(stream.fileno())
        problem = _verify(tmp, source, indices)
        if problem:
            raise RuntimeError(f"shard {path} failed verification after writing: {problem}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path, os.path.getsize(path)


def write_shards(
    source: ShardSource,
    prefix: str,
    *,
    maxcount: int = 1000,
    maxsize: int | None = None,
    workers: int = 1,
    progress: bool = True,
    shuffle_seed: int | None = 0,
) -> ShardIndex:
    """Write ``source`` as WebDataset shards ``{prefix}-NNNNNN.tar`` and their index.

    Samples go in the seeded random order of :func:`sample_order` (``shuffle_seed=None``:
    source order). Resumable: shards that already exist and verify against the plan are
    skipped.

    Returns:
        The :class:`~distnorm.data.index.ShardIndex` written to ``{prefix}-index.json``.
    """
    if isinstance(source, ImageFolderSource):
        _refuse_empty_classes(source)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    plan = plan_shards(source, maxcount, maxsize, shuffle_seed=shuffle_seed)
    paths = [shard_name(prefix, i) for i in range(len(plan))]
    todo = [i for i, path in enumerate(paths) if not (os.path.exists(path) and _verify(path, source, plan[i]) is None)]
    skipped = len(plan) - len(todo)

    from tqdm.auto import tqdm

    bar = tqdm(total=len(plan), initial=skipped, unit="shard", desc=f"writing {Path(prefix).name}", disable=not progress)
    if workers <= 1 or len(todo) <= 1:
        for i in todo:
            _write_one(source, paths[i], plan[i])
            bar.update()
    else:
        # spawn: the workers need nothing from this process but the (picklable) source.
        with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
            futures = [pool.submit(_write_one, source, paths[i], plan[i]) for i in todo]
            for future in as_completed(futures):
                future.result()
                bar.update()
    bar.close()
    # The bytes on disk after the rename (written now, or kept from an earlier run).
    digests = [file_digest(p) for p in paths]
    index = ShardIndex(
        classes=list(source.classes),
        shards=[ShardInfo(name=Path(p).name, count=len(r), class_counts=_class_counts(source, r), size=size, sha256=sha)
                for p, r, (size, sha) in zip(paths, plan, digests)],
        shuffle_seed=shuffle_seed,
    )
    index.save(index_path(prefix))
    return index


def _refuse_empty_classes(source: ImageFolderSource) -> None:
    """Refuse class folders without images (as ``torchvision.datasets.ImageFolder`` does)."""
    counts = Counter(label for _, label in source.files)
    empty = [name for label, name in enumerate(source.classes) if not counts[label]]
    if empty:
        shown = ", ".join(empty[:10]) + (f", ... ({len(empty) - 10} more)" if len(empty) > 10 else "")
        raise ValueError(
            f"ImageFolder source {source.root!r}: {len(empty)} of {len(source.classes)} class folder(s) hold no images "
            f"({', '.join(IMAGE_EXTENSIONS)}): {shown}. Every folder is a class; add the missing images or remove "
            "the empty folders, then write the shards again.")


def _class_counts(source: ShardSource, indices: Sequence[int]) -> dict[str, int]:
    """``{label: samples}`` of one shard (JSON keys are strings)."""
    counts = Counter(source.label(i) for i in indices)
    return {str(label): n for label, n in sorted(counts.items())}


def source_from_spec(spec: str, args: argparse.Namespace) -> ShardSource:
    """Build a source from the CLI's ``SRC`` argument."""
    if spec == "digits":
        return DigitsSource(split=args.split)
    if spec == "synthetic":
        return SyntheticSource(args.num_samples, args.num_classes, args.image_size, seed=args.seed)
    if spec.startswith("torchvision:"):
        try:
            _, name, root = spec.split(":", 2)
        except ValueError:
            raise ValueError(f"torchvision source must be torchvision:<Dataset>:<root>, got {spec!r}") from None
        import torchvision

        cls = getattr(torchvision.datasets, name, None)
        if cls is None:
            raise ValueError(f"torchvision.datasets has no {name!r}")
        kwargs = {"train": args.split == "train"} if "train" in cls.__init__.__code__.co_varnames else {"split": args.split}
        return DatasetSource(cls(root, download=False, **kwargs), name=f"{name.lower()}_{args.split}")
    return ImageFolderSource(spec)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distnorm-shards",
        description="Write WebDataset shards (and a JSON index) from an ImageFolder tree, a torchvision "
        "dataset, the embedded digits demo, or synthetic ImageNet-shaped images.",
    )
    parser.add_argument("src", help="ImageFolder directory | digits | synthetic | torchvision:<Dataset>:<root>")
    parser.add_argument("out_prefix", help="shards are written to OUT_PREFIX-NNNNNN.tar, index to OUT_PREFIX-index.json")
    parser.add_argument("--maxcount", type=int, default=1000, help="samples per shard (default 1000)")
    parser.add_argument("--maxsize", type=int, default=None, help="bytes per shard (approximate tar size)")
    parser.add_argument("--workers", type=int, default=1, help="parallel writer processes")
    parser.add_argument("--shuffle-seed", type=int, default=0,
                        help="seed of the random order samples are written in, so every shard mixes classes (default 0)")
    parser.add_argument("--no-shuffle", action="store_true",
                        help="write in the source's order (an ImageFolder's is class by class: shards of one class)")
    parser.add_argument("--split", default="train", help="digits / torchvision split: train or val (default train)")
    parser.add_argument("--num-samples", type=int, default=10_000, help="synthetic: number of images")
    # The synthetic source's own defaults (SyntheticSource owns them).
    parser.add_argument("--num-classes", type=int, default=SyntheticSource.num_classes,
                        help="synthetic: number of classes")
    parser.add_argument("--image-size", type=int, default=SyntheticSource.image_size,
                        help="synthetic: image side in pixels")
    parser.add_argument("--seed", type=int, default=SyntheticSource.seed, help="synthetic: seed")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        source = source_from_spec(args.src, args)
        index = write_shards(source, args.out_prefix, maxcount=args.maxcount, maxsize=args.maxsize,
                             workers=args.workers, progress=not args.quiet,
                             shuffle_seed=None if args.no_shuffle else args.shuffle_seed)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"distnorm-shards: error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:  # a library of the [data] extra (WebDataset, scikit-learn, tqdm, ...)
        if isinstance(err, ModuleNotFoundError):  # Python's own message, which names no extra
            if (err.name or "distnorm").partition(".")[0] == "distnorm":
                raise  # a module of distnorm itself: a broken install
            err = (f"the optional dependency {err.name!r} is not installed; install the [data] extra: "
                   'pip install "distnorm[data]" (from a clone: pip install -e ".[data]")')
        print(f"distnorm-shards: error: {err}", file=sys.stderr)
        return 2
    print(f"{index.total} samples, {len(index.classes)} classes, {len(index.shards)} shards -> "
          f"{index_path(args.out_prefix)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
