"""Redistribution executed on in-process ranks: round trips, adjoints, gradients and traffic."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.redistribute import (
    gather, plan_redistribution, redistribute, repartition, scatter,
)
from distconv.testing import run_threads
from tests.strategies import redistribution_cases

FP64_TOL = dict(rtol=1e-12, atol=1e-12)


def _pending_weight(grid: ProcessorGrid, dist: Dist) -> float:
    """A share for this rank's partial value; the shares over each pending segment sum to 1."""
    q, total = 0, 1
    for name in grid.names:
        if name in dist.pending:
            q, total = q * grid.extent(name) + grid.coords[name], total * grid.extent(name)
    return (q + 1) / (total * (total + 1) / 2)


def make_local(x_global: torch.Tensor, grid: ProcessorGrid, dist: Dist) -> torch.Tensor:
    """This rank's block of ``x_global`` in ``dist``, split into uneven partials over pending dims."""
    block = x_global[dist.local_slices(x_global.shape, grid)].clone()
    return block * _pending_weight(grid, dist)


def roundtrip(comm, layout, shape, src, dst, seed):
    grid = ProcessorGrid(dict(layout), comm=comm)
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    local = make_local(x, grid, src)
    before = grid.bytes_received()
    moved = redistribute(local, grid, src, dst, shape)
    traffic = grid.bytes_received() - before
    predicted = plan_redistribution(grid.layout, src, dst, shape).received_bytes(grid, 8)
    assert tuple(moved.shape) == dst.local_shape(shape, grid)
    back = gather(moved, dst, grid, shape)
    return x, back, traffic, predicted


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(redistribution_cases(), st.integers(0, 2**16))
def test_redistribute_roundtrip_is_identity(case, seed):
    layout, shape, src, dst = case
    size = math.prod(e for _, e in layout)
    for x, back, traffic, predicted in run_threads(roundtrip, size, layout, shape, src, dst, seed):
        torch.testing.assert_close(back, x, **FP64_TOL)
        assert traffic >= predicted  # gather adds its own traffic
    # the plan's traffic alone, counted by the communicators
    def only_plan(comm):
        grid = ProcessorGrid(dict(layout), comm=comm)
        x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        local = make_local(x, grid, src)
        before = grid.bytes_received()
        redistribute(local, grid, src, dst, shape)
        plan = plan_redistribution(grid.layout, src, dst, shape)
        return grid.bytes_received() - before, plan.received_bytes(grid, 8)

    for counted, predicted in run_threads(only_plan, size):
        assert counted == predicted


def adjoint_pairing(comm, layout, shape, src, dst, seed):
    """Local pieces of <F x, y> and <x, F* y> for random local x, y (any values, not consistent)."""
    grid = ProcessorGrid(dict(layout), comm=comm)
    g = torch.Generator().manual_seed(seed * 101 + comm.rank)
    x = torch.randn(src.local_shape(shape, grid), dtype=torch.float64, generator=g)
    y = torch.randn(dst.local_shape(shape, grid), dtype=torch.float64, generator=g)
    x.requires_grad_(True)
    fx = redistribute(x, grid, src, dst, shape)
    fx.backward(y)
    return float((fx.detach() * y).sum()), float((x * x.grad).sum().detach())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(redistribution_cases(), st.integers(0, 2**16))
def test_every_plan_is_adjoint_to_its_backward(case, seed):
    layout, shape, src, dst = case
    size = math.prod(e for _, e in layout)
    pieces = run_threads(adjoint_pairing, size, layout, shape, src, dst, seed)
    lhs, rhs = sum(p[0] for p in pieces), sum(p[1] for p in pieces)
    assert math.isclose(lhs, rhs, rel_tol=1e-12, abs_tol=1e-12)


