"""Atomic, verified checkpoints with a keep-last-K policy.

A checkpoint is a directory ``<root>/step_XXXXXXXXX`` written by the engine (Accelerate's
``save_state`` or DeepSpeed's ``save_checkpoint``, every rank writing its own files). It is
first written as ``step_XXXXXXXXX.tmp``; after every rank has finished (a barrier), rank 0
fsyncs each file, writes ``manifest.json`` (trainer state, and for every file its size and
SHA-256), fsyncs it, and only then renames the directory into place and updates ``latest``;
a Ctrl-C (SIGINT) that arrives between the rename and that update is held until ``latest``
names the new checkpoint (:func:`_sigint_held`), so an interrupted run's last checkpoint is
the one on disk.
A crash at any point leaves either the previous checkpoints untouched or a complete new
one; a leftover ``.tmp`` directory is never resumed from and is cleaned up later.

On resume, :meth:`CheckpointManager.find_resumable` walks the checkpoints newest first
and returns the first whose manifest verifies, warning about every newer one it had to
pass over (truncated or corrupt files). The root must be on a file system every rank sees
(e.g. a shared scratch directory for multi-node runs).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["CheckpointManager", "CheckpointWriteError", "verify_checkpoint"]

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


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed on at least one rank (raised on every rank)."""


def _describe_write_failure(err: BaseException, where: Path) -> str:
    """What went wrong writing under ``where``, with the free space there: a full disk shows
    up as ``OSError(ENOSPC)`` from Python, but as ``RuntimeError: ... iostream error`` from
    ``torch.save``'s C++ writer, so the free space is what tells."""
    import errno

    probe = where if where.exists() else where.parent
    try:
        usage = shutil.disk_usage(probe)
        space = f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB on the file system of {probe}"
        full = usage.free < 2**20
    except OSError:
        space, full = "free space unknown", False
    if getattr(err, "errno", None) == errno.ENOSPC or full:
        return f"no space left on device while writing {where} ({space}): {err}"
    return f"writing {where} failed ({space}): {type(err).__name__}: {err}"


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold SIGINT (Ctrl-C; torchrun forwards it to every worker) until the block ends, then
    deliver it to the handler that was installed: a Ctrl-C between the checkpoint's rename and
    the update of ``latest`` would otherwise leave a complete checkpoint that ``latest`` does
    not name, and the interrupted run's one line would say there is none. Outside the main
    thread (where Python runs signal handlers) nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[tuple[int, Any]] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held and callable(previous):
            previous(*held[0])  # Python's own handler, or the trainer's, raises KeyboardInterrupt here
        elif held and previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)


class CheckpointManager:
    """Save / find checkpoints under ``root``.

    Args:
        root: the checkpoint directory.
        keep_last: number of complete checkpoints to keep.
        is_main: whether this process is rank 0 (it alone writes manifests and renames).
        barrier: a collective barrier over all ranks.
        gather: every rank's text, given this rank's (a collective); ``None`` in one process.
            Used to agree on failures, so that a rank whose write failed never leaves the
            others waiting in a barrier.
    """

    def __init__(self, root: str | os.PathLike, keep_last: int, is_main: bool, barrier: Callable[[], None],
                 gather: Callable[[str], list[str]] | None = None):
        self.root = Path(root)
        self.keep_last = keep_last
        self.is_main = is_main
        self.barrier = barrier
        self.gather = gather if gather is not None else (lambda text: [text])

    def _agree(self, failure: str, tmp: Path) -> None:
        """Raise :class:`CheckpointWriteError` on every rank if any rank failed, after rank 0
        removed the partial directory (earlier checkpoints are untouched)."""
        failures = [(rank, text) for rank, text in enumerate(self.gather(failure)) if text]
        if not failures:
            return
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        listing = "\n".join(f"  rank {rank}: {text}" for rank, text in failures)
        raise CheckpointWriteError(
            f"checkpoint {tmp.name.removesuffix('.tmp')} was not written; the partial directory was removed and "
            f"the earlier checkpoints in {self.root} are intact:\n{listing}\n"
            "Free space there (or point output.dir at a larger file system) and restart: the run resumes from "
            "the newest complete checkpoint.")

    def _complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        dirs = [p for p in self.root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and not p.name.endswith(".tmp")]
        return sorted(dirs, key=lambda p: int(p.name[len(PREFIX):]))

    def _commit(self, step: int, state: dict[str, Any], name: str, final: Path, tmp: Path) -> None:
        """Rank 0: fsync every file, write and fsync the manifest, rename the directory into
        place, then point ``latest`` at it."""
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            _fsync(path)
            files[str(path.relative_to(tmp))] = {"size": path.stat().st_size, "sha256": _sha256(path)}
        manifest = tmp / MANIFEST
        manifest.write_text(json.dumps({"step": step, "state": state, "files": files}, indent=1))
        _fsync(manifest)
        # The directory in place and `latest` naming it: one step for Ctrl-C (the hashing above
        # may take seconds and stays interruptible; the old checkpoint is then the last one).
        with _sigint_held():
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)  # from here on the checkpoint is complete and verifiable
            latest = self.root / "latest.tmp"
            latest.write_text(name)
            _fsync(latest)
            os.replace(latest, self.root / "latest")

    def save(self, step: int, state: dict[str, Any], write: Callable[[Path, dict[str, Any]], None]) -> Path:
        """Write checkpoint ``step`` with ``write(tmp_dir, state)`` on every rank; returns its path."""
        name = f"{PREFIX}{step:09d}"
        final, tmp = self.root / name, self.root / f"{name}.tmp"
        failure = ""
        if self.is_main:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            except OSError as err:
                failure = _describe_write_failure(err, tmp)
        self._agree(failure, tmp)
        try:
            write(tmp, state)
        except Exception as err:  # noqa: BLE001 - torch.save / safetensors report a full disk in their own types
            failure = _describe_write_failure(err, tmp)
        self._agree(failure, tmp)
        if self.is_main:
            try:
                self._commit(step, state, name, final, tmp)
            except OSError as err:
                failure = _describe_write_failure(err, tmp if tmp.exists() else self.root)
        self._agree(failure, tmp)
        if self.is_main:
            for old in self._complete()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
            for stale in self.root.glob(f"{PREFIX}*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
        self.barrier()
        return final

    def latest(self) -> Path | None:
        """The newest complete checkpoint's directory (what ``latest`` names; not verified
        here: :meth:`find_resumable` does that), or ``None`` before the first."""
        try:
            directory = self.root / (self.root / "latest").read_text().strip()
        except OSError:
            return None
        return directory if directory.is_dir() else None

    def latest_step(self) -> int | None:
        """The global step of :meth:`latest`, or ``None``."""
        directory = self.latest()
        return int(directory.name[len(PREFIX):]) if directory is not None else None

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
