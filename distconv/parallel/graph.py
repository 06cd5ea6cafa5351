"""From a model and a config to a placement for every value: the pure half of ``parallelize``.

The model is traced with ``torch.fx`` (:mod:`distconv.parallel.capture`: a graph that is the
module's forward, or a refusal naming what keeps it from being so); every node gets a kind (what
runs there), the :class:`~distconv.parallel.placement.Placement` of its value, and the placement
each of its inputs must be converted to. Placements do not depend on the input shape, so parameters can be sharded
at construction; shapes enter only when a step is planned (cached per global input shape).

This is the one walk over the traced graph: the input, output and constants are placed here;
every call node (module, function, method) goes to the op handler the registry
(:mod:`distconv.ops`) binds it to, which states its placement rule -- convolutions take their
config entry's algorithm; normalisation, pooling and pointwise ops keep their input's placement;
``Linear`` runs sample-parallel; a residual add meets where fewer bytes move; ``cat`` joins along
a replicated dim; ``flatten``/``view`` replicate every dim but the samples. ``parallelize``
builds the analysis, ``explain`` prices it, and a node no handler runs is refused by name (or,
``strict=False``, listed with the others).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn

from distconv import ops
from distconv.distribution import Dist
from distconv.ops.extents import captured_shape
from distconv.parallel.capture import MODULE_PATHS, UntraceableModelError, trace
from distconv.parallel.capture import _VALUE as CAPTURED_VALUE
from distconv.parallel.config import AliasedConfig, ParallelConfig
from distconv.parallel.placement import Placement, layout_str
from distconv.parallel.steps import SAMPLES, Analysis, LayerSpec, Step, sample_dist, samples_of

__all__ = ["Analysis", "LayerSpec", "Step", "UntraceableModelError", "aliased", "analyse",
           "check_planned", "operand_need", "sample_dist", "trace"]


def check_shapes(analysis: Analysis, modules: dict[str, nn.Module],
                 shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise ``ValueError``, naming the node, where a placed node cannot run on its input's
    global shape (its handler's ``refuse``: a split that leaves some rank no rows, say). The one
    check ``explain`` and the parallel model's plan for an input shape make, before any step."""
    for step in analysis.steps:
        node = step.node
        why = step.handler.refuse_operands(step, shapes) if step.handler is not None else None
        if why:
            raise ValueError(f"parallelize: node {node.name!r} ({node.op} {_target(node)}) on "
                             f"{dict(step.out.layout)}: {why}")
        if step.handler is None or step.layer is None or not node.args:
            continue
        first = node.args[0]
        if not isinstance(first, fx.Node) or first.name not in shapes:
            continue
        module = modules.get(str(node.target)) if node.op == "call_module" else None
        why = step.handler.refuse(step, module, shapes[first.name])
        if why:
            raise ValueError(f"parallelize: node {node.name!r} ({node.op} {_target(node)}) on "
                             f"{dict(step.layer.layout)}, input of global shape "
                             f"{tuple(shapes[first.name])}: {why}")




