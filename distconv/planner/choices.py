"""The planner's choices for one convolution (grid layout and algorithm), the candidates a layer
can run, and one layer's price under a choice by its op handler."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from distconv.comm.base import allreduce_bytes
from distconv.conv_geometry import HaloPlan
from distconv.distribution import Dist
from distconv.machines import resolve_machine
from distconv.machines.base import Machine
from distconv.nn.conv import conv_dists
from distconv.nn.conv_nd import conv_nd_dists, spatial_roles
from distconv.ops.conv import moves_data
from distconv.ops.conv_nd import layer_report, refusal
from distconv.pricing.timeline import LayerReport, largest_block
from distconv.parallel.placement import Placement, conversion_bytes, evaluated_ranks
from distconv.parallel.steps import LayerSpec, Step
from distconv.pricing.problem import ConvProblem


ACT = ("N", "C", "H", "W")
ALGORITHMS = ("sample", "spatial", "stationary-x", "stationary-y", "stationary-w")


# ============================================================================ the network
@dataclass(frozen=True)
class ConvNode:
    """One convolution: its qualified name, the global shape of its output and, for a Conv2d,
    its global problem (the §4 model's). A ``Conv1d``, ``Conv3d`` or transposed convolution has
    no 2-D problem: ``module`` (its hyperparameters, on the meta device) and ``input_shape``
    state it, and its op handler prices it (:func:`distconv.ops.conv_nd.layer_report`)."""

    name: str
    problem: ConvProblem | None
    out_shape: tuple[int, ...]
    module: Any = field(default=None, compare=False, repr=False)
    input_shape: tuple[int, ...] = ()

    @property
    def in_shape(self) -> tuple[int, ...]:
        if self.problem is None:
            return self.input_shape
        pb = self.problem
        return (pb.batch, pb.in_channels, pb.height, pb.width)

    @property
    def spatial(self) -> int:
        """Its spatial dims (2 for a Conv2d)."""
        return len(self.in_shape) - 2

    @property
    def transposed(self) -> bool:
        return bool(getattr(self.module, "transposed", False))



def _problem(conv: torch.nn.Conv2d, shape: Sequence[int]) -> ConvProblem:
    return ConvProblem(int(shape[0]), conv.in_channels, conv.out_channels, int(shape[2]),
                       int(shape[3]), tuple(conv.kernel_size), tuple(conv.stride),
                       conv.padding if isinstance(conv.padding, str) else tuple(conv.padding),
                       tuple(conv.dilation), conv.groups, conv.bias is not None,
                       conv.padding_mode)


# ============================================================================ choices
@dataclass(frozen=True)
class Choice:
    """A grid layout (row-major, model-parallel dims last) and an algorithm for one layer."""

    grid: tuple[tuple[str, int], ...]
    algorithm: str
    groups_aligned: bool = False  # a grouped conv whose channel blocks hold whole groups
    pipeline: int = 1  # chunks of samples its collectives are pipelined over (1: not)
    spatial: int = 2  # the layer's spatial dims (3: a volume's D, H, W)
    transposed: bool = False  # a transposed convolution (its weight's C and F entries swap)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"Choice: algorithm must be one of {ALGORITHMS}, got "
                             f"{self.algorithm!r}")

    @property
    def size(self) -> int:
        return math.prod(e for _, e in self.grid)

    @property
    def extents(self) -> dict[str, int]:
        return dict(self.grid)

    @property
    def conv_algorithm(self) -> str:
        """The DistConv2d algorithm that runs it (sample and spatial are stationary-x on C=1)."""
        return "stationary-x" if self.algorithm in ("sample", "spatial") else self.algorithm

    @property
    def nd(self) -> bool:
        """Whether a ``Conv1d``, ``Conv3d`` or transposed convolution takes it (not a Conv2d)."""
        return self.spatial != 2 or self.transposed

    def dists(self) -> dict[str, Dist]:
        """The layer's distributions (``input``, ``work``, ``partial``, ``output``, ``weight``,
        ``bias``) by the rule its handler places it with (:func:`~distconv.nn.conv.conv_dists`,
        :func:`~distconv.nn.conv_nd.conv_nd_dists`)."""
        if not self.nd:
            roles = {"N": "N", "C": "C", "F": "F", "H": "H", "W": "W"}
            return conv_dists(self.conv_algorithm, roles, self.groups_aligned)
        roles = {"N": "N", "C": "C", "F": "F", **{r: r for r in spatial_roles(self.spatial)}}
        return conv_nd_dists(self.conv_algorithm, roles, self.spatial, self.transposed,
                             self.groups_aligned)

    def _dists(self) -> dict[str, Dist]:
        """x's and y's distributions, canonical on this grid (extent-1 dims dropped)."""
        dists = self.dists()
        return {k: Placement(self.grid, dists[k]).dist for k in ("input", "output")}

    @property
    def input_dist(self) -> Dist:
        """x's distribution, as :class:`~distconv.nn.DistConv2d` states it (extent-1 dims dropped)."""
        return self._dists()["input"]

    @property
    def output_dist(self) -> Dist:
        return self._dists()["output"]

    def config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"grid": dict(self.grid), "algorithm": self.algorithm}
        if self.pipeline > 1:
            out["pipeline"] = self.pipeline
        return out

    @property
    def communicates(self) -> bool:
        """Whether it runs a collective of its own that pipelining can overlap."""
        return not self.nd and moves_data(self.grid, self.dists())

    def __str__(self) -> str:
        grid = "×".join(f"{n}{e}" for n, e in self.grid)
        tail = f" pipeline {self.pipeline}" if self.pipeline > 1 else ""
        return f"{self.algorithm} {grid}{tail}"


