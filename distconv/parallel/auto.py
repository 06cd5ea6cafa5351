"""``algorithm: auto``: each such convolution gets the grid and algorithm the §4 model predicts
fastest for its own global problem (forward plus backward and its gradient allreduce, slowest
rank), among the layer's valid candidates (:func:`distconv.planner.layer_candidates`; with a
grid given, the algorithm that grid runs). A ``Conv2d`` is priced by
:func:`distconv.perfmodel.conv_cost`; a ``Conv1d``, ``Conv3d`` or transposed convolution by its
op handler, as ``explain`` prices it (:func:`distconv.planner.nd_layer_cost`); those take
``auto`` from a layer entry (a default ``auto`` leaves them sample-parallel). The choice is per
layer: redistributions between layers are not weighed here --
:func:`distconv.planner.plan_network` plans a whole network with them.
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
from distconv.pricing.cost import conv_cost
from distconv.pricing.problem import ConvProblem

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


#: the convolutions :class:`~distconv.nn.conv_nd.DistConvNd` runs
_VOLUME = (nn.Conv1d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _volume_options(name: str, module: nn.Module, x_shape: tuple[int, ...],
                    y_shape: tuple[int, ...], choice: LayerChoice, world_size: int,
                    machine: Any, itemsize: int) -> list[tuple[dict[str, int], str, float]]:
    """A ``Conv1d``, ``Conv3d`` or transposed layer's candidates, priced, fastest first."""
    from distconv.ops.conv_nd import refusal
    from distconv.planner import Choice, ConvNode, layer_candidates, nd_layer_cost

    conv = ConvNode(name, None, y_shape, module, x_shape)
    if choice.layout is None:
        options = layer_candidates(conv, world_size)
    else:
        live = {d for d, e in choice.layout if e > 1}
        c, f = "C" in live, "F" in live
        algorithm = ("stationary-w" if c and f else "stationary-x" if c else "stationary-y"
                     if f else "spatial" if live - {"N"} else "sample")
        why = refusal(module, choice.layout, algorithm, x_shape)
        if why is not None:
            raise ValueError(f"{choice.source}: layer {name!r} ({type(module).__name__}) cannot "
                             f"run on {dict(choice.layout)}: {why}")
        ext = dict(choice.layout)
        options = [Choice(tuple(choice.layout), algorithm,
                          groups_aligned=module.groups > 1 and ext.get("C", 1) * ext.get(
                              "F", 1) > 1, spatial=len(x_shape) - 2,
                          transposed=conv.transposed)]
    if not options:
        raise ValueError(f"{choice.source}: no grid of {world_size} ranks can run layer "
                         f"{name!r} ({type(module).__name__} on {x_shape})")
    scored = []
    for ch in options:
        cost = nd_layer_cost(conv, ch, machine, itemsize, 0, 0)
        scored.append((dict(ch.grid), ch.algorithm, cost.forward + cost.backward
                       + cost.allreduce))
    scored.sort(key=lambda item: item[2])
    return scored


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
    volumes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    ref = next((p for p in gm.parameters() if p.is_floating_point()), None)
    propagate_shapes(meta, input_shape, dtype=None if ref is None else ref.dtype)
    for node in meta.graph.nodes:
        if node.op != "call_module":
            continue
        module = meta.get_submodule(node.target)
        if isinstance(module, nn.Conv2d):
            shapes[str(node.target)] = tuple(node.args[0].meta["tensor_meta"].shape)
        elif isinstance(module, _VOLUME) and str(node.target) not in volumes:
            volumes[str(node.target)] = (tuple(node.args[0].meta["tensor_meta"].shape),
                                         tuple(node.meta["tensor_meta"].shape))
    decisions: dict[str, AutoChoice] = {}
    entries = []
    for name, (x_shape, y_shape) in volumes.items():
        choice = config.choice(name)
        if choice.algorithm != "auto" or choice.source == "default":
            continue
        scored = _volume_options(name, meta.get_submodule(name), x_shape, y_shape, choice,
                                 config.world_size, machine, itemsize)
        decisions[name] = AutoChoice(name, tuple(scored))
        grid, alg, _ = scored[0]
        entries.append({"match": name, "grid": grid, "algorithm": alg})
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
