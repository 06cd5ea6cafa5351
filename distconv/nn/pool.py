"""Pooling of a distributed activation: max and average pooling over 1, 2 or 3 spatial dims with
spatial halos, and global average pooling over spatial blocks."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from distconv.conv_geometry import ConvDim, HaloPlan, pair
from distconv.distribution import Dist, nested_block
from distconv.grid import ProcessorGrid
from distconv.halo import halo_exchange
from distconv.nn._activation import (
    check_activation_dist, check_grid, connected_zeros, entry_comm, resolve_shape, show,
    split_dims,
)
from distconv.nn.sharding import ShardSpec

__all__ = [
    "POOLS", "DistAdaptiveAvgPool2d", "DistAvgPool1d", "DistAvgPool2d", "DistAvgPool3d",
    "DistMaxPool1d", "DistMaxPool2d", "DistMaxPool3d", "from_function", "from_module",
]


# --------------------------------------------------------------------------- geometry
def pool_out_length(length: int, kernel: int, stride: int, padding: int, dilation: int,
                    ceil_mode: bool) -> int:
    """Output length of a pooling window on one dim, exactly as PyTorch computes it: with
    ``ceil_mode`` the last window may overhang the padded input, but must start inside the input
    or the leading padding."""
    span = dilation * (kernel - 1) + 1
    out = (length + 2 * padding - span + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= length + padding:
        out -= 1
    return out


def pool_dim(length: int, kernel: int, stride: int, padding: int, dilation: int,
             ceil_mode: bool) -> ConvDim:
    """The pooling window on one dim as a :class:`ConvDim`; a ``ceil_mode`` overhang becomes extra
    trailing padding, so the windows are those of an ordinary (floor-mode) convolution."""
    out = pool_out_length(length, kernel, stride, padding, dilation, ceil_mode)
    span = dilation * (kernel - 1) + 1
    after = max(padding, (out - 1) * stride + span - length - padding)
    return ConvDim(length, kernel, stride, dilation, padding, after)


@dataclass(frozen=True)
class _NestedHaloPlan(HaloPlan):
    """A :class:`HaloPlan` whose input and output rows are nested blocks over ``extents`` (major
    first; part ``r`` is the linear index of the block), as a tuple entry ``o_{P×Q}`` lays them
    out. With one extent these are the balanced blocks of ``HaloPlan``."""

    extents: tuple[int, ...] = ()

    def _blocks(self, n: int) -> tuple[tuple[int, int], ...]:
        out = []
        for r in range(self.parts):
            coords, index = [], r
            for e in reversed(self.extents):
                index, c = divmod(index, e)
                coords.append(c)
            start, size = nested_block(n, self.extents, coords[::-1])
            out.append((start, start + size))
        return tuple(out)

    @cached_property
    def owned(self) -> tuple[tuple[int, int], ...]:
        return self._blocks(self.dim.length)

    @cached_property
    def out(self) -> tuple[tuple[int, int], ...]:
        return self._blocks(self.dim.out_length)


@dataclass(frozen=True)
class _Geometry:
    """What a forward pass derives from the global input shape (cached per shape)."""

    out_shape: tuple[int, ...]
    plans: tuple[_NestedHaloPlan, ...]


def _positive_tuple(value: Any, name: str, dims: int, minimum: int = 1) -> tuple[int, ...]:
    """``value`` (an int or ``dims`` ints) as ``dims`` ints of at least ``minimum``."""
    if dims == 2:
        p = pair(value, name)
    elif isinstance(value, int) and not isinstance(value, bool):
        p = (value,) * dims
    elif isinstance(value, (tuple, list)) and len(value) == dims and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        p = tuple(int(v) for v in value)
    else:
        raise TypeError(f"{name} must be an int or {dims} ints, got {value!r}")
    if min(p) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return p


_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


# --------------------------------------------------------------------------- windowed pooling
class _DistPool(nn.Module):
    """Shared by max and average pooling over ``_dims`` spatial dims: the halo geometry and the
    forward pass.

    Each rank owns the blocks of output rows that the input's spatial entries give it (nested
    balanced blocks of the output length) and gathers, by halo exchange over the grid dims of
    each entry (dim after dim, e.g. H, then W, so corners travel with the later exchange), the
    input rows its windows read; it then adds the global padding itself (-inf for max, zeros for
    average, including a ``ceil_mode`` overhang) and pools without padding. Channel and sample
    dims are untouched: pooling is channel-wise, so channel distributions move no data.
    """

    _fill = 0.0
    _dims = 2

    @property
    def _name(self) -> str:
        return type(self).__name__

    def _setup(self, grid: ProcessorGrid, input_dist: Dist, kernel_size: Any, stride: Any,
               padding: Any, dilation: Any) -> None:
        k = self._dims
        self.grid = check_grid(self._name, grid)
        self.input_dist = check_activation_dist(self._name, grid, input_dist, (2 + k,))
        self.output_dist = self.input_dist
        self.kernel_size = _positive_tuple(kernel_size, "kernel_size", k)
        if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0):
            stride = self.kernel_size
        self.stride = _positive_tuple(stride, "stride", k)
        self.padding = _positive_tuple(padding, "padding", k, minimum=0)
        self.dilation = _positive_tuple(dilation, "dilation", k)
        for size, p in zip(self.kernel_size, self.padding):
            if p > size // 2:
                raise ValueError(
                    f"{self._name}: padding must be at most half the kernel size (as PyTorch "
                    f"requires), got padding={self.padding} for kernel_size={self.kernel_size}"
                )
        self._split = tuple(split_dims(grid, self.input_dist, d) for d in range(2, 2 + k))
        # Sub-communicators are created collectively, in the same order on every rank.
        self._comms = tuple(entry_comm(grid, dims) for dims in self._split)
        self._geometries: dict[tuple[int, ...], _Geometry] = {}

    def _geometry(self, shape: tuple[int, ...]) -> _Geometry:
        geo = self._geometries.get(shape)
        if geo is not None:
            return geo
        dims = []
        for i in range(self._dims):
            length = shape[2 + i]
            args = (self.kernel_size[i], self.stride[i], self.padding[i], self.dilation[i],
                    self.ceil_mode)
            if pool_out_length(length, *args) < 1:
                raise ValueError(
                    f"{self._name}: the input {shape} is too small: no output on dim "
                    f"{'DHW'[3 - self._dims + i]} (kernel_size={self.kernel_size}, stride={self.stride}, "
                    f"padding={self.padding}, dilation={self.dilation}, "
                    f"ceil_mode={self.ceil_mode})"
                )
            dims.append(pool_dim(length, *args))
        plans = tuple(
            _NestedHaloPlan(d, max(1, _prod(self.grid, s)), extents=tuple(
                self.grid.extent(g) for g in s)) for d, s in zip(dims, self._split)
        )
        geo = _Geometry((shape[0], shape[1], *(d.out_length for d in dims)), plans)
        self._geometries[shape] = geo
        return geo

    def output_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        """Global output shape for the global input shape ``(N, C, *spatial)``."""
        return self._geometry(tuple(int(s) for s in global_shape)).out_shape

    def _shard_specs(self) -> dict[str, ShardSpec]:
        return {}

    def forward(self, x: torch.Tensor, global_shape: Sequence[int] | None = None) -> Any:
        """Pool this rank's block ``x`` of the global input of shape ``global_shape`` (in
        :attr:`input_dist`); returns this rank's block of the output (in :attr:`output_dist`).
        ``global_shape`` may be left out only when ``input_dist`` splits nothing."""
        shape = resolve_shape(self._name, self.grid, self.input_dist, x, global_shape,
                              self.__dict__.setdefault("_resolved", {}))
        geo = self._geometry(shape)
        local_out = self.output_dist.local_shape(geo.out_shape, self.grid)
        if not any(self._split):
            if x.numel() == 0:
                return self._empty(x, local_out)
            return self._torch_pool(x)
        pads = []
        for i, (comm, plan) in enumerate(zip(self._comms, geo.plans)):
            r = 0 if comm is None else comm.rank
            if comm is not None:
                x = halo_exchange(x, comm, plan, 2 + i)
                before, after = plan.pad[r]
                x = x.narrow(2 + i, before, x.shape[2 + i] - before - after)
            else:
                lo, hi = plan.needed[0]
                x = x.narrow(2 + i, lo, hi - lo)
            pads.append(plan.pad[r])
        if 0 in local_out:
            return self._empty(x, local_out)
        # (x may hold no rows here: a dilated max window can read only padding)
        flat = [p for pad in reversed(pads) for p in pad]
        if any(flat):  # (a copy: only where there is padding to add)
            x = F.pad(x, flat, value=self._fill)
        return self._windows(x, geo)

    def _empty(self, x: torch.Tensor, shape: Sequence[int]) -> Any:
        return connected_zeros(x, shape)

    def _torch_pool(self, x: torch.Tensor) -> Any:
        raise NotImplementedError

    def _windows(self, x: torch.Tensor, geo: _Geometry) -> torch.Tensor:
        raise NotImplementedError

    def _describe(self) -> str:
        return (f"grid={dict(self.grid.layout)}, x={show(self.input_dist, 'x')}, "
                f"y={show(self.output_dist, 'y')}")


def _prod(grid: ProcessorGrid, dims: Sequence[str]) -> int:
    out = 1
    for d in dims:
        out *= grid.extent(d)
    return out


class _DistMaxPool(_DistPool):
    """``nn.MaxPool1d/2d/3d`` on a distributed activation: ``x[...] -> y[...]`` with the same
    Dist. (An ``nn.MaxPool2d`` (``1d``, ``3d``) for ``isinstance``.)

    Spatial dims blocked over grid dims gather the input rows their output block reads by halo
    exchange and pad with -inf, so every window sees exactly the values it sees on one process
    (ties resolve as PyTorch resolves them); backward sends the halo rows' gradients back to their
    owners (halo accumulate). Channel and sample distributions move no data. (One corner differs:
    a dilated window that holds only padding gives -inf, as in PyTorch, but its gradient is
    dropped, where PyTorch sends it to an element outside the window.)

    Args:
        kernel_size, stride, padding, dilation, return_indices, ceil_mode: as ``nn.MaxPool2d``
            (``1d``, ``3d``). ``return_indices=True`` is implemented when no spatial dim is
            split (the indices are then the single-process ones).
        grid: the :class:`~distconv.grid.ProcessorGrid` over all ranks.
        input_dist: the Dist of the input (N, C and the spatial dims, no pending dims).

    Raises:
        TypeError / ValueError: bad arguments (as PyTorch refuses them), naming the argument.
        NotImplementedError: ``return_indices=True`` with a spatially split input.
    """

    _fill = float("-inf")
    _plain: type[nn.Module] = nn.MaxPool2d

    def __init__(
        self,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] | None = None,
        padding: int | tuple[int, int] = 0,
        dilation: int | tuple[int, int] = 1,
        return_indices: bool = False,
        ceil_mode: bool = False,
        *,
        grid: ProcessorGrid,
        input_dist: Dist,
    ) -> None:
        nn.Module.__init__(self)  # the torch class's init takes its own arguments
        self.return_indices, self.ceil_mode = bool(return_indices), bool(ceil_mode)
        self._setup(grid, input_dist, kernel_size, stride, padding, dilation)
        if self.return_indices and any(self._split):
            raise NotImplementedError(
                f"{self._name}: return_indices=True is not implemented when the spatial dims "
                f"are split ({show(self.input_dist, 'x')}); indices into a haloed local block "
                "are not the single-process ones. Use return_indices=False, or keep the spatial "
                "dims unsplit (e.g. x[o,o_C,*,*])"
            )

    @classmethod
    def from_plain(cls, layer: nn.Module, *, grid: ProcessorGrid, input_dist: Dist) -> Any:
        """Shard the plain pooling module of this class's kind (no parameters)."""
        if not isinstance(layer, cls._plain):
            raise TypeError(f"layer must be an nn.{cls._plain.__name__}, got "
                            f"{type(layer).__name__}")
        return cls(layer.kernel_size, layer.stride, layer.padding, layer.dilation,
                   layer.return_indices, layer.ceil_mode, grid=grid, input_dist=input_dist)

    def to_plain(self) -> nn.Module:
        """The plain torch module (no parameters, so no communication)."""
        return self._plain(self.kernel_size, self.stride, self.padding, self.dilation,
                           self.return_indices, self.ceil_mode)

    def _torch_pool(self, x: torch.Tensor) -> Any:
        return _MAX[self._dims](x, self.kernel_size, self.stride, self.padding, self.dilation,
                                ceil_mode=self.ceil_mode, return_indices=self.return_indices)

    def _empty(self, x: torch.Tensor, shape: Sequence[int]) -> Any:
        y = connected_zeros(x, shape)
        if self.return_indices:
            return y, torch.zeros(tuple(shape), dtype=torch.long, device=x.device)
        return y

    def _windows(self, x: torch.Tensor, geo: _Geometry) -> torch.Tensor:
        return _MAX[self._dims](x, self.kernel_size, self.stride, 0, self.dilation)

    def extra_repr(self) -> str:
        return (
            f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
            f"dilation={self.dilation}, ceil_mode={self.ceil_mode}, "
            f"return_indices={self.return_indices}, {self._describe()}"
        )


