"""What the layers around DistConv2d share: checking an activation's Dist, its local block and
its global shape, the communicator of one of its entries, and printing it in the paper's notation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.memo import BoundedMemo

if TYPE_CHECKING:
    from distconv.comm import Communicator

__all__ = [
    "check_activation_dist", "check_grid", "connected_zeros", "entry_comm", "resolve_shape",
    "show", "split_dims",
]

# Tensor-dim names used only for printing: samples and spatial dims over their own grid dim print
# as plain ``o``, channels as ``o_C`` (the paper writes x[o,o_C,o,o]).
_PRINT_DIMS = ("N", "channels", "H", "W")


def check_grid(layer: str, grid: object) -> ProcessorGrid:
    if not isinstance(grid, ProcessorGrid):
        raise TypeError(
            f"{layer}: grid must be a distconv.grid.ProcessorGrid, got {type(grid).__name__}"
        )
    return grid


def check_activation_dist(layer: str, grid: ProcessorGrid, input_dist: object,
                          ndims: Sequence[int] = (4,)) -> Dist:
    """``input_dist`` as a Dist of one of ``ndims`` entries (N, C and the spatial dims; default:
    4, (N, C, H, W)) on ``grid`` with no pending dims."""
    want = " or ".join(map(str, ndims))
    if not isinstance(input_dist, Dist):
        raise TypeError(
            f"{layer}: input_dist must be a distconv.Dist with {want} entries (N, C and the "
            f"spatial dims), e.g. Dist.parse('x[o,o_C,o,o]', 'NCHW'); got "
            f"{type(input_dist).__name__}"
        )
    if input_dist.ndim not in ndims:
        raise ValueError(
            f"{layer}: input_dist must have {want} entries (N, C and the spatial dims), got "
            f"{input_dist} with {input_dist.ndim}"
        )
    if input_dist.pending:
        raise ValueError(
            f"{layer}: input_dist {input_dist} holds a pending sum over "
            f"{', '.join(sorted(input_dist.pending))}; the input must be complete (resolve the "
            "sum first with distconv.redistribute)"
        )
    try:
        input_dist.validate(grid)
    except ValueError as exc:
        raise ValueError(f"{layer}: input_dist {input_dist} does not fit the grid: {exc}") from exc
    return input_dist


def split_dims(grid: ProcessorGrid, dist: Dist, dim: int) -> tuple[str, ...]:
    """The grid dims (major first) of entry ``dim`` that really split it (extent > 1)."""
    return tuple(g for g in dist.grid_dims_of(dim) if grid.extent(g) > 1)


def entry_comm(grid: ProcessorGrid, dims: Sequence[str]) -> Communicator | None:
    """Communicator over ``dims`` whose sub-rank is the linear index of the nested block
    (``dims`` major first), so sub-rank order is block order. None when ``dims`` is empty.

    Collective on first use, like :meth:`ProcessorGrid.subcomm` (which it is when ``dims`` are in
    grid order; otherwise the groups are reordered and the split is cached by the communicator).
    """
    dims = tuple(dims)
    if not dims:
        return None
    if dims == tuple(n for n in grid.names if n in dims):
        return grid.subcomm(dims)
    groups = []
    for segment in grid.segments(dims):
        def linear(rank: int) -> int:
            coords, index = grid.coords_of(rank), 0
            for d in dims:
                index = index * grid.extent(d) + coords[d]
            return index
        groups.append(sorted(segment, key=linear))
    return grid.comm.split(groups)


# (grid, dist, global shape) -> this rank's block shape: a layer checks its input every step
_LOCAL_SHAPES: BoundedMemo[tuple[int, ...]] = BoundedMemo(4096)


def local_shape(grid: ProcessorGrid, dist: Dist, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``dist.local_shape(shape, grid)``, remembered (layers check their input every step)."""
    return _LOCAL_SHAPES.get((grid, dist, shape), lambda: dist.local_shape(shape, grid))


def resolve_shape(
    layer: str, grid: ProcessorGrid, dist: Dist, x: torch.Tensor,
    global_shape: Sequence[int] | None, memo: dict[Any, Any] | None = None,
) -> tuple[int, ...]:
    """The global shape ((N, C, H, W) for a 4-d ``dist``), checked against this rank's block ``x`` in ``dist``. ``memo``: the
    calling layer's own dict of the (block shape, global shape) pairs it has checked (a layer is
    called with the same pair every step, and its grid and dist never change)."""
    key = (x.shape, global_shape) if memo is not None and type(global_shape) is tuple else None
    if key is not None:
        found = memo.get(key)
        if found is not None:
            return found
    shape = _resolve_shape(layer, grid, dist, x, global_shape)
    if key is not None:
        if len(memo) > 64:
            memo.clear()
        memo[key] = shape
    return shape


def _resolve_shape(
    layer: str, grid: ProcessorGrid, dist: Dist, x: torch.Tensor,
    global_shape: Sequence[int] | None,
) -> tuple[int, ...]:
    nd = dist.ndim
    form = "(N, C, H, W)" if nd == 4 else "(N, C, spatial...)"
    if x.dim() != nd:
        raise ValueError(f"{layer} takes a {nd}-d {form} block, got shape {tuple(x.shape)}")
    if global_shape is None:
        if any(split_dims(grid, dist, d) for d in range(nd)):
            raise ValueError(
                f"{layer}: pass global_shape to forward: {show(dist, 'x')} splits the tensor over "
                "the grid, and local block sizes alone do not determine the global shape"
            )
        return tuple(x.shape)
    shape = tuple(global_shape)
    if len(shape) != nd or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise ValueError(
            f"{layer}: global_shape must be {nd} non-negative ints {form}, got {global_shape!r}"
        )
    expected = local_shape(grid, dist, shape)
    if tuple(x.shape) != expected:
        raise ValueError(
            f"{layer}: rank {grid.rank} (coords {grid.coords}) got an input block of shape "
            f"{tuple(x.shape)}, but {show(dist, 'x')} of the global shape {shape} gives it "
            f"{expected}"
        )
    return shape


def connected_zeros(like: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Zeros of ``shape`` that stay in ``like``'s autograd graph (with a zero gradient).

    A rank whose block is empty computes nothing, but its backward must still reach the
    collectives that produced ``like`` (its peers wait for it there)."""
    anchor = like.reshape(-1)[:0].sum()
    return like.new_zeros(tuple(shape)) + anchor


def show(dist: Dist, name: str) -> str:
    """``dist`` in the paper's notation for an activation called ``name``."""
    if dist.ndim == 4:
        dist = Dist(dist.entries, dist.pending, _PRINT_DIMS)
    elif dist.ndim == 1:
        dist = Dist(dist.entries, dist.pending, ("channels",))
    return dist.format(name)

