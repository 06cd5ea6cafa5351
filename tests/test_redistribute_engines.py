"""The paper's redistributions on real engines: gloo (2 and 4 processes) and MPI (4 ranks).

Each world is started once per session (fixtures in conftest.py); every case below runs inside one
task per world, and each rank returns what the driver checks against the single-process result.
"""
from __future__ import annotations

import math

import torch

from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.redistribute import gather, plan_redistribution, redistribute, repartition

NCHW = "NCHW"
SHAPE = (3, 5, 2, 3)  # uneven on every distributed dim

CASES_4 = [  # (grid layout, src, dst) in the paper's notation
    ((("N", 2), ("C", 2)), "x[o,o_C,o,o]", "x[o,*,o,o]"),            # allgather
    ((("N", 2), ("C", 2)), "x[o,*,o,o]", "x[o,o_C,o,o]"),            # discard
    ((("N", 2), ("C", 2)), "x[*,o_{N×C},o,o]", "x[*,o_N,o,o]"),      # segmented allgather
    ((("N", 2), ("C", 2)), "Σ_C x[o,*,o,o]", "x[o,o_C,o,o]"),        # reduce-scatter
    ((("N", 2), ("C", 2)), "Σ_C x[o,*,o,o]", "x[o,*,o,o]"),          # allreduce
    ((("N", 2), ("C", 2)), "x[o,*,o,o]", "x[*,o_N,o,o]"),            # all-to-all
    ((("N", 2), ("C", 2)), "x[o,o_C,o,o]", "Σ_C x[o,*,o,o]"),        # pad
    ((("N", 2), ("C", 2)), "Σ_{N,C} x[*,*,o,o]", "x[o,o_C,o,o]"),    # two reduce-scatters
    ((("F", 2), ("C", 2)), "x[o,o_{C×F},o,o]", "x[o,o_{F×C},o,o]"),  # transposed nesting
]
CASES_2 = [
    ((("C", 2),), "x[o,o_C,o,o]", "x[o,*,o,o]"),
    ((("C", 2),), "Σ_C x[o,*,o,o]", "x[o,o_C,o,o]"),
    ((("C", 2),), "x[o_C,*,o,o]", "x[*,o_C,o,o]"),
]


def _weight(grid, dist):
    q, total = 0, 1
    for name in grid.names:
        if name in dist.pending:
            q, total = q * grid.extent(name) + grid.coords[name], total * grid.extent(name)
    return (q + 1) / (total * (total + 1) / 2)


def run_cases(comm, cases, dtype=torch.float64):
    """Per case: (max round-trip error, adjoint pairing pieces, counted bytes, predicted bytes)."""
    out = []
    for i, (layout, s, d) in enumerate(cases):
        grid = ProcessorGrid(dict(layout), comm=comm)
        src, dst = Dist.parse(s, NCHW), Dist.parse(d, NCHW)
        x = torch.randn(SHAPE, dtype=dtype, generator=torch.Generator().manual_seed(i))
        local = (x[src.local_slices(SHAPE, grid)] * _weight(grid, src)).requires_grad_(True)
        before = grid.bytes_received()
        moved = redistribute(local, grid, src, dst, SHAPE)
        counted = grid.bytes_received() - before
        predicted = plan_redistribution(grid.layout, src, dst, SHAPE).received_bytes(
            grid, x.element_size())
        y = torch.randn(moved.shape, dtype=dtype,
                        generator=torch.Generator().manual_seed(100 + comm.rank))
        moved.backward(y)
        pairing = (float((moved.detach() * y).sum()), float((local.detach() * local.grad).sum()))
        error = float((gather(moved.detach(), dst, grid, SHAPE) - x).abs().max())
        out.append((error, pairing, counted, predicted))
    return out


def run_repartition(comm):
    a = ProcessorGrid({"N": 2, "C": 2}, comm=comm)
    b = ProcessorGrid({"C": 4}, comm=comm)
    src, dst = Dist.parse("x[o,o_C,o,o]", NCHW), Dist.parse("x[*,o_C,o,*]", NCHW)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    moved = repartition(x[src.local_slices(SHAPE, a)], a, src, b, dst, SHAPE)
    return float((gather(moved, dst, b, SHAPE) - x).abs().max())


def check(results, ncases):
    assert all(len(r) == ncases for r in results)
    for case in range(ncases):
        per_rank = [r[case] for r in results]
        assert max(p[0] for p in per_rank) < 1e-12, f"case {case}: round trip is not exact"
        lhs = sum(p[1][0] for p in per_rank)
        rhs = sum(p[1][1] for p in per_rank)
        assert math.isclose(lhs, rhs, rel_tol=1e-12, abs_tol=1e-12), f"case {case}: adjoint"
        assert all(p[2] == p[3] for p in per_rank), f"case {case}: bytes {per_rank}"


def test_paper_redistributions_on_gloo4(gloo4):
    check(gloo4.run(run_cases, CASES_4), len(CASES_4))
    assert max(gloo4.run(run_repartition)) < 1e-12


def test_paper_redistributions_on_gloo2(gloo2):
    check(gloo2.run(run_cases, CASES_2), len(CASES_2))


def test_paper_redistributions_on_mpi4(mpi4):
    check(mpi4.run(run_cases, CASES_4), len(CASES_4))
    assert max(mpi4.run(run_repartition)) < 1e-12


def test_fp32_redistributions_on_mpi4(mpi4):
    results = mpi4.run(run_cases, CASES_4[:5], torch.float32)
    for case in range(5):
        assert max(r[case][0] for r in results) < 1e-5  # fp32: sums of up to 4 partials


def update_output_in_place(comm):
    """Outputs that are the receive buffer itself (dim-0 parts, back to back) can be modified in
    place like any other, and the gradient flows through the in-place update."""
    grid = ProcessorGrid({"C": comm.size}, comm=comm)
    src = Dist.parse("x[o_C,*,o,o]", NCHW)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    out = []
    # all-to-all dim 0 -> dim 1; allgather dim 0, whose gradient sums every rank's copy
    for d, copies in (("x[*,o_C,o,o]", 1), ("x[*,*,o,o]", comm.size)):
        dst = Dist.parse(d, NCHW)
        local = x[src.local_slices(SHAPE, grid)].clone().requires_grad_(True)
        moved = redistribute(local, grid, src, dst, SHAPE)
        aliased = moved.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
        moved.mul_(2.0).sum().backward()
        error = float((moved.detach() - 2 * x[dst.local_slices(SHAPE, grid)]).abs().max())
        out.append((aliased, error, bool(torch.equal(local.grad, torch.full_like(local, 2.0 * copies)))))
    return out


def test_outputs_can_be_updated_in_place_on_gloo2(gloo2):
    assert gloo2.run(update_output_in_place) == [[(False, 0.0, True)] * 2] * 2


def test_outputs_can_be_updated_in_place_on_mpi4(mpi4):
    assert mpi4.run(update_output_in_place) == [[(False, 0.0, True)] * 2] * 4
