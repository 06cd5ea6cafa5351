"""Moving a tensor between distributions on two different grids over the same ranks: a plan of
index-box intersections and one differentiable all-to-all(v) (``repartition``)."""

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
    Backward (adjoint): every piece of the gradient returned to the replica it came from, summed."""

    @staticmethod
    def forward(ctx, x, plan: RepartitionPlan, comm: Communicator, where: str):  # noqa: ANN001, ANN205
        ctx.plan, ctx.comm, ctx.where = plan, comm, where
        r = comm.rank
        incoming = [row[r] for row in plan.sends]
        return _exchange(x, comm, plan.sends[r], plan.src_boxes[r], incoming, plan.dst_boxes[r],
                         False, where, plan.most_sent)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        plan, comm, r = ctx.plan, ctx.comm, ctx.comm.rank
        outgoing = [row[r] for row in plan.sends]
        grad_x = _exchange(grad.contiguous(), comm, outgoing, plan.dst_boxes[r], plan.sends[r],
                           plan.src_boxes[r], True, "adjoint of " + ctx.where, plan.most_returned)
        return grad_x, None, None, None


def repartition(
    x: torch.Tensor, src_grid: ProcessorGrid, src: Dist, dst_grid: ProcessorGrid, dst: Dist,
    global_shape: Sequence[int],
) -> torch.Tensor:
    """Move a tensor between distributions on two different grids over the same ranks.

    The general fallback when no single-grid plan applies: each rank's target block is assembled
    by intersecting index boxes and one all-to-all(v) over the whole communicator. Pending sums in
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
        key = ("repartition", dst_grid, src, dst, global_shape)
        bound = src_grid._bound.get(key)
    if bound is None or not isinstance(x, torch.Tensor) or x.shape != bound[0]:
        x, bound = _bind_repartition(x, src_grid, src, dst_grid, dst, global_shape, key)
    _, plan, where, plain_dst, shape = bound
    if plan.local:  # every rank already holds its target block: no collective on any rank
        y = _own_block(x, plan, src_grid.comm.rank)
    else:
        y = _Repartition.apply(x, plan, src_grid.comm, where)
    if dst.pending:
        y = redistribute(y, dst_grid, plain_dst, dst, shape)
    return y


def _own_block(x: torch.Tensor, plan: RepartitionPlan, rank: int) -> torch.Tensor:
    """Rank ``rank``'s target block of a :attr:`RepartitionPlan.local` plan, cut from its own
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
    and ``(its shape, plan, message, dst without pending sums, global shape)``, remembered on
    the source grid under ``key`` (None: not remembered)."""
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
    return x, _remember(src_grid, key, (expected, plan, where, plain_dst, shape))
