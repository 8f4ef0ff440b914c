"""Small helpers shared by the end-to-end tests."""

from __future__ import annotations

import socket
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def merged_overrides(*items: str) -> list[str]:
    """``section.key=value`` overrides with later ones replacing earlier ones of the same key
    (distnorm-train refuses a key given twice)."""
    merged: dict[str, str] = {}
    for item in items:
        merged[item.split("=", 1)[0]] = item
    return list(merged.values())


#: The side of the tests' digits. The demo trains on 32×32; the tests' launched trainings check
#: launchers, resumes and failures, none of which depends on the image size, and at 16×16 a
#: ResNet-20 step costs about a third of the CPU (tests/README.md, "CPU seconds").
DIGITS_SIZE = 16


def write_digits_shards(root: Path, size: int = DIGITS_SIZE) -> Path:
    """The demo digits as shards in ``root`` (6 train shards, 3 val shards), ``size`` pixels
    a side."""
    from distnorm import data as D

    D.write_shards(D.DigitsSource("train", size=size), str(root / "digits-train"), maxcount=256, progress=False)
    D.write_shards(D.DigitsSource("val", size=size), str(root / "digits-val"), maxcount=128, progress=False)
    return root


def digits_overrides(root: Path) -> list[str]:
    """``distnorm-train`` overrides pointing the demo config at shards in ``root``."""
    return [f"data.train_shards={root}/digits-train-{{000000..000005}}.tar", f"data.train_index={root}/digits-train-index.json",
            f"data.val_shards={root}/digits-val-{{000000..000002}}.tar", f"data.val_index={root}/digits-val-index.json",
            f"data.image_size={DIGITS_SIZE}"]
