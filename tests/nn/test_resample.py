"""Interpolation of spatially split activations (``DistUpsample``: ``nn.Upsample`` /
``F.interpolate`` in place) equals torch's on the global tensor (fp64: the output, bitwise for the
``nearest`` modes, and the input gradient) for every mode with a bounded window, ``size`` or
``scale_factor`` (fractional, down and up), ``align_corners`` and ``recompute_scale_factor``;
it moves halo rows only, the bytes its price states."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.nn.resample import DistUpsample, upsample_halo_bytes
from distconv.redistribute import gather
from distconv.testing import run_threads
from tests.nn.layer_strategies import spatial_layouts

TOL = 1e-12
SPATIAL = {"nearest": (1, 2, 3), "nearest-exact": (1, 2, 3), "area": (1, 2, 3), "linear": (1,),
           "bilinear": (2,), "trilinear": (3,), "bicubic": (2,)}
FACTORS = (0.4, 0.5, 0.7, 0.75, 1.0, 1.3, 4 / 3, 1.5, 1.7, 2.0, 2.5, 3.0)


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    mode = draw(st.sampled_from(sorted(SPATIAL)))
    dims = draw(st.sampled_from(SPATIAL[mode]))
    names = ("D", "H", "W")[3 - dims:]
    layout = draw(spatial_layouts(dims, 4, 4))
    sizes = tuple(draw(st.integers(2, 9 if dims < 3 else 5)) for _ in range(dims))
    kw: dict[str, Any] = {"mode": mode}
    if draw(st.booleans()):
        kw["size"] = tuple(draw(st.integers(1, 13 if dims < 3 else 7)) for _ in range(dims))
    else:
        kw["scale_factor"] = tuple(draw(st.sampled_from(FACTORS) | st.floats(0.3, 3.5))
                                   for _ in range(dims))
        kw["recompute_scale_factor"] = draw(st.sampled_from([None, False, True]))
    if mode not in ("nearest", "nearest-exact", "area"):
        kw["align_corners"] = draw(st.booleans())
    ext = dict(layout)
    shape = (draw(st.integers(ext["N"], ext["N"] + 1)), draw(st.integers(1, 2)), *sizes)
    try:
        out = F.interpolate(torch.zeros(shape, dtype=torch.float64), **kw).shape[2:]
    except (RuntimeError, ValueError):
        assume(False)  # only what torch accepts
    assume(min(out) >= 1)  # area makes empty outputs, whose gradient torch refuses
    # every rank owns at least one input and one output row of each split dim
    assume(all(ext[n] <= min(sizes[i], out[i]) for i, n in enumerate(names) if n in ext))
    entries = ("N", None, *(n if n in ext else None for n in names))
    return kw, tuple(layout), Dist(entries), shape, draw(st.integers(0, 2**16))


def _interpolated(comm: Any, kw: dict, layout: tuple, dist: Dist, x: torch.Tensor,
                  g: torch.Tensor) -> dict:
    grid = ProcessorGrid(dict(layout), comm=comm)
    layer = DistUpsample(grid=grid, input_dist=dist, **kw)
    shape = tuple(x.shape)
    xl = x[dist.local_slices(shape, grid)].clone().requires_grad_(True)
    calls, moved = dict(comm.stats.calls), comm.stats.total_bytes()
    y = layer(xl, shape)
    y_shape = layer.output_shape(shape)
    y.backward(g[dist.local_slices(y_shape, grid)])
    ops = {op for op, n in comm.stats.calls.items() if n != calls.get(op, 0)}
    moved = comm.stats.total_bytes() - moved
    found = layer.plans(shape)
    priced = 0 if found is None else sum(f + b for _, f, b in upsample_halo_bytes(
        layer._dims, found[1], xl.shape, grid.coords, x.element_size()))
    return {"y": gather(y.detach(), dist, grid, y_shape), "dx": gather(xl.grad, dist, grid, shape),
            "ops": ops, "moved": moved, "priced": priced,
            "in_place": found is not None,
            "windowed": [v is not None for v in layer._offsets.values()]}


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(cases())
def test_interpolation_of_split_rows_equals_one_process(case: tuple) -> None:
    kw, layout, dist, shape, seed = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    y = F.interpolate(x, **kw)
    g = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    y.backward(g)
    exact = kw["mode"] in ("nearest", "nearest-exact")
    for got in run_threads(_interpolated, math.prod(e for _, e in layout), kw, layout, dist,
                           x.detach(), g):
        tol = 0 if exact else TOL
        torch.testing.assert_close(got["y"], y.detach(), rtol=0, atol=tol)
        torch.testing.assert_close(got["dx"], x.grad, rtol=0, atol=TOL)
        if got["in_place"]:
            assert got["ops"] <= {"alltoall"}, got["ops"]  # halos only: nothing made whole
            assert got["moved"] == got["priced"]
        else:  # torch's gradient is not its interpolation's adjoint: torch's on whole rows
            assert "allgather" in got["ops"], got["ops"]


def _explained_layer(interp: dict, config: dict, shape: tuple[int, ...]) -> Any:
    from distconv.ops.base import SampleNet
    from distconv.ops.resample import _Interpolate
    from distconv.parallel.explain import explain

    plan = explain(SampleNet(_Interpolate(**interp), shape[1]), config, shape,
                   world_size=math.prod(config["default"]["grid"].values()), itemsize=8)
    return next(layer for layer in plan.layers if layer.kind == "resample")


@pytest.mark.parametrize("interp", [
    {"size": (10, 13), "mode": "bilinear", "align_corners": True},
    {"size": (3, 4), "mode": "area"},
    {"scale_factor": (1.5, 0.75), "mode": "nearest"},
    {"size": (5, 11), "mode": "nearest-exact"},
    {"scale_factor": 1.7, "mode": "bicubic", "align_corners": False},
], ids=["bilinear-size", "area-down", "nearest-fraction", "nearest-exact-down", "bicubic-fraction"])
def test_interpolation_of_split_rows_is_priced_as_a_halo_exchange(interp: dict) -> None:
    config = {"default": {"grid": {"H": 2, "W": 2}, "algorithm": "spatial"},
              "data": {"H": 2, "W": 2}}
    layer = _explained_layer(interp, config, (2, 2, 7, 8))
    halos = {"halo exchange H", "halo exchange W", "halo accumulate W", "halo accumulate H"}
    assert layer.steps and {s.what for s in layer.steps} <= halos  # no conversion of the input
    assert all(s.op == "alltoall" for s in layer.steps)


def test_antialiased_interpolation_makes_the_rows_whole() -> None:
    config = {"default": {"grid": {"N": 1, "H": 2}, "algorithm": "spatial"},
              "data": {"N": 1, "H": 2}}
    layer = _explained_layer({"scale_factor": 0.5, "mode": "bilinear", "antialias": True},
                             config, (2, 2, 8, 8))
    assert not any("halo" in s.what for s in layer.steps)


def _world() -> ProcessorGrid:
    from distconv.comm import SingleCommunicator

    return ProcessorGrid({"N": 1}, comm=SingleCommunicator())


@pytest.mark.parametrize("kw,match", [
    ({"size": 4, "mode": "lanczos"}, "mode must be one of"),
    ({"size": 4, "mode": "trilinear"}, "interpolates 3 spatial dims"),
    ({"mode": "nearest"}, "exactly one of size and scale_factor"),
    ({"size": 4, "scale_factor": 2, "mode": "nearest"}, "exactly one of size and scale_factor"),
    ({"size": 4, "mode": "nearest", "align_corners": True}, "align_corners"),
    ({"size": 4, "mode": "bilinear", "recompute_scale_factor": True}, "recompute_scale_factor"),
    ({"scale_factor": (2, 2, 2), "mode": "nearest"}, "scale_factor must have 2 entries"),
    ({"scale_factor": -1.0, "mode": "nearest"}, "scale_factor must be positive"),
    ({"size": (0, 3), "mode": "nearest"}, "size must be positive"),
])
def test_bad_arguments_raise_naming_them(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DistUpsample(grid=_world(), input_dist=Dist((None,) * 4), **kw)


def test_size_must_be_ints() -> None:
    with pytest.raises(TypeError, match="size must be ints"):
        DistUpsample(grid=_world(), input_dist=Dist((None,) * 4), size=(2.5, 3), mode="nearest")


def test_a_dim_shorter_than_its_grid_dim_runs_on_whole_rows() -> None:
    """Three ranks over H, two output rows: a rank owns none, so the layer gathers the rows and
    runs torch (a rank's block of the output is empty), still one process's."""
    kw = {"mode": "bilinear", "size": (2, 5)}
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    y = F.interpolate(x, **kw)
    g = torch.randn(y.shape, dtype=torch.float64)
    y.backward(g)
    for got in run_threads(_interpolated, 3, kw, (("H", 3),), Dist((None, None, "H", None)),
                           x.detach(), g):
        assert not got["in_place"] and "allgather" in got["ops"]
        torch.testing.assert_close(got["y"], y.detach(), rtol=0, atol=TOL)
        torch.testing.assert_close(got["dx"], x.grad, rtol=0, atol=TOL)


def test_where_torchs_gradient_is_not_its_adjoint_torch_runs_on_whole_rows() -> None:
    """Torch's backward copies a 1-d nearest dim whose size the factor keeps, its forward does
    not: the layer makes the rows whole and runs torch, so both still equal one process."""
    kw = {"mode": "nearest", "scale_factor": 1.3}
    dist = Dist(("N", None, "W"))
    x = torch.randn(2, 2, 3, dtype=torch.float64, requires_grad=True)
    y = F.interpolate(x, **kw)
    g = torch.randn(y.shape, dtype=torch.float64)
    y.backward(g)
    for got in run_threads(_interpolated, 2, kw, (("N", 1), ("W", 2)), dist, x.detach(), g):
        assert not got["in_place"] and "allgather" in got["ops"]
        torch.testing.assert_close(got["y"], y.detach(), rtol=0, atol=0)
        torch.testing.assert_close(got["dx"], x.grad, rtol=0, atol=TOL)


@pytest.mark.parametrize("kw,windowed", [
    ({"mode": "bilinear", "scale_factor": 2, "align_corners": False}, True),
    ({"mode": "nearest", "scale_factor": (3, 2)}, True),
    ({"mode": "bicubic", "scale_factor": 2, "align_corners": False}, True),
    ({"mode": "bilinear", "scale_factor": 2, "align_corners": True}, False),
    ({"mode": "nearest", "scale_factor": 1.5}, False),
])
def test_integer_factors_run_torchs_kernel_on_the_window(kw: dict, windowed: bool) -> None:
    """Where the map commutes with a shift by whole rows, each rank runs torch's own kernel on
    its window (the faster path); elsewhere it applies the map, both equal to one process."""
    dist = Dist((None, None, "H", None))
    x = torch.randn(2, 2, 7, 5, dtype=torch.float64, requires_grad=True)
    y = F.interpolate(x, **kw)
    g = torch.randn(y.shape, dtype=torch.float64)
    y.backward(g)
    for got in run_threads(_interpolated, 2, kw, (("H", 2),), dist, x.detach(), g):
        assert got["windowed"] == [windowed]
        torch.testing.assert_close(got["y"], y.detach(), rtol=0, atol=TOL)
        torch.testing.assert_close(got["dx"], x.grad, rtol=0, atol=TOL)
