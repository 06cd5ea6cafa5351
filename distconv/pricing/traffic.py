"""The exact bytes of a distributed convolution (Dryden et al., SC'19, §4): what each rank
receives in every communication step of a :class:`~distconv.nn.DistConv2d` forward and backward
pass, in closed form from the global problem, the grid and the rank's coordinates (balanced
blocks, halo rows). The communicators count the same bytes (what a rank receives from other
ranks, never padding), so tests compare the two exactly.

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

Grouped convolutions with channel (filter) parallelism whose blocks hold whole groups (groups
divisible by C (F); depthwise) are local: ``Cx = Cg = blk(C,P,i)``, ``Fp = Fy = blk(F,P,i)``,
only the halo and gradient allreduce remain. Blocks that cut groups gather x over the role dims
R first (``(C - Cx) n h w s``; its adjoint reduce-scatter, over C×F in the two steps the
redistribution takes, the bytes of its plan), and the halo carries ``Cg``, the channels of the
groups the rank's filters reach into.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from distconv.comm.base import allreduce_bytes
from distconv.conv_geometry import HaloPlan, pair
from distconv.conv_groups import group_span, groups_aligned
from distconv.distribution import balanced_block, nested_block
from distconv.grid import grid_layout
from distconv.pricing.problem import ConvProblem

__all__ = ["ALGORITHMS", "Roles", "Traffic", "conv_traffic"]

ALGORITHMS = ("stationary-x", "stationary-y", "stationary-w")


def _blk(n: int, p: int, i: int) -> int:
    return balanced_block(n, p, i)[1]


def _blk2(n: int, extents: Sequence[int], coords: Sequence[int]) -> int:
    return nested_block(n, extents, coords)[1]


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
class Roles:
    """The grid dims that play each role of a convolution's grid."""

    sample: str = "N"
    channel: str = "C"
    filter: str = "F"
    h: str = "H"
    w: str = "W"


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
    layout = grid_layout(grid)
    ext = dict(layout)
    ro = Roles(sample_dim, channel_dim, filter_dim, *spatial_dims)
    P = {k: ext.get(getattr(ro, k), 1) for k in ("sample", "channel", "filter", "h", "w")}
    at = {k: coords.get(getattr(ro, k), 0) for k in P}
    pb = problem
    C, Fo, g = pb.in_channels, pb.out_channels, pb.groups
    pc, pf, c, f = P["channel"], P["filter"], at["channel"], at["filter"]
    aligned_groups = g > 1 and pc * pf > 1
    gather_groups = False  # blocks that cut groups: x gathered over the role dims first
    if aligned_groups:  # each rank's channel block holds whole groups: a local grouped conv
        role, extents, at_role = {"stationary-x": (ro.channel, [pc], [c]),
                                  "stationary-y": (ro.filter, [pf], [f]),
                                  "stationary-w": (f"{ro.channel}×{ro.filter}", [pc, pf],
                                                   [c, f])}[algorithm]
        cx = cg = _blk2(C, extents, at_role)
        fp = fy = fw = _blk2(Fo, extents, at_role)
        cw = C // g
        if not groups_aligned(C, Fo, g, extents):
            span = group_span(Fo, g, extents, at_role)
            gather_groups, cg = True, (span.g1 - span.g0) * cw
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
            "dL/dw": (ro.sample, ro.h, ro.w), "dL/db": (ro.sample, ro.h, ro.w),
            f"{ro.channel}×{ro.filter}": (ro.channel, ro.filter)}

    gathers_x = algorithm != "stationary-x" and pf > 1 and not aligned_groups
    reduces_y = algorithm != "stationary-y" and pc > 1 and not aligned_groups
    gather_dim, gather_peers = ro.filter, pf
    moved = ((cg - cx) * n * own[0] * own[1] * s, (pf - 1) * n * cx * own[0] * own[1] * s)
    if gather_groups:  # every channel gathered (over C×F in one or two steps: the
        # redistribution's own bytes); the groups of its filters convolved
        gathers_x, gather_dim, gather_peers = True, role, pc * pf
        moved = _gathered_x_bytes(pb, layout, coords, ro, role, (dh.length, dw.length), s)
    if gathers_x:
        step(t.forward, f"allgather x over {gather_dim}", "allgather", gather_peers, moved[0])
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
            step(t.backward, f"reduce-scatter dL/dx over {gather_dim}", "reduce_scatter",
                 gather_peers, moved[1])
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


def _gathered_x_bytes(pb: ConvProblem, layout: tuple, coords: Mapping[str, int], ro: Roles,
                      role: str, rows: tuple[int, int], itemsize: int) -> tuple[int, int]:
    """Bytes the rank at ``coords`` receives gathering x over the role dims (``"C"``, ``"F"``
    or ``"C×F"``) of a grouped layer whose blocks cut groups, and scattering dL/dx back: the
    plans the layer runs (:func:`~distconv.redistribute.plan_redistribution`)."""
    from types import SimpleNamespace

    from distconv.distribution import Dist
    from distconv.grid import ProcessorGrid
    from distconv.redistribute import plan_redistribution

    ext = dict(layout)

    def live(d: str) -> str | None:
        return d if ext.get(d, 1) > 1 else None

    names = tuple(d for d in role.split("×") if live(d))
    entry = names if len(names) > 1 else names[0]
    others = (live(ro.sample), live(ro.h), live(ro.w))
    src = Dist((others[0], entry, others[1], others[2]))
    dst = Dist((others[0], None, others[1], others[2]))
    rank = 0
    for d, e in layout:
        rank = rank * e + coords.get(d, 0)
    grid = ProcessorGrid(dict(layout), comm=SimpleNamespace(
        rank=rank, size=math.prod(ext.values()), backend="none"))
    shape = (pb.batch, pb.in_channels, *rows)
    forward = plan_redistribution(layout, src, dst, shape).received_bytes(grid, itemsize)
    backward = plan_redistribution(layout, dst.dual(grid), src.dual(grid), shape)
    return forward, backward.received_bytes(grid, itemsize)
