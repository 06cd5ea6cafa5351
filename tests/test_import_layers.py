"""No import circles among the modules of ``distconv`` and ``distkfac``.

Every ``import`` and ``from ... import`` of the package's own modules counts, at module level
and inside functions alike: a lazy import inside a function is still a dependency, and one that
points back up is a circle deferred to run time. Two kinds are left out, each for a reason:

* imports under ``if TYPE_CHECKING:`` -- they never run;
* the parent packages Python initialises on the way to a submodule (``distconv.ops`` on the way
  to ``distconv.ops.pricing``): a package's ``__init__`` is the facade that re-exports what lies
  below it, so it sits above its own submodules. A name taken from the package itself
  (``from distconv.ops import Unsupported``) does count, as an edge to the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("distconv", "distkfac")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: line of the first such import}."""
    modules = _modules()
    edges: dict[str, dict[str, int]] = {m: {} for m in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod
                           for a in node.names]
            for target in targets:
                found = _resolve(target, modules)
                if found is not None and found != name:
                    edges[name].setdefault(found, node.lineno)
    return edges


def circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # iterative enough for a few hundred modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_the_circle_finder_finds_a_circle_and_only_that() -> None:
    edges = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}, "e": {}}
    assert circles(edges) == [["a", "b", "c"]]
    assert circles({"a": {"b": 1}, "b": {}}) == []


def test_the_import_graph_sees_lazy_relative_and_package_imports() -> None:
    edges = import_graph()
    # a function-level import (distconv.parallel.explain resolves ``auto`` lazily)
    assert "distconv.parallel.auto" in edges["distconv.parallel.explain"]
    # a name from a package is an edge to the package; a submodule, to the submodule
    assert "distconv.ops" in edges["distconv.parallel.graph"]
    assert "distconv.pricing.timeline" in edges["distconv.ops.conv"]


def test_no_module_imports_itself_through_others() -> None:
    edges = import_graph()
    found = circles(edges)
    described = ["; ".join(f"{m} -> {', '.join(f'{t} (line {edges[m][t]})' for t in edges[m] if t in comp)}"
                           for m in comp) for comp in found]
    assert not found, "import circles:\n" + "\n".join(described)


def test_the_preconditioner_concerns_import_only_the_layer_state() -> None:
    """K-FAC's concern modules import neither each other nor the class that composes them, only
    the per-layer state below them (a concern that needs another goes through ``KFAC``)."""
    edges = import_graph()
    pkg = "distkfac.preconditioner"
    for concern in ("hooks", "decompositions", "precondition", "checkpoint"):
        siblings = {t for t in edges[f"{pkg}.{concern}"] if t.startswith(pkg)}
        assert siblings == {f"{pkg}.layer"}, f"{pkg}.{concern} imports {sorted(siblings)}"


#: Modules split by concern, each with the siblings it may import: a concern sits below the
#: module that composes it (the layer, the class, the package's facade) and below the concerns
#: listed after it, never the other way round.
CONCERNS = {
    "distconv.nn.batchnorm": {
        "distconv.nn.batchnorm_statistics": set(),
    },
    "distconv.nn.conv": {
        "distconv.nn.conv_layout": set(),
        "distconv.nn.conv_forward": set(),
    },
    "distconv.redistribute": {
        "distconv.redistribute.steps": set(),
        "distconv.redistribute.planning": {"distconv.redistribute.steps"},
        "distconv.redistribute.execution": {"distconv.redistribute.steps",
                                            "distconv.redistribute.planning"},
        "distconv.redistribute.between_grids": {"distconv.redistribute.steps",
                                                "distconv.redistribute.execution"},
    },
    "distconv.parallel.model": {
        "distconv.parallel.module_tree": set(),
        "distconv.parallel.gradient_sync": set(),
    },
    "distkfac.sharded": {
        "distkfac.sharded.geometry": set(),
        "distkfac.sharded.statistics": {"distkfac.sharded.geometry"},
        "distkfac.sharded.exact": {"distkfac.sharded.geometry", "distkfac.sharded.statistics"},
    },
    "distconv.comm.base": {
        "distconv.comm.debug": set(),
        "distconv.comm.stats": set(),
        "distconv.comm.work": set(),
    },
    "distconv.comm.host_channel": {
        "distconv.comm.host_framing": set(),
    },
}


