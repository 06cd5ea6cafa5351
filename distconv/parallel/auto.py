"""``algorithm: auto``: the layers a config marks ``auto`` are chosen together, by the planner's
whole-network search (:func:`distconv.planner.plan_network` with ``config=``).

Every convolution (``Conv1d/2d/3d``, ``ConvTranspose1d/2d/3d``) that an ``auto`` default or an
``auto`` layer entry reaches is a free choice of the search; an ``auto`` entry that names a grid
chooses the algorithm that grid runs (``C`` and ``F``: stationary-w, ``C``: stationary-x, ``F``:
stationary-y, a spatial dim: spatial, ``N`` alone: sample). Every other layer keeps its entry.
The search returns the plan of least price by the very price :func:`distconv.explain` reports
for its config -- every node's report by its op handler, the conversions between the layers'
placements, the gradient buckets, on one timeline (:mod:`distconv.parallel.cost`) -- on the
given machine, within its memory per rank. The resolved config is the given one with an exact
entry, first, for each chosen layer; an ``auto`` default that then reaches Linear layers only
runs them sample-parallel on the data grid.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from distconv.machines import resolve_machine
from distconv.ops import Unsupported
from distconv.ops.conv_nd import refusal
from distconv.parallel.config import ParallelConfig
from distconv.planner import Network, Plan, graph_network, grid_algorithm, plan_network

__all__ = ["AutoChoice", "resolve_auto", "resolve_auto_once"]


@dataclass(frozen=True)
class AutoChoice:
    """One ``auto`` layer's decision: ``candidates`` are ``(grid, algorithm, seconds)``, the
    chosen one first, then the other choices the search priced last, cheapest first; ``seconds``
    is the predicted training step with the layer on that choice and every other layer as
    planned (``explain``'s price of the resolved config, for the first). ``pipeline``: the chunks
    of samples the chosen one pipelines its collectives over (1: not; the others are unpipelined)."""

    name: str
    candidates: tuple[tuple[dict[str, int], str, float], ...]
    pipeline: int = 1

    @property
    def chosen(self) -> tuple[dict[str, int], str, float]:
        return self.candidates[0]

    def describe(self, limit: int = 4) -> str:
        shown = [f"{alg} {grid} {t * 1e3:.3f} ms" for grid, alg, t in self.candidates[:limit]]
        if self.pipeline > 1:
            grid, alg, t = self.chosen
            shown[0] = f"{alg} {grid} pipeline {self.pipeline} {t * 1e3:.3f} ms"
        more = len(self.candidates) - limit
        return f"auto: {', '.join(shown)}" + (f" (+{more} more)" if more > 0 else "")


def resolve_auto(gm: fx.GraphModule, config: ParallelConfig, input_shape: Sequence[int],
                 machine: Any, *, itemsize: int | None = None, strict: bool = True,
                 progress: Callable[[], None] | None = None
                 ) -> tuple[ParallelConfig, dict[str, AutoChoice]]:
    """A config in which every ``auto`` convolution has its own exact entry, and the decisions.

    ``gm``: the graph :func:`~distconv.parallel.capture.trace` captured (not traced again).
    ``machine``: any form :func:`distconv.machines.resolve_machine` takes (a flat or a
    hierarchical machine, a factory such as ``distconv.machines.lassen``, a name such as
    ``"lassen"``); anything else is a TypeError. ``itemsize``: bytes per element; default the
    model's parameter dtype (as ``explain``). An ``input_shape`` the model cannot take is a
    ValueError naming it (:func:`distconv.parallel.shapes.check_input_shape`); so is an ``auto``
    entry naming a grid its layer cannot run, or no plan within the machine's memory. A node no
    op handler runs raises :class:`~distconv.ops.Unsupported`; with ``strict=False`` (explain's
    coverage table) the config comes back with its ``auto`` entries sample-parallel instead, and
    no decisions: the search prices only graphs ``parallelize`` runs. ``progress``: called now
    and then while the search runs (:func:`~distconv.planner.plan_network`'s); default None."""
    machine = resolve_machine(machine)
    if itemsize is None:
        ref = next((p for p in gm.parameters() if p.is_floating_point()), None)
        itemsize = 4 if ref is None else ref.element_size()
    try:
        net = graph_network(copy.deepcopy(gm).to("meta"), input_shape)
    except Unsupported:
        if strict:
            raise
        return _sample_parallel(config), {}
    if progress is not None:
        progress()
    planned = [c for c in net.convs if config.choice(c.name).algorithm == "auto"]
    if not planned:
        return config, {}
    _check_grids(net, config)
    plan = plan_network(net, world_size=config.world_size, machine=machine,
                        itemsize=itemsize, config=config.to_dict(), progress=progress)
    return ParallelConfig(plan.config(), world_size=config.world_size), _decisions(plan)


def _sample_parallel(config: ParallelConfig) -> ParallelConfig:
    """The config with each ``auto`` entry (and default) sample-parallel over every rank."""
    sample = {"grid": {"N": config.world_size}, "algorithm": "sample"}

    def settled(entry: dict[str, Any]) -> dict[str, Any]:
        if entry.get("algorithm") != "auto":
            return entry
        return {**{k: v for k, v in entry.items() if k not in ("grid", "pipeline")}, **sample}

    raw = config.to_dict()
    if "default" in raw:
        raw["default"] = settled(raw["default"])
    raw["layers"] = [settled(e) for e in raw.get("layers", [])]
    return ParallelConfig(raw, world_size=config.world_size)


def _check_grids(net: Network, config: ParallelConfig) -> None:
    """Refuse an ``auto`` entry whose grid its ``Conv1d``, ``Conv3d`` or transposed layer
    cannot run, naming the layer, the grid and why (the op handler's refusal)."""
    for c in net.convs:
        choice = config.choice(c.name)
        if c.module is None or choice.algorithm != "auto" or choice.layout is None:
            continue
        why = refusal(c.module, choice.layout, grid_algorithm(choice.layout), c.in_shape)
        if why is not None:
            raise ValueError(f"{choice.source}: layer {c.name!r} ({type(c.module).__name__}) "
                             f"cannot run on {dict(choice.layout)}: {why}")


def _decisions(plan: Plan) -> dict[str, AutoChoice]:
    """Each planned layer's choice at the plan's price, then its alternatives at theirs."""
    out = {}
    for lp in plan.layers:
        if lp.conv.name not in plan.planned:
            continue
        rows = [(dict(lp.choice.grid), lp.choice.algorithm, plan.step_time)]
        rows += [(dict(ch.grid), ch.algorithm, t) for ch, t in lp.alternatives
                 if ch.pipeline == 1]
        out[lp.conv.name] = AutoChoice(lp.conv.name, tuple(rows), lp.choice.pipeline)
    return out


#: the errors a rank other than the one that searched raises as that one raised them
_ERRORS = {e.__name__: e for e in (ValueError, TypeError, NotImplementedError, Unsupported)}
#: the tag of rank 0's messages to the waiting ranks (heartbeats, then the outcome)
_TAG = 0x4155
#: a message's kinds: rank 0 is still searching; the outcome's length follows
_SEARCHING, _DONE = 0, 1


def resolve_auto_once(comm: Any, gm: fx.GraphModule, config: ParallelConfig,
                      input_shape: Sequence[int], machine: Any
                      ) -> tuple[ParallelConfig, dict[str, AutoChoice]]:
    """:func:`resolve_auto` on rank 0 of ``comm`` and its result on every rank (collective): every
    rank runs the same config, and one search serves them all (thread ranks, sharing one
    interpreter, would each search in turn). An error rank 0 meets is raised on every rank.

    While rank 0 searches, the other ranks wait for its messages: rank 0 tells them that it
    still searches at least every quarter of the communicator's timeout (from inside the
    search), and then sends the outcome. So a search longer than the timeout ends no job,
    while a rank 0 that died is still noticed within one timeout (each wait is one receive,
    bounded by it)."""
    if comm.size == 1:
        return resolve_auto(gm, config, input_shape, machine)
    host = comm.host  # (collective where it is made: before rank 0 searches)
    if comm.rank == 0:
        beat = _Heartbeat(host)
        failure, text = None, ""
        try:
            cfg, decisions = resolve_auto(gm, config, input_shape, machine, progress=beat)
            text = json.dumps({"config": cfg.to_dict(), "decisions": [
                [d.name, d.candidates, d.pipeline] for d in decisions.values()]})
        except Exception as exc:  # noqa: BLE001 -- raised below; the other ranks must not wait
            failure, text = exc, json.dumps({"raised": type(exc).__name__, "message": str(exc)})
        beat.send(text)
        if failure is not None:
            raise failure
    else:
        text = _wait_for_root(host)
    got = json.loads(text)
    if "raised" in got:
        raise _ERRORS.get(got["raised"], RuntimeError)(got["message"])
    decisions = {name: AutoChoice(name, tuple((dict(g), a, t) for g, a, t in rows), pipeline)
                 for name, rows, pipeline in got["decisions"]}
    return ParallelConfig(got["config"], world_size=config.world_size), decisions


class _Heartbeat:
    """Rank 0's messages to the waiting ranks: called now and then by the search, it tells them
    it still searches once a quarter of the communicator's timeout has passed since the last
    message; :meth:`send` sends the outcome."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.every = comm.timeout / 4
        self.last = time.monotonic()
        self.sent: list[Any] = []

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self.last >= self.every:
            self._post(torch.tensor([_SEARCHING, 0], dtype=torch.int64))
            self.last = now

    def _post(self, t: torch.Tensor) -> None:
        for r in range(1, self.comm.size):
            self.sent.append(self.comm.isend(t, dst=r, tag=_TAG))

    def send(self, text: str) -> None:
        data = text.encode()
        self._post(torch.tensor([_DONE, len(data)], dtype=torch.int64))
        if data:
            self._post(torch.tensor(list(data), dtype=torch.uint8))
        for work in self.sent:
            work.wait()
        self.sent = []


def _wait_for_root(comm: Any) -> str:
    """Rank 0's outcome, its heartbeats skipped: each wait is one receive, bounded by the
    communicator's timeout (rank 0 sends at least every quarter of it while it searches)."""
    while True:
        kind, n = (int(v) for v in comm.recv((2,), torch.int64, src=0, tag=_TAG).tolist())
        if kind == _DONE:
            break
    if not n:
        return ""
    return bytes(comm.recv((n,), torch.uint8, src=0, tag=_TAG).tolist()).decode()