@dataclass(frozen=True)
class Value:
    """Where an activation that no convolution produced lives (a concatenation's output, the
    model's input): a placement with the names of a :class:`Choice`'s."""

    grid: tuple[tuple[str, int], ...]
    output_dist: Dist

    @property
    def input_dist(self) -> Dist:
        return self.output_dist


def grid_algorithm(grid: Sequence[tuple[str, int]]) -> str:
    """The algorithm a layer entry's ``auto`` runs on the grid it names: ``stationary-w`` where
    it splits C and F, ``stationary-x`` C alone, ``stationary-y`` F alone, ``spatial`` a spatial
    dim and ``sample`` N alone."""
    live = {d for d, e in grid if e > 1 and d != "N"}
    return ("stationary-w" if {"C", "F"} <= live else "stationary-x" if "C" in live
            else "stationary-y" if "F" in live else "spatial" if live else "sample")


def sample_choice(world_size: int) -> Choice:
    return Choice((("N", world_size),), "sample")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(problem: ConvProblem, world_size: int, *, max_model: int = 16,
               max_sample: int | None = None,
               algorithms: Sequence[str] = ALGORITHMS) -> list[Choice]:
    """Every choice for one layer: the model-parallel extents multiply to a divisor ``m`` of the
    world size with ``m <= max_model``, N takes the rest (at most the batch and ``max_sample``),
    and no dim is split into more blocks than it has items."""
    pb, out = problem, []
    for m in _divisors(world_size):
        n = world_size // m
        if m > max_model or n > min(pb.batch, max_sample or pb.batch):
            continue
        N = (("N", n),) if n > 1 or m == 1 else ()
        if m == 1:
            if "sample" in algorithms:
                out.append(Choice((("N", n),), "sample"))
            continue
        for a in _divisors(m):
            b = m // a
            options = {
                "spatial": [(("H", m),)] * (a == 1) + [(("H", a), ("W", b))] * (1 < a < m),
                "stationary-x": [(("C", m),)] * (a == 1),
                "stationary-y": [(("F", m),)] * (a == 1),
                "stationary-w": [(("C", a), ("F", b))] * (1 < a < m),
            }
            for alg, grids in options.items():
                if alg not in algorithms:
                    continue
                for g in grids:
                    ch = _valid(pb, Choice(N + g, alg))
                    if ch is not None:
                        out.append(ch)
    return out


