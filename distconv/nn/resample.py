"""Interpolation (``nn.Upsample`` / ``F.interpolate``) of a spatially split activation, in place.

Every mode whose output row reads a bounded window of input rows runs here: ``nearest``,
``nearest-exact``, ``linear`` / ``bilinear`` / ``trilinear``, ``bicubic`` and ``area`` (adaptive
average pooling), by ``size`` or by ``scale_factor`` (integer or not, up or down),
``align_corners`` both ways and ``recompute_scale_factor`` as torch reads them. These
interpolations are separable: along spatial dim ``d``, output row ``o`` is
``Σ_k w_k[o] · x[r_k[o]]`` over a window of consecutive input rows ``r_k[o]`` (at most four,
clamped to the input at its borders; for ``area`` the rows it averages), the same rows and
weights at every position of the other dims.

The rows and weights are torch's own. Its kernels compute them in float32 or in the input's
precision, with special cases that differ between 1, 2 and 3 spatial dims and devices (on the
CPU ``nearest`` copies the rows of a dim whose size it keeps in 2-d, not in 1-d or 3-d; some CUDA
kernels copy when every size is kept), so :func:`index_map` does not restate those formulas: it
reads them off ``F.interpolate`` itself, once per global shape, by interpolating probe signals
along the dim (the other dims taken to one row, their sizes kept or not as the call's are;
:meth:`Interpolation.along`). The combs of ones on the rows ``≡ k (mod 5)`` give each output
row's weight on its tap of residue ``k``, and the same combs times ``row + 1`` give that tap's
row (a window of at most four consecutive rows meets each residue at most once; ``area``'s wider
windows take longer combs); a random signal then checks the map against torch.

Rank ``r`` owns the output rows ``[o0, o1)`` of its balanced block of each split dim and needs
the input rows ``[lo, hi)`` they read (the map's window), which the halo exchange brings, dim after
dim so that the corners travel with the later exchange (:class:`~distconv.conv_geometry.HaloPlan`
over an :class:`UpsampleDim`). It then interpolates dim after dim, the last first as torch's kernel
nests them, gathering the rows ``r_k[o] - lo`` of its window and summing them with the weights
(in float32 for half-precision inputs, as torch's kernel does). Its adjoint is autograd's through
the gathers and products, then the halo accumulate. The result equals one process's: the rows
each output reads exactly, ``nearest`` and ``nearest-exact`` bitwise, the weighted modes to a few
units in the last place (torch's kernel may fuse a multiply and an add; ``area`` divides a sum
over the whole 2-d or 3-d window, where the layer multiplies by each dim's weight). Where the
factors are integers the map commutes with a shift by whole rows, and the rank runs torch's own
kernel on its window and keeps its block instead (faster): only where the window's map, read off
torch the same way, equals the global map on the rank's block, checked and never assumed.

Where torch's gradient is not the adjoint of its own interpolation (a backward kernel copies the
rows of a dim whose size the call keeps while the forward kernel applies a ``scale_factor``, as
the CPU's ``nearest`` in 1-d and 3-d and ``bicubic`` do; :attr:`IndexMap.adjoint`, read off
torch like the map), the layer runs torch's interpolation on the whole spatial dims instead (an
allgather over the grid dims that split them, then a local slice of the output), so that the
output and its gradient are still one process's. So it does where a split dim has fewer input
or output rows than ranks (a rank would own none of them), some ranks' blocks of the output then
empty, as the balanced blocks of a short dim are.

Antialiased interpolation (and ``lanczos``) is not handled here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from distconv.conv_geometry import HaloPlan
from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.halo import halo_exchange
from distconv.nn._activation import check_activation_dist, check_grid, resolve_shape, show
from distconv.redistribute import redistribute

__all__ = ["MODES", "DistUpsample", "IndexMap", "Interpolation", "UpsampleDim", "in_place",
           "index_map", "upsample_halo_bytes", "upsample_plans"]

#: the modes interpolated in place
MODES = ("nearest", "nearest-exact", "linear", "bilinear", "trilinear", "bicubic", "area")
#: the modes that take ``align_corners``
_ALIGNABLE = ("linear", "bilinear", "trilinear", "bicubic")
#: the spatial dims a mode needs (the others take 1 to 3)
_SPATIAL = {"linear": 1, "bilinear": 2, "trilinear": 3, "bicubic": 2}
#: the period of the probe combs: more than the widest window (bicubic's four rows)
_PERIOD = 5


@dataclass(frozen=True)
class Interpolation:
    """The arguments of one ``F.interpolate`` call over ``spatial`` dims, per dim (build it with
    :meth:`of`, which checks them as torch would)."""

    mode: str
    spatial: int
    size: tuple[int, ...] | None = None
    scale_factor: tuple[float, ...] | None = None
    align_corners: bool | None = None
    recompute_scale_factor: bool | None = None

    @classmethod
    def of(cls, *, mode: str, spatial: int, size: Any = None, scale_factor: Any = None,
           align_corners: bool | None = None,
           recompute_scale_factor: bool | None = None) -> Interpolation:
        """Normalise ``F.interpolate``'s arguments (an int or float stands for every dim).

        Raises:
            ValueError: a mode not in :data:`MODES`, a mode for another number of spatial dims,
                neither or both of ``size`` and ``scale_factor``, a size or factor that is not
                positive or has another number of entries than spatial dims, ``align_corners``
                with a ``nearest`` mode, ``recompute_scale_factor`` with ``size``.
            TypeError: a size that is not an int, a factor that is not a number.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not 1 <= spatial <= 3 or _SPATIAL.get(mode, spatial) != spatial:
            raise ValueError(f"mode {mode!r} interpolates {_SPATIAL.get(mode, '1 to 3')} "
                             f"spatial dims, got {spatial}")
        if (size is None) == (scale_factor is None):
            raise ValueError("exactly one of size and scale_factor must be given, got "
                             f"size={size!r}, scale_factor={scale_factor!r}")
        if align_corners is not None and mode not in _ALIGNABLE:
            raise ValueError(f"align_corners applies to the modes {_ALIGNABLE}, not {mode!r}; "
                             f"got align_corners={align_corners!r}")
        if size is not None and recompute_scale_factor:
            raise ValueError("recompute_scale_factor is not meaningful with an explicit size")
        sizes = _per_dim("size", size, spatial)
        if sizes is not None:
            if not all(isinstance(n, numbers.Integral) and not isinstance(n, bool)
                       for n in sizes):
                raise TypeError(f"size must be ints, got {size!r}")
            if min(sizes) < 1:
                raise ValueError(f"size must be positive, got {size!r}")
            sizes = tuple(int(n) for n in sizes)
        scales = _per_dim("scale_factor", scale_factor, spatial)
        if scales is not None:
            if not all(isinstance(s, numbers.Real) and not isinstance(s, bool) for s in scales):
                raise TypeError(f"scale_factor must be numbers, got {scale_factor!r}")
            if not all(s > 0 for s in scales):
                raise ValueError(f"scale_factor must be positive, got {scale_factor!r}")
            scales = tuple(float(s) for s in scales)
        return cls(mode, spatial, sizes, scales,
                   bool(align_corners) if mode in _ALIGNABLE else None,
                   None if recompute_scale_factor is None else bool(recompute_scale_factor))

    @property
    def weighted(self) -> bool:
        """Whether output rows are weighted sums (else copies of one input row)."""
        return self.mode not in ("nearest", "nearest-exact")

    def kwargs(self) -> dict[str, Any]:
        """The arguments of ``F.interpolate`` that make this interpolation."""
        return {"size": self.size, "scale_factor": self.scale_factor, "mode": self.mode,
                "align_corners": self.align_corners,
                "recompute_scale_factor": self.recompute_scale_factor}

    def along(self, dim: int, kept: Sequence[bool]) -> tuple[tuple[int, ...], dict[str, Any]]:
        """A probe of spatial dim ``dim``: the lengths of the other dims and the arguments that
        interpolate ``dim`` as this does and take every other dim to one row, from one row where
        ``kept[j]`` (the call keeps its size) and from four where not (a downsampling by exactly
        4 that reads its rows with exact weights), so that the kernels' special cases for sizes
        that all agree meet the probe as they meet the call."""
        lengths = tuple(1 if kept[j] else 4 for j in range(self.spatial))
        kw = self.kwargs()
        if self.size is not None:
            kw["size"] = tuple(n if j == dim else 1 for j, n in enumerate(self.size))
        else:
            kw["scale_factor"] = tuple(s if j == dim else 1.0 if kept[j] else 0.25
                                       for j, s in enumerate(self.scale_factor or ()))
        return lengths, kw

    def output_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The global output shape for the global input ``shape``, as torch sizes it."""
        return (shape[0], shape[1], *(
            self.size[i] if self.size is not None
            else math.floor(shape[2 + i] * self.scale_factor[i])  # type: ignore[index]
            for i in range(self.spatial)))


def _per_dim(name: str, value: Any, spatial: int) -> tuple[Any, ...] | None:
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        if len(value) != spatial:
            raise ValueError(f"{name} must have {spatial} entries (one per spatial dim), "
                             f"got {value!r}")
        return tuple(value)
    return (value,) * spatial


def in_place(mode: Any, *, spatial: int, size: Any = None, scale_factor: Any = None,
             align_corners: Any = None, recompute_scale_factor: Any = None,
             antialias: bool = False) -> Interpolation | None:
    """The :class:`Interpolation` when ``F.interpolate`` with these arguments runs in place, else
    None (``area``, antialiasing, or arguments torch itself refuses: it then runs on whole
    spatial dims, where torch says what is wrong)."""
    if antialias or mode not in MODES:
        return None
    try:
        return Interpolation.of(mode=mode, spatial=spatial, size=size, scale_factor=scale_factor,
                                align_corners=align_corners,
                                recompute_scale_factor=recompute_scale_factor)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True, eq=False)
class IndexMap:
    """Torch's interpolation along one spatial dim of global ``length``: output row ``o`` is
    ``Σ_k weights[o, k] · x[rows[o, k]]`` (``weights`` None: one row each, copied). Rows a
    window reads at the borders twice (torch clamps its indices) appear once, with the summed
    weight; a row padded in where an output reads fewer rows than others carries weight 0."""

    length: int
    rows: torch.Tensor
    weights: torch.Tensor | None
    #: whether torch's gradient is the adjoint of this map (not where its backward kernel copies
    #: the rows of a dim whose size is kept while its forward kernel applies the scale factor)
    adjoint: bool = True

    @property
    def out_length(self) -> int:
        return self.rows.shape[0]

    def reads(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The first input row and one past the last each output row reads."""
        return (tuple(self.rows.min(1).values.tolist()),
                tuple((self.rows.max(1).values + 1).tolist()))

    def apply(self, x: torch.Tensor, dim: int, out: tuple[int, int], lo: int) -> torch.Tensor:
        """Output rows ``[out[0], out[1])`` along tensor dim ``dim`` of ``x``, which holds the
        input rows from ``lo`` on."""
        rows = self.rows[out[0]:out[1]] - lo
        if self.weights is None:
            return x.index_select(dim, rows[:, 0])
        w = self.weights[out[0]:out[1]].to(x.dtype)
        shape = [1] * x.ndim
        shape[dim] = -1
        y = x.index_select(dim, rows[:, 0]) * w[:, 0].reshape(shape)
        for k in range(1, rows.shape[1]):
            y = y + x.index_select(dim, rows[:, k]) * w[:, k].reshape(shape)
        return y


