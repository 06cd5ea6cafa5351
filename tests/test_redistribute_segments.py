"""Repartitions between grids run among the ranks that exchange data: the send graph's groups,
each on its own segment communicator, all at once; exact (fp64) forward and adjoint, the bytes
of the whole-world exchange, and a dead peer in a segment still an exception."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from distconv.comm import CommError
from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.parallel.placement import Placement, one_grid
from distconv.pricing.segments import conversion_segment, conversion_segments
from distconv.redistribute import _repartition_plan, gather, repartition
from distconv.redistribute import between_grids
from distconv.testing import run_threads
from tests.test_redistribute import two_grid_cases

FP64_TOL = dict(rtol=1e-12, atol=1e-12)

# activations [N, C, H, W]: spatial {N: 2, H: 2} -> stationary-x {N: 2, C: 2}
SPATIAL = (("N", 2), ("H", 2))
CHANNELS = (("N", 2), ("C", 2))
X_SPATIAL = Dist(("N", None, "H", None), tensor_dims="NCHW")
X_CHANNELS = Dist(("N", "C", None, None), tensor_dims="NCHW")


def test_the_groups_of_a_conversion_that_splits_samples_alike_are_its_sample_rows():
    """Both grids put N major: rank 2n + k holds sample block n on either, so each N row trades
    with itself only (written out by hand: ranks {0, 1} hold samples 0-1, {2, 3} samples 2-4)."""
    plan = _repartition_plan(SPATIAL, X_SPATIAL, CHANNELS, X_CHANNELS, (5, 3, 4, 2))
    assert plan.groups == ((0, 1), (2, 3))
    assert plan.group_of(3) == (2, 3)
    # 8 ranks, the case: {N: 2, H: 4} -> {N: 2, C: 4}, two rows of four
    plan = _repartition_plan((("N", 2), ("H", 4)), X_SPATIAL, (("N", 2), ("C", 4)), X_CHANNELS,
                             (4, 8, 8, 2))
    assert plan.groups == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_a_conversion_whose_data_crosses_every_row_is_one_group():
    """Samples split over 4 ranks to samples over 2 and rows over 2: ranks 0 and 1 (samples
    0-1 in the target) read from source ranks 0 and 1; 2 and 3 from 2 and 3 -- two groups; but
    channels over 4 to samples over 4 crosses every rank: one group."""
    samples = Dist(("N", None, None, None), tensor_dims="NCHW")
    plan = _repartition_plan((("N", 4),), samples, SPATIAL, X_SPATIAL, (4, 2, 4, 2))
    assert plan.groups == ((0, 1), (2, 3))
    channels = Dist((None, "C", None, None), tensor_dims="NCHW")
    plan = _repartition_plan((("C", 4),), channels, (("N", 4),), samples, (4, 4, 2, 2))
    assert plan.groups == ((0, 1, 2, 3),)


def converted(comm, src_layout, src, dst_layout, dst, shape, seed, whole_world=False):
    """This rank's converted block (gathered), the adjoint pairing, the bytes received and the
    group sizes of the collectives the conversion called, forward and backward."""
    between_grids._WHOLE_WORLD = whole_world
    a, b = ProcessorGrid(dict(src_layout), comm=comm), ProcessorGrid(dict(dst_layout), comm=comm)
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    local = x[src.local_slices(shape, a)].clone().requires_grad_(True)
    repartition(local.detach(), a, src, b, dst, shape)  # the segments made (once)
    before = comm.stats.total_bytes()
    with comm.stats.journal() as calls:
        moved = repartition(local, a, src, b, dst, shape)
        y = torch.randn(moved.shape, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(seed + 1 + comm.rank))
        moved.backward(y)
    moved_bytes = comm.stats.total_bytes() - before
    pairing = (float((moved.detach() * y).sum()), float((local.detach() * local.grad).sum()))
    return (x, gather(moved.detach(), dst, b, shape), pairing, moved_bytes,
            [(op, size) for op, size, _ in calls], local.grad)


@pytest.mark.parametrize("case", [
    # uneven blocks: 5 samples over 2 rows, 7 rows over 4, 3 channels over 4 (one empty)
    ((("N", 2), ("H", 4)), X_SPATIAL, (("N", 2), ("C", 4)), X_CHANNELS, (5, 3, 7, 2), 4),
    # a replicated source (rows over H, replicated over R) to channel blocks: target 4n + c
    # reads row block h from replica r = c % 2, rank 4n + 2h + r, so {4n, 4n + 2} and
    # {4n + 1, 4n + 3} trade: segments of 2 of the 8 ranks
    ((("N", 2), ("H", 2), ("R", 2)), X_SPATIAL, (("N", 2), ("C", 4)), X_CHANNELS, (5, 6, 3, 2),
     2),
    # 5 samples over 4 ranks ([2, 1, 1, 1]) to whole copies on every rank: rank 0 sends its
    # 2 samples to all 4 (8 sample slices), more than any rank receives (5), and the adjoint
    # sums the 4 copies' gradients
    ((("N", 4),), Dist(("N", None, None, None), tensor_dims="NCHW"), (("R", 4),),
     Dist((None, None, None, None), tensor_dims="NCHW"), (5, 2, 3, 2), 4),
    # stationary-x to stationary-y, sample rows of 2 (the chain)
    (CHANNELS, X_CHANNELS, (("N", 2), ("F", 2)), Dist(("N", None, "F", None), tensor_dims="NCHW"),
     (3, 5, 3, 2), 2),
])
def test_a_segmented_conversion_is_exact_adjoint_and_moves_the_whole_worlds_bytes(case):
    src_layout, src, dst_layout, dst, shape, segment = case
    size = math.prod(e for _, e in src_layout)
    ours = run_threads(converted, size, src_layout, src, dst_layout, dst, shape, 3)
    try:
        before = run_threads(converted, size, src_layout, src, dst_layout, dst, shape, 3,
                             whole_world=True)
    finally:
        between_grids._WHOLE_WORLD = False
    for (x, back, _, nbytes, calls, grad), (_, _, _, old_bytes, old_calls, old_grad) in zip(
            ours, before):
        torch.testing.assert_close(back, x, **FP64_TOL)
        assert nbytes == old_bytes  # each rank receives what it did over the whole world
        torch.testing.assert_close(grad, old_grad, rtol=0, atol=0)
        # one all-to-all forward, one back, each among the segment's ranks, not the world's
        assert calls == [("alltoall", segment)] * 2
        assert old_calls == [("alltoall", size)] * 2
    lhs, rhs = sum(r[2][0] for r in ours), sum(r[2][1] for r in ours)
    assert math.isclose(lhs, rhs, rel_tol=1e-12, abs_tol=1e-12)


def test_the_segment_communicators_are_made_once_by_every_rank():
    """The first conversion makes its segments by one split of the whole partition (every rank,
    the same call); the adjoint and every later conversion with the same groups reuse it."""
    def run(comm):
        a, b = ProcessorGrid(dict(SPATIAL), comm=comm), ProcessorGrid(dict(CHANNELS), comm=comm)
        shape = (4, 2, 4, 2)
        x = torch.ones(X_SPATIAL.local_shape(shape, a), dtype=torch.float64, requires_grad=True)
        with comm.stats.journal() as calls:
            for _ in range(3):
                repartition(x, a, X_SPATIAL, b, X_CHANNELS, shape).sum().backward()
            # the way back, another plan with the same groups: no new split
            y = torch.ones(X_CHANNELS.local_shape(shape, b), dtype=torch.float64)
            repartition(y, b, X_CHANNELS, a, X_SPATIAL, shape)
        return [(op, size) for op, size, _ in calls]

    for calls in run_threads(run, 4):
        assert calls == [("split", 4)] + [("alltoall", 2)] * 7


def test_a_dead_peer_in_a_segment_ends_in_an_exception():
    """Rank 3 stops after the first conversion; its segment's other rank (2) waits for it and
    times out with an exception, while the other segment (0, 1) converts unhindered."""
    def run(comm):
        a, b = ProcessorGrid(dict(SPATIAL), comm=comm), ProcessorGrid(dict(CHANNELS), comm=comm)
        shape = (4, 2, 4, 2)
        x = torch.ones(X_SPATIAL.local_shape(shape, a), dtype=torch.float64)
        repartition(x, a, X_SPATIAL, b, X_CHANNELS, shape)
        if comm.rank == 3:
            return "stopped"
        repartition(x, a, X_SPATIAL, b, X_CHANNELS, shape)
        return "converted"

    with pytest.raises(CommError, match=r"rank 2"):
        run_threads(run, 4, timeout=3)


def test_a_mismatched_peer_in_a_segment_ends_in_an_exception():
    """Rank 1 converts another tensor (a different plan) while rank 0, its segment's peer,
    converts the usual one: the ranks disagree on the partition or the exchange and the run
    ends in an exception, never a hang."""
    def run(comm):
        a, b = ProcessorGrid(dict(SPATIAL), comm=comm), ProcessorGrid(dict(CHANNELS), comm=comm)
        shape = (4, 2, 4, 2) if comm.rank != 1 else (4, 2, 6, 2)
        x = torch.ones(X_SPATIAL.local_shape(shape, a), dtype=torch.float64)
        repartition(x, a, X_SPATIAL, b, X_CHANNELS, shape)
        return "converted"

    with pytest.raises(CommError):
        run_threads(run, 4, timeout=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(two_grid_cases())
def test_the_priced_segment_is_the_executed_one(case):
    """The price's segments (closed form, from one rank outwards) are the executor's groups
    (the send graph of the whole plan), rank by rank."""
    layout_a, dist_a, layout_b, dist_b, shape = case
    dist_a, dist_b = dist_a.with_pending(()), dist_b.with_pending(())
    src, dst = Placement(layout_a, dist_a), Placement(layout_b, dist_b)
    if one_grid(src, dst, shape) != src or src == dst:
        return  # a one-grid redistribution: its segments are grid dims (below)
    plan = _repartition_plan(src.layout, src.dist, dst.layout, dst.dist, shape)
    size = math.prod(e for _, e in layout_a)
    for r in range(size):
        assert conversion_segment(src, dst, shape, r) == plan.group_of(r)


def test_a_one_grid_conversion_runs_over_its_steps_grid_dims():
    """On one grid the segment is the ranks that differ only in the dims the steps run over:
    an allgather over C on {N: 2, C: 2} is rows {0, 1} and {2, 3}; a slice moves nothing."""
    gathered = Placement(CHANNELS, Dist(("N", None, None, None), tensor_dims="NCHW"))
    split = Placement(CHANNELS, X_CHANNELS)
    shape = (4, 4, 2, 2)
    assert [conversion_segment(split, gathered, shape, r) for r in range(4)] == [
        (0, 1), (0, 1), (2, 3), (2, 3)]
    assert conversion_segments(gathered, split, shape, range(4)) == ()


def test_a_one_grid_all_to_all_runs_among_the_ranks_of_its_grid_dim():
    """On {N: 2, C: 2} (rank 2n + c) channels over C to rows over C is one all-to-all over C:
    the ranks of a sample row, {0, 1} and {2, 3}; samples over N to rows over N is one over N:
    the columns {0, 2} and {1, 3}."""
    shape = (4, 4, 2, 2)
    split = Placement(CHANNELS, X_CHANNELS)
    rows_over_c = Placement(CHANNELS, Dist(("N", None, "C", None), tensor_dims="NCHW"))
    rows_over_n = Placement(CHANNELS, Dist((None, "C", "N", None), tensor_dims="NCHW"))
    assert [conversion_segment(split, rows_over_c, shape, r) for r in range(4)] == [
        (0, 1), (0, 1), (2, 3), (2, 3)]
    assert [conversion_segment(split, rows_over_n, shape, r) for r in range(4)] == [
        (0, 2), (1, 3), (0, 2), (1, 3)]


def test_explain_names_each_conversions_segment_and_its_machine_level():
    """The issue's case on 8 ranks: {N: 2, H: 4} then {N: 2, C: 4}; each N row (4 ranks, one
    Lassen node) converts on its own, and the row says so; the bytes are the exchange's."""
    from torch import nn

    from distconv.parallel.explain import explain

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            return self.b(self.a(x)).mean((2, 3))

    config = {"default": {"grid": {"N": 2, "H": 4}, "algorithm": "spatial"},
              "data": {"N": 2, "H": 4},
              "layers": [{"match": "b", "grid": {"N": 2, "C": 4}, "algorithm": "stationary-x"}]}
    text = " ".join(str(explain(Two(), config, (4, 8, 8, 8), world_size=8,
                                machine="lassen")).split())
    # rank 4n + k holds rows 2k, 2k + 1 of samples 2n, 2n + 1 and gets channels 2k, 2k + 1 of
    # all 8 rows: 2·2·6·8 elements it lacks, of 4 bytes
    assert ("768 B redistribute a: [o,*,o,*] on {N:2,H:4} -> [o,o_C,*,*] on {N:2,C:4} "
            "(4 ranks, one node)") in text, text
    plain = " ".join(str(explain(Two(), config, (4, 8, 8, 8), world_size=8)).split())
    assert "{N:2,C:4} (4 ranks)" in plain


