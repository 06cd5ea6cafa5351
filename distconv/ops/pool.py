"""Pooling in its input's distribution: max and average pooling (halo exchanges over the split
spatial dims), global average pooling (``AdaptiveAvgPool2d((1, 1))``,
``F.adaptive_avg_pool2d``) and spatial means (``x.mean((2, 3))``), whose results over split
rows/columns are pending sums over those grid dims."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from distconv.distribution import Dist
from distconv.ops.base import (
    SAMPLE_GRIDS, SIGNAL_GRIDS, VOLUME_GRIDS, Handler, PoolNet, PriceContext, Sample, SampleNet,
)
from distconv.pricing.timeline import CommStep, block_index
from distconv.parallel.placement import Placement, paper_grid

__all__ = ["AdaptiveAvgPoolHandler", "AdaptivePoolHandler", "MeanHandler", "PoolHandler",
           "ReduceHandler"]


def _as_module(node: Any) -> nn.Module:
    """The pooling module a functional call (``F.max_pool2d(x, ...)``) stands for."""
    from distconv.nn.pool import _FUNCTIONS

    cls, bind = _FUNCTIONS[node.target]
    o = bind(*node.args[1:], **node.kwargs)
    if "dilation" in o:
        return cls._plain(o["kernel_size"], o["stride"], o["padding"], o["dilation"],
                          o["return_indices"], o["ceil_mode"])
    if cls._dims == 1:
        return cls._plain(o["kernel_size"], o["stride"], o["padding"], o["ceil_mode"],
                          o["count_include_pad"])
    return cls._plain(o["kernel_size"], o["stride"], o["padding"], o["ceil_mode"],
                      o["count_include_pad"], o["divisor_override"])


def _tuple(value: Any, k: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * k


def _may_be_empty(p: Placement, grid: Any) -> bool:
    """Whether a rank's channel block of ``p`` may be empty (its channels split: fewer channels
    than parts leave some ranks none); torch's pooling refuses an empty channel dim."""
    ext = dict(grid.layout)
    return any(ext.get(g, 1) > 1 for g in p.dist.grid_dims_of(1))


