"""``explain``: a parallelized model's plan on paper -- for any world size, with no communication.

Per layer: the grid and algorithm, its distributions in the paper's notation, every forward and
backward communication step with the bytes each rank receives (the communicators count the
same bytes), parameter, gradient and optimizer-state memory and activation memory per rank, and
with a ``machine`` the §4 predicted time. Totals per step are set against pure sample
parallelism on the same world.
"""

from __future__ import annotations

import copy
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import TensorMetadata

from distconv import machines
from distconv.comm.base import allreduce_bytes
from distconv.nn.grad_sync import plan_buckets
from distconv.parallel.config import ParallelConfig
from distconv.distribution import Dist
from distconv.ops import PriceContext, Unsupported
from distconv.ops.pricing import (
    CommStep, LayerReport, Machine, Timeline, largest_block, segment_rank, timeline,
)
from distconv.parallel.graph import Step, analyse, check_shapes, operand_need, trace
from distconv.parallel.placement import (
    ALL_RANKS, Placement, conversion_bytes, evaluated_ranks, layout_str, one_grid, paper_grid,
    repartition_bytes,
)
from distconv.parallel.shapes import check_input_shape, propagate_shapes
from distconv.perfmodel import Machine as FlatMachine

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
        params = sum(layer.param_elements for layer in self.layers) * self.itemsize
        segments: dict[int, int] = {}
        kept = 0
        for lay in self.layers:
            if lay.segment is None:
                kept += lay.activation_elements
            else:
                segments[lay.segment] = segments.get(lay.segment, 0) + lay.activation_elements
        return {"parameters": params, "gradients": params,
                "optimizer_state": params * self.optimizer_states,
                "activations": (kept + max(segments.values(), default=0)) * self.itemsize}

    def timeline(self) -> Timeline | None:
        """The step on :attr:`machine` (None without one): forward, backward, and the gradient
        allreduces overlapped with backward as the buckets run (:func:`distconv.ops.pricing.
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

    def __str__(self) -> str:
        rows = [f"explain: {self.world_size} ranks, global input {self.input_shape}, "
                f"{self.itemsize}-byte elements (bytes: the most any rank receives)"]
        head = f"{'layer':<22} {'grid':<18} {'algorithm':<13} {'distributions':<58} {'fwd B':>10} " \
               f"{'bwd B':>10} {'params':>9}"
        rows += [head, "-" * len(head)]
        for lay in self.layers:
            fwd = max(lay.bytes("forward", r) for r in self.ranks)
            bwd = max(lay.bytes("backward", r) for r in self.ranks)
            dists = "  ".join(f"{v}" for v in lay.dists.values())
            rows.append(f"{lay.name[:22]:<22} {lay.grid[:18]:<18} {lay.algorithm[:13]:<13} "
                        f"{dists[:58]:<58} {fwd:>10,} {bwd:>10,} {lay.param_elements:>9,}")
            if lay.note:
                rows.append(f"{'':<24}{lay.note}")
            for s in lay.steps:
                rows.append(f"{'':<24}{s.phase:<9} {s.what[:70]:<70} {max(s.bytes.values()):>12,}")
        if self.unsupported:
            rows.append(f"unsupported: {len(self.unsupported)} node(s) parallelize refuses "
                        "(priced at nothing above)")
            for node, target, reason in self.unsupported:
                why = reason.split("): ", 1)[-1]
                rows.append(f"  {node[:22]:<22} {target[:40]:<40} {why[:110]}")
        rows.append(_summary("this config", self))
        if self.baseline is not None:
            rows.append(_summary("sample parallel", self.baseline))
        return "\n".join(rows)


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


def explain(model: nn.Module, config: Any, input_shape: Sequence[int], *,
            world_size: int | None = None, machine: Any = None,
            optimizer_states: int = 1, itemsize: int | None = None,
            bucket_bytes: int = 25 << 20, strict: bool = True) -> Explanation:
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
        machine: for predicted times: a flat :class:`~distconv.perfmodel.Machine` (e.g. from
            ``perfmodel.calibrate``), a hierarchical :class:`distconv.machines.Machine` (each
            collective priced on the level its ranks span), a factory such as
            ``distconv.machines.lassen`` or a name such as ``"lassen"``
            (:func:`distconv.machines.resolve_machine`). Default None (bytes and memory only;
            ``auto`` layers then choose with the default flat ``Machine()``).
        optimizer_states: optimizer state tensors per parameter, an int >= 0 (SGD 0, SGD with
            momentum 1, Adam 2). Default 1.
        itemsize: bytes per element, an int >= 1. Default: the model's parameter dtype.
        bucket_bytes: gradient allreduce bucket size, an int >= 1 (as ``parallelize``).
            Default 25 MiB.
        strict: True (default): a node ``parallelize`` cannot run raises, naming it, as
            ``parallelize`` does. False: every such node is listed at once in
            :attr:`Explanation.unsupported` (a coverage table: ``print`` shows it) and the rest
            is explained around them (those nodes are priced at nothing).

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
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {strict!r}")
    return _explain(model, cfg, input_shape, machine, optimizer_states, itemsize, bucket_bytes,
                    baseline=True, strict=strict)


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
    gm = trace(model)
    check_input_shape(gm, shape)
    decisions: dict[str, Any] = {}
    if cfg.has_auto():
        from distconv.parallel.auto import resolve_auto

        cfg, decisions = resolve_auto(gm, cfg, shape, machine or FlatMachine(),
                                      itemsize=itemsize)
    analysis = analyse(gm, cfg, input_ndim=len(shape), strict=strict)
    meta = copy.deepcopy(gm).to("meta")
    dtype = next((p.dtype for p in gm.parameters() if p.is_floating_point()), None)
    # in the model's own dtype (a .double() model); a capture that is not the model's forward
    propagate_shapes(meta, shape, dtype=dtype, module=model)  # is refused, not the shape
    shapes = {n.name: tuple(n.meta["tensor_meta"].shape) for n in meta.graph.nodes
              if isinstance(n.meta.get("tensor_meta"), TensorMetadata)}
    modules = dict(gm.named_modules())
    check_shapes(analysis, modules, shapes)
    P = cfg.world_size
    ranks = _evaluated_ranks(analysis, P)
    needs_grad: dict[str, bool] = {}
    layers: list[LayerReport] = []
    entry = LayerReport("(input)", "input", layout_str(cfg.data), "-",
                        {"x": analysis.steps[0].out.format("x")})
    if P > 1:
        entry.steps.append(CommStep("forward", "agree on the global batch: allgather of local "
                                    "shapes", "allgather", {r: (P - 1) * len(shape) * 8 for r in ranks}, P))
    layers.append(entry)
    done: set[tuple[str, Placement, int | None]] = set()  # converted once per placement
    for step in analysis.steps[1:]:
        node = step.node
        args = [a for a in step.needs]
        grad_in = any(needs_grad.get(a.name, False) for a in args)
        owns = node.op == "call_module" and any(True for _ in modules[node.target].parameters())
        needs_grad[node.name] = grad_in or owns
        report = _layer(step, modules, shapes, itemsize, P, ranks, grad_in, machine)
        if report.name in decisions:
            decided = decisions[report.name].describe()
            report.note = f"{decided}; {report.note}" if report.note else decided
        recomputed = [st for st in report.steps if st.phase == "forward"
                      and not st.what.startswith("running statistics")]
        for a in step.needs:
            need = operand_need(step, a, shapes)
            src = analysis.step(a).out
            # a value converted inside its own checkpointed segment is converted there, apart
            # from the conversions outside it (as the parallel model runs it)
            inside = step.segment is not None and analysis.step(a).segment == step.segment
            key = (a.name, need, step.segment if inside else None)
            if src != need and key not in done:
                done.add(key)
                _conversion(report, a.name, src, need, shapes[a.name], itemsize, P, ranks,
                            needs_grad.get(a.name, False))
                if inside:
                    recomputed.append(report.steps[0])
        if step.segment is not None:  # the forward again in backward, collectives included
            report.segment = step.segment
            report.backward_seconds += report.forward_seconds
            report.steps += [CommStep("backward", "recompute: " + st.what, st.op, st.bytes,
                                      st.peers, st.layout, st.dims) for st in recomputed]
            note = f"checkpointed (segment {step.segment}): recomputed in backward"
            report.note = f"{report.note}; {note}" if report.note else note
        if report.steps or report.kind not in ("meta", "size", "constant", "pointwise", "reshape"):
            layers.append(report)
    running = _coalesced_running(layers)
    if running is not None:
        layers.append(running)
    sync = _gradient_buckets(gm, analysis, P, ranks, itemsize, bucket_bytes)
    if sync is not None:
        layers.append(sync)
    result = Explanation(P, ranks, shape, itemsize, optimizer_states, layers, machine,
                         unsupported=list(analysis.unsupported))
    if baseline and P > 1:
        sample = ParallelConfig({"default": {"grid": {"N": P}, "algorithm": "sample"}},
                                world_size=P)
        try:
            result.baseline = _explain(model, sample, shape, machine, optimizer_states,
                                       itemsize, bucket_bytes, baseline=False, strict=strict)
        except Unsupported:  # the model cannot run purely sample-parallel: no comparison
            result.baseline = None
    return result


def _conversion(report: LayerReport, name: str, src: Placement, dst: Placement,
                shape: tuple[int, ...], isz: int, P: int, ranks: list[int],
                backward: bool) -> None:
    fwd = {r: conversion_bytes(src, dst, shape, isz, r) for r in ranks}
    what = f"redistribute {name}: {src.format()} -> {dst.format()}"
    report.steps.insert(0, CommStep("forward", what, "redistribute", fwd, P))
    if backward:
        bwd = {r: _backward_bytes(src, dst, shape, isz, r) for r in ranks}
        report.steps.append(CommStep("backward", "adjoint of " + what, "redistribute", bwd, P))


def _backward_bytes(src: Placement, dst: Placement, shape: tuple[int, ...], isz: int,
                    rank: int) -> int:
    """The adjoint's bytes: ``dst.dual -> src.dual`` on one grid; on two grids each rank receives
    back what it sent (the reverse exchange), plus the duals of the pending steps."""
    src = one_grid(src, dst, shape)  # one redistribution where that moves no more
    if src.layout == dst.layout:
        g = paper_grid(src.layout, rank)
        return conversion_bytes(Placement(dst.layout, dst.dist.dual(g)),
                                Placement(src.layout, src.dist.dual(g)), shape, isz, rank)
    from distconv.redistribute import plan_redistribution

    total = 0
    s_dist, d_dist = src.dist, dst.dist
    plain_src, plain_dst = s_dist.with_pending(()), d_dist.with_pending(())
    if d_dist.pending:
        g = paper_grid(dst.layout, rank)
        total += plan_redistribution(dst.layout, d_dist.dual(g), plain_dst.dual(g),
                                     shape).received_bytes(g, isz)
    total += repartition_bytes(src.layout, plain_src, dst.layout, plain_dst, shape, rank,
                               isz)[1]
    if s_dist.pending:
        g = paper_grid(src.layout, rank)
        total += plan_redistribution(src.layout, plain_src.dual(g), s_dist.dual(g),
                                     shape).received_bytes(g, isz)
    return total


def _layer(step: Step, modules: dict[str, nn.Module], shapes: dict[str, tuple[int, ...]],
           isz: int, P: int, ranks: list[int], grad_in: bool,
           machine: Machine | None) -> LayerReport:
    node, spec = step.node, step.layer
    out = step.out
    name = str(node.target) if node.op == "call_module" else node.name
    grid = layout_str(spec.layout) if spec is not None else (
        layout_str(out.layout) if out is not None else "-")
    dists = {"y": out.format("y")} if out is not None else {}
    report = LayerReport(name, step.kind, grid, spec.algorithm if spec else "-", dists)
    if out is not None and node.name in shapes:
        report.activation_elements = largest_block(out, shapes[node.name])
    if step.handler is not None and node.args and isinstance(node.args[0], fx.Node) and (
            node.args[0].name in shapes):
        module = modules.get(str(node.target)) if node.op == "call_module" else None
        ctx = PriceContext(shapes[node.args[0].name], isz, ranks, grad_in, machine,
                           shapes.get(node.name))
        step.handler.price(report, step, module, ctx)
    return report


def _coalesced_running(layers: list[LayerReport]) -> LayerReport | None:
    """The local-statistics layers' running-statistics broadcasts, as the parallel model sends
    them: one per grid and step, after the forward (each layer prices its own share)."""
    merged: dict[tuple, CommStep] = {}
    for lay in layers:
        keep = []
        for st in lay.steps:
            if st.op != "broadcast" or not st.what.startswith("running statistics"):
                keep.append(st)
                continue
            key = (st.layout, st.dims)
            if key not in merged:
                merged[key] = CommStep("forward", "running statistics of sample block 0: one "
                                       f"broadcast over {'×'.join(st.dims)} (asynchronous)",
                                       "broadcast", dict.fromkeys(st.bytes, 0), st.peers,
                                       st.layout, st.dims)
            for r, b in st.bytes.items():
                merged[key].bytes[r] += b
        lay.steps = keep
    if not merged:
        return None
    return LayerReport("(running statistics)", "bn-sync", "-", "-", {}, list(merged.values()))


def _gradient_buckets(gm: fx.GraphModule, analysis: Any, P: int, ranks: list[int], isz: int,
                      bucket_bytes: int) -> LayerReport | None:
    """The fused gradient allreduces, grouped and bucketed exactly as ParallelModel runs them."""
    from distconv.nn.sharding import ShardSpec
    from distconv.parallel.model import gradient_groups

    owners: dict[str, Step] = {str(s.node.target): s for s in analysis.steps
                               if s.layer is not None and s.node.op == "call_module"}
    order = {str(s.node.target): i for i, s in enumerate(analysis.steps)
             if s.node.op == "call_module"}
    params = dict(gm.named_parameters())
    specs: dict[str, ShardSpec] = {}
    for name, p in params.items():
        owner, _, leaf = name.rpartition(".")
        step = owners.get(owner)
        dists = None if step is None else step.handler.param_dists(step, gm.get_submodule(owner))
        dist = None if dists is None else dists[leaf]
        if dist is None:
            specs[name] = ShardSpec(None, Dist.replicated(p.dim()), tuple(p.shape))
        else:
            layout = step.layer.layout
            specs[name] = ShardSpec(paper_grid(layout, 0), Placement(layout, dist).dist,
                                    tuple(p.shape))
    report = LayerReport("(gradients)", "grad-sync", "-", "-", {})
    def ready_after(bucket: list[int], names: list[str]) -> str | None:
        """The layer whose backward completes the bucket: its first owner in forward order."""
        owned = [names[i].rpartition(".")[0] for i in bucket]
        known = [o for o in owned if o in order]
        return min(known, key=order.__getitem__) if len(known) == len(owned) else None

    for (layout, dims), names in gradient_groups(specs, params).items():
        if layout is None and P == 1:
            continue
        size = P if layout is None else math.prod(dict(layout)[d] for d in dims)
        per_rank: dict[int, list[int]] = {}
        for r in ranks:
            if layout is None:
                sizes, sub = [params[n].numel() for n in names], r
            else:
                g = paper_grid(layout, r)
                sizes = [math.prod(specs[n].dist.local_shape(specs[n].global_shape, g))
                         for n in names]
                sub = segment_rank(layout, dims, g.coords)
            # each bucket carries one reached-flag per parameter (BucketedGradSync)
            buckets = plan_buckets([n * isz for n in sizes], bucket_bytes)
            per_rank[r] = [allreduce_bytes(sum(sizes[i] for i in b) + len(b), sub, size, isz)
                           for b in buckets]
            if r == ranks[0]:
                after = [ready_after(list(b), names) for b in buckets]
        where = "every rank" if layout is None else f"{'×'.join(dims)} of {layout_str(layout)}"
        for i in range(len(per_rank[ranks[0]])):
            report.steps.append(CommStep("backward", f"gradient bucket {i} over {where} "
                                         f"({len(names)} parameters in the group)", "allreduce",
                                         {r: b[i] for r, b in per_rank.items()}, size,
                                         layout, tuple(dims) if layout is not None else (),
                                         after=after[i]))
    return report if report.steps else None


def _evaluated_ranks(analysis: Any, P: int) -> list[int]:
    """The ranks evaluated (:func:`~distconv.parallel.placement.evaluated_ranks`) over every
    layout a value of the analysis lives on."""
    layouts = {analysis.data}
    for step in analysis.steps:
        layouts.update(pl.layout for pl in [step.out, *step.needs.values()] if pl is not None)
    return evaluated_ranks(sorted(layouts), P)