class _DistAvgPool(_DistPool):
    """``nn.AvgPool1d/2d/3d`` on a distributed activation: ``x[...] -> y[...]`` with the same
    Dist. (An ``nn.AvgPool2d`` (``1d``, ``3d``) for ``isinstance``.)

    Spatial dims blocked over grid dims gather their windows' rows by halo exchange and pad with
    zeros; each window's sum is divided by PyTorch's divisor for that window, computed from its
    global position: the window clipped to the padded input (``count_include_pad=True``, so a
    ``ceil_mode`` overhang is not counted) or to the input (``False``), or ``divisor_override``.

    Args:
        kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override: as
            ``nn.AvgPool2d`` (``1d``: no ``divisor_override``; ``3d``).
        grid: the :class:`~distconv.grid.ProcessorGrid` over all ranks.
        input_dist: the Dist of the input (N, C and the spatial dims, no pending dims).

    Raises:
        TypeError / ValueError: bad arguments (as PyTorch refuses them), naming the argument.
    """

    _plain: type[nn.Module] = nn.AvgPool2d

    def __init__(
        self,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] | None = None,
        padding: int | tuple[int, int] = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: int | None = None,
        *,
        grid: ProcessorGrid,
        input_dist: Dist,
    ) -> None:
        nn.Module.__init__(self)  # the torch class's init takes its own arguments
        self.ceil_mode, self.count_include_pad = bool(ceil_mode), bool(count_include_pad)
        if divisor_override is not None and (
            isinstance(divisor_override, bool) or not isinstance(divisor_override, int)
            or divisor_override == 0
        ):
            raise ValueError(
                f"divisor_override must be None or a non-zero int, got {divisor_override!r}"
            )
        self.divisor_override = divisor_override
        self._setup(grid, input_dist, kernel_size, stride, padding, 1)

    @classmethod
    def from_plain(cls, layer: nn.Module, *, grid: ProcessorGrid, input_dist: Dist) -> Any:
        """Shard the plain pooling module of this class's kind (no parameters)."""
        if not isinstance(layer, cls._plain):
            raise TypeError(f"layer must be an nn.{cls._plain.__name__}, got "
                            f"{type(layer).__name__}")
        return cls(layer.kernel_size, layer.stride, layer.padding, layer.ceil_mode,
                   layer.count_include_pad, getattr(layer, "divisor_override", None), grid=grid,
                   input_dist=input_dist)

    def to_plain(self) -> nn.Module:
        """The plain torch module (no parameters, so no communication)."""
        if self._dims == 1:
            return nn.AvgPool1d(self.kernel_size, self.stride, self.padding, self.ceil_mode,
                                self.count_include_pad)
        return self._plain(self.kernel_size, self.stride, self.padding, self.ceil_mode,
                           self.count_include_pad, self.divisor_override)

    def _torch_pool(self, x: torch.Tensor) -> torch.Tensor:
        if self._dims == 1:  # avg_pool1d takes no divisor_override
            return F.avg_pool1d(x, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                                self.count_include_pad)
        return _AVG[self._dims](x, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                                self.count_include_pad, self.divisor_override)

    def _windows(self, x: torch.Tensor, geo: _Geometry) -> torch.Tensor:
        k = self._dims
        if self.divisor_override is not None:
            return _AVG[k](x, self.kernel_size, self.stride, 0,
                           divisor_override=self.divisor_override)
        if k == 1:  # each window's sum (avg_pool1d takes no divisor_override)
            sums = F.avg_pool2d(x.unsqueeze(-1), (self.kernel_size[0], 1), (self.stride[0], 1),
                                0, divisor_override=1).squeeze(-1)
        else:
            sums = _AVG[k](x, self.kernel_size, self.stride, 0, divisor_override=1)
        divisor = None
        for i in range(k):  # the product of the per-dim window sizes
            d = self._divisors(geo.plans[i], i, x).view(*([1] * i), -1, *([1] * (k - 1 - i)))
            divisor = d if divisor is None else divisor * d
        return sums / divisor

    def _divisors(self, plan: _NestedHaloPlan, i: int, x: torch.Tensor) -> torch.Tensor:
        """PyTorch's per-dim window size for each of this rank's output rows on spatial dim i."""
        comm = self._comms[i]
        lo, hi = plan.out[0 if comm is None else comm.rank]
        k, s, p, n = self.kernel_size[i], self.stride[i], self.padding[i], plan.dim.length
        sizes = []
        for o in range(lo, hi):
            start = o * s - p
            stop = min(start + k, n + p)
            sizes.append(stop - start if self.count_include_pad
                         else min(stop, n) - max(start, 0))
        return torch.tensor(sizes, dtype=x.dtype, device=x.device)

    def extra_repr(self) -> str:
        return (
            f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
            f"ceil_mode={self.ceil_mode}, count_include_pad={self.count_include_pad}, "
            f"divisor_override={self.divisor_override}, {self._describe()}"
        )