class PoolHandler(Handler):
    """Max and average pooling over 1, 2 or 3 spatial dims, in their input's distribution
    (halo exchanges over the split spatial dims: :mod:`distconv.nn.pool`)."""

    modules = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d,
               nn.AvgPool3d)
    functions = frozenset({F.max_pool1d, F.max_pool2d, F.max_pool3d, torch.max_pool1d,
                           torch.max_pool2d, torch.max_pool3d, F.avg_pool1d, F.avg_pool2d,
                           F.avg_pool3d})

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import LayerSpec

        step = an.keep(node, "pool")
        dist = step.out.dist
        split = any(dist.entries[i] is not None for i in range(2, dist.ndim))
        name = str(node.target) if module is not None else node.name
        step.layer = LayerSpec("pool" if split else "local", name, step.out.layout,
                               input=step.out)
        return step

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        from distconv.nn import pool

        if step.layer.kind != "pool" and not _may_be_empty(step.out, grid):
            return None  # spatial dims whole: the plain call runs on local blocks
        # (a layer also where a rank's channel block may be empty: the layer returns it empty)

        if module is None:
            return pool.from_function(node.target, node.args[1:], dict(node.kwargs), grid=grid,
                                      input_dist=step.layer.input.dist)
        return pool.from_module(module, grid=grid, input_dist=step.layer.input.dist)

    def price(self, report: Any, step: Any, module: Any, ctx: PriceContext) -> None:
        from distconv.nn.pool import _NestedHaloPlan, pool_dim

        if step.layer is None or step.layer.kind != "pool":
            return
        if module is None:
            module = _as_module(step.node)
        p, isz, ranks, x_shape = step.out, ctx.itemsize, ctx.ranks, ctx.in_shape
        nd = len(x_shape) - 2
        k = _tuple(module.kernel_size, nd)
        st = _tuple(module.stride if module.stride else module.kernel_size, nd)
        pad = _tuple(module.padding, nd)
        dil = _tuple(getattr(module, "dilation", 1), nd)
        ext = dict(p.layout)
        splits = [tuple(g for g in p.dist.grid_dims_of(2 + i) if ext.get(g, 1) > 1)
                  for i in range(nd)]
        plans = [_NestedHaloPlan(pool_dim(x_shape[2 + i], k[i], st[i], pad[i], dil[i],
                                          module.ceil_mode),
                                 max(1, math.prod(ext[g] for g in s)),
                                 extents=tuple(ext[g] for g in s)) for i, s in enumerate(splits)]
        rows: dict[str, list[dict[int, int]]] = {
            ph: [{r: 0 for r in ranks} for _ in range(nd)] for ph in ("forward", "backward")}
        for r in ranks:
            g = paper_grid(p.layout, r)
            local = p.dist.local_shape(x_shape, g)
            idx = [block_index(s, ext, g.coords) for s in splits]
            # the widths when dim i is exchanged: earlier dims haloed, later ones as owned
            widths = [plans[j].needed[idx[j]][1] - plans[j].needed[idx[j]][0]
                      for j in range(nd)]
            for i in range(nd):
                if splits[i]:
                    other = local[0] * local[1] * math.prod(
                        widths[j] if j < i else local[2 + j] for j in range(nd) if j != i)
                    rows["forward"][i][r] = plans[i].halo_rows_received(idx[i]) * other * isz
                    rows["backward"][i][r] = plans[i].halo_rows_sent(idx[i]) * other * isz
        names = "DHW"[3 - nd:]
        for i, dim in enumerate(names):
            if splits[i]:
                peers = plans[i].parts
                report.steps.append(CommStep("forward", f"halo exchange {dim}", "alltoall",
                                             rows["forward"][i], peers, p.layout, splits[i]))
                if ctx.grad_in:
                    report.steps.append(CommStep("backward", f"halo accumulate {dim}",
                                                 "alltoall", rows["backward"][i], peers,
                                                 p.layout, splits[i]))

    def samples(self) -> Sequence[Sample]:
        return (Sample("maxpool", lambda: SampleNet(nn.MaxPool2d(3, 2, padding=1), 4),
                       (5, 4, 9, 8), SAMPLE_GRIDS),
                Sample("avgpool", lambda: SampleNet(nn.AvgPool2d(2, ceil_mode=True), 4),
                       (5, 4, 9, 7), SAMPLE_GRIDS),
                Sample("F.max_pool2d", lambda: SampleNet(_Functional(F.max_pool2d, 3, 2, 1), 4),
                       (5, 4, 9, 8), SAMPLE_GRIDS),
                Sample("F.avg_pool2d", lambda: SampleNet(_Functional(F.avg_pool2d, 2), 4),
                       (5, 4, 8, 7), SAMPLE_GRIDS),
                Sample("maxpool3d", lambda: PoolNet(nn.MaxPool3d(3, 2, 1, ceil_mode=True), 2, 3),
                       (5, 2, 7, 6, 5), VOLUME_GRIDS),
                Sample("avgpool3d", lambda: PoolNet(nn.AvgPool3d((2, 3, 2), 2, (1, 1, 0),
                                                                 count_include_pad=False), 2, 3),
                       (5, 2, 7, 6, 5), VOLUME_GRIDS),
                Sample("F.max_pool3d", lambda: PoolNet(_Functional(F.max_pool3d, 2), 2, 3),
                       (5, 2, 6, 5, 4), VOLUME_GRIDS[2:]),
                Sample("maxpool1d", lambda: PoolNet(nn.MaxPool1d(3, 2, 1, 2), 3, 1), (5, 3, 11),
                       SIGNAL_GRIDS),
                Sample("avgpool1d", lambda: PoolNet(nn.AvgPool1d(3, 2, 1, ceil_mode=True), 3, 1),
                       (5, 3, 10), SIGNAL_GRIDS))


