"""The plan: :func:`plan_network` (the beam's plans, the uniform plans, the descent on the
price) and :func:`predict`, with what the plan reports."""

from __future__ import annotations

import functools
import gc
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from distconv.machines import resolve_machine
from distconv.machines.base import Machine
from distconv.ops import Unsupported
from distconv.ops.conv_nd import refusal
from distconv.pricing.timeline import LayerReport, timeline
from distconv.parallel import cost
from distconv.parallel.config import Layout, ParallelConfig
from distconv.planner.choices import (
    ALGORITHMS, Choice, ConvNode, LayerCost, _phases, _valid, data_grids, grid_algorithm,
    layer_candidates, sample_choice,
)
from distconv.planner.search import Network, _Priced, _Search, _literal, trace_network


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
    #: the layer's other choices the search priced last, each with the step's price with it
    #: instead (every other layer as planned), cheapest first
    alternatives: tuple[tuple[Choice, float], ...] = ()


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
    #: the priced layers (``explain``'s :class:`~distconv.pricing.timeline.LayerReport` list)
    reports: list[LayerReport] = field(default_factory=list, repr=False)
    #: the data grid (the config's ``data``: the input's ``x[o_N,*,...]`` and the output's
    #: grid); None: ``{N: world_size}``
    data: tuple[tuple[str, int], ...] | None = None

    def config(self) -> dict[str, Any]:
        """The plan in the format of ``distconv.parallelize``: sample-parallel default, one
        entry per convolution that differs from it (exact names, in model order) and the data
        grid where it is not the sample grid ``{N: P}``. Planned from a
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
        out: dict[str, Any] = {
            "default": default,
            "layers": [{"match": _literal(lp.conv.name), **lp.choice.config()}
                       for lp in self.layers if lp.choice.config() != default],
        }
        if self.data is not None and dict(self.data) != default["grid"]:
            out["data"] = dict(self.data)
        return out

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
    data = "" if plan.data is None else f", data grid {dict(plan.data)}"
    rows = [f"{plan.machine.name}, {plan.world_size} ranks, batch {plan.batch}{data}: predicted "
            f"step {plan.step_time * 1e3:.2f} ms (forward {plan.forward_time * 1e3:.2f} ms), "
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


def _without_cyclic_gc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run without Python's cyclic garbage collector: a plan's capture and search make
    hundreds of thousands of small objects that live until it ends, and each full collection
    walked them, and everything else the program holds, again (a fifth to a quarter of
    DenseNet-121's plan). Collection resumes after it, as it was; reference counting frees
    everything else as usual."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return run


@_without_cyclic_gc
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
    progress: Callable[[], None] | None = None,
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
        progress: called with no arguments now and then while the search runs (between two
            plans priced, and per node of the beam): ``auto`` on several ranks tells the ranks
            waiting for the plan that the search goes on. Default None.

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
    # planned from scratch, the data grid is chosen too (a given config's is kept: its user
    # feeds the input that way)
    first = net.convs[0].name if config is None and net.convs else None
    search = _Search(net, world_size, machine, options, base, itemsize, optimizer_slots, first)
    search.progress = progress
    notes: list[str] = []
    best = _search(search, 0.0, limit, beam_width)
    if best[2].memory > limit:
        best = _fit_memory(search, limit, beam_width)
    chosen, grid, priced = best
    chosen, priced, runners = _descend(search, chosen, grid, priced, limit)
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


Found = tuple[dict[str, Choice], Layout, _Priced]


def _search(s: _Search, mu: float, limit: float, width: int) -> Found:
    """The cheapest, by the price, of the beam's plans (allreduces weighted 0 and 1), each
    layer's own cheapest choice (:func:`_own_picks`) and the uniform plans; the memory
    multiplier ``mu`` steers the beam."""
    plans: dict[tuple, tuple[dict[str, Choice], Layout]] = {}

    def add(p: dict[str, Choice], data: Layout) -> None:
        plans.setdefault((tuple(sorted(p.items(), key=lambda kv: kv[0])), data), (p, data))

    for lam in (0.0, 1.0):
        for _, p, data in s.beam(lam, mu, width)[:BEAM_PLANS]:
            add(p, data)
    add(_own_picks(s), s.base.data)
    for p in _uniform(s):
        add(p, s.base.data)
    scored = []
    for p, data in plans.values():
        try:
            priced = s.price(p, data)
        except (Unsupported, ValueError):
            continue  # e.g. a uniform plan a layer's placement refuses
        fits = priced.memory <= limit
        scored.append(((not fits, priced.step + mu * priced.memory if fits else priced.memory),
                       p, data, priced))
    if not scored:
        raise ValueError("plan_network: the search found no plan parallelize can run")
    _, p, data, priced = min(scored, key=lambda t: t[0])
    # the plans the descent draws each layer's alternatives from: those near the best
    s.seeds.extend((q, d) for (infeasible, _), q, d, qp in scored
                   if not infeasible and qp.step <= SEED_SLACK * priced.step)
    s.binding = s.binding or min(scored, key=lambda t: t[3].step)[3].memory > limit
    return p, data, priced


def _own_picks(s: _Search) -> dict[str, Choice]:
    """Each layer's cheapest choice priced alone (its own report and gradient allreduce,
    :meth:`_Search.own`; the conversions between layers ignored): how ``auto`` once chose, per
    layer. A starting plan, so the plan is never priced above it."""
    convs = {c.name: c for c in s.net.convs}
    return {name: min(opts, key=lambda ch, c=convs[name]: s.own(c, ch))
            for name, opts in s.options.items()}


def _uniform(s: _Search) -> list[dict[str, Choice]]:
    """Per grid and algorithm some layer the search chooses for can take, the plan giving it to
    every layer that can (the others their first candidate: the sample-parallel one where
    allowed)."""
    keys = [{(ch.grid, ch.algorithm): ch for ch in opts} for opts in s.options.values()]
    every = set().union(*keys) if keys else set()
    return [{n: k.get(key, s.options[n][0]) for n, k in zip(s.options, keys)}
            for key in sorted(every, key=lambda g: (g[1], g[0]))]


def _fit_memory(s: _Search, limit: float, width: int) -> Found:
    """Raise the beam's price of memory (seconds per byte) until its plan fits ``limit``, then
    bisect it down to the cheapest multiplier that still fits."""
    lo, hi = 0.0, 1e-12
    while True:
        p, data, priced = _search(s, hi, limit, width)
        if priced.memory <= limit:
            break
        if hi > 1e3:
            raise ValueError(
                f"plan_network: no plan fits memory_limit={limit:.4g} bytes per rank; the "
                f"smallest found needs {priced.memory:.4g} (more ranks, a larger max_model or a "
                "smaller batch)")
        lo, hi = hi, hi * 8
    fit = (p, data, priced)
    for _ in range(8):
        mid = math.sqrt(lo * hi) if lo else hi / 8
        p, data, priced = _search(s, mid, limit, width)
        if priced.memory <= limit:
            hi = mid
            if priced.step < fit[2].step:
                fit = (p, data, priced)
        else:
            lo = mid
    return fit


def _alternatives(s: _Search, name: str, current: Choice) -> list[Choice]:
    """A layer's other choices the descent tries: what the beam's plans and the uniform plans
    give it (each also pipelined as the current one is, where it moves data), and its current
    one pipelined where that layer moves data pipelining can overlap."""
    out = [p[name] for p, _ in s.seeds if p[name] != current]
    if current.pipeline > 1:
        out += [replace(ch, pipeline=current.pipeline) for ch in out if ch.communicates]
    if current.communicates:
        out += [replace(current, pipeline=k) for k in PIPELINES if k != current.pipeline]
    if current.pipeline > 1:
        out.append(replace(current, pipeline=1))
    return list(dict.fromkeys(out))


def _descend(s: _Search, chosen: dict[str, Choice], data: Layout, priced: _Priced,
             limit: float, rounds: int = 8
             ) -> tuple[dict[str, Choice], _Priced, dict[str, list[tuple[Choice, float]]]]:
    """Coordinate descent on the price, until a round changes nothing: each group of layers
    (:func:`_groups`) given one grid and algorithm at once, then each layer's alternatives with
    the rest kept (the first layer's also with the data grid moved onto it), then the data
    grid's, taken where the step is cheaper; the last round's alternatives per layer with the
    step's price under each, cheapest (the runner-up) first. The data grid is the returned
    price's (``_Priced.analysis.data``)."""
    runners: dict[str, list[tuple[Choice, float]]] = {}
    first = s.first
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
                    trial = s.price({**chosen, **moved}, data)
                except (Unsupported, ValueError):
                    continue
                if trial.memory <= limit and trial.step < priced.step * (1 - 1e-9):
                    chosen, priced, improved = {**chosen, **moved}, trial, True
        runners = {}
        for name in s.options:
            others: list[tuple[Choice, float]] = []
            for ch in _alternatives(s, name, chosen[name]):
                # the first layer's choice with each data grid it admits (the batch read onto
                # its grid: a move no single change makes where the input's conversion is what
                # it costs)
                grids = [data] + (data_grids(ch, s.P) if name == first else [])
                for grid in dict.fromkeys(grids):
                    try:
                        trial = s.price({**chosen, name: ch}, grid)
                    except (Unsupported, ValueError):
                        continue
                    if trial.memory > limit:
                        s.binding = s.binding or trial.step < priced.step
                        continue
                    if trial.step < priced.step * (1 - 1e-9):
                        others = [(chosen[name], priced.step)]  # those priced so far, against it
                        chosen, data, priced, improved = {**chosen, name: ch}, grid, trial, True
                        break
                    others.append((ch, trial.step))
            runners[name] = _cheapest_each(others)
        for grid in _data_alternatives(s, chosen, data, first):
            try:
                trial = s.price(chosen, grid)
            except (Unsupported, ValueError):
                continue
            if trial.memory <= limit and trial.step < priced.step * (1 - 1e-9):
                data, priced, improved = grid, trial, True
        if not improved:
            break
    return chosen, priced, runners


def _cheapest_each(priced: list[tuple[Choice, float]]) -> list[tuple[Choice, float]]:
    """Each choice once, at the least price it was priced at, cheapest first."""
    best: dict[Choice, float] = {}
    for ch, t in priced:
        best[ch] = min(t, best.get(ch, math.inf))
    return sorted(best.items(), key=lambda t: t[1])


def _data_alternatives(s: _Search, chosen: Mapping[str, Choice], data: Layout,
                       first: str | None) -> list[Layout]:
    """The data grids the descent tries besides ``data``: those the first layer's choice admits
    (:func:`~distconv.planner.choices.data_grids`)."""
    grids = data_grids(chosen[first], s.P) if first in chosen else []
    return [g for g in grids if g != data]


def _groups(s: _Search) -> list[list[str]]:
    """The layers the search chooses for, grouped by the model's top-level module (a ResNet's
    stage, a U-Net's level), where a group holds more than one."""
    groups: dict[str, list[str]] = {}
    for name in s.options:
        groups.setdefault(name.split(".")[0], []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def _make_plan(s: _Search, chosen: Mapping[str, Choice], priced: _Priced,
               runners: Mapping[str, list[tuple[Choice, float]]], notes: list[str],
               base: dict[str, Any] | None, planned: frozenset[str]) -> Plan:
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
        others = tuple(runners.get(c.name, ()))
        ru, at = others[0] if others else (None, math.inf)
        lps.append(LayerPlan(c, chosen[c.name], lc, sum(st.seconds(s.machine) for st in into),
                             max((sum(st.bytes[r] for st in into) for r in every), default=0),
                             ru, at - t.step, others))
    plan = Plan(s.P, s.net.input_shape[0], s.machine, lps, t.step - own, t.step, t.forward,
                memory, notes, priced=s.visited, base=base, planned=planned, reports=layers,
                data=priced.analysis.data)
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
    algorithm = grid_algorithm(grid)
    if c.module is not None:
        if refusal(c.module, grid, algorithm, c.in_shape) is not None:
            return None
        e = dict(grid)
        return Choice(grid, algorithm,
                      groups_aligned=c.module.groups > 1 and e.get("C", 1) * e.get("F", 1) > 1,
                      spatial=c.spatial, transposed=c.transposed)
    if {d for d, _ in grid} - {"N", "C", "F", "H", "W"}:
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
