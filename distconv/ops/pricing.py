"""What pricing a plan reports: the collectives of each layer with the bytes every rank
receives (exactly what the communicators count), priced on a machine, and the per-rank block
sizes the reports are made of. Shared by the op handlers and :func:`distconv.explain`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

from distconv import machines
from distconv.parallel.placement import Layout, Placement, paper_grid
from distconv.perfmodel import Machine as FlatMachine

__all__ = ["CommStep", "LayerReport", "Machine", "block_index", "largest_block", "pair",
           "segment_rank"]

#: A flat :class:`distconv.perfmodel.Machine` or a hierarchical :class:`distconv.machines.Machine`.
Machine = Union[FlatMachine, machines.Machine]
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

    def seconds(self, machine: Machine) -> float:
        """Predicted seconds on the slowest rank: a flat machine prices ``alpha`` per message
        step and ``beta`` per byte; a hierarchical one prices on the level the ranks span."""
        nbytes = max(self.bytes.values())
        if not isinstance(machine, machines.Machine):
            steps = 2 * (self.peers - 1) if self.op == "allreduce" else max(self.peers - 1, 1)
            return steps * machine.alpha + nbytes * machine.beta
        dims = self.dims or tuple(d for d, _ in self.layout or ())
        if self.op in _COLLECTIVES:
            return machine.collective_time(self.op, self.peers, nbytes, layout=self.layout,
                                           dims=dims)
        group = (machines.group_of(self.layout, dims) if self.layout is not None
                 else list(range(self.peers)))
        return machine.link_time(group, nbytes, max(self.peers - 1, 1)) if nbytes else 0.0


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
    compute_seconds: float = 0.0
    note: str = ""

    def bytes(self, phase: str, rank: int) -> int:
        return sum(s.bytes[rank] for s in self.steps if s.phase == phase)



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
