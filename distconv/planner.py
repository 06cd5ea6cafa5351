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

The price of a plan is :mod:`distconv.parallel.cost`'s: every node's report by its op handler,
the conversions between placements, the running statistics and the gradient buckets, on the
two-stream timeline of :func:`distconv.ops.pricing.timeline`. The search prices it
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
   beam's plans and the uniform plans (one grid and algorithm for every convolution), each
   stage (a top-level module's layers) given one grid and algorithm at once, then each layer's
   alternatives (what the priced plans near the best give it, pipelined or not) with the rest
   kept, until no change lowers the price.

So the plan returned is the least-priced plan the search visits, by the very price ``explain``
gives its config on the same machine (``Plan.step_time`` is that price).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import TensorMetadata

from distconv.comm.base import allreduce_bytes
from distconv.conv_geometry import HaloPlan
from distconv.distribution import Dist
from distconv.machines import resolve_machine
from distconv.machines.base import Machine
from distconv.nn.conv import conv_dists
from distconv.nn.conv_nd import conv_nd_dists, spatial_roles
from distconv.ops import Unsupported
from distconv.ops.conv import moves_data
from distconv.ops.conv_nd import layer_report, refusal
from distconv.ops.pricing import LayerReport, largest_block, timeline
from distconv.parallel import cost
from distconv.parallel.config import LayerChoice, ParallelConfig
from distconv.parallel.graph import _Analyser, analyse, trace
from distconv.parallel.placement import (
    ALL_RANKS, Placement, conversion_bytes, evaluated_ranks)
from distconv.parallel.shapes import check_input_shape, propagate_shapes
from distconv.parallel.steps import LayerSpec, Step
from distconv.perfmodel import ConvProblem

__all__ = ["Choice", "ConvNode", "LayerCost", "LayerPlan", "Network", "Plan", "candidates",
           "explain", "layer_candidates", "layer_cost", "nd_layer_cost", "plan_network",
           "predict", "trace_network", "transition_bytes"]

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


@dataclass(frozen=True, eq=False)
class Network:
    """The planner's view of a model on one global input shape: the traced graph (on the meta
    device), every node's global shape, and the convolutions it chooses for, in graph order."""

    input_shape: tuple[int, ...]
    convs: tuple[ConvNode, ...]
    gm: fx.GraphModule = field(repr=False)
    shapes: Mapping[str, tuple[int, ...]] = field(repr=False)
    #: the traced model (on the meta device), as explain traces it
    model: torch.nn.Module = field(repr=False)

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The global shape of the value the last convolution gives."""
        return self.convs[-1].out_shape if self.convs else self.input_shape


def trace_network(model: torch.nn.Module, input_shape: Sequence[int]) -> Network:
    """Trace ``model`` with ``torch.fx``, propagate global shapes on the meta device and check
    that ``parallelize`` runs every node (the one analysis of the graph).

    Raises:
        distconv.ops.Unsupported: a node no op handler runs (the refusal ``parallelize`` and
            ``explain`` give).
        ValueError: an ``input_shape`` the model cannot take (naming it and what the first
            layer expects).
    """
    if any(p.device.type != "meta" for p in model.parameters()):
        model = copy.deepcopy(model).to("meta")
    input_shape = tuple(int(s) for s in input_shape)
    gm = trace(model)
    check_input_shape(gm, input_shape)
    analyse(gm, ParallelConfig({"default": {"grid": {"N": 1}, "algorithm": "sample"}},
                               world_size=1), input_ndim=len(input_shape))
    dtype = next((p.dtype for p in gm.parameters() if p.is_floating_point()), None)
    propagate_shapes(gm, input_shape, dtype=dtype)  # in the model's own dtype
    shapes = {n.name: tuple(n.meta["tensor_meta"].shape) for n in gm.graph.nodes
              if isinstance(n.meta.get("tensor_meta"), TensorMetadata)}
    modules = dict(gm.named_modules())
    convs: dict[str, ConvNode] = {}
    for node in gm.graph.nodes:
        module = modules.get(node.target) if node.op == "call_module" else None
        if not isinstance(module, _CONVS) or str(node.target) in convs:
            continue
        x = shapes[node.args[0].name]
        y = shapes[node.name]
        name = str(node.target)
        convs[name] = (ConvNode(name, _problem(module, x), y)
                       if isinstance(module, torch.nn.Conv2d) else ConvNode(name, None, y, module, x))
    return Network(input_shape, tuple(convs.values()), gm, shapes, model)


#: the convolutions the planner chooses for
_CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose1d,
          torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)


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


# ============================================================================ the search
class _View:
    """A config as the search sees it: the layers it has chosen for take their choice; the
    others their entry in the config planned from (a convolution still to be chosen, the first
    of its candidates). Everything else is the config's."""

    def __init__(self, base: ParallelConfig, entry: Any, first: Mapping[str, Choice]) -> None:
        self.base, self.entry, self.first = base, entry, first
        self.chosen: Mapping[str, Choice] = {}

    def choice(self, name: str) -> LayerChoice:
        ch = self.chosen.get(name) or self.first.get(name)
        return self.base.choice(name) if ch is None else self.entry(name, ch)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.base, attr)


