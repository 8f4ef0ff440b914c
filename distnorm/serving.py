"""A trained model out of distnorm: :func:`freeze` gives the evaluation-mode model in plain
``torch.nn`` modules, which loads, runs, scripts and exports where distnorm is not installed.

What each normalization becomes (every one computes, at evaluation, a per-channel affine
``y = scale[c] * x + shift[c]``):

* **CBN / POP-Norm** (before a convolution or linear layer, as the papers place them): an
  evaluation-mode ``nn.BatchNorm{1,2,3}d`` holding that affine — ``weight = scale``, ``bias =
  shift``, ``running_mean = 0``, ``running_var = 1``, ``eps = 0`` — so it computes
  ``x * scale + shift``, the same ATen kernel and the same values as distnorm's evaluation
  (``eval_stats`` respected: AMAT's or the running statistics). It keeps its place in front
  of the operation: the ``PreNorm`` at ``layer1.0.conv1`` becomes ``nn.Sequential(norm,
  op)`` with the same child names, so ``state_dict`` keys do not change. It cannot go back
  to where the original model had its BatchNorm (after the operation): a per-channel affine
  in front of a convolution is not one behind it.
* **SyncBatchNorm** (``convert(norm="bn")``): the module the conversion replaced, of its
  original class (torchvision's ``nn.BatchNorm2d``, timm's ``BatchNormAct2d``), holding the
  trained parameters and statistics; a layer built as ``distnorm.SyncBatchNorm`` becomes an
  ``nn.BatchNorm2d`` (``nn.BatchNorm1d`` / ``3d`` in front of a linear / 3-D layer). So a model
  trained with ``norm="bn"`` gives the stock architecture's ``state_dict``: it loads into
  torchvision's or timm's model of the same name with ``strict=True``.
* **GroupNorm** (``norm="gn"``, for BNP): distnorm's :class:`~distnorm.layers.GroupNorm`
  becomes ``nn.GroupNorm`` with the same parameters (an ``nn.GroupNorm`` stays as it is);
  ``GroupNormAct`` (timm's fused norm + activation) becomes ``nn.Sequential(norm, drop, act)``.
* **BNP** leaves nothing behind: its hooks, moments and wrapper class go. A bias BNP added to
  a bias-free layer stays where it changes the output; where the layer's output goes only to
  a BatchNorm (a convolution of a ``norm="bn"`` network), the bias moves into that
  BatchNorm's ``running_mean`` (``BN(conv(x) + b) = BN'(conv(x))`` with ``running_mean' =
  running_mean - b``), so the stock architecture's ``state_dict`` comes back.

``fold=True`` also folds each CBN / POP-Norm affine into the linear operation after it where
that is exact: ``op(scale * x + shift)`` is ``op'(x)`` with ``W'[o, i] = W[o, i] scale[i]``
and ``b'[o] = b[o] + sum_i,k W[o, i, k] shift[i]`` for a linear layer and for a convolution
without padding; a padded convolution pads the affine's output with zeros, where ``op'``
would pad ``x``, so the border differs, and there the affine stays. And each BatchNorm that
a convolution's output alone feeds is folded into it (``torch.fx``; PyTorch's own conv-BN
fusion), where the model can be traced.
"""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from typing import Any

import torch
from torch import fx, nn

from distnorm import functional
from distnorm._engines import partition_tests
from distnorm._wrappers import wrapper_name
from distnorm.bnp import BUFFERS as _BNP_BUFFERS
from distnorm.convert import GroupNormAct, PreNorm, SyncBatchNormAct
from distnorm.layers import GroupNorm, SyncBatchNorm, _CompleteNorm, _DistNormLayer

__all__ = ["freeze"]

#: The BatchNorm class of each input rank's operation (a norm in front of it sees its input).
_BATCH_NORM_OF = {nn.Linear: nn.BatchNorm1d, nn.Conv1d: nn.BatchNorm1d, nn.Conv2d: nn.BatchNorm2d,
                  nn.Conv3d: nn.BatchNorm3d}


