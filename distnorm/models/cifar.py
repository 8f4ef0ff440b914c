"""The CIFAR-style models of the papers' tables, written with ordinary BatchNorm and ReLU.

``distnorm.models.create`` converts them like any user model (one code path for all):

* :class:`ResNet20` — He et al. 2016, §4.2: a 3×3 stem with 16 channels, three stages of
  three basic blocks (16, 32, 64 channels), parameter-free shortcuts (option A: stride-2
  subsampling and zero-padded channels), global average pooling, one linear layer.
* :class:`VGG16` — the 13 convolutions of VGG-16 with BatchNorm after each (the usual
  CIFAR adaptation: 3×3 convs, max-pooling after each block, one linear classifier on the
  512-dimensional 1×1 feature map).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ResNet20", "VGG16"]


class _PadShortcut(nn.Module):
    """Option-A shortcut: subsample by ``stride``, zero-pad the new channels."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.extra = out_channels - in_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        if self.extra:
            half = self.extra // 2
            x = nn.functional.pad(x, (0, 0, 0, 0, half, self.extra - half))
        return x


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.act1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.act2 = nn.ReLU(inplace=True)
        self.shortcut = (
            _PadShortcut(in_channels, out_channels, stride)
            if stride != 1 or in_channels != out_channels
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.act2(out + self.shortcut(x))


class ResNet20(nn.Module):
    """CIFAR ResNet-20 (0.27 M parameters)."""

    def __init__(self, num_classes: int = 10, depth: int = 20, width: int = 16):
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"ResNet depth must be 6n + 2 (20, 32, 44, 56, 110), got {depth}")
        blocks = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.act1 = nn.ReLU(inplace=True)
        layers = []
        in_channels = width
        for stage, channels in enumerate((width, 2 * width, 4 * width)):
            for i in range(blocks):
                stride = 2 if stage > 0 and i == 0 else 1
                layers.append(BasicBlock(in_channels, channels, stride))
                in_channels = channels
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.bn1(self.conv1(x)))
        x = self.pool(self.layers(x))
        return self.fc(torch.flatten(x, 1))


_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG16(nn.Module):
    """CIFAR VGG-16 with BatchNorm (14.7 M parameters)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        in_channels = 3
        for item in _VGG16:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(in_channels, item, 3, padding=1, bias=False), nn.BatchNorm2d(item), nn.ReLU(inplace=True)]
                in_channels = item
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))
