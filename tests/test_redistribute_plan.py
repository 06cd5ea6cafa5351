"""The redistribution planner: a pure function, tested without communication."""
from __future__ import annotations

import math
from types import SimpleNamespace

from hypothesis import given, settings

from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.redistribute import (
    AllGather, AllReduce, AllToAll, KeepRoot, Pad, ReduceScatter, Slice, plan_redistribution,
)
from tests.strategies import redistribution_cases


def grids(layout):
    size = math.prod(e for _, e in layout)
    return [ProcessorGrid(dict(layout), comm=SimpleNamespace(rank=r, size=size, backend="none"))
            for r in range(size)]


def total_bytes(plan, layout):
    return sum(plan.received_bytes(g, itemsize=1) for g in grids(layout))


LAYOUT = (("N", 2), ("C", 2))


def steps(src, dst, shape=(4, 6, 3, 3), layout=LAYOUT, dims="NCHW"):
    return plan_redistribution(
        layout, Dist.parse(src, dims), Dist.parse(dst, dims), shape
    ).steps


def test_the_papers_single_collectives():
    assert steps("x[o,o_C,o,o]", "x[o,*,o,o]") == (AllGather(1, "C", ()),)
    assert steps("x[o,*,o,o]", "x[o,o_C,o,o]") == (Slice(1, "C", ()),)
    assert steps("Σ_C x[o,*,o,o]", "x[o,o_C,o,o]") == (ReduceScatter(1, "C", ()),)
    assert steps("Σ_C x[o,*,o,o]", "x[o,*,o,o]") == (AllReduce(("C",)),)
    assert steps("x[o_C,*,o,o]", "x[*,o_C,o,o]") == (AllToAll(0, 1, "C", (), ()),)
    assert steps("x[o,o_C,o,o]", "Σ_C x[o,*,o,o]") == (Pad(1, "C", ()),)
    assert steps("x[o,*,o,o]", "Σ_C x[o,*,o,o]") == (KeepRoot("C"),)


def test_dropping_the_minor_dim_of_a_tuple_is_one_segmented_allgather():
    layout = (("F", 2), ("C", 2))
    assert steps("x[o,o_{C×F},o,o]", "x[o,o_C,o,o]", layout=layout) == (
        AllGather(1, "F", ("C",)),
    )
    assert steps("Σ_C x[o,o_F,o,o]", "x[o,o_{F×C},o,o]", layout=layout) == (
        ReduceScatter(1, "C", ("F",)),
    )


def test_pending_sums_over_several_dims_are_reduced_in_one_allreduce():
    layout = (("N", 2), ("C", 2), ("H", 2))
    assert steps("Σ_{C,H} x[o,*,*,*]", "x[o,*,*,*]", layout=layout) == (AllReduce(("C", "H")),)


def test_size_one_grid_dims_move_nothing():
    assert steps("x[o,o_C,o,o]", "x[*,*,*,*]", layout=(("N", 1), ("C", 1))) == ()


@settings(max_examples=500, deadline=None)
@given(redistribution_cases())
def test_planner_converges_and_never_moves_more_than_gather_then_scatter(case):
    layout, shape, src, dst = case
    plan = plan_redistribution(layout, src, dst, shape)
    replicated = Dist.replicated(len(shape))
    naive = total_bytes(plan_redistribution(layout, src, replicated, shape), layout)
    assert total_bytes(plan, layout) <= naive
    # a plan to the same distribution does nothing
    assert plan_redistribution(layout, src, src, shape).steps == ()


def test_plans_are_cached():
    a = plan_redistribution(LAYOUT, Dist(("N", None)), Dist((None, "C")), (4, 4))
    b = plan_redistribution(LAYOUT, Dist(("N", None)), Dist((None, "C")), (4, 4))
    assert a is b


def test_a_pending_sum_is_reduced_before_a_gather_when_that_moves_less():
    # reduce-scatter over Q after gathering P (3 ranks) would move 84 bytes in all; summing the
    # P-distributed partials first moves 72
    layout = (("P", 3), ("Q", 2))
    plan = plan_redistribution(layout, Dist.parse("Σ_Q [o_P]"), Dist.parse("[o_Q]"), (12,))
    assert plan.steps == (AllReduce(("Q",)), AllGather(0, "P", ()), Slice(0, "Q", ()))
    assert total_bytes(plan, layout) == 72