class AdaptiveAvgPoolHandler(Handler):
    modules = (nn.AdaptiveAvgPool2d,)
    functions = frozenset({F.adaptive_avg_pool2d})

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import LayerSpec

        if module is not None:
            name, size = str(node.target), module.output_size
        else:
            name = node.name
            size = node.args[1] if len(node.args) > 1 else node.kwargs["output_size"]
        step = an.keep(node, "pool")
        p = step.out
        spatial = [g for i in (2, 3) for g in p.dist.grid_dims_of(i)]
        if not spatial:
            step.layer = LayerSpec("local", name, p.layout, input=p)
            return step
        sizes = (size, size) if not isinstance(size, (tuple, list)) else tuple(size)
        if sizes != (1, 1):  # rows and columns made whole first (an allgather), then local
            whole = Placement(p.layout, Dist(p.dist.entries[:2] + (None, None)))
            step.out, step.needs = whole, {a: whole for a in step.needs}
            step.layer = LayerSpec("local", name, p.layout, input=whole)
            return step
        entries = p.dist.entries[:2] + (None, None)
        step.out = Placement(p.layout, Dist(entries, frozenset(spatial)))
        step.layer = LayerSpec("adaptive", name, p.layout, input=p)
        return step

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        if step.layer.kind != "adaptive":
            return None
        from distconv.nn import pool

        if module is None:  # the functional form runs as its module
            module = nn.AdaptiveAvgPool2d(node.args[1] if len(node.args) > 1
                                          else node.kwargs["output_size"])
        return pool.from_module(module, grid=grid, input_dist=step.layer.input.dist)

    def samples(self) -> Sequence[Sample]:
        return (Sample("adaptive-avgpool", lambda: SampleNet(nn.AdaptiveAvgPool2d(1), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS),
                Sample("adaptive-avgpool-2x3", lambda: SampleNet(nn.AdaptiveAvgPool2d((2, 3)), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS))


class AdaptivePoolHandler(Handler):
    """Adaptive pooling besides ``AdaptiveAvgPool2d``: average pooling of signals and volumes
    (``AdaptiveAvgPool1d/3d``, MONAI's 3-D squeeze-and-excitation) and max pooling of any.
    Average pooling to one row per spatial dim over split rows is a local sum over the global
    count, a pending sum over the grid dims that split them (as ``x.mean``); any other size, and
    max pooling (whose maximum over blocks no sum completes), makes the spatial dims whole
    first (an allgather) and pools locally."""

    modules = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
               nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
    functions = frozenset({F.adaptive_avg_pool1d, F.adaptive_avg_pool3d, F.adaptive_max_pool1d,
                           F.adaptive_max_pool2d, F.adaptive_max_pool3d})
    runs_locally = True

    def runs_as_traced(self, step: Any) -> bool:
        return step.layer is None

    def run(self, node: Any, args: Any, kwargs: Any, in_shape: tuple[int, ...]) -> Any:
        """This block's part of the average over every spatial dim (one output row each)."""
        dims = tuple(range(2, len(in_shape)))
        return args[0].sum(dims, keepdim=True) / math.prod(in_shape[2:])

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import LayerSpec

        if module is not None:
            name, size = str(node.target), module.output_size
            average = isinstance(module, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool3d))
            indices = bool(getattr(module, "return_indices", False))
        else:
            name = node.name
            size = node.kwargs.get("output_size", node.args[1] if len(node.args) > 1 else None)
            average = node.target in (F.adaptive_avg_pool1d, F.adaptive_avg_pool3d)
            indices = bool(node.kwargs.get("return_indices",
                                           node.args[2] if len(node.args) > 2 else False))
        if indices:
            an.fail(node, "pool without the indices (return_indices=False): adaptive max pooling "
                    "with return_indices=True is not supported (its indices are positions in a "
                    "block)")
        step = an.keep(node, "pool")
        p = step.out
        spatial = range(2, p.ndim)
        split = [g for d in spatial for g in p.dist.grid_dims_of(d)]
        if not split:
            return step  # every rank holds whole rows: the traced call pools its block
        sizes = tuple(size) if isinstance(size, (tuple, list)) else (size,) * len(spatial)
        entries = p.dist.entries[:2] + (None,) * len(spatial)
        if average and all(n == 1 for n in sizes):
            step.out = Placement(p.layout, Dist(entries, frozenset(split)))
            step.layer = LayerSpec("adaptive-mean", name, p.layout, input=p)
            return step
        whole = Placement(p.layout, Dist(entries))
        step.out, step.needs = whole, {a: whole for a in step.needs}
        return step

    def samples(self) -> Sequence[Sample]:
        return (Sample("adaptive-max-2d", lambda: SampleNet(nn.AdaptiveMaxPool2d((1, 2)), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS),
                Sample("adaptive-avg-3d", lambda: PoolNet(nn.AdaptiveAvgPool3d(1), 2, 3),
                       (5, 2, 4, 5, 3), VOLUME_GRIDS),
                # (over D×H, explain prices the backward of the gather whole per rank
                # otherwise than it runs, as for any value gathered over two grid dims)
                Sample("adaptive-pools-3d", lambda: PoolNet(nn.Sequential(
                    nn.AdaptiveAvgPool3d((2, 1, 3)), nn.AdaptiveMaxPool3d(1)), 2, 3),
                    (5, 2, 4, 5, 3), VOLUME_GRIDS[:3]),
                Sample("adaptive-avg-max-1d", lambda: PoolNet(nn.Sequential(
                    nn.AdaptiveAvgPool1d(1), nn.AdaptiveMaxPool1d(1)), 3, 1), (5, 3, 10),
                    SIGNAL_GRIDS))


def reduced_dims(node: Any, ndim: int) -> tuple[tuple[int, ...], bool]:
    """The dims a reduction node (``x.mean(dims, keepdim)``, ``torch.sum(x, dims)``, ...) of a
    value of ``ndim`` dims reduces, sorted and non-negative, and its ``keepdim``."""
    dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    keep = bool(node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False))
    dims = (dims,) if isinstance(dims, int) else tuple(dims or ())
    return tuple(sorted(d % ndim for d in dims)), keep


class MeanHandler(Handler):
    """``x.mean(dims)`` over non-sample dims: a local sum over the global count, a pending sum
    over the grid dims that split those dims (as global average pooling)."""

    functions = frozenset({torch.mean})
    methods = frozenset({"mean"})
    runs_locally = True

    def runs_as_traced(self, step: Any) -> bool:
        """Where no rank shares the averaged dims (no pending sum over more than one rank) the
        block's own mean is the value: the traced call, torch's kernel, runs as written."""
        extent = dict(step.out.layout)
        return all(extent.get(g, 1) == 1 for g in step.out.dist.pending)

    def run(self, node: Any, args: Any, kwargs: Any, in_shape: tuple[int, ...]) -> Any:
        """The local part of ``x.mean(dims)``: a sum over the local block over the global count
        (the blocks' parts add up to the mean: a pending sum over the grid dims that split
        ``dims``)."""
        dims, keep = reduced_dims(node, len(in_shape))
        count = math.prod(in_shape[d] for d in dims)
        return args[0].sum(dims, keepdim=keep) / count

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import LayerSpec, Step

        args = an.tensor_args(node)
        p = an.placement(args[0]).settled()
        dims, keep = reduced_dims(node, p.ndim)
        if not dims or 0 in dims or node.kwargs.get("dtype") is not None:
            an.fail(node, "Take the mean over other dims than the samples' (e.g. x.mean((2, "
                    "3))), and over the samples in the loss: mean is supported over non-sample "
                    "dims")
        split = [g for d in dims for g in p.dist.grid_dims_of(d)]
        entries = [None if i in dims else e for i, e in enumerate(p.dist.entries)]
        if not keep:
            entries = [e for i, e in enumerate(entries) if i not in dims]
        out = Placement(p.layout, Dist(tuple(entries), frozenset(split)))
        return Step(node, "mean", out, {args[0]: p},
                    LayerSpec("mean", node.name, p.layout, input=p))

    def samples(self) -> Sequence[Sample]:
        return (Sample("spatial-mean", lambda: SampleNet(nn.Identity(), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),)


class ReduceHandler(Handler):
    """``x.sum(dims)``, ``x.amax(dims)``, ``x.amin(dims)`` over non-sample dims (CBAM's channel
    and spatial gates). A sum over split dims is the block's own sum, a pending sum over the
    grid dims that split them; a maximum or minimum, which no sum completes, makes those dims
    whole first (an allgather) and reduces locally."""

    functions = frozenset({torch.sum, torch.amax, torch.amin})
    methods = frozenset({"sum", "amax", "amin"})
    samples_anywhere = True  # (a stack's new dim before the samples: torch.stack(fs).sum(0))

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import Step, samples_of

        args = an.tensor_args(node)
        p = an.placement(args[0]).settled()
        dims, keep = reduced_dims(node, p.ndim)
        what = getattr(node.target, "__name__", node.target)
        samples = samples_of(args[0])[0]
        if not dims or samples in dims or node.kwargs.get("dtype") is not None:
            an.fail(node, f"Reduce other dims than the samples' (e.g. x.{what}((2, 3))), and "
                    f"the samples in the loss: {what} is supported over non-sample dims (the "
                    f"samples are in dim {samples})")
        split = frozenset(g for d in dims for g in p.dist.grid_dims_of(d))
        entries = [None if i in dims else e for i, e in enumerate(p.dist.entries)]
        need = p if what == "sum" else Placement(p.layout, Dist(tuple(entries)))
        if not keep:
            entries = [e for i, e in enumerate(entries) if i not in dims]
        pending = split if what == "sum" else frozenset()
        return Step(node, "reduce", Placement(p.layout, Dist(tuple(entries), pending)),
                    {args[0]: need}, samples=samples if keep else samples - sum(
                        d < samples for d in dims))

    def samples(self) -> Sequence[Sample]:
        return (Sample("sum-amax-gates", lambda: SampleNet(_Gates(), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),)


class _Gates(nn.Module):
    """CBAM's gates: channel attention from the spatial sum and maximum, spatial attention from
    the channel maximum and minimum."""

    def forward(self, x: Any) -> Any:
        c = torch.sigmoid(x.sum((2, 3), keepdim=True) / 42 + x.amax((2, 3), keepdim=True))
        x = x * c
        return x * torch.sigmoid(torch.amax(x, 1, keepdim=True) - x.amin(dim=1, keepdim=True))


class _Functional(nn.Module):
    """A functional pooling call, as a model writes it in ``forward``."""

    def __init__(self, fn: Any, *args: Any) -> None:
        super().__init__()
        self.fn, self.args = fn, args

    def forward(self, x: Any) -> Any:
        return self.fn(x, *self.args)
