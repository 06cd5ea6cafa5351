"""Normalisation: ``BatchNorm2d`` and ``SyncBatchNorm`` with the statistics of the whole global
batch (:class:`~distconv.nn.DistBatchNorm2d`), in its input's distribution.

Per rank: forward, an allgather of (count, mean, M2) per local channel over the statistics
segment (the grid dims of the N, H and W entries); backward, an allreduce of (Σdy, Σdy·x̂).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from torch import nn

from distconv.comm.base import allreduce_bytes
from distconv.distribution import Dist
from distconv.nn.batchnorm import DistBatchNorm2d
from distconv.ops.base import SAMPLE_GRIDS, Handler, PriceContext, Sample, SampleNet
from distconv.ops.pricing import CommStep, segment_rank
from distconv.parallel.placement import Placement, paper_grid

__all__ = ["BatchNormHandler"]


class BatchNormHandler(Handler):
    modules = (nn.BatchNorm2d, nn.SyncBatchNorm)  # both: global-batch statistics
    kind = "batchnorm"

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.graph import LayerSpec

        name = str(node.target)
        step = an.keep(node, "batchnorm")
        step.layer = LayerSpec("batchnorm", name, step.out.layout, input=step.out,
                               statistics=an.config.statistics(name))
        return step

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        return DistBatchNorm2d.from_batchnorm2d(module, grid=grid, input_dist=step.layer.input.dist,
                                                statistics=step.layer.statistics)

    def param_dists(self, step: Any, module: Any) -> dict[str, Any]:
        d = Dist((step.out.dist.entries[1],))
        return {"weight": d, "bias": d}

    def price(self, report: Any, step: Any, bn: Any, ctx: PriceContext) -> None:
        p = step.out
        ext = dict(p.layout)
        local = step.layer.statistics == "local"
        seg = [g for i in ((2, 3) if local else (0, 2, 3)) for g in p.dist.grid_dims_of(i)]
        blocks = list(p.dist.grid_dims_of(0)) if local and bn.track_running_stats else []
        s = math.prod(ext[g] for g in seg)
        fwd, bwd, running, params = {}, {}, {}, 0
        isz = ctx.itemsize
        for r in ctx.ranks:
            g = paper_grid(p.layout, r)
            c = p.dist.local_shape(ctx.in_shape, g)[1]
            params = max(params, 2 * c if bn.affine else 0)
            fwd[r] = (s - 1) * (1 + 2 * c) * isz
            bwd[r] = allreduce_bytes(2 * c, segment_rank(p.layout, seg, g.coords), s, isz)
            root = all(g.coords.get(d, 0) == 0 for d in blocks)
            running[r] = 0 if root else 2 * c * isz
        report.param_elements = params
        report.dists["w"] = Placement(p.layout, Dist((p.dist.entries[1],))).dist.format("w")
        if s > 1:
            report.steps.append(CommStep("forward", f"statistics allgather over {'×'.join(seg)}",
                                         "allgather", fwd, s, p.layout, tuple(seg)))
            report.steps.append(CommStep("backward",
                                         f"Σdy, Σdy·x̂ allreduce over {'×'.join(seg)}",
                                         "allreduce", bwd, s, p.layout, tuple(seg)))
        if blocks:
            report.steps.append(CommStep(
                "forward", f"running statistics of sample block 0, broadcast over "
                f"{'×'.join(blocks)} (asynchronous)", "broadcast", running,
                math.prod(ext[g] for g in blocks), p.layout, tuple(blocks)))

    def samples(self) -> Sequence[Sample]:
        return (Sample("batchnorm", lambda: SampleNet(nn.BatchNorm2d(4), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),)

