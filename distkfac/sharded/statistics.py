"""A shard's K-FAC statistics from its layer's work hook: the im2col rows of the rank's output
block (direct, N-d or transposed layers) and the output gradient's rows, as the K-FAC blocks of
``'block'`` (:class:`ShardAdapter`, :class:`BiasShardAdapter`) and of a layer split over samples
and space only (:class:`SpatialShardAdapter`); :func:`attach` installs the hook."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distkfac.layers import ConvNdAdapter, LayerAdapter, conv_input_cov, windows
from distkfac.sharded.geometry import ShardGeometry

__all__ = ["BiasShardAdapter", "ShardAdapter", "SpatialShardAdapter", "attach", "g_cov",
           "input_cov"]


def _transposed_rows(m: nn.Module, x: Tensor, y_shape: Sequence[int], groups: int) -> Tensor:
    """The im2col rows of a transposed DistConvNd's output block, as the direct convolution it
    equals reads them (:class:`~distkfac.layers.ConvTransposeAdapter`): ``(groups, rows,
    columns)``.

    On each spatial dim (stride s, span ``P = dilation (kernel - 1)``, padding p) that
    convolution reads, for global output rows ``[o0, o1)``, the rows ``[o0 - P + p, o1 + p)`` of
    the input with ``s - 1`` zeros between its rows.  This rank's input ``x`` (the work hook's:
    its gathered rows ``[lo, ...)``, :class:`~distconv.conv_geometry.HaloPlan`'s ``needed``)
    holds every input row that scatters into its output block ``[o0, o1)`` (``out``); input row
    ``lo + j`` lies at ``s (lo + j)``, so it is placed at ``s (lo + j) - o0 + P - p`` of a zero
    array ``o1 - o0 + P`` long (rows that fall outside reach no output of the block), whose
    windows at stride 1 are the block's.  A dim the grid does not split is the whole output
    (``lo = o0 = 0``).  The global input shape is worked back from ``y_shape``."""
    k = len(m.kernel_size)
    sizes = []
    for i in range(k):
        s, p, op = m.stride[i], m.padding[i], m.output_padding[i]
        span = m.dilation[i] * (m.kernel_size[i] - 1)
        sizes.append((y_shape[2 + i] - 1 - span - op + 2 * p) // s + 1)
    plans = m.plans((y_shape[0], m.in_channels, *sizes))
    for i, plan in enumerate(plans):
        s, p = m.stride[i], m.padding[i]
        span = m.dilation[i] * (m.kernel_size[i] - 1)
        if plan is None:
            lo, (o0, o1) = 0, (0, y_shape[2 + i])
        else:
            r = m.grid.coords[m.spatial_dims[i]]
            lo, (o0, o1) = plan.needed[r][0], plan.out[r]
        offset, length, rows = s * lo - o0 + span - p, o1 - o0 + span, x.shape[2 + i]
        first = max(0, -(offset // s))  # the first and last input rows that land inside
        last = min(rows - 1, (length - 1 - offset) // s)
        shape = list(x.shape)
        shape[2 + i] = length
        z = x.new_zeros(shape)
        if last >= first:
            lead = (slice(None),) * (2 + i)
            z[lead + (slice(offset + s * first, offset + s * last + 1, s),)] = \
                x[lead + (slice(first, last + 1),)]
        x = z
    return windows(x, m.kernel_size, (1,) * k, m.dilation, groups)


def input_cov(m: nn.Module, x: Tensor, padding: tuple[int, ...], y_shape: Sequence[int],
               groups: int, bias: bool) -> tuple[Tensor, int]:
    """``(sum of a a^T over the im2col rows of this rank's output block, rows)`` from the input
    the work hook hands over (``padding``: the zero padding the local convolution still
    applies, ``F.pad``'s list), per group, the bias's 1 appended with ``bias``.  A direct 2-D
    layer's by lags (:func:`~distkfac.layers.conv_input_cov`); 1-D and 3-D ones from the
    input's windows (:func:`~distkfac.layers.windows`); a transposed one from
    :func:`_transposed_rows`."""
    if getattr(m, "transposed", False):
        rows = _transposed_rows(m, x, y_shape, groups)
    elif len(m.kernel_size) == 2:
        return conv_input_cov(x, m.kernel_size, stride=m.stride, dilation=m.dilation,
                              groups=groups, bias=bias, padding=padding)
    else:
        rows = windows(F.pad(x, padding) if any(padding) else x, m.kernel_size, m.stride,
                       m.dilation, groups)
    if bias:
        rows = torch.cat([rows, rows.new_ones(*rows.shape[:2], 1)], dim=2)
    return rows.transpose(1, 2) @ rows, rows.shape[1]


def g_cov(gy: Tensor, groups: int, dtype: torch.dtype) -> tuple[Tensor, int]:
    """Per group, the sum over samples and output positions of ``d d^T``, and the rows."""
    n, f = gy.shape[:2]
    rows = gy.detach().to(dtype).reshape(n, groups, f // groups, math.prod(gy.shape[2:]))
    return (rows @ rows.transpose(-1, -2)).sum(0), n * rows.shape[-1]


class _WorkHookAdapter(LayerAdapter):
    """A DistConv2d or DistConvNd shard's K-FAC block: its statistics arrive through the layer's
    work hook (``work_a`` / ``work_g``), never through the generic per-module hooks.  The hook
    sets :attr:`positions` (global output positions per sample), :attr:`prescaled` (whether it
    scales G by ``N^2`` itself) and :attr:`y_shape` (the global output shape) first."""

    def __init__(self, module: nn.Module, name: str) -> None:
        super().__init__(module, name)
        self.positions, self.prescaled = 1, False
        self.y_shape: tuple[int, ...] = ()

    @staticmethod
    def batch_size(x: Tensor) -> int:
        return x.shape[0]

    def a_sum(self, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
        raise TypeError("a DistConv2d shard's factors come from its work hook")

    g_sum = a_sum


class ShardAdapter(_WorkHookAdapter):
    """The weight shard ``V[f, c]`` of a DistConv2d or DistConvNd (direct or transposed, read as
    the direct convolution it equals: :class:`ShardGeometry`) as one K-FAC block (``'block'``
    layout, and the exact layer when C = F = 1, or of a grouped layer whose blocks hold whole
    groups).  Statistics arrive through :meth:`work_a` and :meth:`work_g`; ``G`` is scaled by
    ``N^2`` from the reduced row count."""

    def __init__(self, module: nn.Module, name: str, geo: ShardGeometry) -> None:
        super().__init__(module, name)
        self.geo = geo
        self._bias = geo.bias and geo.C == 1
        # a grouped layer split over C or F (or both) holds whole groups: its share of them
        self._groups = module.groups // module._group_parts if module.groups > 1 else 1

    @property
    def has_bias(self) -> bool:
        return self._bias

    @property
    def groups(self) -> int:
        return self._groups

    @property
    def a_dim(self) -> int:
        w = self.module.weight
        channels = w.shape[0] // self._groups if self.geo.transposed else w.shape[1]
        return channels * self.geo.k2 + int(self._bias)

    @property
    def g_dim(self) -> int:
        w = self.module.weight
        return w.shape[1] if self.geo.transposed else w.shape[0] // self._groups

    def weight_matrix(self, w: Tensor) -> Tensor:
        return self.geo.matrix(w, self._groups)

    def matrix_weight(self, mat: Tensor, shape: torch.Size) -> Tensor:
        return self.geo.weight(mat, shape, self._groups)

    def work_a(self, x: Tensor, padding: tuple[int, ...], y: Tensor,
               dtype: torch.dtype) -> tuple[Tensor, int]:
        return input_cov(self.module, x.detach().to(dtype), padding, self.y_shape,
                          self._groups, self._bias)

    def work_g(self, gy: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
        return g_cov(gy, self._groups, dtype)

    def g_scale(self, rows: float) -> float:
        """``G = sum / rows * N^2``: N^2 already applied in the hook when the global batch was
        known there, else ``N = rows / (global output positions per sample)``."""
        return 1.0 if self.prescaled else (rows / self.positions) ** 2


class SpatialShardAdapter(_WorkHookAdapter, ConvNdAdapter):
    """A ``DistConvNd`` split over samples and spatial dims only (its weight whole on every
    rank) as one K-FAC block: the im2col rows of the rank's output block, from the haloed input
    its work hook hands over, summed over the ranks that split samples and space as the rows of
    one process's batch are; ``G`` likewise from the output block's gradient."""

    def work_a(self, x: Tensor, padding: tuple[int, ...], y: Tensor,
               dtype: torch.dtype) -> tuple[Tensor, int]:
        m = self.module
        x = x.detach().to(dtype)
        if any(padding):
            x = F.pad(x, padding)
        return self.rows_cov(windows(x, m.kernel_size, m.stride, m.dilation, self.groups))

    def work_g(self, gy: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
        return g_cov(gy, self.groups, dtype)

    g_scale = ShardAdapter.g_scale


class BiasShardAdapter(_WorkHookAdapter):
    """A bias shard ``b[s]`` as its own block (``'block'`` layout with C > 1): ``A = [1]``,
    ``G = G_ss`` from the gradient rows of its filters."""

    def __init__(self, module: nn.Module, name: str, geo: ShardGeometry) -> None:
        super().__init__(module, name)
        self.geo = geo
        lo, _ = geo.bias_subblocks()[geo.c]
        self.offset = lo

    @property
    def has_bias(self) -> bool:
        return False

    @property
    def groups(self) -> int:
        return 1

    @property
    def a_dim(self) -> int:
        return 1

    @property
    def g_dim(self) -> int:
        return self.module.bias.shape[0]

    def work_a(self, x: Tensor, padding: tuple[int, ...], y: Tensor,
               dtype: torch.dtype) -> tuple[Tensor, int]:
        rows = y.shape[0] * math.prod(y.shape[2:])
        return torch.full((1, 1, 1), float(rows), dtype=dtype, device=y.device), rows

    def work_g(self, gy: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
        return g_cov(gy[:, self.offset: self.offset + self.g_dim], 1, dtype)

    g_scale = ShardAdapter.g_scale

    def grad_matrix(self, dtype: torch.dtype) -> Tensor | None:
        b = self.module.bias
        return None if b.grad is None else b.grad.detach().to(dtype).reshape(1, -1, 1)

    def set_grad(self, mat: Tensor) -> None:
        b = self.module.bias
        b.grad.copy_(mat.reshape(b.shape).to(b.grad.dtype))


def attach(module: nn.Module, fn: Any) -> None:
    """Install ``fn`` as the DistConv2d's work hook (one K-FAC per layer)."""
    if getattr(module, "work_hook", None) is not None:
        raise ValueError(f"{type(module).__name__} already has a work hook: one K-FAC per model")
    module.work_hook = fn
