"""Distributed pooling equals torch's on the global tensor: max and average pooling with spatial
halos (every kernel, stride, padding, dilation, ceil_mode, count_include_pad, divisor_override),
and global average pooling as a pending sum over the spatial grid dims."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

from distconv.comm import SingleCommunicator
from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.nn import DistAdaptiveAvgPool2d, DistAvgPool2d, DistMaxPool2d
from distconv.nn.pool import from_function, from_module
from distconv.testing import run_threads
from tests.nn.layer_cases import (
    REPRESENTATIVE, LayerCase, check_results, reference, run_case, run_representative, torch_layer,
)
from tests.nn.layer_strategies import activation_entries, grids

RELAXED = [HealthCheck.too_slow, HealthCheck.filter_too_much]


@st.composite
def pool_cases(draw: st.DrawFn, kind: str, dtype: torch.dtype = torch.float64) -> LayerCase:
    layout = draw(grids())
    entries = draw(activation_entries(layout))
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 8)),
             draw(st.integers(1, 8)))
    options: dict = {}
    if kind != "adaptive":
        kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
        options = {
            "kernel_size": kernel,
            "stride": draw(st.one_of(st.none(), st.tuples(st.integers(1, 3), st.integers(1, 3)))),
            "padding": (draw(st.integers(0, kernel[0] // 2)),
                        draw(st.integers(0, kernel[1] // 2))),
            "ceil_mode": draw(st.booleans()),
        }
        if kind == "max":
            options["dilation"] = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
        else:
            options["count_include_pad"] = draw(st.booleans())
            options["divisor_override"] = draw(st.one_of(st.none(), st.none(),
                                                         st.integers(1, 5)))
    case = LayerCase(kind, layout, entries, shape, options, dtype, draw(st.integers(0, 2**16)))
    try:  # only what torch accepts (e.g. an output of at least one row)
        y = torch_layer(case)(torch.zeros(shape, dtype=dtype))
    except RuntimeError:
        assume(False)
    if kind == "max":
        assume(_every_window_reads_input(case, y.shape[2:]))
    return case


def _every_window_reads_input(case: LayerCase, out: tuple[int, ...]) -> bool:
    """With dilation, a window may hold only padding: torch then returns -inf and sends the
    gradient to an element outside the window; that corner is left out of the comparison."""
    o = case.options
    for i in range(2):
        k, s, p, d = (o["kernel_size"][i], (o["stride"] or o["kernel_size"])[i],
                      o["padding"][i], o["dilation"][i])
        for row in range(out[i]):
            if not any(0 <= row * s - p + j * d < case.shape[2 + i] for j in range(k)):
                return False
    return True


def _run(case: LayerCase) -> None:
    check_results(case, run_threads(run_case, case.size, case, reference(case)))


@settings(max_examples=50, deadline=None, suppress_health_check=RELAXED)
@given(pool_cases("max"))
def test_dist_maxpool_equals_maxpool_fp64(case: LayerCase) -> None:
    _run(case)


@settings(max_examples=50, deadline=None, suppress_health_check=RELAXED)
@given(pool_cases("avg"))
def test_dist_avgpool_equals_avgpool_fp64(case: LayerCase) -> None:
    _run(case)


@settings(max_examples=30, deadline=None, suppress_health_check=RELAXED)
@given(pool_cases("adaptive"))
def test_dist_global_avgpool_resolved_equals_adaptive_avgpool_fp64(case: LayerCase) -> None:
    _run(case)


@pytest.mark.parametrize("case", [
    # a tuple entry against grid order: blocks of rows in nested order, not in rank order
    LayerCase("max", (("W", 2), ("H", 3)), (None, None, ("H", "W"), None), (1, 2, 9, 3),
              {"kernel_size": 3, "stride": 1, "padding": 1}),
    # ceil_mode: the last window overhangs the padding and is not counted in the divisor
    LayerCase("avg", (("H", 2), ("W", 2)), (None, None, "H", "W"), (1, 2, 6, 7),
              {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True}),
    # more ranks than output rows: empty blocks still take part in the halo exchange
    LayerCase("max", (("H", 4),), (None, None, "H", None), (2, 1, 5, 2),
              {"kernel_size": 2, "ceil_mode": True}),
    LayerCase("avg", (("H", 2), ("N", 2)), (None, None, "H", None), (2, 3, 4, 4),
              {"kernel_size": 2}, torch.float32),
], ids=["nested-tuple-entry", "ceil-overhang", "empty-output-blocks", "fp32-with-replicas"])
def test_fixed_cases(case: LayerCase) -> None:
    _run(case)


# ---------------------------------------------------------------------- distributions and traffic
@pytest.mark.parametrize("grid_dims, spec, expected", [
    ({"C": 2, "H": 2, "W": 2}, "x[o,o_C,o,o]", "Σ_{H,W} y[o,o_C,*,*]"),
    ({"C": 2, "H": 2, "F": 2}, "x[*,o_C,o_{H×F},*]", "Σ_{F,H} y[*,o_C,*,*]"),
    ({"N": 2, "C": 4}, "x[o,o_C,*,*]", "y[o,o_C,*,*]"),
])
def test_global_avgpool_output_is_a_pending_sum_over_the_spatial_grid_dims(
    grid_dims, spec, expected,  # noqa: ANN001
) -> None:
    def build(comm):  # noqa: ANN001, ANN202
        grid = ProcessorGrid(grid_dims, comm=comm)
        return DistAdaptiveAvgPool2d(grid=grid, input_dist=Dist.parse(spec, "NCHW")).output_dist

    for dist in run_threads(build, _size(grid_dims)):
        assert dist == Dist.parse(expected, "NCHW")


def _size(grid_dims: dict[str, int]) -> int:
    out = 1
    for e in grid_dims.values():
        out *= e
    return out


def _traffic(comm, layer_cls, kwargs, spec, grid_dims, shape):  # noqa: ANN001, ANN202
    grid = ProcessorGrid(grid_dims, comm=comm)
    dist = Dist.parse(spec, "NCHW")
    layer = layer_cls(**kwargs, grid=grid, input_dist=dist)
    x = torch.randn(dist.local_shape(shape, grid), dtype=torch.float64, requires_grad=True)
    comm.stats.reset()
    y = layer(x, shape)
    forward = comm.stats.total_bytes()
    y.sum().backward()
    return forward, comm.stats.total_bytes() - forward


@pytest.mark.parametrize("layer_cls, kwargs", [
    (DistMaxPool2d, {"kernel_size": 3, "stride": 2, "padding": 1}),
    (DistAvgPool2d, {"kernel_size": 2, "ceil_mode": True}),
])
def test_channel_and_sample_distributions_move_no_data(layer_cls, kwargs) -> None:  # noqa: ANN001
    for fwd, bwd in run_threads(_traffic, 4, layer_cls, kwargs, "x[o,o_C,*,*]",
                                {"N": 2, "C": 2}, (3, 5, 7, 6)):
        assert (fwd, bwd) == (0, 0)


def test_spatial_split_moves_exactly_the_halo_rows() -> None:
    # H = 8 over 2 ranks, kernel 3, stride 1, padding 1: rank 0 computes output rows 0-3 from
    # input rows -1..4, rank 1 output rows 4-7 from rows 3..8: one row of N·C·W = 2·3·5 values
    # each way in forward, and its gradient back in backward.
    row = 2 * 3 * 5 * 8
    for fwd, bwd in run_threads(_traffic, 2, DistMaxPool2d,
                                {"kernel_size": 3, "stride": 1, "padding": 1},
                                "x[o,*,o,o]", {"H": 2}, (2, 3, 8, 5)):
        assert (fwd, bwd) == (row, row)


# ---------------------------------------------------------------------- indices
def _indices(comm, spec, grid_dims, shape):  # noqa: ANN001, ANN202
    grid = ProcessorGrid(grid_dims, comm=comm)
    dist = Dist.parse(spec, "NCHW")
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    layer = DistMaxPool2d(2, return_indices=True, ceil_mode=True, grid=grid, input_dist=dist)
    y, idx = layer(x[dist.local_slices(shape, grid)], shape)
    _, want = F.max_pool2d(x, 2, ceil_mode=True, return_indices=True)
    return torch.equal(idx, want[dist.local_slices(want.shape, grid)])


def test_indices_without_a_spatial_split_are_the_single_process_ones() -> None:
    assert all(run_threads(_indices, 4, "x[o,o_C,*,*]", {"N": 2, "C": 2}, (3, 3, 5, 4)))


# ---------------------------------------------------------------------- conversion
def _grid(dims: dict[str, int] | None = None) -> ProcessorGrid:
    return ProcessorGrid(dims or {"N": 1}, comm=SingleCommunicator())


X = Dist.parse("x[o,o_C,o,o]", "NCHW")


@pytest.mark.parametrize("module, cls, settings_", [
    (nn.MaxPool2d(3, 2, 1, 2, ceil_mode=True), DistMaxPool2d,
     {"kernel_size": (3, 3), "stride": (2, 2), "padding": (1, 1), "dilation": (2, 2),
      "ceil_mode": True, "return_indices": False}),
    (nn.AvgPool2d((2, 3), None, (1, 0), False, False, 3), DistAvgPool2d,
     {"kernel_size": (2, 3), "stride": (2, 3), "padding": (1, 0), "ceil_mode": False,
      "count_include_pad": False, "divisor_override": 3}),
    (nn.AdaptiveAvgPool2d(1), DistAdaptiveAvgPool2d, {"output_size": (1, 1)}),
])
def test_from_module_keeps_every_setting(module, cls, settings_) -> None:  # noqa: ANN001
    layer = from_module(module, grid=_grid(), input_dist=X)
    assert type(layer) is cls
    assert {k: getattr(layer, k) for k in settings_} == settings_
    x = torch.randn(2, 3, 7, 6, dtype=torch.float64)
    back = layer.to_plain()
    torch.testing.assert_close(back(x), module(x), rtol=0, atol=0)


@pytest.mark.parametrize("fn, args, kwargs, cls, settings_", [
    # F.max_pool2d's own order: ceil_mode before return_indices
    (F.max_pool2d, (3, 2, 1, 1, True), {}, DistMaxPool2d,
     {"kernel_size": (3, 3), "stride": (2, 2), "padding": (1, 1), "ceil_mode": True}),
    (torch.max_pool2d, (2,), {"stride": []}, DistMaxPool2d, {"stride": (2, 2)}),
    (F.avg_pool2d, (3,), {"stride": 1, "padding": 1, "count_include_pad": False}, DistAvgPool2d,
     {"kernel_size": (3, 3), "stride": (1, 1), "count_include_pad": False}),
    (F.adaptive_avg_pool2d, ((1, 1),), {}, DistAdaptiveAvgPool2d, {"output_size": (1, 1)}),
])
def test_from_function_binds_the_functional_signature(
    fn, args, kwargs, cls, settings_,  # noqa: ANN001
) -> None:
    layer = from_function(fn, args, kwargs, grid=_grid(), input_dist=X)
    assert type(layer) is cls
    assert {k: getattr(layer, k) for k in settings_} == settings_


def test_conversion_refuses_other_modules_and_functions() -> None:
    with pytest.raises(TypeError, match="got Conv2d"):
        from_module(nn.Conv2d(1, 1, 1), grid=_grid(), input_dist=X)
    with pytest.raises(TypeError, match="from_function takes F.max_pool1d/2d/3d, .*; got .relu."):
        from_function(F.relu, (), grid=_grid(), input_dist=X)
    with pytest.raises(TypeError, match="do not fit max_pool2d"):
        from_function(F.max_pool2d, (), {"kernel": 3}, grid=_grid(), input_dist=X)


# ---------------------------------------------------------------------- real worlds
POOL_KINDS = ("max", "avg", "adaptive")


def _check_world(per_rank: list) -> None:  # noqa: ANN001
    cases = [c for c in REPRESENTATIVE if c.kind in POOL_KINDS]
    for i, case in enumerate(cases):
        check_results(case, [rank[i] for rank in per_rank])


@pytest.mark.gloo
def test_representative_cases_on_gloo(gloo4) -> None:  # noqa: ANN001
    _check_world(gloo4.run(run_representative, POOL_KINDS))


@pytest.mark.mpi
def test_representative_cases_on_mpi(mpi4) -> None:  # noqa: ANN001
    _check_world(mpi4.run(run_representative, POOL_KINDS))


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("cls", [DistMaxPool2d, DistAvgPool2d, DistAdaptiveAvgPool2d])
@pytest.mark.parametrize("input_dist, message", [
    (Dist.parse("x[o,o_C,o]", "NCH"), "input_dist must have 4 entries"),
    (Dist.parse("Σ_F x[o,o_C,o,o]", "NCHW"), "pending sum over F"),
])
def test_bad_input_dist_is_refused_at_construction(
    cls, input_dist, message,  # noqa: ANN001
) -> None:
    args = () if cls is DistAdaptiveAvgPool2d else (2,)
    with pytest.raises(ValueError, match=message):
        cls(*args, grid=_grid(), input_dist=input_dist)


def _indices_with_split(comm):  # noqa: ANN001, ANN202
    grid = ProcessorGrid({"H": 2}, comm=comm)
    DistMaxPool2d(2, return_indices=True, grid=grid, input_dist=Dist.parse("x[*,*,o,*]", "NCHW"))


def test_return_indices_with_a_spatial_split_is_not_implemented() -> None:
    with pytest.raises(NotImplementedError, match="return_indices=True is not implemented when "
                                                  "the spatial dims are split"):
        run_threads(_indices_with_split, 2)


@pytest.mark.parametrize("output_size", [(2, 2), 3, (None, 1)])
def test_other_adaptive_output_sizes_are_not_implemented(output_size) -> None:  # noqa: ANN001
    with pytest.raises(NotImplementedError, match=r"only output_size=\(1, 1\)"):
        DistAdaptiveAvgPool2d(output_size, grid=_grid(), input_dist=X)


@pytest.mark.parametrize("cls, kwargs, error, message", [
    (DistMaxPool2d, {"kernel_size": 3, "padding": 2}, ValueError,
     r"padding must be at most half the kernel size .* got padding=\(2, 2\)"),
    (DistAvgPool2d, {"kernel_size": 0}, ValueError, "kernel_size must be >= 1, got 0"),
    (DistMaxPool2d, {"kernel_size": 2, "stride": -1}, ValueError, "stride must be >= 1, got -1"),
    (DistMaxPool2d, {"kernel_size": "2"}, TypeError, "kernel_size must be an int or a pair"),
    (DistAvgPool2d, {"kernel_size": 2, "divisor_override": 0}, ValueError,
     "divisor_override must be None or a non-zero int, got 0"),
])
def test_bad_arguments_name_the_argument(cls, kwargs, error, message) -> None:  # noqa: ANN001
    with pytest.raises(error, match=message):
        cls(**kwargs, grid=_grid(), input_dist=X)


def test_an_input_too_small_for_the_window_raises_at_forward() -> None:
    layer = DistMaxPool2d(3, grid=_grid(), input_dist=X)
    with pytest.raises(ValueError, match="too small: no output on dim H"):
        layer(torch.randn(1, 2, 2, 5), (1, 2, 2, 5))


def test_repr_shows_settings_and_distributions() -> None:
    text = repr(DistAvgPool2d(3, 2, 1, grid=_grid({"N": 1}), input_dist=X))
    for part in ("kernel_size=(3, 3), stride=(2, 2), padding=(1, 1), ceil_mode=False, "
                 "count_include_pad=True, divisor_override=None", "x=x[o,o_C,o,o]",
                 "y=y[o,o_C,o,o]"):
        assert part in text, text
    text = repr(DistAdaptiveAvgPool2d(grid=_grid({"H": 1}), input_dist=X))
    assert "output_size=(1, 1)" in text and "y=y[o,o_C,*,*]" in text, text
