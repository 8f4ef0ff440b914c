"""The JSON index written beside a shard set: class names and samples per shard.

``{prefix}-index.json``::

    {"format": "distnorm-shards/1", "classes": [...], "total": 1281167, "shuffle_seed": 0,
     "shards": [{"name": "train-000000.tar", "count": 1000, "class_counts": {"0": 1, "7": 2, ...},
                 "size": 115343360, "sha256": "9f86d0..."}, ...]}

``shuffle_seed`` is the seed of the order samples were written in (``null``: the source's
order); ``class_counts`` the labels in each shard; ``size`` and ``sha256`` the bytes of the
shard file as written. Each is absent (``null``) in indexes written before it existed (and
from tools other than ``distnorm-shards``); what is absent is not checked.

Loaders use it to size epochs (train) and to plan an exact-once evaluation (val) without
reading any shard; it is small enough to keep local even when the shards are remote.
:meth:`ShardIndex.verify_files` compares shard files with it: sizes (one ``stat`` each) and,
when asked, SHA-256 checksums (every byte read; ``distnorm-train --check --verify-checksums``).

The index is written with the permissions of any new file (``0666`` less the umask), like
the shards beside it: a shard set on shared storage is readable by whoever can read its shards.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

__all__ = ["ShardIndex", "ShardInfo", "index_path", "file_digest", "expand_urls"]

FORMAT = "distnorm-shards/1"


def index_path(prefix: str) -> str:
    return f"{prefix}-index.json"


def file_digest(path: str | os.PathLike) -> tuple[int, str]:
    """``(bytes, SHA-256 hex digest)`` of a file, read in 1 MiB pieces. ``hashlib`` releases
    the GIL while it hashes, so threads hash several files at once."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


@dataclass
class ShardInfo:
    name: str
    count: int
    class_counts: dict[str, int] | None = None
    size: int | None = None  # bytes of the shard file as written
    sha256: str | None = None  # its SHA-256, hex

    def file_problem(self, path: str | os.PathLike, *, checksum: bool = False) -> str | None:
        """``None`` if the file at ``path`` matches what the index recorded (its size; with
        ``checksum``, its SHA-256 too), else what differs."""
        try:
            size = os.stat(path).st_size
        except OSError as err:
            return f"{path}: cannot be read ({err.strerror})"
        if self.size is not None and size != self.size:
            return f"{path}: {size} bytes, the index records {self.size}"
        if checksum and self.sha256 is not None:
            try:
                _, sha = file_digest(path)
            except OSError as err:
                return f"{path}: cannot be read ({err.strerror})"
            if sha != self.sha256:
                return f"{path}: SHA-256 {sha[:12]}... differs from the index's {self.sha256[:12]}..."
        return None

    def classes_held(self) -> int | None:
        return None if self.class_counts is None else sum(1 for n in self.class_counts.values() if n)


@dataclass
class ShardIndex:
    classes: list[str]
    shards: list[ShardInfo]
    total: int = field(default=-1)
    format: str = FORMAT
    shuffle_seed: int | None = None

    def __post_init__(self) -> None:
        self.shards = [s if isinstance(s, ShardInfo) else ShardInfo(**s) for s in self.shards]
        counted = sum(s.count for s in self.shards)
        if self.total == -1:
            self.total = counted
        if self.total != counted:
            raise ValueError(f"shard index: total {self.total} != sum of shard counts {counted}")

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (temporary file, fsync, rename), with the mode of any new file
        (``0666`` less the umask), as the shards get: ``tempfile`` would create it ``0600``,
        which no other user of a shared dataset can read."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f"{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the kernel applies the umask
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(self), f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ShardIndex":
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"shard index {path} not found; write shards with `distnorm-shards` (it writes the "
                "index beside them) or pass the index path explicitly"
            ) from None
        if raw.get("format") != FORMAT:
            raise ValueError(f"{path}: not a distnorm shard index (format {raw.get('format')!r})")
        return cls(**raw)

    def class_sorted_shards(self) -> list[str]:
        """Shards that hold far fewer classes than a random draw of their size would (at
        most 2 % of their samples, and at most 2 classes for small shards): the signature of
        shards written in class order. Empty when the index has no class counts."""
        sorted_like = []
        for shard in self.shards:
            held = shard.classes_held()
            if held is None or shard.count < 32 or len(self.classes) < 4:
                continue
            expected = len(self.classes) * (1 - (1 - 1 / len(self.classes)) ** shard.count)
            if held <= max(2, 0.1 * expected):
                sorted_like.append(shard.name)
        return sorted_like

    def unchecked(self, *, checksum: bool = False) -> list[str]:
        """Shards whose size (or, with ``checksum``, SHA-256) the index does not record."""
        return [s.name for s in self.shards if s.size is None or (checksum and s.sha256 is None)]

    def verify_files(self, paths: Sequence[str | os.PathLike], *, checksum: bool = False,
                     workers: int | None = None) -> list[str]:
        """What differs between the shard files ``paths`` (local, named as in the index) and
        the index: a file whose size differs from the recorded one, or with ``checksum``
        whose SHA-256 does (all bytes read, ``workers`` threads; default: one per CPU). Files
        the index does not list are reported too. Empty when everything matches."""
        by_name = {s.name: s for s in self.shards}
        problems, listed = [], []
        for path in paths:
            info = by_name.get(Path(path).name)
            if info is None:
                problems.append(f"{path}: not listed in the index")
            else:
                listed.append((info, path))
        threads = max(1, min(len(listed), workers or os.cpu_count() or 1)) if checksum else 1
        with ThreadPoolExecutor(threads) as pool:
            found = pool.map(lambda item: item[0].file_problem(item[1], checksum=checksum), listed)
            problems += [p for p in found if p is not None]
        return problems

    def local_urls(self, directory: str | os.PathLike) -> list[str]:
        """Shard paths next to the index in ``directory``."""
        return [str(Path(directory) / s.name) for s in self.shards]

    def count_for(self, url: str) -> int:
        """Samples in the shard that ``url`` (a path, file://, or pipe: command) refers to."""
        matches = [s for s in self.shards if s.name in url]
        if len(matches) != 1:
            # Prefer the longest name that ends the URL's path-like part.
            matches = sorted(matches, key=lambda s: len(s.name), reverse=True)[:1]
        if not matches:
            raise ValueError(f"shard {url!r} is not listed in the shard index")
        return matches[0].count


def expand_urls(shards: str | Sequence[str]) -> list[str]:
    """A list of shard URLs from a list or a WebDataset brace pattern."""
    if isinstance(shards, str):
        import braceexpand

        urls = [u for part in shards.split("::") for u in braceexpand.braceexpand(part)]
    else:
        urls = list(shards)
    if not urls:
        raise ValueError("no shard URLs given")
    return urls