def freeze(model: nn.Module, *, fold: bool = False) -> nn.Module:
    """An evaluation-mode copy of a trained ``model`` made of ``torch.nn`` modules only: every
    CBN / POP-Norm / SyncBatchNorm as the per-channel affine it computes at evaluation, BNP
    removed (the module docs say what each becomes). ``model`` is not changed.

    ``model``: converted (:func:`distnorm.convert`) or built with distnorm's layers, BNP
    attached or not, bare or wrapped by DDP / DeepSpeed / Accelerate (its ``module`` is
    frozen; parameters sharded by FSDP or ZeRO-3 must be gathered first).

    ``fold``: also fold each affine into the neighbouring convolution or linear layer where
    the result is the same (module docs).

    Example:
        >>> import torch, distnorm
        >>> model = distnorm.convert(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8),
        ...                                              torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 1),
        ...                                              torch.nn.BatchNorm2d(4)), norm="cbn")
        >>> _ = distnorm.set_lr(model, 0.1)                         # AMAT's learning rate
        >>> _ = model(torch.randn(16, 3, 8, 8))                    # a training step's statistics
        >>> frozen = distnorm.freeze(model)
        >>> sorted({type(m).__module__.split(".")[0] for m in frozen.modules()})
        ['torch']
        >>> x = torch.randn(2, 3, 8, 8)
        >>> torch.allclose(frozen(x), model.eval()(x), rtol=1e-6, atol=1e-6)
        True
    """
    bare = _unwrapped(model)
    frozen = copy.deepcopy(bare)
    record = frozen.__dict__.pop("_distnorm_conversion", None)
    originals = {change.path: change.original for change in record.changes} if record is not None else {}
    _remove_hooks(frozen)
    added_biases = _remove_bnp(frozen)
    if isinstance(frozen, (_DistNormLayer, PreNorm)):
        raise TypeError(f"freeze: the model is itself a {type(frozen).__name__}; wrap it in a container "
                        "(e.g. nn.Sequential) so that it can be replaced")
    _replace(frozen, "", originals, fold)
    frozen.eval()
    _move_biases(frozen, added_biases)
    if fold:
        frozen = _fuse_batch_norms(frozen)
    for module in frozen.modules():  # the attributes distnorm set on plain modules (names, records)
        for key in [k for k in module.__dict__ if k.startswith("_distnorm")]:
            del module.__dict__[key]
    left = sorted({type(m).__qualname__ for m in frozen.modules()
                   if type(m).__module__.startswith("distnorm.") and not type(m).__module__.startswith("distnorm.models")})
    if left:  # an internal invariant: every distnorm class has a plain counterpart above
        raise TypeError(f"freeze: no plain torch.nn counterpart for {left}")
    return frozen


def _unwrapped(model: nn.Module) -> nn.Module:
    while wrapper_name(model) is not None and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    engine = wrapper_name(model)
    if engine is not None:
        raise TypeError(f"freeze: the model is wrapped by {engine}, which does not hand out its module; "
                        "freeze the bare model (before wrapping, or the module the engine trains)")
    tests = partition_tests()
    sharded = [name for name, p in model.named_parameters() if any(test(p) for test in tests)]
    if sharded:
        raise ValueError(f"freeze: parameters {sharded[:3]}{' ...' if len(sharded) > 3 else ''} are sharded "
                         "across ranks (FSDP, DeepSpeed ZeRO-3); gather the full model first (FSDP: a full "
                         "state dict; DeepSpeed: zero_to_fp32 or GatheredParameters) and freeze that")
    return model


#: Where the hooks come from that a frozen model drops: distnorm's own (BNP's, the plugin's
#: learning-rate hook) and the training engines' (DeepSpeed's forward hooks on the module it
#: wraps, ...), whose code a plain model must not need. Other hooks (the model's own, torch's
#: parametrizations) stay.
_TRAINING_HOOKS = ("distnorm.", "deepspeed.", "accelerate.", "lightning.", "pytorch_lightning.")


def _remove_hooks(model: nn.Module) -> None:
    """Every hook of :data:`_TRAINING_HOOKS`' libraries on ``model``'s modules."""
    for module in model.modules():
        for attr, hooks in list(vars(module).items()):
            if not attr.endswith("hooks") or not isinstance(hooks, dict):
                continue
            for key in [k for k, hook in list(hooks.items()) if _from_training(hook)]:
                del hooks[key]
                for flags in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                              "_forward_hooks_always_called"):
                    getattr(module, flags, {}).pop(key, None)


def _from_training(hook: Any) -> bool:
    target = getattr(hook, "func", hook)  # a functools.partial
    module = getattr(target, "__module__", None) or type(target).__module__
    return isinstance(module, str) and module.startswith(_TRAINING_HOOKS)