class DistMaxPool1d(_DistMaxPool, nn.MaxPool1d):
    """``nn.MaxPool1d`` on a distributed activation (:class:`_DistMaxPool`); an
    ``nn.MaxPool1d`` for ``isinstance``."""

    _plain, _dims = nn.MaxPool1d, 1


class DistMaxPool2d(_DistMaxPool, nn.MaxPool2d):
    """``nn.MaxPool2d`` on a distributed activation (:class:`_DistMaxPool`); an
    ``nn.MaxPool2d`` for ``isinstance``."""

    _plain, _dims = nn.MaxPool2d, 2


class DistMaxPool3d(_DistMaxPool, nn.MaxPool3d):
    """``nn.MaxPool3d`` on a distributed activation (:class:`_DistMaxPool`); an
    ``nn.MaxPool3d`` for ``isinstance``."""

    _plain, _dims = nn.MaxPool3d, 3


class DistAvgPool1d(_DistAvgPool, nn.AvgPool1d):
    """``nn.AvgPool1d`` on a distributed activation (:class:`_DistAvgPool`); an
    ``nn.AvgPool1d`` for ``isinstance``."""

    _plain, _dims = nn.AvgPool1d, 1


class DistAvgPool2d(_DistAvgPool, nn.AvgPool2d):
    """``nn.AvgPool2d`` on a distributed activation (:class:`_DistAvgPool`); an
    ``nn.AvgPool2d`` for ``isinstance``."""

    _plain, _dims = nn.AvgPool2d, 2


