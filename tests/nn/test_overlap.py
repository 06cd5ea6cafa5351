"""Halo exchange overlapped with the interior rows' convolution (``overlap=True``) equals the
unoverlapped layer and one process, and moves the same bytes.

With small integers in float64 every sum is exact whatever its order, so there the overlapped
layer must equal the unoverlapped one and ``nn.Conv2d`` bitwise: a row convolved twice, dropped,
or a halo gradient sent before all of it was summed shows. With random reals the pieces'
convolutions may sum in another order, so there the results agree within the dtype's tolerance.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from distconv.grid import ProcessorGrid
from distconv.nn import DistConv2d
from distconv.nn.conv_nd import DistConvNd
from distconv.redistribute import gather
from distconv.testing import run_threads
from tests.nn.conv_cases import ConvCase, reference
from tests.nn.test_conv import RELAXED, conv_cases
from tests.nn.test_pipeline import check, integer_reference


def _kinds(y: torch.Tensor) -> set[str]:
    return {type(y.grad_fn).__name__} if y.grad_fn is not None else set()


def run_both(comm, case: ConvCase, ref: dict) -> dict:  # noqa: ANN001
    """``case`` without and with ``overlap=True`` on this rank: both layers' local results, the
    bytes each moved, whether the overlapped step ran, and the gathered overlapped results."""
    from distconv.nn import halo_conv

    grid = ProcessorGrid(dict(case.grid), comm=comm)
    shape = case.input_shape
    out, ran = {}, []
    original = halo_conv._HaloConv._overlapped_forward

    def spy(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        ran.append(True)
        return original(*args, **kw)

    for name, overlap in (("plain", False), ("pipelined", True)):
        layer = DistConv2d.from_conv2d(ref["conv"], grid=grid, algorithm=case.algorithm,
                                       overlap=overlap)
        y_shape = layer.output_shape(shape)
        x = ref["x"][layer.input_dist.local_slices(shape, grid)].clone().requires_grad_(True)
        comm.stats.reset()
        halo_conv._HaloConv._overlapped_forward = staticmethod(spy)  # type: ignore[assignment]
        try:
            y = layer(x, shape)
        finally:
            halo_conv._HaloConv._overlapped_forward = staticmethod(original)  # type: ignore
        y.backward(ref["g"][layer.output_dist.local_slices(y_shape, grid)])
        layer.finish_grad_sync()
        out[name] = {"ran pipelined": bool(ran) and overlap,
                     "bytes": {op: b for op, b in comm.stats.snapshot()["bytes"].items() if b},
                     "y": y.detach(), "dx": x.grad, "dw": layer.weight.grad,
                     "db": None if layer.bias is None else layer.bias.grad}
    p = out["pipelined"]
    out["global"] = {"y": gather(p["y"], layer.output_dist, grid, y_shape),
                     "dx": gather(p["dx"], layer.input_dist, grid, shape),
                     "dw": gather(p["dw"], layer.weight_dist, grid, layer.weight_shape)}
    return out


@st.composite
def overlapped_cases(draw: st.DrawFn) -> tuple[ConvCase, bool]:
    case = draw(conv_cases())
    ext = dict(case.grid)
    split = [d for d in ("H", "W") if ext.get(d, 1) > 1]
    kernel = case.conv["kernel_size"]
    assume(len(split) == 1 and case.conv.get("padding_mode", "zeros") == "zeros")
    i = ("H", "W").index(split[0])
    assume((kernel[i] - 1) * case.conv["dilation"][i] > 0)
    # rows enough that most ranks have interior rows (a few without: no overlap, still exact)
    size = draw(st.integers(3 * ext[split[0]] * kernel[i], 4 * ext[split[0]] * kernel[i] + 3))
    case = dataclasses.replace(case, **{("height", "width")[i]: size})
    return case, draw(st.booleans())


@settings(max_examples=40, deadline=None, suppress_health_check=RELAXED)
@given(overlapped_cases())
def test_overlapped_layer_equals_the_unoverlapped_one(drawn: tuple[ConvCase, bool]) -> None:
    case, exact = drawn
    ref = integer_reference(case) if exact else reference(case)
    results = run_threads(run_both, case.size, case, ref)
    for res in results:  # ranks without interior rows run the one convolution
        res["pipelined"]["ran pipelined"] = True
    check(case, ref, results, bitwise=exact)


def test_the_overlapped_step_runs_where_a_rank_has_interior_rows() -> None:
    case = ConvCase((("H", 2), ("C", 2)), "stationary-x", 3, 4, 5, 16, 6,
                    {"kernel_size": 3, "padding": 1, "stride": 1, "dilation": (1, 1)})
    ref = integer_reference(case)
    results = run_threads(run_both, case.size, case, ref)
    assert all(r["pipelined"]["ran pipelined"] for r in results)
    check(case, ref, results, bitwise=True)


#: Fixed cases for real worlds (4 ranks): rows and columns split, strides, dilation, a halo
#: reaching across a rank (more halo rows than one neighbour owns)
REAL = [
    ConvCase((("N", 2), ("H", 2)), "stationary-x", 3, 3, 4, 13, 6,
             {"kernel_size": 3, "padding": 1, "stride": 1, "dilation": (1, 1)}),
    ConvCase((("W", 4),), "stationary-x", 2, 3, 4, 5, 23,
             {"kernel_size": (3, 5), "padding": 2, "stride": (1, 2), "dilation": (1, 1)}),
    ConvCase((("C", 2), ("H", 2)), "stationary-w", 2, 4, 4, 17, 5,
             {"kernel_size": 3, "padding": 2, "stride": 1, "dilation": (2, 1)}),
]


def run_real(comm) -> list[dict]:  # noqa: ANN001
    return [run_both(comm, case, ref(case)) for case in REAL
            for ref in (integer_reference, reference)]


def _check_real(per_rank: list[list[dict]]) -> None:
    for i, case in enumerate(REAL):
        for j, (ref, exact) in enumerate(((integer_reference, True), (reference, False))):
            check(case, ref(case), [rank[2 * i + j] for rank in per_rank], bitwise=exact)


@pytest.mark.gloo
def test_overlapped_layers_on_gloo(gloo4) -> None:  # noqa: ANN001
    _check_real(gloo4.run(run_real))


@pytest.mark.mpi
def test_overlapped_layers_on_mpi(mpi4) -> None:  # noqa: ANN001
    _check_real(mpi4.run(run_real))


def _volume(comm, conv: nn.Module, shape: tuple, grid: dict, overlap: bool):  # noqa: ANN001
    g = ProcessorGrid(grid, comm=comm)
    layer = DistConvNd.from_module(conv, grid=g, algorithm="stationary-x", overlap=overlap)
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(-3, 4, shape, generator=gen).double()
    y_shape = layer.output_shape(shape)
    dy = torch.randint(-3, 4, y_shape, generator=gen).double()
    xl = x[layer.input_dist.local_slices(shape, g)].clone().requires_grad_(True)
    y = layer(xl, shape)
    y.backward(dy[layer.output_dist.local_slices(y_shape, g)])
    return y.detach(), xl.grad, layer.weight.grad, layer.bias.grad, comm.stats.snapshot()["bytes"]


@pytest.mark.parametrize("conv, shape, grid", [
    (nn.Conv3d(2, 3, 3, padding=1), (2, 2, 11, 4, 3), {"D": 2, "N": 2}),
    (nn.Conv1d(3, 2, 5, padding=2, stride=2), (3, 3, 29), {"W": 3}),
])
def test_an_overlapped_volume_or_signal_layer_equals_the_unoverlapped_one(
        conv, shape, grid) -> None:  # noqa: ANN001
    conv = conv.double()
    size = 1
    for e in grid.values():
        size *= e
    plain = run_threads(_volume, size, conv, shape, grid, False)
    over = run_threads(_volume, size, conv, shape, grid, True)
    for a, b in zip(plain, over):
        for u, v in zip(a[:4], b[:4]):
            assert torch.equal(u, v)
        assert a[4] == b[4]


@pytest.mark.parametrize("grid, kw, message", [
    ({"N": 2}, {}, "splits 0 of H, W"),
    ({"H": 2, "W": 2}, {}, "splits 2 of H, W"),
    ({"H": 2}, {"padding_mode": "reflect", "padding": 1}, "pads with 'reflect'"),
    ({"H": 2}, {"kernel_size": (1, 3)}, "reads one row there"),
])
def test_overlap_without_one_split_dim_to_overlap_is_refused(grid, kw, message) -> None:  # noqa: ANN001
    def build(comm):  # noqa: ANN001, ANN202
        options = {"kernel_size": 3, **kw}
        with pytest.raises(ValueError, match=message):
            DistConv2d(4, 4, options.pop("kernel_size"), grid=ProcessorGrid(grid, comm=comm),
                       algorithm="stationary-x", overlap=True, **options)
        with pytest.raises(TypeError, match="overlap must be a bool"):
            DistConv2d(4, 4, 3, grid=ProcessorGrid(grid, comm=comm), algorithm="stationary-x",
                       overlap=1)
    run_threads(build, 2 if len(grid) == 1 else 4)


def test_repr_shows_the_overlap() -> None:
    reprs = run_threads(lambda c: repr(DistConv2d(4, 4, 3, grid=ProcessorGrid({"H": 2}, comm=c),
                                                  algorithm="stationary-x", overlap=True)), 2)
    assert "overlap=True" in reprs[0]


# ------------------------------------------------------------------ in a parallelized network
#: a ResNet over N×H, every convolution with a halo overlapping it (the default entry's overlap
#: applies where it can: not to the 1×1 convolutions)
OVERLAP_CONFIG = {"default": {"grid": {"N": 2, "H": 2}, "algorithm": "spatial",
                              "overlap": True},
                  "data": {"N": 2, "H": 2}}


def _network_run(comm, case: tuple, explained: list) -> dict:  # noqa: ANN001
    from tests.test_conv_nd import unet_run

    return unet_run(comm, explained, case, OVERLAP_CONFIG)


def test_a_network_with_overlapped_halos_trains_as_one_process_moving_what_explain_says(
) -> None:
    from distconv import models
    from distconv.parallel import parallelize
    from distconv.parallel.explain import explain
    from tests.test_conv_nd import _check_unet

    torch.manual_seed(11)
    model = models.resnet_mini(base=4).double()
    gen = torch.Generator().manual_seed(12)
    x = torch.randn((4, 3, 32, 24), generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (4,), generator=gen)
    plan = explain(model, OVERLAP_CONFIG, tuple(x.shape), world_size=4)
    notes = {lay.name: lay.note for lay in plan.layers if lay.kind == "conv"}
    assert notes["conv1"] == "halo overlapped" and notes["layer1.0.conv1"] != "halo overlapped"
    explained = [tuple(plan.rank_bytes(r).values()) for r in range(4)]
    _check_unet(run_threads(_network_run, 4, (model, x, y), explained))
    built = run_threads(lambda c: {n: m.overlap for n, m in parallelize(
        copy.deepcopy(model), OVERLAP_CONFIG, comm=c).named_modules()
        if hasattr(m, "overlap")}, 4)[0]
    assert built["conv1"] and not built["layer1.0.conv1"]


@pytest.mark.parametrize("config, message", [
    ({"layers": [{"match": "layer1.0.conv1", "grid": {"N": 2, "H": 2}, "algorithm": "spatial",
                  "overlap": True}]}, "layer1.0.conv1.*asks for overlap"),
    ({"default": {"grid": {"N": 4}, "algorithm": "sample", "overlap": True}},
     "splits no spatial dim"),
    ({"default": {"grid": {"H": 4}, "algorithm": "spatial", "overlap": "yes"}},
     "overlap must be true or false"),
])
def test_overlap_where_nothing_can_overlap_is_refused_naming_the_entry(config, message) -> None:  # noqa: ANN001
    from distconv import models
    from distconv.parallel.explain import explain

    model = models.resnet_mini(base=4)
    with pytest.raises(ValueError, match=message):
        explain(model, config, (4, 3, 32, 24), world_size=4)


def test_the_seconds_an_overlapped_layer_hides_are_priced_by_hand() -> None:
    """On a flat machine the hidden seconds are min(halo, interior share × local conv), forward
    and backward, and the timeline's step is shorter by exactly them."""
    from distconv import models
    from distconv.conv_geometry import ConvDim, HaloPlan
    from distconv.nn.halo_conv import interior_share
    from distconv.parallel.explain import explain
    from distconv.perfmodel import Machine

    machine = Machine(alpha=1e-4, beta=1e-9, flop_rate=1e9)
    model = models.resnet_mini(base=4)
    shape = (4, 3, 32, 24)
    plain = explain(model, {"default": {"grid": {"N": 2, "H": 2}, "algorithm": "spatial"},
                            "data": {"N": 2, "H": 2}}, shape, world_size=4, machine=machine)
    over = explain(model, OVERLAP_CONFIG, shape, world_size=4, machine=machine)
    a = next(lay for lay in plain.layers if lay.name == "conv1")
    b = next(lay for lay in over.layers if lay.name == "conv1")
    # conv1: 3×3, stride 2, padding 1 over 32 rows split in 2; the interior share written out:
    # rank 0 owns rows 0-15 (+1 padding row before): outputs 0..7 read rows 2o-1..2o+1, the
    # interior ones (windows in rows 0..15) are 1..7 of 8; rank 1 (rows 16-31) reads one halo
    # row (15) for output 8: interior 9..15, 7 of 8
    plan = HaloPlan(ConvDim(32, 3, 2, 1, 1, 1), 2, "zeros")
    assert [interior_share(plan, r, 3, 2, 1) for r in (0, 1)] == [7 / 8, 7 / 8]
    assert not a.overlap and set(b.overlap) == {"forward", "backward"}
    from distconv.perfmodel import ConvProblem, conv_cost

    conv = model.conv1
    cost = conv_cost(ConvProblem(4, 3, conv.out_channels, 32, 24, 3, 2, 1, bias=False),
                     {"N": 2, "H": 2}, "stationary-x", machine)
    halo = {ph: sum(v for k, v in cost.steps.items() if k.startswith(f"halo {ph}"))
            for ph in ("exchange", "accumulate")}
    assert halo["exchange"] > 0 and halo["accumulate"] > 0
    local_f = cost.steps["local conv forward"]
    local_b = cost.steps["local conv backward (data + filter)"]
    assert b.overlap["forward"] == pytest.approx(min(halo["exchange"], 7 / 8 * local_f))
    assert b.overlap["backward"] == pytest.approx(min(halo["accumulate"], 7 / 8 * local_b))
    hidden = sum(lay.overlap.get(p, 0.0) for lay in over.layers for p in ("forward", "backward"))
    assert over.timeline().step < plain.timeline().step
    assert over.timeline().forward + over.timeline().backward == pytest.approx(
        plain.timeline().forward + plain.timeline().backward - hidden)