def _remove_bnp(model: nn.Module) -> list[str]:
    """Take BNP out of ``model`` (a copy): the wrapper classes, moments and state (its hooks
    went with the others'). Returns the paths of the layers whose bias BNP added and training
    made non-zero (kept: the output uses them); a still-zero added bias is removed."""
    added = []
    for name, module in model.named_modules():
        state = module.__dict__.get("_distnorm_bnp")
        if state is None:
            continue
        module.__class__ = module._distnorm_original_class
        for buf in _BNP_BUFFERS:
            module._buffers.pop(buf, None)
        if state.added_bias and module.bias is not None:
            if bool(module.bias.detach().ne(0).any()):
                added.append(name)
            else:
                module.bias = None
        for key in ("_distnorm_bnp", "_distnorm_buffers", "_distnorm_original_class"):
            module.__dict__.pop(key, None)
    return added


def _replace(parent: nn.Module, prefix: str, originals: dict[str, nn.Module], fold: bool) -> None:
    for name, child in list(parent.named_children()):
        path = f"{prefix}{name}"
        new = _plain(child, path, originals, fold)
        if new is not None:
            parent._modules[name] = new
        else:
            _replace(child, f"{path}.", originals, fold)


def _plain(module: nn.Module, path: str, originals: dict[str, nn.Module], fold: bool) -> nn.Module | None:
    """The plain module that takes ``module``'s place, or None to leave it (and look inside)."""
    if isinstance(module, PreNorm):
        _replace(module.op, f"{path}.op.", originals, fold)  # an operation with children of its own
        norm = _affine(module._modules["norm"], _BATCH_NORM_OF.get(type(module.op), nn.BatchNorm2d))
        if fold and _foldable(module.op):
            return _folded(norm, module.op)
        return nn.Sequential(OrderedDict([("norm", norm), ("op", module.op)]))
    if isinstance(module, _CompleteNorm):
        return _affine(module, nn.BatchNorm2d)
    if isinstance(module, SyncBatchNorm):
        return _batch_norm(module, originals.get(path))
    if isinstance(module, GroupNormAct):
        return nn.Sequential(OrderedDict([("norm", _torch_group_norm(module)), ("drop", module.drop),
                                          ("act", module.act)]))
    if type(module) is GroupNorm:
        return _torch_group_norm(module)
    return None


def _torch_group_norm(module: GroupNorm) -> nn.GroupNorm:
    """``nn.GroupNorm`` with ``module``'s configuration and parameters."""
    norm = nn.GroupNorm(module.num_groups, module.num_channels, module.eps, module.affine)
    if module.affine:
        norm = norm.to(device=module.weight.device, dtype=module.weight.dtype)
        norm.load_state_dict({"weight": module.weight, "bias": module.bias}, strict=True)
    return norm.train(module.training)


def _affine(layer: _CompleteNorm, cls: type[nn.Module]) -> nn.Module:
    """An evaluation-mode ``cls`` (a BatchNorm) computing ``layer``'s evaluation affine."""
    weight = layer.weight
    with torch.no_grad():
        scale, shift = functional.cbn_eval_affine(weight, layer.bias, layer._statistics(), layer.amat_eta,
                                                  layer._state, weight.dtype)
    norm = cls(layer.num_features, eps=0.0, momentum=0.0).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(scale)
        norm.bias.copy_(shift)
        norm.num_batches_tracked.copy_(layer.num_batches_tracked)
    return norm.eval()


def _batch_norm(layer: SyncBatchNorm, original: nn.Module | None) -> nn.Module:
    """``layer``'s trained values in the module ``convert`` replaced (its class, its ``drop``
    and ``act``), or in an ``nn.BatchNorm2d`` (``+ drop, act`` for a fused one)."""
    if original is not None and isinstance(original, nn.modules.batchnorm._BatchNorm):
        new = copy.deepcopy(original)
        if isinstance(layer, SyncBatchNormAct):
            new.drop, new.act = layer.drop, layer.act
    else:
        new = nn.BatchNorm2d(layer.num_features, eps=layer.eps, momentum=layer.momentum, affine=layer.affine,
                             track_running_stats=layer.track_running_stats)
    own = {k: v for k, v in layer.state_dict().items() if "." not in k}  # its own tensors, not drop / act's
    floats = [t for t in own.values() if t.is_floating_point()]
    if floats:  # the layer's device and dtype (the original's buffers stayed where convert found them)
        new = new.to(device=floats[0].device, dtype=floats[0].dtype)
    new.load_state_dict({**new.state_dict(), **own}, strict=True)
    if isinstance(layer, SyncBatchNormAct) and not hasattr(new, "act"):
        return nn.Sequential(OrderedDict([("norm", new), ("drop", layer.drop), ("act", layer.act)]))
    return new


