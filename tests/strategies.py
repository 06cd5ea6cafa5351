"""hypothesis strategies shared by the distribution tests: grids, Dists and global shapes."""
from __future__ import annotations

import math

from hypothesis import strategies as st

from distconv.distribution import Dist

GRID_NAMES = ("P", "Q", "R")


@st.composite
def grid_layouts(draw, max_size: int = 8, max_dims: int = 3):
    ndims = draw(st.integers(1, max_dims))
    extents: list[int] = []
    for _ in range(ndims):
        room = max_size // math.prod(extents or [1])
        extents.append(draw(st.integers(1, max(1, min(4, room)))))
    return tuple(zip(GRID_NAMES, extents))


@st.composite
def dists_on(draw, layout, ndim: int, allow_pending: bool = True):
    names = [n for n, _ in layout]
    order = draw(st.permutations(names))
    roles = {n: draw(st.integers(0, ndim + (1 if allow_pending else 0))) for n in order}
    entries: list[list[str]] = [[] for _ in range(ndim)]
    pending = set()
    for name in order:
        role = roles[name]
        if role < ndim:
            entries[role].append(name)
        elif role == ndim and allow_pending:
            pending.add(name)
        # else: redundant
    return Dist(tuple(tuple(e) or None for e in entries), frozenset(pending))


@st.composite
def redistribution_cases(draw, max_size: int = 8, allow_pending: bool = True):
    layout = draw(grid_layouts(max_size))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0, 7)) for _ in range(ndim))
    src = draw(dists_on(layout, ndim, allow_pending))
    dst = draw(dists_on(layout, ndim, allow_pending))
    return layout, shape, src, dst
