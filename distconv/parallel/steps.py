"""What the analysis of a traced graph states per node, as plain values: the layer spec a node
builds, the step (its placement and its inputs' conversions) and the analysis of a whole graph.
Below the op handlers, which make these (:mod:`distconv.ops`), and the walk that asks them
(:mod:`distconv.parallel.graph`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from distconv.distribution import Dist
from distconv.parallel.placement import Layout, Placement

__all__ = ["SAMPLES", "Analysis", "LayerSpec", "Step", "sample_dist", "samples_of"]

#: node.meta key: ``(dim, mover)``, the dim of a node's value that holds the samples and the node
#: that moved them there ("" where they never left dim 0). A function of the graph's ops alone
#: (permutes, indexing, contractions), the same under every config; the walk records it
SAMPLES = "distconv_samples"


@dataclass(frozen=True)
class LayerSpec:
    """A module to build: its kind, config choice and placements (conv: grid and algorithm)."""

    kind: str
    name: str
    layout: Layout
    algorithm: str = ""
    roles: tuple[tuple[str, str], ...] = ()
    input: Placement | None = None
    source: str = ""
    statistics: str = "global"  # BatchNorm: global-batch or per-sample-block statistics
    pipeline: int = 1  # conv: chunks of samples its collectives are pipelined over
    overlap: bool = False  # conv: its halo exchange overlaps the interior rows' convolution
    #: the spatial grid dims a default entry splits that this layer keeps whole (its maps have
    #: one row there, as the graph states: a keepdim mean, an adaptive pool to 1)
    whole: tuple[str, ...] = ()


@dataclass
class Step:
    """One node: what runs, where its value lives, and what its inputs are converted to."""

    node: fx.Node
    kind: str
    out: Placement | None
    needs: dict[fx.Node, Placement] = field(default_factory=dict)
    layer: LayerSpec | None = None
    handler: Any = None  # the op handler that placed it (distconv.ops)
    #: activation checkpointing: the index of the run of consecutive checkpointed steps this one
    #: belongs to (recomputed together in backward); None: its activations are kept
    segment: int | None = None
    #: the dim of the value that holds the samples (0 unless the op moves them:
    #: :attr:`~distconv.ops.base.Handler.samples_anywhere`)
    samples: int = 0


@dataclass
class Analysis:
    graph: fx.GraphModule
    steps: list[Step]
    data: Layout
    #: with ``strict=False``: every node no handler runs, as (node, target, reason)
    unsupported: list[tuple[str, str, str]] = field(default_factory=list)

    def step(self, node: fx.Node) -> Step:
        return self._by_node[node]

    def __post_init__(self) -> None:
        self._by_node = {s.node: s for s in self.steps}


def sample_dist(ndim: int) -> Dist:
    return Dist(("N",) + (None,) * (ndim - 1))


def samples_of(node: Any) -> tuple[int, str]:
    """``(dim, mover)``: the dim of ``node``'s value that holds the samples, and the node that
    moved them there ("": dim 0, where the input has them), as the walk recorded it."""
    if not isinstance(node, fx.Node):
        return 0, ""
    return node.meta.get(SAMPLES, (0, ""))
