"""What a BatchNorm's ``statistics`` option means on a grid: the choices, their check, and the
groups of sample blocks whose statistics are shared (LBANN's statistics aggregation)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["STATISTICS", "check_statistics", "resolve_statistics", "statistics_groups"]

#: the named choices; an int k >= 1 is the third: groups of k consecutive sample blocks
STATISTICS = ("global", "local")
ALLOWED = "'global', 'local' or a positive int k (groups of k consecutive sample blocks)"


def check_statistics(value: Any, where: str = "statistics") -> str | int:
    """``value`` if it is a statistics choice, else ValueError naming ``where`` and the choices."""
    if isinstance(value, str) and value in STATISTICS:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(f"{where} must be {ALLOWED}, got {value!r}")


def resolve_statistics(value: str | int, blocks: int, where: str) -> str | int:
    """The choice a layer with ``blocks`` sample blocks runs: ``k`` groups of 1 block are
    ``'local'``, one group of all of them ``'global'``; a ``k`` that does not divide ``blocks``
    is refused, naming ``where``."""
    if isinstance(value, str):
        return value
    if blocks % value:
        raise ValueError(f"{where}: give statistics a k that divides {blocks}, 'local' or "
                         f"'global': statistics {value} groups sample blocks {value} by "
                         f"{value}, but the layer has {blocks} sample block(s)")
    return "local" if value == 1 else "global" if value == blocks else value


def statistics_groups(layout: Sequence[tuple[str, int]], sample_dims: Sequence[str],
                      segment_dims: Sequence[str], k: int) -> list[tuple[int, ...]]:
    """The partition of the grid's ranks (row-major over ``layout``) into the groups whose
    BatchNorm statistics are reduced together: the ranks that agree on every grid dim outside
    ``segment_dims`` and whose sample block (the nested index over ``sample_dims``, major
    first) lies in the same run of ``k`` consecutive blocks. Each group lists its ranks in
    increasing order (its communicator's sub-ranks)."""
    names = [n for n, _ in layout]
    ext = dict(layout)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for rank in range(math.prod(ext.values())):
        coords, rest = {}, rank
        for name, extent in reversed(layout):
            rest, coords[name] = divmod(rest, extent)
        block = 0
        for d in sample_dims:
            block = block * ext[d] + coords[d]
        key = (tuple(coords[n] for n in names if n not in segment_dims), block // k)
        groups.setdefault(key, []).append(rank)
    return [tuple(g) for g in groups.values()]
