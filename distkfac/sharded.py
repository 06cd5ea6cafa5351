"""K-FAC factors of a ``DistConv2d`` or ``DistConvNd`` that follow its weight's distribution
(Dryden et al.'s grid).

Notation as in :class:`distconv.nn.DistConv2d`: the weight is ``w[o_F, o_C]`` (stationary-w;
``w[*, o_C]`` for stationary-x, ``w[o_F, *]`` for stationary-y), replicated over the grid dims N,
H, W (its *redundant* dims).  The gradient matrix is ``V = [W_flat | b]`` (``F_o x K``,
``K = C_i kh kw + 1`` with a bias); rank ``(f, c)`` holds the shard ``V[f, c]``.  The global
layer's K-FAC is ``V~ = (G + r I)^-1 V (A + r I)^-1`` with ``r = sqrt(damping)``.

Statistics come from :attr:`DistConv2d.work_hook`: the input ``x[o,o_C,o,o]`` the local
convolution read (halo rows included) gives this rank's im2col rows, and the gradient of its
output, ``dL/dy[o,o_F,o,o]`` after the backward allgather over C, gives its filter rows.  Every
contribution is a sum over this rank's samples and positions, reduced over the redundant dims
(the ranks that hold the same shard) by the usual fused, asynchronous
:class:`~distkfac.comm.FactorReducer`.  Loss convention: the cotangent reaching ``y`` is
``dl_i / N`` per sample (each rank's loss is the sum of its samples' losses over the global
batch N, the contract of ``distconv.parallelize``; weight gradients are summed over N by the
layer), so ``G = N^2 / R * sum g g^T`` over the R = N Ho Wo global rows.

Two layouts (``factor_sharding``):

``'block'`` -- per-shard diagonal blocks (as Shampoo does on FSDP shards):
``V~[f, c] = (G_ff + r I)^-1 V[f, c] (A_cc + r I)^-1``.  The bias joins its weight block as
A's trailing row when C = 1 (``b[o_F]`` is aligned with the rows, as in single-process
K-FAC); with C > 1 its shard ``b[s]`` (filters ``s`` inside block f) is its own block
``(G_ss + r I)^-1 b[s] / (1 + r)`` (A of a bias is the mean of 1 * 1).  Factor memory
``(C_i kh kw / C)^2 + (F_o / F)^2`` per rank: 1/p^2.  Bytes per factor step (rank r of the
redundant segment, size P_R): ``allreduce_bytes(n + k, r, P_R, i)`` per bucket, n the packed
upper triangles of its blocks and k their count (see :class:`~distkfac.comm.FactorReducer`);
decompositions are placed within that segment and broadcast there as for data parallelism.
Nothing else moves but, with KL clipping, the one float64 allreduce of ``<V~, V>`` over the
grid.  With C = F = 1 (sample and spatial parallelism only) this is exactly the global layer's
K-FAC, so ``'exact'`` uses it too.

``'exact'`` -- the global layer's K-FAC.  The factor A (``K x K``) is kept as balanced
blocks of its rows over C, ``A[o_C, *]`` (``K_c`` rows on block c), G (``F_o x F_o``) as
``G[o_F, *]``; both replicated over the other grid dims.  The damped inverse of A is kept by
the rows that block c's gradient columns meet: the im2col rows of its channels
(``K'_c = C_c kh kw``) and the bias row, on every block; that of G as ``[o_F, *]``.

* Factor steps: the C ranks of a segment hold the same samples, each its channels.  One
  all-to-all over C gives rank c every channel of its block of the local samples (``n_c``
  of ``n``, balanced: ``n_c (C_i - C_c) H_x W_x`` numbers received, in x's dtype); it forms
  the whole A of those samples by lags (:func:`~distkfac.layers.conv_input_cov`, 1/C of
  the Gram matrix's work), and one asynchronous reduce-scatter over C sums the row blocks
  (``(C - 1) K_c K`` numbers in ``factor_comm_dtype``; with fp16 or float21 each rank's
  mean and rows travel instead, ``(C - 1) (enc(K_c K) + 8)`` bytes, see
  :func:`distkfac.lowprec.reduce_scatter`).  ``dL/dy`` is allgathered over F for ``G[f, :]``
  (``F_f x F_o``: ``(F_o - F_f) n H_o W_o`` numbers).  Both are then reduced over the
  redundant dims (``allreduce_bytes(K_c K + F_f F_o + 2, r, P_R, i)`` for one bucket; row
  blocks travel whole).
* Inverse steps: each factor has one owner among all ranks (the placement policy); one
  all-to-all brings it the other row blocks (``sum_{c' != c_o} K_{c'} K`` numbers to the
  owner of A), it decomposes the full factor and forms the damped inverse, and one all-to-all
  hands every rank its rows of that inverse (``(K'_c + b) K`` numbers for A, b = 1 with a
  bias, to each rank but the owner).  Only the owner holds a whole factor, and only while it
  decomposes.
* Every step: ``P = V[f, c] (A + rI)^-1[c, :] + e_c (A + rI)^-1[bias, :]`` (``e_c`` this
  rank's bias shard ``b[o_{F x C}]`` at its filters' rows) is a pending sum over C,
  reduce-scattered over C in column blocks, each with the bias column (``(C - 1) F_f (K'_c
  + b)`` numbers received); then ``(G + rI)^-1[f, :]^T U`` is a pending sum over F,
  reduce-scattered over F in row blocks (``(F - 1) F_f (K'_c + b)`` numbers).  All exact
  layers on one communicator share one reduce-scatter, launched before the data-parallel
  layers are preconditioned and waited for after.  With KL clipping one float64 allreduce of
  ``<V~, V>`` over the grid.

A damping that changes between decompositions takes effect at the next decomposition (the row
blocks are of the damped inverse).  Checkpoints: the factors are the global ``(1, K, K)`` and
``(1, F_o, F_o)`` tensors with the Dists above, so they reshard onto any grid or onto one
process (see :meth:`distkfac.KFAC.shard_specs`).

Checkpoints of ``'block'``: each shard's blocks are diagonal blocks of the global factors, over
contiguous index ranges (:class:`BlockLayout`).  They are saved stacked over the shards, and load
onto any layout whose blocks lie inside the saved ones (the same C and F on any grid, a finer
split, or blocks of whole factors saved under ``'exact'``), each a sub-block of a saved one;
other layouts are refused, naming both.

Grouped layers: K-FAC of a grouped convolution is block-diagonal by group, and a grouped
DistConv2d split over C or F holds whole groups (``w[o_C, *]``), so each rank's factors are
those of its groups (``(groups / p, d, d)``), exact in either layout with nothing moving but
the reductions over N, H, W.

N-d and transposed layers (:class:`distconv.nn.conv_nd.DistConvNd`): all of the above holds
with ``kh kw`` read as ``prod(kernel)`` and the spatial dims D, H, W as redundant dims; its work
hook hands over the haloed input and the output block's gradient alike.  A Conv1d's or
Conv3d's im2col rows are its input's windows (:func:`~distkfac.layers.windows`).  A transposed
convolution is the direct convolution it equals (:class:`~distkfac.layers.ConvTransposeAdapter`:
the input zero-stuffed and padded, the kernel flipped, the weight's channel dims swapped), so
its weight ``w[o_C, o_F, *..]`` is that convolution's ``w[o_F, o_C, *..]`` (in channels C,
out channels F) and the layouts above apply unchanged.  Split over space, each rank's output
block reads the input rows that scatter into it, exactly those its work hook gathered
(:func:`_transposed_rows`), so the sums over the ranks of a volume are one process's.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distconv.distribution import balanced_block
from distkfac.layers import (
    ConvNdAdapter, LayerAdapter, conv_input_cov, transposed_weight, transposed_weight_matrix,
    windows,
)
from distkfac.lowprec import reduce_scatter

__all__ = ["LAYOUTS", "BlockLayout", "ShardAdapter", "BiasShardAdapter", "ExactLayer", "precondition_exact",
           "SpatialShardAdapter", "redundant_comm", "shard_geometry"]

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


def _transposed_rows(m: nn.Module, x: Tensor, y_shape: Sequence[int], groups: int) -> Tensor:
    """The im2col rows of a transposed DistConvNd's output block, as the direct convolution it
    equals reads them (:class:`~distkfac.layers.ConvTransposeAdapter`): ``(groups, rows,
    columns)``.

    On each spatial dim (stride s, span ``P = dilation (kernel - 1)``, padding p) that
    convolution reads, for global output rows ``[o0, o1)``, the rows ``[o0 - P + p, o1 + p)`` of
    the input with ``s - 1`` zeros between its rows.  This rank's input ``x`` (the work hook's:
    its gathered rows ``[lo, ...)``, :class:`~distconv.conv_geometry.HaloPlan`'s ``needed``)
    holds every input row that scatters into its output block ``[o0, o1)`` (``out``); input row
    ``lo + j`` lies at ``s (lo + j)``, so it is placed at ``s (lo + j) - o0 + P - p`` of a zero
    array ``o1 - o0 + P`` long (rows that fall outside reach no output of the block), whose
    windows at stride 1 are the block's.  A dim the grid does not split is the whole output
    (``lo = o0 = 0``).  The global input shape is worked back from ``y_shape``."""
    k = len(m.kernel_size)
    sizes = []
    for i in range(k):
        s, p, op = m.stride[i], m.padding[i], m.output_padding[i]
        span = m.dilation[i] * (m.kernel_size[i] - 1)
        sizes.append((y_shape[2 + i] - 1 - span - op + 2 * p) // s + 1)
    plans = m.plans((y_shape[0], m.in_channels, *sizes))
    for i, plan in enumerate(plans):
        s, p = m.stride[i], m.padding[i]
        span = m.dilation[i] * (m.kernel_size[i] - 1)
        if plan is None:
            lo, (o0, o1) = 0, (0, y_shape[2 + i])
        else:
            r = m.grid.coords[m.spatial_dims[i]]
            lo, (o0, o1) = plan.needed[r][0], plan.out[r]
        offset, length, rows = s * lo - o0 + span - p, o1 - o0 + span, x.shape[2 + i]
        first = max(0, -(offset // s))  # the first and last input rows that land inside
        last = min(rows - 1, (length - 1 - offset) // s)
        shape = list(x.shape)
        shape[2 + i] = length
        z = x.new_zeros(shape)
        if last >= first:
            lead = (slice(None),) * (2 + i)
            z[lead + (slice(offset + s * first, offset + s * last + 1, s),)] = \
                x[lead + (slice(first, last + 1),)]
        x = z
    return windows(x, m.kernel_size, (1,) * k, m.dilation, groups)


def _input_cov(m: nn.Module, x: Tensor, padding: tuple[int, ...], y_shape: Sequence[int],
               groups: int, bias: bool) -> tuple[Tensor, int]:
    """``(sum of a a^T over the im2col rows of this rank's output block, rows)`` from the input
    the work hook hands over (``padding``: the zero padding the local convolution still
    applies, ``F.pad``'s list), per group, the bias's 1 appended with ``bias``.  A direct 2-D
    layer's by lags (:func:`~distkfac.layers.conv_input_cov`); 1-D and 3-D ones from the
    input's windows (:func:`~distkfac.layers.windows`); a transposed one from
    :func:`_transposed_rows`."""
    if getattr(m, "transposed", False):
        rows = _transposed_rows(m, x, y_shape, groups)
    elif len(m.kernel_size) == 2:
        return conv_input_cov(x, m.kernel_size, stride=m.stride, dilation=m.dilation,
                              groups=groups, bias=bias, padding=padding)
    else:
        rows = windows(F.pad(x, padding) if any(padding) else x, m.kernel_size, m.stride,
                       m.dilation, groups)
    if bias:
        rows = torch.cat([rows, rows.new_ones(*rows.shape[:2], 1)], dim=2)
    return rows.transpose(1, 2) @ rows, rows.shape[1]


def _g_cov(gy: Tensor, groups: int, dtype: torch.dtype) -> tuple[Tensor, int]:
    """Per group, the sum over samples and output positions of ``d d^T``, and the rows."""
    n, f = gy.shape[:2]
    rows = gy.detach().to(dtype).reshape(n, groups, f // groups, math.prod(gy.shape[2:]))
    return (rows @ rows.transpose(-1, -2)).sum(0), n * rows.shape[-1]


class _WorkHookAdapter(LayerAdapter):
    """A DistConv2d or DistConvNd shard's K-FAC block: its statistics arrive through the layer's
    work hook (``work_a`` / ``work_g``), never through the generic per-module hooks.  The hook
    sets :attr:`positions` (global output positions per sample), :attr:`prescaled` (whether it
    scales G by ``N^2`` itself) and :attr:`y_shape` (the global output shape) first."""

    def __init__(self, module: nn.Module, name: str) -> None:
        super().__init__(module, name)
        self.positions, self.prescaled = 1, False
        self.y_shape: tuple[int, ...] = ()

    @staticmethod
    def batch_size(x: Tensor) -> int:
        return x.shape[0]

    def a_sum(self, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
        raise TypeError("a DistConv2d shard's factors come from its work hook")

    g_sum = a_sum


class ShardAdapter(_WorkHookAdapter):
    """The weight shard ``V[f, c]`` of a DistConv2d or DistConvNd (direct or transposed, read as
    the direct convolution it equals: :class:`ShardGeometry`) as one K-FAC block (``'block'``
    layout, and the exact layer when C = F = 1, or of a grouped layer whose blocks hold whole
    groups).  Statistics arrive through :meth:`work_a` and :meth:`work_g`; ``G`` is scaled by
    ``N^2`` from the reduced row count."""

    def __init__(self, module: nn.Module, name: str, geo: ShardGeometry) -> None:
        super().__init__(module, name)
        self.geo = geo
        self._bias = geo.bias and geo.C == 1
        # a grouped layer split over C or F (or both) holds whole groups: its share of them
        self._groups = module.groups // module._group_parts if module.groups > 1 else 1

    @property
    def has_bias(self) -> bool:
        return self._bias

    @property
    def groups(self) -> int:
        return self._groups

    @property
    def a_dim(self) -> int:
        w = self.module.weight
        channels = w.shape[0] // self._groups if self.geo.transposed else w.shape[1]
        return channels * self.geo.k2 + int(self._bias)

    @property
    def g_dim(self) -> int:
        w = self.module.weight
        return w.shape[1] if self.geo.transposed else w.shape[0] // self._groups

    def weight_matrix(self, w: Tensor) -> Tensor:
        return self.geo.matrix(w, self._groups)

    def matrix_weight(self, mat: Tensor, shape: torch.Size) -> Tensor:
        return self.geo.weight(mat, shape, self._groups)

    def work_a(self, x: Tensor, padding: tuple[int, ...], y: Tensor,
               dtype: torch.dtype) -> tuple[Tensor, int]:
        return _input_cov(self.module, x.detach().to(dtype), padding, self.y_shape,
                          self._groups, self._bias)

    def work_g(self, gy: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
        return _g_cov(gy, self._groups, dtype)

    def g_scale(self, rows: float) -> float:
        """``G = sum / rows * N^2``: N^2 already applied in the hook when the global batch was
        known there, else ``N = rows / (global output positions per sample)``."""
        return 1.0 if self.prescaled else (rows / self.positions) ** 2


class SpatialShardAdapter(_WorkHookAdapter, ConvNdAdapter):
    """A ``DistConvNd`` split over samples and spatial dims only (its weight whole on every
    rank) as one K-FAC block: the im2col rows of the rank's output block, from the haloed input
    its work hook hands over, summed over the ranks that split samples and space as the rows of
    one process's batch are; ``G`` likewise from the output block's gradient."""

    def work_a(self, x: Tensor, padding: tuple[int, ...], y: Tensor,
               dtype: torch.dtype) -> tuple[Tensor, int]:
        m = self.module
        x = x.detach().to(dtype)
        if any(padding):
            x = F.pad(x, padding)
        return self.rows_cov(windows(x, m.kernel_size, m.stride, m.dilation, self.groups))

    def work_g(self, gy: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
        return _g_cov(gy, self.groups, dtype)

    g_scale = ShardAdapter.g_scale


class BiasShardAdapter(_WorkHookAdapter):
    """A bias shard ``b[s]`` as its own block (``'block'`` layout with C > 1): ``A = [1]``,
    ``G = G_ss`` from the gradient rows of its filters."""

    def __init__(self, module: nn.Module, name: str, geo: ShardGeometry) -> None:
        super().__init__(module, name)
        self.geo = geo
        lo, _ = geo.bias_subblocks()[geo.c]
        self.offset = lo

    @property
    def has_bias(self) -> bool:
        return False

    @property
    def groups(self) -> int:
        return 1

    @property
    def a_dim(self) -> int:
        return 1

    @property
    def g_dim(self) -> int:
        return self.module.bias.shape[0]

    def work_a(self, x: Tensor, padding: tuple[int, ...], y: Tensor,
               dtype: torch.dtype) -> tuple[Tensor, int]:
        rows = y.shape[0] * math.prod(y.shape[2:])
        return torch.full((1, 1, 1), float(rows), dtype=dtype, device=y.device), rows

    def work_g(self, gy: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
        return _g_cov(gy[:, self.offset: self.offset + self.g_dim], 1, dtype)

    g_scale = ShardAdapter.g_scale

    def grad_matrix(self, dtype: torch.dtype) -> Tensor | None:
        b = self.module.bias
        return None if b.grad is None else b.grad.detach().to(dtype).reshape(1, -1, 1)

    def set_grad(self, mat: Tensor) -> None:
        b = self.module.bias
        b.grad.copy_(mat.reshape(b.shape).to(b.grad.dtype))


class ExactLayer:
    """Runtime of one DistConv2d or DistConvNd (direct or transposed, :class:`ShardGeometry`)
    under ``'exact'``: row-block factors, their owners, and the two reduce-scatters that apply
    the damped inverses (see the module docstring)."""

    def __init__(self, module: nn.Module, name: str, dtype: torch.dtype,
                 comm_dtype: torch.dtype | str | None = None) -> None:
        geo = ShardGeometry(module)
        self.comm_dtype = comm_dtype
        if module.groups > 1:
            raise NotImplementedError(
                f"K-FAC of the grouped {type(module).__name__} {name!r} (groups={module.groups}) "
                "as one exact layer over channel or filter blocks is not implemented (its blocks "
                "hold whole groups: register it per shard, ShardAdapter); skip it with "
                "skip_layers or use sample/spatial parallelism for it")
        self.module, self.name, self.geo, self.dtype = module, name, geo, dtype
        grid = module.grid
        self.grid = grid
        self.c_comm = grid.subcomm([geo.cdim]) if geo.C > 1 else None
        self.f_comm = grid.subcomm([geo.fdim]) if geo.F > 1 else None
        self.comm = redundant_comm(module)
        self.rows = {"A": geo.a_rows(geo.c), "G": geo.g_rows(geo.f)}
        self.inv_rows = {"A": geo.a_inv_rows(geo.c), "G": self.rows["G"]}
        self.side = {"A": geo.K, "G": geo.fo}
        self.factors: dict[str, Tensor | None] = {"A": None, "G": None}
        self.updates = 0
        self.inverse_rows: dict[str, Tensor | None] = {"A": None, "G": None}
        self.positions, self.prescaled = 1, False
        self.y_shape: tuple[int, ...] = ()

    @property
    def replication(self) -> int:
        return 1 if self.comm is None else self.comm.size

    # ------------------------------------------------------------------ statistics
    def work_a(self, x: Tensor, padding: tuple[int, ...], y: Tensor,
               dtype: torch.dtype) -> tuple[Tensor | Callable[[], Tensor], int]:
        """``A[c, :]``'s contribution of this rank's samples, or (C > 1) a callable that waits
        for it: the C ranks of a segment hold the same samples, each its channels, so one
        all-to-all over C gives rank c every channel of its 1/C of the samples; it forms the
        whole A of those (by lags, :func:`~distkfac.layers.conv_input_cov`) and one
        asynchronous reduce-scatter over C sums the row blocks.  Each rank forms 1/C of the
        Gram matrix instead of its row block of all of it."""
        m, geo = self.module, self.geo
        x = x.detach()
        positions = math.prod(y.shape[2:])
        rows = x.shape[0] * positions

        def cov(xs: Tensor) -> Tensor:
            return _input_cov(m, xs.to(dtype), padding, self.y_shape, 1, geo.bias)[0]

        if self.c_comm is None:
            return cov(x), rows
        samples = [balanced_block(x.shape[0], geo.C, i) for i in range(geo.C)]
        mine = samples[geo.c][1]
        parts = self.c_comm.alltoall(
            [x[lo: lo + n].contiguous() for lo, n in samples],
            recv_shapes=[(mine, n, *x.shape[2:]) for _, n in geo.c_blocks],
            meta=f"kfac x of {self.name}")
        if mine:
            full = cov(torch.cat(parts, 1))[0]
        else:
            full = torch.zeros(geo.K, geo.K, dtype=dtype, device=x.device)
        blocks = [(lo * geo.K, n * geo.K) for lo, n in
                  (balanced_block(geo.K, geo.C, i) for i in range(geo.C))]
        wait = reduce_scatter(self.c_comm, full.reshape(-1), mine * positions,
                              blocks, self.comm_dtype, meta=f"kfac A rows of {self.name}")
        return (lambda: wait().reshape(1, -1, geo.K)), rows

    def work_g(self, gy: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
        """``G[f, :]``'s contribution (sum of g g^T, unscaled; allgather over F)."""
        g = gy.detach().to(dtype)
        full = g
        if self.f_comm is not None:
            shapes = [(g.shape[0], n, *g.shape[2:]) for _, n in self.geo.f_blocks]
            full = torch.cat(self.f_comm.allgather(g.contiguous(), shapes=shapes,
                                                   meta=f"kfac dL/dy of {self.name}"), 1)
        mine = g.flatten(2)
        return ((mine @ full.flatten(2).transpose(1, 2)).sum(0).unsqueeze(0),
                g.shape[0] * mine.shape[2])

    def update(self, results: dict[str, tuple[Tensor, float]], decay: float) -> bool:
        a, g = results.get(self.name + "/A"), results.get(self.name + "/G")
        if a is None or g is None:
            return False
        scale = 1.0 if self.prescaled else (g[1] / self.positions) ** 2
        new = {"A": a[0][0] / a[1], "G": g[0][0] / g[1] * scale}
        for key, value in new.items():
            value = value.to(self.dtype)
            old = self.factors[key]
            self.factors[key] = value.clone() if old is None else old.mul_(decay).add_(
                value, alpha=1.0 - decay)
        self.updates += 1
        return True

    # ------------------------------------------------------------------ preconditioning
    def ready(self) -> bool:
        """Whether this step preconditions the layer: its weight has a gradient and the row
        blocks of the damped inverses have arrived."""
        return self.module.weight.grad is not None and self.inverse_rows["A"] is not None

    def a_side(self) -> tuple[list[Tensor], tuple[Tensor, Tensor | None]]:
        """``P = V[f, c] (A + rI)^-1[c, :] + e_c (A + rI)^-1[bias, :]``, a pending sum over C
        (``e_c``: this rank's bias shard at its filters' rows), as the C column blocks the
        reduce-scatter hands out, each with the bias column; and ``V`` (weight, bias)."""
        m, geo = self.module, self.geo
        vw = geo.matrix(m.weight.grad.detach())[0].to(self.dtype)
        fn, ck = vw.shape
        a_inv = self.inverse_rows["A"]
        p = vw @ a_inv[:ck]
        vb = None
        if geo.bias:
            vb = (m.bias.grad.detach().to(self.dtype) if m.bias.grad is not None
                  else vw.new_zeros(m.bias.shape))
            lo, n = self._bias_block()
            e = vw.new_zeros(fn)
            e[lo: lo + n] = vb
            p = p.addr(e, a_inv[ck])
        if self.c_comm is None:
            return [p], (vw, vb)
        chunks = []
        for lo, n in geo.c_blocks:
            part = p[:, lo * geo.k2: (lo + n) * geo.k2]
            chunks.append(torch.cat([part, p[:, -1:]], 1) if geo.bias else part.contiguous())
        return chunks, (vw, vb)

    def g_side(self, u: Tensor) -> list[Tensor]:
        """``(G + rI)^-1[f, :]^T U``, a pending sum over F, as the F row blocks."""
        g_inv = self.inverse_rows["G"]
        if self.f_comm is None:
            return [g_inv @ u]
        q = g_inv.T @ u
        return [q[lo: lo + n] for lo, n in self.geo.f_blocks]

    def result(self, v: Tensor, vw: Tensor, vb: Tensor | None,
               ) -> tuple[Tensor, Tensor, Callable[[Tensor], None]]:
        """``(V shard, V~ shard, write)`` flattened alike, from this rank's block of V~ and
        its gradient ``V`` (weight ``vw``, bias ``vb``)."""
        m = self.module
        fn, ck = vw.shape
        got, out = [vw.reshape(-1)], [v[:, :ck].reshape(-1)]
        if vb is not None:
            lo, n = self._bias_block()
            got.append(vb.reshape(-1))
            out.append(v[lo: lo + n, -1])

        def write(scaled: Tensor) -> None:
            m.weight.grad.copy_(self.geo.weight(scaled[: fn * ck], m.weight.shape))
            if vb is not None and m.bias.grad is not None:
                m.bias.grad.copy_(scaled[fn * ck:].reshape(m.bias.shape))

        return torch.cat(got), torch.cat(out), write

    def _bias_block(self) -> tuple[int, int]:
        """This rank's bias shard inside its filter block: ``b[o_{F x C}]``."""
        if self.c_comm is None:
            return 0, self.geo.f_blocks[self.geo.f][1]
        return self.geo.bias_subblocks()[self.geo.c]

    def __repr__(self) -> str:
        return (f"ExactLayer({self.name!r}, A rows {len(self.rows['A'])}/{self.side['A']}, "
                f"G rows {len(self.rows['G'])}/{self.side['G']})")


def _fused_reduce_scatter(comms: list, parts: list[list[Tensor]],
                          meta: str) -> Callable[[], list[Tensor]]:
    """Launch one asynchronous reduce-scatter per communicator for all the layers on it
    (``parts[i][r]``: layer i's chunk for rank r; ``comms[i]`` None: nothing to reduce) and
    return the wait that hands back each layer's own chunk."""
    out: list[Tensor | None] = [p[0] if c is None else None for c, p in zip(comms, parts)]
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(comms):
        if c is not None:
            groups.setdefault(id(c), []).append(i)
    pending = []
    for idx in groups.values():
        comm = comms[idx[0]]
        chunks = [torch.cat([parts[i][r].reshape(-1) for i in idx]) for r in range(comm.size)]
        work = comm.reduce_scatter(chunks, async_op=True, meta=f"{meta} of {len(idx)} layers")
        pending.append((idx, [parts[i][comm.rank].shape for i in idx], work))

    def wait() -> list[Tensor]:
        for idx, shapes, work in pending:
            flat, offset = work.wait(), 0
            for i, shape in zip(idx, shapes):
                n = shape.numel()
                out[i] = flat[offset: offset + n].reshape(shape)
                offset += n
        return out

    return wait


def precondition_exact(layers: list[ExactLayer], meanwhile: Callable[[], None] = lambda: None,
                       ) -> list[tuple[int, Tensor, Tensor, Callable[[Tensor], None]]]:
    """Precondition every ready exact layer: one reduce-scatter over each C communicator for
    all of them (``meanwhile()`` runs while it is in flight), then one over each F
    communicator.  Returns ``(replication, V, V~, write)`` per layer."""
    ready = [ly for ly in layers if ly.ready()]
    sides = [ly.a_side() for ly in ready]
    wait = _fused_reduce_scatter([ly.c_comm for ly in ready], [p for p, _ in sides],
                                 "kfac A^-1")
    meanwhile()
    us = wait()
    vs = _fused_reduce_scatter([ly.f_comm for ly in ready],
                               [ly.g_side(u) for ly, u in zip(ready, us)], "kfac G^-1")()
    return [(ly.replication, *ly.result(v, *grads))
            for ly, v, (_, grads) in zip(ready, vs, sides)]


def exchange_exact(work: list[tuple[ExactLayer, str]], owners: list[int], comm,
                   decompose: Callable[[Tensor], Tensor], dtype: torch.dtype) -> None:
    """Assemble each exact factor on its owner, decompose it there and hand every rank its
    row block of the damped inverse: two all-to-alls over ``comm`` (all ranks of the grid).

    ``work[i] = (layer, 'A' or 'G')`` is owned by rank ``owners[i]``; ``decompose(full)``
    returns the damped inverse of a full ``(d, d)`` factor."""
    size, me = comm.size, comm.rank
    tasks = [(ly, key, owner) for (ly, key), owner in zip(work, owners)]
    # where the factors lie (every rank holds its row blocks of every task's factor)
    device = next((ly.factors[key].device for ly, key, _ in tasks
                   if ly.factors[key] is not None), torch.device("cpu"))

    def row_dim(ly: ExactLayer, key: str) -> str | None:
        return ly.geo.cdim if key == "A" else ly.geo.fdim

    def block_of(ly: ExactLayer, key: str, rank: int) -> int:
        d = row_dim(ly, key)
        return ly.grid.coords_of(rank).get(d, 0) if d else 0

    def rows_of(ly: ExactLayer, key: str, block: int) -> Tensor:
        return ly.geo.a_rows(block) if key == "A" else ly.geo.g_rows(block)

    def inv_rows_of(ly: ExactLayer, key: str, block: int) -> Tensor:
        return ly.geo.a_inv_rows(block) if key == "A" else ly.geo.g_rows(block)

    def sources(ly: ExactLayer, key: str, owner: int) -> dict[int, int]:
        """{block: rank that sends it} for the owner: the ranks that share all its coordinates
        but the row dim's."""
        d = row_dim(ly, key)
        if d is None:
            return {0: owner}
        coords = ly.grid.coords_of(owner)
        return {b: ly.grid.rank_of({**coords, d: b}) for b in range(ly.grid.extent(d))}

    # 1. row blocks to owners
    send: list[list[Tensor]] = [[] for _ in range(size)]
    recv_numel = [0] * size
    for ly, key, owner in tasks:
        for block, src in sources(ly, key, owner).items():
            n = len(rows_of(ly, key, block)) * ly.side[key]
            if src == me and owner != me:
                send[owner].append(ly.factors[key].reshape(-1))
            if owner == me and src != me:
                recv_numel[src] += n
    empty = torch.empty(0, dtype=dtype, device=device)
    got = comm.alltoall([torch.cat(s) if s else empty for s in send],
                        recv_shapes=[(n,) for n in recv_numel], meta="kfac exact factors")
    offsets = [0] * size
    mine: dict[tuple[int, str], Tensor] = {}
    for ly, key, owner in tasks:
        if owner != me:
            continue
        full = torch.empty(ly.side[key], ly.side[key], dtype=dtype, device=device)
        for block, src in sources(ly, key, owner).items():
            rows = rows_of(ly, key, block)
            n = len(rows) * ly.side[key]
            part = (ly.factors[key] if src == me
                    else got[src][offsets[src]: offsets[src] + n].reshape(len(rows), -1))
            if src != me:
                offsets[src] += n
            full[rows] = part
        mine[(id(ly), key)] = decompose((full + full.T) / 2)
    # 2. row blocks of the damped inverses from owners
    send = [[] for _ in range(size)]
    recv_numel = [0] * size
    for ly, key, owner in tasks:
        for r in range(size):
            if r == owner:
                continue
            if owner == me:
                send[r].append(mine[(id(ly), key)][inv_rows_of(ly, key, block_of(ly, key, r))]
                               .reshape(-1))
            if r == me:
                recv_numel[owner] += len(ly.inv_rows[key]) * ly.side[key]
    got = comm.alltoall([torch.cat(s) if s else empty for s in send],
                        recv_shapes=[(n,) for n in recv_numel], meta="kfac exact inverses")
    offsets = [0] * size
    for ly, key, owner in tasks:
        if owner == me:
            ly.inverse_rows[key] = mine[(id(ly), key)][ly.inv_rows[key]].clone()
        else:
            n = len(ly.inv_rows[key]) * ly.side[key]
            ly.inverse_rows[key] = got[owner][offsets[owner]: offsets[owner] + n].reshape(
                len(ly.inv_rows[key]), -1)
            offsets[owner] += n


def attach(module: nn.Module, fn: Any) -> None:
    """Install ``fn`` as the DistConv2d's work hook (one K-FAC per layer)."""
    if getattr(module, "work_hook", None) is not None:
        raise ValueError(f"{type(module).__name__} already has a work hook: one K-FAC per model")
    module.work_hook = fn
