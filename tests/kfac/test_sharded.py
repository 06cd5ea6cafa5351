"""K-FAC of DistConv2d layers: ``'exact'`` equals single-process K-FAC on the gathered layer,
``'block'`` equals a dense block-diagonal reference, and the traffic equals the documented
formulas.

Loop under test (the contract of parallelized models): each rank's loss is the sum of its
samples' losses over the global batch N; DistConv2d completes the weight gradients itself.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import distkfac
from distconv.grid import ProcessorGrid
from distconv.nn import DistConv2d
from distconv.testing.threads import run_threads

from .reference import dense_precondition, reference_factors

SHAPE = (4, 5, 6, 5)  # global input (N, C, H, W): uneven channel blocks on 2 and 3 ranks


def global_data(step: int, y_shape, shape=SHAPE):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    return x, torch.randn(y_shape, generator=g, dtype=torch.float64)


def make_conv(conv_kw: dict, fo: int = 5) -> nn.Conv2d:
    """The same layer on every thread rank (a generator of its own, not torch's global one)."""
    conv = nn.Conv2d(SHAPE[1], fo, **conv_kw).double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return conv


def loss_of(y: torch.Tensor, t: torch.Tensor, n: int) -> torch.Tensor:
    return (torch.tanh(y) * t).sum() / n


def sharded_run(comm, grid_dims, algorithm, conv_kw, kfac_kw, steps):
    grid = ProcessorGrid(grid_dims, comm=comm)
    conv = make_conv(conv_kw)
    layer = DistConv2d.from_conv2d(conv, grid=grid, algorithm=algorithm)
    kfac = distkfac.KFAC(layer, factor_dtype=torch.float64, **kfac_kw)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for step in range(steps):
        y_shape = layer.output_shape(SHAPE)
        x, t = global_data(step, y_shape)
        opt.zero_grad()
        y = layer(x[layer.input_dist.local_slices(SHAPE, grid)], SHAPE)
        loss_of(y, t[layer.output_dist.local_slices(y_shape, grid)], SHAPE[0]).backward()
        comm.stats.reset()
        kfac.step()
        traffic = comm.stats.snapshot()
        if step < steps - 1:
            opt.step()
    w_idx = layer.weight_dist.local_slices(layer.weight_shape, grid)
    b_idx = layer.bias_dist.local_slices((layer.out_channels,), grid)
    return (w_idx, b_idx, layer.weight.grad.clone(),
            None if layer.bias is None else layer.bias.grad.clone(), traffic, kfac)


def single_run(conv_kw, kfac_kw, steps):
    conv = make_conv(conv_kw)
    kfac = distkfac.KFAC(conv, factor_dtype=torch.float64, comm=None, **kfac_kw)
    opt = torch.optim.SGD(conv.parameters(), lr=0.1)
    for step in range(steps):
        x, t = global_data(step, conv(torch.zeros(SHAPE, dtype=torch.float64)).shape)
        opt.zero_grad()
        loss_of(conv(x), t, SHAPE[0]).backward()
        kfac.step()
        if step < steps - 1:
            opt.step()
    return conv


def assert_exact(results, ref):
    for w_idx, b_idx, wg, bg, *_ in results:
        torch.testing.assert_close(wg, ref.weight.grad[w_idx], rtol=1e-10, atol=1e-12)
        if bg is not None:
            torch.testing.assert_close(bg, ref.bias.grad[b_idx], rtol=1e-10, atol=1e-12)


EXACT_CASES = [
    ({"N": 2, "C": 2}, "stationary-x", dict(kernel_size=3, padding=1)),
    ({"C": 3}, "stationary-x", dict(kernel_size=(2, 3), stride=(1, 2), bias=False)),
    ({"F": 3}, "stationary-y", dict(kernel_size=3, padding=1)),
    ({"N": 2, "F": 2}, "stationary-y", dict(kernel_size=1)),
    ({"C": 2, "F": 2}, "stationary-w", dict(kernel_size=3, padding=1)),
    ({"H": 2, "C": 2}, "stationary-x", dict(kernel_size=3, padding=1, dilation=(1, 2))),
    ({"N": 2, "W": 2}, "stationary-x", dict(kernel_size=3, padding=1)),
]


@pytest.mark.parametrize("grid_dims, algorithm, conv_kw", EXACT_CASES)
def test_exact_equals_single_process_kfac_on_gathered_layer(grid_dims, algorithm, conv_kw):
    kw = dict(kl_clip=1e-2, damping=1e-2, factor_decay=0.7)
    ref = single_run(conv_kw, kw, steps=2)
    size = 1
    for e in grid_dims.values():
        size *= e
    assert_exact(run_threads(sharded_run, size, grid_dims, algorithm, conv_kw, kw, 2), ref)