class _Analyser:
    def __init__(self, gm: fx.GraphModule, config: ParallelConfig, input_ndim: int | None,
                 strict: bool = True):
        self.strict = strict
        self.unsupported: list[tuple[str, str, str]] = []
        self.gm, self.config = gm, config
        self.modules = dict(gm.named_modules())
        self.input_ndim = input_ndim
        self.ndim: dict[fx.Node, int | None] = {}
        self.steps: list[Step] = []
        self.out: dict[fx.Node, Placement | None] = {}

    # ---------------------------------------------------------------- helpers
    def fail(self, node: fx.Node, what: str, exc: type[Exception] = ops.Unsupported):
        where = module_path(node) if node.op != "call_module" else ""  # (a call names it)
        at = f" in module {where!r}" if where else ""
        raise exc(f"parallelize: node {node.name!r} ({node.op} {_target(node)}){at}: {what}")

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
            step = self.visit_or_record(node)
            self.out[node] = step.out
            self.ndim[node] = step.out.ndim if step.out is not None else None
            self.steps.append(step)
        return self.steps

    def visit(self, node: fx.Node) -> Step:
        """The node's step; its samples' dim recorded in ``node.meta`` (:data:`SAMPLES`) for
        the nodes that read it (this walk's or the planner's, which visits node by node)."""
        step = self._visit(node)
        dims = [samples_of(a) for a in self.tensor_args(node)]
        mover = next((m for d, m in dims if d == step.samples), node.name)
        node.meta[SAMPLES] = (step.samples, mover if step.samples else "")
        return step

    def _visit(self, node: fx.Node) -> Step:
        if node.op == "placeholder":
            ndim = self.input_ndim or self._ndim_from_users(node)
            return Step(node, "input", Placement(self.config.data, sample_dist(ndim)))
        if node.op == "output":
            return self.visit_output(node)
        if node.op == "get_attr":
            return self.visit_constant(node)
        return self.visit_call(node)

    def visit_constant(self, node: fx.Node) -> Step:
        """A parameter or buffer used directly in ops (a layer scale, a positional term): whole
        on every rank, where the model keeps it; an op converts it to the slice it needs (its
        gradient then a pending sum, completed with the replicated parameters')."""
        value = self.gm
        for part in str(node.target).split("."):
            value = getattr(value, part, None)
        if not isinstance(value, torch.Tensor):
            return Step(node, "constant", None)
        return Step(node, "constant", Placement(self.config.data, Dist.replicated(value.dim())))

    def _ndim_from_users(self, node: fx.Node) -> int:
        for user in node.users:
            if user.op == "call_module":
                m = self.modules[user.target]
                if isinstance(m, (nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d, nn.AvgPool2d,
                                  nn.AdaptiveAvgPool2d, nn.ConvTranspose2d)):
                    return 4
                if isinstance(m, (nn.Conv3d, nn.ConvTranspose3d)):
                    return 5
                if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d)):
                    return 3
                if isinstance(m, nn.Linear):
                    return 2
        self.fail(node, "pass input_shape= to parallelize: it cannot tell the input's number "
                  "of dims from its first layer", ValueError)
        raise AssertionError

    def visit_output(self, node: fx.Node) -> Step:
        needs = {}
        for arg in self.tensor_args(node):
            dim, mover = samples_of(arg)
            if dim:
                self.fail(node, "return the samples in dim 0 (move them back with permute or "
                          f"movedim): the model returns {arg.name!r} with the samples in dim "
                          f"{dim} (node {mover!r} moves them there), and the parallel model's "
                          "output rows are its samples")
            needs[arg] = Placement(self.config.data, sample_dist(self.placement(arg).ndim))
        if not needs:
            self.fail(node, "return a tensor from the model: it returns no tensor")
        return Step(node, "output", None, needs)

    def keep(self, node: fx.Node, kind: str) -> Step:
        """A layer that runs on local blocks in its input's (settled) placement."""
        args = self.tensor_args(node)
        if len(args) != 1:
            self.fail(node, "give it one tensor input (its other arguments as numbers): it "
                      f"takes {len(args)}")
        p = self.placement(args[0]).settled()
        return Step(node, kind, p, {args[0]: p}, samples=samples_of(args[0])[0])

    def visit_call(self, node: fx.Node) -> Step:
        """A module, function or method call: its handler's placement (the registry's)."""
        module = self.modules[node.target] if node.op == "call_module" else None
        if module is not None and isinstance(module, _distributed_modules()):
            self.fail(node, "pass the plain single-process model (parallelize converts its "
                      f"layers itself): module {str(node.target)!r} is already a distributed "
                      f"layer ({type(module).__name__})", TypeError)
        handler = ops.handler_for(node, module)
        if handler is None:
            name = (type(module).__name__ if node.op == "call_module"
                    else getattr(node.target, "__name__", str(node.target)))
            what = {"call_module": f"module type {name}",
                    "call_function": "this function",
                    "call_method": f"tensor method .{name}()"}[node.op]
            alt = ops.instead(node.op, name)
            fix = (f"write {alt} instead" if alt is not None else
                   "compute it outside the model, or write an op handler for it (distconv/ops, "
                   "docs/support.md)")
            self.fail(node, f"{fix}: {what} is not supported by parallelize; supported: "
                      f"{ops.supported(node.op, name)}")
        if not handler.samples_anywhere:
            self.samples_in_dim0(node)
        step = handler.place(self, node, module)
        step.handler = handler
        return step

    def samples_in_dim0(self, node: fx.Node) -> None:
        """Refuse ``node`` where an input holds the samples elsewhere than dim 0, which its
        handler reads as the samples (statistics, masks, sample-parallel layers, the output)."""
        for arg in self.tensor_args(node):
            dim, mover = samples_of(arg)
            if dim:
                anywhere = ", ".join(type(h).__name__.removesuffix("Handler").lower()
                                     for h in ops.REGISTRY if h.samples_anywhere)
                self.fail(node, "move the samples back to dim 0 first (permute, movedim), or "
                          f"keep to the ops that take the samples in any dim ({anywhere}): its "
                          f"input {arg.name!r} holds the samples in dim {dim} (node {mover!r} "
                          "moves the samples (dim 0) there), and this op finds them in dim 0")

    def visit_or_record(self, node: fx.Node) -> Step:
        """``visit``; with ``strict=False`` an unsupported node is recorded and its value is
        taken to stay where its first input is, so the walk goes on to find the others."""
        try:
            return self.visit(node)
        except ops.Unsupported as exc:
            if self.strict:
                raise
            self.unsupported.append((node.name, f"{node.op} {_target(node)}", str(exc)))
            args = self.tensor_args(node)
            if not args:
                return Step(node, "unsupported", None)
            p = self.placement(args[0]).settled()
            shape = captured_shape(node)
            value = node.meta.get(CAPTURED_VALUE)
            if (shape is None and captured_shape(args[0]) is not None
                    and not isinstance(value, (tuple, list))):
                return Step(node, "unsupported", None)  # captured on the shape: not a tensor
            if shape is not None and len(shape) != p.ndim:  # (a full reduction: x.max())
                p = Placement(p.layout, Dist.replicated(len(shape)))
                return Step(node, "unsupported", p, {args[0]: self.placement(args[0]).settled()})
            node.meta[SAMPLES] = samples_of(args[0])
            return Step(node, "unsupported", p, {args[0]: p}, samples=samples_of(args[0])[0])

    def to_samples(self, node: fx.Node, arg: fx.Node, out_ndim: int) -> Step:
        from distconv.ops.shape import to_samples

        return to_samples(self, node, arg, out_ndim)


