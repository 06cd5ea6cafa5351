"""Who writes which bytes of a checkpoint: a pure function of the tensors' layouts.

Every rank computes the same plan from the same metadata, so no rank has to be told what to write.

1. *Blocks.* For a tensor ``t[D]`` of global shape ``S`` on grid ``G`` the rank at coordinates
   ``g`` holds the box ``D.blocks(S, G, g)``. Ranks holding the same box are the *holders* of one
   block: the ranks that differ only in the grid dims ``D`` does not split ``t`` over (its
   redundant dims, and any dim named in ``D`` that ``G`` lacks or has extent 1, e.g. ``w[*,o_C]``
   of a purely sample-parallel model on ``{N:P}``: one block held by all ``P`` ranks). A tensor
   without a grid is one block held by every rank.
2. *Split.* Greedy assignment of whole blocks (step 3) leaves the busiest rank at most one
   block above an even share ``T / P`` (``T`` bytes in all, ``P`` ranks). So a block larger than
   ``max(SPLIT_BYTES, T / (8 P))`` with ``k > 1`` holders is cut along its first dim into
   ``min(k, rows, ⌈bytes / that⌉)`` contiguous row ranges (each one a box, and one contiguous
   range of the block's bytes), which keeps every rank within an eighth of its share while most
   tensors stay whole, in one file (a whole tensor is read back with one copy, a split one is
   assembled: measured, the split costs loads more than it gains saves once greedy is balanced).
3. *Greedy.* Blocks and pieces go, largest first, each to its least loaded holder (ties to the
   lowest rank), so replicated bytes spread evenly over the ranks that hold them.

Every block, hence every byte, is written exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from distconv.checkpoint._index import Box, volume
from distconv.nn.sharding import ShardSpec

__all__ = ["SHARE_PARTS", "SPLIT_BYTES", "Block", "Piece", "assign", "blocks_of"]

#: No block smaller than this is split among its holders.
SPLIT_BYTES = 1 << 20
#: A block above 1/SHARE_PARTS of an even share of the bytes is split.
SHARE_PARTS = 8


@dataclass(frozen=True)
class Block:
    """One distinct block of tensor ``key``: its global ``box`` and the ranks that hold it."""

    key: str
    box: Box
    holders: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        return volume(self.box) * self.itemsize


@dataclass(frozen=True)
class Piece:
    """The part ``box`` of a block, written by ``rank``; ``rows`` is its range of the block's
    first dim (None: the whole block)."""

    key: str
    box: Box
    rank: int
    rows: tuple[int, int] | None
    nbytes: int


def blocks_of(key: str, spec: ShardSpec, itemsize: int, size: int) -> list[Block]:
    """The non-empty blocks of one tensor over a world of ``size`` ranks."""
    full = tuple((0, n) for n in spec.global_shape)
    if spec.grid is None:
        held = {full: list(range(size))}
    else:
        held = {}
        for r in range(size):
            coords = spec.grid.coords_of(r)
            box = tuple((s, s + n) for s, n in spec.dist.blocks(spec.global_shape, spec.grid,
                                                                  coords))
            held.setdefault(box, []).append(r)
    return [Block(key, box, tuple(ranks), itemsize)
            for box, ranks in held.items() if volume(box) > 0]


def assign(blocks: Iterable[Block], size: int) -> list[Piece]:
    """Every block's pieces with their writers (steps 2 and 3 of the module docstring)."""
    blocks = sorted(blocks, key=lambda b: (-b.nbytes, b.key, b.box))
    split_at = max(SPLIT_BYTES, -(-sum(b.nbytes for b in blocks) // (SHARE_PARTS * size)))
    parts: list[tuple[Block, tuple[int, int] | None]] = []
    for block in blocks:
        rows = block.box[0][1] - block.box[0][0] if block.box else 1
        k = min(len(block.holders), rows, -(-block.nbytes // split_at))
        parts += [(block, None)] if k <= 1 else [(block, r) for r in _ranges(rows, k)]
    load = [0] * size
    pieces: list[Piece] = []
    taken: dict[tuple[str, Box], set[int]] = {}  # a rank writes one piece of a block at most
    for block, rows in sorted(parts, key=lambda p: -_nbytes(*p)):  # stable: ties keep order
        busy = taken.setdefault((block.key, block.box), set())
        rank = min((r for r in block.holders if r not in busy), key=lambda r: (load[r], r))
        busy.add(rank)
        box = block.box if rows is None else (
            (block.box[0][0] + rows[0], block.box[0][0] + rows[1]), *block.box[1:])
        pieces.append(Piece(block.key, box, rank, rows, volume(box) * block.itemsize))
        load[rank] += pieces[-1].nbytes
    return pieces


def _nbytes(block: Block, rows: tuple[int, int] | None) -> int:
    if rows is None:
        return block.nbytes
    return block.nbytes // (block.box[0][1] - block.box[0][0]) * (rows[1] - rows[0])


def _ranges(n: int, k: int) -> Sequence[tuple[int, int]]:
    """``n`` rows in ``k`` contiguous near-equal ranges (the first ``n % k`` one row longer)."""
    q, r = divmod(n, k)
    bounds = [i * q + min(i, r) for i in range(k + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(k)]

