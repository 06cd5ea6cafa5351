"""What pricing a plan reports, and the step it adds up to: the collectives of each layer with
the bytes every rank receives (exactly what the communicators count), priced on a machine; the
two-stream timeline of a training step; and the per-rank block sizes the reports are made of.
The op handlers fill the reports; :func:`distconv.explain` and the planner add them up."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from distconv.machines.base import group_of
from distconv.parallel.placement import Layout, Placement, paper_grid
from distconv.pricing.machine import AnyMachine, resolve_machine

__all__ = ["CommStep", "LayerReport", "Timeline", "block_index", "halo_hidden", "largest_block",
           "pair", "segment_rank", "timeline"]

_COLLECTIVES = ("allgather", "reduce_scatter", "allreduce", "alltoall")


@dataclass
class CommStep:
    """One collective of a layer: phase, description, op and the bytes each rank receives;
    ``layout`` and ``dims`` say which ranks it runs among (the segments over ``dims`` of the
    grid ``layout``; no dims: the whole grid; no layout: ``peers`` consecutive ranks)."""

    phase: str
    what: str
    op: str
    bytes: dict[int, int]  # rank -> bytes it receives (the evaluated ranks)
    peers: int = 1
    layout: Layout | None = None
    dims: tuple[str, ...] = ()
    #: a gradient allreduce that may start once the backward of this layer (by report name) is
    #: done: it overlaps the rest of backward (see :func:`timeline`); None: on the critical path
    after: str | None = None
    #: a conversion's segments (:func:`~distconv.pricing.segments.conversion_segments`): the
    #: groups of ranks that exchange data, each its own exchange, all at once; None: the
    #: ``layout``/``dims``/``peers`` rule above
    groups: tuple[tuple[int, ...], ...] | None = None

    def seconds(self, machine: AnyMachine) -> float:
        """Predicted seconds on the slowest rank, on the machine level the ranks span (a flat
        machine is priced as the one-level machine
        :func:`~distconv.pricing.machine.resolve_machine` makes of it, as everywhere)."""
        nbytes = max(self.bytes.values())
        machine = resolve_machine(machine, hierarchical=True)
        if self.groups:
            # each segment exchanges on its own: its size for the latency (a pairwise exchange,
            # one step per peer), the level it spans for the bandwidth; the slowest segment,
            # with the most bytes any rank receives
            return max(machine.link_time(g, nbytes, len(g) - 1)
                       for g in self.groups) if nbytes else 0.0
        dims = self.dims or tuple(d for d, _ in self.layout or ())
        if self.op in _COLLECTIVES:
            return machine.collective_time(self.op, self.peers, nbytes, layout=self.layout,
                                           dims=dims)
        group = (group_of(self.layout, dims) if self.layout is not None
                 else list(range(self.peers)))
        return machine.link_time(group, nbytes, max(self.peers - 1, 1)) if nbytes else 0.0


    def segment(self, machine: AnyMachine | None = None) -> str:
        """The ranks a conversion runs among, e.g. ``"4 ranks, one node"`` (the largest segment
        and, with a hierarchical machine, the level it spans); ``""`` for other steps."""
        if self.groups is None:
            return ""
        from distconv.pricing.segments import describe_segment

        if machine is not None:
            machine = resolve_machine(machine, hierarchical=True)
        return describe_segment(self.groups, machine)


@dataclass
class LayerReport:
    name: str
    kind: str
    grid: str
    algorithm: str
    dists: dict[str, str]
    steps: list[CommStep] = field(default_factory=list)
    param_elements: int = 0
    activation_elements: int = 0
    forward_seconds: float = 0.0   # local compute, slowest rank
    backward_seconds: float = 0.0
    note: str = ""
    #: activation checkpointing: the segment the layer is recomputed with in backward (its
    #: activations are held only then), or None
    segment: int | None = None
    #: seconds per phase that a pipelined layer's collectives hide behind its compute
    #: (:func:`distconv.pricing.cost.conv_cost` with ``pipeline``); negative: pipelining costs more
    overlap: dict[str, float] = field(default_factory=dict)

    @property
    def compute_seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds

    def bytes(self, phase: str, rank: int) -> int:
        return sum(s.bytes[rank] for s in self.steps if s.phase == phase)


@dataclass(frozen=True)
class Timeline:
    """One training step priced on a machine (seconds, slowest rank)."""

    forward: float   # forward compute and collectives
    backward: float  # backward compute and the collectives on its critical path
    gradients: float  # the gradient allreduces, all together
    step: float      # forward + backward, plus whatever of the gradient allreduces backward
    #                  does not hide

    @property
    def exposed(self) -> float:
        """Seconds of gradient allreduce that the backward pass does not hide."""
        return self.step - self.forward - self.backward


def timeline(layers: Sequence[LayerReport], machine: AnyMachine,
             cache: dict[int, tuple[Any, ...]] | None = None) -> Timeline:
    """The step of ``layers`` (in forward order) on ``machine``: the forward, then the backward in
    reverse order on a compute stream; each gradient allreduce (a step with ``after``) goes on a
    communication stream once the backward of its layer is done and the previous allreduce has
    finished, as the gradient buckets run, and takes the share ``1 - comm_overlap`` of its time
    from the compute stream too (the processor moves what the network does not). Every other
    collective is on the critical path.

    ``cache``: each layer's collective seconds by the report's identity, for a caller that prices
    many plans made of the same reports on one machine and never changes a report's steps (the
    planner); the report is kept beside its seconds, so an identity is never reused while it is
    remembered."""
    machine = resolve_machine(machine, hierarchical=True)  # once, not per step
    busy = 1.0 - machine.comm_overlap

    def seconds(lay: LayerReport, phase: str) -> float:
        return sum(s.seconds(machine) for s in lay.steps if s.phase == phase and s.after is None)

    def collectives(lay: LayerReport) -> tuple[Any, ...]:
        """(the report, its forward and backward collectives' seconds on the critical path, its
        gradient allreduces as (after, seconds))"""
        got = None if cache is None else cache.get(id(lay))
        if got is None or got[0] is not lay:
            got = (lay, seconds(lay, "forward"), seconds(lay, "backward"),
                   tuple((s.after, s.seconds(machine)) for s in lay.steps if s.after is not None))
            if cache is not None:
                cache[id(lay)] = got
        return got

    own = [collectives(lay) for lay in layers]
    forward = sum(lay.forward_seconds + fwd - lay.overlap.get("forward", 0.0)
                  for lay, fwd, _, _ in own)
    compute = comm = forward
    gradients = 0.0
    names = {lay.name for lay in layers}
    waiting: dict[str | None, list[float]] = {}
    for _, _, _, afters in own:
        for after, t in afters:
            waiting.setdefault(after if after in names else None, []).append(t)
    for lay, _, bwd, _ in reversed(own):
        compute += lay.backward_seconds + bwd - lay.overlap.get("backward", 0.0)
        for t in waiting.pop(lay.name, ()):
            comm = max(comm, compute) + t
            compute += busy * t
            gradients += t
    for t in waiting.pop(None, ()):  # no layer named: after the whole backward
        comm = max(comm, compute) + t
        compute += busy * t
        gradients += t
    return Timeline(forward, compute - forward, gradients, max(compute, comm))


def largest_block(p: Placement, shape: Sequence[int]) -> int:
    """Elements of the largest local block: balanced blocks put the larger parts first, so rank
    0 (coordinate 0 on every grid dim) holds it."""
    return math.prod(p.dist.local_shape(tuple(shape), paper_grid(p.layout, 0)))


def segment_rank(layout: Layout, dims: Sequence[str], coords: dict[str, int]) -> int:
    r = 0
    for name, e in layout:
        if name in dims:
            r = r * e + coords.get(name, 0)
    return r


def block_index(dims: Sequence[str], ext: dict[str, int], coords: dict[str, int]) -> int:
    """Linear index of the nested block over ``dims`` (major first)."""
    i = 0
    for d in dims:
        i = i * ext[d] + coords.get(d, 0)
    return i


def pair(v: Any) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def halo_hidden(steps: Mapping[str, float], share: float,
                machine: Any = None) -> dict[str, float]:
    """The seconds an overlapped layer hides (:func:`distconv.nn.halo_conv.halo_conv`): its
    halo exchange runs beside the ``share`` of its local convolution on interior rows, its halo
    accumulate beside that share of the local backward, so each hides the smaller of the two,
    times the ``machine``'s ``comm_overlap`` (1 without one).
    ``steps``: :func:`distconv.pricing.cost.conv_cost`'s seconds per step."""
    def part(prefix: str) -> float:
        return sum(v for k, v in steps.items() if k.startswith(prefix))

    o = getattr(machine, "comm_overlap", 1.0)
    return {"forward": o * min(part("halo exchange"), share * part("local conv forward")),
            "backward": o * min(part("halo accumulate"), share * part("local conv backward"))}
