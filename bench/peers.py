"""Peers the benchmarks compare distnorm against, written here so nothing extra is installed.

:class:`NaiveSyncBatchNorm` follows detectron2's ``detectron2.layers.batch_norm.NaiveSyncBatchNorm``
(Apache-2.0): the per-channel mean and mean of squares of the local batch go through one
*autograd* all-reduce (``differentiable_all_reduce``: all-reduce forward, all-reduce
backward), the rest is element-wise PyTorch. It is the synchronized BatchNorm a CPU / gloo
user reaches for (``torch.nn.SyncBatchNorm`` is CUDA-only), with the same collective count
as distnorm's SyncBatchNorm: one all-reduce forward, one backward per layer. Like
detectron2's default ``stats_mode=""`` it assumes equal batches on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["NaiveSyncBatchNorm", "naive_sync"]


class _AllReduce(torch.autograd.Function):
    """detectron2's ``differentiable_all_reduce``: sum in forward, sum of gradients backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class NaiveSyncBatchNorm(nn.BatchNorm2d):
    """detectron2's NaiveSyncBatchNorm design (mean and mean of squares, autograd all-reduce)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1 or not self.training:
            return super().forward(x)
        channels = x.shape[1]
        mean = x.mean(dim=[0, 2, 3])
        meansqr = (x * x).mean(dim=[0, 2, 3])
        vec = _AllReduce.apply(torch.cat([mean, meansqr])) * (1.0 / world)
        mean, meansqr = torch.split(vec, channels)
        var = meansqr - mean * mean
        invstd = torch.rsqrt(var + self.eps)
        scale = self.weight * invstd
        bias = self.bias - mean * scale
        with torch.no_grad():
            self.running_mean += self.momentum * (mean.detach() - self.running_mean)
            self.running_var += self.momentum * (var.detach() - self.running_var)
            self.num_batches_tracked += 1
        return x * scale.reshape(1, -1, 1, 1) + bias.reshape(1, -1, 1, 1)


def naive_sync(model: nn.Module) -> nn.Module:
    """Replace every ``nn.BatchNorm2d`` of ``model`` by :class:`NaiveSyncBatchNorm` (in place)."""
    for name, child in list(model.named_children()):
        if type(child) is nn.BatchNorm2d:
            new = NaiveSyncBatchNorm(child.num_features, child.eps, child.momentum)
            new.load_state_dict(child.state_dict())
            setattr(model, name, new)
        else:
            naive_sync(child)
    return model
