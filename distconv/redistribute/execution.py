"""Running a plan: every step an ``autograd.Function`` whose backward is the step's exact
adjoint, bound once per block shape and remembered on the grid (``redistribute``, ``scatter``,
``gather``)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from distconv.comm.base import agree_on_value, get_debug
from distconv.distribution import Dist, as_shape
from distconv.grid import ProcessorGrid
from distconv.redistribute.planning import plan_redistribution
from distconv.redistribute.steps import AllGather, ReduceScatter, Step, _Ctx, _with


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
