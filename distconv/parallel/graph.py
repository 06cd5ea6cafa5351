"""From a model and a config to a placement for every value: the pure half of ``parallelize``.

The model is traced with ``torch.fx``; every node gets a kind (what runs there), the
:class:`~distconv.parallel.placement.Placement` of its value, and the placement each of its inputs
must be converted to. Placements do not depend on the input shape, so parameters can be sharded
at construction; shapes enter only when a step is planned (cached per global input shape).

Rules, per node:

* input: ``[o_N,*,...]`` on the data grid (each rank its samples, replicated over the rest);
* ``Conv2d``: its config entry's grid and algorithm; it takes ``x`` in the algorithm's input
  distribution and gives ``y`` in its output distribution (``sample`` and ``spatial`` are
  stationary-x with C = F = 1). A stationary-w layer whose input arrives as ``x[o,o_{F×C},o,o]``
  on its own grid swaps its channel/filter roles and takes it with no data movement;
* batch norm, pooling, dropout and pointwise layers keep their input's placement (pending sums
  completed first); ``AdaptiveAvgPool2d((1, 1))`` over split rows/columns leaves a pending sum
  over them;
* ``Linear``: sample-parallel, ``[o_N,*]`` on its entry's grid;
* a residual add (and other binary elementwise ops): both operands meet in the placement of one
  of them -- the one the other moves to with fewer bytes (the planner's count on a nominal shape
  every extent divides); ties keep the first;
* ``cat``: the concatenated dim replicated; ``flatten`` / ``view`` / ``reshape``: every dim but
  the samples replicated;
* output: ``[o_N,*,...]`` on the data grid, the samples the input came with.
"""

from __future__ import annotations

import math
import operator
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from distconv.distribution import Dist
from distconv.nn.conv import conv_dists
from distconv.parallel.config import LayerChoice, ParallelConfig
from distconv.parallel.placement import Layout, Placement, conversion_bytes, layout_str

__all__ = ["Analysis", "LayerSpec", "Step", "analyse", "check_broadcasts", "trace"]


POINTWISE_MODULES: tuple[type, ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.ELU, nn.Hardswish,
    nn.Hardsigmoid, nn.Mish, nn.Softplus, nn.Identity, nn.PReLU,
)
POINTWISE_FUNCTIONS: frozenset[Any] = frozenset({
    F.relu, torch.relu, F.relu6, F.gelu, F.silu, F.leaky_relu, F.elu, F.hardswish, F.mish,
    torch.sigmoid, torch.tanh, F.sigmoid, F.tanh, torch.clamp, torch.abs, operator.neg,
    torch.neg, F.softplus,
})
POINTWISE_METHODS = frozenset({
    "relu", "relu_", "sigmoid", "tanh", "clamp", "abs", "neg", "contiguous", "float", "double",
    "half", "bfloat16", "clone", "detach",
})
BINARY = frozenset({operator.add, operator.iadd, operator.sub, operator.isub, operator.mul,
                    operator.imul, operator.truediv, operator.itruediv, torch.add, torch.sub,
                    torch.mul, torch.div})
BINARY_METHODS = frozenset({"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_"})
SIZE_METHODS = frozenset({"size", "dim"})
RESHAPE_METHODS = frozenset({"view", "reshape"})
FLATTENS = frozenset({torch.flatten})


@dataclass(frozen=True)
class LayerSpec:
    """A module to build: its kind, config choice and placements (conv: grid and algorithm)."""

    kind: str
    name: str
    layout: Layout
    algorithm: str = ""
    roles: tuple[tuple[str, str], ...] = ()
    input: Placement | None = None
    source: str = ""


@dataclass
class Step:
    """One node: what runs, where its value lives, and what its inputs are converted to."""

    node: fx.Node
    kind: str
    out: Placement | None
    needs: dict[fx.Node, Placement] = field(default_factory=dict)
    layer: LayerSpec | None = None


@dataclass
class Analysis:
    graph: fx.GraphModule
    steps: list[Step]
    data: Layout

    def step(self, node: fx.Node) -> Step:
        return self._by_node[node]

    def __post_init__(self) -> None:
        self._by_node = {s.node: s for s in self.steps}


# torch.fx patches module-level functions while it traces: thread ranks must take turns.
_TRACE_LOCK = threading.Lock()


class UntraceableModelError(TypeError):
    """The model contains a construct ``torch.fx`` cannot capture."""


