"""Resampling: ``nn.Upsample`` / ``F.interpolate`` (every mode torch has, ``size`` or
``scale_factor``, ``align_corners`` both ways) on values in any distribution; and the pooling
layers the halo-exchanging ones do not cover (adaptive pooling to other sizes than 1).

Every interpolation whose output rows read bounded windows of input rows -- ``nearest``,
``nearest-exact``, ``(bi/tri)linear``, ``bicubic`` and ``area``, by any ``size`` or
``scale_factor`` --
runs in place on split rows (:class:`~distconv.nn.resample.DistUpsample`: the halo rows each
output block reads, exchanged dim after dim, then torch's rows and weights applied locally); its
price is those halo rows, worked from the same plans. Where torch's gradient is not the adjoint of
its own interpolation for the global shape (a ``nearest`` or ``bicubic`` dim whose size the
factor keeps), or a split dim has fewer rows than ranks, the layer gathers the rows and runs torch
instead, priced as that conversion.

An antialiased interpolation, a spatial dim split over several grid dims, and the pooling
layers here (adaptive pooling modules and functions) mix rows and columns but never samples or
channels: the value keeps its sample and channel blocks, and its spatial dims are made whole on
each rank first (an allgather over the grid dims that split them, priced as the conversion it
is); the output is whole in them, and the next layer takes its own blocks of it (a local slice).
Exact for every mode.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from distconv.distribution import Dist
from distconv.nn.resample import (
    DistUpsample, Interpolation, in_place, upsample_halo_bytes, upsample_plans,
)
from distconv.ops.base import (
    SAMPLE_GRIDS, SIGNAL_GRIDS, VOLUME_GRIDS, Handler, PoolNet, PriceContext, Sample, SampleNet,
)
from distconv.pricing.timeline import CommStep
from distconv.parallel.placement import Placement, conversion_bytes, paper_grid

__all__ = ["ResampleHandler"]

#: rows split in uneven blocks: over H, over W, over both
_PLANE_GRIDS: tuple[tuple[int, dict], ...] = (
    (2, {"default": {"grid": {"N": 1, "H": 2}, "algorithm": "spatial"},
         "data": {"N": 1, "H": 2}}),
    (3, {"default": {"grid": {"N": 1, "W": 3}, "algorithm": "spatial"}}),
    (4, {"default": {"grid": {"H": 2, "W": 2}, "algorithm": "spatial"},
         "data": {"H": 2, "W": 2}}),
)


class ResampleHandler(Handler):
    """Resampling, and the pooling layers without a halo implementation (1-D and 3-D adaptive
    pooling, adaptive max pooling): ops that mix rows and columns (and depth) of one sample's
    channel only. Interpolations run in place on split rows (module docstring); the rest with
    those dims whole."""

    modules = (nn.Upsample,  # UpsamplingNearest2d / UpsamplingBilinear2d are subclasses
               nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
               nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
    functions = frozenset({F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear,
                           F.adaptive_avg_pool1d, F.adaptive_avg_pool3d, F.adaptive_max_pool1d,
                           F.adaptive_max_pool2d, F.adaptive_max_pool3d})

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import Step

        from distconv.parallel.steps import LayerSpec

        args = an.tensor_args(node)
        if len(args) != 1:
            an.fail(node, "give it one tensor input (its other arguments as numbers): it "
                    f"takes {len(args)}")
        p = an.placement(args[0]).settled()
        ext = dict(p.layout)
        split = [[g for g in p.dist.grid_dims_of(i) if ext.get(g, 1) > 1]
                 for i in range(2, p.ndim)]
        interp = _interpolation(node, module, p.ndim - 2)
        if interp is not None and any(split) and all(len(s) <= 1 for s in split):
            # an interpolation of split rows: in place, halos exchanged
            step = Step(node, "resample", p, {args[0]: p})
            step.layer = LayerSpec("upsample", str(node.target) if module is not None
                                   else node.name, p.layout, input=p)
            return step
        whole = Placement(p.layout, Dist(p.dist.entries[:2] + (None,) * (p.ndim - 2),
                                         frozenset(), p.dist.tensor_dims))
        return Step(node, "resample", whole, {args[0]: whole})

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        if step.layer is None or step.layer.kind != "upsample":
            return None
        p = step.layer.input
        interp = _placed(node, module, p.ndim - 2)
        return DistUpsample(grid=grid, input_dist=p.dist, **interp.kwargs())

    def price(self, report: Any, step: Any, module: Any, ctx: PriceContext) -> None:
        if step.layer is None or step.layer.kind != "upsample":
            return
        p = step.out
        nd = p.ndim - 2
        interp = _placed(step.node, module, nd)
        ext = dict(p.layout)
        dims = [next((g for g in p.dist.grid_dims_of(2 + i) if ext.get(g, 1) > 1), None)
                for i in range(nd)]
        # the maps of the precision the values have (torch's may differ by a row between them)
        dtype = torch.float64 if ctx.itemsize == 8 else torch.float32
        found = upsample_plans(interp, ctx.in_shape, dims, ext, dtype)
        if found is None:  # on this shape the layer runs torch on whole rows
            _price_whole_rows(report, p, ctx)
            return
        _, plans = found
        per = {}
        for r in ctx.ranks:
            g = paper_grid(p.layout, r)
            per[r] = upsample_halo_bytes(dims, plans, p.dist.local_shape(ctx.in_shape, g),
                                         g.coords, ctx.itemsize)
        order = [d for d, _, _ in per[ctx.ranks[0]]]
        for d in order:
            report.steps.append(CommStep("forward", f"halo exchange {d}", "alltoall",
                                         {r: next(f for g_, f, _ in per[r] if g_ == d)
                                          for r in ctx.ranks}, ext[d], p.layout, (d,)))
        if ctx.grad_in:
            for d in reversed(order):
                report.steps.append(CommStep("backward", f"halo accumulate {d}", "alltoall",
                                             {r: next(b for g_, _, b in per[r] if g_ == d)
                                              for r in ctx.ranks}, ext[d], p.layout, (d,)))

    def samples(self) -> Sequence[Sample]:
        return (
            Sample("upsample-nearest", lambda: SampleNet(nn.Upsample(scale_factor=2), 4),
                   (5, 4, 7, 6), SAMPLE_GRIDS),
            Sample("bilinear-align-corners",
                   lambda: SampleNet(nn.UpsamplingBilinear2d(scale_factor=2), 4),
                   (5, 4, 7, 6), SAMPLE_GRIDS),
            Sample("interpolate-size-bicubic",
                   lambda: SampleNet(_Interpolate(size=(9, 11), mode="bicubic",
                                                  align_corners=False), 4),
                   (5, 4, 7, 6), SAMPLE_GRIDS),
            Sample("interpolate-area", lambda: SampleNet(_Interpolate(size=(3, 4), mode="area"),
                                                         4), (5, 4, 7, 6), SAMPLE_GRIDS),
            Sample("upsample-bilinear-2x3",
                   lambda: SampleNet(nn.Upsample(scale_factor=(2, 3), mode="bilinear"), 4),
                   (5, 4, 7, 6), SAMPLE_GRIDS),
            Sample("upsample-trilinear", lambda: PoolNet(nn.Upsample(scale_factor=2,
                                                                     mode="trilinear"), 2, 3),
                   (5, 2, 5, 4, 3), VOLUME_GRIDS),
            Sample("interpolate-linear-signal",
                   lambda: PoolNet(_Interpolate(scale_factor=3, mode="linear"), 3, 1),
                   (5, 3, 7), SIGNAL_GRIDS),
            Sample("interpolate-nearest-volume",
                   lambda: PoolNet(_Interpolate(scale_factor=(1, 2, 2)), 2, 3),
                   (5, 2, 3, 4, 3), VOLUME_GRIDS[2:]),
            Sample("interpolate-size-bilinear-align-corners",
                   lambda: SampleNet(_Interpolate(size=(10, 13), mode="bilinear",
                                                  align_corners=True), 2),
                   (3, 2, 7, 8), _PLANE_GRIDS),
            Sample("upsample-nearest-fractional",
                   lambda: SampleNet(nn.Upsample(scale_factor=(1.5, 0.75)), 2),
                   (3, 2, 7, 8), _PLANE_GRIDS),
            Sample("interpolate-nearest-exact-down",
                   lambda: SampleNet(_Interpolate(size=(5, 11), mode="nearest-exact"), 2),
                   (3, 2, 7, 8), _PLANE_GRIDS),
            Sample("interpolate-bicubic-align-corners-scale",
                   lambda: SampleNet(_Interpolate(scale_factor=(1.7, 1.3), mode="bicubic",
                                                  align_corners=True,
                                                  recompute_scale_factor=False), 2),
                   (3, 2, 7, 8), _PLANE_GRIDS),
            Sample("interpolate-size-trilinear-align-corners",
                   lambda: PoolNet(_Interpolate(size=(4, 7, 2), mode="trilinear",
                                                align_corners=True), 2, 3),
                   (5, 2, 5, 4, 3), VOLUME_GRIDS),
            Sample("interpolate-linear-down-signal",
                   lambda: PoolNet(_Interpolate(scale_factor=0.7, mode="linear"), 3, 1),
                   (5, 3, 9), SIGNAL_GRIDS),
            Sample("interpolate-area-fraction",
                   lambda: SampleNet(_Interpolate(scale_factor=(0.5, 0.7), mode="area"), 2),
                   (3, 2, 7, 8), _PLANE_GRIDS),
            Sample("interpolate-area-volume",
                   lambda: PoolNet(_Interpolate(size=(2, 3, 2), mode="area"), 2, 3),
                   (5, 2, 5, 4, 3), VOLUME_GRIDS),
            Sample("interpolate-nearest-kept-size-signal",  # torch's gradient copies here
                   lambda: PoolNet(_Interpolate(scale_factor=1.3, mode="nearest"), 3, 1),
                   (5, 3, 3), SIGNAL_GRIDS),
            Sample("adaptive-max-pool", lambda: SampleNet(nn.AdaptiveMaxPool2d((2, 3)), 4),
                   (5, 4, 7, 6), SAMPLE_GRIDS),
            Sample("volume-pools", lambda: _Volume(), (5, 2, 6, 5, 4),
                   ((2, {"default": {"grid": {"N": 2}, "algorithm": "sample"}}),)),
        )


def _price_whole_rows(report: Any, p: Placement, ctx: PriceContext) -> None:
    """The price of :meth:`DistUpsample._on_whole_rows`: the conversion of the input to whole
    spatial dims (its adjoint in backward); the slice of the output moves nothing."""
    whole = Placement(p.layout, Dist(p.dist.entries[:2] + (None,) * (p.ndim - 2), frozenset(),
                                     p.dist.tensor_dims))
    what = f"spatial dims made whole: {p.dist.format()} -> {whole.dist.format()}"
    peers = math.prod(e for _, e in p.layout)
    report.steps.append(CommStep("forward", what, "redistribute", {
        r: conversion_bytes(p, whole, ctx.in_shape, ctx.itemsize, r) for r in ctx.ranks}, peers))
    if ctx.grad_in:
        back = {}
        for r in ctx.ranks:
            g = paper_grid(p.layout, r)
            back[r] = conversion_bytes(Placement(p.layout, whole.dist.dual(g)),
                                       Placement(p.layout, p.dist.dual(g)), ctx.in_shape,
                                       ctx.itemsize, r)
        report.steps.append(CommStep("backward", "adjoint of " + what, "redistribute", back,
                                     peers))


def _interpolate_args(node: Any, module: Any) -> dict[str, Any] | None:
    """``F.interpolate``'s arguments of an ``nn.Upsample`` or an interpolating call (None: an
    adaptive pooling)."""
    if module is not None:
        if not isinstance(module, nn.Upsample):
            return None
        return {"size": module.size, "scale_factor": module.scale_factor, "mode": module.mode,
                "align_corners": module.align_corners,
                "recompute_scale_factor": module.recompute_scale_factor}
    bind = _BINDERS.get(node.target)
    return None if bind is None else bind(*node.args, **node.kwargs)


def _interpolate(input: Any, size: Any = None, scale_factor: Any = None, mode: str = "nearest",
                 align_corners: Any = None, recompute_scale_factor: Any = None,
                 antialias: bool = False) -> dict[str, Any]:
    return {"size": size, "scale_factor": scale_factor, "mode": mode,
            "align_corners": align_corners, "recompute_scale_factor": recompute_scale_factor,
            "antialias": antialias}


def _upsample(input: Any, size: Any = None, scale_factor: Any = None, mode: str = "nearest",
              align_corners: Any = None) -> dict[str, Any]:
    return _interpolate(input, size, scale_factor, mode, align_corners)


def _upsample_nearest(input: Any, size: Any = None, scale_factor: Any = None) -> dict[str, Any]:
    return _interpolate(input, size, scale_factor, "nearest")


def _upsample_bilinear(input: Any, size: Any = None, scale_factor: Any = None) -> dict[str, Any]:
    return _interpolate(input, size, scale_factor, "bilinear", True)


#: every interpolating function's arguments, bound as the function binds them
_BINDERS = {F.interpolate: _interpolate, F.upsample: _upsample,
            F.upsample_nearest: _upsample_nearest, F.upsample_bilinear: _upsample_bilinear}


def _interpolation(node: Any, module: Any, spatial: int) -> Interpolation | None:
    """The interpolation when the node runs in place (:func:`~distconv.nn.resample.in_place`),
    else None."""
    a = _interpolate_args(node, module)
    if a is None or spatial < 1:
        return None
    return in_place(a["mode"], spatial=spatial, size=a["size"], scale_factor=a["scale_factor"],
                    align_corners=a["align_corners"],
                    recompute_scale_factor=a["recompute_scale_factor"],
                    antialias=a.get("antialias", False))


def _placed(node: Any, module: Any, spatial: int) -> Interpolation:
    """The interpolation of a node placed in place (it was placed so because there is one)."""
    interp = _interpolation(node, module, spatial)
    if interp is None:
        raise AssertionError(f"node {node.name!r} was placed in place but does not interpolate "
                             "in place")
    return interp


class _Interpolate(nn.Module):
    def __init__(self, **kw: Any) -> None:
        super().__init__()
        self.kw = kw

    def forward(self, x: Any) -> Any:
        return F.interpolate(x, **self.kw)


class _Volume(nn.Module):
    """A 3-D CNN: convolution, GroupNorm, max pooling, adaptive average pooling, head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.pool = nn.MaxPool3d(2, ceil_mode=True)
        self.squeeze = nn.AdaptiveAvgPool3d(1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Any) -> Any:
        x = self.pool(self.norm(self.conv(x)).relu())
        return self.head(self.squeeze(x).flatten(1))
