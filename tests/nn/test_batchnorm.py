"""DistBatchNorm2d equals nn.BatchNorm2d on the global batch: output, dL/dx, dL/dw, dL/db and
running statistics, in training and eval, on any grid and any activation distribution."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

from distconv.comm import SingleCommunicator
from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.nn import DistBatchNorm2d
from distconv.testing import run_threads
from tests.nn.layer_cases import LayerCase, check_results, reference, run_case, run_representative
from tests.nn.layer_strategies import activation_entries, grids

RELAXED = [HealthCheck.too_slow, HealthCheck.filter_too_much]


@st.composite
def bn_cases(draw: st.DrawFn, dtype: torch.dtype = torch.float64) -> LayerCase:
    layout = draw(grids())
    entries = draw(activation_entries(layout))
    shape = (draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 4)),
             draw(st.integers(1, 4)))
    assume(shape[0] * shape[2] * shape[3] > 1)  # torch refuses to train on one value per channel
    # With 2 values per channel dx is exactly 0 and what fp32 computes is its rounding of the
    # cancellation, scaled by invstd (up to 1/sqrt(eps)): torch's own fp32 kernel is 1.3e-3
    # from its fp64 result there (worst of 300 draws; 1.0e-5 at 3 values, 2.6e-6 at 4), so two
    # exact fp32 implementations differ by more than fp32's tolerance. fp64 covers those shapes.
    assume(dtype == torch.float64 or shape[0] * shape[2] * shape[3] >= 4)
    options = {
        "eps": draw(st.sampled_from([1e-5, 1e-3])),
        "momentum": draw(st.sampled_from([0.1, 0.7, None])),
        "affine": draw(st.booleans()),
        "track_running_stats": draw(st.booleans()),
    }
    return LayerCase("bn", layout, entries, shape, options, dtype, draw(st.integers(0, 2**16)))


def _run(case: LayerCase) -> None:
    check_results(case, run_threads(run_case, case.size, case, reference(case)))


@settings(max_examples=40, deadline=None, suppress_health_check=RELAXED)
@given(bn_cases())
def test_dist_batchnorm_equals_batchnorm_fp64(case: LayerCase) -> None:
    _run(case)


@settings(max_examples=8, deadline=None, suppress_health_check=RELAXED)
@given(bn_cases(torch.float32))
def test_dist_batchnorm_equals_batchnorm_fp32(case: LayerCase) -> None:
    _run(case)


@pytest.mark.parametrize("case", [
    # more ranks than samples, channels and rows: several ranks hold empty blocks
    LayerCase("bn", (("N", 4), ("C", 2)), ("N", "C", None, None), (2, 1, 2, 2)),
    LayerCase("bn", (("H", 4), ("W", 2)), (None, None, "H", "W"), (1, 3, 3, 1)),
    # a tuple channel entry against grid order, with a redundant dim holding replicas
    LayerCase("bn", (("C", 2), ("F", 2), ("N", 2)), (None, ("F", "C"), None, None), (3, 7, 2, 2)),
], ids=["empty-samples-and-channels", "empty-rows", "replicas"])
def test_empty_blocks_and_replicas(case: LayerCase) -> None:
    _run(case)


def test_statistics_are_numerically_stable() -> None:
    """Values around 1e4 with unit spread: E[x²] - E[x]² would lose eight of the variance's
    sixteen digits, and the output would miss the 1e-10 tolerance by two orders of magnitude."""
    case = LayerCase("bn", (("N", 2), ("H", 2)), ("N", None, "H", None), (3, 2, 5, 2))
    ref = reference(case)
    for step in ref["steps"]:
        step["x"] += 1e4
    ref = _rerun(case, ref)
    check_results(case, run_threads(run_case, case.size, case, ref))


def _rerun(case: LayerCase, ref: dict) -> dict:
    """The reference steps again on the shifted inputs (same cotangents)."""
    import copy

    layer = copy.deepcopy(ref["layer"])
    for training, step in zip([True, True, False], ref["steps"]):
        layer.train(training)
        x = step["x"].clone().requires_grad_()
        for p in layer.parameters():
            p.grad = None
        y = layer(x)
        y.backward(step["g"])
        step.update(y=y.detach(), dx=x.grad, dweight=layer.weight.grad.clone(),
                    dbias=layer.bias.grad.clone(), running_mean=layer.running_mean.clone(),
                    running_var=layer.running_var.clone())
    return ref


# ---------------------------------------------------------------------- distributions
def _local_shapes(comm, grid_dims, spec):  # noqa: ANN001, ANN202
    grid = ProcessorGrid(grid_dims, comm=comm)
    bn = DistBatchNorm2d(7, grid=grid, input_dist=Dist.parse(spec, "NCHW"))
    specs = {name: s.dist for name, s in bn._shard_specs().items()}
    return grid.coords, tuple(bn.weight.shape), tuple(bn.running_var.shape), specs


@pytest.mark.parametrize("grid_dims, spec, param_spec", [
    ({"N": 2, "F": 2, "C": 2}, "x[o,o_{F×C},o,o]", "w[o_{F×C}]"),
    ({"N": 2, "C": 2}, "x[o,o_C,o,o]", "w[o_C]"),
    ({"N": 2, "H": 2}, "x[o,*,o,o]", "w[*]"),
])
def test_parameters_and_buffers_are_distributed_like_the_channel_entry(
    grid_dims, spec, param_spec,  # noqa: ANN001
) -> None:
    want = Dist.parse(param_spec)
    blk = lambda n, p, i: n // p + (i < n % p)  # noqa: E731
    for coords, w_shape, rv_shape, specs in run_threads(
        _local_shapes, math.prod(grid_dims.values()), grid_dims, spec,
    ):
        assert specs == {"weight": want, "bias": want, "running_mean": want,
                         "running_var": want, "num_batches_tracked": Dist(())}
        c, f = coords.get("C", 0), coords.get("F", 0)
        expected = {  # 7 channels: blocks over F, then over C inside each F block
            "w[o_{F×C}]": (blk(blk(7, 2, f), 2, c),), "w[o_C]": (blk(7, 2, c),), "w[*]": (7,),
        }[param_spec]
        assert w_shape == expected and rv_shape == expected


def _traffic(comm):  # noqa: ANN001, ANN202
    grid = ProcessorGrid({"N": 2, "C": 2}, comm=comm)
    dist = Dist.parse("x[o,o_C,o,o]", "NCHW")
    bn = DistBatchNorm2d(5, dtype=torch.float64, grid=grid, input_dist=dist)
    shape = (4, 5, 3, 3)
    x = torch.randn(dist.local_shape(shape, grid), dtype=torch.float64, requires_grad=True)
    comm.stats.reset()
    y = bn(x, shape)
    forward = {op: b for op, b in comm.stats.snapshot()["bytes"].items() if b}
    comm.stats.reset()
    y.square().sum().backward()
    backward = {op: b for op, b in comm.stats.snapshot()["bytes"].items() if b}
    return grid.coords["C"], forward, backward


def test_traffic_is_one_small_allgather_forward_and_three_allreduces_backward() -> None:
    # 5 channels over C=2: 3 and 2 per rank. Forward: the other N rank's count, means and M2
    # (1 + 2c values). Backward: Σdy and Σdy·x̂ (2c values) over N, then the weight and bias
    # gradients (c values each) over N, the redundant dim of w[o_C]; a 2-rank ring allreduce
    # delivers as many values as it reduces.
    for c_coord, forward, backward in run_threads(_traffic, 4):
        c = (3, 2)[c_coord]
        assert forward == {"allgather": (1 + 2 * c) * 8}
        assert backward == {"allreduce": (2 * c + c + c) * 8}


def test_one_rank_equals_batchnorm2d() -> None:
    grid = ProcessorGrid({"N": 1}, comm=SingleCommunicator())
    ref = nn.BatchNorm2d(3, dtype=torch.float64)
    bn = DistBatchNorm2d.from_batchnorm2d(ref, grid=grid,
                                          input_dist=Dist.parse("x[o,o_C,o,o]", "NCHW"))
    assert bn.grad_sync is None
    x = torch.randn(4, 3, 2, 5, dtype=torch.float64)
    torch.testing.assert_close(bn(x), ref(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bn.running_var, ref.running_var, rtol=1e-12, atol=1e-12)


@pytest.mark.gloo
def test_representative_cases_on_gloo(gloo4) -> None:  # noqa: ANN001
    _check_world(gloo4.run(run_representative, ("bn",)))


@pytest.mark.mpi
def test_representative_cases_on_mpi(mpi4) -> None:  # noqa: ANN001
    _check_world(mpi4.run(run_representative, ("bn",)))


def _check_world(per_rank: list) -> None:  # noqa: ANN001
    from tests.nn.layer_cases import REPRESENTATIVE

    cases = [c for c in REPRESENTATIVE if c.kind == "bn"]
    for i, case in enumerate(cases):
        check_results(case, [rank[i] for rank in per_rank])


# ---------------------------------------------------------------------- bad input
def _grid(dims: dict[str, int] | None = None) -> ProcessorGrid:
    return ProcessorGrid(dims or {"N": 1}, comm=SingleCommunicator())


@pytest.mark.parametrize("input_dist, error, message", [
    (Dist.parse("x[o,o_C,o]", "NCH"), ValueError, "input_dist must have 4 entries"),
    (Dist.parse("Σ_F x[o,o_C,o,o]", "NCHW"), ValueError, "pending sum over F"),
    (Dist.parse("x[o,o_Q,o,o]", "NCHW"), ValueError, "'Q' is not in"),
    ("x[o,o_C,o,o]", TypeError, "input_dist must be a distconv.Dist"),
])
def test_bad_input_dist_is_refused_at_construction(
    input_dist, error, message,  # noqa: ANN001
) -> None:
    with pytest.raises(error, match=message):
        DistBatchNorm2d(4, grid=_grid(), input_dist=input_dist)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_features": 0}, "num_features must be a positive int, got 0"),
    ({"num_features": 4, "eps": -1.0}, "eps must be a non-negative number, got -1.0"),
    ({"num_features": 4, "momentum": "fast"}, "momentum must be a number or None, got 'fast'"),
])
def test_bad_arguments_name_the_argument(kwargs, message) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        DistBatchNorm2d(**kwargs, grid=_grid(), input_dist=Dist.parse("x[o,o_C,o,o]", "NCHW"))


def test_grid_must_be_a_processor_grid() -> None:
    with pytest.raises(TypeError, match="grid must be a distconv.grid.ProcessorGrid, got dict"):
        DistBatchNorm2d(4, grid={"N": 1}, input_dist=Dist.parse("x[o,o_C,o,o]", "NCHW"))


def test_bad_blocks_and_shapes_raise_at_forward() -> None:
    bn = DistBatchNorm2d(3, grid=_grid(), input_dist=Dist.parse("x[o,o_C,o,o]", "NCHW"))
    with pytest.raises(ValueError, match="got an input block of shape"):
        bn(torch.randn(2, 3, 4, 4), (2, 3, 4, 5))
    with pytest.raises(ValueError, match="has 4 channels, expected num_features=3"):
        bn(torch.randn(2, 4, 4, 4), (2, 4, 4, 4))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(torch.randn(1, 3, 1, 1), (1, 3, 1, 1))
    with pytest.raises(TypeError, match="the input is torch.float64 but the layer's parameters"):
        bn(torch.randn(2, 3, 2, 2, dtype=torch.float64), (2, 3, 2, 2))


def _needs_shape(comm):  # noqa: ANN001, ANN202
    grid = ProcessorGrid({"N": 2}, comm=comm)
    bn = DistBatchNorm2d(3, grid=grid, input_dist=Dist.parse("x[o,o_C,o,o]", "NCHW"))
    bn(torch.randn(2, 3, 2, 2))


def test_global_shape_is_required_when_the_input_is_split() -> None:
    with pytest.raises(ValueError, match="pass global_shape to forward"):
        run_threads(_needs_shape, 2)


def test_repr_shows_settings_and_distributions() -> None:
    bn = DistBatchNorm2d(8, momentum=None, grid=_grid({"N": 1}),
                         input_dist=Dist.parse("x[o,o_C,o,o]", "NCHW"))
    text = repr(bn)
    for part in ("8, eps=1e-05, momentum=None, affine=True, track_running_stats=True",
                 "grid={'N': 1}", "x=x[o,o_C,o,o]", "y=y[o,o_C,o,o]", "w=w[o_C]"):
        assert part in text, text
