"""The im2col rows K-FAC's factors of an N-d convolution are made of: with the layer's weight as
a matrix they give the convolution itself (torch's), for anisotropic padding, stride and
dilation, groups and a non-zero padding mode, so every factor built from them is that of the
layer's true inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distkfac.layers import ConvNdAdapter, adapter_for

CONVS = {
    "conv1d": lambda: nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2),
    "conv3d": lambda: nn.Conv3d(4, 6, (1, 2, 3), stride=(1, 2, 1), padding=(0, 1, 2),
                                dilation=(1, 1, 2), groups=2),
    "conv3d-circular": lambda: nn.Conv3d(2, 3, (3, 1, 2), padding=(1, 0, 2),
                                         padding_mode="circular"),
    "conv3d-same": lambda: nn.Conv3d(2, 3, (2, 3, 4), padding="same", bias=False),
}


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("name", sorted(CONVS))
def test_nd_im2col_rows_times_the_weight_are_the_convolution(name: str) -> None:
    torch.manual_seed(0)
    conv = CONVS[name]().double()
    spatial = len(conv.kernel_size)
    x = torch.randn((2, conv.in_channels) + (5, 7, 6)[3 - spatial:], dtype=torch.float64)
    adapter = adapter_for(conv, name)
    assert isinstance(adapter, ConvNdAdapter)
    rows = adapter.patches(x)  # (groups, N·positions, C/g · prod(kernel))
    g = conv.groups
    w = conv.weight.detach().reshape(g, conv.out_channels // g, -1)
    y = conv(x).detach()
    if conv.bias is not None:
        y = y - conv.bias.detach().view(1, -1, *([1] * spatial))
    # (groups, rows, F/g) -> (N, *out, F) -> (N, F, *out)
    got = (rows @ w.transpose(1, 2)).transpose(0, 1).reshape(
        y.shape[0], *y.shape[2:], conv.out_channels).movedim(-1, 1)
    assert got.shape == y.shape
    assert (got - y).abs().max() < 1e-12