def probe_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision torch computes an interpolation of ``dtype`` values in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=256)
def index_map(interp: Interpolation, dim: int, length: int, kept: tuple[bool, ...],
              dtype: torch.dtype = torch.float64,
              device: torch.device | str = "cpu") -> IndexMap:
    """Torch's rows and weights along spatial dim ``dim`` (of global ``length``) for inputs of
    ``dtype`` on ``device``, where the call keeps the size of the spatial dims ``kept`` says,
    read off ``F.interpolate`` (module docstring): with combs of period 5, or longer where an
    output row reads more rows (``area`` downsampling).

    Raises:
        RuntimeError: torch's interpolation along the dim is not a weighted sum of rows that
            the probes reproduce (it would be computed wrong, so it is not computed).
    """
    dtype, lengths, kw, p = probe_dtype(dtype), *interp.along(dim, kept), _PERIOD
    while True:
        m = _read(interp, dim, length, lengths, kw, p, dtype, device)
        adjoint = None if m is None else _check(m, dim, lengths, kw, dtype)
        if adjoint is not None:
            return dataclasses.replace(m, adjoint=adjoint)  # type: ignore[arg-type]
        if p > length:  # each comb holds one row: nothing left to tell apart
            raise RuntimeError(
                f"torch's {interp.mode!r} interpolation {interp.kwargs()} along spatial dim "
                f"{dim} of length {length} is not a weighted sum of input rows that probes "
                "reproduce; it cannot run in place")
        p = 2 * p - 1