def _distributed_modules() -> tuple[type, ...]:
    from distconv.nn import (
        DistAdaptiveAvgPool2d, DistBatchNorm, DistConv2d, DistConvNd, DistLayerNorm,
        Redistribute,
    )
    from distconv.nn.groupnorm import _GroupedNorm
    from distconv.nn.dropout import _DistDropout
    from distconv.nn.pool import POOLS

    return (DistConv2d, DistConvNd, DistBatchNorm, _GroupedNorm, DistLayerNorm,
            *POOLS.values(), DistAdaptiveAvgPool2d, _DistDropout, Redistribute)


def _target(node: fx.Node) -> str:
    t = node.target
    return getattr(t, "__name__", None) or str(t)


def analyse(gm: fx.GraphModule, config: ParallelConfig, *, input_ndim: int | None = None,
            strict: bool = True) -> Analysis:
    """Placements and layer specs for every node of the traced model (pure; no communication).

    ``strict`` (default): the first node no handler runs raises :class:`distconv.ops.Unsupported`
    naming it; ``strict=False`` records every such node in ``Analysis.unsupported`` instead.
    A module the model registers under several paths takes the entries matching any of them
    (:func:`aliased`)."""
    config = aliased(config, gm)
    configurable = [n for n, m in gm.named_modules() if isinstance(m, ops.CONFIGURABLE)]
    norms = [n for n, m in gm.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    config.check_matches(configurable, norms, [n for n, _ in gm.named_modules() if n])
    walker = _Analyser(gm, config, input_ndim, strict)
    steps = walker.run()
    _segments(steps, config)
    return Analysis(gm, steps, config.data, walker.unsupported)


def aliased(config: ParallelConfig, gm: fx.GraphModule) -> ParallelConfig:
    """``config`` matching every path of the modules ``gm``'s model registers under several
    (:class:`~distconv.parallel.config.AliasedConfig`); ``config`` itself where there are none."""
    paths = gm.meta.get(MODULE_PATHS) if hasattr(gm, "meta") else None
    if not paths or isinstance(config, AliasedConfig):
        return config
    return AliasedConfig(config, paths)  # type: ignore[return-value]


def check_planned(gm: fx.GraphModule, config: ParallelConfig) -> None:
    """Before ``auto`` entries are planned: refuse an entry that sets a convolution only by
    another of its paths (:meth:`~distconv.parallel.config.AliasedConfig.check_planned`)."""
    aliases = aliased(config, gm)
    if isinstance(aliases, AliasedConfig):
        aliases.check_planned([n for n, m in gm.named_modules() if isinstance(m, ops.CONFIGURABLE)])


def module_path(node: fx.Node) -> str:
    """The qualified name of the module a node runs in: a module call's own, else the innermost
    module whose forward called it ("" at the top level)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def _segments(steps: list[Step], config: ParallelConfig) -> None:
    """Number the runs of consecutive call steps that the config checkpoints (constants inside a
    run belong to it). Sizes are constants of the program, in no run; a view sized by them runs
    in the program too (it sizes the local block: :mod:`distconv.parallel.program`), between two
    runs."""
    sizes = {s.node for s in steps if s.kind == "size"}
    segment, current = -1, None
    for step in steps:
        op = step.node.op
        if step.kind == "size":
            continue
        if step.kind == "reshape" and sizes.intersection(step.node.all_input_nodes):
            current = None
        elif op.startswith("call_") and config.checkpointed(module_path(step.node)):
            if current is None:
                segment += 1
                current = segment
            step.segment = current
        elif op == "get_attr" and current is not None:
            step.segment = current
        else:
            current = None


def describe_placement(p: Placement | None, name: str = "") -> str:
    return "-" if p is None else f"{p.dist.format(name)} on {layout_str(p.layout)}"


def operand_need(step: Step, arg: fx.Node, shapes: dict[str, tuple[int, ...]]
                 ) -> Placement | None:
    """The placement ``arg`` is converted to for ``step`` on these global shapes: the analysis's,
    except that an operand of a broadcasting elementwise op keeps the dims it broadcasts over
    whole (:func:`distconv.ops.elementwise.broadcast_need`)."""
    need = step.needs.get(arg)
    if need is None or step.kind != "pointwise" or len(step.needs) < 2 or (
            step.node.target is torch.cat):
        return need
    got, out = shapes.get(arg.name), shapes.get(step.node.name)
    if got is None or out is None or got == out:
        return need
    from distconv.ops.elementwise import broadcast_need

    return broadcast_need(need, got, out)
