"""The planner's search: the network traced once, the price of plans by the op handlers cached
per node and placement, the beam over the topological order and the exact price of a plan."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import TensorMetadata

from distconv.machines.base import Machine
from distconv.ops import Unsupported
from distconv.pricing.timeline import LayerReport, largest_block, timeline
from distconv.parallel import cost
from distconv.parallel.config import LayerChoice, Layout, ParallelConfig
from distconv.parallel.graph import _Analyser, aliased, analyse, operand_need, trace
from distconv.parallel.placement import Placement, evaluated_ranks
from distconv.parallel.shapes import check_input_shape, propagate_shapes
from distconv.parallel.steps import Analysis, Step
from distconv.planner.choices import (
    Choice, ConvNode, _allreduce, _phases, _problem, data_grids, layer_cost,
)


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
    return graph_network(trace(model, input_shape), input_shape, model)


def graph_network(gm: fx.GraphModule, input_shape: Sequence[int],
                  model: torch.nn.Module | None = None) -> Network:
    """The Network of a graph :func:`~distconv.parallel.capture.trace` captured (on the meta
    device; ``parallelize`` plans the graph it traced), as :func:`trace_network` makes it."""
    input_shape = tuple(int(s) for s in input_shape)
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
    return Network(input_shape, tuple(convs.values()), gm, shapes,
                   gm if model is None else model)


#: the convolutions the planner chooses for
_CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose1d,
          torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)


# ============================================================================ the search
#: whether the search keeps what it has priced (steps, reports, plans) to price again: the
#: plans and prices are the same either way (a switch for the tests that show it)
MEMO = True


class _View:
    """A config as the search sees it: the layers it has chosen for take their choice; the
    others their entry in the config planned from (a convolution still to be chosen, the first
    of its candidates); the data grid the plan's. Everything else is the config's."""

    def __init__(self, base: ParallelConfig, entry: Any, first: Mapping[str, Choice]) -> None:
        self.base, self.entry, self.first = base, entry, first
        self.chosen: Mapping[str, Choice] = {}
        #: the grid the model's input and output samples live on: the plan's (a choice too)
        self.data: Layout = base.data

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
    a beam over the topological order and the exact price of a whole plan. A plan is each
    chosen layer's :class:`Choice` and the data grid (the input's distribution): the config's,
    or with ``first`` (the first convolution, one the search chooses for) any of
    :func:`~distconv.planner.choices.data_grids` of that layer's choice."""

    def __init__(self, net: Network, P: int, machine: Machine, options: Mapping[str, list[Choice]],
                 base: Mapping[str, Any], itemsize: int, optimizer_states: int,
                 first: str | None = None, memo: bool | None = None) -> None:
        self.net, self.P, self.machine, self.options = net, P, machine, options
        self.memo = MEMO if memo is None else memo
        self.itemsize, self.optimizer_states = itemsize, optimizer_states
        self.raw = dict(base)
        self.base = ParallelConfig(self.raw, world_size=P)
        self.first = first if first in options else None
        self.data = list(dict.fromkeys([self.base.data] + [
            g for ch in options.get(first, []) for g in data_grids(ch, P)]))

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
        #: each node's checkpointed segment (the config's, the same in every plan)
        self.segment = {st.node: st.segment for st in reference.steps}
        #: whether a gradient flows back into each node's inputs (the same in every plan)
        self._grad_in: dict[Any, bool] = {}
        for st in reference.steps:
            n = st.node
            owns = n.op == "call_module" and any(True for _ in self.modules[n.target].parameters())
            self.grad[n.name] = owns or any(self.grad.get(a.name, False) for a in st.needs)
            self.ndim[n] = st.out.ndim if st.out is not None else None
            self._grad_in[n] = any(self.grad.get(a.name, False) for a in st.needs)
        self._reports: dict[tuple, LayerReport] = {}
        self._moves: dict[tuple, LayerReport] = {}
        self._steps: dict[tuple, Step | None] = {}
        self._seconds: dict[int, tuple[LayerReport, float, float, float]] = {}
        self._grads: dict[tuple, float] = {}
        self._own: dict[tuple, float] = {}
        # the exact price's walk: each node's step per the placements of its inputs, the data
        # grid and the choices its handler reads (its own; a convolution's also those of the
        # convolutions reading its input, which decide whether it takes that input gathered)
        self._inputs = {n: tuple(n.all_input_nodes) for n in self.order}
        self.reads = {n: tuple(sorted({self.decides[m] for m in (n, *(
            u for a in n.all_input_nodes for u in a.users)) if m in self.decides}))
            for n in self.order}
        self._placed: dict[tuple, Step | Exception] = {}
        self._canon: dict[tuple, Placement] = {}
        self._of_step: dict[int, tuple[Step, LayerReport]] = {}  # a placed step's own report
        self._walker = _Analyser(self.gm, aliased(self.view, self.gm),  # type: ignore[arg-type]
                                 len(net.input_shape))
        self._priced: dict[tuple, _Priced | Exception] = {}
        self._groups: dict[tuple, Any] = {}  # the gradient buckets' parts
        self._step_seconds: dict[int, tuple[Any, ...]] = {}  # a layer's seconds, on the machine
        self._records: dict[int, tuple] = {}  # what is kept per placed step (_price)
        self.visited = 0  # plans priced exactly
        #: called now and then while the search runs (``plan_network``'s ``progress``)
        self.progress: Any = None
        self.binding = False  # whether a cheaper plan did not fit the memory limit
        #: the plans the descent draws its alternatives from (choices and data grid)
        self.seeds: list[tuple[dict[str, Choice], Layout]] = []

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
        mine = self._of_step.get(id(step))
        if mine is not None and mine[0] is step:  # (a step the exact price's walk placed)
            base = mine[1]
        else:
            key = (step.node, step.out, step.layer, tuple(step.needs.items()), grad_in)
            base = self._reports.get(key)
        if base is None:
            layouts = [p.layout for p in (step.out, *step.needs.values()) if p is not None]
            if step.layer is not None:
                layouts.append(step.layer.layout)
            base = cost.price_step(step, [], self.modules, self.shapes, self.itemsize, self.P,
                                   self.ranks(layouts), grad_in, self.grad, self.machine)
            self._reports[key] = base
        if mine is None and self.memo and step.node in self._grad_in:
            self._of_step[id(step)] = (step, base)
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
        return _with_steps(parts[0], steps)

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
        key = (step.node.target, step.layer, step.out, self.view.data)
        if key not in self._grads:
            module = self.modules[step.node.target]
            dists = step.handler.param_dists(step, module)
            layout = step.layer.layout
            params = []
            for leaf, p in module.named_parameters(recurse=False):
                dist = None if dists is None else dists.get(leaf)
                if dist is None:  # replicated everywhere: summed over every rank
                    params.append((p.numel(), tuple(d for d, _ in self.view.data)))
                    continue
                placed = Placement(layout, dist)
                dims = tuple(d for d, e in layout if e > 1 and d not in placed.dist.used())
                params.append((largest_block(placed, tuple(p.shape)), dims))
            grid = layout if dists is not None else self.view.data
            self._grads[key] = _allreduce(params, grid, self.machine, self.itemsize)
        return self._grads[key]

    def admits(self, chosen: Mapping[str, Choice], data: Layout) -> bool:
        """Whether a plan may read its input on ``data`` (the config's data grid, or one of
        :func:`~distconv.planner.choices.data_grids` of the first layer's choice)."""
        return data == self.base.data or (
            self.first in chosen and data in data_grids(chosen[self.first], self.P))

    def own(self, conv: ConvNode, ch: Choice) -> float:
        """Seconds of ``conv`` alone under ``ch``: its report's forward and backward and its
        gradient allreduce (:func:`~distconv.planner.choices.layer_cost`), cached per layer
        shape (a ResNet's blocks repeat theirs)."""
        if self.progress is not None:
            self.progress()
        shape = (conv.problem, conv.in_shape, conv.out_shape,
                 None if conv.module is None else (type(conv.module), repr(conv.module)), ch)
        if shape not in self._own:
            self._own[shape] = layer_cost(conv, ch, self.machine, itemsize=self.itemsize,
                                          optimizer_slots=self.optimizer_states).total
        return self._own[shape]

    # ---------------------------------------------------------------- the beam
    def beam(self, lam: float, mu: float, width: int
             ) -> list[tuple[float, dict[str, Choice], Layout]]:
        """The plans of the ``width`` cheapest frontiers after the last node, cheapest first,
        each with its score (the parts' seconds, ``lam`` times the gradient allreduces and
        ``mu`` times the bytes). Every data grid starts a state; none is dropped before the
        first chosen layer has priced the conversion from it; of the states that reach one
        frontier, the cheapest goes on."""
        walker = _Analyser(self.gm, self.view, len(self.net.input_shape))  # type: ignore[arg-type]
        walker.ndim = self.ndim
        # (score, frontier: value -> its step, chosen, conversions made, data grid)
        State = tuple[float, dict[Any, Step], dict[str, Choice], frozenset, Layout]
        states: list[State] = [(0.0, {}, {}, frozenset(), d) for d in self.data]
        keep: int | None = None  # all of them until a layer has chosen
        for i, node in enumerate(self.order):
            if self.progress is not None:
                self.progress()
            name = self.decides.get(node)
            merged: dict[tuple, State] = {}
            for score, live, chosen, done, data in states:
                self.view.data = data
                opts = ([chosen[name]] if name in chosen else self.options[name]) if name else [None]
                for ch in opts:
                    picked = chosen if ch is None or name in chosen else {**chosen, name: ch}
                    if name is not None and name == self.first and not self.admits(picked, data):
                        continue
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
                    key = (tuple((n, s.out) for n, s in after.items()), kept, data)
                    if key not in merged or score + add < merged[key][0]:
                        merged[key] = (score + add, after, picked, kept, data)
            if not merged:
                raise ValueError(f"plan_network: no candidate of {name!r} can take its input "
                                 "in any plan the search kept")
            if name is not None:
                keep = width
            states = sorted(merged.values(), key=lambda s: s[0])[:keep]
        return [(s[0], s[2], s[4]) for s in states]

    def _visit(self, walker: Any, node: Any, live: Mapping[Any, Step],
               picked: Mapping[str, Choice], ch: Choice | None) -> Step | None:
        """The node's step by its handler where its inputs are (the one walk's), cached per
        node, input placements and choice; None where the handler refuses the choice there."""
        args = tuple((a, live[a].out) for a in node.all_input_nodes if a in live)
        key = (node, args, ch, self.view.data)
        if key not in self._steps:
            self.view.chosen = picked
            walker.out = {n: s.out for n, s in live.items()}
            try:
                self._steps[key] = walker.visit(node)
            except (Unsupported, ValueError):
                self._steps[key] = None
        return self._steps[key]

    # ---------------------------------------------------------------- the price
    def price(self, chosen: Mapping[str, Choice], data: Layout | None = None) -> _Priced:
        """The plan's price: ``explain``'s layers of its config (with ``data``, default the
        config's data grid), priced incrementally; a plan priced before is not priced again
        (its price, or the refusal it met, is kept)."""
        if self.progress is not None:
            self.progress()
        data = self.base.data if data is None else data
        if not self.admits(chosen, data):
            raise ValueError(f"plan_network: no plan reads its input on {dict(data)} with its "
                             "first layer's choice")
        if not self.memo:
            return self._price(chosen, data)
        key = (frozenset({**self.view.first, **chosen}.items()), data)
        got = self._priced.get(key)
        if got is None:
            try:
                got = self._price(chosen, data)
            except (Unsupported, ValueError) as exc:
                got = exc
            self._priced[key] = got
        if isinstance(got, Exception):
            raise got
        return got

    def analysis(self, chosen: Mapping[str, Choice], data: Layout) -> Analysis:
        """The analysis of the plan's config, as :func:`~distconv.parallel.graph.analyse` gives
        it: the one walk, each node's step taken from the steps already placed where its
        handler reads the same (:attr:`reads`: its inputs' placements, the data grid, the
        choices it reads); a node placed anew is placed by its handler."""
        self.view.chosen = chosen
        self.view.data = data
        if not self.memo:
            return analyse(self.gm, self.view, input_ndim=len(self.net.input_shape))  # type: ignore[arg-type]
        walker = self._walker
        walker.out, walker.steps = out, steps = {}, []
        walker.__dict__.pop("_unit_dims", None)  # (a memo of the walk's own: made anew)
        choice = {**self.view.first, **chosen}
        canon, placed, reads, inputs = self._canon, self._placed, self.reads, self._inputs
        for node in self.order:
            # (placements by identity: each placed value's placement is kept once, canonical)
            key = (node, tuple([id(out.get(a)) for a in inputs[node]]),
                   tuple([choice[n] for n in reads[node]]), data)
            step = placed.get(key)
            if step is None:
                try:
                    step = walker.visit(node)
                    step.segment = self.segment.get(node)
                    if step.out is not None:  # (one object per placement and its dims' names)
                        step.out = canon.setdefault((step.out, step.out.dist.tensor_dims),
                                                    step.out)
                except (Unsupported, ValueError) as exc:
                    step = exc
                placed[key] = step
            if isinstance(step, Exception):
                raise step
            out[node] = step.out
            steps.append(step)
        return Analysis(self.gm, list(steps), data)

    def _candidates(self, step: Step, analysis: Analysis) -> list[tuple[tuple, cost.Move]]:
        """The conversions ``step`` makes of its operands where no earlier step made them
        (:func:`~distconv.parallel.cost.conversions`' keys and moves)."""
        out = []
        for a in step.needs:
            need = operand_need(step, a, self.shapes)
            src_step = analysis.step(a)
            inside = step.segment is not None and src_step.segment == step.segment
            if src_step.out != need:
                out.append(((a.name, need, step.segment if inside else None),
                            (a, src_step.out, need, inside)))
        return out

    def _price(self, chosen: Mapping[str, Choice], data: Layout) -> _Priced:
        self.visited += 1
        analysis = self.analysis(chosen, data)
        layers = [cost.entry_report(analysis, self.net.input_shape, self.P, [0])]
        done: set = set()
        records, layouts = self._records, {analysis.data}
        for step in analysis.steps[1:]:
            # what is kept of a placed step (it belongs to one set of input placements): the
            # conversions it may make, the grids it touches, and its report per the conversions
            # it makes (those no earlier step of the plan made of the same value)
            rec = records.get(id(step))
            if rec is None or rec[0] is not step:
                rec = records[id(step)] = (
                    step, self._candidates(step, analysis) if step.needs else (),
                    frozenset(p.layout for p in [step.out, *step.needs.values()]
                              if p is not None), {})
            taken, moves = 0, []
            for bit, (key, move) in enumerate(rec[1]):
                if key not in done:
                    done.add(key)
                    moves.append(move)
                    taken |= 1 << bit
            got = rec[3].get(taken)
            if got is None:
                rep = self.report(step, moves, self._grad_in[step.node])
                got = rec[3][taken] = (rep, cost.kept(rep), _running(rep))
            rep, listed, running = got
            if listed:
                # coalescing takes the running statistics out of a report's steps: a copy
                layers.append(_with_steps(rep, list(rep.steps)) if running else rep)
            layouts |= rec[2]
        running = cost.coalesced_running(layers)
        if running is not None:
            layers.append(running)
        # (the buckets differ with every layer's placement: no two plans share them; their
        # groups' parts are kept across plans)
        corners = self.ranks(sorted(layouts))
        sync = cost.gradient_buckets(self.gm, analysis, self.P, corners, self.itemsize, 25 << 20,
                                     cache=self._groups if self.memo else None)
        if sync is not None:
            layers.append(sync)
        t = timeline(layers, self.machine, cache=self._step_seconds)
        mem = sum(cost.memory(layers, self.itemsize, self.optimizer_states).values())
        return _Priced(t.step, t.forward, float(mem), layers, analysis)


def _with_steps(report: LayerReport, steps: list) -> LayerReport:
    """``dataclasses.replace(report, steps=steps)``, made as a shallow copy of its fields (many
    a plan needs one)."""
    new = object.__new__(type(report))
    new.__dict__.update(report.__dict__)
    new.steps = steps
    return new


def _running(report: LayerReport) -> bool:
    """Whether a report holds a running-statistics broadcast (which coalescing moves out)."""
    return any(st.op == "broadcast" and st.what.startswith("running statistics")
               for st in report.steps)


def _layouts_of(analysis: Any) -> set:
    """Every grid a value of the analysis lives on."""
    out = {analysis.data}
    for st in analysis.steps:
        out.update(p.layout for p in [st.out, *st.needs.values()] if p is not None)
    return out


def _literal(name: str) -> str:
    """A module name as a config pattern that matches it alone (``[`` escaped)."""
    return name.replace("[", "[[]")