def _read(interp: Interpolation, dim: int, length: int, lengths: Sequence[int],
          kw: dict[str, Any], p: int, dtype: torch.dtype, device: Any) -> IndexMap | None:
    """The map the combs of period ``p`` read (None: they do not decode to one)."""
    pos = torch.arange(length, device=device)
    comb = (pos % p == torch.arange(p, device=device)[:, None]).to(dtype)
    out = F.interpolate(_spread(torch.cat([comb, comb * (pos + 1).to(dtype)]), dim, lengths),
                        **kw).reshape(2 * p, -1)
    weight, moment = out[:p].T, out[p:].T
    present = weight != 0
    found = torch.where(present, moment / torch.where(present, weight, 1), 1)
    rows = found.round()
    if bool((found - rows).abs().max() > 0.25) or not bool(present.any(1).all()):
        return None
    taps = int(present.sum(1).max())
    order = torch.where(present, rows, float(length + 1)).argsort(1)[:, :taps]
    rows, weight, present = (t.gather(1, order) for t in (rows.long() - 1, weight, present))
    if bool((rows < 0).any()) or bool((rows >= length).any()):
        return None
    rows = torch.where(present, rows, rows[:, :1])
    weight = torch.where(present, weight, 0)
    if not interp.weighted and not bool((weight == 1).all()):
        return None
    return IndexMap(length, rows, weight if interp.weighted else None)


