"""The statistics and backward steps as PyTorch custom operators, for ``torch.compile``.

Eager mode calls the functions of :mod:`distnorm._functions` directly. Under
``torch.compile`` the same functions run as opaque custom operators
(``torch.ops.distnorm.*``) that declare which buffers they mutate. That is what makes the
compiled model equal the eager one: the compiler cannot recompute the statistics from
buffers the step has already updated, cannot move a collective, and saves the plan for the
backward instead of re-deriving it. Inside, the operators run the eager code at run time,
so host-side decisions (synchronize or not, skip the masked path) are made per call,
never baked into a graph.

A layer's :class:`~distnorm._functions.NormState` reaches an operator as an integer key
(operator schemas take tensors and scalars only); :func:`register` hands out keys and
holds the states weakly. The functional API (:mod:`distnorm.functional`) has no layer to
hold a state: its calls reach the operators with the key ``-1`` and a short text of their
configuration (:func:`functional_config`), from which the operator rebuilds the state at
run time — the compiled graph holds the text as a constant, so nothing has to stay
registered for it.

CUDA graphs. ``torch.compile(mode="reduce-overhead")`` captures a graph's kernels once and
replays them; the host decisions inside these operators (AMAT's history branch and
initialisation, the checkpoint stash, host counts, the group's agreement on the fused
kernels) would never run again, and a schedule crossing ``eta = 0`` would replay the wrong
branch. So every operator here carries ``torch.Tag.cudagraph_unsafe``: Inductor then runs
it outside the captured graphs (graph partitions) or captures nothing of that graph. A
torch without the tag (or without ``custom_op(tags=...)``) cannot be told, and there a
compilation that would capture CUDA graphs is refused (:func:`_refuse_cuda_graphs`).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
import weakref
from typing import Optional

import torch
from torch import Tensor

from distnorm import _bnp_functions, _functions
from distnorm._bnp_functions import BNPLayerState
from distnorm._functions import CBNBuffers, NormPlan, NormState

__all__ = ["bn_statistics", "bnp_statistics", "cbn_statistics", "functional_config", "no_grad_input",
           "normalize_backward", "register", "state_of"]

_STATES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def register(state: object) -> int:
    """The key under which the custom operators find ``state`` (assigned once)."""
    key = getattr(state, "key", -1)
    if key < 0 or _STATES.get(key) is not state:
        key = next(_KEYS)
        _STATES[key] = state
        state.key = key  # type: ignore[attr-defined]
    return key


def state_of(key: int, config: str = "") -> object:
    """The state of the layer registered under ``key``, or, for ``key = -1``, the state a
    functional call described by ``config`` (:func:`functional_config`)."""
    if key < 0 and config:
        return _functional_state(config)
    state = _STATES.get(key)
    if state is None:
        raise RuntimeError(f"distnorm: no layer is registered under key {key} (was it garbage-collected?)")
    return state


_SEP = "|"


def functional_config(state: NormState) -> str:
    """``""`` for a registered layer's state; for a functional call's, the text the operators
    rebuild it from: kind, hyper-parameters, synchronization, history, group name, layer name
    (last: it may contain the separator). Traceable by ``torch.compile``, which folds it into
    a constant of the graph (guarded on the values it reads)."""
    if state.key >= 0:
        return ""
    group = "" if state.process_group is None else state.process_group.group_name
    return _SEP.join((state.kind, f"{state.eps!r}", f"{state.momentum!r}", f"{state.rho!r}", f"{state.r_max!r}",
                      f"{int(state.sync)}", f"{int(state.history)}", group, state.name))


def _number(text: str) -> float | None:
    return None if text == "None" else float(text)


@functools.lru_cache(maxsize=256)
def _functional_state(config: str) -> NormState:
    """The state of a functional call, rebuilt from its configuration (one per distinct
    configuration: the stash is unused under compilation, and no other field changes)."""
    kind, eps, momentum, rho, r_max, sync, history, group, name = config.split(_SEP, 8)
    process_group = None
    if group:
        from torch.distributed.distributed_c10d import _resolve_process_group

        process_group = _resolve_process_group(group)
    eps_value = _number(eps)
    assert eps_value is not None, config
    return NormState(kind, name, eps_value, _number(momentum), rho=_number(rho), r_max=_number(r_max),
                     process_group=process_group, sync=sync == "1", history=history == "1")


#: ``torch.Tag.cudagraph_unsafe`` on every operator below, where torch has the tag and
#: ``custom_op`` takes tags; empty otherwise (then :func:`_refuse_cuda_graphs` guards).
_UNSAFE_FOR_CUDA_GRAPHS: dict = (
    {"tags": (torch.Tag.cudagraph_unsafe,)}
    if hasattr(torch.Tag, "cudagraph_unsafe") and "tags" in inspect.signature(torch.library.custom_op).parameters
    else {})


def _refuse_cuda_graphs() -> None:
    """Where the operators cannot be tagged unsafe for CUDA graphs: raise while Inductor
    compiles a graph it would capture (``mode="reduce-overhead"``; run from the fake kernels,
    which run inside that compilation)."""
    if _UNSAFE_FOR_CUDA_GRAPHS:
        return
    config = sys.modules.get("torch._inductor.config")
    if config is not None and getattr(config.triton, "cudagraphs", False):
        raise RuntimeError(
            f"distnorm: torch.compile(mode=\"reduce-overhead\") captures CUDA graphs and replays them, which would "
            "replay the first step's decisions of distnorm's layers (AMAT's history branch and initialisation, "
            "activation checkpointing, the synchronized statistics) at every step. This torch "
            f"({torch.__version__}) cannot mark distnorm's operators unsafe for CUDA graphs "
            "(torch.Tag.cudagraph_unsafe and torch.library.custom_op(tags=...) need torch >= 2.8). Compile with "
            "mode=\"default\" or mode=\"max-autotune-no-cudagraphs\", or upgrade torch.")


def _fresh(tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Custom operator outputs must not alias one another or anything else: copy them."""
    return tuple(t.clone() for t in tensors)


