"""A whole-network planner: per convolution, the grid and algorithm that minimise the step time.

The model is traced (:func:`trace_network`) into a chain of **units** -- a single convolution, or
a block (a main branch and a skip that is the identity or its own branch, joined by a residual
add or by a channel concatenation; a branch is itself a chain of units, so blocks nest, as a
U-Net's levels do). Every convolution chooses a
:class:`Choice` (grid layout and algorithm; its x and y distributions follow, as in
:class:`~distconv.nn.DistConv2d`):

* ``sample``: grid ``{N: P}``;  ``spatial``: ``{N, H}`` or ``{N, H, W}``;
* ``stationary-x``: ``{N, C}``;  ``stationary-y``: ``{N, F}``;  ``stationary-w``: ``{N, C, F}``,

with the model-parallel dims **last**, so channel groups sit inside a socket or node. A
``Conv1d``, ``Conv3d`` or transposed convolution chooses the same way, its spatial splits over
its own spatial dims (``D``, ``H``, ``W`` of a volume, ``W`` of a signal; every split of the
ranks among them) and its candidates kept where it can run them
(:func:`distconv.ops.conv_nd.refusal`). Dynamic programming runs over the chain with the
distribution of the activation between units as the state; inside a block, for every entry
state, a chain DP over the main branch and the cheapest skip (its redistribution, or its own
chain) give the block's cost to every exit state (found once per entry state: a nested block is
entered from every state of its branch). The operands meet as the executor joins them: where
the other reaches with fewer bytes (at a cat, among the operands' placements with the channels
whole).

Costs (seconds, slowest rank): each Conv2d's :func:`~distconv.perfmodel.conv_cost` on the machine
(another convolution's: its op handler's price, :func:`distconv.ops.conv_nd.layer_report`),
split into forward, backward on the critical path, and the gradient allreduce; the bytes of every
redistribution between consecutive choices exactly as the executor moves them
(:func:`transition_bytes`), forward and its adjoint. The DP charges each allreduce a weight
``lam`` in ``(0, 0.5, 1)``; every resulting plan is then timed on a two-stream timeline in which
allreduces overlap the rest of backward, and the fastest kept. A per-rank memory limit (parameters,
gradients, optimizer state, stored activations) is met by a Lagrange multiplier on memory.

That search sees the convolutions and what moves between them; the plans it returns (and every
uniform plan: one grid and algorithm for all convolutions) are then priced by the op handlers,
as ``explain`` prices it (every layer's collectives, BatchNorm statistics, the gradient buckets,
on the same two-stream timeline: :func:`distconv.ops.pricing.timeline`), so ``Plan.step_time``
is the price ``explain`` gives the same config on the same machine.
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from distconv.distribution import Dist
from distconv.machines import resolve_machine
from distconv.machines.base import Machine, group_of
from distconv.comm.base import allreduce_bytes
from distconv.conv_geometry import HaloPlan
from distconv.nn.conv import conv_dists
from distconv.nn.conv_nd import conv_nd_dists, spatial_roles
from distconv.ops.conv import memory_elements, moves_data
from distconv.ops.conv_nd import layer_report, refusal
from distconv.ops.elementwise import meeting
from distconv.ops.pricing import largest_block
from distconv.parallel.placement import (
    Placement, conversion_bytes, evaluated_ranks, one_grid, paper_grid, repartition_sources)
from distconv.perfmodel import ConvProblem, conv_cost
from distconv.redistribute import plan_redistribution

__all__ = ["Choice", "ConvNode", "Block", "Network", "Plan", "trace_network", "candidates",
           "layer_candidates", "nd_layer_cost", "transition_bytes", "transition_time",
           "plan_network", "predict",
           "explain"]

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


@dataclass(frozen=True)
class Block:
    """Two branches from one value, joined: ``add(main(x), skip(x))`` (a residual block) or
    ``cat([main(x), skip(x)], 1)`` (``join="cat"``, e.g. a dense or U-Net-style skip); ``skip``
    is empty for the identity. A branch is a chain of units: convolutions and blocks nested in
    it (a U-Net's levels). ``main_first``: the main branch is the join's first operand (which
    wins a tie where the operands meet). ``shapes``: the global shapes of the (main, skip)
    operands of a cat."""

    main: tuple[ConvNode | Block, ...]
    skip: tuple[ConvNode | Block, ...]
    main_first: bool = True
    join: str = "add"
    shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def convs(self) -> tuple[ConvNode, ...]:
        return tuple(c for u in self.main + self.skip
                     for c in (u.convs if isinstance(u, Block) else (u,)))

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The global shape of the joined value."""
        if self.join == "cat":
            a, b = self.shapes
            return (a[0], a[1] + b[1], *a[2:])
        return self.main[-1].out_shape


Unit = ConvNode | Block


@dataclass(frozen=True)
class Network:
    """The planner's view of a model: input shape, chain of units, and the Linear heads."""

    input_shape: tuple[int, ...]
    units: tuple[Unit, ...]
    linears: tuple[tuple[str, int], ...]  # (name, parameters)
    out_shape: tuple[int, ...]
    #: the traced model (on the meta device): what plans are priced on, by the op handlers
    model: torch.nn.Module | None = field(default=None, compare=False, repr=False)

    @property
    def convs(self) -> list[ConvNode]:
        return [c for u in self.units for c in (u.convs if isinstance(u, Block) else (u,))]


def _problem(conv: torch.nn.Conv2d, shape: Sequence[int]) -> ConvProblem:
    return ConvProblem(int(shape[0]), conv.in_channels, conv.out_channels, int(shape[2]),
                       int(shape[3]), tuple(conv.kernel_size), tuple(conv.stride),
                       conv.padding if isinstance(conv.padding, str) else tuple(conv.padding),
                       tuple(conv.dilation), conv.groups, conv.bias is not None,
                       conv.padding_mode)


def trace_network(model: torch.nn.Module, input_shape: Sequence[int]) -> Network:
    """Trace ``model`` with ``torch.fx`` and propagate global shapes on the meta device.

    Raises:
        distconv.ops.Unsupported: a node no op handler runs (the refusal ``parallelize`` and
            ``explain`` give).
        NotImplementedError: a graph that is not a chain of convolutions and blocks (nested
            or not), naming the layer or join where it branches otherwise.
        ValueError: an ``input_shape`` the model cannot take (naming it and what the first
            layer expects).
    """
    from distconv.ops.conv_nd import ConvNdHandler
    from distconv.ops.elementwise import BinaryHandler, CatHandler
    from distconv.parallel.config import ParallelConfig
    from distconv.parallel.graph import analyse, trace
    from distconv.parallel.shapes import check_input_shape, propagate_shapes

    if any(p.device.type != "meta" for p in model.parameters()):
        model = copy.deepcopy(model).to("meta")
    gm = trace(model)
    check_input_shape(gm, input_shape)
    # the one analysis of the graph: what the planner plans, parallelize can run (every node has
    # a handler in the registry), and each node is read through its handler's step
    analysis = analyse(gm, ParallelConfig({"default": {"grid": {"N": 1}, "algorithm": "sample"}},
                                          world_size=1), input_ndim=len(tuple(input_shape)))
    dtype = next((p.dtype for p in gm.parameters() if p.is_floating_point()), None)
    propagate_shapes(gm, input_shape, dtype=dtype)  # in the model's own dtype
    modules = dict(gm.named_modules())
    producer: dict[Any, Any] = {}  # fx node -> "input" | conv fx node | join fx node
    convs: dict[Any, ConvNode] = {}
    source: dict[Any, Any] = {}    # conv fx node -> producer of its input
    adds: dict[Any, tuple[Any, Any]] = {}  # joins: adds and channel concatenations
    cats: dict[Any, tuple[tuple[int, ...], ...]] = {}  # concatenation -> its operands' shapes
    linears: list[tuple[str, int]] = []
    order: list[Any] = []
    for step in analysis.steps:
        node = step.node
        args = [a for a in node.all_input_nodes if a in producer]  # parameters have none
        if step.kind == "input":
            producer[node] = "input"
        elif step.kind == "conv":
            shape = args[0].meta["tensor_meta"].shape
            convs[node] = ConvNode(str(node.target), _problem(modules[node.target], shape),
                                   tuple(node.meta["tensor_meta"].shape))
            source[node], producer[node] = producer[args[0]], node
            order.append(node)
        elif isinstance(step.handler, ConvNdHandler) and node.op == "call_module":
            shape = tuple(args[0].meta["tensor_meta"].shape)
            convs[node] = ConvNode(str(node.target), None, tuple(node.meta["tensor_meta"].shape),
                                   modules[node.target], shape)
            source[node], producer[node] = producer[args[0]], node
            order.append(node)
        elif (isinstance(step.handler, BinaryHandler) and len(args) == 2
              and node.target in (operator.add, operator.iadd, torch.add, "add", "add_")):
            adds[node] = (producer[args[0]], producer[args[1]])
            producer[node] = node
            order.append(node)
        elif isinstance(step.handler, CatHandler) and len(args) == 2 and _cat_dim(node) == 1:
            adds[node] = (producer[args[0]], producer[args[1]])
            cats[node] = tuple(tuple(a.meta["tensor_meta"].shape) for a in args)
            producer[node] = node
            order.append(node)
        elif step.kind == "output" or not args:
            continue
        else:
            if step.kind == "linear":  # sample-parallel layers: their gradients are allreduced
                mod = modules.get(node.target) if node.op == "call_module" else None
                linears.append((str(node.target) if mod is not None else node.name,
                                sum(p.numel() for p in mod.parameters()) if mod else 0))
            elif len({producer[a] for a in args}) > 1:
                raise NotImplementedError(
                    f"trace_network: {node.format_node()} joins several values; the planner "
                    "handles chains of convolutions joined by residual adds or by a channel "
                    "concatenation of two branches only"
                )
            producer[node] = producer[args[0]]
    # the activation leaving the last unit, which the sample-parallel head reads
    out_shape = tuple(order[-1].meta["tensor_meta"].shape) if order else tuple(input_shape)
    return Network(tuple(input_shape), _units(order, convs, source, adds, cats),
                   tuple(linears), out_shape, model)


def _cat_dim(node: Any) -> int:
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    ndim = len(node.meta["tensor_meta"].shape)
    return dim % ndim if isinstance(dim, int) else -1


def _units(order, convs, source, adds, cats) -> tuple[Unit, ...]:  # noqa: ANN001
    """The chain of units from the input to the last convolution or join: walked back from
    it, a convolution steps to its input, a join to the value its two branches leave from (the
    nearest both pass, found the same way: blocks nest)."""
    entries: dict[Any, Any] = {}  # join -> the value its branches leave from

    def back(p):  # noqa: ANN001, ANN202
        out = [p]
        while p in convs or p in adds:
            p = source[p] if p in convs else entry(p)
            out.append(p)
        return out

    def entry(a):  # noqa: ANN001, ANN202
        if a not in entries:
            c1, c2 = back(adds[a][0]), back(adds[a][1])
            entries[a] = next(p for p in c1 if p in c2)  # both reach the input
        return entries[a]

    def walk(end, start) -> tuple[Unit, ...]:  # noqa: ANN001
        out: list[Unit] = []
        p = end
        while p != start:
            if p in convs:
                out.append(convs[p])
                p = source[p]
            elif p in adds:
                out.append(block(p))
                p = entry(p)
            else:
                raise NotImplementedError(
                    f"trace_network: a branch ending at {end} does not start at {start} but "
                    "passes it by: the planner plans chains of convolutions and of blocks (two "
                    "branches from one value joined by an add or a channel concatenation, "
                    "nested or not), not branches that cross; write such a config by hand "
                    "(explain prices it)")
        return tuple(out[::-1])

    def block(a):  # noqa: ANN001, ANN202
        e = entry(a)
        b1, b2 = walk(adds[a][0], e), walk(adds[a][1], e)
        size = [sum(len(u.convs) if isinstance(u, Block) else 1 for u in b) for b in (b1, b2)]
        main_first = size[0] >= size[1]
        shapes = cats.get(a, ())
        return Block(b1 if main_first else b2, b2 if main_first else b1, main_first,
                     "cat" if a in cats else "add", shapes if main_first else shapes[::-1])

    if not order:
        return ()
    units = walk(order[-1], "input")
    flat = [c.name for u in units for c in (u.convs if isinstance(u, Block) else (u,))]
    twice = sorted({n for n in flat if flat.count(n) > 1})
    if twice:
        raise NotImplementedError(
            f"trace_network: the output of {twice} feeds two branches that do not leave from "
            "one value; the planner plans chains of convolutions and of blocks (two branches "
            "from one value joined by an add or a channel concatenation, nested or not), not "
            "branches that cross; write such a config by hand (explain prices it)")
    stray = [c.name for c in convs.values() if c.name not in flat]
    if stray:
        raise NotImplementedError(
            f"trace_network: {stray} lie on no path from the input to {order[-1]}; the planner "
            "plans chains of convolutions and of blocks (two branches from one value joined "
            "by an add or a channel concatenation), not other branches")
    return units


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
    """Where an activation that no convolution produced lives between units (a concatenation's
    output): a state of the search like a :class:`Choice`'s output."""

    grid: tuple[tuple[str, int], ...]
    output_dist: Dist

    @property
    def input_dist(self) -> Dist:
        return self.output_dist


def sample_choice(world_size: int) -> Choice:
    return Choice((("N", world_size),), "sample")


def _sample_value(world_size: int, ndim: int) -> Choice | Value:
    """Where the model's input (``ndim`` dims) arrives and its head reads: each rank its own
    samples."""
    if ndim == 4:
        return sample_choice(world_size)
    from distconv.parallel.graph import sample_dist

    grid = (("N", world_size),)
    return Value(grid, Placement(grid, sample_dist(ndim)).dist)


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


# ============================================================================ transitions
_fake_grid = paper_grid  # a grid value with no communicator: for counting only


def _ranks(layouts: Sequence[tuple[tuple[str, int], ...]], size: int) -> list[int]:
    """The ranks a move's slowest rank is found among: explain's rule for maxima
    (:func:`~distconv.parallel.placement.evaluated_ranks` with ``every=False``)."""
    return evaluated_ranks(layouts, size, every=False)


Endpoint = tuple[tuple[tuple[str, int], ...], Dist]  # (grid layout, distribution)


def _move_bytes(src: Endpoint, dst: Endpoint, shape: tuple[int, ...], rank: int,
                itemsize: int) -> int:
    """Bytes ``rank`` receives converting between the endpoints: what explain reports and the
    communicators count (:func:`~distconv.parallel.placement.conversion_bytes`)."""
    return conversion_bytes(Placement(*src), Placement(*dst), shape, itemsize, rank)


def _move_time(src: Endpoint, dst: Endpoint, shape: tuple[int, ...], machine: Machine,
               itemsize: int) -> tuple[float, int]:
    """``(seconds, bytes)`` on the slowest rank, priced on the level the moving ranks span."""
    if src[0] != dst[0]:  # one redistribution where the executor makes it one
        same = one_grid(Placement(*src), Placement(*dst), shape)
        src = (same.layout, same.dist) if same.layout == dst[0] else src
    if src == dst:
        return 0.0, 0
    size = math.prod(e for _, e in src[0])
    worst = (0.0, 0)
    if src[0] == dst[0]:
        plan = plan_redistribution(src[0], src[1], dst[1], shape)
        if not plan.steps:
            return worst
        ext = dict(src[0])
        dims = [d for s in plan.steps for d in (getattr(s, "dims", ()) or (s.g,))]
        group = group_of(src[0], sorted(set(dims)))
        steps = sum(max(ext.get(d, 1) - 1, 1) for d in dims)
        for r in _ranks([src[0]], size):
            b = plan.received_bytes(_fake_grid(src[0], r), itemsize)
            worst = max(worst, (machine.link_time(group, b, steps) if b else 0.0, b))
        return worst
    for r in _ranks([src[0], dst[0]], size):
        peers = repartition_sources(src[0], src[1], dst[0], dst[1], shape, r)
        if peers:
            b = itemsize * sum(peers.values())
            worst = max(worst, (machine.link_time([r, *peers], b, len(peers)), b))
    return worst


def transition_bytes(src: Choice, dst: Choice, shape: Sequence[int], rank: int, *,
                     itemsize: int = 4) -> int:
    """Bytes rank ``rank`` receives moving an activation of global ``shape`` from ``src``'s output
    distribution to ``dst``'s input distribution: ``plan_redistribution(...).received_bytes`` on
    one grid layout, the cross-grid ``repartition`` plan otherwise (what the executor counts)."""
    return _move_bytes((src.grid, src.output_dist), (dst.grid, dst.input_dist),
                       tuple(int(s) for s in shape), rank, itemsize)


def transition_time(src: Choice, dst: Choice, shape: Sequence[int], machine: Machine, *,
                    itemsize: int = 4) -> tuple[float, int]:
    """``(seconds, bytes)`` of that redistribution on its slowest rank (forward; the adjoint
    moves the same bytes back). ``machine``: any form of
    :func:`~distconv.machines.resolve_machine` (a flat machine is priced as one level)."""
    machine = resolve_machine(machine, hierarchical=True)
    return _move_time((src.grid, src.output_dist), (dst.grid, dst.input_dist),
                      tuple(int(s) for s in shape), machine, itemsize)


# ============================================================================ layer costs
@dataclass(frozen=True)
class LayerCost:
    """Seconds of one layer under one choice (slowest rank) and its bytes of memory per rank."""

    forward: float
    backward: float   # on the critical path: local backward and activation collectives
    allreduce: float  # gradient allreduce, overlappable with the rest of backward
    memory: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.allreduce


def layer_cost(conv: ConvNode, choice: Choice, machine: Machine, *, itemsize: int = 4,
               optimizer_slots: int = 1, activation_factor: int = 3) -> LayerCost:
    """:func:`~distconv.perfmodel.conv_cost` of the layer, and its memory per rank: weight shard
    times (parameter + gradient + ``optimizer_slots``), plus the stored local input of the local
    convolution and ``activation_factor`` copies of the local output (conv, BN, ReLU).
    ``machine``: any form of :func:`~distconv.machines.resolve_machine`."""
    machine = resolve_machine(machine, hierarchical=True)
    if conv.module is not None:
        return nd_layer_cost(conv, choice, machine, itemsize, optimizer_slots, activation_factor)
    ranks = "corners"  # the slowest rank is among them, as for moves (one sampling rule)
    cost = conv_cost(conv.problem, choice.extents, choice.conv_algorithm, machine,
                     itemsize=itemsize, ranks=ranks, pipeline=choice.pipeline)
    ar = sum(v for k, v in cost.steps.items() if k.startswith("allreduce"))
    return LayerCost(cost.forward, cost.backward - ar, ar,
                     _memory(conv, choice, itemsize, optimizer_slots, activation_factor))


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


def _memory(conv: ConvNode, ch: Choice, itemsize: int, slots: int, factor: int) -> float:
    """Bytes per rank: the weight shard times (parameter + gradient + ``slots``), the gathered
    input the weight gradient keeps, and ``factor`` output blocks (conv, BN, ReLU) -- the conv
    handler's blocks (:func:`~distconv.ops.conv.memory_elements`), as explain counts them."""
    pb = conv.problem
    dists = conv_dists(ch.conv_algorithm, {d: d for d in "NCFHW"}, ch.groups_aligned)
    params, kept = memory_elements(ch.grid, dists, pb, conv.in_shape)
    out = largest_block(Placement(ch.grid, dists["output"]), conv.out_shape)
    return float(itemsize * (params * (2 + slots) + kept + factor * out))


# ============================================================================ the plan
@dataclass
class LayerPlan:
    """One convolution's choice and the costs that made it."""

    conv: ConvNode
    choice: Choice
    cost: LayerCost
    transition: float          # forward seconds of the redistribution into this layer
    transition_bytes: int
    runner_up: Choice | None = None
    runner_up_delta: float = math.inf  # how much slower the step would be with it


@dataclass
class Plan:
    """A whole-network plan: per layer choices, the predicted step time and memory per rank."""

    world_size: int
    batch: int
    machine: Machine
    layers: list[LayerPlan]
    extra: float               # skips, entry and exit redistributions, head allreduce (seconds)
    step_time: float           # the op handlers' price of the plan (explain's), see below
    forward_time: float
    memory: float
    notes: list[str] = field(default_factory=list)
    #: the search's own estimate of the step (convolutions, redistributions, head allreduce)
    search_time: float = math.nan
    #: ``distconv.explain`` of :meth:`config` on the same machine: every layer's collectives and
    #: compute, priced by the op handlers. ``step_time`` and ``forward_time`` are its timeline's,
    #: so the planner and ``explain`` give one price for one plan. None for a network traced
    #: without its model.
    explanation: Any = None
    #: the ``parallelize`` config it was planned from (``plan_network(config=...)``), and the
    #: layers whose ``auto`` entries it chose for; None: planned from scratch
    base: dict[str, Any] | None = None
    planned: frozenset[str] = frozenset()

    def config(self) -> dict[str, Any]:
        """The plan in the format of ``distconv.parallelize``: sample-parallel default and one
        entry per convolution that differs from it (exact names, in model order). Planned from a
        config: that config with an exact entry, first, for every layer its ``auto`` chose; an
        ``auto`` entry or default, which then reaches Linear layers only, says what ``auto``
        means for those where it can -- sample parallelism on a data grid of samples only -- so
        that no ``auto`` is left to resolve."""
        if self.base is not None:
            chosen = [{"match": lp.conv.name, **lp.choice.config()} for lp in self.layers
                      if lp.conv.name in self.planned]
            data = dict(self.base.get("data", {"N": self.world_size}))

            def settled(entry: Mapping[str, Any]) -> dict[str, Any]:
                if entry.get("algorithm") != "auto" or set(data) != {"N"}:
                    return dict(entry)
                rest = {k: v for k, v in entry.items() if k not in ("grid", "pipeline")}
                return {**rest, "grid": data, "algorithm": "sample"}

            out = {**self.base, "layers": chosen + [settled(e) for e in
                                                     self.base.get("layers", [])]}
            if "default" in self.base:
                out["default"] = settled(self.base["default"])
            return out
        default = sample_choice(self.world_size).config()
        return {
            "default": default,
            "layers": [{"match": lp.conv.name, **lp.choice.config()} for lp in self.layers
                       if lp.choice.config() != default],
        }

    def explain(self) -> str:
        return explain(self)

    def __repr__(self) -> str:
        return (f"Plan(world_size={self.world_size}, batch={self.batch}, machine="
                f"{self.machine.name!r}, step_time={self.step_time:.4g}, memory={self.memory:.3g},"
                f" layers={len(self.layers)})")


def explain(plan: Plan) -> str:
    """Why: per layer the chosen option, its predicted milliseconds (forward, backward on the
    critical path, gradient allreduce, redistribution into it), the bytes the slowest rank
    receives in that redistribution, and the runner-up with how much slower the step would be."""
    rows = [f"{plan.machine.name}, {plan.world_size} ranks, batch {plan.batch}: predicted step "
            f"{plan.step_time * 1e3:.2f} ms (forward {plan.forward_time * 1e3:.2f} ms; the "
            f"search's estimate {plan.search_time * 1e3:.2f} ms), "
            f"{plan.memory / 2**30:.2f} GiB per rank",
            "per layer, as the search sees it (runner-up deltas on its estimate):",
            f"{'layer':28s} {'choice':26s} {'fwd':>7s} {'bwd':>7s} {'allred':>7s} "
            f"{'redist':>7s} {'bytes in':>11s}  runner-up (step +ms)"]
    for lp in plan.layers:
        ms = lambda t: f"{t * 1e3:7.3f}"  # noqa: E731
        ru = f"{lp.runner_up} ({lp.runner_up_delta * 1e3:+.3f})" if lp.runner_up else "-"
        rows.append(f"{lp.conv.name:28s} {str(lp.choice):26s} {ms(lp.cost.forward)} "
                    f"{ms(lp.cost.backward)} {ms(lp.cost.allreduce)} {ms(lp.transition)} "
                    f"{lp.transition_bytes:11,d}  {ru}")
    rows.append(f"skips, entry/exit redistributions and head allreduce: {plan.extra * 1e3:.3f} ms")
    rows.extend(plan.notes)
    return "\n".join(rows)


# ============================================================================ dynamic programming
def _first(item: tuple) -> float:
    return item[0]


class _Model:
    """Cached costs of one (network, world size, machine): layer costs and transitions."""

    def __init__(self, net: Network, world_size: int, machine: Machine, *, max_model: int,
                 algorithms: Sequence[str], itemsize: int, optimizer_slots: int,
                 activation_factor: int, fixed: Mapping[str, Choice] | None = None,
                 max_sample: int | None = None,
                 layouts: Mapping[str, tuple[tuple[str, int], ...]] | None = None) -> None:
        self.net, self.P, self.machine, self.itemsize = net, world_size, machine, itemsize
        self.optimizer_slots = optimizer_slots
        self.activation_factor = activation_factor
        #: the layers a config fixes (the search keeps their choice)
        self.fixed = frozenset(fixed or ())
        self.options = {c.name: [fixed[c.name]] if c.name in self.fixed else layer_candidates(
            c, world_size, max_model=max_model, max_sample=max_sample,
            algorithms=algorithms) for c in net.convs}
        convs = {c.name: c for c in net.convs}
        for name, grid in (layouts or {}).items():  # an 'auto' entry that names its grid
            ch = _layout_choice(convs[name], grid)
            self.options[name] = [ch] if ch is not None else []
        for c in net.convs:
            if not self.options[c.name]:
                what = c.problem or f"{type(c.module).__name__} on {c.in_shape}"
                grid = f" on the grid {dict(layouts[c.name])} its entry names" if c.name in (
                    layouts or {}) else ""
                raise ValueError(
                    f"plan_network: no candidate for {c.name} ({what}){grid} on world_size="
                    f"{world_size} with algorithms={tuple(algorithms)}, max_model={max_model}; "
                    "allow more algorithms or a larger max_model, or a batch >= world_size"
                )
        self.costs = {(c.name, ch): layer_cost(c, ch, machine, itemsize=itemsize,
                                               optimizer_slots=optimizer_slots,
                                               activation_factor=activation_factor)
                      for c in net.convs for ch in self.options[c.name]}
        self.head_params = sum(n for _, n in net.linears)
        self._moves: dict[tuple, tuple[float, int]] = {}
        self._meets: dict[tuple, bool] = {}
        self._blocks: dict[tuple, dict[Any, tuple[float, Any]]] = {}
        self.entry = _sample_value(world_size, len(net.input_shape))
        self.exit = _sample_value(world_size, len(net.out_shape))
        self.picks: list[dict[str, Choice]] = []  # the DP's plans of the last search
        self.base: dict[str, Any] | None = None  # the config planned from, if any

    def move(self, src: Choice, dst: Choice, shape: tuple[int, ...], *,
             to_output: bool = False) -> tuple[float, int]:
        """Forward seconds and bytes of src's output -> dst's input (or output, at an add)."""
        key = (src, dst, shape, to_output)
        if key not in self._moves:
            d = dst.output_dist if to_output else dst.input_dist
            self._moves[key] = _move_time((src.grid, src.output_dist), (dst.grid, d), shape,
                                          self.machine, self.itemsize)
        return self._moves[key]

    def meet(self, main: Choice, skip: Choice, main_first: bool) -> bool:
        """Whether the add's operands meet in the main branch's distribution: the executor's rule
        itself (:func:`~distconv.ops.elementwise.meeting`, ties to the add's first operand)."""
        key = (main, skip, main_first)
        if key not in self._meets:
            a, b = Placement(main.grid, main.output_dist), Placement(skip.grid, skip.output_dist)
            first, second = (a, b) if main_first else (b, a)
            self._meets[key] = meeting(first, second) == a
        return self._meets[key]

    def join(self, main: Choice, skip: Choice, block: Block) -> tuple[float, int, Choice]:
        """Forward seconds, bytes and the resulting distribution of the join, as the executor
        joins: the operands meet where the other reaches with fewer bytes (:meth:`meet`); at a
        cat, among the operands' placements with the channels whole."""
        if block.join == "cat":
            (first, s1), (second, s2) = ((main, block.shapes[0]), (skip, block.shapes[1]))[
                ::1 if block.main_first else -1]

            def whole(c: Any) -> Value:
                entries = list(c.output_dist.entries)
                entries[1] = None
                return Value(c.grid, Dist(tuple(entries), frozenset(), c.output_dist.tensor_dims))

            a, b = whole(first), whole(second)
            out = a if self.meet(a, b, True) else b
            t1, b1 = self.move(first, out, s1, to_output=True)
            t2, b2 = self.move(second, out, s2, to_output=True)
            return t1 + t2, b1 + b2, out
        shape = block.main[-1].out_shape
        if self.meet(main, skip, block.main_first):
            return (*self.move(skip, main, shape, to_output=True), main)
        return (*self.move(main, skip, shape, to_output=True), skip)

    def weight(self, c: ConvNode, ch: Choice, lam: float, mu: float) -> float:
        lc = self.costs[(c.name, ch)]
        return lc.forward + lc.backward + lam * lc.allreduce + mu * lc.memory

    # ---------------------------------------------------------------- the DP
    def run(self, start: Mapping[Any, float], units: Sequence[Unit], lam: float, mu: float
            ) -> list[tuple[Unit, dict[Any, tuple[float, Any]]]]:
        """Per unit of a chain from the states ``start`` (state -> cost so far): the best cost
        to each state after it and how it is reached (a convolution: the state before; a block:
        :meth:`block`'s way through it)."""
        trail: list[tuple[Unit, dict[Any, tuple[float, Any]]]] = []
        cur = dict(start)
        for unit in units:
            table: dict[Any, tuple[float, Any]] = {}
            if isinstance(unit, ConvNode):
                for b in self.options[unit.name]:
                    w = self.weight(unit, b, lam, mu)
                    table[b] = min(((cost + 2 * self.move(a, b, unit.in_shape)[0] + w, a)
                                    for a, cost in cur.items()), key=_first)
            else:
                for a, base in cur.items():
                    for out, (cost, way) in self.block(unit, a, lam, mu).items():
                        if out not in table or base + cost < table[out][0]:
                            table[out] = (base + cost, way)
            trail.append((unit, table))
            cur = {b: v[0] for b, v in table.items()}
        return trail

    def block(self, unit: Block, a: Any, lam: float, mu: float
              ) -> dict[Any, tuple[float, Any]]:
        """From the state ``a`` through ``unit``: per state after the join, the cost and the way
        (``a``, the main branch's trail, the skip's, their end states); cached, as a block nested
        in another's branch is entered from every state of that branch."""
        key = (id(unit), a, lam, mu)
        if key not in self._blocks:
            main = self.run({a: 0.0}, unit.main, lam, mu)
            skip = self.run({a: 0.0}, unit.skip, lam, mu) if unit.skip else None
            ends = skip[-1][1].items() if skip else [(a, (0.0, None))]
            best: dict[Any, tuple[float, Any]] = {}
            for e, (cost, _) in main[-1][1].items():
                for s_end, (sc, _) in ends:
                    t, _, out = self.join(e, s_end, unit)
                    total = cost + sc + 2 * t
                    if out not in best or total < best[out][0]:
                        best[out] = (total, (a, main, skip, s_end, e))
            self._blocks[key] = best
        return self._blocks[key]

    def solve(self, lam: float, mu: float) -> dict[str, Choice]:
        trail = self.run({self.entry: 0.0}, self.net.units, lam, mu)
        if not trail:
            return {}
        state, out_shape = trail[-1][1], self.net.out_shape
        end = min(state, key=lambda e: state[e][0] + 2 * self.move(e, self.exit, out_shape)[0])
        return self._backtrack(trail, end, {})

    def _backtrack(self, trail: list[tuple[Unit, Any]], end: Any,
                   pick: dict[str, Choice]) -> dict[str, Choice]:
        cur = end
        for unit, table in reversed(trail):
            if isinstance(unit, ConvNode):
                pick[unit.name] = cur
                cur = table[cur][1]
                continue
            a, main, skip, s_end, e = table[cur][1]
            self._backtrack(main, e, pick)
            if skip:
                self._backtrack(skip, s_end, pick)
            cur = a
        return pick

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, pick: Mapping[str, Choice]) -> dict[str, Any]:
        """Timeline of one step under ``pick``: forward, then backward on a compute stream with
        gradient allreduces on a communication stream (each starts when its layer's backward is
        done and the previous allreduce has finished)."""
        layers: list[tuple[ConvNode, Choice, float, int]] = []  # conv, choice, move in, bytes
        joins: list[float] = []

        def walk(units: Sequence[Unit], cur: Any) -> Any:
            for unit in units:
                if isinstance(unit, ConvNode):
                    t, b = self.move(cur, pick[unit.name], unit.in_shape)
                    layers.append((unit, pick[unit.name], t, b))
                    cur = pick[unit.name]
                    continue
                main, skip = walk(unit.main, cur), walk(unit.skip, cur)
                t, _, cur = self.join(main, skip, unit)
                joins.append(t)
            return cur

        cur = walk(self.net.units, self.entry)
        extra = sum(joins) + self.move(cur, self.exit, self.net.out_shape)[0]
        forward = extra + sum(self.costs[(c.name, ch)].forward + t for c, ch, t, _ in layers)
        head = 0.0
        if self.head_params:
            from distconv.comm.base import allreduce_bytes

            nbytes = allreduce_bytes(self.head_params, 0, self.P, self.itemsize)
            head = self.machine.collective_time("allreduce", self.P, nbytes,
                                                layout=self.entry.grid, dims=("N",))
        compute, comm = forward + extra, head  # backward starts after the forward
        comm += compute
        busy = 1.0 - getattr(self.machine, "comm_overlap", 1.0)  # as ops.pricing.timeline
        for c, ch, t, _ in reversed(layers):
            lc = self.costs[(c.name, ch)]
            compute += lc.backward + t
            comm = max(comm, compute) + lc.allreduce
            compute += busy * lc.allreduce
        memory = sum(self.costs[(c.name, ch)].memory for c, ch, _, _ in layers)
        memory += self.head_params * self.itemsize * 3
        return {"step": max(compute, comm), "forward": forward, "memory": memory,
                "layers": layers, "extra": 2 * extra + head}


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
    activation_factor: int = 3,
    config: Mapping[str, Any] | None = None,
) -> Plan:
    """Choose every convolution's grid and algorithm for one training step of ``model``.

    Args:
        model: a module (traced by :func:`trace_network` on ``input_shape``) or a traced Network.
        input_shape: the global input ``(batch, channels, height, width)``.
        world_size: ranks P; every layer's grid has P positions.
        machine: a :class:`~distconv.machines.Machine`, a flat ``perfmodel.Machine`` (priced as
            one level), a factory such as ``distconv.machines.lassen`` or a name such as
            ``"lassen"`` (:func:`~distconv.machines.resolve_machine`; TypeError otherwise).
        memory_limit: bytes per rank; default ``machine.memory``.
        max_model: the most ranks a layer's C×F×H×W dims may span. Default 16.
        max_sample: the largest N extent (the paper's number of N rows); default the batch.
        algorithms: the choices allowed. Default all of ``sample, spatial, stationary-x/-y/-w``.
        itemsize: bytes per element (4: fp32). optimizer_slots: optimizer state per parameter
            (1: SGD with momentum). activation_factor: stored copies of each conv's output
            (3: conv, BN, ReLU).
        config: a ``parallelize`` config (a mapping or YAML path) whose ``auto`` entries (or
            ``auto`` default) say which convolutions to choose for -- any of ``Conv1d/2d/3d``
            and ``ConvTranspose1d/2d/3d``; an ``auto`` entry that names a grid chooses among
            that grid's candidates; every other convolution keeps its entry, and
            :meth:`Plan.config` is this config with an exact entry, first, for each chosen
            layer. Default None: choose for every convolution, from scratch.

    Raises:
        ValueError: bad arguments, a bad ``config``, or no plan within ``memory_limit``.
        NotImplementedError: a graph that is not a chain of convolutions and blocks, nested or
            not (:func:`trace_network`, naming the node).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"plan_network: world_size must be an int >= 1, got {world_size!r}")
    machine = resolve_machine(machine, hierarchical=True)
    bad = [a for a in algorithms if a not in ALGORITHMS]
    if bad or not algorithms:
        raise ValueError(f"plan_network: algorithms must be among {ALGORITHMS}, got {algorithms}")
    if isinstance(model, Network):
        net = model
    else:
        if input_shape is None or not 3 <= len(input_shape) <= 5:
            raise ValueError(f"plan_network: input_shape must be (N, C, *spatial) with 1 to 3 "
                             f"spatial dims, got {input_shape}")
        net = trace_network(model, input_shape)
    limit = getattr(machine, "memory", math.inf) if memory_limit is None else memory_limit
    if not limit > 0:
        raise ValueError(f"plan_network: memory_limit must be > 0, got {memory_limit}")
    fixed, layouts, base = None, None, None
    if config is not None:
        from distconv.parallel.config import ParallelConfig

        cfg = ParallelConfig(config, world_size=world_size)
        fixed = _config_choices(net, cfg, world_size, auto=True)
        layouts = {c.name: _canonical(cfg.choice(c.name).layout) for c in net.convs
                   if c.name not in fixed and cfg.choice(c.name).layout is not None}
        base = cfg.to_dict()
    m = _Model(net, world_size, machine, max_model=max_model, algorithms=algorithms,
               itemsize=itemsize, optimizer_slots=optimizer_slots,
               activation_factor=activation_factor, max_sample=max_sample, fixed=fixed,
               layouts=layouts)
    m.base = base
    best = _best(m, 0.0)
    notes = []
    if best[1]["memory"] > limit:
        best = _fit_memory(m, limit)
        notes.append(f"memory limit {limit / 2**30:.2f} GiB per rank is binding")
    pick, ev, lam = best
    pick, ev = _refine(m, pick, ev, limit)
    # the search's finalists, priced by the op handlers: the refined plan, the DP's plan at each
    # allreduce weight, and the uniform plans (one grid and algorithm for every layer) the search
    # puts near its best, pure sample parallelism always among them: the handlers weigh what the
    # search does not see (normalisations, pooling, the head's input); the cheapest that fits is
    # the plan
    finalists = [pick, *m.picks, *_uniform(m, ev["step"])]
    plans: dict[tuple, tuple[Plan, dict[str, Choice]]] = {}
    for p in finalists:
        p = _pipelined(m, p)
        key = tuple(p[c.name] for c in net.convs)
        if key in plans:
            continue
        p_ev = m.evaluate(p)
        if p_ev["memory"] > limit:
            continue
        plans[key] = (_make_plan(m, p, p_ev, net.input_shape[0], list(notes)), p)
        if m.net.model is None:
            break  # no model to price on: the search's plan
    plan, pick = min(plans.values(), key=lambda item: item[0].step_time)
    _runner_ups(m, plan, pick, plan.search_time, limit)
    plan.notes.append(f"allreduce weight in the DP: {lam}; {len(plans)} finalist plan(s) priced "
                      "by the op handlers, the cheapest kept")
    return plan


#: how much dearer than the search's best estimate a uniform plan's may be to be priced
UNIFORM_SLACK = 1.5


def _uniform(m: _Model, best: float) -> list[dict[str, Choice]]:
    """The uniform plans worth pricing: per grid and algorithm that every convolution the search
    chooses for can take, the plan giving it to all of them (the layers a config fixes keep
    theirs); of each algorithm the one the search estimates cheapest, where that is within
    :data:`UNIFORM_SLACK` of ``best`` (its best estimate) -- pure sample parallelism always."""
    convs = [c for c in m.net.convs if c.name not in m.fixed]
    kept = {c.name: m.options[c.name][0] for c in m.net.convs if c.name in m.fixed}
    keys = [{(ch.grid, ch.algorithm): ch for ch in m.options[c.name]} for c in convs]
    common = set(keys[0]).intersection(*keys[1:]) if keys else set()
    cheapest: dict[str, tuple[float, tuple, dict[str, Choice]]] = {}
    for key in sorted(common, key=lambda g: (g[1], g[0])):
        plan = {**kept, **{c.name: k[key] for c, k in zip(convs, keys)}}
        t = m.evaluate(plan)["step"]
        if key[1] not in cheapest or t < cheapest[key[1]][0]:
            cheapest[key[1]] = (t, key, plan)
    return [plan for alg, (t, _, plan) in cheapest.items()
            if alg == "sample" or t <= best * UNIFORM_SLACK]


#: the chunk counts the planner tries for a layer whose collectives pipelining can overlap
PIPELINES = (2, 4, 8)


def _pipelined(m: _Model, pick: Mapping[str, Choice]) -> dict[str, Choice]:
    """Each communicating layer of ``pick`` with the ``pipeline`` its §4 cost is lowest with
    (:func:`~distconv.perfmodel.conv_cost`); pipelining changes no distribution, so it is chosen
    per layer after the search. A choice is kept unless another is 0.1% faster."""
    out = dict(pick)
    for c in m.net.convs:
        best = pick[c.name]
        if not best.communicates or c.name in m.fixed:  # (N-d convolutions are not pipelined)
            continue
        for k in PIPELINES:
            trial = replace(best, pipeline=k)
            if (c.name, trial) not in m.costs:
                m.costs[(c.name, trial)] = layer_cost(
                    c, trial, m.machine, itemsize=m.itemsize, optimizer_slots=m.optimizer_slots,
                    activation_factor=m.activation_factor)
            if m.costs[(c.name, trial)].total < m.costs[(c.name, out[c.name])].total * (1 - 1e-3):
                out[c.name] = trial
    return out


def _best(m: _Model, mu: float) -> tuple[dict[str, Choice], dict[str, Any], float]:
    tried = []
    m.picks = []
    for lam in (0.0, 0.5, 1.0):
        pick = m.solve(lam, mu)
        ev = m.evaluate(pick)
        m.picks.append(pick)
        tried.append((ev["step"] + mu * ev["memory"], lam, pick, ev))
    _, lam, pick, ev = min(tried, key=lambda t: t[0])
    return pick, ev, lam


def _fit_memory(m: _Model, limit: float) -> tuple[dict[str, Choice], dict[str, Any], float]:
    """Bisect the price of memory (seconds per byte) until the DP's plan fits in ``limit``."""
    lo, hi = 0.0, 1e-12
    while True:
        pick, ev, lam = _best(m, hi)
        if ev["memory"] <= limit:
            break
        if hi > 1e3:
            raise ValueError(
                f"plan_network: no plan fits memory_limit={limit:.4g} bytes per rank; the "
                f"smallest found needs {ev['memory']:.4g} (more ranks, a larger max_model or a "
                "smaller batch)"
            )
        lo, hi = hi, hi * 8
    fit = (pick, ev, lam)
    for _ in range(12):
        mid = math.sqrt(lo * hi) if lo else hi / 8
        pick, ev, lam = _best(m, mid)
        if ev["memory"] <= limit:
            hi, fit = mid, (pick, ev, lam)
        else:
            lo = mid
    return fit


