"""Where modules and parameters sit in the parallel model's tree: the distributed layers put in
place of the modules they replace (and checked there every forward, :class:`LayersInPlace`), the
modules called in several layouts (:func:`check_split`), the parameters several modules share
(:func:`tied_parameters`, :func:`retie`) and the modules held under several paths
(:func:`realias`)."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch.fx as fx
from torch import nn

from distconv.nn.sharding import shard_specs
from distconv.parallel.graph import LayerSpec, Step
from distconv.parallel.placement import Placement, layout_str
from distconv.parallel.program import _replaced

__all__ = ["LayersInPlace", "call_name", "check_split", "realias", "retie", "same_layer",
           "set_submodule", "tied_parameters"]


def set_submodule(root: nn.Module, target: str, module: nn.Module) -> None:
    parent, _, name = target.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


class LayersInPlace:
    """The distributed layers at their module names, checked cheaply every forward: every
    (parent, name) edge on the paths from the model to its layers is compared, in one pass in C,
    with the module it held last time; only where one differs are the layers looked up by name
    (a replaced layer is refused, naming it) and the edges taken again."""

    def __init__(self, model: nn.Module, layers: dict[str, nn.Module]) -> None:
        self.model, self.layers = model, layers
        self._take()

    def _take(self) -> None:
        edges: dict[tuple[int, str], tuple[dict[str, Any], str, Any]] = {}
        for target in self.layers:
            module: Any = self.model
            for part in target.split("."):
                children = module._modules
                module = children[part]
                edges[(id(children), part)] = (children, part, module)
        self.dicts = [e[0] for e in edges.values()]
        self.names = [e[1] for e in edges.values()]
        self.held = [e[2] for e in edges.values()]

    def check(self) -> None:
        """Raise TypeError, naming it, when a layer was replaced after parallelize."""
        if not any(map(operator.is_not, map(dict.get, self.dicts, self.names), self.held)):
            return
        for target, layer in self.layers.items():
            module: Any = self.model
            for part in target.split("."):
                module = module._modules[part]
            if module is not layer:
                _replaced(target, module)
        self._take()  # containers on the way were replaced, the layers are the same


def check_split(target: str, steps: list[Step], plain: nn.Module) -> None:
    """A module called in several layouts must hold no state: its parameters and buffers live
    in one layout."""
    if not any(True for _ in plain.parameters()) and not any(True for _ in plain.buffers()):
        return
    first = steps[0]
    other = next(s for s in steps[1:] if not same_layer(first.layer, s.layer))
    raise ValueError(
        f"parallelize: module {target!r} is called twice (nodes {first.node.name!r} and "
        f"{other.node.name!r}) with its input in different layouts "
        f"({_show_input(first.layer)} and {_show_input(other.layer)}), and its parameters and "
        "buffers live in one layout. Give the second call its own module (copy.deepcopy, "
        "untied) or make both inputs arrive in the same distribution")


def call_name(node: fx.Node) -> str:
    """The child name of a node's own plain module (a module without state called in another
    layout than its first call, running as traced)."""
    return f"_call_{node.name}"


def same_layer(a: LayerSpec | None, b: LayerSpec | None) -> bool:
    """Whether two calls of one module can share its one layer: the same spec once grid dims of
    extent 1 are dropped (``{N: 2}`` and ``{H: 1, W: 1, N: 2}`` put every rank at the same
    coordinates, so the same blocks on the same ranks)."""
    def canonical(spec: LayerSpec | None) -> Any:
        if spec is None:
            return None
        live = tuple((n, e) for n, e in spec.layout if e > 1)
        given = None if spec.input is None else Placement(live, spec.input.dist)
        return dataclasses.replace(spec, layout=live, input=given, source="")

    return canonical(a) == canonical(b)


def _show_input(spec: LayerSpec | None) -> str:
    return "-" if spec is None or spec.input is None else spec.input.format("x")


def tied_parameters(gm: nn.Module) -> list[list[tuple[str, str]]]:
    """(module, attribute) pairs of every parameter object that more than one module holds."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for mname, m in gm.named_modules(remove_duplicate=False):
        for pname, p in m._parameters.items():
            if p is not None and (mname, pname) not in owners.get(id(p), []):
                owners.setdefault(id(p), []).append((mname, pname))
    return [group for group in owners.values() if len(group) > 1]


def retie(gm: nn.Module, ties: list[list[tuple[str, str]]]) -> None:
    """Make each parameter the original model shared one parameter again: its holders' shards
    are one ``Parameter`` (gradients of every use add up in it) when they lie alike, else the
    model is refused by name."""
    for group in ties:
        held = []
        for mname, pname in group:
            module = gm.get_submodule(mname)
            spec = shard_specs(module)[pname]
            where = (None if spec.grid is None else spec.grid.layout, spec.dist,
                     spec.global_shape)
            held.append((f"{mname}.{pname}" if mname else pname, module, pname, where))
        name0, module0, pname0, where0 = held[0]
        shared = getattr(module0, pname0)
        for name, module, pname, where in held[1:]:
            if getattr(module, pname) is shared:
                continue
            if where != where0:
                raise ValueError(
                    f"parallelize: {name0!r} and {name!r} are one shared parameter, but their "
                    f"layers shard it differently ({_show_where(where0)} and "
                    f"{_show_where(where)}). Give both layers the same grid and algorithm in the "
                    "config (one entry matching both), or untie the parameter")
            setattr(module, pname, shared)


def realias(gm: nn.Module, template: nn.Module) -> None:
    """Register each module the model holds under several paths (``self.skips = [self.enc[1]]``)
    under every one of them again: the traced module keeps only the path the graph names it by, and
    torch's state dict lists the module's tensors under each path. The other paths point at the
    traced (and perhaps distributed) module itself, so every key is the same tensor; parents the
    traced module lacks are plain containers. Modules the forward never calls are the capture's
    to hold (:func:`distconv.parallel.capture.trace` keeps them at their paths)."""
    paths: dict[int, list[str]] = {}
    owns: dict[int, bool] = {}
    for name, m in template.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), []).append(name)
        owns[id(m)] = any(t is not None for t in [*m._parameters.values(), *m._buffers.values()])
    held = dict(gm.named_modules())
    aliases = []
    for key, group in paths.items():
        there = [p for p in group if p in held]
        if owns[key] and there:
            aliases.extend((p, there[0]) for p in group if p not in held)
    for alias, path in sorted(aliases, key=lambda a: a[0].count(".")):
        parent: nn.Module = gm
        *dirs, leaf = alias.split(".")
        for part in dirs:
            if part not in parent._modules:
                parent.add_module(part, nn.Module())
            parent = parent._modules[part]
        parent.add_module(leaf, gm.get_submodule(path))


def _show_where(where: tuple[Any, Any, Any]) -> str:
    layout, dist, shape = where
    on = "every rank" if layout is None else layout_str(layout)
    return f"{dist.format('w')} of {tuple(shape)} on {on}"
