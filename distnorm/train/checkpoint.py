"""Atomic, verified checkpoints with a keep-last-K policy.

A checkpoint is a directory ``<root>/step_XXXXXXXXX`` written by the engine (Accelerate's
``save_state`` or DeepSpeed's ``save_checkpoint``, every rank writing its own files). It is
first written as ``step_XXXXXXXXX.tmp``; after every rank has finished (a barrier), rank 0
fsyncs each file, writes ``manifest.json`` (trainer state, and for every file its size and
SHA-256), fsyncs it, and only then renames the directory into place and updates ``latest``.
A crash at any point leaves either the previous checkpoints untouched or a complete new
one; a leftover ``.tmp`` directory is never resumed from and is cleaned up later.

On resume, :meth:`CheckpointManager.find_resumable` walks the checkpoints newest first
and returns the first whose manifest verifies, warning about every newer one it had to
pass over (truncated or corrupt files). The root must be on a file system every rank sees
(e.g. a shared scratch directory for multi-node runs).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

__all__ = ["CheckpointManager", "verify_checkpoint"]

MANIFEST = "manifest.json"
PREFIX = "step_"


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_checkpoint(directory: Path) -> str | None:
    """``None`` if ``directory`` is a complete checkpoint, else the reason it is not."""
    manifest = directory / MANIFEST
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError) as err:
        return f"no readable {MANIFEST} ({err})"
    for rel, meta in data.get("files", {}).items():
        path = directory / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != meta["size"]:
            return f"{rel} has {path.stat().st_size} bytes, {meta['size']} were written"
        if _sha256(path) != meta["sha256"]:
            return f"{rel} does not match its checksum"
    return None


class CheckpointManager:
    """Save / find checkpoints under ``root``.

    Args:
        root: the checkpoint directory.
        keep_last: number of complete checkpoints to keep.
        is_main: whether this process is rank 0 (it alone writes manifests and renames).
        barrier: a collective barrier over all ranks.
    """

    def __init__(self, root: str | os.PathLike, keep_last: int, is_main: bool, barrier: Callable[[], None]):
        self.root = Path(root)
        self.keep_last = keep_last
        self.is_main = is_main
        self.barrier = barrier

    def _complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        dirs = [p for p in self.root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and not p.name.endswith(".tmp")]
        return sorted(dirs, key=lambda p: int(p.name[len(PREFIX):]))

    def save(self, step: int, state: dict[str, Any], write: Callable[[Path, dict[str, Any]], None]) -> Path:
        """Write checkpoint ``step`` with ``write(tmp_dir, state)`` on every rank; returns its path."""
        name = f"{PREFIX}{step:09d}"
        final, tmp = self.root / name, self.root / f"{name}.tmp"
        if self.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        self.barrier()
        write(tmp, state)
        self.barrier()
        if self.is_main:
            files = {}
            for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
                _fsync(path)
                files[str(path.relative_to(tmp))] = {"size": path.stat().st_size, "sha256": _sha256(path)}
            manifest = tmp / MANIFEST
            manifest.write_text(json.dumps({"step": step, "state": state, "files": files}, indent=1))
            _fsync(manifest)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            latest = self.root / "latest.tmp"
            latest.write_text(name)
            _fsync(latest)
            os.replace(latest, self.root / "latest")
            for old in self._complete()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
            for stale in self.root.glob(f"{PREFIX}*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
        self.barrier()
        return final

    def find_resumable(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that verifies, and its trainer state (or ``None``)."""
        for directory in reversed(self._complete()):
            problem = verify_checkpoint(directory)
            if problem is None:
                data = json.loads((directory / MANIFEST).read_text())
                return directory, data["state"]
            warnings.warn(f"checkpoint {directory} is unusable ({problem}); falling back to an earlier one",
                          stacklevel=2)
        return None