@dataclass(frozen=True)
class _Priced:
    """One plan priced: its step (the timeline's), forward, memory per rank and the reports."""

    step: float
    forward: float
    memory: float
    layers: list[LayerReport]
    analysis: Any


class _Search:
    """The price of plans on one network, world size and machine, cached per node and placement:
    a beam over the topological order and the exact price of a whole plan."""

    def __init__(self, net: Network, P: int, machine: Machine, options: Mapping[str, list[Choice]],
                 base: Mapping[str, Any], itemsize: int, optimizer_states: int) -> None:
        self.net, self.P, self.machine, self.options = net, P, machine, options
        self.itemsize, self.optimizer_states = itemsize, optimizer_states
        self.raw = dict(base)
        self.base = ParallelConfig(self.raw, world_size=P)

        self._layers = list(self.raw.get("layers", []))
        self._entries: dict[tuple[str, Choice], LayerChoice] = {}
        self.view = _View(self.base, self.entry, {n: opts[0] for n, opts in options.items()})
        self.gm, self.shapes = net.gm, dict(net.shapes)
        self.modules = dict(self.gm.named_modules())
        self.order = list(self.gm.graph.nodes)
        index = {n: i for i, n in enumerate(self.order)}
        self.last = {n: max((index[u] for u in n.users), default=-1) for n in self.order}
        self.decides = {n: str(n.target) for n in self.order
                        if n.op == "call_module" and str(n.target) in options}
        # where a gradient flows (as explain finds it: into a value made of one that owns
        # parameters), and each value's number of dims: the same in every plan
        reference = analyse(self.gm, self.view, input_ndim=len(net.input_shape))  # type: ignore[arg-type]
        self.grad: dict[str, bool] = {}
        self.ndim: dict[Any, int | None] = {}
        for st in reference.steps:
            n = st.node
            owns = n.op == "call_module" and any(True for _ in self.modules[n.target].parameters())
            self.grad[n.name] = owns or any(self.grad.get(a.name, False) for a in st.needs)
            self.ndim[n] = st.out.ndim if st.out is not None else None
        self._reports: dict[tuple, LayerReport] = {}
        self._moves: dict[tuple, LayerReport] = {}
        self._steps: dict[tuple, Step | None] = {}
        self._buckets: dict[tuple, LayerReport | None] = {}
        self._seconds: dict[int, tuple[LayerReport, float, float, float]] = {}
        self._grads: dict[tuple, float] = {}
        self.visited = 0  # plans priced exactly
        self.binding = False  # whether a cheaper plan did not fit the memory limit
        self.seeds: list[dict[str, Choice]] = []  # the plans the descent starts among

    def entry(self, name: str, ch: Choice) -> LayerChoice:
        """The config entry ``ch`` makes for the layer ``name``, as ``parallelize`` reads it."""
        key = (name, ch)
        if key not in self._entries:
            raw = {**self.raw, "layers": [{"match": _literal(name), **ch.config()}]
                   + self._layers}
            self._entries[key] = ParallelConfig(raw, world_size=self.P).choice(name)
        return self._entries[key]

    # ---------------------------------------------------------------- one node
    def ranks(self, layouts: Sequence[Any]) -> list[int]:
        """The ranks a report is evaluated on: the corners of the grids it touches, whose maxima
        are the whole world's (:func:`~distconv.parallel.placement.evaluated_ranks`), found once
        per set of grids."""
        return evaluated_ranks(sorted(set(layouts)), self.P, every=False)

    def parts(self, step: Step, moves: list[cost.Move], grad_in: bool) -> list[LayerReport]:
        """The reports that make ``step``'s (:func:`~distconv.parallel.cost.price_step`): its
        handler's, cached per node, placements and layer, and one per conversion of an operand,
        cached per shape and placements (shared by every node that converts alike)."""
        if step.segment is not None:  # recomputed in backward: priced whole
            return [self._whole(step, moves, grad_in)]
        key = (step.node, step.out, step.layer, tuple(step.needs.items()), grad_in)
        base = self._reports.get(key)
        if base is None:
            layouts = [p.layout for p in (step.out, *step.needs.values()) if p is not None]
            if step.layer is not None:
                layouts.append(step.layer.layout)
            base = cost.price_step(step, [], self.modules, self.shapes, self.itemsize, self.P,
                                   self.ranks(layouts), grad_in, self.grad, self.machine)
            self._reports[key] = base
        out = [base]
        for a, src, need, _ in moves:
            back = self.grad.get(a.name, False)
            mkey = (self.shapes[a.name], src, need, back)
            rep = self._moves.get(mkey)
            if rep is None:
                rep = LayerReport("(conversion)", "redistribute", "-", "-", {})
                cost.conversion(rep, "a value", src, need, self.shapes[a.name], self.itemsize,
                                self.P, self.ranks([src.layout, need.layout]), back)
                self._moves[mkey] = rep
            out.append(rep)
        return out

    def _whole(self, step: Step, moves: list[cost.Move], grad_in: bool) -> LayerReport:
        key = (step.node, step.out, step.layer, tuple(step.needs.items()), tuple(moves), grad_in,
               step.segment)
        if key not in self._reports:
            layouts = [p.layout for p in (step.out, *step.needs.values()) if p is not None]
            layouts += [m[1].layout for m in moves] + [m[2].layout for m in moves]
            if step.layer is not None:
                layouts.append(step.layer.layout)
            self._reports[key] = cost.price_step(
                step, moves, self.modules, self.shapes, self.itemsize, self.P,
                self.ranks(layouts), grad_in, self.grad, self.machine)
        return self._reports[key]

    def report(self, step: Step, moves: list[cost.Move], grad_in: bool) -> LayerReport:
        """``step``'s report from its :meth:`parts`: the conversions' forward steps first and
        their adjoints last, as :func:`~distconv.parallel.cost.price_step` orders them."""
        parts = self.parts(step, moves, grad_in)
        if len(parts) == 1:
            return parts[0]
        steps = list(parts[0].steps)
        for conv in parts[1:]:
            steps.insert(0, conv.steps[0])
            steps += conv.steps[1:]
        return replace(parts[0], steps=steps)

    def seconds(self, rep: LayerReport) -> tuple[float, float, float]:
        """A report's forward and backward seconds on the critical path, and its memory."""
        got = self._seconds.get(id(rep))
        if got is None or got[0] is not rep:
            fwd, bwd = _phases(rep, self.machine)
            mem = self.itemsize * (rep.param_elements * (2 + self.optimizer_states)
                                   + rep.activation_elements)
            got = (rep, fwd, bwd, float(mem))
            self._seconds[id(rep)] = got
        return got[1], got[2], got[3]

    def allreduce(self, step: Step) -> float:
        """The step's parameters' gradient allreduces alone (the beam's share of the buckets)."""
        if step.layer is None or step.handler is None or step.node.op != "call_module":
            return 0.0
        key = (step.node.target, step.layer, step.out)
        if key not in self._grads:
            module = self.modules[step.node.target]
            dists = step.handler.param_dists(step, module)
            layout = step.layer.layout
            params = []
            for leaf, p in module.named_parameters(recurse=False):
                dist = None if dists is None else dists.get(leaf)
                if dist is None:  # replicated everywhere: summed over every rank
                    params.append((p.numel(), tuple(d for d, _ in self.base.data)))
                    continue
                placed = Placement(layout, dist)
                dims = tuple(d for d, e in layout if e > 1 and d not in placed.dist.used())
                params.append((largest_block(placed, tuple(p.shape)), dims))
            grid = layout if dists is not None else self.base.data
            self._grads[key] = _allreduce(params, grid, self.machine, self.itemsize)
        return self._grads[key]

    # ---------------------------------------------------------------- the beam
    def beam(self, lam: float, mu: float, width: int) -> list[dict[str, Choice]]:
        """The plans of the ``width`` cheapest frontiers after the last node, cheapest first."""
        walker = _Analyser(self.gm, self.view, len(self.net.input_shape))  # type: ignore[arg-type]
        walker.ndim = self.ndim
        # (score, frontier: value -> its step, chosen, conversions made)
        states: list[tuple[float, dict[Any, Step], dict[str, Choice], frozenset]] = [
            (0.0, {}, {}, frozenset())]
        for i, node in enumerate(self.order):
            name = self.decides.get(node)
            merged: dict[tuple, tuple[float, dict[Any, Step], dict[str, Choice], frozenset]] = {}
            for score, live, chosen, done in states:
                opts = ([chosen[name]] if name in chosen else self.options[name]) if name else [None]
                for ch in opts:
                    picked = chosen if ch is None or name in chosen else {**chosen, name: ch}
                    step = self._visit(walker, node, live, picked, ch)
                    if step is None:
                        continue  # a choice the layer cannot take where its input is
                    made = set(done)
                    moves = cost.conversions(step, live.__getitem__, self.shapes, made)
                    add = 0.0
                    if i:  # the input's own report is the same for every plan
                        grad_in = any(self.grad.get(a.name, False) for a in step.needs)
                        for rep in self.parts(step, moves, grad_in):
                            fwd, bwd, mem = self.seconds(rep)
                            add += fwd + bwd + mu * mem
                        add += lam * self.allreduce(step)
                    after = {n: s for n, s in live.items() if self.last[n] > i}
                    if self.last[node] > i and step.out is not None:
                        after[node] = step
                    names = {n.name for n in after}
                    kept = frozenset(k for k in made if k[0] in names)
                    key = (tuple((n, s.out) for n, s in after.items()), kept)
                    if key not in merged or score + add < merged[key][0]:
                        merged[key] = (score + add, after, picked, kept)
            if not merged:
                raise ValueError(f"plan_network: no candidate of {name!r} can take its input "
                                 "in any plan the search kept")
            states = sorted(merged.values(), key=lambda s: s[0])[:width]
        return [s[2] for s in states]

    def _visit(self, walker: Any, node: Any, live: Mapping[Any, Step],
               picked: Mapping[str, Choice], ch: Choice | None) -> Step | None:
        """The node's step by its handler where its inputs are (the one walk's), cached per
        node, input placements and choice; None where the handler refuses the choice there."""
        args = tuple((a, live[a].out) for a in node.all_input_nodes if a in live)
        key = (node, args, ch)
        if key not in self._steps:
            self.view.chosen = picked
            walker.out = {n: s.out for n, s in live.items()}
            try:
                self._steps[key] = walker.visit(node)
            except (Unsupported, ValueError):
                self._steps[key] = None
        return self._steps[key]

    # ---------------------------------------------------------------- the price
    def price(self, chosen: Mapping[str, Choice]) -> _Priced:
        """The plan's price: ``explain``'s layers of its config, priced incrementally."""
        self.visited += 1
        self.view.chosen = chosen
        analysis = analyse(self.gm, self.view, input_ndim=len(self.net.input_shape))  # type: ignore[arg-type]
        layers = [cost.entry_report(analysis, self.net.input_shape, self.P, [0])]
        done: set = set()
        for step in analysis.steps[1:]:
            moves = cost.conversions(step, analysis.step, self.shapes, done)
            grad_in = any(self.grad.get(a.name, False) for a in step.needs)
            rep = self.report(step, moves, grad_in)
            if cost.kept(rep):
                layers.append(replace(rep, steps=list(rep.steps)))  # coalescing edits steps
        running = cost.coalesced_running(layers)
        if running is not None:
            layers.append(running)
        placed = tuple((st.node, st.layer) for st in analysis.steps if st.layer is not None)
        if placed not in self._buckets:
            corners = self.ranks(sorted({lay for lay in _layouts_of(analysis)}))
            self._buckets[placed] = cost.gradient_buckets(self.gm, analysis, self.P, corners,
                                                          self.itemsize, 25 << 20)
        sync = self._buckets[placed]
        if sync is not None:
            layers.append(sync)
        t = timeline(layers, self.machine)
        mem = sum(cost.memory(layers, self.itemsize, self.optimizer_states).values())
        return _Priced(t.step, t.forward, float(mem), layers, analysis)


