"""Module adapters: what a Kronecker factor is for each supported layer.

Every adapter turns the tensors seen by its module's hooks into *sums* of outer products and a
row count, so that factors reduced over ranks are exactly those of the concatenated batch:

    A = (1/R) sum_r  a_r a_r^T          a_r: one im2col row (patch), with a trailing 1 for the bias
    G = (1/R) sum_r  d_r d_r^T          d_r = n * dL/dy_r, n the local batch size

R counts rows: samples for ``nn.Linear`` (times any middle dims), samples x output positions for
``nn.Conv2d``.  With a loss that is a mean over the local batch, ``d_r`` is the gradient of the
row's own sample loss, so ``G`` does not depend on how the batch is split over ranks.

Grouped convolutions get block-diagonal factors, one block per group: every factor is stored as
a batch ``(groups, d, d)``; ``groups == 1`` for everything else.
"""
from __future__ import annotations

import abc

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LayerAdapter", "LinearAdapter", "Conv2dAdapter", "adapter_for", "conv_input_cov"]


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
        """Local batch size n seen in the input (the factor of ``d = n dL/dy``)."""

    def grad_matrix(self, dtype: torch.dtype) -> Tensor | None:
        """The current gradient as ``(groups, g_dim, a_dim)``; ``None`` if there is none."""
        w = self.module.weight
        if w.grad is None:
            return None
        g = self.groups
        mat = w.grad.detach().reshape(g, w.shape[0] // g, -1).to(dtype)
        if self.has_bias:
            b = self.module.bias.grad
            b = torch.zeros(w.shape[0], dtype=dtype, device=w.device) if b is None else b
            mat = torch.cat([mat, b.detach().reshape(g, -1, 1).to(dtype)], dim=2)
        return mat

    def set_grad(self, mat: Tensor) -> None:
        """Write a ``(groups, g_dim, a_dim)`` matrix back into the parameters' ``.grad``."""
        w = self.module.weight
        ncol = mat.shape[2] - (1 if self.has_bias else 0)
        w.grad.copy_(mat[:, :, :ncol].reshape(w.shape).to(w.grad.dtype))
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
        xp = self.pad(x.to(dtype))
        return conv_input_cov(xp, m.kernel_size, stride=m.stride, dilation=m.dilation,
                              groups=m.groups, bias=self.has_bias)

    def g_sum(self, gy: Tensor, batch: int, dtype: torch.dtype) -> tuple[Tensor, int]:
        gy = gy.detach()
        if gy.dim() == 3:
            gy = gy.unsqueeze(0)
        n, f, ho, wo = gy.shape
        g = self.groups
        per_sample = gy.to(dtype).reshape(n, g, f // g, ho * wo)
        cov = (per_sample @ per_sample.transpose(-1, -2)).sum(0)
        return cov * (batch * batch), n * ho * wo


def conv_input_cov(xp: Tensor, kernel_size: tuple[int, int], *, stride: tuple[int, int],
                   dilation: tuple[int, int], groups: int = 1,
                   bias: bool = False) -> tuple[Tensor, int]:
    """Sum over all im2col rows of ``a a^T`` for an already padded input ``xp`` (N, C, Hp, Wp).

    Exact, without materialising the unfold (``kh*kw`` copies of the input): the covariance of
    a convolution's patches has lag structure.  Writing ``x_u`` for the channel vector at
    position ``u``, the block for kernel offsets ``(d, d + D)`` is ``sum_o x_{o+d} x_{o+d+D}^T``
    over output positions ``o``: every block with the same lag ``D`` sums the same products over
    a shifted window.  :func:`_cov_by_row_lags` uses this along rows: kernel columns are
    unfolded (``kw`` copies), and one batched product per row lag serves all ``kh - D`` pairs of
    kernel rows with that lag -- ``kh (C kw)^2 N Wo Hp`` multiply-adds against
    ``(C kh kw)^2 N Ho Wo`` for the unfold's Gram matrix, about ``kh`` times fewer.

    Returns ``(A_sum of shape (groups, C/groups*kh*kw [+1], same), rows)``, rows ordered like
    ``weight.reshape(F, -1)`` columns: (channel, kernel row, kernel column), then the bias 1.
    """
    n, c, hp, wp = xp.shape
    kh, kw = kernel_size
    (sh, sw), (dh, dw) = stride, dilation
    ho = (hp - dh * (kh - 1) - 1) // sh + 1
    wo = (wp - dw * (kw - 1) - 1) // sw + 1
    if ho <= 0 or wo <= 0:
        raise ValueError(f"input of spatial size {(hp, wp)} is smaller than the kernel extent")
    rows = [slice(dh * p, dh * p + sh * (ho - 1) + 1, sh) for p in range(kh)]
    cols = [slice(dw * q, dw * q + sw * (wo - 1) + 1, sw) for q in range(kw)]
    a = _cov_by_row_lags(xp, kernel_size, ho, wo, rows, cols, groups)
    count = n * ho * wo
    if not bias:
        return a, count
    xs = xp.sum(0)  # (C, Hp, Wp)
    s = torch.stack([torch.stack([xs[:, r, q].sum((1, 2)) for q in cols], -1) for r in rows], -2)
    s = s.reshape(groups, -1)  # (group, (c, p, q))
    m = s.shape[1]
    out = a.new_empty(groups, m + 1, m + 1)
    out[:, :-1, :-1] = a
    out[:, :-1, -1] = s
    out[:, -1, :-1] = s
    out[:, -1, -1] = count
    return out, count


def _cov_by_row_lags(xp: Tensor, kernel_size: tuple[int, int], ho: int, wo: int,
                     rows: list[slice], cols: list[slice], groups: int) -> Tensor:
    """Any stride.  Kernel columns are unfolded (``kw`` copies of the input, not ``kh*kw``) as
    ``Z[h]``: input row ``h`` of every (channel, kernel column) over samples and output columns.
    The block for kernel rows ``(p, p+D)`` sums ``Z[h] Z[h + dil*D]^T`` over the rows of
    ``p``'s window: one batched product per row lag ``D >= 0``.  When striding makes that no
    cheaper than the unfold's Gram matrix, that is formed from the same ``Z``."""
    n, c, hp, wp = xp.shape
    kh, kw = kernel_size
    g, cg = groups, c // groups
    m = cg * kw
    z = xp.new_empty(hp, g, cg, kw, n, wo)
    for q, cs in enumerate(cols):
        z[:, :, :, q].copy_(xp[:, :, :, cs].reshape(n, g, cg, hp, wo).permute(3, 1, 2, 0, 4))
    z = z.reshape(hp, g, m, n * wo)
    starts = [r.start for r in rows]
    spans = [starts[kh - 1 - lag] + rows[0].stop - rows[0].start for lag in range(kh)]
    if sum(spans) <= kh * kh * ho:
        blocks = xp.new_empty(g, kh, m, kh, m)
        for lag, span in enumerate(spans):
            off = starts[lag]
            prod = z[:span] @ z[off: off + span].transpose(-1, -2)  # (span, g, m, m)
            for p in range(kh - lag):
                blk = prod[rows[p]].sum(0)
                blocks[:, p, :, p + lag, :] = blk
                if lag:
                    blocks[:, p + lag, :, p, :] = blk.transpose(-1, -2)
    else:
        unfolded = torch.stack([z[r] for r in rows], 0)  # (kh, Ho, g, m, N*Wo)
        unfolded = unfolded.permute(2, 0, 3, 1, 4).reshape(g, kh * m, -1)
        blocks = (unfolded @ unfolded.transpose(1, 2)).reshape(g, kh, m, kh, m)
    a = blocks.reshape(g, kh, cg, kw, kh, cg, kw).permute(0, 2, 1, 3, 5, 4, 6)
    return a.reshape(g, m * kh, m * kh)


def adapter_for(module: nn.Module, name: str) -> LayerAdapter | str:
    """The adapter for ``module``, or the reason it cannot be preconditioned."""
    if not isinstance(module, (nn.Linear, nn.Conv2d)):
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
    if isinstance(module, nn.Conv2d):
        return Conv2dAdapter(module, name)
    return LinearAdapter(module, name)