class DistAvgPool3d(_DistAvgPool, nn.AvgPool3d):
    """``nn.AvgPool3d`` on a distributed activation (:class:`_DistAvgPool`); an
    ``nn.AvgPool3d`` for ``isinstance``."""

    _plain, _dims = nn.AvgPool3d, 3


#: the distributed layer of each plain windowed pooling module
POOLS: dict[type, type] = {c._plain: c for c in (DistMaxPool1d, DistMaxPool2d, DistMaxPool3d,
                                                 DistAvgPool1d, DistAvgPool2d, DistAvgPool3d)}


# --------------------------------------------------------------------------- global pooling
class DistAdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    r"""``nn.AdaptiveAvgPool2d((1, 1))`` (global average pooling) on a distributed activation.
    (An ``nn.AdaptiveAvgPool2d`` for ``isinstance``.)

    With x's spatial dims blocked over grid dims P (those of its H and W entries)::

        Σ_P y[o_N,o_C,*,*] = Σ_{local rows, cols} x[o_N,o_C,o_H,o_W] / (H·W)       local

    The result is a pending sum over P (:attr:`output_dist` says so); the consumer resolves it
    with :func:`distconv.redistribute` (an allreduce to ``y[o_N,o_C,*,*]``, or a reduce-scatter
    to a distributed layout), whose adjoint hands every rank the replicated cotangent. With
    unsplit spatial dims the layer is local and ``y`` is complete.

    Args:
        output_size: only ``(1, 1)`` (or ``1``) is implemented.
        grid: the :class:`~distconv.grid.ProcessorGrid` over all ranks.
        input_dist: the Dist of the input (4 entries N, C, H, W, no pending dims).

    Raises:
        NotImplementedError: another ``output_size``.
        TypeError / ValueError: bad ``grid`` or ``input_dist``.
    """

    def __init__(
        self, output_size: int | tuple[int, int] = (1, 1), *, grid: ProcessorGrid,
        input_dist: Dist,
    ) -> None:
        nn.Module.__init__(self)  # the torch class's init takes its own arguments
        if output_size not in (1, (1, 1), [1, 1]) or isinstance(output_size, bool):
            raise NotImplementedError(
                f"DistAdaptiveAvgPool2d: only output_size=(1, 1) (global average pooling) is "
                f"implemented, got {output_size!r}; pool to (1, 1) or gather the activation "
                "and use nn.AdaptiveAvgPool2d"
            )
        self.output_size = (1, 1)
        self.grid = check_grid("DistAdaptiveAvgPool2d", grid)
        self.input_dist = check_activation_dist("DistAdaptiveAvgPool2d", grid, input_dist)
        spatial = split_dims(grid, self.input_dist, 2) + split_dims(grid, self.input_dist, 3)
        e = self.input_dist.entries
        self.output_dist = Dist((e[0], e[1], None, None), frozenset(spatial))
        self._split = bool(spatial)

    @classmethod
    def from_plain(
        cls, layer: nn.AdaptiveAvgPool2d, *, grid: ProcessorGrid, input_dist: Dist
    ) -> DistAdaptiveAvgPool2d:
        if not isinstance(layer, nn.AdaptiveAvgPool2d):
            raise TypeError(f"layer must be an nn.AdaptiveAvgPool2d, got {type(layer).__name__}")
        return cls(layer.output_size, grid=grid, input_dist=input_dist)

    def to_plain(self) -> nn.AdaptiveAvgPool2d:
        """The plain ``nn.AdaptiveAvgPool2d`` (no parameters, so no communication)."""
        return nn.AdaptiveAvgPool2d(self.output_size)

    def _shard_specs(self) -> dict[str, ShardSpec]:
        return {}

    def output_shape(self, global_shape: Sequence[int]) -> tuple[int, int, int, int]:
        n, c = int(global_shape[0]), int(global_shape[1])
        return (n, c, 1, 1)

    def forward(self, x: torch.Tensor, global_shape: Sequence[int] | None = None) -> torch.Tensor:
        """This rank's block of ``y`` in :attr:`output_dist` (a pending sum over the spatial grid
        dims when they split x)."""
        shape = resolve_shape("DistAdaptiveAvgPool2d", self.grid, self.input_dist, x,
                              global_shape, self.__dict__.setdefault("_resolved", {}))
        if shape[2] * shape[3] == 0:
            raise ValueError(f"DistAdaptiveAvgPool2d: the input {shape} has no rows or columns")
        if not self._split and x.numel():
            return F.adaptive_avg_pool2d(x, self.output_size)
        return x.sum((2, 3), keepdim=True) / (shape[2] * shape[3])

    def extra_repr(self) -> str:
        return (f"output_size={self.output_size}, grid={dict(self.grid.layout)}, "
                f"x={show(self.input_dist, 'x')}, y={show(self.output_dist, 'y')}")