def _spread(signals: torch.Tensor, dim: int, lengths: Sequence[int]) -> torch.Tensor:
    """Signals ``(B, L)`` as a batch ``(B, 1, ...)`` of probes along spatial dim ``dim``, the
    same along the other dims (of ``lengths``)."""
    shape = [signals.shape[0], 1] + [signals.shape[1] if j == dim else 1
                                     for j in range(len(lengths))]
    full = [signals.shape[0], 1] + [signals.shape[1] if j == dim else n
                                    for j, n in enumerate(lengths)]
    return signals.reshape(shape).expand(full).contiguous()


def _check(m: IndexMap, dim: int, lengths: Sequence[int], kw: dict[str, Any],
           dtype: torch.dtype) -> bool | None:
    """Whether torch's gradient is the adjoint of its interpolation; None where the map does
    not reproduce the interpolation of a random signal (combs too short for the windows)."""
    gen = torch.Generator().manual_seed(0)
    v = torch.rand(2, m.length, generator=gen, dtype=torch.float64).to(dtype)
    v = v.to(m.rows.device).requires_grad_(True)
    want = F.interpolate(_spread(v, dim, lengths), **kw).reshape(2, -1)
    got = m.apply(v, 1, (0, m.out_length), 0)
    tol = 64 * torch.finfo(dtype).eps
    if got.shape != want.shape or bool(
            (got - want).abs().max() > (0 if m.weights is None else tol)):
        return None
    g = torch.rand(want.shape, generator=gen, dtype=torch.float64).to(dtype).to(v.device)
    (torch_grad,), (adjoint,) = (torch.autograd.grad(y, v, g) for y in (want, got))
    return bool((torch_grad - adjoint).abs().max() <= tol)


@dataclass(frozen=True)
class UpsampleDim:
    """One spatial dim of an interpolation, for a :class:`HaloPlan`: the global input
    ``length`` and, per output row, the first input row it reads (``lows``) and one past the last
    (``highs``)."""

    length: int
    lows: tuple[int, ...]
    highs: tuple[int, ...]
    pad_before = 0
    pad_after = 0
    dilation = 1
    stride = 1

    @classmethod
    def of(cls, m: IndexMap) -> UpsampleDim:
        return cls(m.length, *m.reads())

    @property
    def kernel(self) -> int:
        return max(h - lo for lo, h in zip(self.lows, self.highs))

    @property
    def span(self) -> int:
        return self.kernel

    @property
    def out_length(self) -> int:
        return len(self.lows)

    def input_range(self, out_start: int, out_stop: int) -> tuple[int, int]:
        """Input rows ``[lo, hi)`` that output rows ``[out_start, out_stop)`` read."""
        if out_stop <= out_start:
            return (0, 0)
        return min(self.lows[out_start:out_stop]), max(self.highs[out_start:out_stop])


