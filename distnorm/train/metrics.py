"""Where the recipe's numbers go: JSON lines (always), TensorBoard (when installed), and a
rank-0 progress bar. Only rank 0 writes."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

__all__ = ["MetricsWriter"]

logger = logging.getLogger(__name__)


class MetricsWriter:
    """Append records to ``<run>/metrics.jsonl`` and mirror scalars to TensorBoard.

    Each record is one JSON object per line with a ``kind`` (``train``, ``eval``,
    ``epoch``, ...), the ``step`` / ``epoch`` it belongs to, a wall-clock ``time`` and the
    values. The file is flushed after each record, so a killed run loses nothing written.
    """

    def __init__(self, run_dir: str | Path, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = None
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:
                logger.info("tensorboard is not installed; metrics go to %s only", self.path)

    def log(self, kind: str, **values: Any) -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "time": time.time(), **values}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            step = values.get("step", values.get("epoch", 0))
            for key, value in values.items():
                if isinstance(value, (int, float)) and key not in ("step", "epoch"):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
