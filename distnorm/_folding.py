"""A pre-operation CBN folded into the convolution after it, where its input needs no gradient.

``distnorm.convert(norm="cbn")`` puts a CBN before every convolution, the stem's too: a CBN
on the image. Computed as written, ``conv(cbn(x))``, its gamma and beta need ``g``, the
gradient of the convolution's *input* — for the stem a full convolution backward over the
images, which a BatchNorm after the stem never computes (``docs/reference/benchmarks.md``).

CBN's output is a per-channel affine map of its normalized input, ``y = s * x_hat + t``
(:meth:`distnorm.CBN.forward_parts`; ``t`` is 0 in value and carries beta's gradient), and
a convolution is linear, so::

    conv(s * x_hat + t; W) = conv(x_hat; W * s) + conv(t; W)

with ``s`` scaling ``W``'s input channels, and ``conv(t; W)`` the convolution of one image
filled with ``t``, padded by ``op``'s own padding mode, as ``t`` would be. The gradients follow
without ``g``: ``dL/ds = sum over (o, k) of dL/d(W * s) * W`` from the convolution's weight
gradient, which the step computes anyway, and ``dL/dt`` from the one-image convolution's
input gradient, ``1/N`` of the cost. Exact in real arithmetic; rounding differs from the
unfolded form by a few ulps (``tests/test_folding.py`` checks it against the float64
reference and the unfolded layer).

Only the plain case folds (:func:`folds`). The decision reads the model (its modules'
classes and hooks, the parameters' ``requires_grad``, training mode), the grad mode and
whether the input needs a gradient: the same on every rank unless a rank registers a hook of
its own on the stem. Either way the statistics step, its collective and the buffer updates
are the layer's own, and neither form runs a collective in the backward, so a rank that
decides otherwise differs from the others by rounding only.
"""

from __future__ import annotations

import torch
from torch import nn

from distnorm.layers import CBN, POPNorm

__all__ = ["FOLDABLE", "FOLDABLE_NORMS", "fold_into_conv", "folds"]

#: The convolutions a CBN folds into: these exact classes (a subclass may change its
#: forward, as timm's ``Conv2dSame`` and ``StdConv2d`` do).
FOLDABLE: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: The layers that fold: these exact classes (FSDP2's ``fully_shard`` makes a subclass of its
#: own; a user's may change the forward).
FOLDABLE_NORMS: tuple[type[nn.Module], ...] = (CBN, POPNorm)


def _hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` runs more than its class's ``forward``: hooks — an
    engine's (DeepSpeed ZeRO-3 and FSDP2 gather parameters in pre-forward hooks), BNP's, a
    user's — or a ``forward`` replaced on the instance (Accelerate's ``add_hook_to_module``,
    behind ``cpu_offload`` and ``dispatch_model``, wraps it so). Folding skips the modules'
    own calls, so it must not skip these."""
    hooks = nn.modules.module
    return bool("forward" in module.__dict__ or module._forward_pre_hooks or module._forward_hooks
                or module._backward_hooks or module._backward_pre_hooks or hooks._global_forward_pre_hooks
                or hooks._global_forward_hooks or hooks._global_backward_hooks or hooks._global_backward_pre_hooks)


def folds(norm: nn.Module, op: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``op(norm(x))`` is computed folded (:func:`fold_into_conv`): a grad-enabled
    training forward of a :class:`~distnorm.CBN` / :class:`~distnorm.POPNorm` whose gamma
    or beta needs a gradient, on an input ``x`` that needs none, before a plain ungrouped
    convolution; neither module with hooks or a replaced ``forward``. (Under ``no_grad``
    there is no input gradient to save, and the unfolded form is the cheaper.)"""
    # Cheapest first: every PreNorm after the stem has an input that needs a gradient, and a
    # GPU step is bound by the host's time per layer.
    return (isinstance(x, torch.Tensor) and not x.requires_grad and torch.is_grad_enabled()
            and type(op) in FOLDABLE and type(norm) in FOLDABLE_NORMS and norm.training
            and (norm.weight.requires_grad or norm.bias.requires_grad) and op.groups == 1
            and not _hooked(op) and not _hooked(norm))


def fold_into_conv(x: torch.Tensor, norm: nn.Module, op: nn.Module) -> torch.Tensor:
    """``op(norm(x))`` computed as ``conv(x_hat; W * s) + conv(t; W)`` (module docstring).

    ``op``'s own padding mode, stride and dilation apply to both convolutions
    (``_conv_forward`` is what ``op.forward`` calls). The one-image convolution takes ``W``
    detached: its input is 0 in value, so ``W``'s gradient through it is 0, and computing it
    would cost a weight gradient for nothing. It runs outside autocast, in the parameters'
    dtype: beta's gradient is the sum of its input gradient, which a bf16 convolution would
    round before the sum, and a one-image convolution costs ``1/N`` of the batch's.
    """
    x_hat, scale, shift = norm.forward_parts(x)
    weight = op.weight
    per_input_channel = (1, -1) + (1,) * (weight.dim() - 2)
    y = op._conv_forward(x_hat, weight * scale.to(weight.dtype).view(per_input_channel), op.bias)
    # A stride-0 view: ATen's convolution makes it contiguous for the kernels that need it
    # (aten/src/ATen/native/Convolution.cpp, _convolution, ConvBackend::Cudnn:
    # input.contiguous(backend_memory_format)); the CPU's takes it as it is.
    image = shift.to(weight.dtype).view(per_input_channel).expand((1,) + tuple(x.shape[1:]))
    with torch.autocast(x.device.type, enabled=False):
        bias_image = op._conv_forward(image, weight.detach(), None)
    # In place: the convolution's backward does not read its output.
    return y.add_(bias_image)
