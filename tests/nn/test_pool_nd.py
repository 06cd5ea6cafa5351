"""Max and average pooling of signals and volumes (``MaxPool1d/3d``, ``AvgPool1d/3d``) split over
their spatial dims equal torch's on the global tensor (fp64: output and input gradient), for
every kernel, stride, padding, dilation, ceil_mode, count_include_pad and divisor_override."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.nn.pool import POOLS
from distconv.redistribute import gather
from distconv.testing import run_threads
from tests.nn.layer_strategies import spatial_layouts
from tests.parallel.cases import TOL

PLAIN = {("max", 1): nn.MaxPool1d, ("max", 3): nn.MaxPool3d, ("avg", 1): nn.AvgPool1d,
         ("avg", 3): nn.AvgPool3d}


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    kind, dims = draw(st.sampled_from(sorted(PLAIN)))
    names = ("D", "H", "W")[3 - dims:]
    layout = draw(spatial_layouts(dims, 3, 8))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    options: dict[str, Any] = {
        "kernel_size": kernel,
        "stride": tuple(draw(st.integers(1, 3)) for _ in range(dims)),
        "padding": tuple(draw(st.integers(0, k // 2)) for k in kernel),
        "ceil_mode": draw(st.booleans()),
    }
    if kind == "max":
        options["dilation"] = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    else:
        options["count_include_pad"] = draw(st.booleans())
        if dims == 3:
            options["divisor_override"] = draw(st.sampled_from([None, None, 3]))
    sizes = tuple(draw(st.integers(1, 8 if dims == 1 else 6)) for _ in range(dims))
    ext = dict(layout)
    shape = (draw(st.integers(ext["N"], ext["N"] + 2)), draw(st.integers(1, 3)), *sizes)
    module = PLAIN[(kind, dims)](**options)
    try:  # only what torch accepts (an output of at least one row)
        out = module(torch.zeros(shape, dtype=torch.float64)).shape[2:]
    except RuntimeError:
        assume(False)
    if kind == "max":  # a dilated window of padding only: torch's gradient leaves the window
        for i in range(dims):
            k, s, p, d = (options[a][i] for a in ("kernel_size", "stride", "padding",
                                                   "dilation"))
            assume(all(any(0 <= o * s - p + j * d < sizes[i] for j in range(k))
                       for o in range(out[i])))
    entries = ("N", None, *(n if n in ext else None for n in names))
    return module, tuple(layout), Dist(entries), shape, draw(st.integers(0, 2**16))


def _pooled(comm: Any, module: nn.Module, layout: tuple, dist: Dist, x: torch.Tensor,
            g: torch.Tensor) -> dict:
    grid = ProcessorGrid(dict(layout), comm=comm)
    layer = POOLS[type(module)].from_plain(module, grid=grid, input_dist=dist)
    shape = tuple(x.shape)
    xl = x[dist.local_slices(shape, grid)].clone().requires_grad_(True)
    y = layer(xl, shape)
    y_shape = layer.output_shape(shape)
    y.backward(g[dist.local_slices(y_shape, grid)])
    return {"y": gather(y.detach(), dist, grid, y_shape), "dx": gather(xl.grad, dist, grid, shape)}


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(cases())
def test_pooling_of_split_signals_and_volumes_equals_one_process(case: tuple) -> None:
    module, layout, dist, shape, seed = case
    gen = torch.Generator().manual_seed(seed)
    # distinct values: max pooling's ties would make its gradient depend on the order of reads
    x = torch.randperm(math.prod(shape), generator=gen).reshape(shape).double()
    x.requires_grad_(True)
    y = module(x)
    g = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    y.backward(g)
    for got in run_threads(_pooled, math.prod(e for _, e in layout), module, layout, dist,
                           x.detach(), g):
        torch.testing.assert_close(got["y"], y.detach(), rtol=TOL, atol=TOL)
        torch.testing.assert_close(got["dx"], x.grad, rtol=TOL, atol=TOL)


def test_a_distributed_pool_is_the_torch_module_for_isinstance_and_back() -> None:
    from distconv.comm import SingleCommunicator

    grid = ProcessorGrid({"N": 1}, comm=SingleCommunicator())
    for plain, cls in POOLS.items():
        assert issubclass(cls, plain) and cls.__name__ == f"Dist{plain.__name__}"
        assert not any(issubclass(cls, other) for other in POOLS if other is not plain)
        dims = cls._dims
        module = plain(3, 2, 1, ceil_mode=True)
        layer = cls.from_plain(module, grid=grid, input_dist=Dist((None,) * (2 + dims)))
        back = layer.to_plain()
        x = torch.randn(2, 3, *(7,) * dims, dtype=torch.float64)
        assert type(back) is plain
        torch.testing.assert_close(back(x), module(x), rtol=0, atol=0)
        torch.testing.assert_close(layer(x, x.shape), module(x), rtol=0, atol=0)
