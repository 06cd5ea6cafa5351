"""Redistribution between two distributions of a tensor (Dryden et al., §2.3.4–2.3.5).

Planning is a pure function of ``(grid layout, source Dist, target Dist, global shape)`` and is
cached; execution is a separate pass in which every step is an ``autograd.Function`` whose backward
is the step's exact adjoint:

=====================================  =========================================================
forward step                           adjoint (backward)
=====================================  =========================================================
AllGather   ``o_g -> *`` over g        ReduceScatter ``Σ_g -> o_g``
ReduceScatter ``Σ_g -> o_g``           AllGather
AllReduce   ``Σ_g -> *``               AllReduce
Slice       ``* -> o_g`` (discard)     Pad ``o_g -> Σ_g``: the local grad in zeros, pending over g
Pad         ``o_g -> Σ_g``             Slice
AllToAll    dim i over g -> dim j      AllToAll back, dim j -> dim i
KeepRoot    ``* -> Σ_g``               KeepRoot (self-adjoint)
=====================================  =========================================================

The cotangent of a tensor in Dist ``D`` lives in ``D.dual(grid)`` (pending and redundant dims
swapped): a replicated tensor's gradient is the sum of every rank's contribution. With that
convention the pairing of a tensor with its cotangent is the sum over all ranks of the local inner
products, and the backward of a redistribution ``S -> T`` is exactly the redistribution
``T.dual -> S.dual``. Slicing a replicated tensor therefore needs no communication in backward: its
gradient stays a pending sum until something needs it complete.

Planning is greedy, shrinking before growing: reduce-scatters, slices, allreduces (one merged
collective over every pending dim that must be summed), all-to-alls, pads, allgathers (minor dim
first, so every allgather is a segmented allgather of nested blocks), and finally KeepRoot for
pending sums the target introduces. Where a pending sum's reduce-scatter must wait for a gather,
the planner also tries summing it first (an allreduce on the smaller data) and keeps the plan
that moves fewer bytes in total.

Modules, one concern each: :mod:`~distconv.redistribute.steps` (the steps, their adjoints and
the context they run in), :mod:`~distconv.redistribute.planning` (``plan_redistribution``),
:mod:`~distconv.redistribute.execution` (the differentiable collectives: ``redistribute``,
``scatter``, ``gather``) and :mod:`~distconv.redistribute.between_grids` (``repartition``).
"""
from __future__ import annotations

from distconv.redistribute.between_grids import RepartitionPlan, repartition
from distconv.redistribute.execution import gather, redistribute, scatter
from distconv.redistribute.planning import Plan, plan_redistribution
from distconv.redistribute.steps import (
    AllGather, AllReduce, AllToAll, KeepRoot, Pad, ReduceScatter, Slice,
)

# Reached below the public names by the library's own modules, tests and benchmarks: the step
# context (distconv.nn.pipeline), the autograd functions (benchmarks/end_to_end.py) and the
# cached plan between grids (tests/test_planner.py).
from distconv.redistribute.between_grids import _Repartition as _Repartition
from distconv.redistribute.between_grids import _repartition_plan as _repartition_plan
from distconv.redistribute.execution import _StepFunction as _StepFunction
from distconv.redistribute.steps import _Ctx as _Ctx

__all__ = [
    "AllGather", "AllReduce", "AllToAll", "KeepRoot", "Pad", "Plan", "ReduceScatter", "Slice",
    "RepartitionPlan", "gather", "plan_redistribution", "redistribute", "repartition", "scatter",
]
