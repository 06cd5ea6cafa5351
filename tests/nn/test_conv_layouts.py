"""DistConv2d's distributions as the paper writes them (Dryden et al. SC'19, §3), written down
here rather than read from the layer, and the layer exact when its blocks are cut and gathered
with these written-down distributions (so a wrong layout cannot pass by moving together with the
layer's own ``output_dist`` and the performance model)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distconv import Dist, ProcessorGrid, gather
from distconv.nn import DistConv2d
from distconv.testing import run_threads

# algorithm, grid, x, w, b, y (major-first tuples: the paper's x[o,o_{F×C},o,o] is o_{C×F} here)
LAYOUTS = [
    ("stationary-x", {"N": 2, "C": 2},
     "x[o,o_C,o,o]", "w[*,o_C,*,*]", "b[o_C]", "y[o,o_C,o,o]"),
    ("stationary-y", {"N": 2, "F": 2},
     "x[o,o_F,o,o]", "w[o_F,*,*,*]", "b[o_F]", "y[o,o_F,o,o]"),
    ("stationary-w", {"C": 2, "F": 2},
     "x[o,o_{C×F},o,o]", "w[o_F,o_C,*,*]", "b[o_{F×C}]", "y[o,o_{F×C},o,o]"),
    ("stationary-x", {"H": 2, "C": 2},
     "x[o,o_C,o,o]", "w[*,o_C,*,*]", "b[o_C]", "y[o,o_C,o,o]"),
    ("stationary-y", {"W": 2, "F": 2},
     "x[o,o_F,o,o]", "w[o_F,*,*,*]", "b[o_F]", "y[o,o_F,o,o]"),
]
SHAPE = (3, 5, 7, 6)  # uneven blocks on every split dim
OUT = 6


def _reference():
    g = torch.Generator().manual_seed(0)
    conv = nn.Conv2d(SHAPE[1], OUT, 3, padding=1, dtype=torch.float64)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g, dtype=torch.float64))
        conv.bias.copy_(torch.randn(OUT, generator=g, dtype=torch.float64))
    x = torch.randn(SHAPE, generator=g, dtype=torch.float64, requires_grad=True)
    y = conv(x)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    y.backward(dy)
    return conv, x.detach(), dy, {"y": y.detach(), "dx": x.grad, "dw": conv.weight.grad,
                                  "db": conv.bias.grad}


def _run(comm, algorithm, dims, specs):
    conv, x, dy, _ = _reference()
    grid = ProcessorGrid(dims, comm=comm)
    layer = DistConv2d.from_conv2d(conv, grid=grid, algorithm=algorithm)
    dx_, dw_, db_, dy_ = (Dist.parse(s, t) for s, t in zip(specs, ("NCHW", "FCHW", "F", "NCHW")))
    got_specs = (layer.input_dist.format("x"), layer.weight_dist.format("w"),
                 layer.bias_dist.format("b"), layer.output_dist.format("y"))
    xl = x[dx_.local_slices(SHAPE, grid)].clone().requires_grad_(True)
    y = layer(xl, global_shape=SHAPE)
    y_shape = (SHAPE[0], OUT, SHAPE[2], SHAPE[3])
    y.backward(dy[dy_.local_slices(y_shape, grid)])
    return got_specs, {
        "y": gather(y.detach(), dy_, grid, y_shape),
        "dx": gather(xl.grad, dx_, grid, SHAPE),
        "dw": gather(layer.weight.grad, dw_, grid, tuple(conv.weight.shape)),
        "db": gather(layer.bias.grad, db_, grid, (OUT,)),
    }


@pytest.mark.parametrize("algorithm, dims, x, w, b, y", LAYOUTS,
                         ids=[f"{a}-{'x'.join(d)}" for a, d, *_ in LAYOUTS])
def test_layer_states_and_uses_the_papers_distributions(algorithm, dims, x, w, b, y):
    specs = (x, w, b, y)
    *_, want = _reference()
    for got_specs, got in run_threads(_run, 4, algorithm, dims, specs):
        assert got_specs == specs
        for key, value in got.items():
            torch.testing.assert_close(value, want[key], rtol=0, atol=1e-10, msg=key)
