"""Halo exchange of a block-distributed spatial dim, and its adjoint (halo accumulate).

A convolution whose spatial dim is blocked over the ranks of a grid dim computes each rank's
output block from the input rows it reads (:class:`distconv.conv_geometry.HaloPlan`): rows it owns,
rows owned by other ranks (the *halo*), and rows of global padding (zeros, or for the ``'reflect'``,
``'replicate'`` and ``'circular'`` modes copies of input rows, which travel like halo rows;
each row moves once). :func:`halo_exchange`
builds that local input; its adjoint sends each halo row's gradient back to the row's owner, which
adds it to the gradient of its own rows (*halo accumulate*). Every rank derives the same plan from
global sizes, so all ranks take the same collective path; when no rank needs another rank's rows
(e.g. a 1x1 kernel on aligned blocks) the step is local and sends nothing.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from distconv.conv_geometry import HaloPlan

__all__ = ["HaloExchange", "halo_accumulate", "halo_accumulate_start", "halo_adjoint",
           "halo_exchange", "halo_forward", "halo_parts_start",
           "halo_parts", "haloed"]


def _with_len(t: torch.Tensor, dim: int, n: int) -> tuple[int, ...]:
    shape = list(t.shape)
    shape[dim] = n
    return tuple(shape)


def _swap_rows(
    t: torch.Tensor, comm: Any, parts: int, dim: int, outgoing: Any, incoming: Any, meta: str,
    async_op: bool = False, most_rows: int | None = None,
) -> Any:
    """One all-to-all: rows ``outgoing(q) = (offset, count)`` of ``t`` go to rank ``q``, and
    ``incoming(q)`` rows arrive from it (nothing to or from this rank itself). ``async_op``:
    return the started operation (the rows sent are copied when it starts). ``most_rows``: the
    most rows any rank of the exchange sends (a row has the same size on each: the ranks of
    one split dim hold the same blocks of the other dims)."""
    r = comm.rank
    chunks, shapes = [], []
    for q in range(parts):
        if q == r:
            chunks.append(t.new_empty(_with_len(t, dim, 0)))
            shapes.append(_with_len(t, dim, 0))
            continue
        off, cnt = outgoing(q)
        chunks.append(t.narrow(dim, off, cnt).contiguous())
        shapes.append(_with_len(t, dim, incoming(q)))
    bound = None
    if most_rows is not None:
        bound = most_rows * math.prod(_with_len(t, dim, 1)) * t.element_size()
    return comm.alltoall(chunks, recv_shapes=shapes, meta=meta, async_op=async_op,
                         max_bytes=bound)


def halo_parts(x: torch.Tensor, comm: Any, plan: HaloPlan, dim: int
               ) -> tuple[torch.Tensor, tuple[int, int], torch.Tensor]:
    """Zero padding: the rank's local input is ``cat([before, x.narrow(dim, *own), after])`` --
    global padding and the halo rows from lower ranks, the own rows it reads, the halo rows from
    higher ranks and padding. Returns ``(before, own, after)`` (one all-to-all)."""
    return halo_parts_start(x, comm, plan, dim)()


def halo_parts_start(x: torch.Tensor, comm: Any, plan: HaloPlan, dim: int
                     ) -> Callable[[], tuple[torch.Tensor, tuple[int, int], torch.Tensor]]:
    """:func:`halo_parts` with its all-to-all started now: call the result to wait for it and
    get ``(before, own, after)`` (compute that needs no halo row runs in between)."""
    r = comm.rank
    own = plan.send_rows(r, r)
    work = _swap_rows(
        x, comm, plan.parts, dim, lambda q: plan.send_rows(r, q),
        lambda q: plan.recv_rows(q, r)[1], f"halo exchange dim {dim}", async_op=True,
        most_rows=plan.most_sent,
    ) if plan.exchanges else None

    def finish() -> tuple[torch.Tensor, tuple[int, int], torch.Tensor]:
        before, after = [], []
        if work is not None:
            recv = work.wait()
            for q in range(plan.parts):  # the owners' blocks are in rank order
                if q != r and recv[q].shape[dim]:
                    (before if q < r else after).append(recv[q])
        pad_before, pad_after = plan.pad[r]
        if pad_before:
            before.insert(0, x.new_zeros(_with_len(x, dim, pad_before)))
        if pad_after:
            after.append(x.new_zeros(_with_len(x, dim, pad_after)))

        def joined(pieces: list[torch.Tensor]) -> torch.Tensor:
            if not pieces:
                return x.new_zeros(_with_len(x, dim, 0))
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)

        return joined(before), own, joined(after)

    return finish


def _exchange_forward(x: torch.Tensor, comm: Any, plan: HaloPlan, dim: int) -> torch.Tensor:
    """Zero padding: the local input is contiguous rows, so slices and one concatenation do."""
    before, (off, cnt), after = halo_parts(x, comm, plan, dim)
    pieces = [p for p in (before, x.narrow(dim, off, cnt), after) if p.shape[dim]]
    if not pieces:  # a rank whose output block is empty reads no rows
        return x.new_zeros(_with_len(x, dim, 0))
    if len(pieces) == 1:
        return pieces[0].contiguous()
    return torch.cat(pieces, dim)


def halo_accumulate(g: torch.Tensor, comm: Any, plan: HaloPlan, dim: int) -> torch.Tensor:
    """Adjoint of :func:`halo_exchange` for ``'zeros'`` padding: the gradient of the owned block.

    ``g`` is the gradient of the local (haloed, padded) input. Halo rows go back to their owners,
    which add them into their own rows; padding rows are dropped.
    """
    return halo_accumulate_start(g, comm, plan, dim)(g)


def halo_accumulate_start(g: torch.Tensor, comm: Any, plan: HaloPlan, dim: int
                          ) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`halo_accumulate` with the halo rows of ``g`` sent now: the result takes the local
    input's gradient again (its own rows may have grown since; its halo rows must not have) and
    returns the owned block's."""
    r = comm.rank
    work = _swap_rows(
        g, comm, plan.parts, dim, lambda q: plan.recv_rows(q, r),
        lambda q: plan.send_rows(r, q)[1], f"halo accumulate dim {dim}", async_op=True,
        most_rows=plan.most_returned,
    ) if plan.exchanges else None

    def finish(g: torch.Tensor) -> torch.Tensor:
        owned = plan.owned[r][1] - plan.owned[r][0]
        out = g.new_zeros(_with_len(g, dim, owned))
        off, cnt = plan.send_rows(r, r)
        if cnt:
            out.narrow(dim, off, cnt).add_(g.narrow(dim, plan.recv_rows(r, r)[0], cnt))
        if work is None:
            return out
        recv = work.wait()
        for q in range(plan.parts):
            s_off, s_cnt = plan.send_rows(r, q)
            if q != r and s_cnt:
                out.narrow(dim, s_off, s_cnt).add_(recv[q])
        return out

    return finish


