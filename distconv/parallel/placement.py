"""Where a value lives: a grid layout and a :class:`~distconv.distribution.Dist` on it, and the
conversions between two placements (same grid: :func:`redistribute`; different grids over the same
ranks: :func:`repartition`) with the exact bytes each rank receives doing them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Sequence

import torch

from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.redistribute import (
    _repartition_plan, plan_redistribution, redistribute, repartition,
)

__all__ = ["Layout", "Placement", "conversion_bytes", "convert", "layout_str", "paper_grid"]

Layout = tuple[tuple[str, int], ...]


def layout_str(layout: Layout) -> str:
    return "{" + ", ".join(f"{n}: {e}" for n, e in layout) + "}"


def _live(layout: Layout) -> set[str]:
    return {n for n, e in layout if e > 1}


@dataclass(frozen=True)
class Placement:
    """A value's grid layout and distribution, kept canonical (grid dims of extent 1 dropped), so
    two placements that put every element on the same ranks compare equal."""

    layout: Layout
    dist: Dist

    def __post_init__(self) -> None:
        live = _live(self.layout)
        entries = []
        for i in range(self.dist.ndim):
            names = tuple(g for g in self.dist.grid_dims_of(i) if g in live)
            entries.append(names if len(names) > 1 else (names[0] if names else None))
        pending = frozenset(g for g in self.dist.pending if g in live)
        object.__setattr__(self, "dist", Dist(tuple(entries), pending, self.dist.tensor_dims))

    @property
    def ndim(self) -> int:
        return self.dist.ndim

    def settled(self) -> Placement:
        """The same blocks with every pending sum completed."""
        return Placement(self.layout, self.dist.with_pending(()))

    def distinct_blocks(self) -> int:
        """How many different blocks the ranks hold (1: replicated everywhere)."""
        ext = dict(self.layout)
        return math.prod(ext[g] for g in self.dist.used())

    def format(self, name: str = "") -> str:
        return f"{self.dist.format(name)} on {layout_str(self.layout)}"

    def __str__(self) -> str:
        return self.format()


def paper_grid(layout: Layout, rank: int) -> ProcessorGrid:
    """A grid value for ``rank`` with no communicator behind it: for planning and counting only."""
    size = math.prod(e for _, e in layout)
    return ProcessorGrid(dict(layout), comm=SimpleNamespace(rank=rank, size=size, backend="none"))


def convert(x: torch.Tensor, src: Placement, dst: Placement, shape: Sequence[int],
            grids: dict[Layout, ProcessorGrid]) -> torch.Tensor:
    """This rank's block of the value in ``dst``, from its block ``x`` in ``src`` (differentiable,
    exact adjoint). Collective over the ranks the two placements involve."""
    if src == dst:
        return x
    if src.layout == dst.layout:
        return redistribute(x, grids[src.layout], src.dist, dst.dist, shape)
    return repartition(x, grids[src.layout], src.dist, grids[dst.layout], dst.dist, shape)


def conversion_bytes(src: Placement, dst: Placement, shape: Sequence[int], itemsize: int,
                     rank: int) -> int:
    """Bytes ``rank`` receives in :func:`convert` (what the communicators count)."""
    shape = tuple(int(s) for s in shape)
    if src == dst:
        return 0
    if src.layout == dst.layout:
        plan = plan_redistribution(src.layout, src.dist, dst.dist, shape)
        return plan.received_bytes(paper_grid(src.layout, rank), itemsize)
    total = 0
    s_dist, d_dist = src.dist, dst.dist
    if s_dist.pending:
        plain = s_dist.with_pending(())
        total += plan_redistribution(src.layout, s_dist, plain, shape).received_bytes(
            paper_grid(src.layout, rank), itemsize)
        s_dist = plain
    plain_dst = d_dist.with_pending(())
    plan = _repartition_plan(src.layout, s_dist, dst.layout, plain_dst, shape)
    total += plan.received_bytes(rank, itemsize)
    if d_dist.pending:
        total += plan_redistribution(dst.layout, plain_dst, d_dist, shape).received_bytes(
            paper_grid(dst.layout, rank), itemsize)
    return total