def _refine(m: _Model, pick: dict[str, Choice], ev: dict[str, Any], limit: float,
            rounds: int = 3) -> tuple[dict[str, Choice], dict[str, Any]]:
    """Coordinate descent on the timeline: the DP's additive costs cannot see how much of an
    allreduce hides behind backward, so try each layer's other choices with the rest kept."""
    for _ in range(rounds):
        improved = False
        for c in m.net.convs:
            for ch in m.options[c.name]:
                if ch == pick[c.name]:
                    continue
                trial = {**pick, c.name: ch}
                t = m.evaluate(trial)
                if t["memory"] <= limit and t["step"] < ev["step"] * (1 - 1e-9):
                    pick, ev, improved = trial, t, True
        if not improved:
            break
    return pick, ev


def _make_plan(m: _Model, pick: Mapping[str, Choice], ev: dict[str, Any], batch: int,
               notes: list[str], config: Mapping[str, Any] | None = None) -> Plan:
    """The plan, priced by the op handlers: ``explain`` of ``config`` (default: the plan's) on
    the same machine."""
    order = {c.name: i for i, c in enumerate(m.net.convs)}
    layers = sorted(ev["layers"], key=lambda t: order[t[0].name])
    lps = [LayerPlan(c, ch, m.costs[(c.name, ch)], t, b) for c, ch, t, b in layers]
    plan = Plan(m.P, batch, m.machine, lps, ev["extra"], ev["step"], ev["forward"],
                ev["memory"], notes, search_time=ev["step"], base=m.base,
                planned=frozenset(c.name for c in m.net.convs if c.name not in m.fixed))
    if m.net.model is not None:
        plan.explanation = price(m.net.model, config or plan.config(), m.net.input_shape,
                                 world_size=m.P, machine=m.machine, itemsize=m.itemsize,
                                 optimizer_states=m.optimizer_slots)
        tl = plan.explanation.timeline()
        plan.step_time, plan.forward_time = tl.step, tl.forward
    return plan


