"""``KFAC``: the preconditioner a training loop calls between ``backward`` and the optimizer.

Per step (Pauloski et al. SC'20, Listing 1: ``loss.backward(); kfac.step(); optimizer.step()``):

1. Hooks (on factor-update steps): the forward hook forms ``sum a a^T`` from the layer input, the
   output-gradient hook ``sum d d^T``; each is packed (upper triangle) into the open bucket of
   its group's :class:`~distkfac.comm.FactorReducer`, launched asynchronously when full, so
   factor communication overlaps the rest of forward and backward.  A module called several
   times per step (weight sharing) or over several backward passes (``accumulation_steps``)
   adds its contributions and rows.
2. ``step()`` waits for the buckets; factors become ``sum / rows`` of the concatenated batch and
   enter the running averages (fp32 by default, whatever the activation dtype).
3. On inverse-update steps the factors are decomposed where the placement policy says
   (``'lbp'`` or ``'round-robin'``) and the payloads broadcast, packed per owning rank; with
   ``stale_threshold`` a factor that moved less than that since its last decomposition keeps
   it, and is looked at again after twice as many scheduled updates (Osawa et al.'s stale
   statistics), back to every update once it moves.
4. Every step, each layer's gradient ``V`` becomes ``(G + sqrt(lam) I)^-1 V (A + sqrt(lam) I)^-1``
   (see :mod:`distkfac.methods`), scaled by the KL-clip factor
   ``nu = min(1, sqrt(kl_clip / |lr^2 sum_l <V~_l, V_l>|))`` (Pauloski et al. eq. 18).

Data parallelism (plain ``nn.Linear`` / ``nn.Conv2d`` layers): each rank's loss is a mean over its
local batch and the gradients are averaged over ranks before ``step()`` (e.g.
:func:`distkfac.allreduce_gradients`).  Factors are reduced as sums of per-row outer products with
their row counts, so P ranks with local batches b equal one process with the concatenated batch
(also for unequal b); ``d = b dL/dy`` is each sample's own loss gradient.

``DistConv2d`` layers: the factors follow the weight's distribution (:mod:`distkfac.sharded`,
layouts ``'exact'`` and ``'block'``); their gradients are complete after ``backward`` and the
cotangent at their output is ``dl_i / N`` (global-mean units).

Modules, one concern each: :mod:`~distkfac.preconditioner.kfac` (the :class:`KFAC` class: its
options, public methods and the order of a step), :mod:`~distkfac.preconditioner.hooks`
(registration and factor hooks, steps 1-2), :mod:`~distkfac.preconditioner.decompositions`
(placement, broadcast and stale statistics, step 3), :mod:`~distkfac.preconditioner.precondition`
(the preconditioned gradients and the KL clip, step 4), :mod:`~distkfac.preconditioner.checkpoint`
(``state_dict``, ``shard_specs``, loading onto a layout) and :mod:`~distkfac.preconditioner.layer`
(the state kept per layer and factor).
"""
from __future__ import annotations

from distkfac.preconditioner.kfac import KFAC

__all__ = ["KFAC"]
