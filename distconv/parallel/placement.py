"""Where a value lives: a grid layout and a :class:`~distconv.distribution.Dist` on it, and the
conversions between two placements (same grid: :func:`redistribute`; different grids over the same
ranks: :func:`repartition`) with the exact bytes each rank receives doing them."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterable, Sequence

import torch

from distconv.distribution import Dist, Entry, balanced_block
from distconv.grid import ProcessorGrid, corner_coords
from distconv.redistribute import AllToAll, plan_redistribution, redistribute, repartition

__all__ = ["ALL_RANKS", "Layout", "Placement", "conversion_bytes", "convert", "evaluated_ranks",
           "layout_str", "on_layout", "one_grid", "paper_grid", "same_blocks",
           "repartition_bytes", "repartition_sources"]

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


@functools.lru_cache(maxsize=8192)
def paper_grid(layout: Layout, rank: int) -> ProcessorGrid:
    """A grid value for ``rank`` with no communicator behind it: for planning and counting only
    (remembered: pricing asks for the same few thousand again and again; never mutated)."""
    size = math.prod(e for _, e in layout)
    return ProcessorGrid(dict(layout), comm=SimpleNamespace(rank=rank, size=size, backend="none"))


def on_layout(p: Placement, layout: Layout) -> Placement | None:
    """``p`` written on ``layout``, when the two layouts number the ranks alike (their grid dims
    of extent > 1 have the same extents in the same order): every rank's block unchanged, the
    grid dims renamed in order (``y[*,o_F,*,*]`` on ``{F: 2}`` is ``y[*,o_C,*,*]`` on
    ``{C: 2}``). None when they do not."""
    a = [(n, e) for n, e in p.layout if e > 1]
    b = [(n, e) for n, e in layout if e > 1]
    if [e for _, e in a] != [e for _, e in b]:
        return None
    names = {x: y for (x, _), (y, _) in zip(a, b)}
    entries: list[Entry] = []
    for i in range(p.dist.ndim):
        dims = tuple(names[g] for g in p.dist.grid_dims_of(i))
        entries.append(dims if len(dims) > 1 else (dims[0] if dims else None))
    return Placement(layout, Dist(tuple(entries), frozenset(names[g] for g in p.dist.pending),
                                  p.dist.tensor_dims))


def same_blocks(a: Placement, b: Placement) -> bool:
    """Whether every rank holds the same block in ``a`` and in ``b`` (equal placements, or equal
    once written on one layout: :func:`on_layout`), so converting between them moves nothing."""
    return a == b or on_layout(a, b.layout) == b


@functools.lru_cache(maxsize=4096)
def one_grid(src: Placement, dst: Placement, shape: tuple[int, ...]) -> Placement:
    """The source placement a conversion ``src -> dst`` of a value of global ``shape`` starts
    from: ``src`` on ``dst``'s layout (:func:`on_layout`) where that makes it one redistribution
    on ``dst``'s grid with no all-to-all step (an allgather, a slice, a reduction) receiving no
    more bytes on any evaluated rank than the cross-grid repartition, else ``src``. A function
    of global values only: every rank decides alike."""
    if src.layout == dst.layout:
        return src
    same = on_layout(src, dst.layout)
    if same is None:
        return src
    plan = plan_redistribution(dst.layout, same.dist, dst.dist, shape)
    if any(isinstance(step, AllToAll) for step in plan.steps):
        return src  # an all-to-all either way: the repartition's is one exchange
    size = math.prod(e for _, e in dst.layout)
    for r in evaluated_ranks([src.layout, dst.layout], size, every=False):
        if (plan.received_bytes(paper_grid(dst.layout, r), 1)
                > _repartition_received(src, dst, shape, 1, r)):
            return src
    return same


def convert(x: torch.Tensor, src: Placement, dst: Placement, shape: Sequence[int],
            grids: dict[Layout, ProcessorGrid]) -> torch.Tensor:
    """This rank's block of the value in ``dst``, from its block ``x`` in ``src`` (differentiable,
    exact adjoint). Collective over the ranks the two placements involve: a redistribution on
    one grid where the layouts number the ranks alike (:func:`on_layout`), else a
    :func:`repartition`."""
    if src.layout != dst.layout:  # (a program passes its source already on dst's grid)
        src = one_grid(src, dst, tuple(int(n) for n in shape))
    if src == dst:
        return x
    if src.layout == dst.layout:
        return redistribute(x, grids[src.layout], src.dist, dst.dist, shape)
    return repartition(x, grids[src.layout], src.dist, grids[dst.layout], dst.dist, shape)


#: worlds up to this size are evaluated rank by rank (explain, the planner, where operands meet)
ALL_RANKS = 64


def evaluated_ranks(layouts: Iterable[Layout], size: int, *, every: bool = True) -> list[int]:
    """The ranks whose bytes and times stand for the world's: every rank of a world of at most
    :data:`ALL_RANKS` (``every``: per-rank reports and sums need them all); above, or for a
    maximum (``every=False``), the ranks at coordinates 0, 1 and last of every grid dim of every
    layout in use (the largest blocks, an interior block with halos on both sides, the last
    block), whose maxima are those of the whole world for the balanced layouts used here. The
    one rule of ``explain``, the planner and the meeting of operands."""
    if every and size <= ALL_RANKS:
        return list(range(size))
    ranks: set[int] = set()
    for layout in layouts:
        for coords in corner_coords(layout):
            r = 0
            for name, e in layout:
                r = r * e + coords[name]
            ranks.add(r)
    return sorted(ranks)


def _block_index(n: int, p: int, i: int) -> int:
    """Which of ``p`` balanced blocks of ``n`` items holds item ``i``."""
    q, r = divmod(n, p)
    return i // (q + 1) if i < r * (q + 1) else r + (i - r * (q + 1)) // q


def _hits(n: int, extents: Sequence[int], lo: int, hi: int) -> list[tuple[tuple[int, ...], int]]:
    """Nested balanced blocks of ``n`` items over ``extents`` (major first) that overlap
    ``[lo, hi)``: ``(coords, overlap)`` for each nonempty overlap."""
    out: list[tuple[tuple[int, ...], int]] = []

    def walk(start: int, size: int, depth: int, coords: tuple[int, ...]) -> None:
        a, b = max(lo, start), min(hi, start + size)
        if b <= a:
            return
        if depth == len(extents):
            out.append((coords, b - a))
            return
        p = extents[depth]
        for i in range(_block_index(size, p, a - start), _block_index(size, p, b - 1 - start) + 1):
            s, k = balanced_block(size, p, i)
            walk(start + s, k, depth + 1, coords + (i,))

    walk(0, n, 0, ())
    return out


def repartition_sources(src_layout: Layout, src: Dist, dst_layout: Layout, dst: Dist,
                        shape: tuple[int, ...], rank: int) -> dict[int, int]:
    """Elements ``rank`` receives from each other rank in :func:`repartition` of plain
    (non-pending) dists, in closed form: every source block overlapping this rank's target box,
    read from the replica ``rank % replicas`` (replicas ordered row-major over the source's
    redundant dims, as the exchange reads them); O(overlapping blocks), not O(P)."""
    sg, dg = paper_grid(src_layout, rank), paper_grid(dst_layout, rank)
    box = list(dst.blocks(shape, dg))
    if any(k == 0 for _, k in box):
        return {}
    used = src.used()
    redundant = [(n, e) for n, e in src_layout if n not in used]
    rep: dict[str, int] = {}
    j = rank % math.prod(e for _, e in redundant)
    for n, e in reversed(redundant):
        j, rep[n] = divmod(j, e)
    per_dim = []
    for d, n in enumerate(shape):
        names = src.grid_dims_of(d)
        lo, k = box[d]
        per_dim.append([(dict(zip(names, c)), ov) for c, ov in
                        _hits(n, [sg.extent(g) for g in names], lo, lo + k)])
    out: dict[int, int] = {}

    def combine(d: int, coords: dict[str, int], elems: int) -> None:
        if d == len(shape):
            r = sg.rank_of({**coords, **rep})
            if r != rank:
                out[r] = out.get(r, 0) + elems
            return
        for c, ov in per_dim[d]:
            combine(d + 1, {**coords, **c}, elems * ov)

    combine(0, {}, 1)
    return out


def repartition_bytes(src_layout: Layout, src: Dist, dst_layout: Layout, dst: Dist,
                      shape: tuple[int, ...], rank: int, itemsize: int) -> tuple[int, int]:
    """(received, sent) bytes of ``rank`` in :func:`repartition` of plain (non-pending) dists:
    received from :func:`repartition_sources`; sent in O(P): target rank t reads each source box
    from its holder ``holders[t % len(holders)]``, as the exchange does (the adjoint receives
    what the forward sent)."""
    received = sum(repartition_sources(src_layout, src, dst_layout, dst, shape, rank).values())
    return received * itemsize, _sent(src_layout, src, dst_layout, dst, shape, rank) * itemsize


def _sent(src_layout: Layout, src: Dist, dst_layout: Layout, dst: Dist,
          shape: tuple[int, ...], rank: int) -> int:
    """Elements ``rank`` sends in :func:`repartition`, in closed form (:func:`readers`)."""
    return sum(n for _, n in readers(src_layout, src, dst_layout, dst, shape, rank))


def readers(src_layout: Layout, src: Dist, dst_layout: Layout, dst: Dist,
            shape: tuple[int, ...], rank: int) -> Iterable[tuple[int, int]]:
    """``(target rank, elements)`` for each nonempty piece ``rank`` sends in
    :func:`repartition` of plain dists: to every target whose box overlaps this rank's source
    box and reads it from this rank (the target ``t`` reads from the holder ``t % holders`` of
    the source box, holders in rank order: the ranks that differ from this one on the source's
    redundant dims); O(overlapping blocks times their replicas), not O(P)."""
    sg, dg = paper_grid(src_layout, rank), paper_grid(dst_layout, rank)
    box = list(src.blocks(shape, sg))
    if any(k == 0 for _, k in box):
        return
    used = src.used()
    redundant = [(n, e) for n, e in src_layout if n not in used]
    mine = []
    for j in range(math.prod(e for _, e in redundant)):
        coords = dict(sg.coords)
        for n, e in reversed(redundant):
            j, coords[n] = divmod(j, e)
        mine.append(sg.rank_of(coords))
    mine.sort()
    per_dim = []
    for d, n in enumerate(shape):
        names = dst.grid_dims_of(d)
        lo, k = box[d]
        per_dim.append([(dict(zip(names, c)), ov) for c, ov in
                        _hits(n, [dg.extent(g) for g in names], lo, lo + k)])
    d_used = dst.used()
    spare = [(n, e) for n, e in dst_layout if n not in d_used]

    def combine(d: int, coords: dict[str, int], elems: int) -> Iterable[tuple[int, int]]:
        if d == len(shape):
            for j in range(math.prod(e for _, e in spare)):
                rep: dict[str, int] = {}
                for n, e in reversed(spare):
                    j, rep[n] = divmod(j, e)
                t = dg.rank_of({**coords, **rep})
                if t != rank and mine[t % len(mine)] == rank:
                    yield t, elems
            return
        for c, ov in per_dim[d]:
            yield from combine(d + 1, {**coords, **c}, elems * ov)

    yield from combine(0, {}, 1)


def conversion_bytes(src: Placement, dst: Placement, shape: Sequence[int], itemsize: int,
                     rank: int) -> int:
    """Bytes ``rank`` receives in :func:`convert` (what the communicators count)."""
    shape = tuple(int(s) for s in shape)
    src = one_grid(src, dst, shape)
    if src == dst:
        return 0
    if src.layout == dst.layout:
        plan = plan_redistribution(src.layout, src.dist, dst.dist, shape)
        return plan.received_bytes(paper_grid(src.layout, rank), itemsize)
    return _repartition_received(src, dst, shape, itemsize, rank)


def _repartition_received(src: Placement, dst: Placement, shape: tuple[int, ...], itemsize: int,
                          rank: int) -> int:
    """Bytes ``rank`` receives in :func:`repartition` (its pending steps included)."""
    total = 0
    s_dist, d_dist = src.dist, dst.dist
    if s_dist.pending:
        plain = s_dist.with_pending(())
        total += plan_redistribution(src.layout, s_dist, plain, shape).received_bytes(
            paper_grid(src.layout, rank), itemsize)
        s_dist = plain
    plain_dst = d_dist.with_pending(())
    total += itemsize * sum(repartition_sources(src.layout, s_dist, dst.layout, plain_dst,
                                                shape, rank).values())
    if d_dist.pending:
        total += plan_redistribution(dst.layout, plain_dst, d_dist, shape).received_bytes(
            paper_grid(dst.layout, rank), itemsize)
    return total
