"""A profile of the machine this runs on, fitted by a short calibration run (collective)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from distconv.machines.base import ConvTable, Level, Machine
from distconv.pricing.calibrate import calibrate as _fit, measure_flop_rate
from distconv.pricing.cost import conv_cost
from distconv.pricing.problem import ConvProblem

__all__ = ["calibrate"]


def calibrate(comm: Any, *, problems: Sequence[ConvProblem] = (), memory: float = math.inf,
              sizes: Sequence[int] = (1, 1 << 18), repeats: int = 5,
              overheads: bool = True) -> Machine:
    """Profile this machine on ``comm`` (collective; every rank gets rank 0's fit).

    * alpha and beta from allgathers, and the local FLOP rate
      (:func:`distconv.pricing.calibrate.calibrate`);
    * the local forward convolutions in ``problems`` timed into a :class:`ConvTable`;
    * with ``overheads`` (default) and 1 < P <= 16 ranks: the software around each layer and
      each collective call, fitted so that the model reproduces two measured
      :class:`~distconv.nn.DistConv2d` steps -- sample-parallel (``{N: P}``: one gradient
      allreduce) and channel-parallel (``{C: P}``: a reduce-scatter and an allgather);
    * with P > 1 ranks: ``comm_overlap``, how much of an asynchronous collective runs beside a
      local convolution (:class:`Machine`), so pipelining is chosen only where it pays here.

    All ranks of this machine share one level (one host, loopback or shared memory).
    """
    flat = _fit(comm, sizes=sizes, repeats=repeats)
    keys = [ConvTable.key(pb) for pb in problems]
    values = [pb.flops() / measure_flop_rate(pb, repeats=repeats) for pb in problems]
    source = f"calibrated on {comm.size} ranks ({getattr(comm, 'backend', '?')})"
    level = Level("host", 0, flat.alpha, 1.0 / flat.beta, source=source)
    machine = Machine("this machine", (level,), flat.flop_rate, memory,
                      ConvTable(dict(zip(keys, values)), flat.flop_rate),
                      {"alpha": source, "beta": source, "flop_rate": "measure_flop_rate()"})
    layer, call = (_overheads(comm, machine, repeats)
                   if overheads and 1 < comm.size <= 16 else (0.0, 0.0))
    overlap = _overlap(comm, level.bandwidth, repeats) if comm.size > 1 else 1.0
    fit = torch.tensor([*values, layer, call, overlap], dtype=torch.float64)
    if comm.size > 1:
        fit = comm.broadcast(fit, root=0)
    *values, layer, call, overlap = (float(v) for v in fit)
    return Machine("this machine", (level,), flat.flop_rate, memory,
                   ConvTable(dict(zip(keys, values)), flat.flop_rate, overhead=layer),
                   {**machine.sources, "overheads": f"fitted to DistConv2d steps, {source}",
                    "comm_overlap": f"an allgather started before a convolution, {source}"},
                   call_overhead=call, comm_overlap=overlap)


def _overlap(comm: Any, bandwidth: float, repeats: int) -> float:
    """How much of an asynchronous collective runs while its rank computes: with ``c`` a local
    convolution's seconds, ``m`` an allgather's (sized to take about as long) and ``b`` the
    allgather started, the convolution run and the allgather waited for, ``(c + m - b) /
    min(c, m)`` clamped to ``[0, 1]`` (medians of interleaved repeats; 1: fully hidden, 0: the
    two take their sum or more)."""
    x = torch.randn(4, 64, 16, 16, generator=torch.Generator().manual_seed(0))
    w = torch.randn(64, 64, 3, 3, generator=torch.Generator().manual_seed(1))

    def timed(key: str, buf: torch.Tensor) -> float:
        comm.barrier()
        t0 = time.perf_counter()
        work = comm.allgather(buf, async_op=True) if key != "c" else None
        if key != "m":
            torch.conv2d(x, w, padding=1)
        if work is not None:
            work.wait()
        return time.perf_counter() - t0

    def agreed(nbytes: float) -> torch.Tensor:  # rank 0's size for all; 64 MiB received at most
        most = min(1 << 23, (1 << 26) // (comm.size - 1))
        want = torch.tensor([min(max(nbytes, 1 << 12), most)], dtype=torch.float64)
        return torch.zeros(int(comm.broadcast(want, root=0).item()) // 4)

    c = statistics.median(timed("c", torch.zeros(0)) for _ in range(5))
    buf = agreed(c * bandwidth / (comm.size - 1))
    m = statistics.median(timed("m", buf) for _ in range(5))
    buf = agreed(buf.numel() * 4 * c / m)  # the allgather that takes what the convolution does
    times: dict[str, list[float]] = {"c": [], "m": [], "b": []}
    for _ in range(max(3 * repeats, 9)):
        for key, got in times.items():
            got.append(timed(key, buf))
    c, m, b = (statistics.median(v) for v in times.values())
    return min(1.0, max(0.0, (c + m - b) / min(c, m)))


def _overheads(comm: Any, machine: Machine, repeats: int) -> tuple[float, float]:
    """``(per local conv call, per collective call)`` seconds that close the gap between the
    measured and modelled steps of two small layers (least squares, clamped at zero)."""
    from distconv.grid import ProcessorGrid
    from distconv.nn import DistConv2d

    P = comm.size
    pb = ConvProblem(2 * P, 16, 16, 8, 8, 3, padding=1)
    rows = []
    for grid in ({"N": P}, {"C": P}):
        g = ProcessorGrid(grid, comm=comm)
        conv = DistConv2d(16, 16, 3, padding=1, grid=g, algorithm="stationary-x", init_seed=0)
        shape = (pb.batch, 16, 8, 8)
        x = torch.randn(conv.local_input_shape(shape), requires_grad=True)
        times = []
        for _ in range(repeats + 1):
            comm.barrier()
            t0 = time.perf_counter()
            conv(x, shape).sum().backward()
            conv.zero_grad()
            comm.barrier()
            times.append(time.perf_counter() - t0)
        cost = conv_cost(pb, grid, "stationary-x", machine)
        calls = len(cost.traffic.forward) + len(cost.traffic.backward)
        rows.append((3.0, float(calls), statistics.median(times[1:]) - cost.total))
    (a1, b1, d1), (a2, b2, d2) = rows
    det = a1 * b2 - a2 * b1
    layer, call = ((d1 * b2 - d2 * b1) / det, (a1 * d2 - a2 * d1) / det) if det else (-1, -1)
    if layer < 0 or call < 0:  # not separable from these two: put it all in one term
        layer, call = max(0.0, min(d1, d2) / 3), 0.0
        call = max(0.0, max((d - 3 * layer) / b for _, b, d in rows if b) if b1 or b2 else 0.0)
    return layer, call
