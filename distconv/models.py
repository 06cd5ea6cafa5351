"""Small ResNet and wide-ResNet builders (bottleneck blocks), traceable by ``torch.fx``.

The networks of the paper's experiments in miniature, for examples, tests and benchmarks:
a stem (conv, BN, ReLU, max-pool), stages of bottleneck blocks (1×1 reduce, 3×3, 1×1 expand, each
with BN; a projection shortcut where the shape changes; residual add, ReLU), global average
pooling and a linear head. Module names follow torchvision's (``layer1.0.conv2``), so configs
written for those models read the same here.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

__all__ = ["Bottleneck", "ResNet", "resnet_mini", "wide_resnet_mini"]


class Bottleneck(nn.Module):
    """``x -> relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))) + shortcut(x))``."""

    def __init__(self, in_channels: int, width: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """A bottleneck ResNet: stem, ``len(blocks)`` stages, global average pool, linear head.

    Args:
        blocks: bottleneck blocks per stage.
        widths: bottleneck width per stage (the 3×3 conv's channels).
        expansion: output channels = ``expansion * width``. Default 4 (ResNet-50's).
        stem: stem conv channels. Default ``widths[0]``.
        in_channels: input image channels. Default 3.
        num_classes: classes of the head. Default 10.
        stem_stride: stride of the stem conv (its max-pool has stride 2 as well). Default 2.
    """

    def __init__(self, blocks: Sequence[int], widths: Sequence[int], *, expansion: int = 4,
                 stem: int | None = None, in_channels: int = 3, num_classes: int = 10,
                 stem_stride: int = 2) -> None:
        super().__init__()
        if len(blocks) != len(widths) or not blocks:
            raise ValueError(f"blocks and widths must be non-empty and of equal length, got "
                             f"{list(blocks)} and {list(widths)}")
        stem = stem or widths[0]
        self.conv1 = nn.Conv2d(in_channels, stem, 3, stride=stem_stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(stem)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        channels = stem
        for i, (n, width) in enumerate(zip(blocks, widths)):
            stage = []
            for j in range(n):
                stride = 2 if i > 0 and j == 0 else 1
                stage.append(Bottleneck(channels, width, expansion * width, stride))
                channels = expansion * width
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
        self.stages = len(blocks)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(self.stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet_mini(*, num_classes: int = 10, in_channels: int = 3, base: int = 8) -> ResNet:
    """A 3-stage bottleneck ResNet (one block per stage): the shape of ResNet-50, small."""
    return ResNet([1, 1, 1], [base, 2 * base, 4 * base], stem=2 * base, in_channels=in_channels,
                  num_classes=num_classes)


def wide_resnet_mini(*, num_classes: int = 10, in_channels: int = 3, base: int = 8,
                     widen: int = 2, blocks: Sequence[int] = (1, 1, 1)) -> ResNet:
    """A wide bottleneck ResNet (WRN-50-k style: bottleneck width ``widen`` times ResNet's,
    expansion 2)."""
    widths = [widen * base * 2 ** i for i in range(len(blocks))]
    return ResNet(list(blocks), widths, expansion=2, stem=2 * base, in_channels=in_channels,
                  num_classes=num_classes)