def upsample_plans(interp: Interpolation, shape: Sequence[int], dims: Sequence[str | None],
                   extents: Mapping[str, int], dtype: torch.dtype = torch.float64,
                   device: torch.device | str = "cpu"
                   ) -> tuple[tuple[IndexMap, ...], tuple[HaloPlan | None, ...]] | None:
    """Each spatial dim's :class:`IndexMap` and, for one split over grid dim ``dims[i]`` (None:
    whole), its :class:`HaloPlan`, for the global input ``shape`` (cached); None where the
    interpolation does not run in place on this shape: a split dim with fewer input or output
    rows than ranks (every rank needs one of each), or torch's gradient not the adjoint of its
    interpolation (:attr:`IndexMap.adjoint`)."""
    return _plans(interp, tuple(shape), tuple(dims),
                  tuple((d, extents[d]) for d in dims if d is not None),
                  probe_dtype(dtype), torch.device(device))


@functools.lru_cache(maxsize=256)
def _plans(interp: Interpolation, shape: tuple[int, ...], dims: tuple[str | None, ...],
           extents: tuple[tuple[str, int], ...], dtype: torch.dtype, device: torch.device
           ) -> tuple[tuple[IndexMap, ...], tuple[HaloPlan | None, ...]] | None:
    kept = tuple(o == n for o, n in zip(interp.output_shape(shape)[2:], shape[2:]))
    maps = tuple(index_map(interp, i, shape[2 + i], kept, dtype, device)
                 for i in range(interp.spatial))
    if not all(m.adjoint for m in maps):
        return None
    parts_of, plans = dict(extents), []
    for m, d in zip(maps, dims):
        if d is None:
            plans.append(None)
        elif parts_of[d] > min(m.length, m.out_length):
            return None
        else:
            plans.append(HaloPlan(UpsampleDim.of(m), parts_of[d]))
    return maps, tuple(plans)