def test_a_segment_is_priced_on_its_own_ranks_and_level():
    """Each segment exchanges on its own: k - 1 latencies of the level it spans (a pairwise
    exchange, one step per peer) and the most bytes any evaluated rank receives over that
    level's bandwidth (the same price whichever ranks a caller evaluates); the step takes its
    slowest segment. Written out by hand on a machine of 4-rank nodes (1 us, 100 GB/s inside,
    10 us and 1 GB/s between nodes, no shared links)."""
    from distconv.machines.base import Level, Machine
    from distconv.pricing.timeline import CommStep

    machine = Machine("two-level", (Level("node", 4, 1e-6, 100e9),
                                    Level("network", 0, 1e-5, 1e9)), 1e12)
    # the most bytes, 8000 B: inside node 0, 1 us + 80 ns; ranks 2 and 6 span two nodes: 10 us
    # for the one step + 8000 B at 1 GB/s (8 us), the slowest segment
    step = CommStep("forward", "x", "redistribute", {0: 8000, 2: 1000}, 2,
                    groups=((0, 1), (2, 6)))
    assert math.isclose(step.seconds(machine), 1e-5 + 8e-6, rel_tol=1e-12)
    # one segment of 4 ranks over two nodes: 3 steps at 10 us + 2000 B at 1 GB/s
    step = CommStep("forward", "x", "redistribute", {0: 2000, 1: 500}, 4,
                    groups=((0, 1, 4, 5),))
    assert math.isclose(step.seconds(machine), 3e-5 + 2e-6, rel_tol=1e-12)
    # the same exchange inside one node: 3 steps at 1 us + 2000 B at 100 GB/s
    step = CommStep("forward", "x", "redistribute", {0: 2000, 1: 500}, 4,
                    groups=((0, 1, 2, 3),))
    assert math.isclose(step.seconds(machine), 3e-6 + 2e-8, rel_tol=1e-12)


