"""The flattened parameter vector split over ranks in balanced blocks.

A vector ``x`` of ``n`` entries (every parameter flattened, in ``params`` order) is held as
``x[o]``: rank ``r`` of ``P`` owns ``x[s_r : s_r + b_r]`` with ``(s_r, b_r) =
balanced_block(n, P, r)``.  Everything the hybrid-order optimizers do on long vectors goes
through this class, so a size-one space (``comm=None``) is single-process FOSI and a P-rank space
is DHO2, with the same arithmetic on every entry:

* ``dots(M, x)`` (``M`` a few rows) is the local product plus one small reduction;
* ``gather(x_slice)`` is ``* <- o`` (an allgather);
* ``reduce_mean(full, weight)`` is ``o <- Σ`` weighted by local sample counts (one reduce-scatter
  whose chunks carry the weight as a trailing entry, so uneven batches stay exact).

For checkpoints, ``spec(rows)`` states a sliced vector (or a stack of ``rows`` of them) as a
:class:`~distconv.nn.sharding.ShardSpec` on the one-dim grid ``{P: size}``: ``x[o_P]``, ``E[*, o_P]``,
the balanced blocks above, so a saved state reshards onto any number of ranks.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from distconv.distribution import Dist, balanced_block
from distconv.nn.sharding import ShardSpec

__all__ = ["SlicedSpace", "flatten", "assign"]


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """The concatenation of ``tensors`` flattened (a new vector)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


@torch.no_grad()
def assign(params: Sequence[Tensor], flat: Tensor) -> None:
    """Copy the full vector ``flat`` back into ``params`` (in order)."""
    offset = 0
    for p in params:
        p.copy_(flat[offset: offset + p.numel()].view_as(p))
        offset += p.numel()


class SlicedSpace:
    """Vectors of length ``n`` held as balanced blocks over ``comm`` (None: one rank)."""

    def __init__(self, n: int, comm=None) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int (the number of parameters), got {n!r}")
        self.n = n
        self.comm = comm
        self.size = 1 if comm is None else comm.size
        self.rank = 0 if comm is None else comm.rank
        self.blocks = [balanced_block(n, self.size, r) for r in range(self.size)]
        self.start, self.local = self.blocks[self.rank]
        self._grid = None

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def spec(self, rows: int | None = None) -> ShardSpec:
        """Where a sliced vector lies, ``x[o_P]`` of global shape ``(n,)``, or (``rows`` given) a
        stack of them, ``E[*, o_P]`` of shape ``(rows, n)``, over the grid ``{P: size}`` of this
        space's ranks; replicated (no grid) on one rank."""
        shape = (self.n,) if rows is None else (rows, self.n)
        if not self.distributed:
            return ShardSpec(None, Dist.replicated(len(shape)), shape)
        if self._grid is None:
            from distconv.grid import ProcessorGrid

            self._grid = ProcessorGrid({"P": self.size}, comm=self.comm)
        return ShardSpec(self._grid, Dist(("P",) if rows is None else (None, "P")), shape)

    def slice(self, full: Tensor) -> Tensor:
        """This rank's block of a full vector (a view)."""
        return full[self.start: self.start + self.local]

    def allreduce(self, t: Tensor, meta: str) -> Tensor:
        """The sum over ranks of a small tensor, bitwise equal on every rank.

        An allgather of the partials summed here in rank order: an MPI allreduce may round
        differently on different ranks, and the Lanczos breakdown test and the tridiagonal
        eigenproblem must see the same numbers everywhere (ranks must never branch apart).
        """
        if not self.distributed:
            return t
        parts = self.comm.allgather(t.contiguous(), meta=meta)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def dots(self, rows: Tensor, x: Tensor, meta: str = "hybrid dots") -> Tensor:
        """``rows @ x`` over the whole vector: ``rows`` is ``(m, b_r)``, ``x`` is ``(b_r,)``."""
        return self.allreduce(rows @ x, meta)

    def norm(self, x: Tensor) -> Tensor:
        return self.allreduce((x * x).sum().reshape(1), "hybrid norm")[0].sqrt()

    def gather(self, x: Tensor) -> Tensor:
        """``* <- o``: the full vector from every rank's block."""
        if not self.distributed:
            return x
        parts = self.comm.allgather(x, shapes=[(b,) for _, b in self.blocks],
                                    meta="hybrid gather")
        return torch.cat(parts)

    def reduce_mean(self, full: Tensor, weight: float) -> Tensor:
        """This rank's block of ``Σ_r w_r full_r / Σ_r w_r``: the global-batch mean when
        ``full_r`` is rank r's mean over its ``w_r`` samples."""
        if not self.distributed:
            return full.clone()
        w = full.new_tensor([float(weight)])
        chunks = [torch.cat([full[s: s + b] * w, w]) for s, b in self.blocks]
        mine = self.comm.reduce_scatter(chunks, meta="hybrid weighted mean")
        return mine[:-1] / mine[-1]

    def __repr__(self) -> str:
        return f"SlicedSpace(n={self.n}, size={self.size}, rank={self.rank}, local={self.local})"
