"""A whole-network planner: per convolution, the grid and algorithm that minimise the price of a
training step -- the price :func:`distconv.explain` reports, and no other.

The model is traced and analysed once (:func:`trace_network`: the one walk over the graph,
:mod:`distconv.parallel.graph`, so every graph ``parallelize`` runs is planned -- residual adds,
squeeze-and-excitation gates, many-way concatenations, interpolations to a skip's size). Every
convolution chooses a :class:`Choice` (grid layout and algorithm):

* ``sample``: grid ``{N: P}``;  ``spatial``: ``{N, H}`` or ``{N, H, W}`` (a volume's ``D``,
  ``H``, ``W``; a signal's ``W``);
* ``stationary-x``: ``{N, C}``;  ``stationary-y``: ``{N, F}``;  ``stationary-w``: ``{N, C, F}``,

with the model-parallel dims **last**, so channel groups sit inside a socket or node; every
other node is placed by its op handler from where its inputs are, as ``parallelize`` places it.
Planned from scratch, the plan also chooses its data grid (the config's ``data``: the input
``x[o_N,*,...]``): the sample grid ``{N: P}``, or where the first convolution is spatial its
own grid, the batch read onto the spatial ranks of its row (:func:`data_grids`); a given
config's data grid is kept.

The price of a plan is :mod:`distconv.parallel.cost`'s: every node's report by its op handler,
the conversions between placements, the running statistics and the gradient buckets, on the
two-stream timeline of :func:`distconv.pricing.timeline.timeline`. The search prices it
incrementally -- a node's report is cached per (node, placements, layer choice), a conversion's
steps per (value, source, target) -- in two stages over the same reports:

1. **a beam over the topological order** (:meth:`_Search.beam`): a state is the placement of
   every value still to be read (the frontier), and each node adds its report's seconds on the
   critical path, its gradient allreduce weighted by ``lam`` (0: hidden behind backward, 1: not;
   both are searched) and its memory weighted by a multiplier ``mu`` (0 unless a memory limit
   binds). States with the same frontier merge (a dynamic programme where the frontier is small:
   chains, residual blocks, U-Net skips); the ``width`` cheapest are kept (a beam where it is
   large: a DenseNet block's many-way concatenations). The additive score is the price except
   for how much of the gradient allreduces hides behind backward and how the buckets fuse;
2. **coordinate descent on the price itself** (:meth:`_Search.price`): from the cheapest of the
   beam's plans, the uniform plans (one grid and algorithm for every convolution) and the plan
   of each layer's own cheapest choice priced alone (how ``auto`` once chose per layer), each
   stage (a top-level module's layers) given one grid and algorithm at once, then each layer's
   alternatives (what the priced plans near the best give it, pipelined or not) with the rest
   kept, then the data grid's, until no change lowers the price.

So the plan returned is the least-priced plan the search visits, by the very price ``explain``
gives its config on the same machine (``Plan.step_time`` is that price), never priced above
the per-layer picks or a uniform plan that fits the memory.
"""

from __future__ import annotations

from distconv.planner.choices import (
    ACT, ALGORITHMS, Choice, ConvNode, LayerCost, Value, _memory, _problem, candidates,
    data_grids, grid_algorithm, layer_candidates, layer_cost, nd_layer_cost, sample_choice,
    transition_bytes,
)
from distconv.planner.plan import LayerPlan, Plan, explain, plan_network, predict
from distconv.planner.search import Network, _Search, graph_network, trace_network

__all__ = ["ACT", "ALGORITHMS", "Choice", "ConvNode", "LayerCost", "LayerPlan", "Network", "Plan",
           "Value", "candidates", "data_grids", "explain", "graph_network", "grid_algorithm",
           "layer_candidates", "layer_cost", "nd_layer_cost", "plan_network", "predict",
           "sample_choice", "trace_network", "transition_bytes"]
