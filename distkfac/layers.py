"""Module adapters: what a Kronecker factor is for each supported layer.

Every adapter turns the tensors seen by its module's hooks into *sums* of outer products and a
row count, so that factors reduced over ranks are exactly those of the concatenated batch:

    A = (1/R) sum_r  a_r a_r^T          a_r: one im2col row (patch), with a trailing 1 for the bias
    G = (1/R) sum_r  d_r d_r^T          d_r = n * dL/dy_r, n the local batch size

R counts rows: samples for ``nn.Linear`` (times any middle dims), samples x output positions for
``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d``.  ``n`` counts samples, the leading dim of the
model's input (read there by :class:`~distkfac.KFAC`): a layer may see more leading rows, as
Swin's window attention sees ``N * windows``.  With a loss that is a mean over the local
batch, ``d_r`` is the gradient of the row's own sample loss, so ``G`` does not depend on how the
batch is split over ranks.

Grouped convolutions get block-diagonal factors, one block per group: every factor is stored as
a batch ``(groups, d, d)``; ``groups == 1`` for everything else.
"""
from __future__ import annotations

import abc
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LayerAdapter", "LinearAdapter", "Conv2dAdapter", "ConvNdAdapter",
           "ConvTransposeAdapter", "adapter_for", "conv_input_cov", "transposed_weight",
           "transposed_weight_matrix", "windows"]


class LayerAdapter(abc.ABC):
    """How one module's factors and gradient matrix are formed.

    The gradient matrix of a layer is ``(groups, out, in [+1])``: the weight flattened to
    ``out x in`` with the bias appended as a last column, which is the layout ``A`` and ``G``
    precondition as ``G^-1 V A^-1``.
    """

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module = module
        self.name = name

    @property
    def has_bias(self) -> bool:
        return getattr(self.module, "bias", None) is not None

    @property
    @abc.abstractmethod
    def groups(self) -> int: ...

    @property
    @abc.abstractmethod
    def a_dim(self) -> int:
        """Side of one block of A (input features, +1 with a bias)."""

    @property
    @abc.abstractmethod
    def g_dim(self) -> int:
        """Side of one block of G (output features of one group)."""

    @abc.abstractmethod
    def a_sum(self, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
        """``(sum of a a^T over rows, number of rows)`` for the module input ``x``."""

    @abc.abstractmethod
    def g_sum(self, gy: Tensor, batch: int, dtype: torch.dtype) -> tuple[Tensor, int]:
        """``(sum of d d^T over rows, number of rows)`` for the output gradient ``gy``."""

    @staticmethod
    @abc.abstractmethod
    def batch_size(x: Tensor) -> int:
        """Local batch size n seen in the layer's input (the factor of ``d = n dL/dy`` where
        the model's own input gives none)."""

    def weight_matrix(self, w: Tensor) -> Tensor:
        """A tensor shaped like the weight as ``(groups, g_dim, a_dim - bias)``."""
        g = self.groups
        return w.reshape(g, w.shape[0] // g, -1)

    def matrix_weight(self, mat: Tensor, shape: torch.Size) -> Tensor:
        """The inverse of :meth:`weight_matrix`: the matrix back in the weight's ``shape``."""
        return mat.reshape(shape)

    def grad_matrix(self, dtype: torch.dtype) -> Tensor | None:
        """The current gradient as ``(groups, g_dim, a_dim)``; ``None`` if there is none."""
        w = self.module.weight
        if w.grad is None:
            return None
        g = self.groups
        mat = self.weight_matrix(w.grad.detach()).to(dtype)
        if self.has_bias:
            b = self.module.bias.grad
            b = (torch.zeros(mat.shape[0] * mat.shape[1], dtype=dtype, device=w.device)
                 if b is None else b)
            mat = torch.cat([mat, b.detach().reshape(g, -1, 1).to(dtype)], dim=2)
        return mat

    def set_grad(self, mat: Tensor) -> None:
        """Write a ``(groups, g_dim, a_dim)`` matrix back into the parameters' ``.grad``."""
        w = self.module.weight
        ncol = mat.shape[2] - (1 if self.has_bias else 0)
        w.grad.copy_(self.matrix_weight(mat[:, :, :ncol], w.shape).to(w.grad.dtype))
        if self.has_bias and self.module.bias.grad is not None:
            b = self.module.bias
            b.grad.copy_(mat[:, :, ncol].reshape(b.shape).to(b.grad.dtype))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, groups={self.groups}, "
                f"A={self.a_dim}, G={self.g_dim})")


def _with_ones(rows: Tensor) -> Tensor:
    return torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)


