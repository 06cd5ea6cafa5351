"""Small networks, traceable by ``torch.fx``, for examples, tests and benchmarks.

- ResNet and wide-ResNet builders (bottleneck blocks): the networks of the paper's experiments in
  miniature: a stem (conv, BN, ReLU, max-pool), stages of bottleneck blocks (1×1 reduce, 3×3, 1×1
  expand, each with BN; a projection shortcut where the shape changes; residual add, ReLU),
  global average pooling and a linear head. Module names follow torchvision's
  (``layer1.0.conv2``), so configs written for those models read the same here.
- :func:`resnet18_mini`: ResNet-18's layout (basic blocks of two 3×3 convolutions) at
  CIFAR-sized widths, without the max-pool.
- :func:`unet2d` and :func:`unet3d`: U-Nets for segmentation (encoder blocks, max-pooling, a
  decoder of transposed convolutions or upsampling, skip connections concatenated).
- :func:`cosmoflow_mini`: a CosmoFlow-style 3-D CNN regressing parameters of a volume.
- :func:`se_resnet_mini`: basic residual blocks with squeeze-and-excitation gates.
- :func:`mobilenet_mini`: depthwise-separable blocks (MobileNet style).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

__all__ = ["BasicBlock", "BasicResNet", "Bottleneck", "CosmoFlow", "ResNet", "SEBlock", "UNet",
           "cosmoflow_mini", "mobilenet_mini", "resnet18_mini", "resnet_mini", "se_resnet_mini",
           "unet2d", "unet3d", "wide_resnet_mini"]


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


# ============================================================================ U-Nets
_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_UP = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
_POOL = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}
_BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
NORMS = ("batch", "group", "instance", "none")


def _norm(kind: str, channels: int, dims: int) -> nn.Module:
    if kind == "batch":
        return _BN[dims](channels)
    if kind == "group":
        return nn.GroupNorm(2 if channels % 2 == 0 else 1, channels)
    if kind == "instance":
        return {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[dims](
            channels, affine=True)
    return nn.Identity()


def _check(name: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class DoubleConv(nn.Sequential):
    """(conv 3, norm, ReLU) twice: a U-Net level."""

    def __init__(self, cin: int, cout: int, dims: int, norm: str) -> None:
        conv = _CONV[dims]
        super().__init__(conv(cin, cout, 3, padding=1, bias=norm == "none"),
                         _norm(norm, cout, dims), nn.ReLU(),
                         conv(cout, cout, 3, padding=1, bias=norm == "none"),
                         _norm(norm, cout, dims), nn.ReLU())


class UNet(nn.Module):
    """A U-Net over ``dims`` (2 or 3) spatial dims: ``depth`` encoder levels of :class:`DoubleConv`
    and 2× max-pooling (channels ``base``, ``2·base``, ...), a bottom level, and a decoder whose
    every level doubles the resolution (``up="transpose"``: a transposed convolution, kernel and
    stride 2; ``up="upsample"``: (bi/tri)linear upsampling and a 1×1 convolution), concatenates
    the encoder's output of the same resolution (``torch.cat`` of the skip connection) and runs a
    :class:`DoubleConv`; a 1×1 convolution gives ``num_classes`` scores per position. The input's
    spatial sizes must be multiples of ``2**depth``."""

    def __init__(self, *, dims: int = 2, in_channels: int = 3, num_classes: int = 2,
                 base: int = 8, depth: int = 2, norm: str = "batch",
                 up: str = "transpose") -> None:
        super().__init__()
        _check("dims", dims, (2, 3))
        _check("norm", norm, NORMS)
        _check("up", up, ("transpose", "upsample"))
        for name, value in (("in_channels", in_channels), ("num_classes", num_classes),
                            ("base", base), ("depth", depth)):
            _positive(name, value)
        self.dims, self.depth, self.norm_kind, self.up_kind = dims, depth, norm, up
        widths = [base * 2 ** i for i in range(depth + 1)]
        self.down = nn.ModuleList()
        cin = in_channels
        for w in widths[:-1]:
            self.down.append(DoubleConv(cin, w, dims, norm))
            cin = w
        self.pool = _POOL[dims](2)
        self.bottom = DoubleConv(widths[-2], widths[-1], dims, norm)
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        mode = {2: "bilinear", 3: "trilinear"}[dims]
        for w_in, w_out in zip(widths[:0:-1], widths[-2::-1]):
            if up == "transpose":
                self.up.append(_UP[dims](w_in, w_out, 2, stride=2))
            else:
                self.up.append(nn.Sequential(nn.Upsample(scale_factor=2, mode=mode),
                                             _CONV[dims](w_in, w_out, 1)))
            self.dec.append(DoubleConv(2 * w_out, w_out, dims, norm))
        self.head = _CONV[dims](widths[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottom(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([skip, up(x)], 1))
        return self.head(x)

    def extra_repr(self) -> str:
        return (f"dims={self.dims}, depth={self.depth}, norm={self.norm_kind!r}, "
                f"up={self.up_kind!r}")


def unet2d(*, in_channels: int = 3, num_classes: int = 2, base: int = 8, depth: int = 2,
           norm: str = "batch", up: str = "transpose") -> UNet:
    """A 2-D U-Net (:class:`UNet`): scores ``(N, num_classes, H, W)`` for ``(N, C, H, W)``."""
    return UNet(dims=2, in_channels=in_channels, num_classes=num_classes, base=base,
                depth=depth, norm=norm, up=up)


def unet3d(*, in_channels: int = 1, num_classes: int = 2, base: int = 4, depth: int = 2,
           norm: str = "group", up: str = "transpose") -> UNet:
    """A 3-D U-Net (:class:`UNet`): scores ``(N, num_classes, D, H, W)`` for a volume."""
    return UNet(dims=3, in_channels=in_channels, num_classes=num_classes, base=base,
                depth=depth, norm=norm, up=up)


# ============================================================================ CosmoFlow
class CosmoFlow(nn.Module):
    """A CosmoFlow-style 3-D CNN: ``depth`` levels of (Conv3d 3, optional BatchNorm3d, leaky ReLU,
    2× max-pooling) with ``base``, ``2·base``, ... channels, then the flattened features through
    two fully connected layers (leaky ReLU, dropout ``dropout``) to ``outputs`` values (the
    cosmological parameters of the volume). ``size``: the volume's side (a multiple of
    ``2**depth``)."""

    def __init__(self, *, in_channels: int = 4, outputs: int = 4, base: int = 8, depth: int = 3,
                 size: int = 16, hidden: int = 32, batch_norm: bool = True,
                 dropout: float = 0.0) -> None:
        super().__init__()
        for name, value in (("in_channels", in_channels), ("outputs", outputs), ("base", base),
                            ("depth", depth), ("size", size), ("hidden", hidden)):
            _positive(name, value)
        if size % 2 ** depth:
            raise ValueError(f"size must be a multiple of 2**depth = {2 ** depth}, got {size}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        layers: list[nn.Module] = []
        cin = in_channels
        for i in range(depth):
            cout = base * 2 ** i
            layers += [nn.Conv3d(cin, cout, 3, padding=1, bias=not batch_norm)]
            layers += [nn.BatchNorm3d(cout)] if batch_norm else []
            layers += [nn.LeakyReLU(0.3), nn.MaxPool3d(2)]
            cin = cout
        self.features = nn.Sequential(*layers)
        flat = cin * (size // 2 ** depth) ** 3
        self.fc1 = nn.Linear(flat, hidden)
        self.act = nn.LeakyReLU(0.3)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.features(x), 1)
        return self.fc2(self.drop(self.act(self.fc1(x))))


def cosmoflow_mini(*, in_channels: int = 4, outputs: int = 4, base: int = 4, depth: int = 2,
                   size: int = 8, hidden: int = 16, batch_norm: bool = True,
                   dropout: float = 0.0) -> CosmoFlow:
    """A small :class:`CosmoFlow` (8³ volumes, two levels)."""
    return CosmoFlow(in_channels=in_channels, outputs=outputs, base=base, depth=depth, size=size,
                     hidden=hidden, batch_norm=batch_norm, dropout=dropout)


# ============================================================================ ResNet-18-style
class BasicBlock(nn.Module):
    """ResNet-18's block: two 3×3 convolutions with BN, ``relu(bn2(conv2(relu(bn1(conv1(x))))) +
    shortcut(x))``, the shortcut a 1×1 projection with BN where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.shortcut = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                       nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.residual(x) + self.shortcut(x))


