"""The segment of a conversion: the ranks a rank exchanges data with when a value moves between
two placements, as the executor runs it (:func:`distconv.parallel.placement.convert`).

On one grid a redistribution's steps run over grid dims, so its segment is the ranks that differ
from this one only in those dims. Between two grids a repartition runs on the connected
components of its send graph (:attr:`distconv.redistribute.RepartitionPlan.groups`), its pending
steps on their own grid dims; found here in closed form from one rank outwards (each rank's
sources and targets over the blocks its box overlaps), never by a pass over every pair of ranks,
so 1024 ranks price at once. A conversion is priced on its segment: the segment's size for the
latency, the machine level it crosses for the bandwidth (:meth:`CommStep.seconds
<distconv.pricing.timeline.CommStep.seconds>`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

from distconv.distribution import Dist
from distconv.machines.base import group_of
from distconv.parallel.placement import (
    Layout, Placement, one_grid, paper_grid, readers, repartition_sources,
)

__all__ = ["conversion_segment", "conversion_segments", "describe_segment"]


def conversion_segment(src: Placement, dst: Placement, shape: Sequence[int],
                       rank: int) -> tuple[int, ...]:
    """The ranks ``rank`` shares data with converting a value of global ``shape`` from ``src``
    to ``dst`` (sorted, ``rank`` included; ``(rank,)`` when it exchanges nothing)."""
    return _Segments.of(src, dst, tuple(int(n) for n in shape)).segment(rank)


def conversion_segments(src: Placement, dst: Placement, shape: Sequence[int],
                        ranks: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """The distinct segments of ``ranks`` (:func:`conversion_segment`), those of more than one
    rank, largest first."""
    found = {conversion_segment(src, dst, shape, r) for r in ranks}
    return tuple(sorted((g for g in found if len(g) > 1), key=lambda g: (-len(g), g)))


def describe_segment(groups: Sequence[Sequence[int]], machine: Any = None) -> str:
    """``"4 ranks, one node"``: the largest segment's size and, on a hierarchical machine, the
    level its ranks span (``one socket``, ``one node``, or how many units of the level below the
    outermost it covers: ``"64 ranks, 16 nodes"``)."""
    if not groups:
        return "no exchange"
    size = max(len(g) for g in groups)
    text = f"{size} ranks"
    levels = getattr(machine, "levels", None)
    if not levels or len(levels) < 2:
        return text
    worst = max((machine.level_of(tuple(sorted(g)))[0], len(g)) for g in groups)[0]
    if worst < len(levels) - 1:
        return f"{text}, one {levels[worst].name}"
    unit = levels[-2]
    units = max(len({r // unit.ranks for r in g}) for g in groups)
    return f"{text}, {units} {unit.name}s"


class _Segments:
    """The segments of one conversion, found rank by rank and remembered."""

    def __init__(self, src: Placement, dst: Placement, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.size = math.prod(e for _, e in dst.layout)
        src = one_grid(src, dst, shape)
        self.src, self.dst = src, dst
        self.found: dict[int, tuple[int, ...]] = {}
        # the grid dims the one-grid steps run over: (layout, dims) pairs
        self.dims: list[tuple[Layout, tuple[str, ...]]] = []
        self.cross = src.layout != dst.layout and src != dst
        if src == dst:
            return
        if not self.cross:
            self.dims.append((dst.layout, _plan_dims(dst.layout, src.dist, dst.dist, shape)))
            return
        if src.dist.pending:
            self.dims.append((src.layout, _plan_dims(src.layout, src.dist,
                                                     src.dist.with_pending(()), shape)))
        if dst.dist.pending:
            self.dims.append((dst.layout, _plan_dims(dst.layout, dst.dist.with_pending(()),
                                                     dst.dist, shape)))

    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def of(src: Placement, dst: Placement, shape: tuple[int, ...]) -> _Segments:
        return _Segments(src, dst, shape)

    def neighbours(self, rank: int) -> set[int]:
        out: set[int] = set()
        for layout, dims in self.dims:
            if dims:
                out.update(_segment_of(layout, dims, rank))
        if self.cross:
            s, d = self.src.dist.with_pending(()), self.dst.dist.with_pending(())
            out.update(repartition_sources(self.src.layout, s, self.dst.layout, d, self.shape,
                                           rank))
            out.update(_targets(self.src.layout, s, self.dst.layout, d, self.shape, rank))
        out.discard(rank)
        return out

    def segment(self, rank: int) -> tuple[int, ...]:
        known = self.found.get(rank)
        if known is not None:
            return known
        seen, frontier = {rank}, [rank]
        while frontier and len(seen) < self.size:
            nxt = []
            for r in frontier:
                for t in self.neighbours(r):
                    if t not in seen:
                        seen.add(t)
                        nxt.append(t)
            frontier = nxt
        group = tuple(sorted(seen))
        for r in group:
            self.found[r] = group
        return group


def _plan_dims(layout: Layout, src: Dist, dst: Dist, shape: tuple[int, ...]) -> tuple[str, ...]:
    """The grid dims the communicating steps of the one-grid plan ``src -> dst`` run over."""
    from distconv.redistribute import plan_redistribution

    dims: set[str] = set()
    for step in plan_redistribution(layout, src, dst, shape).steps:
        kind = type(step).__name__
        if kind == "AllReduce":
            dims.update(step.dims)
        elif kind in ("AllGather", "ReduceScatter", "AllToAll"):
            dims.add(step.g)
    return tuple(n for n, _ in layout if n in dims)


def _segment_of(layout: Layout, dims: tuple[str, ...], rank: int) -> tuple[int, ...]:
    """The ranks that differ from ``rank`` only in ``dims`` of the row-major ``layout``."""
    coords = paper_grid(layout, rank).coords
    base = 0
    for name, e in layout:
        base = base * e + (0 if name in dims else coords[name])
    return tuple(base + g for g in group_of(layout, dims))


def _targets(src_layout: Layout, src: Dist, dst_layout: Layout, dst: Dist,
             shape: tuple[int, ...], rank: int) -> set[int]:
    """The ranks that read a nonempty box from ``rank`` in the repartition of plain dists
    (:func:`~distconv.parallel.placement.readers`: as the exchange does)."""
    return {t for t, _ in readers(src_layout, src, dst_layout, dst, shape, rank)}