# ---------------------------------------------------------------- statistics operators
@torch.library.custom_op(
    "distnorm::bn_statistics", mutates_args=("running_mean", "running_var", "num_batches_tracked"),
    **_UNSAFE_FOR_CUDA_GRAPHS)
def _bn_statistics_op(x: Tensor, weight: Optional[Tensor], running_mean: Optional[Tensor],
                      running_var: Optional[Tensor], num_batches_tracked: Optional[Tensor],
                      key: int, config: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    plan = _functions.bn_statistics(x, weight, running_mean, running_var, num_batches_tracked,
                                    state_of(key, config), replay=False)
    return _fresh(tuple(plan))


@_bn_statistics_op.register_fake
def _(x, weight, running_mean, running_var, num_batches_tracked, key, config):
    _refuse_cuda_graphs()
    return _fake_plan(x, beta_coef=False)


@torch.library.custom_op(
    "distnorm::cbn_statistics",
    mutates_args=("amat_mean", "amat_var", "amat_initialized", "running_mean", "running_var", "num_batches_tracked"),
    **_UNSAFE_FOR_CUDA_GRAPHS)
def _cbn_statistics_op(x: Tensor, weight: Tensor, bias: Tensor, amat_mean: Tensor, amat_var: Tensor,
                       amat_initialized: Tensor, running_mean: Tensor, running_var: Tensor,
                       num_batches_tracked: Tensor, amat_eta: Tensor,
                       key: int, config: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    buffers = CBNBuffers(amat_mean, amat_var, amat_initialized, running_mean, running_var, num_batches_tracked)
    plan = _functions.cbn_statistics(x, weight, bias, buffers, amat_eta, state_of(key, config), replay=False)
    return _fresh(tuple(plan))


@_cbn_statistics_op.register_fake
def _(x, weight, bias, amat_mean, amat_var, amat_initialized, running_mean, running_var,
      num_batches_tracked, amat_eta, key, config):
    _refuse_cuda_graphs()
    return _fake_plan(x, beta_coef=True)


def _fake_plan(x: Tensor, *, beta_coef: bool) -> tuple[Tensor, ...]:
    channels = x.shape[1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    vec = lambda *shape: x.new_empty(shape, dtype=acc)  # noqa: E731
    return (vec(channels), vec(channels), vec(channels), vec(channels), vec(2, 2, channels),
            vec(channels) if beta_coef else vec(0))


@torch.library.custom_op("distnorm::normalize_backward", mutates_args=(), **_UNSAFE_FOR_CUDA_GRAPHS)
def _normalize_backward_op(grad_out: Tensor, x: Tensor, center: Tensor, invstd: Tensor, grad_scale: Tensor,
                           grad_coef: Tensor, beta_coef: Tensor, need_input_grad: bool,
                           key: int, config: str) -> tuple[Tensor, Tensor, Tensor]:
    grads = _functions.normalize_backward(grad_out, x, center, invstd, grad_scale, grad_coef, beta_coef,
                                          need_input_grad, state_of(key, config))
    return _fresh(grads)


@_normalize_backward_op.register_fake
def _(grad_out, x, center, invstd, grad_scale, grad_coef, beta_coef, need_input_grad, key, config):
    _refuse_cuda_graphs()
    channels = x.shape[1]
    grad_x = torch.empty_like(x) if need_input_grad else x.new_empty(0)
    return grad_x, center.new_empty(channels), center.new_empty(channels)


def bnp_statistics_impl(h: Tensor, mean: Tensor, var: Tensor, key: int) -> tuple[Tensor, Tensor, Tensor]:
    """What ``torch.ops.distnorm.bnp_statistics`` runs (named, so tests can count its ops)."""
    new_mean, var_t, count = _bnp_functions.layer_statistics(h, mean, var, state_of(key), replay=False)
    if not isinstance(count, Tensor):  # a host count (local statistics): an operator returns tensors
        # torch.full, not torch.tensor: a fill kernel instead of a host-to-device copy + sync
        count = torch.full((), float(count), dtype=new_mean.dtype, device=new_mean.device)
    return _fresh((new_mean, var_t, count))


_bnp_statistics_op = torch.library.custom_op("distnorm::bnp_statistics", mutates_args=("mean", "var"),
                                             **_UNSAFE_FOR_CUDA_GRAPHS)(bnp_statistics_impl)


@_bnp_statistics_op.register_fake
def _(h, mean, var, key):
    _refuse_cuda_graphs()
    return mean.new_empty(mean.shape), var.new_empty(var.shape), mean.new_empty(())


# --------------------------------------------------------------- eager or operator
def _compiling() -> bool:
    return torch.compiler.is_compiling()


def no_grad_input(t: Tensor | None) -> Tensor | None:
    """What a statistics step receives. Eager: the tensor itself (the step runs under
    ``no_grad``: no graph, no extra op). Compiled: a detached tensor, since the custom
    operators have no autograd formula of their own."""
    return t.detach() if t is not None and _compiling() else t


def bn_statistics(x: Tensor, weight: Tensor | None, running_mean: Tensor | None, running_var: Tensor | None,
                  num_batches_tracked: Tensor | None, state: NormState) -> NormPlan:
    if _compiling():
        return NormPlan(*torch.ops.distnorm.bn_statistics(x, weight, running_mean, running_var,
                                                          num_batches_tracked, state.key, functional_config(state)))
    return _functions.bn_statistics(x, weight, running_mean, running_var, num_batches_tracked, state)


def cbn_statistics(x: Tensor, weight: Tensor, bias: Tensor, buffers: CBNBuffers, amat_eta: Tensor,
                   state: NormState) -> NormPlan:
    if _compiling():  # an operator's schema takes tensors: the buffers one by one
        return NormPlan(*torch.ops.distnorm.cbn_statistics(x, weight, bias, *buffers, amat_eta, state.key,
                                                           functional_config(state)))
    return _functions.cbn_statistics(x, weight, bias, buffers, amat_eta, state)


def normalize_backward(grad_out: Tensor, x: Tensor, center: Tensor, invstd: Tensor, grad_scale: Tensor,
                       grad_coef: Tensor, beta_coef: Tensor, need_input_grad: bool,
                       state: NormState) -> tuple[Tensor, Tensor, Tensor]:
    args = (grad_out, x, center, invstd, grad_scale, grad_coef, beta_coef, need_input_grad)
    if _compiling():
        return torch.ops.distnorm.normalize_backward(*args, state.key, functional_config(state))
    return _functions.normalize_backward(*args, state)


def bnp_statistics(h: Tensor, mean: Tensor, var: Tensor, state: BNPLayerState) -> tuple[Tensor, Tensor, Tensor]:
    if _compiling():
        return torch.ops.distnorm.bnp_statistics(h, mean, var, state.key)  # type: ignore[attr-defined]
    return _bnp_functions.layer_statistics(h, mean, var, state)
