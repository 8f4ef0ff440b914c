"""What the loaders do with bad data: unreadable shards and samples raised or skipped and
counted (:class:`ErrorLog`, ``on_error``), and shards written in class order warned about
(:class:`ClassOrderWatch`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterator

from distnorm.data.specs import SKIP_HINT, DataError

__all__ = ["ClassOrderWatch", "ErrorLog", "MAX_CONSECUTIVE_ERRORS"]

logger = logging.getLogger("distnorm.data.loaders")  # the loaders' log, where users filter it

#: Consecutive unreadable samples after which ``on_error="skip"`` gives up (a broken source, not bad samples).
MAX_CONSECUTIVE_ERRORS = 100


@dataclass
class ErrorLog:
    """Per-worker record of skipped data, shipped to the main process with each batch."""

    on_error: str
    pending: int = 0
    consecutive: int = 0
    messages: list[str] = field(default_factory=list)
    failed_shards: set[str] = field(default_factory=set)

    def failure(self, message: str, err: BaseException, reason: str | None = None) -> None:
        """Raise, or count and log, ``message`` failing with ``err`` (described as ``reason``)."""
        reason = str(err) if reason is None else reason
        if self.on_error == "raise":
            raise DataError(f"{message}: {reason}; {SKIP_HINT}") from err
        self.pending += 1
        self.consecutive += 1
        if len(self.messages) < 20:
            self.messages.append(f"{message}: {reason}")
        logger.warning("skipping %s: %s", message, reason)
        if self.consecutive > MAX_CONSECUTIVE_ERRORS:
            raise DataError(f"more than {MAX_CONSECUTIVE_ERRORS} consecutive unreadable samples; last: {message}: {reason}") from err

    def success(self) -> None:
        self.consecutive = 0

    def drain(self) -> tuple[int, list[str]]:
        out = (self.pending, self.messages)
        self.pending, self.messages = 0, []
        return out

    def tar_handler(self, err: BaseException) -> bool:
        """WebDataset exception handler for shard-level failures (the URL is in err.args)."""
        args = getattr(err, "args", ())
        urls = [a for a in args if isinstance(a, str) and (".tar" in a or a.startswith("pipe:"))]
        self.failed_shards.add(urls[-1] if urls else "?")
        # The tar reader appends the stream and the URL to the error's args; the message names
        # the shard already, so the reason is the first argument alone (not the tuple).
        reason = args[0] if urls and len(args) > 1 and isinstance(args[0], str) else None
        self.failure(f"shard {urls[-1] if urls else '?'}", err, reason)
        return True


class ClassOrderWatch:
    """Warns (once per worker) when a shard turns out to hold a single class or two: shards
    written in class order (an ImageFolder cut into consecutive ranges, as tools other than
    ``distnorm-shards`` do) leave every shuffle buffer with a handful of classes, and batch
    statistics — what this project normalizes with — with a biased sample."""

    MIN_SAMPLES = 64

    def __init__(self, shuffle_buffer: int):
        self.shuffle_buffer = shuffle_buffer
        self.url, self.labels, self.count, self.warned = None, set(), 0, False

    def passing(self, src: Iterator[dict]) -> Iterator[dict]:
        """The samples of ``src``, each seen on its way (a pipeline stage)."""
        for sample in src:
            self.see(sample.get("__url__"), sample.get("cls"))
            yield sample

    def see(self, url: str, label: Any) -> None:
        if url != self.url:
            self._check()
            self.url, self.labels, self.count = url, set(), 0
        self.labels.add(label)
        self.count += 1

    def _check(self) -> None:
        if self.warned or self.url is None or self.count < self.MIN_SAMPLES or len(self.labels) > 2:
            return
        self.warned = True
        logger.warning(
            "shard %s holds %d class(es) in %d samples: the shards look written in class order, so a "
            "shuffle buffer of %d samples mixes only a few classes and batch statistics are biased. "
            "Rewrite them with distnorm-shards (it writes samples in a seeded random order).",
            self.url, len(self.labels), self.count, self.shuffle_buffer)
