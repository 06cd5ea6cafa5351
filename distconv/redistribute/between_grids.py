"""Moving a tensor between distributions on two different grids over the same ranks: a plan of
index-box intersections, split into the groups of ranks that exchange data, and one
differentiable all-to-all(v) per group, all groups at once, each on its segment communicator
(``repartition``)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from distconv.comm.base import packed
from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.redistribute.execution import _check_args, _remember, redistribute
from distconv.redistribute.steps import Layout

if TYPE_CHECKING:
    from distconv.comm import Communicator


Box = tuple[tuple[int, int], ...]  # (start, size) per tensor dim


def _intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (s0, n0), (s1, n1) in zip(a, b):
        lo, hi = max(s0, s1), min(s0 + n0, s1 + n1)
        if hi <= lo:
            return None
        out.append((lo, hi - lo))
    return tuple(out)


def _relative(box: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(s - o, s - o + n) for (s, n), (o, _) in zip(box, origin))


@dataclass(frozen=True)
class RepartitionPlan:
    """Who sends which box to whom when moving a tensor between two grids over the same ranks.

    ``sends[r][t]`` is the global box rank ``r`` sends to rank ``t`` (``None``: nothing). Of the
    ranks holding the same source block (replicas), rank ``t`` reads from ``replicas[t % len]``, so
    every element of every target block arrives exactly once.
    """

    src_boxes: tuple[Box, ...]
    dst_boxes: tuple[Box, ...]
    sends: tuple[tuple[Box | None, ...], ...]

    def received_bytes(self, rank: int, itemsize: int) -> int:
        return itemsize * sum(
            math.prod(n for _, n in row[rank]) for s, row in enumerate(self.sends)
            if s != rank and row[rank] is not None
        )

    @functools.cached_property
    def local(self) -> bool:
        """Whether no rank sends to another: every target block lies in the rank's own source
        block (the same blocks on two grids, or a slice of a replica), so the exchange is a
        local view and its adjoint a local pad."""
        return all(_volume(b) == 0 for r, row in enumerate(self.sends)
                   for t, b in enumerate(row) if t != r)

    @functools.cached_property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The segments of the exchange: the connected components of its send graph (rank ``r``
        joined to every rank it sends a nonempty box to, either way), each sorted, in the order
        of their smallest rank. They partition the ranks; a rank that keeps its own elements
        only is a group of one. Both grids splitting the samples alike, each sample row is a
        group (or several); only a conversion whose data crosses every row is one group."""
        size = len(self.sends)
        parent = list(range(size))

        def find(r: int) -> int:
            while parent[r] != r:
                parent[r] = parent[parent[r]]
                r = parent[r]
            return r

        for r, row in enumerate(self.sends):
            for t, b in enumerate(row):
                if t != r and _volume(b):
                    a, c = find(r), find(t)
                    if a != c:
                        parent[max(a, c)] = min(a, c)
        members: dict[int, list[int]] = {}
        for r in range(size):
            members.setdefault(find(r), []).append(r)
        return tuple(tuple(g) for g in sorted(members.values()))

    def group_of(self, rank: int) -> tuple[int, ...]:
        """The segment (:attr:`groups`) holding ``rank``."""
        return next(g for g in self.groups if rank in g)

    @functools.cached_property
    def most_sent(self) -> int:
        """The most elements any rank sends (its own block's share included) forward."""
        return max(sum(_volume(b) for b in row) for row in self.sends)

    @functools.cached_property
    def most_returned(self) -> int:
        """The most elements any rank sends back in the adjoint."""
        return max(sum(_volume(row[r]) for row in self.sends) for r in range(len(self.sends)))


def _volume(box: Box | None) -> int:
    return 0 if box is None else math.prod(n for _, n in box)


@functools.lru_cache(maxsize=1024)
def _repartition_plan(
    src_layout: Layout, src: Dist, dst_layout: Layout, dst: Dist, shape: tuple[int, ...]
) -> RepartitionPlan:
    from types import SimpleNamespace

    from distconv.grid import ProcessorGrid

    size = math.prod(e for _, e in src_layout)
    fake = SimpleNamespace(rank=0, size=size, backend="none")
    sg, dg = ProcessorGrid(dict(src_layout), comm=fake), ProcessorGrid(dict(dst_layout), comm=fake)
    src_boxes = tuple(tuple(src.blocks(shape, sg, sg.coords_of(r))) for r in range(size))
    dst_boxes = tuple(tuple(dst.blocks(shape, dg, dg.coords_of(r))) for r in range(size))
    replicas: dict[Box, list[int]] = {}
    for r, box in enumerate(src_boxes):
        replicas.setdefault(box, []).append(r)
    sends = tuple(
        tuple(
            _intersect(src_boxes[r], dst_boxes[t])
            if replicas[src_boxes[r]][t % len(replicas[src_boxes[r]])] == r else None
            for t in range(size)
        )
        for r in range(size)
    )
    return RepartitionPlan(src_boxes, dst_boxes, sends)


