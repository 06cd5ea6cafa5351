"""Performance model of a distributed convolution (Dryden et al., SC'19, §4).

Two parts, kept apart:

* :func:`conv_traffic` -- the **exact** bytes each rank receives in every communication step of a
  :class:`~distconv.nn.DistConv2d` forward and backward pass, in closed form from the global
  problem, the grid and the rank's coordinates (balanced blocks, halo rows). The communicators
  count the same bytes (what a rank receives from other ranks, never padding), so tests compare
  the two exactly.
* :func:`conv_cost` -- the §4 time model: every collective costs ``alpha`` per message step plus
  ``beta`` per byte received (ring allgather / reduce-scatter: ``(p-1) alpha + bytes beta``; ring
  allreduce: ``2 (p-1) alpha + bytes beta``; halo exchange: ``alpha`` per neighbour plus bytes),
  and local convolutions cost their FLOPs over a measured rate (or a measured time function). The
  layer time is that of its slowest rank; :func:`choose_algorithm` picks the cheapest candidate.
  The flat :class:`Machine` prices every collective alike; a hierarchical
  :class:`distconv.machines.Machine` prices each on the level its segment crosses (the grid dims
  a step runs over are in ``Traffic.dims``).

Closed forms, per rank, with ``n`` its samples, ``h, w`` its input rows/cols and ``ho, wo`` its
output rows/cols (balanced blocks), ``s`` the element size, and the channel blocks below
(``blk(n, p, i)`` the balanced block, ``blk2`` the block-of-block, major first)::

    algorithm       x block Cx           x after step 1 Cg   conv out Fp      y block Fy
    stationary-x    blk(C,Pc,c)          Cx                  F                blk(F,Pc,c)
    stationary-y    blk(C,Pf,f)          C                   blk(F,Pf,f)      Fp
    stationary-w    blk2(C,[Pc,Pf])      blk(C,Pc,c)         blk(F,Pf,f)      blk2(F,[Pf,Pc])

    forward   allgather x over F       (Cg - Cx) n h w s            (stationary-y/w, Pf > 1)
              halo exchange H          rows_in_H(h) n Cg w s
              halo exchange W          rows_in_W(w) n Cg H' s        (H' = h + halo + padding)
              reduce-scatter y over C  (Pc - 1) n Fy ho wo s         (stationary-x/w, Pc > 1)
    backward  allgather dL/dy over C   (Fp - Fy) n ho wo s
              halo accumulate W, H     rows_out_W(w) n Cg H' s, rows_out_H(h) n Cg w s
              reduce-scatter dL/dx     (Pf - 1) n Cx h w s
              allreduce dL/dw, dL/db   ((Q-1) b + (m - b)) s over the Q = N·H·W ranks holding
                                       the same m-element shard, b = blk(m, Q, q) (ring)

Grouped convolutions with channel (filter) parallelism and groups divisible by C (F) are local:
``Cx = Cg = blk(C,P,i)``, ``Fp = Fy = blk(F,P,i)``, only the halo and gradient allreduce remain.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from distconv.comm.base import allreduce_bytes
from distconv.conv_geometry import HaloPlan, conv_dims, normalize_padding, pair
from distconv.distribution import balanced_block, nested_block

__all__ = [
    "ConvProblem",
    "Machine",
    "Traffic",
    "Cost",
    "conv_traffic",
    "conv_cost",
    "choose_algorithm",
    "corner_coords",
    "calibrate",
    "measure_flop_rate",
]

ALGORITHMS = ("stationary-x", "stationary-y", "stationary-w")


def _blk(n: int, p: int, i: int) -> int:
    return balanced_block(n, p, i)[1]


def _blk2(n: int, extents: Sequence[int], coords: Sequence[int]) -> int:
    return nested_block(n, extents, coords)[1]


@dataclass(frozen=True)
class ConvProblem:
    """A 2-d convolution on a global input ``(batch, in_channels, height, width)``."""

    batch: int
    in_channels: int
    out_channels: int
    height: int
    width: int
    kernel_size: int | tuple[int, int] = 3
    stride: int | tuple[int, int] = 1
    padding: str | int | tuple[int, int] = 0
    dilation: int | tuple[int, int] = 1
    groups: int = 1
    bias: bool = True
    padding_mode: str = "zeros"

    def dims(self) -> tuple[Any, Any]:
        k, s, d = (pair(v, n) for v, n in ((self.kernel_size, "kernel_size"),
                                            (self.stride, "stride"), (self.dilation, "dilation")))
        pads = normalize_padding(self.padding, k, s, d)
        return conv_dims((self.height, self.width), k, s, d, pads)

    @property
    def output_hw(self) -> tuple[int, int]:
        dh, dw = self.dims()
        return dh.out_length, dw.out_length

    def flops(self) -> int:
        """Multiply-adds times two of the whole forward convolution."""
        ho, wo = self.output_hw
        kh, kw = pair(self.kernel_size, "kernel_size")
        per_output = 2 * (self.in_channels // self.groups) * kh * kw
        return self.batch * self.out_channels * ho * wo * per_output


@dataclass
class Traffic:
    """Bytes one rank receives, per step, in forward and backward."""

    forward: dict[str, int] = field(default_factory=dict)
    backward: dict[str, int] = field(default_factory=dict)
    ops: dict[str, str] = field(default_factory=dict)  # step -> communicator op name
    peers: dict[str, int] = field(default_factory=dict)  # step -> ranks in its collective
    dims: dict[str, tuple[str, ...]] = field(default_factory=dict)  # step -> grid dims it spans

    @property
    def forward_bytes(self) -> int:
        return sum(self.forward.values())

    @property
    def backward_bytes(self) -> int:
        return sum(self.backward.values())

    def by_op(self) -> dict[str, int]:
        """Bytes per communicator operation (``allgather``, ``reduce_scatter``, ``alltoall``,
        ``allreduce``), the keys of ``Communicator.stats.bytes``; zero entries omitted."""
        out: dict[str, int] = {}
        for steps in (self.forward, self.backward):
            for step, nbytes in steps.items():
                if nbytes:
                    out[self.ops[step]] = out.get(self.ops[step], 0) + nbytes
        return out


@dataclass(frozen=True)
class _Roles:
    sample: str = "N"
    channel: str = "C"
    filter: str = "F"
    h: str = "H"
    w: str = "W"


def _layout(grid: Mapping[str, int] | Sequence[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    if isinstance(grid, Mapping):
        return tuple(grid.items())
    return tuple((str(n), int(e)) for n, e in grid)


def all_coords(grid: Mapping[str, int] | Sequence[tuple[str, int]]) -> list[dict[str, int]]:
    """The coordinates of every rank of a row-major grid, in rank order."""
    layout = _layout(grid)
    out = []
    for r in range(math.prod(e for _, e in layout)):
        c: dict[str, int] = {}
        for name, e in reversed(layout):
            r, c[name] = divmod(r, e)
        out.append(c)
    return out


def conv_traffic(
    problem: ConvProblem,
    grid: Mapping[str, int] | Sequence[tuple[str, int]],
    algorithm: str,
    coords: Mapping[str, int],
    *,
    itemsize: int = 4,
    input_grad: bool = True,
    channel_dim: str = "C",
    filter_dim: str = "F",
    sample_dim: str = "N",
    spatial_dims: tuple[str, str] = ("H", "W"),
) -> Traffic:
    """Exact bytes the rank at ``coords`` receives in one forward and one backward pass.

    ``grid`` is the ordered grid (``{"N": 2, "C": 2}``); ``input_grad`` says whether dL/dx is
    computed (the halo accumulate and dL/dx reduce-scatter are skipped otherwise).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    layout = _layout(grid)
    ext = dict(layout)
    ro = _Roles(sample_dim, channel_dim, filter_dim, *spatial_dims)
    P = {k: ext.get(getattr(ro, k), 1) for k in ("sample", "channel", "filter", "h", "w")}
    at = {k: coords.get(getattr(ro, k), 0) for k in P}
    pb = problem
    C, Fo, g = pb.in_channels, pb.out_channels, pb.groups
    pc, pf, c, f = P["channel"], P["filter"], at["channel"], at["filter"]
    aligned_groups = g > 1 and pc * pf > 1
    if aligned_groups:  # each rank's channel block holds whole groups: a local grouped conv
        if algorithm == "stationary-w":  # blocks over C, then F within
            cx = cg = _blk2(C, [pc, pf], [c, f])
            fp = fy = fw = _blk2(Fo, [pc, pf], [c, f])
        else:
            p, i = (pc, c) if algorithm == "stationary-x" else (pf, f)
            cx = cg = _blk(C, p, i)
            fp = fy = fw = _blk(Fo, p, i)
        cw = C // g
    elif algorithm == "stationary-x":
        cx = _blk(C, pc, c)
        cg, fp, fy, fw, cw = cx, Fo, _blk(Fo, pc, c), Fo, _blk(C // g, pc, c)
    elif algorithm == "stationary-y":
        cx = _blk(C, pf, f)
        cg, fp = C, _blk(Fo, pf, f)
        fy, fw, cw = fp, fp, C // g
    else:
        cx = _blk2(C, [pc, pf], [c, f])
        cg, fp = _blk(C, pc, c), _blk(Fo, pf, f)
        fy, fw, cw = _blk2(Fo, [pf, pc], [f, c]), fp, _blk(C // g, pc, c)
    dh, dw = pb.dims()
    n = _blk(pb.batch, P["sample"], at["sample"])
    plans = [HaloPlan(d, P[k], pb.padding_mode) if P[k] > 1 else None
             for d, k in ((dh, "h"), (dw, "w"))]
    own = [
        (pl.owned[at[k]][1] - pl.owned[at[k]][0]) if pl else d.length
        for pl, d, k in zip(plans, (dh, dw), ("h", "w"))
    ]
    out = [
        (pl.out[at[k]][1] - pl.out[at[k]][0]) if pl else d.out_length
        for pl, d, k in zip(plans, (dh, dw), ("h", "w"))
    ]
    h_ext = plans[0].local_length[at["h"]] if plans[0] else dh.length
    s = itemsize
    t = Traffic()

    def step(phase: dict[str, int], name: str, op: str, peers: int, nbytes: int) -> None:
        phase[name] = nbytes
        t.ops[name], t.peers[name] = op, peers
        t.dims[name] = tuple(d for d, e in layout if e > 1 and d in span[name.split()[-1]])

    span = {ro.filter: (ro.filter,), ro.channel: (ro.channel,), ro.h: (ro.h,), ro.w: (ro.w,),
            "dL/dw": (ro.sample, ro.h, ro.w), "dL/db": (ro.sample, ro.h, ro.w)}

    gathers_x = algorithm != "stationary-x" and pf > 1 and not aligned_groups
    reduces_y = algorithm != "stationary-y" and pc > 1 and not aligned_groups
    if gathers_x:
        step(t.forward, f"allgather x over {ro.filter}", "allgather", pf,
             (cg - cx) * n * own[0] * own[1] * s)
    if plans[0]:
        rows = plans[0].halo_rows_received(at["h"])
        step(t.forward, f"halo exchange {ro.h}", "alltoall", P["h"], rows * n * cg * own[1] * s)
    if plans[1]:
        rows = plans[1].halo_rows_received(at["w"])
        step(t.forward, f"halo exchange {ro.w}", "alltoall", P["w"], rows * n * cg * h_ext * s)
    if reduces_y:
        step(t.forward, f"reduce-scatter y over {ro.channel}", "reduce_scatter", pc,
             (pc - 1) * n * fy * out[0] * out[1] * s)
    if reduces_y:
        step(t.backward, f"allgather dL/dy over {ro.channel}", "allgather", pc,
             (fp - fy) * n * out[0] * out[1] * s)
    if input_grad:
        if plans[1]:
            rows = plans[1].halo_rows_sent(at["w"])
            step(t.backward, f"halo accumulate {ro.w}", "alltoall", P["w"],
                 rows * n * cg * h_ext * s)
        if plans[0]:
            rows = plans[0].halo_rows_sent(at["h"])
            step(t.backward, f"halo accumulate {ro.h}", "alltoall", P["h"],
                 rows * n * cg * own[1] * s)
        if gathers_x:
            step(t.backward, f"reduce-scatter dL/dx over {ro.filter}", "reduce_scatter", pf,
                 (pf - 1) * n * cx * own[0] * own[1] * s)
    red = [(name, e) for name, e in layout if e > 1 and name in (ro.sample, ro.h, ro.w)]
    q = math.prod(e for _, e in red)
    if q > 1:
        sub = 0
        for name, e in red:
            sub = sub * e + coords.get(name, 0)
        kh, kw = pair(pb.kernel_size, "kernel_size")
        for what, m in (("dL/dw", fw * cw * kh * kw), ("dL/db", fy if pb.bias else 0)):
            if m:
                step(t.backward, f"allreduce {what}", "allreduce", q,
                     allreduce_bytes(m, sub, q, s))
    return t


@dataclass(frozen=True)
class Machine:
    """Alpha-beta communication parameters and a local convolution rate.

    Args:
        alpha: seconds per message step. Default 20 µs (loopback TCP).
        beta: seconds per byte received. Default 1 ns (1 GB/s).
        flop_rate: local convolution FLOP/s (forward; backward-data and -filter each take as
            long). Default 20 GFLOP/s.
        conv_time: optional measured time function ``(local ConvProblem) -> seconds`` of one
            local forward convolution; replaces ``flop_rate``.
    """

    alpha: float = 20e-6
    beta: float = 1e-9
    flop_rate: float = 20e9
    conv_time: Callable[[ConvProblem], float] | None = None

    def local_conv(self, problem: ConvProblem) -> float:
        if self.conv_time is not None:
            return self.conv_time(problem)
        return problem.flops() / self.flop_rate

    def collective_time(self, op: str, peers: int, nbytes: float, *,
                        layout: Any = None, dims: Sequence[str] = ()) -> float:
        """``steps * alpha + nbytes * beta`` (ring steps; one level, so ``layout`` and ``dims``
        do not matter). :class:`distconv.machines.Machine` prices by the level crossed."""
        latency = 2 * (peers - 1) if op == "allreduce" else (2 if op == "alltoall" else peers - 1)
        return latency * self.alpha + nbytes * self.beta


def corner_coords(grid: Mapping[str, int] | Sequence[tuple[str, int]]) -> list[dict[str, int]]:
    """The ranks whose every coordinate is 0, 1 or the last: with balanced blocks they hold every
    combination of the larger and the smaller block per dim, and an interior block with halos on
    both sides, so the slowest rank is among them (the one sampling rule of pricing:
    :func:`distconv.parallel.placement.evaluated_ranks`)."""
    layout = _layout(grid)
    out: list[dict[str, int]] = [{}]
    for name, e in layout:
        out = [{**c, name: v} for c in out for v in sorted({0, min(1, e - 1), e - 1})]
    return out


@dataclass(frozen=True)
class Cost:
    """Predicted seconds of one layer (slowest rank) and the per-step breakdown of that rank."""

    forward: float
    backward: float
    steps: dict[str, float]
    traffic: Traffic

    @property
    def total(self) -> float:
        return self.forward + self.backward


def _local_problem(problem: ConvProblem, grid: Mapping[str, int], algorithm: str,
                   roles: _Roles) -> ConvProblem:
    """The largest local convolution any rank runs (balanced blocks: rank 0's)."""
    ext = lambda d: grid.get(d, 1)  # noqa: E731
    pc, pf = ext(roles.channel), ext(roles.filter)
    c_work = {"stationary-x": -(-problem.in_channels // pc), "stationary-y": problem.in_channels,
              "stationary-w": -(-problem.in_channels // pc)}[algorithm]
    f_work = {"stationary-x": problem.out_channels, "stationary-y": -(-problem.out_channels // pf),
              "stationary-w": -(-problem.out_channels // pf)}[algorithm]
    ho, wo = problem.output_hw
    kh, kw = pair(problem.kernel_size, "kernel_size")
    sh, sw = pair(problem.stride, "stride")
    dh, dw = pair(problem.dilation, "dilation")
    lho, lwo = -(-ho // ext(roles.h)), -(-wo // ext(roles.w))
    return ConvProblem(
        -(-problem.batch // ext(roles.sample)), c_work, f_work,
        (lho - 1) * sh + dh * (kh - 1) + 1, (lwo - 1) * sw + dw * (kw - 1) + 1,
        (kh, kw), (sh, sw), 0, (dh, dw), problem.groups, problem.bias,
    )


def conv_cost(
    problem: ConvProblem,
    grid: Mapping[str, int],
    algorithm: str,
    machine: Machine = Machine(),
    *,
    itemsize: int = 4,
    channel_dim: str = "C",
    filter_dim: str = "F",
    sample_dim: str = "N",
    spatial_dims: tuple[str, str] = ("H", "W"),
    ranks: str = "all",
    pipeline: int = 1,
) -> Cost:
    """Predicted forward and backward seconds of the layer (§4): local convs plus collectives.

    ``pipeline=k`` (:mod:`distconv.nn.pipeline`): the layer runs on k chunks of each rank's
    samples (at most as many as it has). The network carries the chunks' allgathers and
    reduce-scatters (each ``1/k`` of the bytes, each paying its latency), the processor their
    local convolutions, so a stage lasts ``max(conv/k, comm/k)``::

        forward   g + c + r + (k-1) both(c, g + r)               g, c, r: one chunk's allgather
        backward  g' + c + (k-1) both(c, g' + r') + both(w, r')  over F, conv, reduce-scatter
                                                                 over C; w: the weight gradient

    where ``both(a, b) = a + b - o min(a, b)`` with ``o`` the machine's ``comm_overlap``: ``max(a,
    b)`` where communication runs beside the compute (``o = 1``, a flat :class:`Machine`'s), the
    sum where it does not (``o = 0``: then pipelining only adds each chunk's latency).
    Halo exchanges run per chunk on the critical path; gradient allreduces are unchanged.

    ``machine`` is a flat :class:`Machine` or a hierarchical :class:`distconv.machines.Machine`
    (anything with ``local_conv`` and ``collective_time``). The layer time is its slowest rank's:
    among ``ranks="all"`` (default) or the grid's ``"corners"`` (:func:`corner_coords`; the same
    maximum with balanced blocks, and cheap for thousands of ranks).
    """
    if ranks not in ("all", "corners"):
        raise ValueError(f"ranks must be 'all' or 'corners', got {ranks!r}")
    roles = _Roles(sample_dim, channel_dim, filter_dim, *spatial_dims)
    kw = dict(itemsize=itemsize, channel_dim=channel_dim, filter_dim=filter_dim,
              sample_dim=sample_dim, spatial_dims=spatial_dims)
    if isinstance(pipeline, bool) or not isinstance(pipeline, int) or pipeline < 1:
        raise ValueError(f"pipeline must be a positive int, got {pipeline!r}")
    local = machine.local_conv(_local_problem(problem, dict(grid), algorithm, roles))
    best: Cost | None = None
    layout = _layout(grid)
    ext = dict(layout)
    chunks = min(pipeline, -(-problem.batch // ext.get(sample_dim, 1)))
    # every step of a rank moves its local samples' bytes, or its share of a gradient allreduce
    # over (N, H, W), and both are largest at sample coordinate 0 (balanced blocks put the larger
    # first; the allreduce block of segment rank 0 is the largest): the slowest rank has the
    # first sample block, and only the other coordinates need to be tried
    for coords in [c for c in (all_coords if ranks == "all" else corner_coords)(grid)
                   if c.get(sample_dim, 0) == 0]:
        t = conv_traffic(problem, grid, algorithm, coords, **kw)  # type: ignore[arg-type]
        steps = {"local conv forward": local, "local conv backward (data + filter)": 2 * local}
        for phase in (t.forward, t.backward):
            for name, nbytes in phase.items():
                steps[name] = chunks * machine.collective_time(
                    t.ops[name], t.peers[name], nbytes / chunks, layout=layout, dims=t.dims[name]
                ) if not name.startswith("allreduce") else machine.collective_time(
                    t.ops[name], t.peers[name], nbytes, layout=layout, dims=t.dims[name])
        fwd = local + sum(steps[k] for k in t.forward)
        bwd = 2 * local + sum(steps[k] for k in t.backward)
        if chunks > 1:
            fwd, bwd = _pipelined(steps, t, local, chunks, getattr(machine, "comm_overlap", 1.0))
        cost = Cost(fwd, bwd, steps, t)
        if best is None or cost.total > best.total:
            best = cost
    assert best is not None
    return best


def _pipelined(steps: dict[str, float], t: Traffic, local: float, k: int, overlap: float
               ) -> tuple[float, float]:
    """Forward and backward seconds of a layer pipelined over ``k`` chunks (see
    :func:`conv_cost`); ``steps`` hold each collective's time over all k chunks; ``overlap``:
    the machine's ``comm_overlap``."""
    def both(a: float, b: float) -> float:  # a and b at once, b partly beside a
        return a + b - overlap * min(a, b)

    def part(phase: dict[str, int], op: str) -> float:
        return sum(steps[n] for n in phase if t.ops[n] == op and not n.startswith("allreduce"))

    def serial(phase: dict[str, int]) -> float:  # halos and gradient allreduces
        return sum(steps[n] for n in phase if t.ops[n] not in ("allgather", "reduce_scatter")
                   or n.startswith("allreduce"))

    c = local / k
    g, r = part(t.forward, "allgather") / k, part(t.forward, "reduce_scatter") / k
    fwd = serial(t.forward) + g + c + r + (k - 1) * both(c, g + r)
    g, r = part(t.backward, "allgather") / k, part(t.backward, "reduce_scatter") / k
    bwd = serial(t.backward) + g + c + (k - 1) * both(c, g + r) + both(local, r)
    return fwd, bwd


def choose_algorithm(
    problem: ConvProblem,
    candidates: Sequence[tuple[Mapping[str, int], str]],
    machine: Machine = Machine(),
    **options: Any,
) -> tuple[Mapping[str, int], str, Cost]:
    """The cheapest ``(grid, algorithm)`` among ``candidates`` by :func:`conv_cost`."""
    if not candidates:
        raise ValueError("choose_algorithm: candidates must not be empty")
    scored = [(conv_cost(problem, g, a, machine, **options), g, a) for g, a in candidates]
    cost, g, a = min(scored, key=lambda item: item[0].total)
    return g, a, cost


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