def _layouts_of(analysis: Any) -> set:
    """Every grid a value of the analysis lives on."""
    out = {analysis.data}
    for st in analysis.steps:
        out.update(p.layout for p in [st.out, *st.needs.values()] if p is not None)
    return out


def _literal(name: str) -> str:
    """A module name as a config pattern that matches it alone (``[`` escaped)."""
    return name.replace("[", "[[]")


# ============================================================================ the plan
@dataclass
class LayerPlan:
    """One convolution's choice, its price (its own report: compute and collectives, its
    gradient allreduce alone) and the conversion into it."""

    conv: ConvNode
    choice: Choice
    cost: LayerCost
    transition: float          # forward seconds of the conversions into this layer
    transition_bytes: int      # the bytes the slowest rank receives in them
    runner_up: Choice | None = None
    runner_up_delta: float = math.inf  # how much dearer the step would be with it


@dataclass
class Plan:
    """A whole-network plan: per layer choices, the price of a step and memory per rank."""

    world_size: int
    batch: int
    machine: Machine
    layers: list[LayerPlan]
    extra: float               # everything but the convolutions' own reports (seconds)
    step_time: float           # explain's price of :meth:`config` on ``machine``
    forward_time: float
    memory: float              # explain's memory per rank (parameters, gradients, state, activations)
    notes: list[str] = field(default_factory=list)
    #: the plans the search priced exactly
    priced: int = 0
    #: the ``parallelize`` config it was planned from (``plan_network(config=...)``), and the
    #: layers whose ``auto`` entries it chose for; None: planned from scratch
    base: dict[str, Any] | None = None
    planned: frozenset[str] = frozenset()
    #: the priced layers (``explain``'s :class:`~distconv.ops.pricing.LayerReport` list)
    reports: list[LayerReport] = field(default_factory=list, repr=False)

    def config(self) -> dict[str, Any]:
        """The plan in the format of ``distconv.parallelize``: sample-parallel default and one
        entry per convolution that differs from it (exact names, in model order). Planned from a
        config: that config with an exact entry, first, for every layer its ``auto`` chose; an
        ``auto`` entry or default, which then reaches Linear layers only, says what ``auto``
        means for those where it can -- sample parallelism on a data grid of samples only -- so
        that no ``auto`` is left to resolve."""
        if self.base is not None:
            chosen = [{"match": _literal(lp.conv.name), **lp.choice.config()}
                      for lp in self.layers if lp.conv.name in self.planned]
            return {**_settled(self.base, self.world_size),
                    "layers": chosen + [_settled_entry(e, self.base, self.world_size)
                                        for e in self.base.get("layers", [])]}
        default = sample_choice(self.world_size).config()
        return {
            "default": default,
            "layers": [{"match": _literal(lp.conv.name), **lp.choice.config()}
                       for lp in self.layers if lp.choice.config() != default],
        }

    def explain(self) -> str:
        return explain(self)

    def __repr__(self) -> str:
        return (f"Plan(world_size={self.world_size}, batch={self.batch}, machine="
                f"{self.machine.name!r}, step_time={self.step_time:.4g}, memory={self.memory:.3g},"
                f" layers={len(self.layers)})")