def _exchange(
    x: torch.Tensor, comm: Communicator, outgoing: Sequence[Box | None], own: Box,
    incoming: Sequence[Box | None], result: Box, accumulate: bool, where: str, most: int,
) -> torch.Tensor:
    """Send the boxes ``outgoing[t]`` of ``x`` (whose block is ``own``) and place what arrives
    (``most``: the most elements any rank sends)."""
    ndim = x.dim()
    empty = (0,) * ndim
    chunks = packed([x[_relative(b, own)] if b is not None else x.new_empty(empty)
                     for b in outgoing])
    shapes = [tuple(n for _, n in b) if b is not None else empty for b in incoming]
    parts = comm.alltoall(chunks, recv_shapes=shapes, meta=where,
                          max_bytes=most * x.element_size())
    shape = tuple(n for _, n in result)
    out = x.new_zeros(shape) if accumulate else x.new_empty(shape)
    for box, part in zip(incoming, parts):
        if box is not None:
            if accumulate:
                out[_relative(box, result)] += part
            else:
                out[_relative(box, result)] = part
    return out


class _Repartition(torch.autograd.Function):
    """Forward: each target block assembled from one replica of every source block it overlaps.
    Backward (adjoint): every piece of the gradient returned to the replica it came from, summed.
    Both run among the ranks of this rank's segment only (``segment``: its communicator and
    its ranks, in sub-rank order)."""

    @staticmethod
    def forward(ctx, x, plan: RepartitionPlan, segment: Segment, rank: int, where: str):  # noqa: ANN001, ANN205
        ctx.plan, ctx.segment, ctx.rank, ctx.where = plan, segment, rank, where
        comm, group = segment
        incoming = [plan.sends[s][rank] for s in group]
        outgoing = [plan.sends[rank][t] for t in group]
        return _exchange(x, comm, outgoing, plan.src_boxes[rank], incoming,
                         plan.dst_boxes[rank], False, where, plan.most_sent)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        plan, (comm, group), r = ctx.plan, ctx.segment, ctx.rank
        outgoing = [plan.sends[t][r] for t in group]
        incoming = [plan.sends[r][s] for s in group]
        grad_x = _exchange(grad.contiguous(), comm, outgoing, plan.dst_boxes[r], incoming,
                           plan.src_boxes[r], True, "adjoint of " + ctx.where, plan.most_returned)
        return grad_x, None, None, None, None


#: run every repartition as one exchange over the whole communicator, as before segments (for
#: benchmarks that compare the two; never set by the library)
_WHOLE_WORLD = False

#: a rank's segment of a repartition: the communicator among its group and the group's ranks
#: (world ranks of the grids' communicator, in sub-rank order)
Segment = tuple["Communicator", tuple[int, ...]]


def segment_communicator(comm: Communicator, plan: RepartitionPlan) -> Segment | None:
    """This rank's segment of ``plan`` (None: the plan moves nothing, :attr:`~RepartitionPlan.
    local`). Collective over ``comm`` the first time a partition is asked for: every rank
    creates every group's communicator at once, by one :meth:`~distconv.comm.Communicator.split`
    of the whole partition (the groups are a function of global values only, so every rank
    passes the same partition in the same order, and no rank waits on a group it is not in);
    the communicator caches the split by partition, so later conversions with the same groups,
    forward or adjoint, reuse it without communicating. One group: ``comm`` itself."""
    if plan.local:
        return None
    groups = plan.groups
    if _WHOLE_WORLD:
        return comm, tuple(range(comm.size))
    if len(groups) == 1:
        return comm, groups[0]
    return comm.split(groups), plan.group_of(comm.rank)


