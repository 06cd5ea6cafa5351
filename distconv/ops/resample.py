"""Resampling: ``nn.Upsample`` / ``F.interpolate`` (every mode torch has, ``size`` or
``scale_factor``, ``align_corners`` both ways) on values in any distribution; and the pooling
layers the halo-exchanging ones do not cover (adaptive pooling to other sizes than 1).

Upsampling by integer factors with ``nearest`` or ``(bi/tri)linear`` (``align_corners=False``)
runs in place on split rows (:class:`~distconv.nn.resample.DistUpsample`: the halo rows each output
block reads, exchanged dim after dim). Any other interpolation mixes rows and columns but never
samples or channels: the value keeps its sample and channel blocks, and its spatial dims are made
whole on each rank first (an allgather over the grid dims that split them, priced as the
conversion it is); the output is whole in them, and the next layer takes its own blocks of it (a
local slice). Exact for every mode.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch.nn.functional as F
from torch import nn

from distconv.conv_geometry import HaloPlan
from distconv.distribution import Dist
from distconv.nn.resample import DistUpsample, UpsampleDim, in_place, upsample_halo_bytes
from distconv.ops.base import (
    SAMPLE_GRIDS, SIGNAL_GRIDS, VOLUME_GRIDS, Handler, PoolNet, PriceContext, Sample, SampleNet,
)
from distconv.ops.pricing import CommStep
from distconv.parallel.placement import Placement, paper_grid

__all__ = ["ResampleHandler"]


class ResampleHandler(Handler):
    """Resampling, and the pooling layers without a halo implementation (1-D and 3-D pooling,
    adaptive max pooling): ops that mix rows and columns (and depth) of one sample's channel
    only, run with those dims whole."""

    modules = (nn.Upsample,  # UpsamplingNearest2d / UpsamplingBilinear2d are subclasses
               nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
               nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
    functions = frozenset({F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear,
                           F.adaptive_avg_pool1d, F.adaptive_avg_pool3d, F.adaptive_max_pool1d,
                           F.adaptive_max_pool2d, F.adaptive_max_pool3d})

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.graph import Step

        from distconv.parallel.graph import LayerSpec

        args = an.tensor_args(node)
        if len(args) != 1:
            an.fail(node, f"expected one tensor input, got {len(args)}")
        p = an.placement(args[0]).settled()
        ext = dict(p.layout)
        split = [[g for g in p.dist.grid_dims_of(i) if ext.get(g, 1) > 1]
                 for i in range(2, p.ndim)]
        scale = _upsampling(node, module, p.ndim - 2)
        if scale is not None and any(split) and all(len(s) <= 1 for s in split):
            # an integer upsampling of split rows: in place, halos exchanged
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
        scale = _upsampling(node, module, p.ndim - 2)
        return DistUpsample(scale, _mode(node, module), grid=grid, input_dist=p.dist)

    def price(self, report: Any, step: Any, module: Any, ctx: PriceContext) -> None:
        if step.layer is None or step.layer.kind != "upsample":
            return
        p = step.out
        nd = p.ndim - 2
        scale = _upsampling(step.node, module, nd)
        linear = _mode(step.node, module) != "nearest"
        ext = dict(p.layout)
        dims = [next((g for g in p.dist.grid_dims_of(2 + i) if ext.get(g, 1) > 1), None)
                for i in range(nd)]
        plans = [None if d is None else HaloPlan(UpsampleDim(ctx.in_shape[2 + i], scale[i],
                                                              linear), ext[d])
                 for i, d in enumerate(dims)]
        for plan, d in zip(plans, dims):
            if plan is not None:
                plan.check(d)
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
            Sample("adaptive-max-pool", lambda: SampleNet(nn.AdaptiveMaxPool2d((2, 3)), 4),
                   (5, 4, 7, 6), SAMPLE_GRIDS),
            Sample("volume-pools", lambda: _Volume(), (5, 2, 6, 5, 4),
                   ((2, {"default": {"grid": {"N": 2}, "algorithm": "sample"}}),)),
        )


def _interpolate_args(node: Any, module: Any) -> dict[str, Any]:
    if module is not None:
        return {"size": module.size, "scale_factor": module.scale_factor, "mode": module.mode,
                "align_corners": module.align_corners,
                "recompute_scale_factor": module.recompute_scale_factor}
    if node.target is not F.interpolate:
        return {"mode": None}  # the other upsample functions: on whole dims

    def bind(input: Any, size: Any = None, scale_factor: Any = None, mode: str = "nearest",
             align_corners: Any = None, recompute_scale_factor: Any = None,
             antialias: bool = False) -> dict[str, Any]:
        return {"size": size, "scale_factor": scale_factor, "mode": mode,
                "align_corners": align_corners, "recompute_scale_factor": recompute_scale_factor,
                "antialias": antialias}

    return bind(*node.args, **node.kwargs)


def _mode(node: Any, module: Any) -> str:
    return _interpolate_args(node, module)["mode"]


def _upsampling(node: Any, module: Any, spatial: int) -> tuple[int, ...] | None:
    """The integer scale per spatial dim of an upsampling that runs in place, else None."""
    if module is not None and not isinstance(module, nn.Upsample):
        return None
    if module is None and node.target is not F.interpolate:
        return None
    a = _interpolate_args(node, module)
    if a.get("antialias") or spatial < 1:
        return None
    return in_place(a["mode"], a["scale_factor"], a["align_corners"], a["size"], spatial,
                    a["recompute_scale_factor"])


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