def _settled_entry(entry: Mapping[str, Any], base: Mapping[str, Any], P: int) -> dict[str, Any]:
    """An ``auto`` entry that now reaches Linear layers only: sample parallelism on the data grid
    where that grid splits samples only."""
    data = dict(base.get("data", {"N": P}))
    if entry.get("algorithm") != "auto" or set(data) != {"N"}:
        return dict(entry)
    rest = {k: v for k, v in entry.items() if k not in ("grid", "pipeline")}
    return {**rest, "grid": data, "algorithm": "sample"}


def _settled(base: Mapping[str, Any], P: int) -> dict[str, Any]:
    out = dict(base)
    if "default" in base:
        out["default"] = _settled_entry(base["default"], base, P)
    return out


def explain(plan: Plan) -> str:
    """Why: per layer the chosen option, its predicted milliseconds (forward, backward on the
    critical path, gradient allreduce alone, conversion into it), the bytes the slowest rank
    receives in that conversion, and the runner-up with how much dearer the step would be."""
    rows = [f"{plan.machine.name}, {plan.world_size} ranks, batch {plan.batch}: predicted step "
            f"{plan.step_time * 1e3:.2f} ms (forward {plan.forward_time * 1e3:.2f} ms), "
            f"{plan.memory / 2**30:.2f} GiB per rank; {plan.priced} plans priced",
            "per layer (its own report; runner-up: the step's price with it instead):",
            f"{'layer':28s} {'choice':26s} {'fwd':>7s} {'bwd':>7s} {'allred':>7s} "
            f"{'redist':>7s} {'bytes in':>11s}  runner-up (step +ms)"]
    for lp in plan.layers:
        ms = lambda t: f"{t * 1e3:7.3f}"  # noqa: E731
        ru = f"{lp.runner_up} ({lp.runner_up_delta * 1e3:+.3f})" if lp.runner_up else "-"
        rows.append(f"{lp.conv.name:28s} {str(lp.choice):26s} {ms(lp.cost.forward)} "
                    f"{ms(lp.cost.backward)} {ms(lp.cost.allreduce)} {ms(lp.transition)} "
                    f"{lp.transition_bytes:11,d}  {ru}")
    rows.append(f"every other node, the gradient buckets and their overlap: "
                f"{plan.extra * 1e3:.3f} ms")
    rows.extend(plan.notes)
    return "\n".join(rows)


