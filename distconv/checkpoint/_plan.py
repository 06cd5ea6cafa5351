"""Who writes which bytes of a checkpoint: a pure function of the tensors' layouts.

Every rank computes the same plan from the same metadata, so no rank has to be told what to write.

1. *Blocks.* For a tensor ``t[D]`` of global shape ``S`` on grid ``G`` the rank at coordinates
   ``g`` holds the box ``D.blocks(S, G, g)``. Ranks holding the same box are the *holders* of one
   block: the ranks that differ only in the grid dims ``D`` does not split ``t`` over (its
   redundant dims, and any dim named in ``D`` that ``G`` lacks or has extent 1, e.g. ``w[*,o_C]``
   of a purely sample-parallel model on ``{N:P}``: one block held by all ``P`` ranks). A tensor
   without a grid is one block held by every rank.
2. *Split.* A block of at least :data:`SPLIT_BYTES` with ``k > 1`` holders is cut along its first
   dim into ``min(k, rows)`` contiguous row ranges (each one a box, and one contiguous range of
   the block's bytes), given to the least loaded of its holders.
3. *Greedy.* Every smaller block goes whole to its least loaded holder, largest blocks first
   (ties to the lowest rank), so replicated bytes spread evenly over the ranks that hold them.

Every block, hence every byte, is written exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from distconv.checkpoint._index import Box, volume
from distconv.nn.sharding import ShardSpec

__all__ = ["SPLIT_BYTES", "Block", "Piece", "assign", "blocks_of"]

#: Blocks at least this large are split among their holders; smaller ones go whole to one.
SPLIT_BYTES = 1 << 20


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


def assign(blocks: Iterable[Block], size: int, split_bytes: int = SPLIT_BYTES) -> list[Piece]:
    """Every block's pieces with their writers (steps 2 and 3 of the module docstring)."""
    load = [0] * size
    pieces: list[Piece] = []
    for block in sorted(blocks, key=lambda b: (-b.nbytes, b.key, b.box)):
        rows = block.box[0][1] - block.box[0][0] if block.box else 1
        k = min(len(block.holders), rows) if block.nbytes >= split_bytes else 1
        writers = sorted(block.holders, key=lambda r: (load[r], r))[:k]
        for (lo, hi), rank in zip(_ranges(rows, k), sorted(writers)):
            box = block.box if k == 1 else ((block.box[0][0] + lo, block.box[0][0] + hi),
                                            *block.box[1:])
            nbytes = volume(box) * block.itemsize
            pieces.append(Piece(block.key, box, rank, None if k == 1 else (lo, hi), nbytes))
            load[rank] += nbytes
    return pieces


def _ranges(n: int, k: int) -> Sequence[tuple[int, int]]:
    """``n`` rows in ``k`` contiguous near-equal ranges (the first ``n % k`` one row longer)."""
    q, r = divmod(n, k)
    bounds = [i * q + min(i, r) for i in range(k + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(k)]