def price(model: torch.nn.Module, config: Mapping[str, Any], input_shape: Sequence[int], *,
          world_size: int, machine: Machine, itemsize: int, optimizer_states: int) -> Any:
    """``explain`` of ``config`` without its sample-parallel baseline, refusing with the planner's
    name what ``parallelize`` cannot run."""
    from distconv.ops import Unsupported
    from distconv.parallel.config import ParallelConfig
    from distconv.parallel.explain import _explain

    try:
        return _explain(model, ParallelConfig(config, world_size=world_size),
                        tuple(input_shape), machine, optimizer_states, itemsize, 25 << 20,
                        baseline=False)
    except Unsupported as exc:
        raise Unsupported(f"plan_network: the plan puts a layer where parallelize cannot run "
                          f"it ({exc}); the planner chooses for convolutions only, so keep that "
                          "part sample-parallel with a config by hand, or use explain") from exc


def _runner_ups(m: _Model, plan: Plan, pick: Mapping[str, Choice], step: float,
                limit: float) -> None:
    """Per layer, the best other choice with every other layer kept, and its cost in seconds."""
    for lp in plan.layers:
        best: tuple[float, Choice | None] = (math.inf, None)
        for ch in m.options[lp.conv.name]:
            if ch == lp.choice:
                continue
            ev = m.evaluate({**pick, lp.conv.name: ch})
            if ev["memory"] <= limit:
                best = min(best, (ev["step"], ch), key=lambda t: t[0])
        lp.runner_up, lp.runner_up_delta = best[1], best[0] - step


