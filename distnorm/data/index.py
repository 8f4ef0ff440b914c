"""The JSON index written beside a shard set: class names and samples per shard.

``{prefix}-index.json``::

    {"format": "distnorm-shards/1", "classes": [...], "total": 1281167, "shuffle_seed": 0,
     "shards": [{"name": "train-000000.tar", "count": 1000, "class_counts": {"0": 1, "7": 2, ...}}, ...]}

``shuffle_seed`` is the seed of the order samples were written in (``null``: the source's
order); ``class_counts`` the labels in each shard. Both are absent from indexes written
before they existed (and from tools other than ``distnorm-shards``).

Loaders use it to size epochs (train) and to plan an exact-once evaluation (val) without
reading any shard; it is small enough to keep local even when the shards are remote.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["ShardIndex", "ShardInfo", "index_path"]

FORMAT = "distnorm-shards/1"


def index_path(prefix: str) -> str:
    return f"{prefix}-index.json"


@dataclass
class ShardInfo:
    name: str
    count: int
    class_counts: dict[str, int] | None = None

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
        """Write atomically (temporary file, fsync, rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            json.dump(asdict(self), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(f.name, path)

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
