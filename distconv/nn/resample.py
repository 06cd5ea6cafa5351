"""Upsampling of a spatially split activation by integer factors, in place: nearest and
(bi/tri)linear interpolation (``align_corners=False``) exchange the halo rows their output block
reads and interpolate locally.

An output row ``o`` of nearest upsampling by ``s`` reads input row ``o // s``; of linear
upsampling, the rows ``floor(t)`` and ``floor(t) + 1`` (clamped to the input) at
``t = max((o + 0.5) / s - 0.5, 0)``. Both commute with a shift by whole input rows (``s`` is an
integer), so a rank interpolates the input rows ``[lo, hi)`` its output block reads, as one
process would interpolate the whole, and keeps the rows of its block: exact, the edge effects of
the local interpolation falling outside the block. The dims are independent (a bilinear or
trilinear interpolation is the product of linear ones), so the halos travel dim after dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from distconv.conv_geometry import HaloPlan
from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.halo import halo_exchange
from distconv.nn._activation import check_activation_dist, check_grid, resolve_shape, show

__all__ = ["MODES", "DistUpsample", "UpsampleDim", "in_place"]

#: the modes upsampled in place (with ``align_corners`` False or None)
MODES = ("nearest", "linear", "bilinear", "trilinear")


@dataclass(frozen=True)
class UpsampleDim:
    """One spatial dim of an upsampling by the integer ``scale``: global input ``length``, the
    rows each output block reads (:meth:`input_range`) for a :class:`HaloPlan`."""

    length: int
    scale: int
    linear: bool
    pad_before = 0
    pad_after = 0
    dilation = 1

    @property
    def kernel(self) -> int:
        return 2 if self.linear else 1

    @property
    def stride(self) -> int:
        return self.scale

    @property
    def span(self) -> int:
        return self.kernel

    @property
    def out_length(self) -> int:
        return self.length * self.scale

    def _low(self, o: int) -> int:
        """The first input row output row ``o`` reads."""
        if not self.linear:
            return o // self.scale
        return max(0, (2 * o + 1 - self.scale) // (2 * self.scale))  # floor(max(t, 0))

    def input_range(self, out_start: int, out_stop: int) -> tuple[int, int]:
        """Input rows ``[lo, hi)`` that output rows ``[out_start, out_stop)`` read."""
        if out_stop <= out_start:
            return (0, 0)
        last = self._low(out_stop - 1) + (1 if self.linear else 0)
        return self._low(out_start), min(self.length, last + 1)


def in_place(mode: str, scale_factor: Any, align_corners: Any, size: Any, spatial: int,
             recompute_scale_factor: Any = None) -> tuple[int, ...] | None:
    """The integer scale per spatial dim when an upsampling with these arguments runs in place,
    else None (it then runs on whole spatial dims)."""
    if mode not in MODES or align_corners or size is not None or scale_factor is None or (
            recompute_scale_factor):
        return None
    scales = (tuple(scale_factor) if isinstance(scale_factor, (tuple, list))
              else (scale_factor,) * spatial)
    if len(scales) != spatial or not all(
            float(s) == int(s) and int(s) >= 1 for s in scales):
        return None
    return tuple(int(s) for s in scales)


class DistUpsample(nn.Module):
    """``nn.Upsample(scale_factor=s, mode=...)`` / ``F.interpolate`` by integer factors on an
    activation in ``input_dist`` (any of its dims split), its output in the same Dist (module
    docstring).

    Args:
        scale: the integer factor per spatial dim.
        mode: ``'nearest'``, ``'linear'``, ``'bilinear'`` or ``'trilinear'`` (align_corners
            False).
        grid: the :class:`~distconv.grid.ProcessorGrid` over all ranks.
        input_dist: the input's Dist (N, C and 1 to 3 spatial dims; no pending dims).

    Raises:
        ValueError: a mode or scale not upsampled in place, an ``input_dist`` of the wrong size.
    """

    def __init__(self, scale: Sequence[int], mode: str, *, grid: ProcessorGrid,
                 input_dist: Dist) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"DistUpsample: mode must be one of {MODES}, got {mode!r}")
        self.grid = check_grid("DistUpsample", grid)
        self.input_dist = self.output_dist = check_activation_dist(
            "DistUpsample", grid, input_dist, (3, 4, 5))
        k = self.input_dist.ndim - 2
        self.scale = tuple(int(s) for s in scale)
        if len(self.scale) != k or min(self.scale) < 1:
            raise ValueError(f"DistUpsample: scale must be {k} positive ints, got {scale!r}")
        self.mode = mode
        split = [tuple(g for g in self.input_dist.grid_dims_of(2 + i) if grid.extent(g) > 1)
                 for i in range(k)]
        for i, dims in enumerate(split):
            if len(dims) > 1:
                raise ValueError(f"DistUpsample: spatial dim {i} is split over several grid dims "
                                 f"{dims}; one grid dim per spatial dim")
        self._dims = tuple(d[0] if d else None for d in split)
        # sub-communicators are created collectively, in the same order on every rank
        self._comms = tuple(grid.subcomm([d]) if d else None for d in self._dims)
        self._plans: dict[tuple[int, ...], tuple[HaloPlan | None, ...]] = {}
        self._resolved: dict[Any, Any] = {}

    def plans(self, shape: Sequence[int]) -> tuple[HaloPlan | None, ...]:
        """The halo plan of each split spatial dim for the global input ``shape``."""
        shape = tuple(shape)
        found = self._plans.get(shape)
        if found is None:
            found = tuple(
                None if d is None else HaloPlan(UpsampleDim(
                    shape[2 + i], self.scale[i], self.mode != "nearest"), self.grid.extent(d))
                for i, d in enumerate(self._dims))
            for plan, d in zip(found, self._dims):
                if plan is not None:
                    plan.check(d)
            self._plans[shape] = found
        return found

    def output_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return (shape[0], shape[1], *(n * s for n, s in zip(shape[2:], self.scale)))

    def forward(self, x: torch.Tensor, global_shape: Sequence[int] | None = None) -> torch.Tensor:
        """This rank's block of the upsampled activation from its block ``x`` of the global
        input of ``global_shape``."""
        shape = resolve_shape("DistUpsample", self.grid, self.input_dist, x, global_shape,
                              self._resolved)
        plans = self.plans(shape)
        for i, plan in enumerate(plans):
            if plan is not None:
                x = halo_exchange(x, self._comms[i], plan, 2 + i)
        y = F.interpolate(x, scale_factor=tuple(float(s) for s in self.scale), mode=self.mode,
                          align_corners=False if self.mode != "nearest" else None)
        for i, plan in enumerate(plans):
            if plan is not None:  # the rows of this rank's block
                r = self._comms[i].rank
                o0, o1 = plan.out[r]
                y = y.narrow(2 + i, o0 - plan.needed[r][0] * self.scale[i], o1 - o0)
        return y

    def extra_repr(self) -> str:
        return (f"scale={self.scale}, mode={self.mode!r}, grid={dict(self.grid.layout)}, "
                f"x={show(self.input_dist, 'x')}")


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
