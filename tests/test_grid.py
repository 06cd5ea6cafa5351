"""ProcessorGrid: layout, coordinates, validation."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from distconv.grid import ProcessorGrid


def fake_comm(size: int, rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(rank=rank, size=size, backend="none")


def test_ranks_are_row_major_in_dim_order():
    grid = ProcessorGrid({"N": 2, "C": 3}, comm=fake_comm(6))
    assert [grid.coords_of(r) for r in range(6)] == [
        {"N": n, "C": c} for n in range(2) for c in range(3)
    ]
    assert all(grid.rank_of(grid.coords_of(r)) == r for r in range(6))


def test_segments_partition_the_ranks():
    grid = ProcessorGrid({"N": 2, "C": 2, "H": 2}, comm=fake_comm(8))
    assert grid.segments(["C"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.segments(["H", "N"]) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert grid.segments([]) == [[r] for r in range(8)]


def test_size_must_equal_world_size():
    with pytest.raises(ValueError, match="4 grid positions but the communicator has 8 ranks"):
        ProcessorGrid({"N": 2, "C": 2}, comm=fake_comm(8))


@pytest.mark.parametrize(
    "dims, message",
    [({"N": 0}, "extent of dim 'N' must be an int >= 1"),
     ({"N": 2.0}, "extent of dim 'N' must be an int"),
     ([("N", 2), ("N", 2)], "repeated dim names"),
     ({"1x": 1}, "not an identifier")],
)
def test_bad_dims_are_named(dims, message):
    with pytest.raises(ValueError, match=message):
        ProcessorGrid(dims, comm=fake_comm(4))


def test_missing_canonical_dims_have_extent_one():
    grid = ProcessorGrid({"N": 4}, comm=fake_comm(4))
    assert grid.extent("H") == 1
    with pytest.raises(ValueError, match="grid dim 'Z' is not in grid"):
        grid.extent("Z")