#: the chunk counts the search tries for a layer whose collectives pipelining can overlap
PIPELINES = (2, 4, 8)
#: the frontiers the beam keeps per node
BEAM_WIDTH = 4
#: the beam's plans per allreduce weight that are priced exactly
BEAM_PLANS = 1
#: how much dearer than the best a priced plan may be for the descent to draw choices from it
SEED_SLACK = 1.5


def plan_network(
    model: torch.nn.Module | Network,
    input_shape: Sequence[int] | None = None,
    *,
    world_size: int,
    machine: Machine,
    memory_limit: float | None = None,
    max_model: int = 16,
    max_sample: int | None = None,
    algorithms: Sequence[str] = ALGORITHMS,
    itemsize: int = 4,
    optimizer_slots: int = 1,
    config: Mapping[str, Any] | None = None,
    beam_width: int = BEAM_WIDTH,
) -> Plan:
    """Choose every convolution's grid and algorithm for one training step of ``model``.

    Args:
        model: a module (traced by :func:`trace_network` on ``input_shape``) or a traced Network.
        input_shape: the global input ``(batch, channels, *spatial)``.
        world_size: ranks P; every layer's grid has P positions.
        machine: a :class:`~distconv.machines.Machine`, a flat ``perfmodel.Machine`` (priced as
            one level), a factory such as ``distconv.machines.lassen`` or a name such as
            ``"lassen"`` (:func:`~distconv.machines.resolve_machine`; TypeError otherwise).
        memory_limit: bytes per rank (explain's memory: parameters, gradients, optimizer state,
            activations); default ``machine.memory``.
        max_model: the most ranks a layer's C×F×(spatial) dims may span. Default 16.
        max_sample: the largest N extent (the paper's number of N rows); default the batch.
        algorithms: the choices allowed. Default all of ``sample, spatial, stationary-x/-y/-w``.
        itemsize: bytes per element (4: fp32). optimizer_slots: optimizer state per parameter
            (1: SGD with momentum), as explain's ``optimizer_states``.
        config: a ``parallelize`` config (a mapping or YAML path) whose ``auto`` entries (or
            ``auto`` default) say which convolutions to choose for -- any of ``Conv1d/2d/3d``
            and ``ConvTranspose1d/2d/3d``; an ``auto`` entry that names a grid chooses among
            that grid's candidates; every other layer keeps its entry, and
            :meth:`Plan.config` is this config with an exact entry, first, for each chosen
            layer. Default None: choose for every convolution, from scratch.
        beam_width: the frontiers the search keeps per node (:class:`_Search`). Default 4.

    Raises:
        ValueError: bad arguments, a bad ``config``, or no plan within ``memory_limit``.
        distconv.ops.Unsupported: a node ``parallelize`` cannot run, named.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"plan_network: world_size must be an int >= 1, got {world_size!r}")
    machine = resolve_machine(machine, hierarchical=True)
    bad = [a for a in algorithms if a not in ALGORITHMS]
    if bad or not algorithms:
        raise ValueError(f"plan_network: algorithms must be among {ALGORITHMS}, got {algorithms}")
    if isinstance(beam_width, bool) or not isinstance(beam_width, int) or beam_width < 1:
        raise ValueError(f"plan_network: beam_width must be an int >= 1, got {beam_width!r}")
    net = model if isinstance(model, Network) else _traced(model, input_shape)
    limit = getattr(machine, "memory", math.inf) if memory_limit is None else memory_limit
    if not limit > 0:
        raise ValueError(f"plan_network: memory_limit must be > 0, got {memory_limit}")
    base: dict[str, Any] = {"default": sample_choice(world_size).config()}
    todo = [c for c in net.convs]
    options: dict[str, list[Choice]] = {}
    if config is not None:
        cfg = ParallelConfig(config, world_size=world_size)
        base = cfg.to_dict()
        todo = [c for c in net.convs if cfg.choice(c.name).algorithm == "auto"]
        for c in todo:
            grid = cfg.choice(c.name).layout
            if grid is not None:  # an 'auto' entry that names its grid
                ch = _layout_choice(c, _canonical(grid))
                options[c.name] = [ch] if ch is not None else []
        # what parallelize would do with the auto layers left: its own per-layer choice; the
        # search replaces it, so the config it starts from holds none
        base = _without_auto(base, world_size)
    for c in todo:
        if c.name not in options:
            options[c.name] = layer_candidates(c, world_size, max_model=max_model,
                                               max_sample=max_sample, algorithms=algorithms)
        if not options[c.name]:
            what = c.problem or f"{type(c.module).__name__} on {c.in_shape}"
            grid = (f" on the grid {dict(cfg.choice(c.name).layout)} its entry names"
                    if config is not None and cfg.choice(c.name).layout is not None else "")
            raise ValueError(
                f"plan_network: no candidate for {c.name} ({what}){grid} on world_size="
                f"{world_size} with algorithms={tuple(algorithms)}, max_model={max_model}; "
                "allow more algorithms or a larger max_model, or a batch >= world_size")
    search = _Search(net, world_size, machine, options, base, itemsize, optimizer_slots)
    notes: list[str] = []
    best = _search(search, 0.0, limit, beam_width)
    if best[1].memory > limit:
        best = _fit_memory(search, limit, beam_width)
    chosen, priced = best
    chosen, priced, runners = _descend(search, chosen, priced, limit)
    if search.binding:
        notes.append(f"memory limit {limit / 2**30:.2f} GiB per rank is binding")
    return _make_plan(search, chosen, priced, runners, notes,
                      base if config is not None else None, frozenset(options))


def _traced(model: torch.nn.Module, input_shape: Sequence[int] | None) -> Network:
    if input_shape is None or not 3 <= len(input_shape) <= 5:
        raise ValueError(f"plan_network: input_shape must be (N, C, *spatial) with 1 to 3 "
                         f"spatial dims, got {input_shape}")
    return trace_network(model, input_shape)


def _without_auto(raw: dict[str, Any], P: int) -> dict[str, Any]:
    """The config with its ``auto`` default sample-parallel on the data grid (the layers the
    search chooses for take its choices; Linear layers take what ``auto`` means for them)."""
    return _settled(raw, P)


def _search(s: _Search, mu: float, limit: float, width: int
            ) -> tuple[dict[str, Choice], _Priced]:
    """The cheapest of the beam's plans (allreduces weighted 0 and 1) and the uniform plans,
    by the price; the memory multiplier ``mu`` steers the beam."""
    plans: dict[tuple, dict[str, Choice]] = {}
    for lam in (0.0, 1.0):
        for p in s.beam(lam, mu, width)[:BEAM_PLANS]:
            plans.setdefault(tuple(sorted(p.items(), key=lambda kv: kv[0])), p)
    for p in _uniform(s):
        plans.setdefault(tuple(sorted(p.items(), key=lambda kv: kv[0])), p)
    scored = []
    for p in plans.values():
        try:
            priced = s.price(p)
        except (Unsupported, ValueError):
            continue  # e.g. a uniform plan a layer's placement refuses
        fits = priced.memory <= limit
        scored.append(((not fits, priced.step + mu * priced.memory if fits else priced.memory),
                       p, priced))
    if not scored:
        raise ValueError("plan_network: the search found no plan parallelize can run")
    _, p, priced = min(scored, key=lambda t: t[0])
    # the plans the descent draws each layer's alternatives from: those near the best
    s.seeds.extend(q for (infeasible, _), q, qp in scored
                   if not infeasible and qp.step <= SEED_SLACK * priced.step)
    s.binding = s.binding or min(scored, key=lambda t: t[2].step)[2].memory > limit
    return p, priced


def _uniform(s: _Search) -> list[dict[str, Choice]]:
    """Per grid and algorithm every layer the search chooses for can take, the plan giving it
    to all of them."""
    keys = [{(ch.grid, ch.algorithm): ch for ch in opts} for opts in s.options.values()]
    common = set(keys[0]).intersection(*keys[1:]) if keys else set()
    return [{n: k[key] for n, k in zip(s.options, keys)}
            for key in sorted(common, key=lambda g: (g[1], g[0]))]


def _fit_memory(s: _Search, limit: float, width: int) -> tuple[dict[str, Choice], _Priced]:
    """Raise the beam's price of memory (seconds per byte) until its plan fits ``limit``, then
    bisect it down to the cheapest multiplier that still fits."""
    lo, hi = 0.0, 1e-12
    while True:
        p, priced = _search(s, hi, limit, width)
        if priced.memory <= limit:
            break
        if hi > 1e3:
            raise ValueError(
                f"plan_network: no plan fits memory_limit={limit:.4g} bytes per rank; the "
                f"smallest found needs {priced.memory:.4g} (more ranks, a larger max_model or a "
                "smaller batch)")
        lo, hi = hi, hi * 8
    fit = (p, priced)
    for _ in range(8):
        mid = math.sqrt(lo * hi) if lo else hi / 8
        p, priced = _search(s, mid, limit, width)
        if priced.memory <= limit:
            hi = mid
            if priced.step < fit[1].step:
                fit = (p, priced)
        else:
            lo = mid
    return fit


def _alternatives(s: _Search, name: str, current: Choice) -> list[Choice]:
    """A layer's other choices the descent tries: what the beam's plans and the uniform plans
    give it, and its current one pipelined where that layer moves data pipelining can
    overlap."""
    out = [p[name] for p in s.seeds if p[name] != current]
    if current.communicates:
        out += [replace(current, pipeline=k) for k in PIPELINES if k != current.pipeline]
    if current.pipeline > 1:
        out.append(replace(current, pipeline=1))
    return list(dict.fromkeys(out))


def _descend(s: _Search, chosen: dict[str, Choice], priced: _Priced, limit: float,
             rounds: int = 4) -> tuple[dict[str, Choice], _Priced, dict[str, tuple]]:
    """Coordinate descent on the price, until a round changes nothing: each group of layers
    (:func:`_groups`) given one grid and algorithm at once, then each layer's alternatives with
    the rest kept, taken where the step is cheaper; the last round's best alternative per layer
    (the runner-up) with its price."""
    runners: dict[str, tuple[Choice | None, float]] = {}
    for _ in range(rounds):
        improved = False
        for group in _groups(s):  # a stage at once: what no single layer's change pays for
            for key in sorted({(ch.grid, ch.algorithm) for n in group for ch in s.options[n]},
                              key=lambda g: (g[1], g[0])):
                moved = {n: next((ch for ch in s.options[n] if (ch.grid, ch.algorithm) == key),
                                 chosen[n]) for n in group}
                if all(moved[n] == chosen[n] for n in group):
                    continue
                try:
                    trial = s.price({**chosen, **moved})
                except (Unsupported, ValueError):
                    continue
                if trial.memory <= limit and trial.step < priced.step * (1 - 1e-9):
                    chosen, priced, improved = {**chosen, **moved}, trial, True
        runners = {}
        for name in s.options:
            best_other: tuple[Choice | None, float] = (None, math.inf)
            for ch in _alternatives(s, name, chosen[name]):
                try:
                    trial = s.price({**chosen, name: ch})
                except (Unsupported, ValueError):
                    continue
                if trial.memory > limit:
                    s.binding = s.binding or trial.step < priced.step
                    continue
                if trial.step < priced.step * (1 - 1e-9):
                    best_other = (chosen[name], priced.step)
                    chosen, priced, improved = {**chosen, name: ch}, trial, True
                elif trial.step < best_other[1]:
                    best_other = (ch, trial.step)
            runners[name] = best_other
        if not improved:
            break
    return chosen, priced, runners


def _groups(s: _Search) -> list[list[str]]:
    """The layers the search chooses for, grouped by the model's top-level module (a ResNet's
    stage, a U-Net's level), where a group holds more than one."""
    groups: dict[str, list[str]] = {}
    for name in s.options:
        groups.setdefault(name.split(".")[0], []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def _make_plan(s: _Search, chosen: Mapping[str, Choice], priced: _Priced,
               runners: Mapping[str, tuple], notes: list[str], base: dict[str, Any] | None,
               planned: frozenset[str]) -> Plan:
    """The plan of ``chosen``, its price that of :mod:`distconv.parallel.cost` over the
    analysis of its config (explain's, exactly)."""
    shapes = s.shapes
    every = cost.evaluated_analysis_ranks(priced.analysis, s.P)
    layers, _ = cost.price_analysis(s.gm, priced.analysis, s.net.input_shape, shapes, s.P,
                                    s.itemsize, s.machine, 25 << 20, {})
    t = timeline(layers, s.machine)
    memory = float(sum(cost.memory(layers, s.itemsize, s.optimizer_states).values()))
    by_name = {lay.name: lay for lay in layers}
    steps = {str(st.node.target): st for st in priced.analysis.steps
             if st.node.op == "call_module"}
    lps = []
    own = 0.0
    for c in s.net.convs:
        if c.name not in chosen or c.name not in by_name:
            continue
        rep = by_name[c.name]
        moved = [st for st in rep.steps if st.op == "redistribute"]
        mine = replace(rep, steps=[st for st in rep.steps if st.op != "redistribute"])
        fwd, bwd = _phases(mine, s.machine)
        _, _, mem = s.seconds(mine)
        into = [st for st in moved if st.phase == "forward"]
        lc = LayerCost(fwd, bwd, s.allreduce(steps[c.name]), mem)
        own += fwd + bwd + sum(st.seconds(s.machine) for st in moved)
        ru, at = runners.get(c.name, (None, math.inf))
        lps.append(LayerPlan(c, chosen[c.name], lc, sum(st.seconds(s.machine) for st in into),
                             max((sum(st.bytes[r] for st in into) for r in every), default=0),
                             ru, at - t.step))
    plan = Plan(s.P, s.net.input_shape[0], s.machine, lps, t.step - own, t.step, t.forward,
                memory, notes, priced=s.visited, base=base, planned=planned, reports=layers)
    return plan


def _config_choices(net: Network, config: Any, world_size: int) -> dict[str, Choice]:
    """Each convolution's choice under a ``parallelize`` config, as parallelize matches it
    (:meth:`ParallelConfig.choice`); an ``auto`` entry is refused (predict prices given
    configs)."""
    cfg = config if isinstance(config, ParallelConfig) else ParallelConfig(
        config, world_size=world_size)
    out = {}
    for c in net.convs:
        entry = cfg.choice(c.name)
        if entry.layout is None or entry.algorithm == "auto":
            raise ValueError(f"predict: {c.name} takes {entry.source}, whose algorithm 'auto' "
                             "is chosen by parallelize; give it a grid and an algorithm")
        grid, algorithm = _canonical(entry.layout), entry.algorithm
        if c.module is not None and entry.source == "default" and algorithm != "spatial":
            # a sample or stationary default runs these sample-parallel on the data grid
            grid, algorithm = _canonical(cfg.data), "sample"
        groups = c.module.groups if c.module is not None else c.problem.groups
        e_ = dict(grid)
        out[c.name] = Choice(grid, algorithm, pipeline=entry.pipeline,
                             groups_aligned=groups > 1 and e_.get("C", 1) * e_.get("F", 1) > 1,
                             spatial=c.spatial, transposed=c.transposed)
    return out


def _layout_choice(c: ConvNode, grid: tuple[tuple[str, int], ...]) -> Choice | None:
    """The choice an ``auto`` entry naming ``grid`` gives ``c`` (the algorithm that grid runs, as
    ``parallelize`` resolves it), or None where the layer cannot run it."""
    live = {d for d, _ in grid if d != "N"}
    algorithm = ("stationary-w" if {"C", "F"} <= live else "stationary-x" if "C" in live
                 else "stationary-y" if "F" in live else "spatial" if live else "sample")
    if c.module is not None:
        if refusal(c.module, grid, algorithm, c.in_shape) is not None:
            return None
        e = dict(grid)
        return Choice(grid, algorithm,
                      groups_aligned=c.module.groups > 1 and e.get("C", 1) * e.get("F", 1) > 1,
                      spatial=c.spatial, transposed=c.transposed)
    if live - {"C", "F", "H", "W"}:
        return None
    return _valid(c.problem, Choice(grid, algorithm))


def _canonical(layout: Sequence[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """A grid layout as the executor keeps placements: grid dims of extent 1 dropped."""
    return tuple((d, e) for d, e in layout if e > 1) or (("N", 1),)


def predict(model: torch.nn.Module | Network, config: Mapping[str, Any],
            input_shape: Sequence[int] | None = None, *, world_size: int, machine: Machine,
            itemsize: int = 4, optimizer_slots: int = 1) -> Plan:
    """A given ``parallelize`` config (``auto`` is not resolved here) as a :class:`Plan`: its
    price is ``explain``'s on ``machine`` (any form of
    :func:`~distconv.machines.resolve_machine`)."""
    machine = resolve_machine(machine, hierarchical=True)
    net = model if isinstance(model, Network) else trace_network(model, input_shape or ())
    cfg = ParallelConfig(config, world_size=world_size)
    fixed = _config_choices(net, cfg, world_size)
    search = _Search(net, world_size, machine, {}, cfg.to_dict(), itemsize, optimizer_slots)
    return _make_plan(search, fixed, search.price({}), {}, ["prediction of a given config"],
                      cfg.to_dict(), frozenset())
