"""The executor's code: one Python function per global input shape, generated from the analysis.

:class:`~distconv.parallel.model.ParallelModel` runs a traced graph whose every decision -- each
node's handler and layer, each operand's conversion, every global shape -- the analysis made once
per input shape. Interpreting the graph node by node re-did, every step, the work those decisions
make unnecessary: mapping arguments over fx structures, looking modules up by dotted name,
looking conversions up in dicts. :func:`generate` writes the step out instead, once per shape, as
straight-line code (the technique of ``torch.fx``'s own code generation)::

    def program(x):
        v_conv1 = L0(x, S0)                             # a distributed layer, its input's shape
        v_relu = R._modules['relu'](v_conv1)            # a module that runs as traced
        c0 = convert(v_relu, P0, P1, S1, G)             # an operand converted, once
        ...
        return exit(v_fc)

Every constant the code uses is bound in its namespace (``L*`` layers, ``S*`` shapes, ``P*``
placements, ``Z*`` sizes, ``K*`` other arguments), never printed into it. Sizes the model reads
(``h, w = skip.shape[2:]``, ``c // groups``, :mod:`distconv.ops.sizes`) are the global tensor's,
from the shape propagation, the same on every rank; nothing computes them per step (a view or
reshape sized by them regroups this rank's block: :class:`~distconv.ops.shape.ReshapeHandler`).
Each value is deleted after the statement that reads it last. Modules that run as traced are looked
up from the model root at each call (``R._modules[...]``), so a module the user swaps between steps
is the one that runs, as in eager PyTorch; a distributed layer swapped after ``parallelize`` is
refused, naming it (the eager forward checks them all before its program runs).
Activation-checkpointed segments run through the model's segment runner. The program that
``torch.compile`` traces is written apart: there each layer call and conversion is wrapped as
``E(L0, x, S0)``, run eagerly as a graph break (collectives cannot be traced), and each layer is
checked where it is called; eager execution needs neither.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch.fx as fx
from torch import nn

from distconv.comm.base import compiling, eager
from distconv.parallel.placement import convert, one_grid
from distconv.parallel.shapes import global_values

__all__ = ["generate"]


def generate(model: Any, shapes: dict[str, tuple[int, ...]],
             needs: dict[tuple[fx.Node, fx.Node], Any], *, compiled: bool = False
             ) -> Callable[[Any], Any]:
    """The step of ``model`` (a :class:`ParallelModel`) for one set of global ``shapes`` and
    operand ``needs``: a function of this rank's input block that returns the model's output,
    exactly what interpreting the analysed graph gives. ``compiled``: the program
    ``torch.compile`` traces (layers and conversions run eagerly, as graph breaks)."""
    return _Writer(model, shapes, needs, compiled).program()


def _replaced(target: str, module: Any) -> None:
    raise TypeError(
        f"module {target!r} was replaced after parallelize (now {type(module).__name__}): the "
        "parallel model runs the layer it built. Convert or replace layers in the plain model "
        "before parallelize")


def _get_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _eager(fn: Any, *args: Any) -> Any:
    """``fn(*args)``; under ``torch.compile`` run eagerly, as a graph break: the collectives, the
    conversions and the distributed layers, so that the local computation between them compiles."""
    return eager(fn)(*args) if compiling() else fn(*args)


class _Writer:
    def __init__(self, model: Any, shapes: dict[str, tuple[int, ...]],
                 needs: dict[tuple[fx.Node, fx.Node], Any], compiled: bool) -> None:
        self.model, self.shapes, self.needs, self.compiled = model, shapes, needs, compiled
        self.analysis = model._analysis
        self.ns: dict[str, Any] = {"E": _eager, "convert": convert, "G": model._grids,
                                   "R": model, "GA": _get_attr, "replaced": _replaced,
                                   "map_aggregate": fx.node.map_aggregate, "exit": model._exit,
                                   "segment": model._run_segment}
        self.lines: list[str] = []
        self.reads: list[frozenset[str]] = []  # the local names each line reads
        self._reading: set[str] = set()  # read so far by the statement being written
        self.var: dict[fx.Node, str] = {}
        self.converted: dict[tuple[fx.Node, Any], str] = {}
        self._ids = itertools.count()
        # sizes are constants of the global shape (distconv.ops.sizes), bound before any
        # statement: a checkpointed segment may read one computed after its first step
        values = global_values(model._meta)
        self.folded = {s.node for s in self.analysis.steps if s.kind == "size"}
        for node in self.folded:
            self.var[node] = self.const(values[node.name], "Z")

    # ------------------------------------------------------------------ names and constants
    def const(self, value: Any, prefix: str = "K") -> str:
        name = f"{prefix}{next(self._ids)}"
        self.ns[name] = value
        return name

    def module_expr(self, target: str) -> str:
        """The module at ``target``, looked up from the root as ``get_submodule`` does."""
        return "R" + "".join(f"._modules[{part!r}]" for part in target.split("."))

    def operand(self, node: fx.Node, a: fx.Node) -> str:
        """The expression of operand ``a`` of ``node``: its value, converted to what ``node``
        needs (each conversion emitted once, where it is first needed)."""
        if a in self.folded:
            return self.var[a]
        need = self.needs[(node, a)]
        src = self.analysis.step(a).out
        if need is not None and src is not None:  # on need's grid where convert would move it
            src = one_grid(src, need, tuple(self.shapes[a.name]))
        if need is None or need == src:  # a conversion that moves nothing is not emitted
            return self.use(self.var[a])
        key = (a, need)
        if key not in self.converted:
            name = self.converted[key] = f"c{len(self.converted)}"
            args = (f"{self.var[a]}, {self.const(src, 'P')}, {self.const(need, 'P')}, "
                    f"{self.const(self.shapes[a.name], 'S')}, G")
            self.emit(f"{name} = {self.call('convert', args)}", reads={self.var[a]})
        return self.use(self.converted[key])

    def expr(self, node: fx.Node, value: Any) -> str:
        """Source for an argument structure, its nodes replaced by their operand expressions."""
        if isinstance(value, fx.Node):
            return self.operand(node, value)
        if isinstance(value, tuple):
            items = [self.expr(node, v) for v in value]
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        if isinstance(value, list):
            return "[" + ", ".join(self.expr(node, v) for v in value) + "]"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{self.const(k)}: {self.expr(node, v)}"
                                   for k, v in value.items()) + "}"
        if isinstance(value, slice) and any(isinstance(v, fx.Node) for v in
                                            (value.start, value.stop, value.step)):
            return (f"slice({self.expr(node, value.start)}, {self.expr(node, value.stop)}, "
                    f"{self.expr(node, value.step)})")
        return self.const(value)

    def call_args(self, node: fx.Node, args: tuple, kwargs: dict) -> str:
        parts = [self.expr(node, a) for a in args]
        parts += [f"{k}={self.expr(node, v)}" for k, v in kwargs.items()]
        return ", ".join(parts)

    def call(self, fn: str, args: str) -> str:
        """A call of a layer or a conversion: run eagerly (a graph break) in the compiled
        program, a plain call otherwise."""
        return f"E({fn}, {args})" if self.compiled else f"{fn}({args})"

    def use(self, name: str) -> str:
        """``name``, a local value, read by the statement being written."""
        self._reading.add(name)
        return name

    def emit(self, line: str, reads: set[str] | None = None) -> None:
        """Append a statement that reads ``reads`` (default: the values :meth:`use` marked
        since the last statement)."""
        if reads is None:
            reads, self._reading = self._reading, set()
        self.lines.append("    " + line)
        self.reads.append(frozenset(reads))

    def body(self) -> list[str]:
        """The statements, each value deleted after the statement that reads it last (as
        ``torch.fx``'s code sets it to None): an activation that backward does not keep is freed
        where the plain module frees it, not when the step returns."""
        last = {name: i for i, reads in enumerate(self.reads) for name in reads}
        lines = []
        for i, line in enumerate(self.lines):
            lines.append(line)
            dead = sorted(n for n in self.reads[i] if last[n] == i and n != "x")
            if dead and i + 1 < len(self.lines):
                lines.append("    del " + ", ".join(dead))
        return lines

    # ------------------------------------------------------------------ the step
    def program(self) -> Callable[[Any], Any]:
        done: set[int] = set()
        for step in self.analysis.steps:
            node = step.node
            if step.kind == "input":
                self.var[node] = "x"
            elif step.kind == "size":
                continue
            elif step.segment is not None:
                if step.segment not in done:
                    self.segment(step.segment)
                    done.add(step.segment)
            elif step.kind == "output":
                out = node.args[0]
                if isinstance(out, fx.Node) and out.name in self.shapes:  # one tensor
                    self.emit(f"return exit({self.expr(node, out)})")
                else:
                    self.emit(f"return map_aggregate({self.expr(node, out)}, exit)")
                break
            else:
                self.node(step)
        else:
            raise AssertionError("the traced graph has no output")
        source = "def program(x):\n" + "\n".join(self.body()) + "\n"
        code = compile(source, "<distconv program>", "exec")
        exec(code, self.ns)  # noqa: S102 -- our own generated source, constants bound by name
        program = self.ns["program"]
        program.source = source
        return program

    def node(self, step: Any) -> None:
        node, model = step.node, self.model
        out = self.var[node] = f"v{len(self.var)}"
        if step.handler is not None and not step.handler.runs_as_traced(step):
            args = self.expr(node, tuple(node.args))
            kwargs = self.expr(node, dict(node.kwargs))
            self.emit(f"{out} = {self.const(step.handler.run, 'H')}({self.const(node, 'N')}, "
                      f"{args}, {kwargs}, {self.const(self.shapes[node.args[0].name], 'S')})")
            return
        layer = model._function_modules.get(node.name)
        if layer is not None:  # this node's own layer: a function's, or a module's without state
            # called in another layout than its first call
            args = (f"{self.expr(node, node.args[0])}, "
                    f"{self.const(self.shapes[node.args[0].name], 'S')}")
            if step.handler is not None and step.handler.layer_operands:
                args += (f", *{self.const(step.handler, 'H')}.operands("
                         f"{self.expr(node, tuple(node.args))}, "
                         f"{self.expr(node, dict(node.kwargs))})")
            self.emit(f"{out} = {self.call(self.const(layer, 'L'), args)}")
        elif node.op == "call_module" and f"_call_{node.name}" in model._modules:
            # this call's own plain module (the module at its name is another call's layer)
            self.emit(f"{out} = R._modules[{f'_call_{node.name}'!r}]("
                      f"{self.call_args(node, node.args, node.kwargs)})")
        elif node.op == "call_module":
            target = str(node.target)
            layer = model._layers.get(target)
            if layer is not None:
                mine = self.const(layer, "L")
                if self.compiled:  # (the eager forward checks every layer at once first)
                    self.emit(f"if {self.module_expr(target)} is not {mine}: "
                              f"replaced({target!r}, {self.module_expr(target)})")
                args = (f"{self.expr(node, node.args[0])}, "
                        f"{self.const(self.shapes[node.args[0].name], 'S')}")
                self.emit(f"{out} = {self.call(mine, args)}")
            else:
                self.emit(f"{out} = {self.module_expr(target)}("
                          f"{self.call_args(node, node.args, node.kwargs)})")
        elif node.op == "call_function":
            self.emit(f"{out} = {self.const(node.target, 'F')}("
                      f"{self.call_args(node, node.args, node.kwargs)})")
        elif node.op == "call_method":
            this, rest = node.args[0], node.args[1:]
            self.emit(f"{out} = getattr({self.expr(node, this)}, {node.target!r})("
                      f"{self.call_args(node, rest, node.kwargs)})")
        elif node.op == "get_attr":
            self.emit(f"{out} = GA(R, {str(node.target)!r})")
        else:
            raise AssertionError(f"unexpected node {node.op}")

    def segment(self, index: int) -> None:
        """A checkpointed segment: its inputs and the conversions made so far handed over in
        dicts, the segment runner called, the values leaving it (and the conversions it made of
        outer values) taken back."""
        steps = [s for s in self.analysis.steps if s.segment == index]
        inside = {s.node for s in steps}
        outer = {a for s in steps for a in s.node.all_input_nodes if a not in inside}
        env = ", ".join(f"{self.const(a, 'N')}: "
                        f"{self.var[a] if a in self.folded else self.use(self.var[a])}"
                        for a in outer)
        self.emit(f"env = {{{env}}}")
        conv = ", ".join(f"({self.const(k[0], 'N')}, {self.const(k[1], 'P')}): {self.use(v)}"
                         for k, v in self.converted.items())
        self.emit(f"converted = {{{conv}}}")
        self.emit(f"segment({index}, {self.use('env')}, {self.use('converted')}, "
                  f"{self.const(self.shapes, 'S')}, {self.const(self.needs, 'K')})")
        for s in steps:  # the outer values the runner converted
            for a in s.node.all_input_nodes:
                need = self.needs[(s.node, a)]
                if a not in inside and need is not None and (a, need) not in self.converted:
                    name = self.converted[(a, need)] = f"c{len(self.converted)}"
                    self.emit(f"{name} = {self.use('converted')}[({self.const(a, 'N')}, "
                              f"{self.const(need, 'P')})]")
        for s in steps:
            if any(u not in inside for u in s.node.users):
                self.var[s.node] = f"v{len(self.var)}"
                self.emit(f"{self.var[s.node]} = {self.use('env')}[{self.const(s.node, 'N')}]")