def _foldable(op: nn.Module) -> bool:
    """``op(scale * x + shift) == op'(x)`` exactly in the maths: a linear layer, or a
    convolution that pads nothing."""
    if isinstance(op, nn.Linear):
        return True
    if isinstance(op, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return isinstance(op.padding, tuple) and not any(op.padding)
    return False


def _folded(norm: nn.Module, op: nn.Module) -> nn.Module:
    """``op`` with the affine ``norm`` (``x * weight + bias``) folded in, computed in float64."""
    new = copy.deepcopy(op)
    scale, shift = norm.weight.detach().double(), norm.bias.detach().double()
    weight = op.weight.detach().double()
    groups = getattr(op, "groups", 1)
    per_group = weight.shape[1]
    out = weight.shape[0]
    # input channel of each (output, input-in-group) pair: its group's block of scale / shift
    index = (torch.arange(out, device=weight.device) // (out // groups))[:, None] * per_group \
        + torch.arange(per_group, device=weight.device)[None, :]
    shape = (out, per_group) + (1,) * (weight.dim() - 2)
    folded_weight = weight * scale[index].view(shape)
    extra = (weight * shift[index].view(shape)).sum(dim=tuple(range(1, weight.dim())))
    bias = op.bias.detach().double() + extra if op.bias is not None else extra
    with torch.no_grad():
        new.weight.copy_(folded_weight.to(op.weight.dtype))
        if new.bias is None:
            new.bias = nn.Parameter(bias.to(op.weight.dtype), requires_grad=op.weight.requires_grad)
        else:
            new.bias.copy_(bias.to(op.bias.dtype))
    return new


def _users(graph_module: fx.GraphModule) -> list[tuple[str, str]]:
    """``(conv, batch_norm)`` module paths where the convolution's output goes only to the
    BatchNorm, from the model's dataflow."""
    modules = dict(graph_module.named_modules())
    pairs = []
    for node in graph_module.graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(node.target), nn.modules.batchnorm._BatchNorm):
            continue
        source = node.args[0] if node.args else None
        if (isinstance(source, fx.Node) and source.op == "call_module" and len(source.users) == 1
                and isinstance(modules.get(source.target), (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear))):
            pairs.append((source.target, node.target))
    return pairs


def _trace(model: nn.Module) -> fx.GraphModule | None:
    try:
        return fx.symbolic_trace(model)
    except Exception:  # noqa: BLE001 - any model fx cannot trace: the step is skipped, and said so
        return None


def _move_biases(model: nn.Module, paths: list[str]) -> None:
    """Each bias BNP added at ``paths`` whose layer feeds only a BatchNorm goes into that
    BatchNorm's ``running_mean`` (``BN(op(x) + b) = BN'(op(x))``)."""
    if not paths:
        return
    graph_module = _trace(model)
    if graph_module is None:
        warnings.warn(f"freeze: torch.fx cannot trace {type(model).__name__}, so the biases BNP added to "
                      f"{paths[:3]} stay on their layers (the model's state_dict keeps their keys)", stacklevel=3)
        return
    feeds = dict(_users(graph_module))
    for path in paths:
        bn_path = feeds.get(path)
        if bn_path is None:
            continue
        op, bn = model.get_submodule(path), model.get_submodule(bn_path)
        if bn.running_mean is None or bn.training:
            continue
        with torch.no_grad():
            bn.running_mean.sub_(op.bias.to(bn.running_mean.dtype))
        op.bias = None


def _fuse_batch_norms(model: nn.Module) -> nn.Module:
    """Each BatchNorm a convolution alone feeds, folded into it (``torch.fx``'s conv-BN
    fusion, an evaluation-mode rewrite); the model as it is where fx cannot trace it."""
    graph_module = _trace(model)
    if graph_module is None:
        warnings.warn(f"freeze(fold=True): torch.fx cannot trace {type(model).__name__}; its BatchNorms after "
                      "convolutions stay unfolded", stacklevel=3)
        return model
    pairs = [(c, b) for c, b in _users(graph_module)
             if not isinstance(graph_module.get_submodule(c), nn.Linear)]
    if not pairs:
        return model
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    for conv_path, bn_path in pairs:
        conv, bn = model.get_submodule(conv_path), model.get_submodule(bn_path)
        if not bn.track_running_stats:
            continue
        _set(model, conv_path, fuse_conv_bn_eval(conv, bn))
        _set(model, bn_path, nn.Identity())
    return model


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)

