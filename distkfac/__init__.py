"""distkfac: a distributed K-FAC preconditioner on distconv's grid and communicators.

    pmodel = distconv.parallelize(model, config)     # or DistConv2d layers of your own
    kfac = distkfac.KFAC(pmodel)                     # the model's grids, or the job's world
    loss = F.cross_entropy(pmodel(x), y)             # a mean over this rank's samples
    loss.backward()                                  # gradients complete on every shard
    kfac.step()
    optimizer.step()

A plain model under data parallelism averages its gradients before ``kfac.step()``
(``distkfac.allreduce_gradients(model.parameters(), comm)`` or any data-parallel wrapper).

Conventions (see :mod:`distkfac.layers`, :mod:`distkfac.sharded` and :mod:`distkfac.methods`):

* Factors: ``A = mean over rows of a a^T`` (im2col rows for convolutions, bias as a trailing 1),
  ``G = mean over rows of d d^T`` with ``d`` each sample's own loss gradient at the layer's
  output (``n dL/dy``: n the local batch for a plain model, the leading dim of the model's
  input; the global batch for parallelized models and DistConv2d layers).  Ranks reduce sums
  and row counts, so P ranks equal one process on the concatenated batch.
* DistConv2d factors follow the weight's distribution: ``factor_sharding='exact'`` (the global
  layer's K-FAC from row blocks) or ``'block'`` (per-shard diagonal blocks, no extra traffic).
* Damping: factored Tikhonov, ``V~ = (G + sqrt(lam) I)^-1 V (A + sqrt(lam) I)^-1`` for both
  ``'eigen'`` and ``'inverse'``; KL clip ``nu = min(1, sqrt(kl_clip / |lr^2 sum <V~, V>|))``.

Modules: :mod:`~distkfac.layers` (what a factor is per layer), :mod:`~distkfac.sharded` (factors
of DistConv2d shards), :mod:`~distkfac.factors` (running averages, upper-triangle packing),
:mod:`~distkfac.methods` (eigen / Cholesky), :mod:`~distkfac.placement` (who decomposes what:
round-robin, LBP, cost model), :mod:`~distkfac.comm` (fused asynchronous reductions, packed
broadcasts), :mod:`~distkfac.lowprec` (bf16 / fp16 / float21 factor traffic),
:mod:`~distkfac.preconditioner` (:class:`KFAC`).
"""
from __future__ import annotations

from distconv import __version__  # one project, one version (pyproject.toml)
from distkfac.comm import FactorReducer, PayloadBroadcaster, allreduce_gradients
from distkfac.factors import RunningFactor, pack, unpack
from distkfac.layers import (
    Conv2dAdapter, ConvNdAdapter, LayerAdapter, LinearAdapter, conv_input_cov,
)
from distkfac.lowprec import COMM_DTYPES, float21_pack, float21_unpack
from distkfac.methods import EigenMethod, InverseMethod, Method
from distkfac.placement import (
                                EVERYWHERE,
                                CostModel,
                                FactorTask,
                                LoadBalanced,
                                Placement,
                                RoundRobin,
)
from distkfac.preconditioner import KFAC
from distkfac.sharded import LAYOUTS, BiasShardAdapter, ExactLayer, ShardAdapter

__all__ = [
    "KFAC", "allreduce_gradients", "FactorReducer", "PayloadBroadcaster", "RunningFactor",
    "pack", "unpack", "LayerAdapter", "LinearAdapter", "Conv2dAdapter", "ConvNdAdapter", "conv_input_cov",
    "Method", "EigenMethod", "InverseMethod", "CostModel", "FactorTask", "Placement",
    "RoundRobin", "LoadBalanced", "EVERYWHERE", "LAYOUTS", "ShardAdapter", "BiasShardAdapter",
    "ExactLayer", "COMM_DTYPES", "float21_pack", "float21_unpack",
]

# the hybrid-order optimizers (FOSI, DHO2, MR-DHO2): see distkfac.hybrid
from distkfac.hybrid import DHO2, FOSI, MRDHO2  # noqa: E402

__all__ += ["FOSI", "DHO2", "MRDHO2"]
