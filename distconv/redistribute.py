"""Redistribution between two distributions of a tensor (Dryden et al., §2.3.4–2.3.5).

Planning is a pure function of ``(grid layout, source Dist, target Dist, global shape)`` and is
cached; execution is a separate pass in which every step is an ``autograd.Function`` whose backward
is the step's exact adjoint:

=====================================  =========================================================
forward step                           adjoint (backward)
=====================================  =========================================================
AllGather   ``o_g -> *`` over g        ReduceScatter ``Σ_g -> o_g``
ReduceScatter ``Σ_g -> o_g``           AllGather
AllReduce   ``Σ_g -> *``               AllReduce
Slice       ``* -> o_g`` (discard)     Pad ``o_g -> Σ_g``: the local grad in zeros, pending over g
Pad         ``o_g -> Σ_g``             Slice
AllToAll    dim i over g -> dim j      AllToAll back, dim j -> dim i
KeepRoot    ``* -> Σ_g``               KeepRoot (self-adjoint)
=====================================  =========================================================

The cotangent of a tensor in Dist ``D`` lives in ``D.dual(grid)`` (pending and redundant dims
swapped): a replicated tensor's gradient is the sum of every rank's contribution. With that
convention the pairing of a tensor with its cotangent is the sum over all ranks of the local inner
products, and the backward of a redistribution ``S -> T`` is exactly the redistribution
``T.dual -> S.dual``. Slicing a replicated tensor therefore needs no communication in backward: its
gradient stays a pending sum until something needs it complete.

Planning is greedy, shrinking before growing: reduce-scatters, slices, allreduces (one merged
collective over every pending dim that must be summed), all-to-alls, pads, allgathers (minor dim
first, so every allgather is a segmented allgather of nested blocks), and finally KeepRoot for
pending sums the target introduces. Where a pending sum's reduce-scatter must wait for a gather,
the planner also tries summing it first (an allreduce on the smaller data) and keeps the plan
that moves fewer bytes in total.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from distconv.comm.base import (
    Work, agree_on_value, allreduce_bytes, concat_parts, get_debug, packed, split_chunks,
)
from distconv.distribution import Dist, as_shape, balanced_block, nested_block
from distconv.grid import CANONICAL_DIMS, ProcessorGrid

if TYPE_CHECKING:
    from distconv.comm import Communicator

__all__ = [
    "AllGather", "AllReduce", "AllToAll", "KeepRoot", "Pad", "Plan", "ReduceScatter", "Slice",
    "RepartitionPlan", "gather", "plan_redistribution", "redistribute", "repartition", "scatter",
]

Layout = tuple[tuple[str, int], ...]


def _extent(layout: Layout, name: str) -> int:
    for n, e in layout:
        if n == name:
            return e
    if name in CANONICAL_DIMS:
        return 1
    raise ValueError(f"grid dim {name!r} is not in the grid {dict(layout)}")


# --------------------------------------------------------------------------- execution context
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


# --------------------------------------------------------------------------- steps
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


# --------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class Plan:
    """The steps that take a tensor from ``src`` to ``dst`` on one grid."""

    layout: Layout
    src: Dist
    dst: Dist
    global_shape: tuple[int, ...]
    steps: tuple[Step, ...]

    def describe(self) -> str:
        head = f"{self.src} -> {self.dst}"
        return head if not self.steps else head + ": " + "; ".join(map(str, self.steps))

    def received_bytes(self, grid: ProcessorGrid, itemsize: int) -> int:
        """Bytes this rank receives executing the plan (the communicators count the same)."""
        ctx = _Ctx(grid, self.global_shape, "")
        shape = self.src.local_shape(self.global_shape, grid)
        total = 0
        for step in self.steps:
            shape, got = step.received(shape, ctx)
            total += got
        return total * itemsize


def plan_redistribution(
    layout: Layout, src: Dist, dst: Dist, global_shape: Sequence[int]
) -> Plan:
    """Plan the redistribution of a tensor of ``global_shape`` from ``src`` to ``dst``.

    Pure and cached: every rank computes the same plan from shared information only.
    """
    if isinstance(layout, ProcessorGrid) or not isinstance(layout, (tuple, list)):
        raise TypeError(
            f"plan_redistribution: layout must be a grid layout ((name, extent), ...) such as "
            f"grid.layout, got {layout!r}"
        )
    for name, d in (("src", src), ("dst", dst)):
        if not isinstance(d, Dist):
            raise TypeError(f"plan_redistribution: {name} must be a distconv.Dist, got {d!r}")
    shape = as_shape(global_shape, "plan_redistribution: global_shape")
    return _plan(tuple(tuple(p) for p in layout), src, dst, shape)


@functools.lru_cache(maxsize=4096)
def _plan(layout: Layout, src: Dist, dst: Dist, global_shape: tuple[int, ...]) -> Plan:
    """The cheaper (total bytes over all ranks) of two greedy plans that differ in one choice:
    a pending sum the target distributes waits for its reduce-scatter, or -- when its tensor dim
    must first be gathered -- is allreduced at once, while the data is still small."""
    plans = [_greedy(layout, src, dst, global_shape, eager) for eager in (False, True)]
    if plans[0].steps == plans[1].steps:
        return plans[0]
    cost = [_total_bytes(p) for p in plans]
    return plans[1] if cost[1] < cost[0] else plans[0]


def _total_bytes(plan: Plan) -> int:
    from types import SimpleNamespace

    from distconv.grid import ProcessorGrid

    size = math.prod(e for _, e in plan.layout)
    return sum(
        plan.received_bytes(ProcessorGrid(dict(plan.layout), comm=SimpleNamespace(
            rank=r, size=size, backend="none")), itemsize=1)
        for r in range(size)
    )


def _greedy(
    layout: Layout, src: Dist, dst: Dist, global_shape: tuple[int, ...], eager: bool
) -> Plan:
    for d in (src, dst):
        if d.ndim != len(global_shape):
            raise ValueError(
                f"{d} has {d.ndim} entries but the global shape {global_shape} has "
                f"{len(global_shape)} dims"
            )
        for name in sorted(d.used() | d.pending):
            _extent(layout, name)
    live = {n for n, e in layout if e > 1}
    cur = [[g for g in src.grid_dims_of(i) if g in live] for i in range(src.ndim)]
    tgt = [tuple(g for g in dst.grid_dims_of(i) if g in live) for i in range(dst.ndim)]
    pending = {g for g in src.pending if g in live}
    want_pending = {g for g in dst.pending if g in live}
    steps: list[Step] = []

    def ready(i: int) -> bool:
        return tuple(cur[i]) == tgt[i][: len(cur[i])]

    def next_of(i: int) -> str | None:
        return tgt[i][len(cur[i])] if ready(i) and len(cur[i]) < len(tgt[i]) else None

    def used() -> set[str]:
        return {g for t in cur for g in t}

    for _ in range(4 * (len(live) + 1) * (len(cur) + 1)):
        if [tuple(t) for t in cur] == tgt and pending == want_pending:
            return Plan(layout, src, dst, global_shape, tuple(steps))
        steps.append(_next_step(cur, tgt, pending, want_pending, ready, next_of, used, eager))
    raise AssertionError(f"redistribution planner did not converge for {src} -> {dst}")


def _next_step(cur, tgt, pending, want_pending, ready, next_of, used, eager) -> Step:  # noqa: ANN001
    # 1. reduce-scatter a pending sum straight into the target's block
    for i in range(len(cur)):
        g = next_of(i)
        if g is not None and g in pending and g not in want_pending:
            pending.discard(g)
            step = ReduceScatter(i, g, tuple(cur[i]))
            cur[i].append(g)
            return step
    # 2. discard: slice a replicated dim into the target's block
    for i in range(len(cur)):
        g = next_of(i)
        if g is not None and g not in used() and g not in pending:
            step = Slice(i, g, tuple(cur[i]))
            cur[i].append(g)
            return step
    # 3. sum every pending dim the target neither keeps pending nor distributes, in one collective
    # (eager: also those the target distributes, whose reduce-scatter is not possible yet)
    target_used = set() if eager else {g for t in tgt for g in t}
    done = sorted(g for g in pending if g not in want_pending and g not in target_used)
    if done:
        pending.difference_update(done)
        return AllReduce(tuple(done))
    extras = [i for i in range(len(cur)) if not ready(i)]
    # 4. all-to-all: an extra minor grid dim that the target wants next on another tensor dim
    for i in extras:
        g = cur[i][-1]
        for j in range(len(cur)):
            if j != i and next_of(j) == g:
                step = AllToAll(i, j, g, tuple(cur[i][:-1]), tuple(cur[j]))
                cur[i].pop()
                cur[j].append(g)
                return step
    # 5. pad: an extra minor grid dim that the target holds as a pending sum
    for i in extras:
        g = cur[i][-1]
        if g in want_pending and g not in pending:
            cur[i].pop()
            pending.add(g)
            return Pad(i, g, tuple(cur[i]))
    # 6. allgather the minor extra grid dim
    if extras:
        i = extras[0]
        g = cur[i].pop()
        return AllGather(i, g, tuple(cur[i]))
    # 7. a pending sum the target introduces over a dim the tensor is replicated on
    for g in sorted(want_pending - pending):
        if g not in used():
            pending.add(g)
            return KeepRoot(g)
    raise AssertionError(f"redistribution planner is stuck at {cur} (pending {sorted(pending)})")


# --------------------------------------------------------------------------- execution
class _StepFunction(torch.autograd.Function):
    """One redistribution step bound to this rank's block (:func:`_runner`); backward runs the
    step's adjoint."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, runner: _Run) -> torch.Tensor:  # noqa: ANN001
        ctx.runner = runner
        return runner[0](x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return ctx.runner[1](grad.contiguous()), None


#: a step bound to one rank and block shape: (forward, adjoint), each a block -> block
_Run = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


def _runner(step: Step, ctx: _Ctx, shape: tuple[int, ...]) -> _Run:
    """``step`` on this rank's block of ``shape``, its arguments derived once: an allgather or
    reduce-scatter (the steps a channel- or filter-parallel layer runs per step, both ways)
    calls its communicator's planned collective, every other step its own ``run``."""
    if isinstance(step, (AllGather, ReduceScatter)):
        comm, dim = ctx.comm((step.g,)), step.dim
        sizes = ctx.parts(dim, step.prefix, step.g)
        gather, scatter = ((step, step.adjoint()) if isinstance(step, AllGather)
                           else (step.adjoint(), step))
        shapes = [_with(shape, dim, n) for n in sizes]
        gather_meta, scatter_meta = ctx.meta(gather), ctx.meta(scatter)

        def allgather(x: torch.Tensor) -> torch.Tensor:
            return comm._allgather_along(x.contiguous(), shapes, dim, gather_meta)

        def reduce_scatter(x: torch.Tensor) -> torch.Tensor:
            return comm._reduce_scatter_along(x.contiguous(), sizes, dim, scatter_meta)

        return ((allgather, reduce_scatter) if isinstance(step, AllGather)
                else (reduce_scatter, allgather))
    adjoint = step.adjoint()
    return (lambda x: step.run(x, ctx)), (lambda g: adjoint.run(g, ctx))


def redistribute(
    x: torch.Tensor, grid: ProcessorGrid, src: Dist, dst: Dist, global_shape: Sequence[int]
) -> torch.Tensor:
    """Redistribute the local block ``x`` of a tensor of ``global_shape`` from ``src`` to ``dst``.

    Args:
        x: this rank's block, distributed as ``src``.
        grid: the processor grid both distributions refer to.
        src, dst: source and target distributions.
        global_shape: the tensor's global shape (the same on every rank).

    Returns:
        This rank's block distributed as ``dst``. Differentiable: the gradient flows back through
        the exact adjoint of every step, the cotangent living in ``dst.dual(grid)``.

    Raises:
        ValueError: a distribution that does not fit the grid or the shape, or an ``x`` whose shape
            is not ``src``'s local block of ``global_shape``.
    """
    # a block shape, distributions and global shape seen on this grid before: checked and
    # planned then (the layers of a network call this per step with the same arguments)
    key = bound = None
    if (type(grid) is ProcessorGrid and type(src) is Dist and type(dst) is Dist
            and type(global_shape) is tuple and all(type(n) is int for n in global_shape)):
        key = (src, dst, global_shape)
        bound = grid._bound.get(key)
    if bound is None or not isinstance(x, torch.Tensor) or x.shape != bound[0]:
        bound = _bind(x, grid, src, dst, global_shape, key)
    for runner in bound[1]:
        x = _StepFunction.apply(x, runner)
    return x


def _bind(x: object, grid: object, src: object, dst: object, global_shape: object,
          key: tuple | None) -> tuple[tuple[int, ...], tuple[_Run, ...]]:
    """Check ``redistribute``'s arguments and plan it: ``(x's shape, the steps bound to this
    block)``, remembered on the grid under ``key`` (None: not remembered)."""
    global_shape = _check_args("redistribute", x, grid, global_shape, src=src, dst=dst)
    expected = src.local_shape(global_shape, grid)  # also rejects unknown grid dims
    if tuple(x.shape) != expected:
        raise ValueError(
            f"redistribute: local block has shape {tuple(x.shape)} but {src} of global shape "
            f"{global_shape} gives rank {grid.rank} (coords {grid.coords}) the shape {expected}"
        )
    plan = plan_redistribution(grid.layout, src, dst, global_shape)
    rctx = _Ctx(grid, global_shape, f"{src} -> {dst} of {global_shape}")
    runners, shape = [], expected
    for step in plan.steps:
        runners.append(_runner(step, rctx, shape))
        shape = step.received(shape, rctx)[0]
    return _remember(grid, key, (expected, tuple(runners)))


def _remember(grid: ProcessorGrid, key: tuple | None, bound: tuple) -> tuple:
    """``bound`` kept on ``grid`` under ``key`` (None: not kept) for the next call with the same
    arguments; at most 256 (shapes that keep changing clear it)."""
    if key is not None:
        if len(grid._bound) > 256:
            grid._bound.clear()
        grid._bound[key] = bound
    return bound


def scatter(x: torch.Tensor, dist: Dist, grid: ProcessorGrid) -> torch.Tensor:
    """This rank's block of the global tensor ``x`` (the same on every rank) in ``dist``.

    A pending sum keeps the whole value on coordinate 0 and zeros elsewhere. In debug mode
    (:func:`distconv.comm.set_debug`) the ranks first compare a digest of ``x`` and raise
    :class:`~distconv.comm.CollectiveMismatchError` when it differs (a silent mix otherwise).
    """
    _check_args("scatter", x, grid, (), dist=dist)
    if get_debug():
        agree_on_value(grid.comm, x, "scatter: the global tensor x")
    return redistribute(x, grid, Dist.replicated(x.dim()), dist, x.shape)


def gather(
    x: torch.Tensor, dist: Dist, grid: ProcessorGrid, global_shape: Sequence[int]
) -> torch.Tensor:
    """The global tensor, on every rank, from the local blocks ``x`` in ``dist`` (pending sums summed)."""
    shape = _check_args("gather", x, grid, global_shape, dist=dist)
    return redistribute(x, grid, dist, Dist.replicated(len(shape)), shape)


def _check_args(
    where: str, x: object, grid: object, global_shape: object, **dists: object
) -> tuple[int, ...]:
    """TypeErrors for arguments of the wrong kind, naming them; the global shape as ints."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{where}: x must be a torch.Tensor, got {type(x).__name__}"
        )
    if not isinstance(grid, ProcessorGrid):
        raise TypeError(
            f"{where}: grid must be a distconv.ProcessorGrid, got {grid!r} ({type(grid).__name__})"
        )
    for name, d in dists.items():
        if not isinstance(d, Dist):
            hint = " (use Dist.parse for the paper's notation)" if isinstance(d, str) else ""
            raise TypeError(
                f"{where}: {name} must be a distconv.Dist, got {d!r} ({type(d).__name__}){hint}"
            )
    return as_shape(global_shape, f"{where}: global_shape")



# --------------------------------------------------------------------------- between grids
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
