"""Resampling: ``nn.Upsample`` / ``F.interpolate`` (every mode torch has for 4-d inputs, ``size``
or ``scale_factor``, ``align_corners`` both ways) on values in any distribution; and the pooling
layers the halo-exchanging ones do not cover (adaptive pooling to other sizes than 1).

Interpolation mixes rows and columns but never samples or channels: the value keeps its sample
and channel blocks, and its rows and columns are made whole on each rank first (an allgather over
the grid dims that split them, priced as the conversion it is); the output is whole in rows and
columns, and the next layer takes its own blocks of it (a local slice). Exact for every mode; each
rank of a row/column group computes the whole image of its samples and channels.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch.nn.functional as F
from torch import nn

from distconv.distribution import Dist
from distconv.ops.base import SAMPLE_GRIDS, Handler, Sample, SampleNet
from distconv.parallel.placement import Placement

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

        args = an.tensor_args(node)
        if len(args) != 1:
            an.fail(node, f"expected one tensor input, got {len(args)}")
        p = an.placement(args[0]).settled()
        whole = Placement(p.layout, Dist(p.dist.entries[:2] + (None,) * (p.ndim - 2),
                                         frozenset(), p.dist.tensor_dims))
        return Step(node, "resample", whole, {args[0]: whole})

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
            Sample("adaptive-max-pool", lambda: SampleNet(nn.AdaptiveMaxPool2d((2, 3)), 4),
                   (5, 4, 7, 6), SAMPLE_GRIDS),
            Sample("volume-pools", lambda: _Volume(), (5, 2, 6, 5, 4),
                   ((2, {"default": {"grid": {"N": 2}, "algorithm": "sample"}}),)),
        )


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
