"""Behaviours of the executor's placement rules that hold today and that the other tests leave
open: a squeeze-and-excitation gate indexed straight from an unsettled mean, layouts with the
same extents under other names, and where the operands of an add meet, judged by the bytes that
move. Expectations are one process's values or byte counts worked out by hand."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.ops.elementwise import meeting
from distconv.parallel.placement import (
    Placement, conversion_bytes, convert, on_layout, one_grid, same_blocks,
)
from distconv.testing import run_threads
from tests.parallel.cases import TOL, counted_step, reference_step, seeded


# ----------------------------------------------------------------------------- the SE gate
class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        x = x * torch.sigmoid(x.mean((2, 3))[:, :, None, None])  # no keepdim, no layer between
        return self.head(x.mean((2, 3)))


SPATIAL = {"default": {"grid": {"N": 2, "H": 2}, "algorithm": "spatial"},
           "data": {"N": 2, "H": 2}}


def _gate_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(21)
    model = seeded(_Gate().double(), gen)
    x = torch.randn(3, 4, 7, 6, generator=gen, dtype=torch.float64)  # uneven rows and samples
    return model, x, torch.randint(0, 2, (3,), generator=gen)


def gate_step(comm: Any) -> dict[str, Any]:
    model, x, y = _gate_case()
    return counted_step(comm, model, SPATIAL, x, y)


def check_gate(results: list[dict[str, Any]]) -> None:
    model, x, y = _gate_case()
    ref = reference_step(model, x, y)
    for got in results:
        assert (got["out"] - ref["out"][got["rows"]]).abs().max() < TOL
        for k, g in ref["grads"].items():
            assert (got["grads"][k] - g).abs().max() < TOL, k


def test_se_gate_indexed_from_an_unsettled_mean_of_split_rows_equals_one_process() -> None:
    check_gate(run_threads(gate_step, 4))


# ----------------------------------------------------------------------------- placement helpers
#: the same extents under other names and in another order: {N: 2, F: 3} numbers rank
#: r = 3n + f, {C: 3, N: 2} numbers r = 2c + n
NF = (("N", 2), ("F", 3))
CN = (("C", 3), ("N", 2))
SRC = Placement(NF, Dist(("N", "F")))  # x[o_N,o_F] of a (4, 6) value: rows 2n.., cols 2f..
DST = Placement(CN, Dist(("N", "C")))  # x[o_N,o_C]: rows 2n.., cols 2c..
SHAPE = (4, 6)


def _box(layout: tuple, rank: int) -> tuple[slice, slice]:
    """Rank's 2×2 block, by hand: rows by its N coordinate, columns by its other one."""
    if layout == NF:
        n, other = divmod(rank, 3)
    else:
        other, n = divmod(rank, 2)
    return slice(2 * n, 2 * n + 2), slice(2 * other, 2 * other + 2)


def _received(rank: int) -> int:
    """Bytes of the new 2×2 block of ``rank`` that it does not hold already (8-byte values)."""
    (ra, ca), (rb, cb) = _box(NF, rank), _box(CN, rank)
    overlap = (max(0, min(ra.stop, rb.stop) - max(ra.start, rb.start))
               * max(0, min(ca.stop, cb.stop) - max(ca.start, cb.start)))
    return (4 - overlap) * 8


def test_layouts_of_the_same_extents_under_other_names_are_not_the_same_layout() -> None:
    assert on_layout(SRC, CN) is None
    assert not same_blocks(SRC, DST)
    assert one_grid(SRC, DST, SHAPE) == SRC  # no one-grid shortcut: a cross-grid repartition
    assert [_received(r) for r in range(6)] == [0, 32, 32, 32, 32, 0]
    for r in range(6):
        assert conversion_bytes(SRC, DST, SHAPE, 8, r) == _received(r), r
    # the same extents in the same order are one layout renamed
    assert on_layout(Placement((("N", 2), ("F", 3)), Dist(("N", "F"))),
                     (("N", 2), ("C", 3))) == Placement((("N", 2), ("C", 3)), Dist(("N", "C")))


def convert_across_names(comm: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    value = torch.arange(24, dtype=torch.float64).reshape(SHAPE)
    grids = {NF: ProcessorGrid(dict(NF), comm=comm), CN: ProcessorGrid(dict(CN), comm=comm)}
    before = comm.stats.total_bytes()
    out = convert(value[_box(NF, comm.rank)].clone(), SRC, DST, SHAPE, grids)
    return out, value[_box(CN, comm.rank)], comm.stats.total_bytes() - before


def test_a_conversion_between_those_layouts_moves_every_block_where_it_belongs() -> None:
    for r, (got, want, moved) in enumerate(run_threads(convert_across_names, 6)):
        assert torch.equal(got, want), r
        assert moved == _received(r), r


# ----------------------------------------------------------------------------- meeting operands
class _Add(nn.Module):
    """The input (replicated on every rank) plus a row-split convolution of it."""

    def __init__(self, first: str) -> None:
        super().__init__()
        self.first = first
        self.a = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.a(x) if self.first == "input" else self.a(x) + x
        return y.mean((2, 3))


class _NoAdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).mean((2, 3))