def test_a_segment_is_described_by_its_size_and_the_units_it_spans():
    """On Lassen (2 ranks a socket, 4 a node): ranks {0, 1} share a socket, {0..3} a node;
    {0, 4, 8, 12} lie on 4 nodes, {0, 1, 4, 5} on 2 (the largest segment is named)."""
    from distconv.pricing.machine import resolve_machine
    from distconv.pricing.segments import describe_segment

    lassen = resolve_machine("lassen", hierarchical=True)
    assert describe_segment(((0, 1),), lassen) == "2 ranks, one socket"
    assert describe_segment(((0, 1), (2, 3)), lassen) == "2 ranks, one socket"
    assert describe_segment(((0, 1, 2, 3),), lassen) == "4 ranks, one node"
    assert describe_segment(((0, 4, 8, 12),), lassen) == "4 ranks, 4 nodes"
    assert describe_segment(((0, 1, 4, 5), (2, 3)), lassen) == "4 ranks, 2 nodes"
    assert describe_segment((), lassen) == "no exchange"
    assert describe_segment(((0, 4, 8),)) == "3 ranks"


def test_a_conversions_adjoint_is_priced_on_its_forward_segments():
    """The adjoint runs on the forward's segment communicators, so it is priced and named on
    them too: {N: 2, H: 4} -> {N: 2, C: 4} on 8 ranks, each N row (ranks 4n..4n+3, one Lassen
    node) both ways."""
    from torch import nn

    from distconv.parallel.explain import explain

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            return self.b(self.a(x)).mean((2, 3))

    config = {"default": {"grid": {"N": 2, "H": 4}, "algorithm": "spatial"},
              "data": {"N": 2, "H": 4},
              "layers": [{"match": "b", "grid": {"N": 2, "C": 4}, "algorithm": "stationary-x"}]}
    e = explain(Two(), config, (4, 8, 8, 8), world_size=8, machine="lassen")
    steps = [st for lay in e.layers for st in lay.steps if "redistribute a:" in st.what]
    assert [st.phase for st in steps] == ["forward", "backward"]
    for st in steps:
        assert st.groups == ((0, 1, 2, 3), (4, 5, 6, 7)), st
    text = " ".join(str(e).split())
    assert ("768 B adjoint of redistribute a: [o,*,o,*] on {N:2,H:4} -> [o,o_C,*,*] on "
            "{N:2,C:4} (4 ranks, one node)") in text, text