class LinearAdapter(LayerAdapter):
    """``nn.Linear``: ``a = [x, 1]``; every leading dim but the last counts as rows."""

    @property
    def groups(self) -> int:
        return 1

    @property
    def a_dim(self) -> int:
        return self.module.in_features + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.module.out_features

    @staticmethod
    def batch_size(x: Tensor) -> int:
        return x.shape[0] if x.dim() > 1 else 1

    def a_sum(self, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
        rows = x.detach().reshape(-1, x.shape[-1]).to(dtype)
        if self.has_bias:
            rows = _with_ones(rows)
        return (rows.T @ rows).unsqueeze(0), rows.shape[0]

    def g_sum(self, gy: Tensor, batch: int, dtype: torch.dtype) -> tuple[Tensor, int]:
        rows = gy.detach().reshape(-1, gy.shape[-1]).to(dtype) * batch
        return (rows.T @ rows).unsqueeze(0), rows.shape[0]


def _conv_padding(conv: nn.Conv2d) -> tuple[int, int, int, int]:
    """``(left, right, top, bottom)`` padding exactly as ``nn.Conv2d`` applies it."""
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            return (0, 0, 0, 0)
        pads = []
        for d, k in zip(reversed(conv.dilation), reversed(conv.kernel_size)):
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
        return tuple(pads)  # type: ignore[return-value]
    ph, pw = conv.padding
    return (pw, pw, ph, ph)


class Conv2dAdapter(LayerAdapter):
    """``nn.Conv2d`` with any stride, padding (ints, ``'same'``, ``'valid'``, any padding mode),
    dilation, kernel (odd or even) and groups (block-diagonal factors per group)."""

    @property
    def groups(self) -> int:
        return self.module.groups

    @property
    def a_dim(self) -> int:
        m = self.module
        kh, kw = m.kernel_size
        return m.in_channels // m.groups * kh * kw + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.module.out_channels // self.module.groups

    @staticmethod
    def batch_size(x: Tensor) -> int:
        return x.shape[0] if x.dim() == 4 else 1

    def pad(self, x: Tensor) -> Tensor:
        m = self.module
        mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
        pads = _conv_padding(m)
        return F.pad(x, pads, mode=mode) if any(pads) else x

    def a_sum(self, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
        x = x.detach()
        if x.dim() == 3:
            x = x.unsqueeze(0)
        m = self.module
        x = x.to(dtype)
        if m.padding_mode == "zeros":  # padded on the fly, without a padded copy
            padding = _conv_padding(m)
        else:
            x, padding = self.pad(x), (0, 0, 0, 0)
        return conv_input_cov(x, m.kernel_size, stride=m.stride, dilation=m.dilation,
                              groups=m.groups, bias=self.has_bias, padding=padding)

    def g_sum(self, gy: Tensor, batch: int, dtype: torch.dtype) -> tuple[Tensor, int]:
        gy = gy.detach()
        if gy.dim() == 3:
            gy = gy.unsqueeze(0)
        n, f, ho, wo = gy.shape
        g = self.groups
        per_sample = gy.to(dtype).reshape(n, g, f // g, ho * wo)
        cov = (per_sample @ per_sample.transpose(-1, -2)).sum(0)
        return cov * (batch * batch), n * ho * wo


def _nd_padding(conv: nn.Module) -> list[int]:
    """``F.pad`` padding (last spatial dim first) exactly as an ``nn.ConvNd`` applies it."""
    k, d = conv.kernel_size, conv.dilation
    if isinstance(conv.padding, str):
        pads: list[int] = []
        for i in reversed(range(len(k))):
            total = 0 if conv.padding == "valid" else d[i] * (k[i] - 1)
            pads += [total // 2, total - total // 2]
        return pads
    return [p for i in reversed(range(len(k))) for p in (conv.padding[i], conv.padding[i])]


def windows(x: Tensor, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
            groups: int) -> Tensor:
    """The im2col rows of a convolution over the already padded ``x`` (N, C, *spatial):
    ``(groups, rows, C/groups * prod(kernel))``, taken with ``Tensor.unfold`` along each
    spatial dim and ordered like ``weight.reshape(F, -1)``'s columns."""
    for i, (k, s, d) in enumerate(zip(kernel, stride, dilation)):
        x = x.unfold(2 + i, d * (k - 1) + 1, s)[..., ::d]  # windows as a trailing dim
    nd, c = len(kernel), x.shape[1]
    # (N, C, *out, *kernel) -> (N, *out, C, *kernel) -> (groups, rows, C/g * prod(kernel))
    order = (0, *range(2, 2 + nd), 1, *range(2 + nd, 2 + 2 * nd))
    rows = x.permute(order).reshape(-1, groups, c // groups * math.prod(kernel))
    return rows.transpose(0, 1)


class ConvNdAdapter(LayerAdapter):
    """``nn.Conv1d`` and ``nn.Conv3d`` (and any ``nn.ConvNd``) with any stride, padding (ints,
    ``'same'``, ``'valid'``, any padding mode), dilation, kernel and groups: the im2col rows are
    the input's windows taken with ``Tensor.unfold`` along each spatial dim (views; one copy of
    ``prod(kernel)`` times the input when they are gathered into rows), ordered like
    ``weight.reshape(F, -1)``'s columns: (channel, kernel offsets), then the bias 1."""

    @property
    def groups(self) -> int:
        return self.module.groups

    @property
    def spatial(self) -> int:
        return len(self.module.kernel_size)

    @property
    def a_dim(self) -> int:
        m = self.module
        return m.in_channels // m.groups * math.prod(m.kernel_size) + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.module.out_channels // self.module.groups

    def batch_size(self, x: Tensor) -> int:  # type: ignore[override]
        return x.shape[0] if x.dim() == 2 + self.spatial else 1

    def _batched(self, t: Tensor) -> Tensor:
        return t if t.dim() == 2 + self.spatial else t.unsqueeze(0)

    def patches(self, x: Tensor) -> Tensor:
        """``(groups, rows, C/groups * prod(kernel))``: every window of ``x`` (batched)."""
        m = self.module
        pads = _nd_padding(m)
        if any(pads):
            mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
            x = F.pad(x, pads, mode=mode)
        return windows(x, m.kernel_size, m.stride, m.dilation, m.groups)

    def a_sum(self, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
        return self.rows_cov(self.patches(self._batched(x.detach()).to(dtype)))

    def rows_cov(self, rows: Tensor) -> tuple[Tensor, int]:
        """``(sum of a a^T, rows)`` for the im2col ``rows`` (groups, rows, columns), the bias's
        1 appended to each row when the layer has one."""
        if self.has_bias:
            rows = torch.cat([rows, rows.new_ones(*rows.shape[:2], 1)], dim=2)
        return rows.transpose(1, 2) @ rows, rows.shape[1]

    def g_sum(self, gy: Tensor, batch: int, dtype: torch.dtype) -> tuple[Tensor, int]:
        gy = self._batched(gy.detach())
        n, f = gy.shape[:2]
        g = self.groups
        per_sample = gy.to(dtype).reshape(n, g, f // g, -1)
        cov = (per_sample @ per_sample.transpose(-1, -2)).sum(0)
        return cov * (batch * batch), n * per_sample.shape[-1]


class ConvTransposeAdapter(ConvNdAdapter):
    """``nn.ConvTranspose1d/2d/3d`` with any stride, padding, output padding, dilation, kernel and
    groups, as the direct convolution it equals: over the input with ``stride - 1`` zeros
    between its rows, padded by ``dilation (kernel - 1) - padding`` before and that plus the
    output padding after (cropped where negative), with the kernel flipped and the weight's
    channel dims swapped per group, stride 1. The im2col rows are that convolution's windows;
    :meth:`weight_matrix` and :meth:`matrix_weight` map the weight ``(in, out/groups, k...)`` to
    the ``(groups, out/groups, in/groups · prod(k))`` matrix and back."""

    @property
    def a_dim(self) -> int:
        m = self.module
        return m.in_channels // m.groups * math.prod(m.kernel_size) + int(self.has_bias)

    def patches(self, x: Tensor) -> Tensor:
        m = self.module
        k = self.spatial
        for i, s in enumerate(m.stride):  # zeros between the rows
            if s > 1:
                shape = list(x.shape)
                shape[2 + i] = (shape[2 + i] - 1) * s + 1
                stuffed = x.new_zeros(shape)
                stuffed[(slice(None),) * (2 + i) + (slice(None, None, s),)] = x
                x = stuffed
        pads = []
        for i in reversed(range(k)):
            before = m.dilation[i] * (m.kernel_size[i] - 1) - m.padding[i]
            pads += [before, before + m.output_padding[i]]
        if any(pads):
            x = F.pad(x, pads)
        return windows(x, m.kernel_size, (1,) * k, m.dilation, m.groups)

    def weight_matrix(self, w: Tensor) -> Tensor:
        return transposed_weight_matrix(w, self.groups)

    def matrix_weight(self, mat: Tensor, shape: torch.Size) -> Tensor:
        return transposed_weight(mat, shape, self.groups)


def transposed_weight_matrix(w: Tensor, groups: int) -> Tensor:
    """A transposed convolution's weight ``(in, out/g, k...)`` as the matrix of the direct
    convolution it equals, ``(g, out/g, in/g · prod(k))``: channel dims swapped per group, the
    kernel flipped."""
    k = w.dim() - 2
    w = w.reshape(groups, w.shape[0] // groups, *w.shape[1:]).transpose(1, 2)
    return w.flip(list(range(3, 3 + k))).reshape(groups, w.shape[1], -1)


def transposed_weight(mat: Tensor, shape: Sequence[int], groups: int) -> Tensor:
    """The inverse of :func:`transposed_weight_matrix`: ``(g, out/g, in/g · prod(k))`` back to a
    transposed convolution's weight of ``shape`` ``(in, out/g, k...)``."""
    k = len(shape) - 2
    og, ig = shape[1], shape[0] // groups
    direct = mat.reshape(groups, og, ig, *shape[2:]).flip(list(range(3, 3 + k)))
    return direct.transpose(1, 2).reshape(shape)


def conv_input_cov(xp: Tensor, kernel_size: tuple[int, int], *, stride: tuple[int, int],
                   dilation: tuple[int, int], groups: int = 1, bias: bool = False,
                   padding: tuple[int, int, int, int] = (0, 0, 0, 0)) -> tuple[Tensor, int]:
    """Sum over all im2col rows of ``a a^T`` for the input ``xp`` (N, C, H, W) zero-padded by
    ``padding`` = (left, right, top, bottom), default none (an already padded input).

    Exact, without materialising the unfold (``kh*kw`` copies of the input): the covariance of
    a convolution's patches has lag structure.  Writing ``x_u`` for the channel vector at
    position ``u``, the block for kernel offsets ``(d, d + D)`` is ``sum_o x_{o+d} x_{o+d+D}^T``
    over output positions ``o``: every block with the same lag ``D`` sums the same products over
    a shifted window.  :func:`_cov_by_row_lags` uses this along rows: kernel columns are
    unfolded (``kw`` copies), and one batched product per row lag serves all ``kh - D`` pairs of
    kernel rows with that lag -- ``kh (C kw)^2 N Wo Hp`` multiply-adds against
    ``(C kh kw)^2 N Ho Wo`` for the unfold's Gram matrix, about ``kh`` times fewer.  With column
    stride 1, :func:`_cov_by_2d_lags` uses it along columns too: one ``C x C`` product per
    distinct 2-D lag, about ``kw`` times fewer again, where the images are wide enough for its
    edge corrections to stay small (see :func:`_prefer_2d_lags`).  Both leave out the rows of
    zero padding, and are exactly symmetric (lower blocks mirror upper ones).

    Returns ``(A_sum of shape (groups, C/groups*kh*kw [+1], same), rows)``, rows ordered like
    ``weight.reshape(F, -1)`` columns: (channel, kernel row, kernel column), then the bias 1.
    """
    n, c, h, w = xp.shape
    hp, wp = h + padding[2] + padding[3], w + padding[0] + padding[1]
    kh, kw = kernel_size
    (sh, sw), (dh, dw) = stride, dilation
    ho = (hp - dh * (kh - 1) - 1) // sh + 1
    wo = (wp - dw * (kw - 1) - 1) // sw + 1
    if ho <= 0 or wo <= 0:
        raise ValueError(f"input of spatial size {(hp, wp)} is smaller than the kernel extent")
    rows = [slice(dh * p, dh * p + sh * (ho - 1) + 1, sh) for p in range(kh)]
    cols = [slice(dw * q, dw * q + sw * (wo - 1) + 1, sw) for q in range(kw)]
    live = _live_rows(rows, hp, padding[2:])
    if sw == 1 and _prefer_2d_lags(kernel_size, dilation, live, w, wo, padding[0], c // groups):
        a = _cov_by_2d_lags(xp, padding, kernel_size, wo, rows, dilation, groups)
    else:
        padded = F.pad(xp, padding) if any(padding) else xp
        a = _cov_by_row_lags(padded, kernel_size, ho, wo, rows, cols, groups, padding[2:])
    count = n * ho * wo
    if not bias:
        return a, count
    xs = F.pad(xp.sum(0), padding)  # (C, Hp, Wp): padding with zeros commutes with the sum
    s = torch.stack([torch.stack([xs[:, r, q].sum((1, 2)) for q in cols], -1) for r in rows], -2)
    s = s.reshape(groups, -1)  # (group, (c, p, q))
    m = s.shape[1]
    out = a.new_empty(groups, m + 1, m + 1)
    out[:, :-1, :-1] = a
    out[:, :-1, -1] = s
    out[:, -1, :-1] = s
    out[:, -1, -1] = count
    return out, count


def _row_spans(kh: int, rows: list[slice]) -> list[int]:
    """Input rows each kernel-row lag multiplies: up to the last row of the last window."""
    return [rows[kh - 1 - lag].start + rows[0].stop - rows[0].start for lag in range(kh)]


def _live_rows(rows: list[slice], hp: int, zero_rows: tuple[int, int]) -> list[range]:
    """Per kernel-row lag ``D``, the rows ``h`` whose products with row ``h + dil*D`` some
    window sums and which can be non-zero: neither row among the ``zero_rows`` = (top, bottom)
    rows of zero padding."""
    top, bottom = zero_rows
    spans = _row_spans(len(rows), rows)
    return [range(top, max(top, min(span, hp - bottom - rows[lag].start)))
            for lag, span in enumerate(spans)]


def _within(window: slice, live: range, hp: int) -> slice:
    """The rows of ``window`` among ``live``, indexed from ``live.start``."""
    kept = [h - live.start for h in range(hp)[window] if h in live]
    return slice(kept[0], kept[-1] + 1, window.step) if kept else slice(0, 0)


def _edge_columns(w: int, wo: int, pad: int, left: int) -> list[tuple[int, int]]:
    """Input columns ``[lo, hi)`` that some kernel column's window of :func:`_cov_by_2d_lags`
    leaves out: the ``pad - left`` first and ``pad - right`` last ones."""
    sides = [(0, max(0, pad - left)), (max(0, wo - left), w)]
    return [(lo, hi) for lo, hi in sides if hi > lo]


def _prefer_2d_lags(kernel_size: tuple[int, int], dilation: tuple[int, int], live: list[range],
                    w: int, wo: int, left: int, cg: int) -> bool:
    """Whether :func:`_cov_by_2d_lags` is the faster exact path (column stride 1 only).

    Multiply-adds per sample and channel pair, over the ``live`` rows of each kernel-row lag:
    ``(2 kw - 1)`` lags (``kw`` at lag 0) of ``W + pad`` columns plus the edge strips' products,
    against :func:`_cov_by_row_lags`' ``kw^2`` blocks (``kw (kw + 1) / 2`` at lag 0) of ``Wo``
    columns.  Its ``cg x cg`` products run further below BLAS peak than the other path's
    ``cg kw x cg kw``, so it must save a quarter, and the channels must fill a vector register.
    """
    kh, kw = kernel_size
    pad = dilation[1] * (kw - 1)
    if cg < 16 or wo < pad:
        return False
    strips = sum((hi - lo) * (hi - lo + 2 * pad) for lo, hi in _edge_columns(w, wo, pad, left))
    lags = sum(len(hs) * ((kw if lag == 0 else 2 * kw - 1) * (w + pad) + strips)
               for lag, hs in enumerate(live))
    blocks = sum(len(hs) * (kw * (kw + 1) // 2 if lag == 0 else kw * kw) * wo
                 for lag, hs in enumerate(live))
    return 4 * lags < 3 * blocks


def _cov_by_row_lags(xp: Tensor, kernel_size: tuple[int, int], ho: int, wo: int,
                     rows: list[slice], cols: list[slice], groups: int,
                     zero_rows: tuple[int, int] = (0, 0)) -> Tensor:
    """Any stride, padded input.  Kernel columns are unfolded (``kw`` copies of the input, not
    ``kh*kw``) as ``Z[h]``: input row ``h`` of every (kernel column, channel) over samples and
    output columns.  The block for kernel rows ``(p, p+D)`` sums ``Z[h] Z[h + dil*D]^T`` over
    the rows of ``p``'s window: one batched product per row lag ``D >= 0`` over the rows some
    window holds (or per window, when striding leaves rows no window holds) and that are not
    ``zero_rows`` of padding, of which lag 0 is symmetric and only its kernel-column pairs
    ``q <= q'`` are formed.  When striding makes that no cheaper than the unfold's Gram matrix,
    that is formed from the same ``Z``."""
    n, c, hp, wp = xp.shape
    kh, kw = kernel_size
    g, cg = groups, c // groups
    m = cg * kw
    z = xp.new_empty(hp, g, kw, cg, n, wo)
    for q, cs in enumerate(cols):
        z[:, :, q].copy_(xp[:, :, :, cs].reshape(n, g, cg, hp, wo).permute(3, 1, 2, 0, 4))
    z = z.reshape(hp, g, kw, cg, n * wo)
    live = _live_rows(rows, hp, zero_rows)
    if sum(_row_spans(kh, rows)) <= kh * kh * ho:
        blocks = xp.new_empty(g, kh, kw, cg, kh, kw, cg)
        # Lag 0, symmetric in round-off too.  Forming only q <= q' pays from 8 channels on;
        # thinner products run too far below BLAS peak.
        z0 = z[live[0].start: live[0].stop]
        for q in range(kw) if cg >= 8 else ():
            prod = z0[:, :, q] @ z0[:, :, q:].flatten(2, 3).mT
            for p in range(kh):
                blk = prod[_within(rows[p], live[0], hp)].sum(0)
                blk = blk.unflatten(-1, (kw - q, cg))  # (g, cg, kw - q, cg)
                own = blk[:, :, 0]
                blk[:, :, 0] = own.triu() + own.triu(1).mT
                blocks[:, p, q, :, p, q:] = blk
                blocks[:, p, q + 1:, :, p, q] = blk[:, :, 1:].permute(0, 2, 3, 1)
        z = z.flatten(2, 3)
        if cg < 8:
            prod = z0.flatten(2, 3) @ z0.flatten(2, 3).mT
            for p in range(kh):
                blk = prod[_within(rows[p], live[0], hp)].sum(0)
                blk = blk.triu() + blk.triu(1).mT
                blocks[:, p, :, :, p] = blk.unflatten(-1, (kw, cg)).unflatten(-3, (kw, cg))
        for lag, hs in enumerate(live[1:], 1):
            off = rows[lag].start
            windows = [_within(rows[p], hs, hp) for p in range(kh - lag)]
            first, second = z[hs.start: hs.stop], z[hs.start + off: hs.stop + off]
            if sum(len(range(len(hs))[w]) for w in windows) < len(hs):
                blks = [(first[w] @ second[w].mT).sum(0) for w in windows]
            else:
                prod = first @ second.mT  # (rows, g, m, m)
                blks = [prod[w].sum(0) for w in windows]
            for p, blk in enumerate(blks):
                blk = blk.unflatten(-1, (kw, cg)).unflatten(-3, (kw, cg))
                blocks[:, p, :, :, p + lag] = blk
                blocks[:, p + lag, :, :, p] = blk.permute(0, 3, 4, 1, 2)
    else:
        z = z.flatten(2, 3)
        unfolded = torch.stack([z[r] for r in rows], 0)  # (kh, Ho, g, m, N*Wo)
        unfolded = unfolded.permute(2, 0, 3, 1, 4).reshape(g, kh * m, -1)
        blocks = (unfolded @ unfolded.mT).reshape(g, kh, kw, cg, kh, kw, cg)
    a = blocks.permute(0, 3, 1, 2, 6, 4, 5)
    return a.reshape(g, m * kh, m * kh)


def _cov_by_2d_lags(x: Tensor, padding: tuple[int, int, int, int],
                    kernel_size: tuple[int, int], wo: int, rows: list[slice],
                    dilation: tuple[int, int], groups: int) -> Tensor:
    """Column stride 1, ``Wo >= dw (kw - 1)``; ``x`` is zero-padded by ``padding`` on the way.

    The input is laid out once as ``X[h]``: (padded) input row ``h`` of every channel over
    (sample, column), each sample's ``W`` columns followed by ``pad = dw (kw - 1)`` zeros, which
    stand for the padding columns: a partner shifted by at most ``pad`` columns meets zeros, not
    the next sample.  For kernel-row lag ``D`` and column lag ``e``, ``S[h] = X[h] X[h + dh D]^T``
    with the partner shifted by ``dw e`` columns sums the products over all columns: one
    ``C x C`` product per distinct 2-D lag, ``kh (2 kw - 1) - (kw - 1)`` of them, against
    :func:`_cov_by_row_lags`' ``kh kw^2``.  Kernel column ``q`` only sees input columns
    ``[dw q - left, dw q - left + Wo)``, so the block for ``(q, q + e)`` is ``S`` minus the
    products at the other columns: ``pad - left`` first and ``pad - right`` last ones."""
    n, c, h, w = x.shape
    left, _, top, bottom = padding
    hp = h + top + bottom
    kh, kw = kernel_size
    dh, dw = dilation
    g, cg = groups, c // groups
    pad = dw * (kw - 1)
    row = w + pad
    k = n * row
    flat = x.new_zeros(hp, g, cg, pad + k + pad)
    flat[top: top + h, ..., pad: pad + k].unflatten(-1, (n, row))[..., :w].copy_(
        x.reshape(n, g, cg, h, w).permute(3, 1, 2, 0, 4))
    # Edge columns [lo, hi) on each side, with their partners at any column lag: strips of
    # columns [lo - pad, hi + pad) of every row, (Hp, g, column, cg, N).
    sides = _edge_columns(w, wo, pad, left)
    fs = flat.stride()
    strips = [flat.as_strided((hp, g, cg, n, hi - lo + 2 * pad), fs[:3] + (row, 1),
                              flat.storage_offset() + lo).permute(0, 1, 4, 2, 3).contiguous()
              for lo, hi in sides]
    edge = [u for lo, hi in sides for u in range(lo, hi)]
    outside = torch.tensor([[not dw * q - left <= u < dw * q - left + wo for u in edge]
                            for q in range(kw)], dtype=x.dtype, device=x.device)  # (kw, edge)
    body = flat[..., pad: pad + k]
    blocks = x.new_empty(kh, kw, kh, kw, g, cg, cg)
    for lag, hs in enumerate(_live_rows(rows, hp, (top, bottom))):
        off = rows[lag].start
        col_lags = range(0 if lag == 0 else 1 - kw, kw)
        first, part = body[hs.start: hs.stop], flat[hs.start + off: hs.stop + off]
        full = torch.stack([first @ part[..., pad + dw * e: pad + dw * e + k].mT
                            for e in col_lags])  # (lags, rows, g, cg, cg)
        windows = [_within(rows[p], hs, hp) for p in range(kh - lag)]
        full = torch.stack([full[:, wd].sum(1) for wd in windows], 1)  # (lags, P, g, cg, cg)
        at_edge = []
        for (lo, hi), strip in zip(sides, strips):
            # Every column pair of the strip: (rows, g, (hi - lo) cg, (hi - lo + 2 pad) cg).
            pairs = (strip[hs.start: hs.stop, :, pad: pad + hi - lo].flatten(2, 3)
                     @ strip[hs.start + off: hs.stop + off].flatten(2, 3).mT)
            pairs = torch.stack([pairs[wd].sum(0) for wd in windows]).unflatten(
                -1, (hi - lo + 2 * pad, cg)).unflatten(-3, (hi - lo, cg))
            j = torch.arange(hi - lo, device=x.device)
            at_edge.append(torch.stack([pairs[:, :, j, :, j + pad + dw * e].movedim(0, 2)
                                        for e in col_lags]))  # (lags, P, g, hi - lo, cg, cg)
        corr = (torch.einsum("qu,lpguij->lpqgij", outside, torch.cat(at_edge, 3)) if at_edge
                else full.new_zeros(len(col_lags), kh - lag, kw, g, cg, cg))
        p_idx = torch.arange(kh - lag, device=x.device)[:, None]
        for i, e in enumerate(col_lags):
            qs = torch.arange(max(0, -e), min(kw, kw - e), device=x.device)
            val = full[i][:, None] - corr[i][:, qs]  # (P, Q, g, cg, cg)
            if not (lag or e):  # a diagonal block: symmetric, also in round-off
                val = val.triu() + val.triu(1).mT
            blocks[p_idx, qs, p_idx + lag, qs + e] = val
            if lag or e:
                blocks[p_idx + lag, qs + e, p_idx, qs] = val.mT
    a = blocks.permute(4, 5, 0, 1, 6, 2, 3)
    return a.reshape(g, cg * kh * kw, cg * kh * kw)


def adapter_for(module: nn.Module, name: str) -> LayerAdapter | str:
    """The adapter for ``module``, or the reason it cannot be preconditioned."""
    if not isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d,
                               nn.modules.conv._ConvTransposeNd)):
        return f"{type(module).__name__} is not a supported layer type"
    if isinstance(module, torch.jit.ScriptModule):
        return "scripted modules do not run Python hooks"
    w = getattr(module, "weight", None)
    if not isinstance(w, nn.Parameter) or isinstance(w, nn.parameter.UninitializedParameter):
        return "its weight is not an initialised Parameter"
    if not w.requires_grad:
        return "its weight is frozen"
    b = getattr(module, "bias", None)
    if b is not None and not b.requires_grad:
        return "its bias is frozen while its weight is trained"
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        return ConvTransposeAdapter(module, name)
    if isinstance(module, nn.Conv2d):
        return Conv2dAdapter(module, name)
    if isinstance(module, (nn.Conv1d, nn.Conv3d)):
        return ConvNdAdapter(module, name)
    return LinearAdapter(module, name)
