"""The steps of a redistribution (Dryden et al., §2.3.4–2.3.5) and the context they run in.

Each step is a frozen value that says what it does to a block's shape and bytes (``received``),
runs itself on this rank's block (``run``) and names its exact adjoint (``adjoint``); the table of
steps and adjoints is in :mod:`distconv.redistribute`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from distconv.comm.base import Work, allreduce_bytes, concat_parts, split_chunks
from distconv.distribution import balanced_block, nested_block
from distconv.grid import CANONICAL_DIMS, ProcessorGrid

if TYPE_CHECKING:
    from distconv.comm import Communicator


Layout = tuple[tuple[str, int], ...]


def _extent(layout: Layout, name: str) -> int:
    for n, e in layout:
        if n == name:
            return e
    if name in CANONICAL_DIMS:
        return 1
    raise ValueError(f"grid dim {name!r} is not in the grid {dict(layout)}")


@dataclass(frozen=True)
class _Ctx:
    """What a step needs at run time: the grid, this rank's coords and the global shape. What
    it derives from them (block sizes, sub-communicators, messages) it derives once."""

    grid: ProcessorGrid
    global_shape: tuple[int, ...]
    where: str  # description for debug-mode agreement checks and error messages
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    def extent(self, g: str) -> int:
        return self.grid.extent(g)

    def coord(self, g: str) -> int:
        return self.grid.coords.get(g, 0)

    def prefix_block(self, dim: int, prefix: tuple[str, ...]) -> int:
        """Size of this rank's block of ``dim`` when blocked over ``prefix``."""
        _, size = nested_block(
            self.global_shape[dim], [self.extent(g) for g in prefix],
            [self.coord(g) for g in prefix],
        )
        return size

    def parts(self, dim: int, prefix: tuple[str, ...], g: str) -> list[int]:
        """Sizes of the sub-blocks over ``g`` of this rank's ``prefix`` block of ``dim``."""
        key = (dim, prefix, g)
        sizes = self.memo.get(key)
        if sizes is None:
            n, p = self.prefix_block(dim, prefix), self.extent(g)
            sizes = self.memo[key] = [balanced_block(n, p, j)[1] for j in range(p)]
        return sizes

    def subrank(self, dims: Sequence[str]) -> int:
        """This rank's index in the segment over ``dims`` (row-major in grid order)."""
        index = 0
        for name in self.grid.names:
            if name in dims:
                index = index * self.extent(name) + self.coord(name)
        return index

    def comm(self, dims: tuple[str, ...]) -> Communicator:
        comm = self.memo.get(dims)
        if comm is None:
            comm = self.memo[dims] = self.grid.subcomm(dims)
        return comm

    def meta(self, step: Step) -> str:
        """The message a step's collective carries (debug checks, errors)."""
        text = self.memo.get(step)
        if text is None:
            text = self.memo[step] = f"{step} in {self.where}"
        return text


