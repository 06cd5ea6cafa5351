"""The statistics of a batch norm over a segment of ranks: the per-channel moments of a block,
combined exactly across the segment (Chan et al.), and the training-mode autograd function whose
backward reduces its two channel sums over the same segment (used by
:class:`~distconv.nn.batchnorm.DistBatchNorm`, and the moments by the group norm)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

#: input dtypes whose statistics are computed in float32
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _layout(x: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The dims a channel's statistics of ``x`` reduce over, and the view of a per-channel
    vector against ``x``."""
    return (0, *range(2, x.dim())), (1, -1, *([1] * (x.dim() - 2)))


def _moments(x: torch.Tensor, comm: Any, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance over every other dim of the whole segment."""
    dims, view = _layout(x)
    n = x.shape[0] * math.prod(x.shape[2:])
    if n:
        mean = x.mean(dims)
        dev = x - mean.view(view)
        m2 = dev.mul_(dev).sum(dims)  # (square() is pow, several times slower on CPU)
    else:
        mean = x.new_zeros(x.shape[1])
        m2 = x.new_zeros(x.shape[1])
    if comm is None:
        return mean, m2 / count
    c = x.shape[1]
    mine = torch.cat([x.new_full((1,), float(n)), mean, m2])
    parts = comm.allgather(mine, meta="DistBatchNorm statistics")
    # Chan et al.'s pairwise update, folding the ranks' moments in rank order (the same bits on
    # every rank): per rank four small ops, the weights Python numbers
    total, mean, m2 = 0.0, None, None
    for part in parts:
        nb = float(part[0])
        if nb == 0:
            continue
        if mean is None:
            total, mean, m2 = nb, part[1:1 + c], part[1 + c:]
            continue
        delta = part[1:1 + c] - mean
        both = total + nb
        mean = torch.add(mean, delta, alpha=nb / both)
        m2 = torch.add(m2, part[1 + c:]).addcmul_(delta, delta, value=total * nb / both)
        total = both
    if mean is None:  # no rank holds a value: what the one-process kernel gives (nan)
        return x.new_full((c,), math.nan), x.new_full((c,), math.nan)
    return mean, m2 / count


class _BatchNorm(torch.autograd.Function):
    """Training-mode batch normalisation over the segment of ``comm`` (see DistBatchNorm).

    Forward returns ``y`` and, not differentiable, the batch mean and biased variance. Backward is
    the standard batch-norm backward with its two channel sums reduced over the same segment.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                comm: Any, eps: float, count: int) -> tuple[torch.Tensor, ...]:
        work = x.float() if x.dtype in _LOW_PRECISION else x
        mean, var = _moments(work, comm, count)
        invstd = (var + eps).rsqrt()
        # the normalisation and the affine in one pass: torch's kernel with these statistics
        y = (F.batch_norm(work, mean, var, None if weight is None else weight.to(work.dtype),
                          None if bias is None else bias.to(work.dtype), False, 0.0, eps)
             if work.shape[1] else work.clone())  # (a rank may hold no channel)
        ctx.comm, ctx.count = comm, count
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.mark_non_differentiable(mean, var)
        # the statistics stay in the precision they were computed in (float32 under autocast)
        return y.to(x.dtype), mean, var

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        x = x.detach()  # (the ops below then skip autograd's bookkeeping)
        work = x.float() if x.dtype in _LOW_PRECISION else x
        w = None if weight is None else weight.detach().to(work.dtype)
        dy_w = dy.to(work.dtype).contiguous()
        _, v = _layout(x)
        if work.numel():  # sum(dy·x̂) and sum(dy) per channel, in torch's one fused kernel
            # (with a weight: CUDA's kernel computes the weight's gradient only with one; that
            # gradient, sum(dy·x̂), does not depend on the weight's values)
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy_w, work, torch.ones_like(mean) if w is None else w, None, None, mean, invstd,
                True, 0.0, [False, True, True])
        else:
            sum_dy_xhat = sum_dy = work.new_zeros(work.shape[1])
        dx = None
        if ctx.needs_input_grad[0]:
            sums = torch.stack([sum_dy, sum_dy_xhat])
            if ctx.comm is not None:
                sums = ctx.comm.allreduce(sums, meta="DistBatchNorm backward sums")
            scale = invstd if w is None else invstd * w
            # dx = scale·(dy - Σdy/n - x̂·Σ(dy·x̂)/n), x̂ = (x - mean)·invstd, is per channel
            # c + x·b + dy·scale: two passes over the block, b = -scale·invstd·Σ(dy·x̂)/n and
            # c = -scale·Σdy/n - b·mean
            t = sums * (scale / -ctx.count)
            b = t[1].mul_(invstd)
            c = torch.addcmul(t[0], b, mean, value=-1)
            dx = torch.addcmul(c.view(v), work, b.view(v))
            dx = dx.addcmul_(dy_w, scale.view(v)).to(x.dtype)
        # Local sums: the parameters' gradient sync completes them over the segment and replicas.
        dw = sum_dy_xhat.to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = sum_dy.to(weight.dtype) if ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None
