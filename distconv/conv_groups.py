"""Index math of a grouped convolution whose channels and filters are blocked over ranks (pure,
no communication): whether every rank's blocks hold the same whole groups (a local grouped
convolution), and otherwise which groups a rank's filter block reaches into (it gathers their
channels). Global sizes only, so every rank derives the same answer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from distconv.distribution import nested_block

__all__ = ["GroupSpan", "group_role", "group_span", "groups_aligned"]


def group_role(algorithm: str, extents: dict[str, int], channel: str = "C", filter: str = "F"
               ) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The grid dims (major first) a grouped convolution's channels and filters are blocked
    over under ``algorithm`` (C, F, C×F), with their extents (``extents``: grid dim -> extent;
    ``channel``/``filter``: the dims playing C and F)."""
    dims = {"stationary-x": (channel,), "stationary-y": (filter,),
            "stationary-w": (channel, filter)}[algorithm]
    return dims, tuple(extents.get(d, 1) for d in dims)


@dataclass(frozen=True)
class GroupSpan:
    """One rank's share of a grouped convolution whose filters are blocked over the role dims:
    its filters ``[f0, f0 + filters)`` lie in the groups ``[g0, g1)``; ``lead`` filters of group
    ``g0`` before its block and ``trail`` of group ``g1 - 1`` after it belong to other ranks."""

    g0: int
    g1: int
    f0: int
    filters: int
    lead: int
    trail: int


def group_span(out_channels: int, groups: int, extents: Sequence[int],
               coords: Sequence[int]) -> GroupSpan:
    """The groups the filter block at ``coords`` (over ``extents``, major first) reaches into."""
    per = out_channels // groups
    f0, n = nested_block(out_channels, extents, coords)
    g0, g1 = f0 // per, -(-(f0 + n) // per)
    return GroupSpan(g0, max(g1, g0), f0, n, f0 - g0 * per, max(g1, g0) * per - f0 - n)


def groups_aligned(in_channels: int, out_channels: int, groups: int,
                   extents: Sequence[int]) -> bool:
    """Whether every rank's block of channels and its block of filters (balanced
    block-of-blocks over ``extents``) hold the same whole groups: a local grouped convolution
    (``groups`` divisible by the blocks; a depthwise layer of any width)."""
    cin, cout = in_channels // groups, out_channels // groups
    for coords in itertools.product(*(range(e) for e in extents)):
        c0, cn = nested_block(in_channels, extents, coords)
        f0, fn = nested_block(out_channels, extents, coords)
        if c0 % cin or cn % cin or f0 % cout or fn % cout or (c0 // cin, cn // cin) != (
                f0 // cout, fn // cout):
            return False
    return True
