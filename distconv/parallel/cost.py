"""What a placed graph costs: every node priced by its op handler, the conversions between the
placements of its values, the running statistics' broadcasts and the gradient buckets, in forward
order (:class:`~distconv.pricing.timeline.LayerReport` per layer), on paper and with no
communication.

The one price of a config: :func:`distconv.explain` reports it, and the planner searches it (a
layer's report under a choice, a conversion's steps between two placements, the timeline of the
whole, :func:`distconv.pricing.timeline.timeline`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch.fx as fx
from torch import nn

from distconv.comm.base import allreduce_bytes
from distconv.distribution import Dist
from distconv.nn.grad_sync import gradient_groups, plan_buckets
from distconv.nn.sharding import ShardSpec
from distconv.ops import PriceContext
from distconv.pricing.machine import AnyMachine as Machine
from distconv.pricing.segments import conversion_segments
from distconv.pricing.timeline import CommStep, LayerReport, largest_block, segment_rank
from distconv.parallel.graph import operand_need
from distconv.parallel.placement import (
    Placement, conversion_bytes, evaluated_ranks, layout_str, one_grid, paper_grid,
    repartition_bytes,
)
from distconv.parallel.steps import Analysis, Step

__all__ = ["Move", "backward_bytes", "coalesced_running", "conversion", "conversions", "entry_report",
           "evaluated_analysis_ranks", "gradient_buckets", "kept", "layer_report", "memory",
           "price_analysis", "price_step"]


def price_analysis(gm: fx.GraphModule, analysis: Analysis, shape: tuple[int, ...],
                   shapes: dict[str, tuple[int, ...]], P: int, itemsize: int,
                   machine: Machine | None, bucket_bytes: int, decisions: dict[str, Any]
                   ) -> tuple[list[LayerReport], list[int]]:
    """The layer reports of ``analysis`` on the global input ``shape`` (``shapes``: every
    node's global shape) in forward order, the input's entry first, the running statistics and
    gradient buckets last, and the ranks evaluated; ``decisions``: the ``auto`` layers'
    choices, noted on their reports."""
    modules = dict(gm.named_modules())
    ranks = evaluated_analysis_ranks(analysis, P)
    needs_grad: dict[str, bool] = {}
    layers: list[LayerReport] = []
    layers.append(entry_report(analysis, shape, P, ranks))
    done: set[tuple[str, Placement, int | None]] = set()  # converted once per placement
    for step in analysis.steps[1:]:
        node = step.node
        grad_in = any(needs_grad.get(a.name, False) for a in step.needs)
        owns = node.op == "call_module" and any(True for _ in modules[node.target].parameters())
        needs_grad[node.name] = grad_in or owns
        moves = conversions(step, analysis.step, shapes, done)
        report = price_step(step, moves, modules, shapes, itemsize, P, ranks, grad_in,
                            needs_grad, machine)
        if report.name in decisions:
            decided = decisions[report.name].describe()
            report.note = f"{decided}; {report.note}" if report.note else decided
        if kept(report):
            layers.append(report)
    running = coalesced_running(layers)
    if running is not None:
        layers.append(running)
    sync = gradient_buckets(gm, analysis, P, ranks, itemsize, bucket_bytes)
    if sync is not None:
        layers.append(sync)
    return layers, ranks


def entry_report(analysis: Analysis, shape: tuple[int, ...], P: int, ranks: list[int]
                 ) -> LayerReport:
    """The model's input: where it arrives, and the allgather of local shapes that agrees on
    the global batch."""
    entry = LayerReport("(input)", "input", layout_str(analysis.data), "-",
                        {"x": analysis.steps[0].out.format("x")})
    if P > 1:
        entry.steps.append(CommStep("forward", "agree on the global batch: allgather of local "
                                    "shapes", "allgather",
                                    {r: (P - 1) * len(shape) * 8 for r in ranks}, P))
    return entry


#: a value converted between two placements for a step: (value, its placement, the placement the
#: step needs, whether the step converts it inside the value's own checkpointed segment)
Move = tuple[fx.Node, Placement, Placement, bool]


def conversions(step: Step, step_of: Any, shapes: dict[str, tuple[int, ...]],
                done: set[tuple[str, Placement, int | None]]) -> list[Move]:
    """The conversions ``step`` makes of its operands (``step_of``: the step of a value): each
    value is converted once per placement (``done`` holds those made, and takes these)."""
    moves = []
    for a in step.needs:
        need = operand_need(step, a, shapes)
        src_step = step_of(a)
        src = src_step.out
        # a value converted inside its own checkpointed segment is converted there, apart
        # from the conversions outside it (as the parallel model runs it)
        inside = step.segment is not None and src_step.segment == step.segment
        key = (a.name, need, step.segment if inside else None)
        if src != need and key not in done:
            done.add(key)
            moves.append((a, src, need, inside))
    return moves


def price_step(step: Step, moves: list[Move], modules: dict[str, nn.Module],
               shapes: dict[str, tuple[int, ...]], itemsize: int, P: int, ranks: list[int],
               grad_in: bool, needs_grad: dict[str, bool], machine: Machine | None
               ) -> LayerReport:
    """The report of one step: its handler's price, the conversions ``moves`` of its operands
    (and their adjoints where a gradient flows back), and in a checkpointed segment the
    forward again in backward."""
    report = layer_report(step, modules, shapes, itemsize, P, ranks, grad_in, machine)
    recomputed = [st for st in report.steps if st.phase == "forward"
                  and not st.what.startswith("running statistics")]
    for a, src, need, inside in moves:
        conversion(report, a.name, src, need, shapes[a.name], itemsize, P, ranks,
                   needs_grad.get(a.name, False))
        if inside:
            recomputed.append(report.steps[0])
    if step.segment is not None:  # the forward again in backward, collectives included
        report.segment = step.segment
        report.backward_seconds += report.forward_seconds
        report.steps += [CommStep("backward", "recompute: " + st.what, st.op, st.bytes,
                                  st.peers, st.layout, st.dims, groups=st.groups)
                           for st in recomputed]
        note = f"checkpointed (segment {step.segment}): recomputed in backward"
        report.note = f"{report.note}; {note}" if report.note else note
    return report


def kept(report: LayerReport) -> bool:
    """Whether a step's report is listed: it moves data, or it is more than a view, a constant
    or a pointwise op."""
    return bool(report.steps) or report.kind not in ("meta", "size", "constant", "pointwise", "reshape")


def memory(layers: list[LayerReport], itemsize: int, optimizer_states: int) -> dict[str, int]:
    """Bytes per rank (the largest rank): parameters, gradients, optimizer state, and the
    activations kept for backward -- every layer's output block, except that the layers of a
    checkpointed segment hold theirs only while it is recomputed (the largest segment)."""
    params = sum(layer.param_elements for layer in layers) * itemsize
    segments: dict[int, int] = {}
    kept_ = 0
    for lay in layers:
        if lay.segment is None:
            kept_ += lay.activation_elements
        else:
            segments[lay.segment] = segments.get(lay.segment, 0) + lay.activation_elements
    return {"parameters": params, "gradients": params,
            "optimizer_state": params * optimizer_states,
            "activations": (kept_ + max(segments.values(), default=0)) * itemsize}


def conversion(report: LayerReport, name: str, src: Placement, dst: Placement,
               shape: tuple[int, ...], isz: int, P: int, ranks: list[int],
               backward: bool) -> None:
    """The conversion of ``name`` from ``src`` to ``dst`` (and its adjoint with ``backward``) on
    ``report``: the bytes each evaluated rank receives, run among the segments of the first and
    the last rank (the ranks they exchange data with:
    :func:`~distconv.pricing.segments.conversion_segments`), the adjoint on the same segments.
    With the balanced, row-major layouts used here every segment of a conversion is a
    translate of these (the same size and span); finding every evaluated rank's would cost a
    search from each per conversion priced, and the price must not depend on which ranks a
    caller evaluates."""
    fwd = {r: conversion_bytes(src, dst, shape, isz, r) for r in ranks}
    groups = conversion_segments(src, dst, shape, (0, P - 1))
    peers = max((len(g) for g in groups), default=1)
    what = f"redistribute {name}: {src.format()} -> {dst.format()}"
    report.steps.insert(0, CommStep("forward", what, "redistribute", fwd, peers, groups=groups))
    if backward:
        bwd = {r: backward_bytes(src, dst, shape, isz, r) for r in ranks}
        report.steps.append(CommStep("backward", "adjoint of " + what, "redistribute", bwd,
                                     peers, groups=groups))


def backward_bytes(src: Placement, dst: Placement, shape: tuple[int, ...], isz: int,
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


def layer_report(step: Step, modules: dict[str, nn.Module], shapes: dict[str, tuple[int, ...]],
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


def coalesced_running(layers: list[LayerReport]) -> LayerReport | None:
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


def gradient_buckets(gm: fx.GraphModule, analysis: Any, P: int, ranks: list[int], isz: int,
                      bucket_bytes: int, cache: dict | None = None) -> LayerReport | None:
    """The fused gradient allreduces, grouped and bucketed exactly as ParallelModel runs them.

    ``cache``: a dict kept across analyses of ``gm`` (the planner prices many plans of one
    graph), in which each parameter's placement is kept per its owner's layer and placements,
    and each group's buckets per the group's layout, dims, parameters and their
    distributions; the report is the same with it or without."""
    owners: dict[str, Step] = {str(s.node.target): s for s in analysis.steps
                               if s.layer is not None and s.node.op == "call_module"}
    order = {str(s.node.target): i for i, s in enumerate(analysis.steps)
             if s.node.op == "call_module"}
    if cache is None:
        params = dict(gm.named_parameters())
    else:
        params = cache.get(("parameters",))
        if params is None:
            params = cache[("parameters",)] = dict(gm.named_parameters())
    specs: dict[str, ShardSpec] = {}
    groups: dict[tuple, list[str]] | None = None if cache is None else {}
    for name, p in params.items():
        owner, _, leaf = name.rpartition(".")
        step = owners.get(owner)
        # (a step by identity, kept in the entry: the planner's steps live as long as it does)
        key = None if cache is None else ("spec", name, id(step))
        got = None if key is None else cache.get(key)
        spec = got[1] if got is not None and got[0] is step else None
        if spec is None:
            dists = None if step is None else step.handler.param_dists(step, gm.get_submodule(owner))
            dist = None if dists is None else dists[leaf]
            if dist is None:
                spec = ShardSpec(None, Dist.replicated(p.dim()), tuple(p.shape))
            else:
                layout = step.layer.layout
                spec = ShardSpec(paper_grid(layout, 0), Placement(layout, dist).dist,
                                 tuple(p.shape))
            if key is not None:
                # its group, as gradient_groups finds it (in parameter order below)
                one = gradient_groups({name: spec}, {name: p})
                cache[key] = (step, spec, next(iter(one), None))
        specs[name] = spec
        if groups is not None:
            group = cache[key][2]
            if group is not None:
                groups.setdefault(group, []).append(name)
    report = LayerReport("(gradients)", "grad-sync", "-", "-", {})
    def ready_after(bucket: list[int], names: list[str]) -> str | None:
        """The layer whose backward completes the bucket: its first owner in forward order."""
        owned = [names[i].rpartition(".")[0] for i in bucket]
        known = [o for o in owned if o in order]
        return min(known, key=order.__getitem__) if len(known) == len(owned) else None

    if groups is None:
        groups = gradient_groups(specs, params)
    for (layout, dims), names in groups.items():
        if layout is None and P == 1:
            continue
        key = None if cache is None else (
            "group", layout, dims, tuple(names), tuple(id(specs[n]) for n in names),
            tuple(ranks), P, isz, bucket_bytes,
            tuple(order.get(n.rpartition(".")[0]) for n in names))
        if key is not None and key in cache:
            report.steps += cache[key]
            continue
        size = P if layout is None else math.prod(dict(layout)[d] for d in dims)
        per_rank: dict[int, list[int]] = {}
        for r in ranks:
            if layout is None:
                sizes, sub = [params[n].numel() for n in names], r
            else:
                sizes = [_local_numel(layout, specs[n].dist, specs[n].global_shape, r)
                         for n in names]
                sub = segment_rank(layout, dims, paper_grid(layout, r).coords)
            # each bucket carries one reached-flag per parameter (BucketedGradSync)
            buckets = plan_buckets([n * isz for n in sizes], bucket_bytes)
            per_rank[r] = [allreduce_bytes(sum(sizes[i] for i in b) + len(b), sub, size, isz)
                           for b in buckets]
            if r == ranks[0]:
                after = [ready_after(list(b), names) for b in buckets]
        where = "every rank" if layout is None else f"{'×'.join(dims)} of {layout_str(layout)}"
        steps = [CommStep("backward", f"gradient bucket {i} over {where} "
                          f"({len(names)} parameters in the group)", "allreduce",
                          {r: b[i] for r, b in per_rank.items()}, size,
                          layout, tuple(dims) if layout is not None else (), after=after[i])
                 for i in range(len(per_rank[ranks[0]]))]
        if key is not None:
            cache[key] = steps
        report.steps += steps
    return report if report.steps else None


@functools.lru_cache(maxsize=1 << 14)
def _local_numel(layout: Any, dist: Dist, shape: tuple[int, ...], rank: int) -> int:
    """Elements of ``rank``'s block of a tensor of global ``shape`` in ``dist`` on ``layout``
    (cached: a plan's parameters are priced again with every other layer's choice)."""
    return math.prod(dist.local_shape(shape, paper_grid(layout, rank)))


def evaluated_analysis_ranks(analysis: Any, P: int) -> list[int]:
    """The ranks evaluated (:func:`~distconv.parallel.placement.evaluated_ranks`) over every
    layout a value of the analysis lives on."""
    layouts = {analysis.data}
    for step in analysis.steps:
        layouts.update(pl.layout for pl in [step.out, *step.needs.values()] if pl is not None)
    return evaluated_ranks(sorted(layouts), P)
