"""CUDA-graph capture: whether a step is being recorded, and the refusal of what cannot be.

A captured step is replayed at other learning rates and buffer states, so while capturing a
layer takes the decisions a replay keeps (:mod:`distnorm._functions`); what reads the device
on the host cannot be recorded and raises through :func:`refuse_capture`, naming the warm-up
step that does it once before capture.
"""

from __future__ import annotations

import torch

__all__ = ["capturing", "refuse_capture"]


def capturing(device: torch.device) -> bool:
    """Whether work on ``device`` is being captured into a CUDA graph (``torch.cuda.graph``,
    ``torch.cuda.make_graphed_callables``, and ``torch.compile(mode="reduce-overhead")``'s
    recording): the layers then take the decisions a replay can keep (:mod:`distnorm._functions`,
    :func:`distnorm._collectives.all_reduce_sum`). One host call on a CUDA device, none elsewhere."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def refuse_capture(device: torch.device, what: str) -> None:
    """Raise while ``device``'s work is being captured: ``what`` (a step that reads the device
    on the host) cannot be recorded into a CUDA graph, and a step before capture does it."""
    if capturing(device):
        raise RuntimeError(
            f"distnorm: {what} reads the device on the host, which a CUDA graph cannot capture. Run one training "
            "step before capturing (the warm-up torch.cuda.graph's documentation prescribes, on a side stream): "
            "it does this once, and every captured step after it replays without it.")