class DistUpsample(nn.Module):
    """``nn.Upsample`` / ``F.interpolate`` in place on an activation ``x[o_N,o_C,o_H,o_W]`` (any
    dims split, one grid dim per spatial dim; 1 to 3 spatial dims), its output in the same Dist,
    ``y[o_N,o_C,o_H,o_W]``, each spatial dim in balanced blocks of the output length (module
    docstring).

    Args:
        grid: the :class:`~distconv.grid.ProcessorGrid` over all ranks.
        input_dist: the input's Dist (N, C and 1 to 3 spatial dims; no pending dims).
        size: the output's spatial size (an int for every dim), or None.
        scale_factor: the factor per spatial dim (a number for every dim), or None; exactly one
            of ``size`` and ``scale_factor``.
        mode: one of :data:`MODES` (default ``'nearest'``).
        align_corners: as ``F.interpolate`` (the interpolating modes only; default None, i.e.
            False).
        recompute_scale_factor: as ``F.interpolate`` (default None).

    Where a split dim has fewer rows than ranks, or torch's gradient is not the adjoint of its
    interpolation on the global shape, the layer gathers the spatial dims, ``x[o_N,o_C,*,*]``,
    and keeps its block of torch's output (module docstring).

    Raises:
        ValueError: arguments ``F.interpolate`` refuses or :data:`MODES` lacks, an
            ``input_dist`` of the wrong size, a spatial dim split over several grid dims.
        TypeError: a size that is not an int, a factor that is not a number; in forward, a
            weighted mode on values that are not floating point.
    """

    def __init__(self, *, grid: ProcessorGrid, input_dist: Dist, size: Any = None,
                 scale_factor: Any = None, mode: str = "nearest",
                 align_corners: bool | None = None,
                 recompute_scale_factor: bool | None = None) -> None:
        super().__init__()
        self.grid = check_grid("DistUpsample", grid)
        self.input_dist = self.output_dist = check_activation_dist(
            "DistUpsample", grid, input_dist, (3, 4, 5))
        k = self.input_dist.ndim - 2
        try:
            self.interpolation = Interpolation.of(
                mode=mode, spatial=k, size=size, scale_factor=scale_factor,
                align_corners=align_corners, recompute_scale_factor=recompute_scale_factor)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"DistUpsample: {exc}") from None
        split = [tuple(g for g in self.input_dist.grid_dims_of(2 + i) if grid.extent(g) > 1)
                 for i in range(k)]
        for i, dims in enumerate(split):
            if len(dims) > 1:
                raise ValueError(f"DistUpsample: spatial dim {i} is split over several grid dims "
                                 f"{dims}; one grid dim per spatial dim")
        self._dims = tuple(d[0] if d else None for d in split)
        # sub-communicators are created collectively, in the same order on every rank
        self._comms = tuple(grid.subcomm([d]) if d else None for d in self._dims)
        self._resolved: dict[Any, Any] = {}
        self._offsets: dict[Any, tuple[int, ...] | None] = {}

    @classmethod
    def from_module(cls, module: nn.Upsample, *, grid: ProcessorGrid,
                    input_dist: Dist) -> DistUpsample:
        """The layer that runs ``module`` (an ``nn.Upsample``, or a subclass) in place."""
        if not isinstance(module, nn.Upsample):
            raise TypeError(f"module must be an nn.Upsample, got {type(module).__name__}")
        return cls(grid=grid, input_dist=input_dist, size=module.size,
                   scale_factor=module.scale_factor, mode=module.mode,
                   align_corners=module.align_corners,
                   recompute_scale_factor=module.recompute_scale_factor)

    def plans(self, shape: Sequence[int], dtype: torch.dtype = torch.float64,
              device: torch.device | str = "cpu"
              ) -> tuple[tuple[IndexMap, ...], tuple[HaloPlan | None, ...]] | None:
        """The index maps and halo plans for the global input ``shape``, None where the layer
        runs on whole rows (:func:`upsample_plans`; cached)."""
        return upsample_plans(self.interpolation, shape, self._dims, dict(self.grid.layout),
                              dtype, device)

    def output_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return self.interpolation.output_shape(shape)

    def forward(self, x: torch.Tensor, global_shape: Sequence[int] | None = None) -> torch.Tensor:
        """This rank's block of the interpolated activation from its block ``x`` of the global
        input of ``global_shape``."""
        shape = resolve_shape("DistUpsample", self.grid, self.input_dist, x, global_shape,
                              self._resolved)
        if self.interpolation.weighted and not x.is_floating_point():
            raise TypeError(f"DistUpsample: mode {self.interpolation.mode!r} interpolates "
                            f"floating-point values, got {x.dtype}")
        found = self.plans(shape, x.dtype, x.device)
        if found is None:
            return self._on_whole_rows(x, shape)
        maps, plans = found
        for i, plan in enumerate(plans):
            if plan is not None:
                x = halo_exchange(x, self._comms[i], plan, 2 + i)
        offsets = self._window_offsets(shape, maps, plans, x.dtype, x.device)
        if offsets is not None:  # torch's own kernel on the window, then this rank's block
            y = F.interpolate(x, **self.interpolation.kwargs())
            for i, plan in enumerate(plans):
                if plan is not None:
                    o0, o1 = plan.out[self._comms[i].rank]
                    y = y.narrow(2 + i, o0 - offsets[i], o1 - o0)
            return y
        dtype = x.dtype
        if x.is_floating_point():  # torch's kernels sum (the gradient too) in this precision
            x = x.to(probe_dtype(dtype))
        for i in reversed(range(len(maps))):
            plan = plans[i]
            if plan is None:
                x = maps[i].apply(x, 2 + i, (0, maps[i].out_length), 0)
            else:
                r = self._comms[i].rank
                x = maps[i].apply(x, 2 + i, plan.out[r], plan.needed[r][0])
        return x.to(dtype)

    def _window_offsets(self, shape: tuple[int, ...], maps: Sequence[IndexMap],
                        plans: Sequence[HaloPlan | None], dtype: torch.dtype,
                        device: torch.device) -> tuple[int, ...] | None:
        """Where torch's interpolation of this rank's window (its haloed input) reads, for every
        output row of its block, the rows and weights the global one reads (integer factors:
        the map commutes with a shift by whole rows), the offset of the block in the window's
        output per dim; else None. Checked on the maps, never assumed; cached per shape."""
        key = (shape, dtype, device)
        if key not in self._offsets:
            self._offsets[key] = _window_offsets(
                self.interpolation, shape, maps, plans,
                [None if c is None else c.rank for c in self._comms], dtype, device)
        return self._offsets[key]

    def whole_dist(self) -> Dist:
        """The input's Dist with its spatial dims whole, ``x[o_N,o_C,*,*]``."""
        d = self.input_dist
        return Dist(d.entries[:2] + (None,) * (d.ndim - 2), frozenset(), d.tensor_dims)

    def _on_whole_rows(self, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """Torch's interpolation on the whole spatial dims (an allgather over the grid dims that
        split them), then this rank's block of the output (a local slice): where the layer does
        not run in place on this shape (:func:`upsample_plans`)."""
        x = redistribute(x, self.grid, self.input_dist, self.whole_dist(), shape)
        y = F.interpolate(x, **self.interpolation.kwargs())
        block = self.output_dist.local_slices(self.output_shape(shape), self.grid)
        return y[(slice(None), slice(None), *block[2:])]

    def extra_repr(self) -> str:
        kw = ", ".join(f"{k}={v!r}" for k, v in self.interpolation.kwargs().items()
                       if v is not None)
        return f"{kw}, grid={dict(self.grid.layout)}, x={show(self.input_dist, 'x')}"


def _window_offsets(interp: Interpolation, shape: tuple[int, ...], maps: Sequence[IndexMap],
                    plans: Sequence[HaloPlan | None], ranks: Sequence[int | None],
                    dtype: torch.dtype, device: torch.device) -> tuple[int, ...] | None:
    factors = interp.scale_factor
    if factors is None or not all(float(f).is_integer() for f in factors):
        return None
    local = list(shape)
    for i, (plan, r) in enumerate(zip(plans, ranks)):
        if plan is not None:
            local[2 + i] = plan.needed[r][1] - plan.needed[r][0]
    kept = tuple(o == n for o, n in zip(interp.output_shape(local)[2:], local[2:]))
    if kept != tuple(o == n for o, n in zip(interp.output_shape(shape)[2:], shape[2:])):
        return None  # the kernels' special cases would meet the window otherwise
    offsets = []
    for i, (m, plan, r) in enumerate(zip(maps, plans, ranks)):
        if plan is None:  # the whole dim: the same length and call, the same map
            offsets.append(0)
            continue
        lo, (o0, o1) = plan.needed[r][0], plan.out[r]
        window, off = index_map(interp, i, local[2 + i], kept, dtype, device), lo * int(factors[i])
        if not window.adjoint or o0 < off or o1 - off > window.out_length:
            return None
        want = _dense(m, o0, o1, lo, local[2 + i])
        got = _dense(window, o0 - off, o1 - off, 0, local[2 + i])
        if want is None or got is None or not torch.equal(want, got):
            return None
        offsets.append(off)
    return tuple(offsets)


def _dense(m: IndexMap, o0: int, o1: int, lo: int, n: int) -> torch.Tensor | None:
    """Output rows ``[o0, o1)`` of ``m`` as weights on the ``n`` input rows from ``lo``."""
    rows = m.rows[o0:o1] - lo
    if bool((rows < 0).any()) or bool((rows >= n).any()):
        return None
    w = torch.ones(rows.shape, dtype=torch.float64, device=rows.device) if m.weights is None \
        else m.weights[o0:o1]
    return torch.zeros(o1 - o0, n, dtype=w.dtype, device=w.device).scatter_add_(1, rows, w)


def upsample_halo_bytes(layer_dims: Sequence[str | None], plans: Sequence[HaloPlan | None],
                        block: Sequence[int], coords: dict[str, int], itemsize: int
                        ) -> list[tuple[str, int, int]]:
    """``(grid dim, forward bytes, backward bytes)`` a rank with ``coords`` and the input
    ``block`` receives in the halo exchange of each split dim (and its adjoint), in order."""
    block, out = list(block), []
    for i, (d, plan) in enumerate(zip(layer_dims, plans)):
        if plan is None:
            continue
        c = coords[d]
        if plan.exchanges:
            other = math.prod(block[:2 + i] + block[3 + i:])
            out.append((d, plan.halo_rows_received(c) * other * itemsize,
                        plan.halo_rows_sent(c) * other * itemsize))
        block[2 + i] = plan.local_length[c]
    return out
