"""Activation checkpointing: every buffer is updated once per step, whatever recomputes.

``torch.utils.checkpoint`` runs a segment's forward twice: once in the forward pass and
again during the backward pass to rebuild what autograd needs. A layer whose forward has
side effects — a collective, buffer updates (running / AMAT statistics, BNP moments) —
would repeat them, and for CBN with AMAT the second forward would normalize with averages
that already contain this batch, changing the gradients. (``torch.nn.BatchNorm*`` counts
such a step twice.)

Each distnorm layer therefore keeps a small first-in, first-out :class:`Stash` of the
per-step statistics its forward computed ("plans"). A forward that runs while autograd is
executing a backward pass is a recomputation: it takes the oldest stashed plan instead of
computing statistics, issues no collective and changes no buffer, so it reproduces the
first forward exactly.

Lifetime of a stashed plan, so that the stash never grows:

* grad-enabled forward (plain training, non-reentrant checkpointing): the stash holds a
  *weak* reference; the strong one lives on the autograd node of the forward, so the plan
  disappears with the graph (after its backward, or when the graph is dropped), and the
  next grad-enabled forward forgets the reference;
* no-grad training forward (the first pass of reentrant checkpointing, or a statistics
  recalibration pass under ``torch.no_grad()``): there is no graph to tie it to, so the
  stash keeps it, at most :data:`MAX_DETACHED` per layer, and drops these when the layer
  next runs a grad-enabled forward outside a backward pass, or switches ``train()`` /
  ``eval()`` — the points where no reentrant recomputation can still be pending.

Recomputation order is the forward order within a segment, and segments are recomputed
one at a time, so FIFO order matches when each layer runs once per forward (a layer module
shared between two checkpointed segments is not supported). Each plan records the input
shape, and a mismatch is an error rather than a silently wrong gradient.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import torch

__all__ = ["Stash", "StashedPlan", "in_backward", "MAX_DETACHED"]

#: No-grad plans kept per layer (pipelined reentrant checkpointing with more micro-batches
#: in flight per layer than this raises a clear error).
MAX_DETACHED = 16


def in_backward() -> bool:
    """Whether autograd is executing a backward pass on this thread (a recomputation)."""
    return torch._C._current_graph_task_id() != -1


class StashedPlan:
    """The statistics one training forward computed, and the shape they belong to."""

    __slots__ = ("plan", "shape", "__weakref__")

    def __init__(self, plan: Any, shape: torch.Size):
        self.plan = plan
        self.shape = shape


class Stash:
    """Per-layer FIFO of :class:`StashedPlan` (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: collections.deque[Any] = collections.deque()  # weakref.ref or StashedPlan
        self._detached = 0

    def __len__(self) -> int:
        return sum(1 for e in self._entries if self._resolve(e) is not None)

    @staticmethod
    def _resolve(entry: Any) -> StashedPlan | None:
        return entry() if isinstance(entry, weakref.ref) else entry

    def push(self, stashed: StashedPlan, *, grad_enabled: bool) -> None:
        """Record the plan of a first (non-recomputed) forward."""
        if grad_enabled:
            # No reentrant recomputation is pending now: forget the no-grad plans, and the
            # plans whose graphs are gone (their backward ran without a recomputation).
            live = (e for e in self._entries if isinstance(e, weakref.ref) and e() is not None)
            self._entries = collections.deque(live)
            self._detached = 0
            self._entries.append(weakref.ref(stashed))
            return
        if self._detached >= MAX_DETACHED:
            for i, entry in enumerate(self._entries):  # drop the oldest detached plan
                if not isinstance(entry, weakref.ref):
                    del self._entries[i]
                    self._detached -= 1
                    break
        self._entries.append(stashed)
        self._detached += 1

    def pop(self, shape: torch.Size, layer: str) -> Any:
        """The plan a recomputed forward of input ``shape`` must reuse (oldest first)."""
        while self._entries:
            entry = self._entries.popleft()
            if not isinstance(entry, weakref.ref):
                self._detached -= 1
            stashed = self._resolve(entry)
            if stashed is None:
                continue  # its graph was freed without a recomputation
            if stashed.shape != shape:
                raise RuntimeError(
                    f"{layer}: a recomputed forward (activation checkpointing) got an input of shape "
                    f"{tuple(shape)}, but the forward it recomputes had {tuple(stashed.shape)}. A layer "
                    "module called more than once in different checkpointed segments is not supported; "
                    "give each call its own module."
                )
            return stashed.plan
        raise RuntimeError(
            f"{layer}: the layer ran a training forward during a backward pass — a recomputation by "
            "activation checkpointing — but no statistics of an earlier forward are stashed for it. "
            "Every recomputed forward must follow a training forward of the same input, in the same "
            "train() mode, with no train()/eval() switch in between."
        )

    def drop_detached(self) -> None:
        """Forget no-grad plans: no reentrant recomputation can be pending for them now."""
        if self._detached:
            self._entries = collections.deque(e for e in self._entries if isinstance(e, weakref.ref))
            self._detached = 0
