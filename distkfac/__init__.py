"""distkfac: a distributed K-FAC preconditioner on distconv's communicators.

    kfac = distkfac.KFAC(model, grid=grid)     # or comm=..., or neither for one process
    loss.backward()
    distkfac.allreduce_gradients(model.parameters(), grid.comm)   # or any data-parallel wrapper
    kfac.step()
    optimizer.step()

Conventions (see :mod:`distkfac.layers` and :mod:`distkfac.methods`):

* Factors: ``A = mean over rows of a a^T`` (im2col rows for convolutions, bias as a trailing 1),
  ``G = mean over rows of d d^T`` with ``d = n dL/dy``, n the local batch size: each rank's loss
  is a mean over its local batch, so ``d`` is a sample's own loss gradient.  Ranks reduce sums
  and row counts, so P ranks with local batches b_r equal one process on the concatenated batch.
* Damping: factored Tikhonov, ``V~ = (G + sqrt(lam) I)^-1 V (A + sqrt(lam) I)^-1`` for both
  ``'eigen'`` and ``'inverse'``; KL clip ``nu = min(1, sqrt(kl_clip / |lr^2 sum <V~, V>|))``.

Modules: :mod:`~distkfac.layers` (what a factor is per layer), :mod:`~distkfac.factors`
(running averages, upper-triangle packing), :mod:`~distkfac.methods` (eigen / Cholesky),
:mod:`~distkfac.placement` (who decomposes what: round-robin, LBP, cost model),
:mod:`~distkfac.comm` (fused asynchronous reductions, packed broadcasts),
:mod:`~distkfac.preconditioner` (:class:`KFAC`).
"""
from __future__ import annotations

from distkfac.comm import FactorReducer, PayloadBroadcaster, allreduce_gradients
from distkfac.factors import RunningFactor, pack, unpack
from distkfac.layers import Conv2dAdapter, LayerAdapter, LinearAdapter, conv_input_cov
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

__all__ = [
    "KFAC", "allreduce_gradients", "FactorReducer", "PayloadBroadcaster", "RunningFactor",
    "pack", "unpack", "LayerAdapter", "LinearAdapter", "Conv2dAdapter", "conv_input_cov",
    "Method", "EigenMethod", "InverseMethod", "CostModel", "FactorTask", "Placement",
    "RoundRobin", "LoadBalanced", "EVERYWHERE",
]

# the hybrid-order optimizers (FOSI, DHO2, MR-DHO2): see distkfac.hybrid
from distkfac.hybrid import DHO2, FOSI, MRDHO2  # noqa: E402

__all__ += ["FOSI", "DHO2", "MRDHO2"]
