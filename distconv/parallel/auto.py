"""``algorithm: auto``: each such convolution gets the grid and algorithm the §4 model predicts
fastest for its own global problem (:func:`distconv.perfmodel.conv_cost`, forward plus backward,
slowest rank), among the layer's valid candidates (:func:`distconv.planner.candidates`; with a
grid given, the algorithms that grid can run). The choice is per layer: redistributions between
layers are not weighed here -- :func:`distconv.planner.plan_network` plans a whole network with
them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Sequence

import torch.fx as fx
from torch import nn

from distconv.machines import resolve_machine
from distconv.parallel.config import LayerChoice, ParallelConfig
from distconv.parallel.shapes import propagate_shapes
from distconv.perfmodel import ConvProblem, conv_cost

__all__ = ["AutoChoice", "resolve_auto"]


@dataclass(frozen=True)
class AutoChoice:
    """The candidates of one ``auto`` layer with their predicted seconds, fastest first."""

    name: str
    candidates: tuple[tuple[dict[str, int], str, float], ...]

    @property
    def chosen(self) -> tuple[dict[str, int], str, float]:
        return self.candidates[0]

    def describe(self, limit: int = 4) -> str:
        shown = ", ".join(f"{alg} {grid} {t * 1e3:.3f} ms"
                          for grid, alg, t in self.candidates[:limit])
        more = len(self.candidates) - limit
        return f"auto: {shown}" + (f" (+{more} more)" if more > 0 else "")


def _problem(conv: nn.Conv2d, shape: Sequence[int]) -> ConvProblem:
    return ConvProblem(shape[0], conv.in_channels, conv.out_channels, shape[2], shape[3],
                       conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.groups,
                       conv.bias is not None, conv.padding_mode)


def _options(problem: ConvProblem, choice: LayerChoice, world_size: int) -> list[tuple[Any, str]]:
    from distconv.planner import candidates

    if choice.layout is None:
        return [(c.grid, c.algorithm) for c in candidates(problem, world_size)]
    live = {n for n, e in choice.layout if e > 1}
    c, f = "C" in live, "F" in live
    algorithm = ("stationary-w" if c and f else "stationary-x" if c else "stationary-y" if f
                 else "spatial" if live & {"H", "W"} else "sample")
    return [(choice.layout, algorithm)]


def resolve_auto(gm: fx.GraphModule, config: ParallelConfig, input_shape: Sequence[int],
                 machine: Any, *, itemsize: int = 4
                 ) -> tuple[ParallelConfig, dict[str, AutoChoice]]:
    """A config in which every ``auto`` convolution has its own exact entry, and the decisions.

    ``machine``: any form :func:`distconv.machines.resolve_machine` takes (a flat or a
    hierarchical machine, a factory such as ``distconv.machines.lassen``, a name such as
    ``"lassen"``); anything else is a TypeError. An ``input_shape`` the model cannot take is a
    ValueError naming it (:func:`distconv.parallel.shapes.propagate_shapes`)."""
    machine = resolve_machine(machine)
    meta = copy.deepcopy(gm).to("meta")
    shapes: dict[str, tuple[int, ...]] = {}
    propagate_shapes(meta, input_shape)
    for node in meta.graph.nodes:
        if node.op == "call_module" and isinstance(meta.get_submodule(node.target), nn.Conv2d):
            shapes[str(node.target)] = tuple(node.args[0].meta["tensor_meta"].shape)
    decisions: dict[str, AutoChoice] = {}
    entries = []
    for name, shape in shapes.items():
        choice = config.choice(name)
        if choice.algorithm != "auto":
            continue
        conv = gm.get_submodule(name)
        problem = _problem(conv, shape)
        scored = []
        for layout, alg in _options(problem, choice, config.world_size):
            run = "stationary-x" if alg in ("sample", "spatial") else alg
            cost = conv_cost(problem, dict(layout), run, machine, itemsize=itemsize)
            scored.append((dict(layout), alg, cost.total))
        if not scored:
            raise ValueError(f"{choice.source}: no grid of {config.world_size} ranks can run "
                             f"layer {name!r} ({problem})")
        scored.sort(key=lambda item: item[2])
        decisions[name] = AutoChoice(name, tuple(scored))
        grid, alg, _ = scored[0]
        entries.append({"match": name, "grid": grid, "algorithm": alg})
    raw = config.to_dict()
    raw["layers"] = entries + list(raw.get("layers", []))
    return ParallelConfig(raw, world_size=config.world_size), decisions
