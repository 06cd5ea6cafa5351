"""Processor grids: named dims laid row-major over the ranks of a communicator."""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distconv.comm import Communicator

__all__ = ["CANONICAL_DIMS", "ProcessorGrid", "all_coords", "corner_coords", "grid_layout"]

#: Grid dims a layer may refer to even when the grid leaves them out (their extent is then 1).
CANONICAL_DIMS = ("N", "C", "F", "D", "H", "W")

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class ProcessorGrid:
    """Named grid dims over the ranks of ``comm``, laid out row-major in the given order.

    ``ProcessorGrid({"N": 2, "C": 2})`` puts rank ``r`` at ``N = r // 2, C = r % 2``. The product of
    the extents must equal the communicator's size: every layer uses every rank. Different layers
    may use different grids over the same ranks.

    Sub-communicators over any set of dims (:meth:`subcomm`) are created collectively on first
    use -- every rank must ask for them in the same order, which a program that runs the same
    layers on every rank does -- and cached by the partition of ranks they form, so two grids with
    the same layout share them.

    Args:
        dims: ordered mapping (or sequence of pairs) from dim name to extent.
        comm: the communicator whose ranks form the grid. Default: ``distconv.comm.world()``.

    Raises:
        ValueError: an extent below 1, a repeated or malformed name, or a product of extents
            different from ``comm.size``.
    """

    def __init__(
        self, dims: Mapping[str, int] | Sequence[tuple[str, int]], comm: Communicator | None = None
    ) -> None:
        pairs = _pairs(dims)
        names = [p[0] for p in pairs]
        for name, extent in pairs:
            if not isinstance(name, str) or not _NAME.match(name):
                raise ValueError(f"ProcessorGrid: dim name {name!r} is not an identifier")
            if isinstance(extent, bool) or not isinstance(extent, int) or extent < 1:
                raise ValueError(
                    f"ProcessorGrid: extent of dim {name!r} must be an int >= 1, got {extent!r}"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"ProcessorGrid: repeated dim names in {names}")
        if comm is None:
            from distconv.comm import world

            comm = world()
        elif not hasattr(comm, "size") or not hasattr(comm, "rank"):
            raise TypeError(
                f"ProcessorGrid: comm must be a distconv.comm.Communicator (or None for the "
                f"world), got {comm!r} ({type(comm).__name__})"
            )
        self._layout: tuple[tuple[str, int], ...] = tuple((n, int(e)) for n, e in pairs)
        size = math.prod(e for _, e in self._layout)
        if size != comm.size:
            raise ValueError(
                f"ProcessorGrid {self._describe()}: {size} grid positions but the communicator has "
                f"{comm.size} ranks; the product of the extents must equal the world size"
            )
        self.comm = comm
        self._coords = self.coords_of(comm.rank)
        self._subcomms: dict[tuple[str, ...], Communicator] = {}
        # redistributions planned on this grid and bound to it (distconv.redistribute's)
        self._bound: dict[Any, Any] = {}

    # ----------------------------------------------------------------- value
    @property
    def layout(self) -> tuple[tuple[str, int], ...]:
        """``((name, extent), ...)``: a hashable value for plans and caches."""
        return self._layout

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self._layout)

    @property
    def shape(self) -> dict[str, int]:
        return dict(self._layout)

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinate on every grid dim."""
        return dict(self._coords)

    def extent(self, name: str) -> int:
        """Extent of grid dim ``name``: 1 for a canonical dim (N C F H W) the grid leaves out."""
        for n, e in self._layout:
            if n == name:
                return e
        if name in CANONICAL_DIMS:
            return 1
        raise ValueError(
            f"grid dim {name!r} is not in {self._describe()}; known dims: {', '.join(self.names)}"
            f" (and {', '.join(CANONICAL_DIMS)} with extent 1)"
        )

    def coords_of(self, rank: int) -> dict[str, int]:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be an int, got {rank!r}")
        if not 0 <= rank < math.prod(e for _, e in self._layout):
            raise ValueError(f"rank {rank} is outside {self._describe()}")
        coords: dict[str, int] = {}
        for name, extent in reversed(self._layout):
            rank, coords[name] = divmod(rank, extent)
        return {n: coords[n] for n in self.names}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """The rank at ``coords`` (dims left out are at 0)."""
        if not isinstance(coords, Mapping):
            raise TypeError(f"coords must be a mapping from grid dim name to int, got {coords!r}")
        for name, c in coords.items():
            extent = self.extent(name)
            if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < extent:
                raise ValueError(
                    f"coords[{name!r}] must be an int in [0, {extent}), got {c!r} "
                    f"({self._describe()})"
                )
        rank = 0
        for name, extent in self._layout:
            rank = rank * extent + coords.get(name, 0)
        return rank

    # ----------------------------------------------------------------- communicators
    def segments(self, dims: Iterable[str]) -> list[list[int]]:
        """The partition of ranks into groups that differ only in ``dims`` (row-major inside)."""
        wanted = self._order(dims)
        fixed = [(n, e) for n, e in self._layout if n not in wanted]
        varying = [(n, self.extent(n)) for n in wanted if n in self.shape]
        groups = []
        for outer in range(math.prod(e for _, e in fixed)):
            base = _unravel(outer, fixed)
            group = []
            for inner in range(math.prod(e for _, e in varying)):
                group.append(self.rank_of({**base, **_unravel(inner, varying)}))
            groups.append(group)
        return groups

    def subcomm(self, dims: Iterable[str]) -> Communicator:
        """Communicator among the ranks that differ only in ``dims`` (sub-rank row-major over them).

        Collective the first time a set of dims is asked for; cached afterwards.
        """
        key = self._order(dims)
        comm = self._subcomms.get(key)
        if comm is None:
            comm = self.comm.split(self.segments(key))
            self._subcomms[key] = comm
        return comm

    def bytes_received(self) -> int:
        """Bytes this rank has received over the grid's communicator and its sub-communicators
        (whose counters roll up into it)."""
        return self.comm.stats.total_bytes()

    def _order(self, dims: Iterable[str]) -> tuple[str, ...]:
        if not isinstance(dims, (str, Iterable)):
            raise TypeError(f"dims must be a grid dim name or an iterable of names, got {dims!r}")
        dims = tuple(dims) if not isinstance(dims, str) else (dims,)
        for d in dims:
            if not isinstance(d, str):
                raise TypeError(f"dims must hold grid dim names (str), got {dims!r}")
            self.extent(d)
        if len(set(dims)) != len(dims):
            raise ValueError(f"repeated grid dims in {dims}")
        return tuple(n for n in self.names if n in dims)

    # ----------------------------------------------------------------- printing
    def _describe(self) -> str:
        return "grid(" + " × ".join(f"{n}={e}" for n, e in self._layout) + ")"

    def __repr__(self) -> str:
        dims = ", ".join(f"{n!r}: {e}" for n, e in self._layout)
        return f"ProcessorGrid({{{dims}}}, rank={self.rank}, backend={self.comm.backend!r})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ProcessorGrid)
            and other._layout == self._layout
            and other.comm is self.comm
        )

    def __hash__(self) -> int:
        return hash((self._layout, id(self.comm)))


def _pairs(dims: object) -> list[tuple[str, int]]:
    """The (name, extent) pairs of a mapping or a sequence of pairs, or a TypeError that says
    what a grid spec looks like."""
    hint = "a mapping such as {'N': 2, 'C': 2} or a sequence of (name, extent) pairs"
    if isinstance(dims, Mapping):
        return list(dims.items())
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence):
        raise TypeError(f"ProcessorGrid: dims must be {hint}, got {dims!r}")
    pairs = []
    for p in dims:
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or len(p) != 2:
            raise TypeError(f"ProcessorGrid: dims must be {hint}; the entry {p!r} is not a pair")
        pairs.append((p[0], p[1]))
    return pairs


def _unravel(index: int, dims: Sequence[tuple[str, int]]) -> dict[str, int]:
    coords: dict[str, int] = {}
    for name, extent in reversed(dims):
        index, coords[name] = divmod(index, extent)
    return coords


def grid_layout(grid: Mapping[str, int] | Sequence[tuple[str, int]]
                ) -> tuple[tuple[str, int], ...]:
    """The ordered ``(name, extent)`` pairs of a grid given as a mapping or as pairs."""
    if isinstance(grid, Mapping):
        return tuple(grid.items())
    return tuple((str(n), int(e)) for n, e in grid)


def all_coords(grid: Mapping[str, int] | Sequence[tuple[str, int]]) -> list[dict[str, int]]:
    """The coordinates of every rank of a row-major grid, in rank order."""
    layout = grid_layout(grid)
    out = []
    for r in range(math.prod(e for _, e in layout)):
        c: dict[str, int] = {}
        for name, e in reversed(layout):
            r, c[name] = divmod(r, e)
        out.append(c)
    return out


def corner_coords(grid: Mapping[str, int] | Sequence[tuple[str, int]]) -> list[dict[str, int]]:
    """The ranks whose every coordinate is 0, 1 or the last: with balanced blocks they hold every
    combination of the larger and the smaller block per dim, and an interior block with halos on
    both sides, so the slowest rank is among them (the one sampling rule of pricing:
    :func:`distconv.parallel.placement.evaluated_ranks`)."""
    layout = grid_layout(grid)
    out: list[dict[str, int]] = [{}]
    for name, e in layout:
        out = [{**c, name: v} for c in out for v in sorted({0, min(1, e - 1), e - 1})]
    return out