def trace(model: nn.Module) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` with an error that names the construct fx stopped at."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    try:
        with _TRACE_LOCK:
            gm = fx.symbolic_trace(model)
    except Exception as exc:  # fx raises TraceError, TypeError, ... with the construct's text
        raise UntraceableModelError(
            f"parallelize: torch.fx cannot trace {type(model).__name__}: {exc}. Data-dependent "
            "control flow cannot be captured; rewrite it, or convert layer by layer with "
            "DistConv2d.from_conv2d and Redistribute"
        ) from exc
    _order_like(gm, model)  # fx registers modules in call order; users expect theirs
    return gm


def _order_like(module: nn.Module, original: nn.Module) -> None:
    """Register ``module``'s submodules in the order ``original`` defines them (recursively), so
    that ``parameters()`` and ``state_dict()`` list the shards in the single-process model's
    order: optimizers and their state dicts address parameters by position."""
    rank = {name: i for i, name in enumerate(original._modules)}
    names = sorted(module._modules, key=lambda n: rank.get(n, len(rank)))
    module._modules = {n: module._modules[n] for n in names}
    for n in names:
        child, twin = module._modules[n], original._modules.get(n)
        if child is not None and twin is not None and child is not twin and child._modules:
            _order_like(child, twin)


def _sample_dist(ndim: int) -> Dist:
    return Dist(("N",) + (None,) * (ndim - 1))


class _Analyser:
    def __init__(self, gm: fx.GraphModule, config: ParallelConfig, input_ndim: int | None):
        self.gm, self.config = gm, config
        self.modules = dict(gm.named_modules())
        self.input_ndim = input_ndim
        self.ndim: dict[fx.Node, int | None] = {}
        self.steps: list[Step] = []
        self.out: dict[fx.Node, Placement | None] = {}

    # ---------------------------------------------------------------- helpers
    def fail(self, node: fx.Node, what: str, exc: type[Exception] = NotImplementedError):
        raise exc(f"parallelize: node {node.name!r} ({node.op} {_target(node)}): {what}")

    def placement(self, node: Any) -> Placement:
        if not isinstance(node, fx.Node) or self.out.get(node) is None:
            raise AssertionError(f"no placement for {node!r}")
        return self.out[node]  # type: ignore[return-value]

    def tensor_args(self, node: fx.Node) -> list[fx.Node]:
        found: list[fx.Node] = []
        fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(a) or a)
        return [a for a in found if self.out.get(a) is not None]

    # ---------------------------------------------------------------- per node
    def run(self) -> list[Step]:
        for node in self.gm.graph.nodes:
            step = self.visit(node)
            self.out[node] = step.out
            self.ndim[node] = step.out.ndim if step.out is not None else None
            self.steps.append(step)
        return self.steps

    def visit(self, node: fx.Node) -> Step:
        if node.op == "placeholder":
            ndim = self.input_ndim or self._ndim_from_users(node)
            return Step(node, "input", Placement(self.config.data, _sample_dist(ndim)))
        if node.op == "output":
            return self.visit_output(node)
        if node.op == "get_attr":
            return Step(node, "constant", None)
        if node.op == "call_module":
            return self.visit_module(node, self.modules[node.target])
        if node.op == "call_function":
            return self.visit_function(node, node.target)
        return self.visit_method(node, node.target)

    def _ndim_from_users(self, node: fx.Node) -> int:
        for user in node.users:
            if user.op == "call_module":
                m = self.modules[user.target]
                if isinstance(m, (nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d, nn.AvgPool2d,
                                  nn.AdaptiveAvgPool2d)):
                    return 4
                if isinstance(m, nn.Linear):
                    return 2
        self.fail(node, "cannot tell the input's number of dims from its first layer; pass "
                  "input_shape= to parallelize", ValueError)
        raise AssertionError

    def visit_output(self, node: fx.Node) -> Step:
        needs = {}
        for arg in self.tensor_args(node):
            needs[arg] = Placement(self.config.data, _sample_dist(self.placement(arg).ndim))
        if not needs:
            self.fail(node, "the model returns no tensor")
        return Step(node, "output", None, needs)

    def keep(self, node: fx.Node, kind: str) -> Step:
        """A layer that runs on local blocks in its input's (settled) placement."""
        args = self.tensor_args(node)
        if len(args) != 1:
            self.fail(node, f"expected one tensor input, got {len(args)}")
        p = self.placement(args[0]).settled()
        return Step(node, kind, p, {args[0]: p})

    def visit_module(self, node: fx.Node, m: nn.Module) -> Step:
        name = str(node.target)
        if isinstance(m, _distributed_modules()):
            self.fail(node, f"module {name!r} is already a distributed layer "
                      f"({type(m).__name__}); parallelize takes the plain single-process model "
                      "and converts its layers itself", TypeError)
        if isinstance(m, nn.Conv2d):
            return self.visit_conv(node, m, name)
        if isinstance(m, nn.Linear):
            return self.visit_linear(node, name)
        if isinstance(m, (nn.BatchNorm2d, nn.SyncBatchNorm)):  # both: global-batch statistics
            step = self.keep(node, "batchnorm")
            step.layer = LayerSpec("batchnorm", name, step.out.layout, input=step.out)
            return step
        if isinstance(m, (nn.MaxPool2d, nn.AvgPool2d)):
            return self.visit_pool(node, name)
        if isinstance(m, nn.AdaptiveAvgPool2d):
            return self.visit_adaptive(node, name, m.output_size)
        if isinstance(m, nn.Dropout):
            return self.visit_dropout(node, m.p)
        if isinstance(m, nn.Flatten):
            return self.visit_flatten(node, m.start_dim, m.end_dim)
        if isinstance(m, POINTWISE_MODULES):
            return self.keep(node, "pointwise")
        self.fail(node, f"module type {type(m).__name__} is not supported; supported: Conv2d, "
                  "Linear, BatchNorm2d (and SyncBatchNorm), MaxPool2d, AvgPool2d, "
                  "AdaptiveAvgPool2d, Dropout, Flatten and pointwise activations")
        raise AssertionError

    def visit_conv(self, node: fx.Node, m: nn.Conv2d, name: str) -> Step:
        choice = self.config.choice(name)
        if choice.algorithm == "auto":
            self.fail(node, "algorithm 'auto' must be resolved before placement (pass "
                      "input_shape= to parallelize)", ValueError)
        algorithm = choice.algorithm
        if algorithm in ("sample", "spatial"):
            algorithm = "stationary-x"
        roles = {"N": "N", "C": "C", "F": "F", "H": "H", "W": "W"}
        ext = dict(choice.layout)
        grouped = m.groups > 1 and ext.get("C", 1) * ext.get("F", 1) > 1
        args = self.tensor_args(node)
        if algorithm == "stationary-w" and args:
            src = self.placement(args[0])
            if src.layout == choice.layout and src.dist.entries[1] == ("F", "C"):
                roles["C"], roles["F"] = "F", "C"
        dists = conv_dists(algorithm, roles, grouped)
        need = Placement(choice.layout, dists["input"])
        spec = LayerSpec("conv", name, choice.layout, algorithm,
                         tuple(sorted(roles.items())), need, choice.source)
        out = Placement(choice.layout, dists["output"])
        return Step(node, "conv", out, {args[0]: need}, spec)

    def visit_linear(self, node: fx.Node, name: str) -> Step:
        choice = self.config.choice(name)
        if choice.algorithm not in ("sample", "auto") and choice.source != "default":
            self.fail(node, f"{choice.source} asks for {choice.algorithm}, but Linear layers "
                      "run sample-parallel; give them algorithm 'sample'", ValueError)
        if choice.algorithm != "sample" or choice.layout is None:
            choice = LayerChoice(self.config.data, "sample", "data")
        args = self.tensor_args(node)
        need = Placement(choice.layout, _sample_dist(self.placement(args[0]).ndim))
        return Step(node, "linear", need, {args[0]: need},
                    LayerSpec("linear", name, choice.layout, "sample", input=need,
                              source=choice.source))

    def visit_pool(self, node: fx.Node, name: str) -> Step:
        step = self.keep(node, "pool")
        split = any(step.out.dist.entries[i] is not None for i in (2, 3))
        step.layer = LayerSpec("pool" if split else "local", name, step.out.layout,
                               input=step.out)
        return step

    def visit_adaptive(self, node: fx.Node, name: str, size: Any) -> Step:
        step = self.keep(node, "pool")
        p = step.out
        spatial = [g for i in (2, 3) for g in p.dist.grid_dims_of(i)]
        if not spatial:
            step.layer = LayerSpec("local", name, p.layout, input=p)
            return step
        sizes = (size, size) if not isinstance(size, (tuple, list)) else tuple(size)
        if sizes != (1, 1):
            self.fail(node, f"AdaptiveAvgPool2d({size}) over rows/columns split on {spatial} is "
                      "not implemented; only (1, 1) is, or keep H and W whole before it")
        entries = p.dist.entries[:2] + (None, None)
        step.out = Placement(p.layout, Dist(entries, frozenset(spatial)))
        step.layer = LayerSpec("adaptive", name, p.layout, input=p)
        return step

    def visit_mean(self, node: fx.Node) -> Step:
        """``x.mean(dims)`` over spatial dims: a local sum over the global count, a pending sum
        over the grid dims that split those dims (as global average pooling)."""
        args = self.tensor_args(node)
        p = self.placement(args[0]).settled()
        dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        keep = bool(node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False))
        dims = (dims,) if isinstance(dims, int) else tuple(dims or ())
        dims = tuple(sorted(d % p.ndim for d in dims))
        if not dims or 0 in dims or node.kwargs.get("dtype") is not None:
            self.fail(node, "mean is supported over non-sample dims (e.g. x.mean((2, 3)))")
        split = [g for d in dims for g in p.dist.grid_dims_of(d)]
        entries = [None if i in dims else e for i, e in enumerate(p.dist.entries)]
        if not keep:
            entries = [e for i, e in enumerate(entries) if i not in dims]
        out = Placement(p.layout, Dist(tuple(entries), frozenset(split)))
        return Step(node, "mean", out, {args[0]: p},
                    LayerSpec("mean", node.name, p.layout, input=p))

    def visit_dropout(self, node: fx.Node, p: float) -> Step:
        step = self.keep(node, "dropout")
        model_dims = step.out.dist.used() - set(step.out.dist.grid_dims_of(0))
        if p > 0 and model_dims:
            self.fail(node, f"dropout (p={p}) on a value split over model-parallel grid dims "
                      f"{sorted(model_dims)}: its masks would not match one process. Put dropout "
                      "where activations are sample-parallel (e.g. before the head) or use p=0")
        return step

    def visit_flatten(self, node: fx.Node, start: int, end: int) -> Step:
        args = self.tensor_args(node)
        p = self.placement(args[0])
        ndim = p.ndim
        start, end = start % ndim, end % ndim
        if start != 1 or end != ndim - 1:
            self.fail(node, f"flatten(start_dim={start}, end_dim={end}) is not supported; only "
                      "flattening every dim after the samples (start_dim=1) is")
        return self.to_samples(node, args[0], 2)

    def to_samples(self, node: fx.Node, arg: fx.Node, out_ndim: int) -> Step:
        """Every dim but the samples replicated (flatten, view, reshape act on local rows)."""
        p = self.placement(arg)
        need = Placement(p.layout, Dist((p.dist.entries[0],) + (None,) * (p.ndim - 1)))
        out = Placement(p.layout, Dist((p.dist.entries[0],) + (None,) * (out_ndim - 1)))
        return Step(node, "reshape", out, {arg: need})

    def visit_function(self, node: fx.Node, fn: Any) -> Step:
        if fn in BINARY:
            return self.visit_binary(node)
        if fn in POINTWISE_FUNCTIONS:
            return self.keep(node, "pointwise")
        if fn is F.dropout:
            p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
            return self.visit_dropout(node, float(p))
        if fn in FLATTENS:
            start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0)
            end = node.kwargs.get("end_dim", node.args[2] if len(node.args) > 2 else -1)
            return self.visit_flatten(node, start, end)
        if fn is torch.cat:
            return self.visit_cat(node)
        if fn is torch.reshape:
            return self.to_samples(node, node.args[0], _shape_len(node.args[1:]))
        if fn is F.adaptive_avg_pool2d:
            return self.visit_adaptive(node, node.name, node.args[1] if len(node.args) > 1
                                       else node.kwargs["output_size"])
        if fn is torch.mean:
            return self.visit_mean(node)
        if fn is getattr:
            return Step(node, "meta", None)
        self.fail(node, "this function is not supported by parallelize; supported: elementwise "
                  "activations, +, -, *, /, torch.cat, torch.flatten, reshape/view, dropout")
        raise AssertionError

    def visit_method(self, node: fx.Node, name: Any) -> Step:
        if name in POINTWISE_METHODS:
            return self.keep(node, "pointwise")
        if name in BINARY_METHODS:
            return self.visit_binary(node)
        if name in SIZE_METHODS:
            return Step(node, "meta", None)
        if name in RESHAPE_METHODS:
            return self.to_samples(node, node.args[0], _shape_len(node.args[1:]))
        if name == "mean":
            return self.visit_mean(node)
        if name == "flatten":
            start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0)
            end = node.kwargs.get("end_dim", node.args[2] if len(node.args) > 2 else -1)
            return self.visit_flatten(node, start, end)
        self.fail(node, f"tensor method .{name}() is not supported by parallelize")
        raise AssertionError

    def visit_binary(self, node: fx.Node) -> Step:
        args = self.tensor_args(node)
        for a in fx.node.map_aggregate(node.args, lambda a: a):
            if isinstance(a, fx.Node) and self.out.get(a) is None and a.op == "get_attr":
                self.fail(node, "an elementwise op between an activation and a model tensor "
                          "(get_attr) is not supported: its broadcast over split dims is unplanned")
        if len(args) == 1:
            return self.keep(node, "pointwise")
        if len(args) != 2:
            self.fail(node, f"expected two tensor operands, got {len(args)}")
        a, b = (self.placement(x).settled() for x in args)
        if a.ndim != b.ndim:
            self.fail(node, "operands with different numbers of dims (broadcasting across "
                      "distributed dims) are not supported")
        target = _cheaper_meeting(a, b)
        return Step(node, "pointwise", target, {args[0]: target, args[1]: target})

    def visit_cat(self, node: fx.Node) -> Step:
        args = self.tensor_args(node)
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        first = self.placement(args[0]).settled()
        dim = dim % first.ndim
        if dim == 0:
            self.fail(node, "concatenating along the sample dim is not supported")
        entries = list(first.dist.entries)
        entries[dim] = None
        target = Placement(first.layout, Dist(tuple(entries)))
        return Step(node, "pointwise", target, {a: target for a in args})


def _distributed_modules() -> tuple[type, ...]:
    from distconv.nn import (
        DistAdaptiveAvgPool2d, DistAvgPool2d, DistBatchNorm2d, DistConv2d, DistMaxPool2d,
        Redistribute,
    )

    return (DistConv2d, DistBatchNorm2d, DistMaxPool2d, DistAvgPool2d, DistAdaptiveAvgPool2d,
            Redistribute)


def _shape_len(args: tuple[Any, ...]) -> int:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return len(args[0])
    return len(args)


def _target(node: fx.Node) -> str:
    t = node.target
    return getattr(t, "__name__", None) or str(t)


def _cheaper_meeting(a: Placement, b: Placement) -> Placement:
    """The operand placement the other reaches with fewer bytes in total (ties: ``a``), counted by
    the planner on a nominal shape whose every dim each extent divides."""
    if a == b:
        return a
    size = math.prod(e for _, e in a.layout)
    shape = (2 * size,) * a.ndim
    cost_to_a = sum(conversion_bytes(b, a, shape, 1, r) for r in range(size))
    cost_to_b = sum(conversion_bytes(a, b, shape, 1, r) for r in range(size))
    return b if cost_to_b < cost_to_a else a


def analyse(gm: fx.GraphModule, config: ParallelConfig, *, input_ndim: int | None = None
            ) -> Analysis:
    """Placements and layer specs for every node of the traced model (pure; no communication)."""
    configurable = [n for n, m in gm.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    config.check_matches(configurable)
    steps = _Analyser(gm, config, input_ndim).run()
    return Analysis(gm, steps, config.data)


def describe_placement(p: Placement | None, name: str = "") -> str:
    return "-" if p is None else f"{p.dist.format(name)} on {layout_str(p.layout)}"


def check_broadcasts(analysis: Analysis, shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse, by node, an elementwise op that broadcasts an operand over a dim its placement
    splits (its blocks of a size-1 dim are not the values every rank needs)."""
    for step in analysis.steps:
        if step.kind != "pointwise" or len(step.needs) < 2 or step.node.name not in shapes:
            continue
        out = shapes[step.node.name]
        for arg, need in step.needs.items():
            got = shapes.get(arg.name)
            if got is None or len(got) != len(out):
                continue
            for d, (a, o) in enumerate(zip(got, out)):
                if a != o and need.dist.grid_dims_of(d) and step.node.target is not torch.cat:
                    raise NotImplementedError(
                        f"parallelize: node {step.node.name!r} broadcasts {arg.name!r} of shape "
                        f"{got} against {out} over dim {d}, which its operands' meeting layout "
                        f"{need.format('x')} splits: broadcasting across a split dim is not "
                        "supported yet. Keep that dim whole there (e.g. a config that runs this "
                        "part sample-parallel), or expand the smaller operand explicitly")