VOLUME_CONFIG = {"default": {"grid": {"N": 2, "D": 2}, "algorithm": "spatial", "overlap": True},
                 "data": {"N": 2, "D": 2}}


def _volume_run(comm, case: tuple, explained: list) -> dict:  # noqa: ANN001
    from tests.test_conv_nd import unet_run

    return unet_run(comm, explained, case, VOLUME_CONFIG)


def test_a_volume_network_with_overlapped_halos_trains_as_one_process_priced_by_explain(
) -> None:
    from distconv import models
    from distconv.parallel.explain import explain
    from distconv.perfmodel import Machine
    from tests.test_conv_nd import _check_unet

    torch.manual_seed(13)
    model = models.cosmoflow_mini().double()
    gen = torch.Generator().manual_seed(14)
    x = torch.randn((4, 4, 8, 8, 8), generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (4,), generator=gen)
    machine = Machine(alpha=1e-4, beta=1e-9, flop_rate=1e9)
    plan = explain(model, VOLUME_CONFIG, tuple(x.shape), world_size=4, machine=machine)
    convs = {lay.name: lay for lay in plan.layers if lay.note == "halo overlapped"}
    assert sorted(convs) == ["features.0", "features.4"]
    # features.0: 8 rows of depth over 2 ranks, 4 each, a 3-row window: interior rows exist
    # (the first layer has no input gradient, so nothing to hide in backward); features.4
    # (after pooling): 2 rows each, fewer than a window, so no row is interior and nothing hides
    first, second = convs["features.0"].overlap, convs["features.4"].overlap
    assert 0 < first["forward"] <= convs["features.0"].forward_seconds and not first["backward"]
    assert second["forward"] == second["backward"] == 0
    explained = [tuple(plan.rank_bytes(r).values()) for r in range(4)]
    _check_unet(run_threads(_volume_run, 4, (model, x, y), explained))