ROWS = {"default": {"grid": {"H": 4}, "algorithm": "spatial"}, "data": {"H": 4}}
ADD_SHAPE = (2, 4, 8, 8)


def _add_case(first: str | None) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(22)
    model = seeded((_NoAdd() if first is None else _Add(first)).double(), gen)
    x = torch.randn(ADD_SHAPE, generator=gen, dtype=torch.float64)
    return model, x, torch.randint(0, 4, (2,), generator=gen)


def add_step(comm: Any, first: str | None) -> dict[str, Any]:
    model, x, y = _add_case(first)
    out = counted_step(comm, model, ROWS, x, y)
    return {"rows": out["rows"], "out": out["out"], "counted": out["counted"]}


def test_meeting_picks_the_placement_the_other_operand_reaches_with_fewer_bytes() -> None:
    replicated = Placement((("H", 4),), Dist((None, None, None, None)))
    rows = Placement((("H", 4),), Dist((None, None, "H", None)))
    # rows -> replicated: an allgather, each rank receives the 3 blocks it lacks; the other
    # way a slice, nothing moves
    for r in range(4):
        assert conversion_bytes(rows, replicated, ADD_SHAPE, 8, r) == 3 * 2 * 4 * 2 * 8 * 8
        assert conversion_bytes(replicated, rows, ADD_SHAPE, 8, r) == 0
    assert meeting(replicated, rows) == rows
    assert meeting(rows, replicated) == rows


@pytest.mark.parametrize("first", ["input", "conv"])
def test_an_add_of_a_replicated_and_a_row_split_operand_moves_no_byte(first: str) -> None:
    """``x + a(x)``: x arrives whole on every rank, a(x) split over the rows. Meeting at the
    rows slices x (nothing moves); meeting whole would allgather a(x) (3 · 2·4·2·8 elements of 8
    bytes per rank forward, its adjoint backward). The counted bytes of every rank are those of
    the same network without the add, and the output is one process's."""
    model, x, y = _add_case(first)
    ref = model(x).detach()
    without = run_threads(add_step, 4, None)
    for r, got in enumerate(run_threads(add_step, 4, first)):
        assert got["counted"] == without[r]["counted"], r
        assert (got["out"] - ref[got["rows"]]).abs().max() < TOL


class _Tie(nn.Module):
    """Two branches whose outputs cost the same to move either way: ``f`` splits the filters
    (``y[*,o_F,*,*]`` on {F: 4}), ``h`` the rows (``y[*,*,o_H,*]`` on {H: 4})."""

    def __init__(self, first: str) -> None:
        super().__init__()
        self.first = first
        self.f = nn.Conv2d(4, 4, 1)
        self.h = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.f(x) + self.h(x) if self.first == "f" else self.h(x) + self.f(x)
        return y.mean((2, 3))


TIE = {"default": {"grid": {"H": 4}, "algorithm": "spatial"}, "data": {"H": 4},
       "layers": [{"match": "f", "grid": {"F": 4}, "algorithm": "stationary-y"}]}


def tie_step(comm: Any, first: str) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(23)
    model = seeded(_Tie(first).double(), gen)
    x = torch.randn(ADD_SHAPE, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (2,), generator=gen)
    got = counted_step(comm, model, TIE, x, y)
    return {"error": (got["out"] - model(x).detach()[got["rows"]]).abs().max().item(),
            "forward": got["counted"][0]}


@pytest.mark.parametrize("first, output", [("f", 48), ("h", 96)])
def test_operands_that_cost_the_same_meet_where_the_first_is(first: str, output: int) -> None:
    """Each rank holds a quarter of the sum's operands either way and receives the part of its
    new quarter it lacks: 2·1·8·8 elements less the 2·1·2·8 it holds, 768 bytes, whichever
    meets the other. Where they meet decides the output's cost: filters split, the means of
    y[*,o_F] are gathered (3 of 4 channel blocks of 2 samples: 48 bytes); rows split, the
    pending sum over H is allreduced (2·4 values: 96 bytes). The entry agrees on the batch's
    shape (3 peers' 4 dims of 8 bytes: 96)."""
    for got in run_threads(tie_step, 4, first):
        assert got["error"] < TOL
        assert got["forward"] == 96 + 768 + output, got


# ----------------------------------------------------------------------------- a real world
@pytest.mark.gloo
def test_parallel_pins_on_gloo(gloo4) -> None:  # noqa: ANN001
    check_gate(gloo4.run(gate_step))
    model, x, _ = _add_case("input")
    ref = model(x).detach()
    without = gloo4.run(add_step, None)
    for r, got in enumerate(gloo4.run(add_step, "input")):
        assert got["counted"] == without[r]["counted"], r
        assert (got["out"] - ref[got["rows"]]).abs().max() < TOL
