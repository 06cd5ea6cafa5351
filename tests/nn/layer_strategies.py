"""hypothesis strategies for the layers around DistConv2d: grids over N, C, F, H, W (product at
most 8) and activation Dists that put any grid dim in any entry (tuples included, in any order)
or leave it redundant."""

from __future__ import annotations

import math

from hypothesis import strategies as st

GRID_DIMS = "NCFHW"


@st.composite
def grids(draw: st.DrawFn, max_size: int = 8) -> tuple[tuple[str, int], ...]:
    names = draw(st.lists(st.sampled_from(GRID_DIMS), min_size=1, max_size=3, unique=True))
    layout, room = [], max_size
    for name in names:
        extent = draw(st.integers(1, min(4, room)))
        room //= extent
        layout.append((name, extent))
    return tuple(layout)


@st.composite
def activation_entries(draw: st.DrawFn, layout: tuple[tuple[str, int], ...]) -> tuple:
    """Four entries (N, C, H, W): each grid dim goes to one entry or stays redundant (role 4)."""
    entries: list[list[str]] = [[], [], [], []]
    for name, _ in draw(st.permutations(layout)):
        role = draw(st.integers(0, 4))
        if role < 4:
            entries[role].append(name)
    return tuple(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries)


@st.composite
def spatial_layouts(draw: st.DrawFn, dims: int, max_extent: int, max_ranks: int
                    ) -> list[tuple[str, int]]:
    """A grid for an N-d layer (``dims`` of D, H, W): one or two of its spatial dims split (2 to
    ``max_extent`` parts alone, 2 each together) and N over what ``max_ranks`` leaves, in any
    order."""
    names = ("D", "H", "W")[3 - dims:]
    split = draw(st.lists(st.sampled_from(names), min_size=1, max_size=min(2, dims),
                          unique=True))
    layout = [(n, draw(st.integers(2, max_extent if len(split) == 1 else 2))) for n in split]
    layout.append(("N", draw(st.integers(1, max_ranks // math.prod(e for _, e in layout)))))
    return draw(st.permutations(layout))
