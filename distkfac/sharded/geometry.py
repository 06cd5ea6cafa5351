"""Where a distributed convolution's weight shard lies, and the blocks of its factors that each
layout keeps: :class:`ShardGeometry` (extents, coordinates, the rows of A and G a block holds),
:class:`BlockLayout` (``'block'``'s diagonal blocks, also what checkpoints name) and the ranks that
hold the same shard (:func:`redundant_comm`); see :mod:`distkfac.sharded` for the layouts."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from distconv.distribution import balanced_block
from distkfac.layers import transposed_weight, transposed_weight_matrix

__all__ = ["LAYOUTS", "BlockLayout", "ShardGeometry", "redundant_comm", "shard_geometry"]


LAYOUTS = ("exact", "block")


class ShardGeometry:
    """Where a DistConv2d's or DistConvNd's weight shard lies: extents, coordinates and blocks
    over C and F.  A transposed layer's weight ``(in, out/groups, k...)`` is read as the direct
    convolution it equals (:class:`~distkfac.layers.ConvTransposeAdapter`): its rows (filters)
    are the output channels, its columns the input channels times the (flipped) kernel, so a
    transposed ``w[o_C, o_F, *..]`` is the direct ``w[o_F, o_C, *..]``."""

    def __init__(self, m: nn.Module) -> None:
        grid = m.grid
        w_rows, w_cols = m.weight_dist.entries[0], m.weight_dist.entries[1]
        #: a transposed layer (its shard read as the direct convolution's)
        self.transposed = bool(getattr(m, "transposed", False))
        if self.transposed and m._group_parts == 1:  # grouped: dim 0 holds the groups
            w_rows, w_cols = w_cols, w_rows
        self.cdim = w_cols if isinstance(w_cols, str) else None
        self.fdim = w_rows if isinstance(w_rows, str) else None
        self.C = grid.extent(self.cdim) if self.cdim else 1
        self.F = grid.extent(self.fdim) if self.fdim else 1
        self.c = grid.coords.get(self.cdim, 0) if self.cdim else 0
        self.f = grid.coords.get(self.fdim, 0) if self.fdim else 0
        #: kernel offsets per channel (``kh kw`` of a DistConv2d, ``prod(kernel)`` in N-d)
        self.k2 = math.prod(m.kernel_size)
        self.ci, self.fo = m.in_channels, m.out_channels
        self.bias = m.bias is not None
        self.c_blocks = [balanced_block(self.ci, self.C, i) for i in range(self.C)]
        self.f_blocks = [balanced_block(self.fo, self.F, j) for j in range(self.F)]
        self.K = self.ci * self.k2 + int(self.bias)

    def a_rows(self, i: int) -> Tensor:
        """Rows of the factor A that block i holds: balanced blocks of its K rows (any
        partition would do; this one is the Dist ``[o_C, *]`` checkpoints reshard)."""
        lo, n = balanced_block(self.K, self.C, i)
        return torch.arange(lo, lo + n)

    def a_inv_rows(self, i: int) -> Tensor:
        """Rows of ``(A + rI)^-1`` block i holds: the im2col rows of its channels (those its
        gradient columns meet), then the bias row (on every block: each adds its own bias
        shard's term)."""
        lo, n = self.c_blocks[i]
        rows = torch.arange(lo * self.k2, (lo + n) * self.k2)
        return torch.cat([rows, torch.tensor([self.K - 1])]) if self.bias else rows

    def g_rows(self, j: int) -> Tensor:
        lo, n = self.f_blocks[j]
        return torch.arange(lo, lo + n)

    def bias_subblocks(self) -> list[tuple[int, int]]:
        """The bias shards of block f's filters over C (b[o_{F x C}]), offsets inside it."""
        return [balanced_block(self.f_blocks[self.f][1], self.C, i) for i in range(self.C)]

    def matrix(self, w: Tensor, groups: int = 1) -> Tensor:
        """A tensor shaped like this rank's weight shard as ``(groups, filters, columns)``:
        the direct convolution's gradient-matrix block (see the class docstring)."""
        if self.transposed:
            return transposed_weight_matrix(w, groups)
        return w.reshape(groups, w.shape[0] // groups, -1)

    def weight(self, mat: Tensor, shape: torch.Size, groups: int = 1) -> Tensor:
        """The inverse of :meth:`matrix`: the block back in the weight shard's ``shape``."""
        return transposed_weight(mat, shape, groups) if self.transposed else mat.reshape(shape)


class BlockLayout:
    """The diagonal blocks of a DistConv2d's global factors that ``'block'`` keeps on a split of
    C channel blocks and F filter blocks.

    Indices are one process's: A is ``K x K`` (``K = C_i kh kw + b``, the im2col rows channel by
    channel, the bias row last), G is ``F_o x F_o``.  Shard ``(f, c)`` keeps

    * its ``"weight"`` block: A over the rows of channel block c (and the bias row when C = 1),
      G over filter block f;
    * with a bias and C > 1, its ``"bias"`` block: A over the bias row, G over the filters of
      the bias shard c inside block f (``b[o_{F x C}]``).

    Every block is a contiguous range of indices, so a block of one layout lies inside another
    layout's block when its ranges do, and it is then that block's diagonal sub-block.  C = F = 1
    is the whole factors (those of ``'exact'`` and of layers without a channel or filter split).
    """

    def __init__(self, ci: int, fo: int, k2: int, bias: bool, C: int, F: int) -> None:
        self.ci, self.fo, self.k2, self.bias, self.C, self.F = ci, fo, k2, bias, C, F
        self.K = ci * k2 + int(bias)

    @classmethod
    def of(cls, geo: ShardGeometry, *, whole: bool = False) -> BlockLayout:
        """The layout of ``geo``'s split (``whole``: of the whole factors)."""
        C, F = (1, 1) if whole else (geo.C, geo.F)
        return cls(geo.ci, geo.fo, geo.k2, geo.bias, C, F)

    @property
    def key(self) -> str:
        """How checkpoints name it: ``"C2xF1"``."""
        return f"C{self.C}xF{self.F}"

    @property
    def parts(self) -> tuple[str, ...]:
        return ("weight", "bias") if self.bias and self.C > 1 else ("weight",)

    def ranges(self, part: str, f: int, c: int) -> dict[str, tuple[int, int]]:
        """``{"A": (lo, hi), "G": (lo, hi)}`` of shard ``(f, c)``'s ``part`` block."""
        flo, fn = balanced_block(self.fo, self.F, f)
        if part == "bias":
            slo, sn = balanced_block(fn, self.C, c)
            return {"A": (self.K - 1, self.K), "G": (flo + slo, flo + slo + sn)}
        clo, cn = balanced_block(self.ci, self.C, c)
        hi = self.K if self.C == 1 else (clo + cn) * self.k2
        return {"A": (clo * self.k2, hi), "G": (flo, flo + fn)}

    def shards(self) -> list[tuple[int, int]]:
        """``(f, c)`` of every shard."""
        return [(f, c) for f in range(self.F) for c in range(self.C)]

    def side(self, part: str, key: str) -> int:
        """The largest block of ``key`` over the shards (what checkpoints pad to)."""
        return max(hi - lo for f, c in self.shards()
                   for lo, hi in [self.ranges(part, f, c)[key]])

    def holder(self, key: str, lo: int, hi: int, *,
               prefer: str = "weight") -> tuple[str, int, int, int] | None:
        """``(part, f, c, start)`` of a block of this layout whose ``key`` range holds
        ``[lo, hi)`` (``start``: where that range begins), None if none does; blocks of the
        part ``prefer`` first (a bias block's G lies in its weight block's G too)."""
        for part in sorted(self.parts, key=lambda p: p != prefer):
            for f, c in self.shards():
                a, b = self.ranges(part, f, c)[key]
                if a <= lo and hi <= b:
                    return part, f, c, a
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockLayout) and vars(self) == vars(other)

    def __str__(self) -> str:
        if self.C == self.F == 1:
            return "whole factors (factor_sharding='exact', or no channel or filter split)"
        return (f"factor_sharding='block' over C={self.C} channel blocks x F={self.F} filter "
                "blocks")

    def __repr__(self) -> str:
        return (f"BlockLayout(ci={self.ci}, fo={self.fo}, k2={self.k2}, bias={self.bias}, "
                f"C={self.C}, F={self.F})")


def shard_geometry(m: nn.Module) -> ShardGeometry:
    return ShardGeometry(m)


def redundant_comm(m: nn.Module):
    """The ranks that hold the same weight shard: the segment over the grid dims the weight's
    Dist leaves unused (N, H, W), None when there are none.  Read from the Dist, not from the
    layer's own gradient sync (a parallelized model fuses those)."""
    dims = [d for d in m.weight_dist.redundant(m.grid) if m.grid.extent(d) > 1]
    return m.grid.subcomm(dims) if dims else None