class BasicResNet(nn.Module):
    """A ResNet-18-style network for small images: a 3×3 stem (conv, BN, ReLU), one stage of
    ``blocks`` :class:`BasicBlock` s per width (``layer1``, ``layer2``, ...; stride 2 from the
    second), global average pooling and a linear head ``fc``."""

    def __init__(self, widths: Sequence[int], *, blocks: int = 2, in_channels: int = 3,
                 num_classes: int = 10) -> None:
        super().__init__()
        for name, value in (("blocks", blocks), ("in_channels", in_channels),
                            ("num_classes", num_classes), *(("widths", w) for w in widths)):
            _positive(name, value)
        if not widths:
            raise ValueError("widths must name at least one stage's channels, got ()")
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        cin = widths[0]
        self.stages = len(widths)
        for i, w in enumerate(widths):
            stage = [BasicBlock(cin, w, 1 if i == 0 else 2)]
            stage += [BasicBlock(w, w) for _ in range(blocks - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
            cin = w
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        for i in range(self.stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18_mini(*, num_classes: int = 10, in_channels: int = 3,
                  widths: Sequence[int] = (32, 64, 128, 256)) -> BasicResNet:
    """ResNet-18's layout (four stages of two :class:`BasicBlock` s) at CIFAR-sized widths."""
    return BasicResNet(widths, blocks=2, in_channels=in_channels, num_classes=num_classes)


# ============================================================================ SE-ResNet
class SEBlock(BasicBlock):
    """A :class:`BasicBlock` whose residual branch is gated per channel by
    squeeze-and-excitation: the channel means through two Linear layers (ReLU, sigmoid),
    broadcast back as ``s[:, :, None, None]``."""

    def __init__(self, cin: int, cout: int, stride: int = 1, reduction: int = 4) -> None:
        super().__init__(cin, cout, stride)
        self.fc1 = nn.Linear(cout, max(1, cout // reduction))
        self.fc2 = nn.Linear(max(1, cout // reduction), cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.residual(x)
        s = torch.sigmoid(self.fc2(self.relu(self.fc1(out.mean((2, 3))))))
        return self.relu(out * s[:, :, None, None] + self.shortcut(x))


def se_resnet_mini(*, num_classes: int = 10, in_channels: int = 3, base: int = 8,
                   stages: int = 2) -> nn.Sequential:
    """A stem (3×3 conv, BN, ReLU), ``stages`` :class:`SEBlock` s (channels ``base`` doubling,
    stride 2 after the first), global average pooling and a linear head."""
    _positive("stages", stages)
    layers: list[nn.Module] = [nn.Conv2d(in_channels, base, 3, padding=1, bias=False),
                               nn.BatchNorm2d(base), nn.ReLU()]
    cin = base
    for i in range(stages):
        cout = base * 2 ** i
        layers.append(SEBlock(cin, cout, stride=1 if i == 0 else 2))
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


# ============================================================================ MobileNet
def _separable(cin: int, cout: int, stride: int) -> nn.Sequential:
    """A depthwise 3×3 convolution (one filter per channel, ``groups=cin``) and a pointwise 1×1
    convolution, each with BN and ReLU6."""
    return nn.Sequential(
        nn.Conv2d(cin, cin, 3, stride=stride, padding=1, groups=cin, bias=False),
        nn.BatchNorm2d(cin), nn.ReLU6(),
        nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU6())


def mobilenet_mini(*, num_classes: int = 10, in_channels: int = 3, base: int = 8,
                   blocks: int = 3) -> nn.Sequential:
    """A MobileNet-style network: a 3×3 stem, ``blocks`` depthwise-separable blocks (channels
    doubling, stride 2 every other block), global average pooling and a linear head."""
    _positive("blocks", blocks)
    layers: list[nn.Module] = [nn.Conv2d(in_channels, base, 3, padding=1, bias=False),
                               nn.BatchNorm2d(base), nn.ReLU6()]
    cin = base
    for i in range(blocks):
        cout = base * 2 ** ((i + 1) // 2)
        layers.append(_separable(cin, cout, 2 if i % 2 else 1))
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)