def finite_difference_check(comm, layout, shape, src, dst):
    """fp64 gradient check over the product space of all ranks' local inputs.

    The scalar is L = sum over ranks of <F(x)_r, v_r>; for every rank r0 and element k, all ranks
    run F with only x_{r0}[k] perturbed, and the central difference of L must equal the gradient
    that backward left in x_{r0}.grad[k]."""
    grid = ProcessorGrid(dict(layout), comm=comm)
    g = torch.Generator().manual_seed(7 + comm.rank)
    x = torch.randn(src.local_shape(shape, grid), dtype=torch.float64, generator=g)
    v = torch.randn(dst.local_shape(shape, grid), dtype=torch.float64, generator=g)
    xg = x.clone().requires_grad_(True)
    redistribute(xg, grid, src, dst, shape).backward(v)
    sizes = comm.allgather(torch.tensor([x.numel()]))
    worst, eps = 0.0, 1e-6
    for r0 in range(comm.size):
        for k in range(int(sizes[r0])):
            values = []
            for sign in (1.0, -1.0):
                xp = x.clone()
                if comm.rank == r0:
                    xp.view(-1)[k] += sign * eps
                local = float((redistribute(xp, grid, src, dst, shape) * v).sum())
                values.append(float(comm.allreduce(torch.tensor([local], dtype=torch.float64))))
            numeric = (values[0] - values[1]) / (2 * eps)
            analytic = float(comm.broadcast(
                xg.grad.reshape(-1)[k:k + 1].clone() if comm.rank == r0
                else torch.zeros(1, dtype=torch.float64), root=r0))
            worst = max(worst, abs(numeric - analytic))
    return worst


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(redistribution_cases(max_size=4))
def test_gradients_match_finite_differences_fp64(case):
    layout, shape, src, dst = case
    shape = tuple(min(n, 3) for n in shape)
    size = math.prod(e for _, e in layout)
    assert max(run_threads(finite_difference_check, size, layout, shape, src, dst)) < 1e-7


def scatter_gather(comm, layout, dist, x):
    grid = ProcessorGrid(dict(layout), comm=comm)
    return gather(scatter(x, dist, grid), dist, grid, x.shape)


@settings(max_examples=30, deadline=None)
@given(redistribution_cases(), st.integers(0, 100))
def test_gather_of_scatter_is_identity(case, seed):
    layout, shape, src, _ = case
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    for out in run_threads(scatter_gather, math.prod(e for _, e in layout), layout, src, x):
        torch.testing.assert_close(out, x, **FP64_TOL)


def between_grids(comm, layout_a, dist_a, layout_b, dist_b, shape, seed):
    grid_a = ProcessorGrid(dict(layout_a), comm=comm)
    grid_b = ProcessorGrid(dict(layout_b), comm=comm)
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    local = make_local(x, grid_a, dist_a).requires_grad_(True)
    moved = repartition(local, grid_a, dist_a, grid_b, dist_b, shape)
    g = torch.Generator().manual_seed(seed + 1 + comm.rank)
    y = torch.randn(moved.shape, dtype=torch.float64, generator=g)
    moved.backward(y)
    pairing = (float((moved.detach() * y).sum()), float((local.detach() * local.grad).sum()))
    return x, gather(moved.detach(), dist_b, grid_b, shape), pairing


