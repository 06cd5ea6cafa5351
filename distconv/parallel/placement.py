"""Where a value lives: a grid layout and a :class:`~distconv.distribution.Dist` on it, and the
conversions between two placements (same grid: :func:`redistribute`; different grids over the same
ranks: :func:`repartition`) with the exact bytes each rank receives doing them."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Sequence

import torch

from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.redistribute import plan_redistribution, redistribute, repartition

__all__ = ["Layout", "Placement", "conversion_bytes", "convert", "layout_str", "paper_grid",
           "repartition_bytes"]

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


@functools.lru_cache(maxsize=256)
def _boxes(layout: Layout, dist: Dist, shape: tuple[int, ...]) -> tuple[tuple, dict]:
    """Every rank's index box of ``dist`` and, per distinct box, the ranks holding it."""
    boxes = tuple(tuple(dist.blocks(shape, paper_grid(layout, r)))
                  for r in range(math.prod(e for _, e in layout)))
    holders: dict[tuple, list[int]] = {}
    for r, box in enumerate(boxes):
        holders.setdefault(box, []).append(r)
    return boxes, holders


def _overlap(a: tuple, b: tuple) -> int:
    n = 1
    for (s0, n0), (s1, n1) in zip(a, b):
        n *= max(0, min(s0 + n0, s1 + n1) - max(s0, s1))
    return n


def repartition_bytes(src_layout: Layout, src: Dist, dst_layout: Layout, dst: Dist,
                      shape: tuple[int, ...], rank: int, itemsize: int) -> tuple[int, int]:
    """(received, sent) bytes of ``rank`` in :func:`repartition` of plain (non-pending) dists, in
    O(P): target rank t reads each source box from its holder ``holders[t % len(holders)]``, as
    the exchange does; the adjoint receives what the forward sent."""
    src_boxes, holders = _boxes(src_layout, src, shape)
    dst_boxes, _ = _boxes(dst_layout, dst, shape)
    received = sum(_overlap(box, dst_boxes[rank]) for box, ranks in holders.items()
                   if ranks[rank % len(ranks)] != rank)
    mine = holders[src_boxes[rank]]
    sent = sum(_overlap(src_boxes[rank], dst_boxes[t]) for t in range(len(dst_boxes))
               if t != rank and mine[t % len(mine)] == rank)
    return received * itemsize, sent * itemsize


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
    total += repartition_bytes(src.layout, s_dist, dst.layout, plain_dst, shape, rank,
                               itemsize)[0]
    if d_dist.pending:
        total += plan_redistribution(dst.layout, plain_dst, d_dist, shape).received_bytes(
            paper_grid(dst.layout, rank), itemsize)
    return total
