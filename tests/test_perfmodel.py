"""The performance model: exact bytes per rank (checked against the communicators) and §4 costs."""

from __future__ import annotations

import pytest
import torch

from distconv.grid import ProcessorGrid
from distconv.nn import DistConv2d
from distconv.perfmodel import (
    ConvProblem, Machine, all_coords, choose_algorithm, conv_cost, conv_traffic,
)
from distconv.testing import run_threads
from tests.nn.conv_cases import ConvCase, check_results, reference, run_case

HYBRID = [
    ConvCase((("N", 2), ("C", 2), ("H", 2)), "stationary-x", 3, 5, 7, 9, 6,
             {"kernel_size": 3, "padding": 1}),
    ConvCase((("W", 2), ("F", 3)), "stationary-y", 2, 7, 5, 6, 7,
             {"kernel_size": (2, 4), "padding": "same", "dilation": (1, 2)}),
    ConvCase((("C", 2), ("H", 2), ("F", 2)), "stationary-w", 3, 9, 7, 8, 5,
             {"kernel_size": 3, "stride": 2, "padding": 2}),
    ConvCase((("F", 2), ("C", 3), ("W", 1)), "stationary-w", 1, 7, 11, 4, 4,
             {"kernel_size": 1, "bias": False}),
]


@pytest.mark.parametrize("case", HYBRID, ids=lambda c: f"{c.algorithm}-{dict(c.grid)}")
def test_counted_bytes_equal_model_bytes_for_every_algorithm(case: ConvCase) -> None:
    check_results(case, run_threads(run_case, case.size, case, reference(case)))


def test_stationary_w_bytes_by_hand() -> None:
    # N=2, C=F=8, 4x4, 1x1 kernel on C=2 x F=2, fp32: x block 2 channels, gathered 4; y block 2.
    pb = ConvProblem(2, 8, 8, 4, 4, 1, bias=False)
    t = conv_traffic(pb, {"C": 2, "F": 2}, "stationary-w", {"C": 0, "F": 0})
    assert t.forward == {"allgather x over F": 2 * 2 * 16 * 4,
                         "reduce-scatter y over C": 2 * 2 * 16 * 4}
    assert t.backward == {"allgather dL/dy over C": 256, "reduce-scatter dL/dx over F": 256}


def test_weight_gradient_allreduce_bytes_by_hand() -> None:
    # 10-element weight shard (F=2 x C=5, 1x1) over N=4: ring allreduce, rank 1's block b = 3.
    pb = ConvProblem(4, 5, 2, 3, 3, 1, bias=False)
    t = conv_traffic(pb, {"N": 4}, "stationary-x", {"N": 1}, itemsize=8)
    assert t.backward == {"allreduce dL/dw": (3 * 3 + (10 - 3)) * 8}
    assert t.forward == {}


def _no_input_grad(comm):  # noqa: ANN001, ANN202
    grid = ProcessorGrid({"F": 2, "H": 2}, comm=comm)
    layer = DistConv2d(4, 6, 3, padding=1, grid=grid, algorithm="stationary-y", init_seed=0)
    shape = (2, 4, 6, 6)
    x = torch.randn(layer.local_input_shape(shape))
    comm.stats.reset()
    layer(x, shape).sum().backward()
    pb = ConvProblem(2, 4, 6, 6, 6, 3, padding=1)
    model = conv_traffic(pb, grid.layout, "stationary-y", grid.coords, input_grad=False)
    return {k: v for k, v in comm.stats.snapshot()["bytes"].items() if v}, model.by_op()


def test_model_skips_input_gradient_steps_when_x_needs_no_gradient() -> None:
    for measured, model in run_threads(_no_input_grad, 4):
        assert measured == model and "reduce_scatter" not in model


def test_one_rank_costs_only_the_local_convolution() -> None:
    pb = ConvProblem(8, 128, 128, 28, 28, 3, padding=1)
    m = Machine(alpha=1e-5, beta=1e-9, flop_rate=1e10)
    cost = conv_cost(pb, {"N": 1}, "stationary-x", m)
    assert cost.forward == pytest.approx(pb.flops() / 1e10)
    assert cost.backward == pytest.approx(2 * pb.flops() / 1e10)
    assert conv_traffic(pb, {"N": 1}, "stationary-x", {"N": 0}).by_op() == {}


def test_channel_parallelism_beats_sample_parallelism_at_small_batch_on_wide_layers() -> None:
    # The paper's strong-scaling argument: with N=1, sample parallelism cannot split the work.
    pb = ConvProblem(1, 1024, 1024, 14, 14, 3, padding=1)
    m = Machine(alpha=2e-5, beta=1e-9, flop_rate=2e10)
    grid, algorithm, _ = choose_algorithm(
        pb, [({"N": 1}, "stationary-x"), ({"C": 2}, "stationary-x"), ({"F": 2}, "stationary-y")], m
    )
    assert grid != {"N": 1}
    assert conv_cost(pb, {"C": 2}, "stationary-x", m).total < conv_cost(
        pb, {"N": 1}, "stationary-x", m).total


def test_cost_grows_with_alpha_and_beta() -> None:
    pb = ConvProblem(4, 64, 64, 14, 14, 3, padding=1)
    slow = conv_cost(pb, {"C": 2, "F": 2}, "stationary-w", Machine(alpha=1e-3, beta=1e-8))
    fast = conv_cost(pb, {"C": 2, "F": 2}, "stationary-w", Machine(alpha=1e-6, beta=1e-10))
    assert slow.total > fast.total
    assert len(all_coords({"C": 2, "F": 2})) == 4


def test_unknown_algorithm_raises() -> None:
    with pytest.raises(ValueError, match="algorithm must be one of"):
        conv_traffic(ConvProblem(1, 1, 1, 1, 1, 1), {"C": 1}, "im2col", {})


def _calibrate(comm):  # noqa: ANN001, ANN202
    from distconv.perfmodel import calibrate

    return calibrate(comm, sizes=(1, 4096), repeats=2)


def test_calibration_gives_every_rank_the_same_machine() -> None:
    machines = run_threads(_calibrate, 2)
    assert machines[0] == machines[1]
    assert machines[0].alpha > 0 and machines[0].beta > 0 and machines[0].flop_rate > 0


@pytest.mark.parametrize("grid, algorithm", [
    ({"N": 4, "C": 2}, "stationary-x"), ({"N": 3, "F": 2}, "stationary-y"),
    ({"N": 2, "C": 2, "F": 2}, "stationary-w"), ({"N": 4, "H": 3}, "stationary-x"),
])
def test_the_slowest_rank_is_found_among_the_first_sample_block(grid: dict, algorithm: str
                                                                 ) -> None:
    """conv_cost tries only sample coordinate 0; every rank's cost, counted from its own
    traffic, is no larger (uneven sample blocks, uneven rows, biased allreduce blocks)."""
    from distconv.machines import lassen
    from distconv.perfmodel import all_coords, conv_cost, conv_traffic

    machine = lassen()
    pb = ConvProblem(7, 6, 10, 7, 5, 3, padding=1)
    got = conv_cost(pb, grid, algorithm, machine)
    layout = tuple(grid.items())
    local = got.steps["local conv forward"]
    worst = 0.0
    for coords in all_coords(grid):
        t = conv_traffic(pb, grid, algorithm, coords)
        total = 3 * local + sum(machine.collective_time(t.ops[k], t.peers[k], b, layout=layout,
                                                        dims=t.dims[k])
                                for phase in (t.forward, t.backward) for k, b in phase.items())
        worst = max(worst, total)
    assert got.total == pytest.approx(worst, rel=1e-12)
