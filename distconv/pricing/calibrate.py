"""The flat machine this runs on, measured: the local convolution FLOP rate, and ``alpha`` and
``beta`` fitted from allgathers of two sizes (:func:`distconv.machines.calibrate` builds the
hierarchical profile on these)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from distconv.conv_geometry import pair
from distconv.pricing.machine import Machine
from distconv.pricing.problem import ConvProblem

__all__ = ["calibrate", "measure_flop_rate"]


def measure_flop_rate(problem: ConvProblem | None = None, *, repeats: int = 3) -> float:
    """Local forward-convolution FLOP/s measured with ``F.conv2d`` (best of ``repeats``)."""
    import torch
    import torch.nn.functional as F

    pb = problem or ConvProblem(8, 64, 64, 28, 28, 3, padding=1)
    x = torch.randn(pb.batch, pb.in_channels, pb.height, pb.width)
    kh, kw = pair(pb.kernel_size, "kernel_size")
    w = torch.randn(pb.out_channels, pb.in_channels // pb.groups, kh, kw)
    F.conv2d(x, w, None, pb.stride, pb.padding, pb.dilation, pb.groups)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        F.conv2d(x, w, None, pb.stride, pb.padding, pb.dilation, pb.groups)
        best = min(best, time.perf_counter() - t0)
    return pb.flops() / best


def calibrate(comm: Any, *, sizes: Sequence[int] = (1, 1 << 18), repeats: int = 5) -> Machine:
    """Fit ``alpha`` and ``beta`` from allgathers of two sizes on ``comm`` (collective), and the
    local FLOP rate; returns the same :class:`Machine` on every rank (rank 0's fit, broadcast)."""
    import torch

    times = []
    for n in sizes:
        x = torch.zeros(n)
        comm.allgather(x)
        best = math.inf
        for _ in range(repeats):
            comm.barrier()
            t0 = time.perf_counter()
            comm.allgather(x)
            best = min(best, time.perf_counter() - t0)
        times.append(best)
    p = max(comm.size - 1, 1)
    nbytes = [(comm.size - 1) * n * 4 for n in sizes]
    beta = max((times[1] - times[0]) / max(nbytes[1] - nbytes[0], 1), 1e-12)
    alpha = max((times[0] - beta * nbytes[0]) / p, 1e-7)
    fit = torch.tensor([alpha, beta, measure_flop_rate()], dtype=torch.float64)
    if comm.size > 1:
        fit = comm.broadcast(fit, root=0)
    return Machine(float(fit[0]), float(fit[1]), float(fit[2]))
