"""distconv: channel, filter, sample and spatial parallelism for CNNs (Dryden et al., SC'19).

The building blocks, bottom up: :mod:`distconv.comm` (communicators), :class:`ProcessorGrid`
(named grid dims), :class:`Dist` (per-tensor distributions in the paper's notation),
:func:`redistribute` (differentiable redistributions with exact adjoints) and
:mod:`distconv.nn` (distributed layers). On top: :func:`parallelize` (a whole model from a
declarative per-layer config, trained exactly by an ordinary data-parallel loop),
:func:`explain` (its plan on paper, for any world size) and sharded checkpoints that reshard
(:func:`save`, :func:`load`).
"""
from __future__ import annotations

from distconv import machines
from distconv.checkpoint import consolidate, load, load_global_state_dict, save
from distconv.data import rng_state, set_rng_state
from distconv.distribution import Dist, balanced_block, nested_block
from distconv.grid import ProcessorGrid
from distconv.nn.clip import clip_grad_norm_
from distconv.parallel import ParallelModel, parallelize
from distconv.parallel.explain import explain
from distconv.redistribute import (
    gather, plan_redistribution, redistribute, repartition, scatter,
)

__all__ = [
    "Dist", "ParallelModel", "ProcessorGrid", "balanced_block", "clip_grad_norm_", "consolidate",
    "explain", "gather", "load", "load_global_state_dict", "machines", "nested_block",
    "parallelize", "plan_redistribution", "redistribute", "repartition", "rng_state", "save",
    "scatter", "set_rng_state",
]
__version__ = "0.1.0"
