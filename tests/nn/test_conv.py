"""DistConv2d equals nn.Conv2d: forward, dL/dx, dL/dw, dL/db, on every algorithm and grid."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

from distconv.conv_geometry import ConvDim, normalize_padding
from distconv.grid import ProcessorGrid
from distconv.nn import DistConv2d
from distconv.testing import run_threads
from tests.nn.conv_cases import REPRESENTATIVE, ConvCase, check_results, reference, run_case

ALGORITHMS = ("stationary-x", "stationary-y", "stationary-w")
RELAXED = [HealthCheck.too_slow, HealthCheck.filter_too_much]  # thread worlds; assume() on sizes


@st.composite
def conv_cases(draw: st.DrawFn, dtype: torch.dtype = torch.float64) -> ConvCase:
    algorithm = draw(st.sampled_from(ALGORITHMS))
    pc = draw(st.integers(1, 4)) if algorithm != "stationary-y" else 1
    pf = draw(st.integers(1, 4 // pc if algorithm == "stationary-w" else 4)) if (
        algorithm != "stationary-x") else 1
    budget = 8 // (pc * pf)
    pn = draw(st.integers(1, budget))
    ph = draw(st.integers(1, budget // pn))
    pw = draw(st.integers(1, budget // (pn * ph)))
    dims = [("N", pn), ("C", pc), ("F", pf), ("H", ph), ("W", pw)]
    dims = [d for d in dims if d[1] > 1 or draw(st.booleans())] or [("N", 1)]
    dims = draw(st.permutations(dims))
    kernel = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    padding = draw(st.one_of(
        st.integers(0, 2), st.tuples(st.integers(0, 2), st.integers(0, 2)),
        st.just("valid"), st.just("same") if stride == (1, 1) else st.just(0),
    ))
    cin = draw(st.integers(pc * pf, pc * pf + 3))
    cout = draw(st.integers(pc * pf, pc * pf + 3))
    groups = 1
    if pc * pf == 1:
        groups = draw(st.sampled_from([g for g in range(1, 4) if cin % g == 0 and cout % g == 0]))
    elif draw(st.booleans()):  # groups aligned with the blocks
        groups = pc * pf * draw(st.integers(1, 2))
        cin, cout = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    elif draw(st.booleans()):  # any groups: blocks that cut them, or depthwise of any width
        groups = draw(st.integers(2, 5))
        cin, cout = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
        assume(min(cin, cout) >= pc * pf)
    pads = normalize_padding(padding, kernel, stride, dilation)
    sizes = []
    for i, p in enumerate((ph, pw)):
        span = dilation[i] * (kernel[i] - 1) + 1
        lo = max(p, span - sum(pads[i]), 1)
        n = draw(st.integers(lo, lo + 6))
        dim = ConvDim(n, kernel[i], stride[i], dilation[i], *pads[i])
        assume(dim.out_length >= p)
        sizes.append(n)
    mode = draw(st.sampled_from(["zeros", "zeros", "reflect", "replicate", "circular"]))
    for n, (lo, hi) in zip(sizes, pads):
        assume(mode != "reflect" or max(lo, hi) < n)
        assume(mode != "circular" or max(lo, hi) <= n)
    conv = {"kernel_size": kernel, "stride": stride, "padding": padding, "dilation": dilation,
            "groups": groups, "bias": draw(st.booleans()), "padding_mode": mode}
    batch = draw(st.integers(pn, pn + 2))
    return ConvCase(tuple(dims), algorithm, batch, cin, cout, sizes[0], sizes[1], conv, dtype,
                    seed=draw(st.integers(0, 2**16)))


def _run(case: ConvCase) -> None:
    ref = reference(case)
    check_results(case, run_threads(run_case, case.size, case, ref))


@settings(max_examples=120, deadline=None, suppress_health_check=RELAXED)
@given(conv_cases())
def test_dist_conv2d_equals_conv2d_fp64(case: ConvCase) -> None:
    _run(case)


@settings(max_examples=25, deadline=None, suppress_health_check=RELAXED)
@given(conv_cases(torch.float32))
def test_dist_conv2d_equals_conv2d_fp32(case: ConvCase) -> None:
    _run(case)


@pytest.mark.parametrize("case", REPRESENTATIVE, ids=lambda c: f"{c.algorithm}-{dict(c.grid)}")
def test_representative_cases_on_threads(case: ConvCase) -> None:
    _run(case)


@pytest.mark.gloo
def test_representative_cases_on_gloo(gloo4) -> None:  # noqa: ANN001
    from tests.nn.conv_cases import run_representative

    per_rank = gloo4.run(run_representative)
    for i, case in enumerate(REPRESENTATIVE):
        check_results(case, [rank[i] for rank in per_rank])


@pytest.mark.mpi
def test_representative_cases_on_mpi(mpi4) -> None:  # noqa: ANN001
    from tests.nn.conv_cases import run_representative

    per_rank = mpi4.run(run_representative)
    for i, case in enumerate(REPRESENTATIVE):
        check_results(case, [rank[i] for rank in per_rank])


# ---------------------------------------------------------------------- the 1-rank path
def test_one_rank_is_a_direct_conv2d_call() -> None:
    from distconv.comm import SingleCommunicator

    grid = ProcessorGrid({"N": 1}, comm=SingleCommunicator())
    conv = nn.Conv2d(3, 4, 3, padding="same", padding_mode="reflect")
    layer = DistConv2d.from_conv2d(conv, grid=grid, algorithm="stationary-x")
    assert layer.grad_sync is None
    x = torch.randn(2, 3, 5, 6)
    assert torch.equal(layer(x), conv(x))
    assert torch.equal(layer.to_conv2d().weight, conv.weight)


# ---------------------------------------------------------------------- weights and gradients
def _shares(comm, grid_dims, algorithm):  # noqa: ANN001, ANN202
    grid = ProcessorGrid(grid_dims, comm=comm)
    layer = DistConv2d(7, 5, 3, grid=grid, algorithm=algorithm, init_seed=3)
    return grid.coords, tuple(layer.weight.shape), tuple(layer.bias.shape), layer.to_conv2d()


@pytest.mark.parametrize("grid_dims, algorithm", [
    ({"C": 2, "F": 2}, "stationary-w"), ({"N": 2, "C": 3}, "stationary-x"),
    ({"F": 3, "H": 2}, "stationary-y"),
])
def test_each_rank_holds_exactly_its_weight_share(grid_dims, algorithm) -> None:  # noqa: ANN001
    size = math.prod(grid_dims.values())
    results = run_threads(_shares, size, grid_dims, algorithm)
    blk = lambda n, p, i: n // p + (i < n % p)  # noqa: E731
    for coords, w_shape, b_shape, _ in results:
        c, f = coords.get("C", 0), coords.get("F", 0)
        pc, pf = grid_dims.get("C", 1), grid_dims.get("F", 1)
        if algorithm == "stationary-w":
            assert w_shape == (blk(5, pf, f), blk(7, pc, c), 3, 3)
            assert b_shape == (blk(blk(5, pf, f), pc, c),)
        elif algorithm == "stationary-x":
            assert w_shape == (5, blk(7, pc, c), 3, 3) and b_shape == (blk(5, pc, c),)
        else:
            assert w_shape == (blk(5, pf, f), 7, 3, 3) and b_shape == (blk(5, pf, f),)
    distinct = {tuple(sorted(co.items()))[:0] + (co.get("C", 0), co.get("F", 0)): w
                for co, w, _, _ in results}
    assert sum(math.prod(w) for w in distinct.values()) == 5 * 7 * 9
    gathered = [r[3] for r in results]
    for conv in gathered[1:]:
        assert torch.equal(conv.weight, gathered[0].weight)
        assert torch.equal(conv.bias, gathered[0].bias)


def _accumulate(comm, ref):  # noqa: ANN001, ANN202
    grid = ProcessorGrid({"N": 2, "C": 2}, comm=comm)
    layer = DistConv2d.from_conv2d(ref["conv"], grid=grid, algorithm="stationary-x")
    shape = tuple(ref["x"].shape)
    xs = layer.input_dist.local_slices(shape, grid)
    ys = layer.output_dist.local_slices(layer.output_shape(shape), grid)
    for _ in range(2):
        layer(ref["x"][xs], shape).backward(ref["g"][ys])
    ws = layer.weight_dist.local_slices(layer.weight_shape, grid)
    return torch.allclose(layer.weight.grad, 2 * ref["dw"][ws], rtol=1e-10, atol=1e-11)


def test_gradients_accumulate_over_backward_passes_like_pytorch() -> None:
    ref = reference(ConvCase((("N", 2), ("C", 2)), "stationary-x", 3, 4, 3, 5, 5,
                             {"kernel_size": 3, "padding": 1}))
    assert all(run_threads(_accumulate, 4, ref))


def _agreed_shape(comm, ref):  # noqa: ANN001, ANN202
    grid = ProcessorGrid({"H": 2, "N": 2}, comm=comm)
    layer = DistConv2d.from_conv2d(ref["conv"], grid=grid, algorithm="stationary-x")
    shape = tuple(ref["x"].shape)
    y = layer(ref["x"][layer.input_dist.local_slices(shape, grid)])  # no global shape given
    return torch.allclose(y, ref["y"][layer.output_dist.local_slices(layer.output_shape(shape),
                                                                     grid)])


def test_global_shape_is_agreed_when_not_given() -> None:
    ref = reference(ConvCase((("H", 2), ("N", 2)), "stationary-x", 3, 2, 3, 7, 4,
                             {"kernel_size": 3, "padding": 1}))
    assert all(run_threads(_agreed_shape, 4, ref))


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
@pytest.mark.parametrize("grid", [(("N", 2), ("C", 2)), (("H", 2), ("W", 2)), (("H", 3),)])
def test_padding_modes_under_every_kind_of_parallelism(mode: str, grid) -> None:  # noqa: ANN001
    case = ConvCase(grid, "stationary-x", 3, 4, 3, 5, 6,
                    {"kernel_size": 3, "padding": (2, 3), "padding_mode": mode})
    _run(case)


def _stack(comm, c1, c2, x, g):  # noqa: ANN001, ANN202
    grid = ProcessorGrid({"C": 2, "F": 2}, comm=comm)
    l1 = DistConv2d.from_conv2d(c1, grid=grid, algorithm="stationary-w")
    l2 = DistConv2d.from_conv2d(c2, grid=grid, algorithm="stationary-w", channel_dim="F",
                                filter_dim="C")
    assert l1.output_dist == l2.input_dist
    shape = tuple(x.shape)
    xl = x[l1.input_dist.local_slices(shape, grid)].clone().requires_grad_(True)
    mid = l1.output_shape(shape)
    y = l2(l1(xl, shape), mid)
    y.backward(g[l2.output_dist.local_slices(l2.output_shape(mid), grid)])
    return y.detach(), xl.grad, l2.output_dist.local_slices(l2.output_shape(mid), grid), \
        l1.input_dist.local_slices(shape, grid)


def test_stacked_stationary_w_layers_need_no_data_movement_between_them() -> None:
    torch.manual_seed(0)
    c1 = nn.Conv2d(6, 5, 3, padding=1, dtype=torch.float64)
    c2 = nn.Conv2d(5, 7, 3, padding=1, dtype=torch.float64)
    x = torch.randn(2, 6, 5, 5, dtype=torch.float64, requires_grad=True)
    y = c2(c1(x))
    g = torch.randn_like(y)
    y.backward(g)
    for yl, gx, ys, xs in run_threads(_stack, 4, c1, c2, x.detach(), g):
        torch.testing.assert_close(yl, y.detach()[ys])
        torch.testing.assert_close(gx, x.grad[xs])


# ---------------------------------------------------------------------- bad configurations
def _build(comm, grid_dims, kwargs):  # noqa: ANN001, ANN202
    grid = ProcessorGrid(grid_dims, comm=comm)
    args = {"in_channels": 4, "out_channels": 4, "kernel_size": 3, "init_seed": 0, **kwargs}
    return DistConv2d(grid=grid, **args)


@pytest.mark.parametrize("grid_dims, kwargs, message", [
    ({"C": 2}, {"algorithm": "winograd"}, "algorithm must be one of"),
    ({"C": 2, "F": 2}, {"algorithm": "stationary-x"}, "use algorithm='stationary-w'"),
    ({"C": 2, "F": 2}, {"algorithm": "stationary-y"}, "use algorithm='stationary-w'"),
    ({"C": 2, "F": 2}, {"algorithm": "stationary-w", "in_channels": 3}, "use C×F <= 3"),
    ({"F": 4}, {"algorithm": "stationary-y", "out_channels": 3}, "use C×F <= 3"),
    ({"H": 4}, {"algorithm": "stationary-x", "padding": 1, "input_shape": (2, 4, 3, 8)},
     "use H <= 3"),
    ({"W": 4}, {"algorithm": "stationary-x", "stride": 3, "input_shape": (2, 4, 8, 9)},
     "use W <= 3"),
    ({"N": 4}, {"algorithm": "stationary-x", "input_shape": (3, 4, 8, 8)}, "use N <= 3"),
    ({"H": 2}, {"algorithm": "stationary-x", "padding": 4, "padding_mode": "reflect",
                "input_shape": (2, 4, 4, 8)}, "padding < input size"),
    ({"Q": 2}, {"algorithm": "stationary-x"}, "has no role"),
    ({"C": 2}, {"algorithm": "stationary-x", "padding": "same", "stride": 2}, "padding='same'"),
    ({"C": 2}, {"algorithm": "stationary-x", "padding_mode": "mirror"}, "padding_mode must be"),
    ({"C": 2}, {"algorithm": "stationary-x", "gathered_input": True}, "gathers nothing"),
    ({"F": 2}, {"algorithm": "stationary-y", "gathered_input": True, "pipeline": 2},
     "is pipelined"),
])
def test_bad_configurations_raise_saying_what_works(grid_dims, kwargs, message):  # noqa: ANN
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_threads(_build, math.prod(grid_dims.values()), grid_dims, kwargs)


@pytest.mark.parametrize("grid_dims, algorithm, channels, groups", [
    ((("C", 2),), "stationary-x", (6, 6), 3),          # a group across the C blocks
    ((("C", 2), ("F", 2)), "stationary-w", (4, 4), 2),  # two groups over four blocks
    ((("F", 3),), "stationary-y", (10, 15), 5),         # 5 filters a block, 3 a group
])
def test_grouped_layers_whose_blocks_cut_groups_gather_x_and_equal_conv2d(
        grid_dims, algorithm, channels, groups) -> None:  # noqa: ANN001
    """Blocks that cut groups: x gathered over the blocks' dims, each rank's filters convolved
    with their groups' channels; forward, every gradient and the bytes equal the model's."""
    case = ConvCase(grid_dims, algorithm, 3, *channels, 5, 4,
                    {"kernel_size": 3, "padding": 1, "groups": groups})
    _run(case)
    from distconv.perfmodel import conv_traffic

    ops = conv_traffic(case.problem(), case.grid, algorithm, {d: 0 for d, _ in grid_dims})
    assert set(ops.by_op()) == {"allgather", "reduce_scatter"}  # x gathered, dL/dx scattered


def test_grouped_layers_whose_blocks_cut_groups_refuse_pipelining_saying_what_works() -> None:
    with pytest.raises(ValueError, match="use pipeline=1 for this grouped stationary-x"):
        run_threads(_build, 2, {"C": 2}, {"algorithm": "stationary-x", "in_channels": 6,
                                          "out_channels": 6, "groups": 3, "pipeline": 2})


def test_depthwise_convolution_with_channel_parallelism_moves_no_data() -> None:
    case = ConvCase((("C", 2), ("H", 2)), "stationary-x", 2, 4, 4, 6, 5,
                    {"kernel_size": 3, "padding": 1, "groups": 4})
    _run(case)
    traffic = case.problem()
    from distconv.perfmodel import conv_traffic

    ops = conv_traffic(traffic, case.grid, case.algorithm, {"C": 1, "H": 0}).by_op()
    assert set(ops) == {"alltoall", "allreduce"}  # halo and weight gradients only


def _wrong_block(comm):  # noqa: ANN001, ANN202
    layer = _build(comm, {"C": 2}, {"algorithm": "stationary-x"})
    layer(torch.randn(2, 4, 6, 6), (2, 4, 6, 6))


def test_an_input_block_of_the_wrong_shape_raises() -> None:
    with pytest.raises(ValueError, match="input block of shape"):
        run_threads(_wrong_block, 2)


def test_grid_must_be_a_processor_grid() -> None:
    with pytest.raises(TypeError, match="ProcessorGrid"):
        DistConv2d(2, 2, 1, grid={"C": 2}, algorithm="stationary-x")  # type: ignore[arg-type]


def test_repr_shows_settings_and_distributions() -> None:
    from distconv.comm import SingleCommunicator

    layer = DistConv2d(4, 6, 3, padding=1, grid=ProcessorGrid({"C": 1}, comm=SingleCommunicator()),
                       algorithm="stationary-w", init_seed=1)
    text = repr(layer)
    assert "algorithm='stationary-w'" in text and "x[o,o_{C×F},o,o]" in text
    assert "y[o,o_{F×C},o,o]" in text and "w[o_F,o_C,*,*]" in text


def _gathered_layer(comm, x, g):  # noqa: ANN001, ANN202
    """A stationary-y layer on {F: 2} given x whole over F (``gathered_input``) and the same
    layer given x[o,o_F,o,o]: each one's output and x gradient gathered (the gathered layer's
    gradient is pending over F: the sum over F), its global weight and bias, and its repr."""
    from distconv.redistribute import gather

    grid = ProcessorGrid({"F": 2}, comm=comm)
    shape = tuple(x.shape)
    out = {}
    for gathered in (False, True):
        layer = DistConv2d(4, 6, 3, padding=1, grid=grid, algorithm="stationary-y", init_seed=0,
                           gathered_input=gathered, dtype=torch.float64)
        xl = (x if gathered else x[:, 2 * comm.rank: 2 * comm.rank + 2]).clone()
        xl.requires_grad_(True)
        y = layer(xl, shape)
        y.backward(g[:, 3 * comm.rank: 3 * comm.rank + 3])
        dist = layer.input_dist.dual(grid) if gathered else layer.input_dist
        out[gathered] = (gather(y.detach(), layer.output_dist, grid, tuple(g.shape)),
                         gather(xl.grad, dist, grid, shape), layer.gather_weight(),
                         layer.gather_bias(), repr(layer))
    return out


def test_gathered_input_skips_the_gather_and_leaves_the_gradient_pending() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 5, 5, generator=gen, dtype=torch.float64)
    g = torch.randn(2, 6, 5, 5, generator=gen, dtype=torch.float64)
    for got in run_threads(_gathered_layer, 2, x, g):
        for gathered, (y, dx, w, b, text) in got.items():
            xr = x.clone().requires_grad_(True)
            yr = torch.nn.functional.conv2d(xr, w, b, padding=1)
            yr.backward(g)
            assert (y - yr).abs().max() < 1e-12 and (dx - xr.grad).abs().max() < 1e-12
            assert ("gathered_input=True" in text) == gathered
        assert "x[o,*,o,o]" in got[True][-1] and "x[o,o_F,o,o]" in got[False][-1]
    with pytest.raises(TypeError, match="gathered_input must be a bool"):
        run_threads(_build, 2, {"F": 2}, {"algorithm": "stationary-y", "gathered_input": 1})