# --------------------------------------------------------------------------- conversion
def from_module(m: nn.Module, *, grid: ProcessorGrid, input_dist: Dist) -> nn.Module:
    """The distributed layer for an ``nn.MaxPool1d/2d/3d``, ``nn.AvgPool1d/2d/3d`` or
    ``nn.AdaptiveAvgPool2d`` whose input is distributed as ``input_dist``."""
    cls = POOLS.get(type(m)) or next((c for p, c in POOLS.items() if isinstance(m, p)), None)
    if cls is not None:
        return cls.from_plain(m, grid=grid, input_dist=input_dist)
    if isinstance(m, nn.AdaptiveAvgPool2d):
        return DistAdaptiveAvgPool2d.from_plain(m, grid=grid, input_dist=input_dist)
    raise TypeError(
        "from_module takes an nn.MaxPool1d/2d/3d, nn.AvgPool1d/2d/3d or nn.AdaptiveAvgPool2d, "
        f"got {type(m).__name__}"
    )


def _max_pool(kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
              ceil_mode: bool = False, return_indices: bool = False) -> dict[str, Any]:
    return {"kernel_size": kernel_size, "stride": stride, "padding": padding,
            "dilation": dilation, "ceil_mode": ceil_mode, "return_indices": return_indices}


def _avg_pool(kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
              count_include_pad: bool = True, divisor_override: Any = None) -> dict[str, Any]:
    return {"kernel_size": kernel_size, "stride": stride, "padding": padding,
            "ceil_mode": ceil_mode, "count_include_pad": count_include_pad,
            "divisor_override": divisor_override}


