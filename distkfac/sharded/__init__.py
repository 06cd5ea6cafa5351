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
(``_transposed_rows`` in :mod:`~distkfac.sharded.statistics`), so the sums over the ranks of a
volume are one process's.

Modules, one concern each: :mod:`~distkfac.sharded.geometry` (where a shard lies and the blocks
each layout keeps), :mod:`~distkfac.sharded.statistics` (the factors' statistics from the work
hook, the ``'block'`` adapters) and :mod:`~distkfac.sharded.exact` (``'exact'``'s row-block
factors, decompositions and preconditioning).
"""

from __future__ import annotations

from distkfac.sharded.exact import ExactLayer, precondition_exact
from distkfac.sharded.geometry import LAYOUTS, BlockLayout, redundant_comm, shard_geometry
from distkfac.sharded.statistics import BiasShardAdapter, ShardAdapter, SpatialShardAdapter

# Read by K-FAC's preconditioner modules beside the names above.
from distkfac.sharded.exact import exchange_exact as exchange_exact
from distkfac.sharded.geometry import ShardGeometry as ShardGeometry
from distkfac.sharded.statistics import attach as attach

__all__ = ["LAYOUTS", "BlockLayout", "ShardAdapter", "BiasShardAdapter", "ExactLayer",
           "precondition_exact", "SpatialShardAdapter", "redundant_comm", "shard_geometry"]
