"""Pipelined stationary-x, -y and -w: the local convolution split into chunks of samples so that
each chunk's collectives run while the next chunk computes.

With ``k`` chunks of this rank's samples (balanced, the larger first; the ranks of every
collective hold the same samples, so they cut them alike), the forward pass is::

    start allgather over F of x chunk 0
    for i in 0..k-1:
        start allgather over F of x chunk i+1          (prefetch)
        wait for x chunk i; halo exchange; pad
        y chunk i = conv(x chunk i)                     (local)
        start reduce-scatter over C of y chunk i        (runs while chunk i+1 computes)
    wait for every y chunk; concatenate

and the backward pass the same with the adjoints: the allgather over C of dL/dy chunk i+1 runs
while chunk i's ``conv_bwd_data`` computes, and chunk i's reduce-scatter over F of dL/dx while
chunk i+1's does. The weight (and bias) gradient is computed once, from the whole working input
and the whole gathered dL/dy, while the last reduce-scatter is in flight.

**Exactness.** Every collective moves the same elements as the unpipelined layer's, split along
the sample dim, and sums them in the same order, so the bytes are unchanged and the reduced
values equal; the weight gradient reads the same tensors as the unpipelined layer's. Where the
local convolution computes each sample alike whatever the batch (the arithmetic per sample is
unchanged), the output and every gradient are bitwise those of the unpipelined layer.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from distconv.comm.base import Work, concat_parts, eager
from distconv.distribution import balanced_block
from distconv.halo import halo_adjoint, halo_forward
from distconv.redistribute import AllGather, ReduceScatter, _Ctx, plan_redistribution

__all__ = ["chunk_sizes", "pipelined_conv"]


def chunk_sizes(n: int, k: int) -> list[int]:
    """The sizes of ``min(k, n)`` balanced chunks of ``n`` samples (the larger first)."""
    k = max(1, min(k, n))
    return [balanced_block(n, k, i)[1] for i in range(k)]


def _start(steps: Sequence[Any], x: torch.Tensor, ctx: _Ctx) -> Work:
    """Run ``steps`` on ``x``: the first started without blocking where it can be (an allgather
    or reduce-scatter), any later ones when the handle is waited for."""
    if not steps:
        return Work.completed(x)
    first, rest = steps[0], steps[1:]
    work = first.start(x, ctx) if isinstance(first, (AllGather, ReduceScatter)) else (
        Work.completed(first.run(x, ctx)))

    def finish() -> torch.Tensor:
        out = work.wait()
        for step in rest:
            out = step.run(out, ctx)
        return out

    return Work(finish, test_fn=work.is_completed) if rest else work


def _adjoints(steps: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(s.adjoint() for s in reversed(steps))


class _Pipelined(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                layer: Any, geo: Any, shape: tuple[int, ...], sizes: list[int]
                ) -> torch.Tensor:
        grid = layer.grid
        gather = plan_redistribution(grid.layout, layer.input_dist, layer.work_dist, shape).steps
        reduce = plan_redistribution(grid.layout, layer.partial_dist, layer.output_dist,
                                     geo.y_shape).steps
        xctx = _Ctx(grid, shape, f"pipelined {layer.input_dist} -> {layer.work_dist}")
        yctx = _Ctx(grid, geo.y_shape, f"pipelined {layer.partial_dist} -> {layer.output_dist}")
        chunks = torch.split(x, sizes, 0)
        pending = _start(gather, chunks[0], xctx)
        works, inputs, unpadded, indices = [], [], [], []
        for i in range(len(chunks)):
            nxt = _start(gather, chunks[i + 1], xctx) if i + 1 < len(chunks) else None
            xi = pending.wait()
            index: list[Any] = []
            for d, plan in enumerate(geo.halo):
                idx = None
                if plan is not None and not plan.is_identity:
                    xi, idx = halo_forward(xi, layer._halo_comms[d], plan, 2 + d)
                index.append(idx)
            indices.append(index)
            unpadded.append(tuple(xi.shape))
            if geo.explicit_pad is not None:
                mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
                xi = F.pad(xi, geo.explicit_pad, mode=mode)
            inputs.append(xi)
            yi = F.conv2d(xi, weight, bias, layer.stride, geo.conv_padding, layer.dilation,
                          layer._local_groups)
            works.append(_start(reduce, yi, yctx))
            pending = nxt  # type: ignore[assignment]
        y = torch.cat([w.wait() for w in works], 0)
        ctx.layer, ctx.geo, ctx.sizes = layer, geo, sizes
        ctx.gather, ctx.reduce, ctx.xctx, ctx.yctx = gather, reduce, xctx, yctx
        ctx.unpadded, ctx.indices, ctx.has_bias = unpadded, indices, bias is not None
        ctx.save_for_backward(weight, *inputs)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        layer, geo = ctx.layer, ctx.geo
        weight, *inputs = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gather_dy, scatter_dx = _adjoints(ctx.reduce), _adjoints(ctx.gather)
        chunks = torch.split(dy.contiguous(), ctx.sizes, 0)
        args = dict(bias_sizes=[layer.out_channels] if ctx.has_bias else None,
                    stride=list(layer.stride), padding=list(geo.conv_padding),
                    dilation=list(layer.dilation), transposed=False, output_padding=[0, 0],
                    groups=layer._local_groups)
        pending = _start(gather_dy, chunks[0], ctx.yctx)
        gathered, works = [], []
        for i in range(len(chunks)):
            nxt = _start(gather_dy, chunks[i + 1], ctx.yctx) if i + 1 < len(chunks) else None
            gi = pending.wait().contiguous()
            gathered.append(gi)
            if need_x:
                gx = torch.ops.aten.convolution_backward(
                    gi, inputs[i], weight, output_mask=[True, False, False], **args)[0]
                gx = _unpad_and_accumulate(gx, layer, geo, ctx.unpadded[i], ctx.indices[i])
                works.append(_start(scatter_dx, gx.contiguous(), ctx.xctx))
            pending = nxt  # type: ignore[assignment]
        dw = db = None
        if need_w or need_b:  # once, from the whole tensors: the unpipelined layer's arithmetic
            x_all, g_all = concat_parts(inputs, 0), concat_parts(gathered, 0)
            _, dw, db = torch.ops.aten.convolution_backward(
                g_all, x_all, weight, output_mask=[False, bool(need_w), bool(need_b)], **args)
        dx = torch.cat([w.wait() for w in works], 0) if need_x else None
        return dx, dw, db, None, None, None, None


def _unpad_and_accumulate(g: torch.Tensor, layer: Any, geo: Any, unpadded: tuple[int, ...],
                          index: list[Any]) -> torch.Tensor:
    """The adjoints of the explicit padding and the halo exchanges (W, then H)."""
    if geo.explicit_pad is not None:
        mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
        if mode == "constant":
            l, r, t, b = geo.explicit_pad
            g = g[..., t:g.shape[2] - b, l:g.shape[3] - r]
        else:  # the adjoint of a copying pad does not depend on the values: autograd's
            z = torch.zeros(unpadded, dtype=g.dtype, device=g.device, requires_grad=True)
            with torch.enable_grad():
                (g,) = torch.autograd.grad(F.pad(z, geo.explicit_pad, mode=mode), z, g)
    for d in (1, 0):
        plan = geo.halo[d]
        if plan is not None and not plan.is_identity:
            g = halo_adjoint(g, layer._halo_comms[d], plan, 2 + d, index[d])
    return g


@eager
def pipelined_conv(layer: Any, x: torch.Tensor, geo: Any, shape: tuple[int, ...],
                   bias: torch.Tensor | None) -> torch.Tensor:
    """The layer's forward steps 1-3 (gather, halo, local convolution, reduce-scatter) on
    ``layer.pipeline`` chunks of samples; ``bias`` is fused into the local convolution (None
    where the layer adds it after the reduce-scatter)."""
    return _Pipelined.apply(x, layer.weight, bias, layer, geo, shape,
                            chunk_sizes(x.shape[0], layer.pipeline))