def repartition(
    x: torch.Tensor, src_grid: ProcessorGrid, src: Dist, dst_grid: ProcessorGrid, dst: Dist,
    global_shape: Sequence[int],
) -> torch.Tensor:
    """Move a tensor between distributions on two different grids over the same ranks.

    The general fallback when no single-grid plan applies: each rank's target block is assembled
    by intersecting index boxes, and the exchange runs among the ranks that share data only --
    the send graph's groups (:attr:`RepartitionPlan.groups`), each an all-to-all(v) on its own
    segment communicator, all groups at once (two grids that split the samples alike convert
    each sample row on its own). The segment communicators are made collectively, once per
    partition, the first time a conversion is planned on these grids (every rank plans every
    conversion of a program in the same order). Pending sums in
    ``src`` are reduced on the source grid first; pending sums in ``dst`` are introduced on the
    target grid afterwards. Differentiable (the backward is the reverse exchange, summing pieces
    that several targets read from one replica).

    Raises:
        ValueError: grids over different communicators, or a block that does not match ``src``.
    """
    # arguments seen on this grid before (a network's transition between two layers' grids,
    # each step): checked and planned then
    key = bound = None
    if (type(src_grid) is ProcessorGrid and type(dst_grid) is ProcessorGrid and type(src) is Dist
            and type(dst) is Dist and not src.pending and type(global_shape) is tuple
            and all(type(n) is int for n in global_shape)):
        key = ("repartition", dst_grid, src, dst, global_shape, _WHOLE_WORLD)
        bound = src_grid._bound.get(key)
    if bound is None or not isinstance(x, torch.Tensor) or x.shape != bound[0]:
        x, bound = _bind_repartition(x, src_grid, src, dst_grid, dst, global_shape, key)
    _, plan, where, plain_dst, shape, segment = bound
    if segment is None or len(segment[1]) == 1:
        # this rank already holds its target block (on every rank: no collective anywhere;
        # a segment of one: this rank trades with no other)
        y = _own_block(x, plan, src_grid.comm.rank)
    else:
        y = _Repartition.apply(x, plan, segment, src_grid.comm.rank, where)
    if dst.pending:
        y = redistribute(y, dst_grid, plain_dst, dst, shape)
    return y


def _own_block(x: torch.Tensor, plan: RepartitionPlan, rank: int) -> torch.Tensor:
    """Rank ``rank``'s target block where it trades with no other rank (a
    :attr:`RepartitionPlan.local` plan, or a segment of one), cut from its own
    source block ``x`` (``x`` itself when the boxes agree; autograd's slice adjoint pads)."""
    own, target = plan.src_boxes[rank], plan.dst_boxes[rank]
    if own == target:
        return x
    if _volume(target) == 0:
        return x.flatten()[:0].view(tuple(n for _, n in target))
    return x[_relative(target, own)]


def _bind_repartition(x: object, src_grid: object, src: object, dst_grid: object, dst: object,
                      global_shape: object, key: tuple | None) -> tuple[torch.Tensor, tuple]:
    """Check ``repartition``'s arguments and plan it: ``x`` with ``src``'s pending sums summed,
    and ``(its shape, plan, message, dst without pending sums, global shape, this rank's
    segment)``, remembered on the source grid under ``key`` (None: not remembered). Makes the
    plan's segment communicators (collective, once per partition: :func:`segment_communicator`)
    after every check, so a rank that refuses its arguments refuses before any collective."""
    for name, g in (("src_grid", src_grid), ("dst_grid", dst_grid)):
        if not isinstance(g, ProcessorGrid):
            raise TypeError(f"repartition: {name} must be a distconv.ProcessorGrid, got {g!r}")
    shape = _check_args("repartition", x, src_grid, global_shape, src=src, dst=dst)
    if src_grid.comm is not dst_grid.comm:
        raise ValueError(
            "repartition: src_grid and dst_grid must be over the same communicator (the same ranks)"
        )
    if src.pending:
        plain = src.with_pending(())
        x = redistribute(x, src_grid, src, plain, shape)
        src = plain
    src.validate(src_grid, len(shape))
    dst.validate(dst_grid, len(shape))
    expected = src.local_shape(shape, src_grid)
    if tuple(x.shape) != expected:
        raise ValueError(
            f"repartition: local block has shape {tuple(x.shape)}, but {src} of {shape} gives "
            f"rank {src_grid.rank} the shape {expected}"
        )
    plain_dst = dst.with_pending(())
    plan = _repartition_plan(src_grid.layout, src, dst_grid.layout, plain_dst, shape)
    where = f"repartition {src} on {dict(src_grid.layout)} -> {plain_dst} on {dict(dst_grid.layout)}"
    segment = segment_communicator(src_grid.comm, plan)
    if segment is not None and len(segment[1]) < src_grid.size:
        where += f" (segment of {len(segment[1])} ranks: {list(segment[1])})"
    return x, _remember(src_grid, key, (expected, plan, where, plain_dst, shape, segment))