def _config_choices(net: Network, config: Any, world_size: int, *, auto: bool = False
                    ) -> dict[str, Choice]:
    """Each convolution's choice under a ``parallelize`` config (a mapping or a
    :class:`ParallelConfig`), as parallelize matches it (:meth:`ParallelConfig.choice`);
    ``auto``: leave out the layers whose entry says ``auto`` (else they are refused)."""
    from distconv.parallel.config import ParallelConfig

    cfg = config if isinstance(config, ParallelConfig) else ParallelConfig(
        config, world_size=world_size)
    out = {}
    for c in net.convs:
        entry = cfg.choice(c.name)
        if entry.algorithm == "auto" and auto:
            continue
        if entry.layout is None or entry.algorithm == "auto":
            raise ValueError(f"predict: {c.name} takes {entry.source}, whose algorithm 'auto' "
                             "is chosen by parallelize; give it a grid and an algorithm")
        # canonical, as the executor keeps placements: grid dims of extent 1 dropped
        grid = _canonical(entry.layout)
        algorithm = entry.algorithm
        if c.module is not None and entry.source == "default" and algorithm != "spatial":
            # a sample or stationary default runs these sample-parallel on the data grid
            grid, algorithm = _canonical(cfg.data), "sample"
        groups = c.module.groups if c.module is not None else c.problem.groups
        e_ = dict(grid)
        out[c.name] = Choice(grid, algorithm,
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
            itemsize: int = 4, optimizer_slots: int = 1, activation_factor: int = 3) -> Plan:
    """A given ``parallelize`` config (``auto`` is not resolved here) as a :class:`Plan`: priced
    as :func:`plan_network` prices its plans (``step_time`` is ``explain``'s timeline of the
    config on ``machine``; the per-layer table and memory are the search's); ``machine`` as
    there."""
    machine = resolve_machine(machine, hierarchical=True)
    net = model if isinstance(model, Network) else trace_network(model, input_shape or ())
    fixed = _config_choices(net, config, world_size)
    m = _Model(net, world_size, machine, max_model=world_size, algorithms=ALGORITHMS,
               itemsize=itemsize, optimizer_slots=optimizer_slots,
               activation_factor=activation_factor, fixed=fixed)
    ev = m.evaluate(fixed)
    return _make_plan(m, fixed, ev, net.input_shape[0], ["prediction of a given config"],
                      config)