def _with(shape: Sequence[int], dim: int, size: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = size
    return tuple(out)


@dataclass(frozen=True)
class AllGather:
    """``o_{prefix×g} -> o_{prefix}`` on tensor dim ``dim``: segmented allgather over ``g``."""

    dim: int
    g: str
    prefix: tuple[str, ...]

    def run(self, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        return self.start(x, ctx).wait()

    def start(self, x: torch.Tensor, ctx: _Ctx) -> Work:
        """:meth:`run` started without blocking; the handle's ``wait()`` gives its result."""
        sizes = ctx.parts(self.dim, self.prefix, self.g)
        shapes = [_with(x.shape, self.dim, s) for s in sizes]
        work = ctx.comm((self.g,)).allgather(x, shapes=shapes, async_op=True,
                                            meta=ctx.meta(self))
        return Work(lambda: concat_parts(work.wait(), self.dim), test_fn=work.is_completed)

    def adjoint(self) -> ReduceScatter:
        return ReduceScatter(self.dim, self.g, self.prefix)

    def received(self, shape: Sequence[int], ctx: _Ctx) -> tuple[tuple[int, ...], int]:
        sizes = ctx.parts(self.dim, self.prefix, self.g)
        mine = ctx.coord(self.g)
        got = sum(s for j, s in enumerate(sizes) if j != mine) * _rest(shape, self.dim)
        return _with(shape, self.dim, sum(sizes)), got

    def __str__(self) -> str:
        return f"allgather dim {self.dim} over {self.g}"


@dataclass(frozen=True)
class ReduceScatter:
    """``Σ_g o_{prefix} -> o_{prefix×g}`` on tensor dim ``dim``: segmented reduce-scatter over ``g``."""

    dim: int
    g: str
    prefix: tuple[str, ...]

    def run(self, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        return self.start(x, ctx).wait()

    def start(self, x: torch.Tensor, ctx: _Ctx) -> Work:
        """:meth:`run` started without blocking; the handle's ``wait()`` gives its result."""
        chunks = split_chunks(x, ctx.parts(self.dim, self.prefix, self.g), self.dim)
        return ctx.comm((self.g,)).reduce_scatter(chunks, async_op=True,
                                                 meta=ctx.meta(self))

    def adjoint(self) -> AllGather:
        return AllGather(self.dim, self.g, self.prefix)

    def received(self, shape: Sequence[int], ctx: _Ctx) -> tuple[tuple[int, ...], int]:
        sizes = ctx.parts(self.dim, self.prefix, self.g)
        mine = sizes[ctx.coord(self.g)]
        return _with(shape, self.dim, mine), (len(sizes) - 1) * mine * _rest(shape, self.dim)

    def __str__(self) -> str:
        return f"reduce-scatter dim {self.dim} over {self.g}"


@dataclass(frozen=True)
class AllReduce:
    """``Σ_{dims} -> *``: one segmented allreduce over all of ``dims``."""

    dims: tuple[str, ...]

    def run(self, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        return ctx.comm(self.dims).allreduce(x, meta=ctx.meta(self))

    def adjoint(self) -> AllReduce:
        return self

    def received(self, shape: Sequence[int], ctx: _Ctx) -> tuple[tuple[int, ...], int]:
        p = math.prod(ctx.extent(g) for g in self.dims)
        return tuple(shape), allreduce_bytes(math.prod(shape), ctx.subrank(self.dims), p, 1)

    def __str__(self) -> str:
        return f"allreduce over {'×'.join(self.dims)}"


@dataclass(frozen=True)
class Slice:
    """``o_{prefix} -> o_{prefix×g}`` where the tensor is replicated over ``g``: keep the own block."""

    dim: int
    g: str
    prefix: tuple[str, ...]

    def run(self, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        start, size = balanced_block(x.shape[self.dim], ctx.extent(self.g), ctx.coord(self.g))
        return x.narrow(self.dim, start, size).contiguous()

    def adjoint(self) -> Pad:
        return Pad(self.dim, self.g, self.prefix)

    def received(self, shape: Sequence[int], ctx: _Ctx) -> tuple[tuple[int, ...], int]:
        _, size = balanced_block(shape[self.dim], ctx.extent(self.g), ctx.coord(self.g))
        return _with(shape, self.dim, size), 0

    def __str__(self) -> str:
        return f"slice dim {self.dim} over {self.g}"


@dataclass(frozen=True)
class Pad:
    """``o_{prefix×g} -> Σ_g o_{prefix}``: the own block placed in zeros, a pending sum over ``g``."""

    dim: int
    g: str
    prefix: tuple[str, ...]

    def run(self, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        n = ctx.prefix_block(self.dim, self.prefix)
        start, _ = balanced_block(n, ctx.extent(self.g), ctx.coord(self.g))
        out = x.new_zeros(_with(x.shape, self.dim, n))
        out.narrow(self.dim, start, x.shape[self.dim]).copy_(x)
        return out

    def adjoint(self) -> Slice:
        return Slice(self.dim, self.g, self.prefix)

    def received(self, shape: Sequence[int], ctx: _Ctx) -> tuple[tuple[int, ...], int]:
        return _with(shape, self.dim, ctx.prefix_block(self.dim, self.prefix)), 0

    def __str__(self) -> str:
        return f"pad dim {self.dim} over {self.g}"


@dataclass(frozen=True)
class AllToAll:
    """Move grid dim ``g`` from the minor end of tensor dim ``src`` to the minor end of ``dst``."""

    src: int
    dst: int
    g: str
    src_prefix: tuple[str, ...]
    dst_prefix: tuple[str, ...]

    def run(self, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        send_sizes = ctx.parts(self.dst, self.dst_prefix, self.g)
        recv_sizes = ctx.parts(self.src, self.src_prefix, self.g)
        mine = send_sizes[ctx.coord(self.g)]
        chunks = split_chunks(x, send_sizes, self.dst)
        recv_shapes = [_with(_with(x.shape, self.dst, mine), self.src, s) for s in recv_sizes]
        # every rank of the segment holds this block but for its own rows of dim src
        most = max(recv_sizes) * math.prod(_with(x.shape, self.src, 1)) * x.element_size()
        parts = ctx.comm((self.g,)).alltoall(
            chunks, recv_shapes=recv_shapes, meta=ctx.meta(self), max_bytes=most
        )
        return concat_parts(parts, self.src)

    def adjoint(self) -> AllToAll:
        return AllToAll(self.dst, self.src, self.g, self.dst_prefix, self.src_prefix)

    def received(self, shape: Sequence[int], ctx: _Ctx) -> tuple[tuple[int, ...], int]:
        send_sizes = ctx.parts(self.dst, self.dst_prefix, self.g)
        recv_sizes = ctx.parts(self.src, self.src_prefix, self.g)
        c = ctx.coord(self.g)
        out = _with(_with(shape, self.dst, send_sizes[c]), self.src, sum(recv_sizes))
        rest = _rest(out, self.src)
        return out, sum(s for j, s in enumerate(recv_sizes) if j != c) * rest

    def __str__(self) -> str:
        return f"all-to-all over {self.g}: dim {self.src} -> dim {self.dst}"


@dataclass(frozen=True)
class KeepRoot:
    """``* -> Σ_g``: the rank at coordinate 0 of ``g`` keeps the value, the others hold zeros."""

    g: str

    def run(self, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        return x.clone() if ctx.coord(self.g) == 0 else torch.zeros_like(x)

    def adjoint(self) -> KeepRoot:
        return self

    def received(self, shape: Sequence[int], ctx: _Ctx) -> tuple[tuple[int, ...], int]:
        return tuple(shape), 0

    def __str__(self) -> str:
        return f"keep-root over {self.g}"


Step = AllGather | ReduceScatter | AllReduce | Slice | Pad | AllToAll | KeepRoot


def _rest(shape: Sequence[int], dim: int) -> int:
    return math.prod(s for d, s in enumerate(shape) if d != dim)