def test_split_concerns_import_only_the_concerns_below_them() -> None:
    edges = import_graph()
    for top, concerns in CONCERNS.items():
        family = {top, *concerns}
        for concern, allowed in concerns.items():
            assert concern in edges, f"{concern} is not a module"
            siblings = {t for t in edges[concern] if t in family}
            may = ", ".join(sorted(allowed)) or "none of them"
            assert siblings <= allowed, (
                f"{concern} imports {sorted(siblings - allowed)} of {sorted(family)}; it may "
                f"import {may}")


#: What pricing sits above (the data it reads) and what sits above it (what fills in or adds up
#: its prices): ``distconv.pricing`` reaches nothing of the latter, and none of the former reaches
#: back up into it, so a layer's price walks down through one layer.
BELOW_PRICING = ("distconv.conv_geometry", "distconv.distribution", "distconv.grid",
                 "distconv.redistribute", "distconv.parallel.placement", "distconv.machines.base",
                 "distconv.machines.lassen")
ABOVE_PRICING = ("distconv.ops", "distconv.nn", "distconv.parallel", "distconv.planner",
                 "distconv.machines", "distconv.perfmodel", "distkfac")


def _above_pricing(module: str) -> bool:
    if module in BELOW_PRICING:
        return False
    return any(module == top or module.startswith(top + ".") for top in ABOVE_PRICING)


def reach(edges: dict[str, dict[str, int]], start: str) -> dict[str, list[str]]:
    """Every module ``start`` imports, directly or through others: module -> one import path."""
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in edges[v]:
            if w not in paths:
                paths[w] = paths[v] + [w]
                todo.append(w)
    del paths[start]
    return paths


def test_reach_follows_imports_through_others() -> None:
    edges = {"a": {"b": 1}, "b": {"c": 1}, "c": {}, "d": {"a": 1}}
    assert reach(edges, "a") == {"b": ["a", "b"], "c": ["a", "b", "c"]}
    assert _above_pricing("distconv.ops.conv") and _above_pricing("distconv.machines")
    assert not _above_pricing("distconv.parallel.placement")
    assert not _above_pricing("distconv.pricing.cost")


def test_pricing_imports_nothing_above_it() -> None:
    edges = import_graph()
    pricing = [m for m in edges if m == "distconv.pricing" or m.startswith("distconv.pricing.")]
    assert {"distconv.pricing.traffic", "distconv.pricing.cost",
            "distconv.pricing.timeline"} <= set(pricing)
    climbs = [" -> ".join(path) for m in pricing for target, path in reach(edges, m).items()
              if _above_pricing(target)]
    assert not climbs, "pricing reaches above itself:\n" + "\n".join(climbs)


def test_what_pricing_reads_never_reaches_back_into_it() -> None:
    edges = import_graph()
    climbs = [" -> ".join(path) for m in BELOW_PRICING for target, path in reach(edges, m).items()
              if target.startswith("distconv.pricing")]
    assert not climbs, "below pricing, yet reaching into it:\n" + "\n".join(climbs)


def test_a_convolutions_price_walks_down_through_pricing() -> None:
    """The handler states the problem and asks pricing for its bytes and seconds: it imports the
    formulas and the reports, and the formulas import no handler or layer."""
    edges = import_graph()
    for handler in ("distconv.ops.conv", "distconv.nn.conv"):
        assert "distconv.pricing.traffic" in edges[handler]
    assert {"distconv.pricing.cost", "distconv.pricing.timeline"} <= set(edges["distconv.ops.conv"])
    assert not any(_above_pricing(t) for t in reach(edges, "distconv.pricing.cost"))
