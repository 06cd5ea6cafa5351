"""distconv: channel, filter, sample and spatial parallelism for CNN layers (Dryden et al., SC'19).

The building blocks, bottom up: :mod:`distconv.comm` (communicators), :class:`ProcessorGrid`
(named grid dims), :class:`Dist` (per-tensor distributions in the paper's notation) and
:func:`redistribute` (differentiable redistributions with exact adjoints).
"""
from __future__ import annotations

from distconv.distribution import Dist, balanced_block, nested_block
from distconv.grid import ProcessorGrid
from distconv.redistribute import (
    gather, plan_redistribution, redistribute, repartition, scatter,
)
from distconv.checkpoint import consolidate, load, load_global_state_dict, save

__all__ = [
    "Dist", "ProcessorGrid", "balanced_block", "gather", "nested_block", "plan_redistribution",
    "redistribute", "repartition", "scatter",
]
__all__ += ["consolidate", "load", "load_global_state_dict", "save"]
__version__ = "0.1.0"
