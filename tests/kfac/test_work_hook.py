"""DistConv2d's work hook: the local convolution's input, padding and output, as distkfac reads
them (the input gives A, the output's gradient G)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distconv.grid import ProcessorGrid
from distconv.nn import DistConv2d
from distconv.testing.threads import run_threads


def _seen(comm, grid_dims, algorithm, padding_mode):
    grid = ProcessorGrid(grid_dims, comm=comm)
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 4, 3, padding=1, padding_mode=padding_mode).double()
    layer = DistConv2d.from_conv2d(conv, grid=grid, algorithm=algorithm)
    shape = (2, 4, 5, 4)
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    seen = []
    layer.work_hook = lambda m, xw, pad, y, y_shape: seen.append((xw, pad, y, y_shape))
    layer(x[layer.input_dist.local_slices(shape, grid)], shape)
    (xw, pad, y, y_shape) = seen[0]
    again = F.conv2d(F.pad(xw, pad), layer.weight.detach(), None, layer.stride, 0,
                     layer.dilation, layer._local_groups)
    if not layer._reduce_y:  # the bias is added inside the local convolution
        again = again + layer.bias.detach().view(1, -1, 1, 1)
    return bool(torch.allclose(again, y.detach(), rtol=1e-12, atol=1e-12)), y_shape


def test_work_hook_sees_the_local_convolution():
    for dims, alg, mode in [({"N": 2}, "stationary-x", "reflect"),
                            ({"N": 2}, "stationary-x", "zeros"),
                            ({"C": 2}, "stationary-x", "zeros"),
                            ({"H": 2}, "stationary-x", "zeros"),
                            ({"F": 2}, "stationary-y", "zeros")]:
        for ok, y_shape in run_threads(_seen, 2, dims, alg, mode):
            assert ok, (dims, alg, mode)
            assert y_shape[1:] == (4, 5, 4)