def _index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _gather_forward(
    x: torch.Tensor, comm: Any, plan: HaloPlan, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """General exchange (padding modes that copy rows): distinct rows travel once, then every
    local row is picked from [own rows, received rows..., one zero row] by an index."""
    r, o0, n_own = comm.rank, plan.owned[comm.rank][0], x.shape[dim]
    pos = {o0 + i: i for i in range(n_own)}
    pieces = [x]
    if plan.exchanges:
        chunks, shapes = [], []
        for q in range(plan.parts):
            rows = [] if q == r else [g - o0 for g in plan.rows_from(r, q)]
            chunks.append(x.index_select(dim, _index(rows, x.device)))
            shapes.append(_with_len(x, dim, 0 if q == r else len(plan.rows_from(q, r))))
        recv = comm.alltoall(chunks, recv_shapes=shapes, meta=f"halo exchange dim {dim}")
        base = n_own
        for q in range(plan.parts):
            if q != r:
                for k, g in enumerate(plan.rows_from(q, r)):
                    pos[g] = base + k
                base += recv[q].shape[dim]
                pieces.append(recv[q])
    zero = sum(p.shape[dim] for p in pieces)
    pieces.append(x.new_zeros(_with_len(x, dim, 1)))
    index = _index([pos[g] if g >= 0 else zero for g in plan.sources[r]], x.device)
    return torch.cat(pieces, dim).index_select(dim, index), index


def _gather_adjoint(
    g: torch.Tensor, comm: Any, plan: HaloPlan, dim: int, index: torch.Tensor
) -> torch.Tensor:
    r, o0 = comm.rank, plan.owned[comm.rank][0]
    n_own = plan.owned[r][1] - o0
    received = [0 if q == r else len(plan.rows_from(q, r)) for q in range(plan.parts)]
    buf = g.new_zeros(_with_len(g, dim, n_own + sum(received) + 1)).index_add_(dim, index, g)
    out = buf.narrow(dim, 0, n_own).contiguous()
    if not plan.exchanges:
        return out
    chunks, shapes, base = [], [], n_own
    for q in range(plan.parts):
        chunks.append(buf.narrow(dim, base, received[q]).contiguous())
        base += received[q]
        shapes.append(_with_len(g, dim, 0 if q == r else len(plan.rows_from(r, q))))
    recv = comm.alltoall(chunks, recv_shapes=shapes, meta=f"halo accumulate dim {dim}")
    for q in range(plan.parts):
        if q != r and recv[q].shape[dim]:
            out.index_add_(dim, _index([g_ - o0 for g_ in plan.rows_from(r, q)], g.device), recv[q])
    return out


def halo_forward(x: torch.Tensor, comm: Any, plan: HaloPlan, dim: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The halo exchange on plain tensors: the local input, and what its adjoint needs (the
    row index of a copying padding mode; None for zeros)."""
    if plan.mode == "zeros":
        return _exchange_forward(x, comm, plan, dim), None
    return _gather_forward(x, comm, plan, dim)


def halo_adjoint(g: torch.Tensor, comm: Any, plan: HaloPlan, dim: int,
                 index: torch.Tensor | None) -> torch.Tensor:
    """The adjoint of :func:`halo_forward`: the gradient of the owned block from the gradient
    ``g`` of the local input (``index``: what :func:`halo_forward` returned with it)."""
    if plan.mode == "zeros":
        return halo_accumulate(g.contiguous(), comm, plan, dim)
    return _gather_adjoint(g.contiguous(), comm, plan, dim, index)


class HaloExchange(torch.autograd.Function):
    """Halo exchange along tensor dim ``dim`` over the ranks of ``comm`` (one grid dim).

    Forward: rank ``r``'s local input is ``pad[r][0]`` padding rows, then the rows ``needed[r]``
    gathered from their owners (its own rows sliced locally), then ``pad[r][1]`` padding rows.
    Padding rows are zeros, or (``plan.mode`` ``'reflect'``, ``'replicate'``, ``'circular'``)
    copies of input rows, which travel like halo rows (each distinct row once).
    Adjoint: halo accumulate — every rank sends the gradient of the rows it received back to their
    owner, which adds it into the gradient of its own rows (a row read several times gets the sum);
    zero-padding gradients are dropped.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Any, plan: HaloPlan, dim: int) -> torch.Tensor:
        ctx.comm, ctx.plan, ctx.dim = comm, plan, dim
        out, ctx.index = halo_forward(x, comm, plan, dim)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return halo_adjoint(g, ctx.comm, ctx.plan, ctx.dim, ctx.index), None, None, None


def haloed(x: torch.Tensor, comms: Sequence[Any], plans: Sequence[HaloPlan | None],
           explicit: Sequence[int] | None, padding_mode: str) -> torch.Tensor:
    """A convolution's local input as separate differentiable steps: the halo exchange of each
    split spatial dim (``plans[i]`` over ``comms[i]``; None: whole), dim after dim so that
    corners travel with the later exchange, then the padding of the whole dims (``explicit``,
    ``F.pad``'s list; None: none) in ``padding_mode``."""
    for i, plan in enumerate(plans):
        if plan is not None:
            x = halo_exchange(x, comms[i], plan, 2 + i)
    if explicit is not None:
        x = torch.nn.functional.pad(
            x, list(explicit), mode="constant" if padding_mode == "zeros" else padding_mode)
    return x


def halo_exchange(x: torch.Tensor, comm: Any, plan: HaloPlan, dim: int) -> torch.Tensor:
    """Differentiable halo exchange (see :class:`HaloExchange`).

    ``comm`` is the communicator of the grid dim that blocks tensor dim ``dim`` (its rank is the
    rank's coordinate on that dim) and ``plan.parts == comm.size``. ``x`` is the rank's owned block.
    """
    if plan.parts != comm.size:
        raise ValueError(f"plan has {plan.parts} parts but the communicator has {comm.size} ranks")
    r = comm.rank
    want = plan.owned[r][1] - plan.owned[r][0]
    if x.shape[dim] != want:
        raise ValueError(
            f"rank {r} holds {x.shape[dim]} rows on dim {dim}, but its block of the global "
            f"length {plan.dim.length} over {plan.parts} ranks has {want}"
        )
    if plan.is_identity:
        return x
    return HaloExchange.apply(x, comm, plan, dim)
