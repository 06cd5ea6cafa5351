"""``explain``: a parallelized model's plan on paper -- for any world size, with no communication.

Per layer: the grid and algorithm, its distributions in the paper's notation, every forward and
backward communication step with the bytes each rank receives (the communicators count the
same bytes), parameter, gradient and optimizer-state memory and activation memory per rank, and
with a ``machine`` the §4 predicted time. Totals per step are set against pure sample
parallelism on the same world.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import numbers
import os
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import TensorMetadata

from distconv import machines
from distconv.parallel.config import ConfigSource, ParallelConfig
from distconv.ops import Unsupported
from distconv.pricing.machine import AnyMachine as Machine, Machine as FlatMachine
from distconv.pricing.timeline import CommStep, LayerReport, Timeline, timeline
from distconv.parallel.cost import memory, price_analysis
from distconv.parallel.graph import aliased, analyse, check_planned, check_shapes, trace
from distconv.parallel.placement import ALL_RANKS
from distconv.parallel.shapes import check_input_shape, propagate_shapes

__all__ = ["CommStep", "Explanation", "LayerReport", "explain"]



@dataclass
class Explanation:
    """The result of :func:`explain`: ``print`` it, or ``to_dict()`` / ``to_json()``."""

    world_size: int
    ranks: list[int]
    input_shape: tuple[int, ...]
    itemsize: int
    optimizer_states: int
    layers: list[LayerReport]
    machine: Machine | None
    baseline: Explanation | None = None
    #: ``strict=False``: the nodes parallelize cannot run, as (node, target, reason)
    unsupported: list[tuple[str, str, str]] = field(default_factory=list)
    #: graph node name -> the module path it runs in (``layer1.0.relu``, ``layer1.0.add``)
    paths: dict[str, str] = field(default_factory=dict)
    #: layer name -> the algorithm its config entry gives (``sample``, ``spatial``, ...)
    configured: dict[str, str] = field(default_factory=dict)
    #: ``str()`` shows every distribution and collective (True) or one row per layer (False)
    verbose: bool = False

    def rank_bytes(self, rank: int) -> dict[str, int]:
        """Bytes ``rank`` receives per step: forward and backward (the communicators' count)."""
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} was not evaluated; explain evaluates every rank of "
                             f"worlds up to {ALL_RANKS} and these of larger ones: {self.ranks}")
        return {ph: sum(layer.bytes(ph, rank) for layer in self.layers)
                for ph in ("forward", "backward")}

    def memory(self) -> dict[str, int]:
        """Bytes per rank (the largest rank): parameters, gradients, optimizer state, and the
        activations kept for backward -- every layer's output block, except that the layers of a
        checkpointed segment hold theirs only while it is recomputed (the largest segment)."""
        return memory(self.layers, self.itemsize, self.optimizer_states)

    def timeline(self) -> Timeline | None:
        """The step on :attr:`machine` (None without one): forward, backward, and the gradient
        allreduces overlapped with backward as the buckets run (:func:`distconv.pricing.timeline.
        timeline`, the planner's pricing too)."""
        return None if self.machine is None else timeline(self.layers, self.machine)

    def seconds(self) -> float | None:
        """Predicted seconds of one training step (:meth:`timeline`'s ``step``), or None."""
        t = self.timeline()
        return None if t is None else t.step

    def totals(self) -> dict[str, Any]:
        per_rank = [self.rank_bytes(r) for r in self.ranks]
        out: dict[str, Any] = {
            "max_bytes_forward": max(b["forward"] for b in per_rank),
            "max_bytes_backward": max(b["backward"] for b in per_rank),
            "memory_per_rank": self.memory(),
        }
        if self.machine is not None:
            out["predicted_seconds"] = self.seconds()
        return out

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "world_size": self.world_size, "input_shape": list(self.input_shape),
            "itemsize": self.itemsize, "totals": self.totals(),
            "layers": [{
                "name": lay.name, "kind": lay.kind, "grid": lay.grid, "note": lay.note,
                "algorithm": lay.algorithm, "dists": lay.dists,
                "param_elements_per_rank": lay.param_elements,
                "activation_elements_per_rank": lay.activation_elements,
                "steps": [{"phase": s.phase, "what": s.what, "op": s.op,
                           "bytes_per_rank": {str(r): b for r, b in s.bytes.items()}}
                          for s in lay.steps],
            } for lay in self.layers],
        }
        if self.baseline is not None:
            d["sample_parallel_totals"] = self.baseline.totals()
        if self.unsupported:
            d["unsupported"] = [{"node": n, "target": t, "reason": r}
                                for n, t, r in self.unsupported]
        return d

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    def full(self) -> Explanation:
        """This explanation with every distribution and collective in its text
        (``str(e.full())``); ``explain(..., verbose=True)`` gives the same."""
        return dataclasses.replace(self, verbose=True)

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Draw the step as a picture at ``path`` (PNG, SVG or PDF by its suffix; matplotlib):
        the timeline of the compute and communication streams (with a ``machine``: which
        collectives wait, which gradient allreduces backward hides), and per layer the bytes
        each step moves and the memory it holds."""
        from distconv.parallel.explain_plot import plot

        plot(self, path)

    def __str__(self) -> str:
        return render(self)


WIDTH = 100  # columns of explain's text


def _wrap(text: str, indent: str = "", more: str = "    ") -> list[str]:
    """``text`` in lines of at most WIDTH columns, broken between words, never inside one."""
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + more,
                         break_long_words=False, break_on_hyphens=False) or [indent]


def render(e: Explanation) -> str:
    """The text of an explanation: a table of one row per layer (module paths, the configured
    algorithm, the most bytes any rank receives, parameters per rank and, with a machine, the
    predicted time) with the collectives that move bytes beneath each; ``verbose`` adds each
    layer's distributions and the rows that move nothing; then the totals, against sample
    parallelism on the same ranks."""
    rows = _wrap(f"explain: {e.world_size} ranks, global input {e.input_shape}, "
                 f"{e.itemsize}-byte elements; bytes: the most any rank receives per step"
                 + (f"; time: predicted on {_machine_name(e.machine)}, the slowest rank"
                    if e.machine is not None else ""))
    head = (f"{'layer':<26} {'grid':<14} {'algorithm':<12} {'fwd B':>11} {'bwd B':>11} "
            f"{'params':>10}" + (f" {'ms':>9}" if e.machine is not None else ""))
    rows += [head, "-" * len(head)]
    for lay in e.layers:
        rows += _layer_rows(e, lay)
    if e.unsupported:
        rows += _wrap(f"unsupported: {len(e.unsupported)} node(s) parallelize refuses "
                      "(priced at nothing above)")
        for node, target, reason in e.unsupported:
            why = reason.split("): ", 1)[-1]
            rows += _wrap(f"{e.paths.get(node, node)} ({target}): {why}", "  ")
    rows += _wrap(_summary("this config", e))
    if e.baseline is not None:
        rows += _wrap(_summary("sample parallel", e.baseline))
        rows += _wrap(_comparison(e))
    return "\n".join(row.rstrip() for row in rows)


def _machine_name(machine: Any) -> str:
    return getattr(machine, "name", None) or type(machine).__name__


def _display(e: Explanation, name: str) -> str:
    return e.paths.get(name, name)


def _described(e: Explanation, what: str) -> str:
    """A step's description with graph node names as module paths and grids written as in the
    grid column (``{N:2,C:2}``: one word, which a line is never broken inside)."""
    what = re.sub(r"(redistribute )(\w+)(:)",
                  lambda m: m.group(1) + _display(e, m.group(2)) + m.group(3), what)
    return re.sub(r"\{\w+: \d+(?:, \w+: \d+)*\}", lambda m: m.group(0).replace(" ", ""), what)


def layer_seconds(lay: LayerReport, machine: Machine) -> float:
    """Predicted seconds of one layer in the step: its compute, forward and backward, and the
    collectives on the critical path, less what pipelining hides (the terms of
    :func:`~distconv.pricing.timeline.timeline`; gradient allreduces, which backward may hide,
    are the ``(gradients)`` row's)."""
    comm = sum(st.seconds(machine) for st in lay.steps if st.after is None)
    return lay.compute_seconds + comm - sum(lay.overlap.values())


def _layer_rows(e: Explanation, lay: LayerReport) -> list[str]:
    fwd = max(lay.bytes("forward", r) for r in e.ranks)
    bwd = max(lay.bytes("backward", r) for r in e.ranks)
    if e.machine is None:
        ms = ""
    elif lay.kind == "grad-sync":
        ms = f" {sum(st.seconds(e.machine) for st in lay.steps) * 1e3:>9.3f}"
    else:
        ms = f" {layer_seconds(lay, e.machine) * 1e3:>9.3f}"
    if not (e.verbose or fwd or bwd or lay.param_elements or ms.strip(" 0.")):
        return []  # nothing moved, held or spent: no row
    name = _display(e, lay.name)
    grid = lay.grid.replace(" ", "")
    algorithm = e.configured.get(lay.name, lay.algorithm if lay.algorithm else "-")
    rows = [name] if len(name) > 26 else []
    rows.append(f"{'' if rows else name:<26} {grid:<14} {algorithm:<12} {fwd:>11,} {bwd:>11,} "
                f"{lay.param_elements:>10,}{ms}")
    if e.verbose and lay.dists:
        rows += _wrap(_described(e, "  ".join(lay.dists.values())), " " * 4)
    if lay.note:
        rows += _wrap(lay.note, " " * 4)
    for st in lay.steps:
        most = max(st.bytes.values())
        if most or e.verbose:
            among = st.segment(e.machine) if most else ""  # a conversion's segment
            rows += _wrap(f"{st.phase:<9}{most:>11,} B  {_described(e, st.what)}"
                          + (f" ({among})" if among else ""), " " * 4, " " * 25)
    return rows


def _summary(label: str, e: Explanation) -> str:
    t, m = e.totals(), e.memory()
    s = (f"{label}: per step forward {t['max_bytes_forward']:,} B, backward "
         f"{t['max_bytes_backward']:,} B; per rank parameters {m['parameters']:,} B, gradients "
         f"{m['gradients']:,} B, optimizer state {m['optimizer_state']:,} B, activations "
         f"{m['activations']:,} B")
    tl = e.timeline()
    if tl is not None:
        s += (f"; predicted step {tl.step * 1e3:.3f} ms (forward {tl.forward * 1e3:.3f}, "
              f"backward {tl.backward * 1e3:.3f}, gradient allreduces {tl.gradients * 1e3:.3f} "
              f"of which {tl.exposed * 1e3:.3f} not hidden by backward)")
    return s


def _comparison(e: Explanation) -> str:
    """How the config compares with sample parallelism on the same ranks: predicted time with a
    machine, bytes and memory without one."""
    assert e.baseline is not None
    ours, theirs = e.seconds(), e.baseline.seconds()
    if ours is not None and theirs is not None and ours > 0 and theirs > 0:
        ratio = ours / theirs
        if ratio > 1.0:
            return (f"this config is predicted {ratio:.2f}× SLOWER than sample parallelism on "
                    f"the same {e.world_size} ranks ({ours * 1e3:.3f} ms vs {theirs * 1e3:.3f} "
                    "ms per step)")
        return (f"this config is predicted {1 / ratio:.2f}× faster than sample parallelism on "
                f"the same {e.world_size} ranks ({ours * 1e3:.3f} ms vs {theirs * 1e3:.3f} ms "
                "per step)")
    mine, base = e.memory(), e.baseline.memory()
    return (f"against sample parallelism: {sum(mine.values()) / max(sum(base.values()), 1):.2f}× "
            "its memory per rank; for a speed verdict pass machine=: distconv.machines."
            "calibrate(comm) in a job on the ranks you will run on, or a known one (\"lassen\")")


def explain(model: nn.Module, config: ConfigSource, input_shape: Sequence[int], *,
            world_size: int | None = None,
            machine: Machine | Callable[[], Machine] | str | None = None,
            optimizer_states: int = 1, itemsize: int | None = None,
            bucket_bytes: int = 25 << 20, strict: bool = True,
            verbose: bool = False) -> Explanation:
    """The plan :func:`distconv.parallelize` makes for ``model`` under ``config``, on paper.

    Pure: traces the model and propagates ``input_shape`` (the global input) on the meta device;
    no communicator is used, so any ``world_size`` (default: the config's default grid size)
    works on one process.

    Args:
        model, config: as for :func:`distconv.parallelize`.
        input_shape: the global input shape, samples first: a sequence of ints >= 1 that the
            model's first layer takes (its number of dims and channels).
        world_size: ranks to plan for, an int >= 1. Default: the product of the config's
            default grid.
        machine: for predicted times: a flat :class:`~distconv.pricing.machine.Machine` (e.g.
            from ``distconv.pricing.calibrate.calibrate``), a hierarchical
            :class:`distconv.machines.Machine` (each collective priced on the level its ranks
            span), a factory such as ``distconv.machines.lassen`` or a name such as
            ``"lassen"`` (:func:`distconv.machines.resolve_machine`). Default None (bytes and
            memory only; ``auto`` layers then choose with the default flat ``Machine()``).
        optimizer_states: optimizer state tensors per parameter, an int >= 0 (SGD 0, SGD with
            momentum 1, Adam 2). Default 1.
        itemsize: bytes per element, an int >= 1. Default: the model's parameter dtype.
        bucket_bytes: gradient allreduce bucket size, an int >= 1 (as ``parallelize``).
            Default 25 MiB.
        strict: True (default): a node ``parallelize`` cannot run raises, naming it, as
            ``parallelize`` does. False: every such node is listed at once in
            :attr:`Explanation.unsupported` (a coverage table: ``print`` shows it) and the rest
            is explained around them (those nodes are priced at nothing).
        verbose: False (default): ``str()`` is a table of one row per layer, at most 100
            columns wide. True: each layer's distributions and every collective too (also
            ``str(e.full())``).

    Raises:
        TypeError: a model that is not an ``nn.Module``, an option of the wrong type (naming
            it, the value and what is allowed), or a ``machine`` of none of the forms above.
        ValueError: an option out of range, an unknown machine name, a config that does not fit
            the model or ``world_size``, or an ``input_shape`` the model cannot take (naming it
            and what the first layer expects).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {model!r} of type "
                        f"{type(model).__name__}")
    input_shape = _check_shape(input_shape)
    if world_size is None:
        default = dict(config).get("default", {}) if isinstance(config, dict) else {}
        world_size = math.prod(dict(default.get("grid", {"N": 1})).values())
    else:
        _check_int("world_size", world_size, 1)
    optimizer_states = _check_int("optimizer_states", optimizer_states, 0)
    bucket_bytes = _check_int("bucket_bytes", bucket_bytes, 1)
    if machine is not None:
        machine = machines.resolve_machine(machine, hierarchical=True)  # one pricing
    cfg = ParallelConfig(config, world_size=world_size)
    if itemsize is None:
        p = next(model.parameters(), None)
        itemsize = p.element_size() if p is not None else 4
    else:
        itemsize = _check_int("itemsize", itemsize, 1)
    for name, flag in (("strict", strict), ("verbose", verbose)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    try:
        result = _explain(model, cfg, input_shape, machine, optimizer_states, itemsize,
                          bucket_bytes, baseline=True, strict=strict)
    except (ValueError, TypeError, NotImplementedError) as exc:
        _said_by_explain(exc)
        raise
    result.unsupported = [(n, t, _by_explain(r)) for n, t, r in result.unsupported]
    result.verbose = verbose
    return result


def _by_explain(message: str) -> str:
    """A refusal shared with ``parallelize``, as ``explain`` says it."""
    return "explain: " + message.removeprefix("parallelize: ") if message.startswith(
        "parallelize: ") else message


def _said_by_explain(exc: BaseException) -> None:
    """``exc``'s message (its first argument), as ``explain`` says it, in place: the same
    exception type and traceback."""
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (_by_explain(exc.args[0]), *exc.args[1:])


def _check_int(name: str, value: Any, low: int) -> int:
    """``value`` as an int >= ``low`` (numpy ints too; not bools, not floats)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {low}, got {value!r} of type "
                        f"{type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def _check_shape(shape: Any) -> tuple[int, ...]:
    """``input_shape`` as a tuple of ints >= 1 (a list, tuple or ``torch.Size``)."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) or not shape:
        raise TypeError(f"input_shape must be a non-empty sequence of ints (the global input "
                        f"shape, samples first), got {shape!r}")
    if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) for s in shape):
        raise TypeError(f"input_shape must hold ints, got {tuple(shape)!r}")
    if any(s < 1 for s in shape):
        raise ValueError(f"input_shape must hold sizes >= 1, got {tuple(shape)!r}")
    return tuple(int(s) for s in shape)


def _explain(model: nn.Module, cfg: ParallelConfig, shape: tuple[int, ...],
             machine: Machine | None, optimizer_states: int, itemsize: int,
             bucket_bytes: int, baseline: bool, strict: bool = True) -> Explanation:
    gm, branches = (trace(model, shape), []) if strict else _trace_listing_branches(model, shape)
    check_input_shape(gm, shape)
    decisions: dict[str, Any] = {}
    if cfg.has_auto():
        from distconv.parallel.auto import resolve_auto

        check_planned(gm, cfg)
        cfg, decisions = resolve_auto(gm, cfg, shape, machine or FlatMachine(),
                                      itemsize=itemsize, strict=strict)
    analysis = analyse(gm, cfg, input_ndim=len(shape), strict=strict)
    cfg = aliased(cfg, gm)  # as the analysis read it: an entry may name a module's other path
    meta = copy.deepcopy(gm).to("meta")
    dtype = next((p.dtype for p in gm.parameters() if p.is_floating_point()), None)
    # in the model's own dtype (a .double() model); a capture that is not the model's forward
    refused = frozenset(name for name, _, _ in analysis.unsupported)
    propagate_shapes(meta, shape, dtype=dtype, module=model,  # is refused, not the shape
                     tolerate=refused)
    shapes = {n.name: tuple(n.meta["tensor_meta"].shape) for n in meta.graph.nodes
              if isinstance(n.meta.get("tensor_meta"), TensorMetadata)}
    modules = dict(gm.named_modules())
    check_shapes(analysis, modules, shapes)
    P = cfg.world_size
    layers, ranks = price_analysis(gm, analysis, shape, shapes, P, itemsize, machine,
                                   bucket_bytes, decisions)
    result = Explanation(P, ranks, shape, itemsize, optimizer_states, layers, machine,
                         unsupported=branches + [u for u in analysis.unsupported
                                                 if u[0] not in {b[0] for b in branches}],
                         paths=_module_paths(gm),
                         configured={str(st.node.target): _runs(st, cfg)
                                     for st in analysis.steps
                                     if st.layer is not None and st.layer.algorithm
                                     and st.node.op == "call_module"})
    if baseline and P > 1:
        sample = ParallelConfig({"default": {"grid": {"N": P}, "algorithm": "sample"}},
                                world_size=P)
        try:
            result.baseline = _explain(model, sample, shape, machine, optimizer_states,
                                       itemsize, bucket_bytes, baseline=False, strict=strict)
        except Unsupported:  # the model cannot run purely sample-parallel: no comparison
            result.baseline = None
    return result


def _trace_listing_branches(model: nn.Module, shape: tuple[int, ...]
                            ) -> tuple[fx.GraphModule, list[tuple[str, str, str]]]:
    """The capture on ``shape`` (``explain(strict=False)``), going on past each Python branch
    on a tensor's value, which torch.fx cannot follow: each is listed as refused, naming where,
    and the rest is captured as if the branch's condition were true."""
    from distconv.parallel import capture

    refused: list[tuple[str, str, str]] = []

    class _Listing(capture._SizedTracer):
        def to_bool(self, obj: fx.Proxy) -> bool:
            try:
                return super().to_bool(obj)
            except fx.proxy.TraceError:
                node = obj.node
                target = f"{node.op} {getattr(node.target, '__name__', node.target)}"
                refused.append((node.name, target, (
                    f"explain: node {node.name!r} ({target}): rewrite the branch "
                    f"{_user_frame(self)} without reading a tensor's value (torch.where, a "
                    "mask), or compute it outside the model: its Python decides on "
                    f"{node.name!r}, which torch.fx cannot follow (the rest is explained as "
                    "if it were true)")))
                return True

    return capture._trace(model, _Listing(model, shape)), refused


def _user_frame(tracer: fx.Tracer) -> str:
    """``at file:line in module 'path'``: the model's frame that asked for a value."""
    import sys

    import torch

    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
    path = list(tracer.module_stack)[-1] if tracer.module_stack else ""
    line = f"at {frame.f_code.co_filename}:{frame.f_lineno} " if frame is not None else ""
    return f"{line}in module {path or '(the root)'!r}"


def _runs(step: Any, cfg: ParallelConfig) -> str:
    """The algorithm a layer's row names: its config entry's, except where the layer runs
    over the samples alone (a ``Linear`` head on ``{N: 4}`` under a spatial default): ``sample``."""
    algorithm = cfg.choice(str(step.node.target)).algorithm
    split = {d for d, extent in step.layer.layout if extent > 1}
    if algorithm not in ("sample", "auto") and split and split <= {"N"}:
        return "sample"
    return algorithm


def _module_paths(gm: fx.GraphModule) -> dict[str, str]:
    """Each graph node's name as the model's code names it: a module call by the module's path
    (``layer1.0.relu``, however often it is called), a function by the path of the module whose
    forward calls it and the function (``layer1.0.add``)."""
    paths = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            paths[node.name] = str(node.target)
        elif node.op in ("call_function", "call_method"):
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            fn = node.target if isinstance(node.target, str) else getattr(
                node.target, "__name__", node.name)
            owner = str(stack[-1][0]) if stack and stack[-1] else ""
            paths[node.name] = f"{owner}.{fn}" if owner else fn
    return paths