def _avg_pool1d(kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
                count_include_pad: bool = True) -> dict[str, Any]:
    return _avg_pool(kernel_size, stride, padding, ceil_mode, count_include_pad)


def _adaptive_avg_pool2d(output_size: Any) -> dict[str, Any]:
    return {"output_size": output_size}


# The functional forms a traced model calls, with their own argument order (F.max_pool2d puts
# ceil_mode before return_indices, nn.MaxPool2d the other way round).
_FUNCTIONS: dict[Any, tuple[type, Callable[..., dict[str, Any]]]] = {
    F.max_pool1d: (DistMaxPool1d, _max_pool), torch.max_pool1d: (DistMaxPool1d, _max_pool),
    F.max_pool2d: (DistMaxPool2d, _max_pool), torch.max_pool2d: (DistMaxPool2d, _max_pool),
    F.max_pool3d: (DistMaxPool3d, _max_pool), torch.max_pool3d: (DistMaxPool3d, _max_pool),
    F.avg_pool1d: (DistAvgPool1d, _avg_pool1d), F.avg_pool2d: (DistAvgPool2d, _avg_pool),
    F.avg_pool3d: (DistAvgPool3d, _avg_pool),
    F.adaptive_avg_pool2d: (DistAdaptiveAvgPool2d, _adaptive_avg_pool2d),
}


def from_function(
    fn: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None, *,
    grid: ProcessorGrid, input_dist: Dist,
) -> nn.Module:
    """The distributed layer for a call ``fn(x, *args, **kwargs)`` of ``F.max_pool1d/2d/3d``
    (or ``torch.``'s), ``F.avg_pool1d/2d/3d`` or ``F.adaptive_avg_pool2d`` (``args`` leave out
    the input), e.g. from a ``torch.fx`` ``call_function`` node."""
    entry = _FUNCTIONS.get(fn)
    if entry is None:
        raise TypeError(
            "from_function takes F.max_pool1d/2d/3d, torch.max_pool1d/2d/3d, F.avg_pool1d/2d/3d "
            f"or F.adaptive_avg_pool2d; got {getattr(fn, '__name__', fn)!r}"
        )
    cls, bind = entry
    try:
        options = bind(*args, **(kwargs or {}))
    except TypeError as exc:
        raise TypeError(f"from_function: arguments {args!r}, {kwargs!r} do not fit "
                        f"{getattr(fn, '__name__', fn)}: {exc}") from exc
    return cls(**options, grid=grid, input_dist=input_dist)