@st.composite
def two_grid_cases(draw):
    from tests.strategies import dists_on

    size = draw(st.sampled_from([2, 4, 6, 8]))
    layouts = []
    for names in (("P", "Q"), ("S", "T")):
        a = draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
        layouts.append(((names[0], a), (names[1], size // a)))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0, 6)) for _ in range(ndim))
    return (layouts[0], draw(dists_on(layouts[0], ndim)), layouts[1],
            draw(dists_on(layouts[1], ndim)), shape)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(two_grid_cases(), st.integers(0, 100))
def test_repartition_between_grids_is_exact_and_adjoint(case, seed):
    layout_a, dist_a, layout_b, dist_b, shape = case
    size = math.prod(e for _, e in layout_a)
    results = run_threads(between_grids, size, layout_a, dist_a, layout_b, dist_b, shape, seed)
    for x, back, _ in results:
        torch.testing.assert_close(back, x, **FP64_TOL)
    lhs = sum(r[2][0] for r in results)
    rhs = sum(r[2][1] for r in results)
    assert math.isclose(lhs, rhs, rel_tol=1e-12, abs_tol=1e-12)


def test_wrong_local_shape_names_the_rank():
    def bad(comm):
        grid = ProcessorGrid({"P": 2}, comm=comm)
        redistribute(torch.zeros(3), grid, Dist(("P",)), Dist((None,)), (4,))

    with pytest.raises(ValueError, match=r"local block has shape \(3,\).*gives rank"):
        run_threads(bad, 2)


def test_a_redistribution_seen_before_is_still_checked():
    """The second call with the same grid, distributions and global shape reuses the first
    call's plan; a block of another shape, or a global shape of floats, is still refused."""
    def seen(comm):
        grid = ProcessorGrid({"P": 2}, comm=comm)
        src, dst = Dist(("P",)), Dist((None,))
        x = torch.arange(2.0) + 2 * comm.rank
        first = redistribute(x, grid, src, dst, (4,))
        again = redistribute(x + 1, grid, src, dst, (4,))
        errors = []
        for args in ((torch.zeros(3), (4,)), (x, (4.0,))):
            try:
                redistribute(args[0], grid, src, dst, args[1])
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        return first, again, errors

    for first, again, errors in run_threads(seen, 2):
        assert torch.equal(first, torch.arange(4.0)) and torch.equal(again, torch.arange(4.0) + 1)
        assert "local block has shape (3,)" in errors[0]
        assert "global_shape" in errors[1] and len(errors) == 2


def test_a_repartition_seen_before_is_still_checked():
    """The same for a move between two grids: the second call reuses the first's plan; a
    block of another shape, or a target grid over other ranks, is still refused."""
    def seen(comm):
        rows, cols = ProcessorGrid({"R": 2, "S": 1}, comm=comm), ProcessorGrid({"S": 2}, comm=comm)
        src, dst = Dist(("R", None)), Dist((None, "S"))
        x = torch.arange(4.0).view(2, 2) + 4 * comm.rank  # rows 2r, 2r+1 of arange(8).view(4, 2)
        first = repartition(x, rows, src, cols, dst, (4, 2))
        again = repartition(x + 1, rows, src, cols, dst, (4, 2))
        errors = []
        other = ProcessorGrid({"S": 2}, comm=comm.split([[0, 1]]))
        for y, target in ((torch.zeros(3, 2), cols), (x, other)):
            try:
                repartition(y, rows, src, target, dst, (4, 2))
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        return first, again, errors

    for rank, (first, again, errors) in enumerate(run_threads(seen, 2)):
        column = torch.arange(8.0).view(4, 2)[:, rank:rank + 1]
        assert torch.equal(first, column) and torch.equal(again, column + 1)
        assert "local block has shape (3, 2)" in errors[0]
        assert "same communicator" in errors[1] and len(errors) == 2


def disagreeing_ranks(comm):
    grid = ProcessorGrid({"P": 2}, comm=comm)
    src = Dist(("P", None))
    dst = Dist((None, None)) if comm.rank == 0 else Dist((None, "P"))  # rank 1 is wrong
    x = torch.zeros(src.local_shape((4, 4), grid))
    return redistribute(x, grid, src, dst, (4, 4))


def test_debug_mode_names_disagreeing_distributions():
    from distconv.comm import CollectiveMismatchError, set_debug

    set_debug(True)
    try:
        with pytest.raises(CollectiveMismatchError, match=r"(?s)allgather.*\[o_P,\*\] -> \[\*,\*\]"):
            run_threads(disagreeing_ranks, 2, timeout=10)
    finally:
        set_debug(False)


STEP_CASES = {  # one redistribution per step kind, on a 2×2 grid, uneven global shape (3, 5)
    "AllGather": ("[o_P,*]", "[*,*]"),
    "ReduceScatter": ("Σ_P [*,*]", "[o_P,*]"),
    "AllReduce": ("Σ_{P,Q} [*,*]", "[*,*]"),
    "Slice": ("[*,*]", "[*,o_Q]"),
    "Pad": ("[o_P,*]", "Σ_P [*,*]"),
    "AllToAll": ("[o_Q,*]", "[*,o_Q]"),
    "KeepRoot": ("[*,*]", "Σ_Q [*,*]"),
}


@pytest.mark.parametrize("kind", sorted(STEP_CASES))
def test_each_step_is_adjoint_of_its_backward(kind):
    layout, shape = (("P", 2), ("Q", 2)), (3, 5)
    src, dst = (Dist.parse(s) for s in STEP_CASES[kind])
    plan = plan_redistribution(layout, src, dst, shape)
    assert [type(s).__name__ for s in plan.steps] == [kind]
    for seed in range(3):
        pieces = run_threads(adjoint_pairing, 4, layout, shape, src, dst, seed)
        lhs, rhs = sum(p[0] for p in pieces), sum(p[1] for p in pieces)
        assert math.isclose(lhs, rhs, rel_tol=1e-12, abs_tol=1e-12)


def test_unknown_grid_dims_and_wrong_ranks_are_named():
    def bad_dst(comm):
        grid = ProcessorGrid({"P": 2}, comm=comm)
        redistribute(torch.zeros(2, 4), grid, Dist(("P", None)), Dist(("Z", None)), (4, 4))

    with pytest.raises(ValueError, match="grid dim 'Z' is not in the grid"):
        run_threads(bad_dst, 2)

    def bad_ndim(comm):
        grid = ProcessorGrid({"P": 2}, comm=comm)
        redistribute(torch.zeros(2, 4), grid, Dist(("P", None)), Dist((None,)), (4, 4))

    with pytest.raises(ValueError, match=r"has 1 entries but the global shape \(4, 4\) has 2"):
        run_threads(bad_ndim, 2)


def local_moves(comm):
    """Two moves that keep every rank's elements where they are: the same channel blocks on
    grids of other names, and a replica cut to a block; each with its adjoint."""
    f, c = ProcessorGrid({"F": 2}, comm=comm), ProcessorGrid({"C": 2}, comm=comm)
    shape = (3, 5, 2)
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    out = []
    for src, src_grid, dst in ((Dist((None, "F", None)), f, Dist((None, "C", None))),
                               (Dist((None, None, None)), f, Dist((None, "C", None)))):
        local = x[src.local_slices(shape, src_grid)].clone().requires_grad_(True)
        comm.stats.reset()
        moved = repartition(local, src_grid, src, c, dst, shape)
        g = torch.full(moved.shape, 2.0, dtype=torch.float64)
        moved.backward(g)
        calls = sum(comm.stats.snapshot()["calls"].values())
        expected_grad = torch.zeros_like(local)
        # this rank's target block inside its source block gets the cotangent, the rest zeros
        lo = 0 if comm.rank == 0 else 3
        n = 3 if comm.rank == 0 else 2
        if src.entries[1] is None:
            expected_grad[:, lo:lo + n] = 2.0
        else:
            expected_grad += 2.0
        out.append((calls, torch.equal(moved, x[:, lo:lo + n]),
                    torch.equal(local.grad, expected_grad)))
    return out


def test_a_repartition_that_moves_nothing_runs_no_collective():
    """Blocks that are already where the target grid wants them (channel-split activations
    passed from a filter-split layer's grid to a channel-split layer's) are taken as they are,
    and a replicated source is cut locally: no collective, forward or backward."""
    for rank_results in run_threads(local_moves, 2):
        for calls, values, grads in rank_results:
            assert (calls, values, grads) == (0, True, True)