def layer_candidates(conv: ConvNode, world_size: int, *, max_model: int = 16,
                     max_sample: int | None = None,
                     algorithms: Sequence[str] = ALGORITHMS) -> list[Choice]:
    """Every choice for the convolution ``conv``: :func:`candidates` of a Conv2d's problem; for
    a ``Conv1d``, ``Conv3d`` or transposed convolution the same extents (model-parallel ranks
    ``m`` dividing the world size, at most ``max_model``; N the rest) over

    * ``sample``: ``{N: P}``;  ``spatial``: ``{N, ...}`` and ``m`` split over the layer's
      spatial dims (``D``, ``H``, ``W`` of a volume, ``W`` of a signal) every way;
    * ``stationary-x``: ``{N, C}``;  ``stationary-y``: ``{N, F}``;  ``stationary-w``:
      ``{N, C, F}``,

    each kept where the layer can run it (:func:`distconv.ops.conv_nd.refusal`: blocks of whole
    groups, every rank an input and an output row on each split dim)."""
    if conv.module is None:
        return candidates(conv.problem, world_size, max_model=max_model, max_sample=max_sample,
                          algorithms=algorithms)
    module, shape = conv.module, conv.in_shape
    rows = spatial_roles(conv.spatial)
    out = []
    for m in _divisors(world_size):
        n = world_size // m
        if m > max_model or n > min(shape[0], max_sample or shape[0]):
            continue
        N = (("N", n),) if n > 1 else ()
        grids: list[tuple[str, tuple[tuple[str, int], ...]]] = []
        if m == 1:
            grids.append(("sample", (("N", n),)))
        else:
            grids += [("spatial", N + g) for g in _splits(m, rows)]
            grids += [("stationary-x", N + (("C", m),)), ("stationary-y", N + (("F", m),))]
            grids += [("stationary-w", N + (("C", a), ("F", m // a)))
                      for a in _divisors(m) if 1 < a < m]
        for alg, grid in grids:
            if alg in algorithms and refusal(module, grid, alg, shape) is None:
                ext = dict(grid)
                aligned = module.groups > 1 and ext.get("C", 1) * ext.get("F", 1) > 1
                out.append(Choice(grid, alg, groups_aligned=aligned, spatial=conv.spatial,
                                  transposed=conv.transposed))
    return out


def data_grids(first: Choice, world_size: int) -> list[tuple[tuple[str, int], ...]]:
    """The data grids (a config's ``data``: where the model's input and output samples live,
    ``x[o_N,*,...]``) of a plan whose first convolution takes ``first``: the sample grid
    ``{N: P}``, and where ``first`` is spatial its own grid -- the batch read whole onto the
    spatial ranks of its N row, as ``docs/volumes.md`` reads volumes, so that layer takes its
    block by a local slice. No other: the price does not charge for reading the input onto
    more ranks, and any other layer on a data grid that replicates the input (a
    channel/filter-parallel one, or a later one) would get its blocks free of the conversion
    it pays from the sample grid."""
    out = [(("N", world_size),)]
    if first.algorithm == "spatial":
        out.append(first.grid)
    return list(dict.fromkeys(out))


def _splits(m: int, rows: Sequence[str]) -> list[tuple[tuple[str, int], ...]]:
    """Every way to split ``m`` ranks over some of ``rows`` (in their order), each by more than
    1."""
    if m == 1:
        return [()]
    out = []
    for i, row in enumerate(rows):
        for a in _divisors(m)[1:]:
            out += [((row, a),) + rest for rest in _splits(m // a, rows[i + 1:])]
    return out


def _valid(pb: ConvProblem, ch: Choice) -> Choice | None:
    """``ch`` where the layer can run it (as ``DistConv2d`` and ``explain`` decide: every rank
    at least one input and one output row of each split spatial dim, a padding mode that can be
    split, whole channel blocks), else None."""
    e = ch.extents
    c, f = e.get("C", 1), e.get("F", 1)
    if c * f > min(pb.in_channels, pb.out_channels):
        return None
    for row, dim in zip(("H", "W"), pb.dims()):
        if e.get(row, 1) > 1:
            try:
                HaloPlan(dim, e[row], pb.padding_mode).check(row)
            except ValueError:
                return None
    if pb.groups > 1 and c * f > 1:
        if pb.groups % (c * f):
            return None
        return Choice(ch.grid, ch.algorithm, groups_aligned=True)
    return ch


# ============================================================================ one layer's price
def transition_bytes(src: Choice | Value, dst: Choice, shape: Sequence[int], rank: int, *,
                     itemsize: int = 4) -> int:
    """Bytes rank ``rank`` receives moving an activation of global ``shape`` from ``src``'s output
    distribution to ``dst``'s input distribution: the one byte count of conversions
    (:func:`~distconv.parallel.placement.conversion_bytes`, what the executor counts)."""
    return conversion_bytes(Placement(src.grid, src.output_dist),
                            Placement(dst.grid, dst.input_dist), tuple(int(s) for s in shape),
                            itemsize, rank)


@dataclass(frozen=True)
class LayerCost:
    """Seconds of one layer under one choice (slowest rank), from its op handler's report, and
    its bytes of memory per rank."""

    forward: float
    backward: float   # on the critical path: local backward and activation collectives
    allreduce: float  # its gradient's allreduce, alone (explain fuses them into buckets)
    memory: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.allreduce


def _conv_step(conv: ConvNode, choice: Choice) -> Step:
    """The step ``parallelize`` places ``conv`` with under ``choice`` (its input arriving in
    the choice's input distribution)."""
    spec = LayerSpec("conv", conv.name, choice.grid, choice.conv_algorithm,
                     tuple((d, d) for d in "NCFHW"), pipeline=choice.pipeline)
    dists = choice.dists()
    return Step(None, "conv", Placement(choice.grid, dists["output"]),  # type: ignore[arg-type]
                {}, spec)


def _conv_report(conv: ConvNode, choice: Choice, machine: Any, itemsize: int) -> LayerReport:
    """A convolution's report by its op handler, as ``explain`` prices it on its slowest rank."""
    ranks = evaluated_ranks([choice.grid], choice.size, every=False)
    if conv.module is not None:
        return layer_report(conv.module, choice.grid, choice.algorithm, conv.in_shape,
                            conv.out_shape, ranks=ranks, itemsize=itemsize, machine=machine)
    from distconv.ops.conv import ConvHandler
    from distconv.ops.base import PriceContext

    module = torch.nn.Conv2d(conv.problem.in_channels, conv.problem.out_channels,
                             conv.problem.kernel_size, conv.problem.stride,
                             conv.problem.padding, conv.problem.dilation, conv.problem.groups,
                             conv.problem.bias, conv.problem.padding_mode, device="meta")
    report = LayerReport(conv.name, "conv", "-", choice.algorithm, {})
    report.activation_elements = largest_block(Placement(choice.grid, choice.output_dist),
                                               conv.out_shape)
    ConvHandler().price(report, _conv_step(conv, choice), module,
                        PriceContext(conv.in_shape, itemsize, ranks, True, machine,
                                     conv.out_shape))
    return report


def _allreduce(params: Sequence[tuple[int, tuple[str, ...]]], grid: Any, machine: Any,
               itemsize: int) -> float:
    """Seconds of each parameter's gradient allreduce alone (elements per rank, the grid dims it
    is summed over), on ``machine``: the ring of the §4 model."""
    total = 0.0
    for n, dims in params:
        peers = math.prod(dict(grid)[d] for d in dims)
        if peers > 1 and n:
            total += machine.collective_time("allreduce", peers,
                                             allreduce_bytes(n, 0, peers, itemsize),
                                             layout=grid, dims=dims)
    return total


def layer_cost(conv: ConvNode, choice: Choice, machine: Any, *, itemsize: int = 4,
               optimizer_slots: int = 1, activation_factor: int = 3) -> LayerCost:
    """The layer's price by its op handler (its report's forward and backward seconds on the
    critical path), its gradient allreduce alone, and its memory per rank: the weight shard
    times (parameter + gradient + ``optimizer_slots``), the blocks its report keeps for backward
    and ``activation_factor - 1`` more output blocks (BN, ReLU). ``machine``: any form of
    :func:`~distconv.machines.resolve_machine`."""
    machine = resolve_machine(machine, hierarchical=True)
    report = _conv_report(conv, choice, machine, itemsize)
    fwd, bwd = _phases(report, machine)
    weight = Placement(choice.grid, choice.dists()["weight"])
    redundant = tuple(d for d, e in choice.grid if e > 1 and d not in weight.dist.used())
    out = largest_block(Placement(choice.grid, choice.output_dist), conv.out_shape)
    memory = itemsize * (report.param_elements * (2 + optimizer_slots)
                         + report.activation_elements + (activation_factor - 1) * out)
    return LayerCost(fwd, bwd, _allreduce([(report.param_elements, redundant)], choice.grid,
                                          machine, itemsize), float(memory))


def _phases(report: LayerReport, machine: Any) -> tuple[float, float]:
    """A report's forward and backward seconds on the critical path (:func:`timeline`'s terms
    for one layer)."""
    def part(phase: str) -> float:
        return (getattr(report, f"{phase}_seconds") - report.overlap.get(phase, 0.0)
                + sum(s.seconds(machine) for s in report.steps
                      if s.phase == phase and s.after is None))

    return part("forward"), part("backward")


def _memory(conv: ConvNode, ch: Choice, itemsize: int, slots: int, factor: int) -> float:
    """Bytes per rank of :func:`layer_cost` (its op handler's blocks), without pricing time."""
    report = _conv_report(conv, ch, None, itemsize)
    out = largest_block(Placement(ch.grid, ch.output_dist), conv.out_shape)
    return float(itemsize * (report.param_elements * (2 + slots) + report.activation_elements
                             + (factor - 1) * out))


def nd_layer_cost(conv: ConvNode, ch: Choice, machine: Machine, itemsize: int, slots: int,
             factor: int) -> LayerCost:
    """A ``Conv1d``, ``Conv3d`` or transposed convolution priced by its op handler, as
    ``explain`` prices it (:func:`~distconv.ops.conv_nd.layer_report`: compute from its FLOPs,
    the allgather of x over F, halo exchanges, the reduce-scatter of y over C and their
    adjoints, on the slowest rank), its gradient allreduced over the ranks that replicate the
    weight (the §4 model's ring), and its memory as :func:`_memory` counts it."""
    ranks = evaluated_ranks([ch.grid], ch.size, every=False)
    rep = layer_report(conv.module, ch.grid, ch.algorithm, conv.in_shape, conv.out_shape,
                       ranks=ranks, itemsize=itemsize, machine=machine)

    def phase(name: str) -> float:
        return sum(s.seconds(machine) for s in rep.steps if s.phase == name)

    weight = Placement(ch.grid, ch.dists()["weight"])
    redundant = [d for d, e in ch.grid if e > 1 and d not in weight.dist.used()]
    peers = math.prod(dict(ch.grid)[d] for d in redundant)
    params = rep.param_elements
    allreduce = machine.collective_time(
        "allreduce", peers, allreduce_bytes(params, 0, peers, itemsize), layout=ch.grid,
        dims=redundant) if peers > 1 else 0.0
    out = largest_block(Placement(ch.grid, ch.dists()["output"]), conv.out_shape)
    memory = itemsize * (params * (2 + slots) + rep.activation_elements + factor * out)
    return LayerCost(rep.forward_seconds + phase("forward"),
                     rep.backward_seconds + phase("backward"), allreduce, float(memory))

