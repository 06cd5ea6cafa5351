"""A spatially split convolution's halo exchanges and local convolution as one autograd step.

Run separately, the halo exchange makes a haloed copy of the rank's input block and the
convolution keeps that copy for backward -- next to the block itself, which the layer before
keeps anyway (a ReLU keeps its output): twice the activation memory of one process, whose
convolution keeps the very tensor its predecessor keeps. Here the step keeps the block (the same
storage) and the halo and padding rows around it, and rebuilds the haloed copy in backward
without communication; the collectives are those of the separate steps (the halo exchange in
forward, the halo accumulate in backward), in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from distconv.conv_geometry import HaloPlan
from distconv.halo import halo_accumulate_start, halo_adjoint, halo_parts, halo_parts_start

__all__ = ["HaloConvSpec", "halo_conv", "interior_rows", "interior_share"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_TRANSPOSED = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@dataclass(frozen=True, eq=False)
class HaloConvSpec:
    """One layer's step on one input shape: per spatial dim its communicator and zero-padding
    halo plan (None: whole), the explicit zero padding of the whole dims applied after the
    exchanges (``F.pad``'s list, or None), and the local convolution's arguments (the split dims
    unpadded)."""

    comms: tuple[Any, ...]
    plans: tuple[HaloPlan | None, ...]
    explicit: tuple[int, ...] | None
    stride: tuple[int, ...]
    padding: Any
    dilation: tuple[int, ...]
    groups: int
    transposed: bool = False
    output_padding: Any = None
    #: convolve the interior rows while the halo rows travel (see :func:`halo_conv`)
    overlap: bool = False

    @property
    def spatial(self) -> int:
        return len(self.plans)


def halo_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              spec: HaloConvSpec) -> torch.Tensor:
    """The local convolution of this rank's block ``x`` after the halo exchanges of ``spec``
    (differentiable in ``x``, ``weight`` and ``bias``).

    With ``spec.overlap`` and one split dim (a direct convolution), the exchange overlaps the
    interior: forward starts the halo exchange, convolves the output rows whose windows lie in
    the rank's own rows, then (halo rows arrived) the border rows above and below; backward
    computes the border rows' gradients first, sends the halo rows' gradients back, and
    computes the interior's while they travel. The same collectives and bytes; the results
    equal the one convolution's up to the order of its sums (bitwise where the convolution's
    arithmetic per output row does not depend on the rows around it)."""
    if any(p is not None and p.mode != "zeros" for p in spec.plans):
        raise ValueError("halo_conv takes zero-padding halo plans only")
    return _HaloConv.apply(x, weight, bias, spec)


@dataclass(frozen=True)
class _Rows:
    """The one split dim of an overlapped step on this rank: tensor dim ``dim`` (its plan
    ``index``), the local input's ``length`` with ``before`` rows ahead of the own rows (which
    start at ``offset`` in the block), the output rows ``[lo, hi]`` whose windows lie in the own
    rows, and each output row's window ``reach`` and ``stride``."""

    dim: int
    index: int
    length: int
    before: int
    offset: int
    lo: int
    hi: int
    n_out: int
    reach: int
    stride: int

    def top(self) -> tuple[int, int]:  # input rows of the border outputs [0, lo)
        return 0, (self.lo - 1) * self.stride + self.reach if self.lo else 0

    def bottom(self) -> tuple[int, int]:  # input rows of the border outputs (hi, n_out)
        start = (self.hi + 1) * self.stride
        return (start, self.length - start) if self.hi < self.n_out - 1 else (start, 0)

    def interior(self) -> tuple[int, int]:  # input rows of the interior outputs [lo, hi]
        return self.lo * self.stride, (self.hi - self.lo) * self.stride + self.reach


def _overlapped(spec: HaloConvSpec, weight: torch.Tensor) -> _Rows | None:
    """The geometry of an overlapped step, or None where it does not apply (no overlap asked,
    a transposed layer, other than one exchanging dim, no interior row)."""
    if not spec.overlap or spec.transposed or isinstance(spec.padding, str):
        return None
    split = [i for i, p in enumerate(spec.plans) if p is not None]
    if len(split) != 1 or not spec.plans[split[0]].exchanges:
        return None
    i = split[0]
    if spec.explicit is not None and any(spec.explicit[2 * (spec.spatial - 1 - i) + j]
                                         for j in (0, 1)):
        return None
    return interior_rows(spec.plans[i], spec.comms[i].rank, weight.shape[2 + i],
                         spec.stride[i], spec.dilation[i], 2 + i, i)


def interior_rows(plan: HaloPlan, rank: int, kernel: int, stride: int, dilation: int,
                  dim: int = 2, index: int = 0) -> _Rows | None:
    """Rank ``rank``'s interior and border output rows of a convolution whose split dim has the
    zero-padding halo ``plan`` (None: no interior row)."""
    lo_need, hi_need = plan.needed[rank]
    pad_before, pad_after = plan.pad[rank]
    length = pad_before + max(0, hi_need - lo_need) + pad_after
    before = plan.recv_rows(rank, rank)[0]
    offset, own = plan.send_rows(rank, rank)
    reach = dilation * (kernel - 1) + 1
    if length < reach or own < reach:
        return None
    n_out = (length - reach) // stride + 1
    lo = -(-before // stride)
    hi = min((before + own - reach) // stride, n_out - 1)
    if hi < lo:
        return None
    return _Rows(dim, index, length, before, offset, lo, hi, n_out, reach, stride)


def interior_share(plan: HaloPlan, rank: int, kernel: int, stride: int, dilation: int) -> float:
    """The share of rank ``rank``'s output rows whose windows lie in its own rows: the part of
    its convolution an overlapped step runs while the halo travels."""
    rows = interior_rows(plan, rank, kernel, stride, dilation)
    return 0.0 if rows is None else (rows.hi - rows.lo + 1) / rows.n_out


def _tuple(value: Any, k: int) -> list[int]:
    return list(value) if isinstance(value, (tuple, list)) else [value] * k


class _HaloConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                spec: HaloConvSpec) -> torch.Tensor:
        rows = _overlapped(spec, weight)
        ctx.rows = rows
        if rows is not None:
            return _HaloConv._overlapped_forward(ctx, x, weight, bias, spec, rows)
        parts, pieces, xh = [], [], x
        for i, plan in enumerate(spec.plans):  # dim after dim: corners travel with the later
            if plan is None:
                continue
            before, own, after = halo_parts(xh, spec.comms[i], plan, 2 + i)
            parts.append((2 + i, own))
            pieces += [before, after]
            xh = torch.cat([before, xh.narrow(2 + i, *own), after], 2 + i)
        if spec.explicit is not None:
            xh = F.pad(xh, spec.explicit)
        if spec.transposed:
            y = _TRANSPOSED[spec.spatial](xh, weight, bias, spec.stride, spec.padding,
                                          spec.output_padding, spec.groups, spec.dilation)
        else:
            y = _CONV[spec.spatial](xh, weight, bias, spec.stride, spec.padding, spec.dilation,
                                    spec.groups)
        ctx.spec, ctx.parts = spec, parts
        ctx.bias_size = None if bias is None else [bias.numel()]
        ctx.save_for_backward(x, weight, *pieces)
        return y

    @staticmethod
    def _overlapped_forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None, spec: HaloConvSpec,
                            rows: _Rows) -> torch.Tensor:
        d, conv = rows.dim, _CONV[spec.spatial]

        def run(t: torch.Tensor) -> torch.Tensor:
            if spec.explicit is not None:
                t = F.pad(t, spec.explicit)
            return conv(t, weight, bias, spec.stride, spec.padding, spec.dilation, spec.groups)

        finish = halo_parts_start(x, spec.comms[rows.index], spec.plans[rows.index], d)
        start, count = rows.interior()  # the own rows' outputs, while the halo travels
        inner = run(x.narrow(d, rows.offset + start - rows.before, count))
        before, own, after = finish()
        xh = torch.cat([before, x.narrow(d, *own), after], d)
        ys = [run(xh.narrow(d, *rows.top()))] if rows.lo else []
        ys.append(inner)
        if rows.hi < rows.n_out - 1:
            ys.append(run(xh.narrow(d, *rows.bottom())))
        ctx.spec, ctx.parts = spec, [(d, own)]
        ctx.bias_size = None if bias is None else [bias.numel()]
        ctx.save_for_backward(x, weight, before, after)
        return torch.cat(ys, d) if len(ys) > 1 else inner

    @staticmethod
    def _overlapped_backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, before, after = ctx.saved_tensors
        spec, rows, k = ctx.spec, ctx.rows, ctx.spec.spatial
        d = rows.dim
        xh = torch.cat([before, x.narrow(d, *ctx.parts[0][1]), after], d)
        if spec.explicit is not None:  # (whole dims only: the split dim's rows stay in place)
            xh = F.pad(xh, spec.explicit)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gx = torch.zeros_like(xh) if need_x else None
        gw = torch.zeros_like(weight) if need_w else None

        def back(out_rows: tuple[int, int], in_rows: tuple[int, int]) -> None:
            if not out_rows[1] or not (need_x or need_w):
                return
            g, w, _ = torch.ops.aten.convolution_backward(
                dy.narrow(d, *out_rows).contiguous(), xh.narrow(d, *in_rows), weight, None,
                _tuple(spec.stride, k), _tuple(spec.padding, k), _tuple(spec.dilation, k),
                False, [0] * k, spec.groups, [need_x, need_w, False])
            if need_x:
                gx.narrow(d, *in_rows).add_(g)
            if need_w:
                gw.add_(w)

        back((0, rows.lo), rows.top())  # the borders first: the halo rows' gradients
        back((rows.hi + 1, rows.n_out - rows.hi - 1), rows.bottom())
        finish = owned = None
        if need_x:
            owned = gx  # the local input's gradient without the explicit padding (a view)
            if spec.explicit is not None:
                for i in range(k):
                    lo, hi = spec.explicit[2 * (k - 1 - i)], spec.explicit[2 * (k - 1 - i) + 1]
                    owned = owned.narrow(2 + i, lo, owned.shape[2 + i] - lo - hi)
            finish = halo_accumulate_start(owned, spec.comms[rows.index],
                                           spec.plans[rows.index], d)
        # the interior's, while the halo rows' gradients travel
        back((rows.lo, rows.hi - rows.lo + 1), rows.interior())
        gb = None
        if ctx.bias_size is not None and ctx.needs_input_grad[2]:
            gb = dy.sum([i for i in range(dy.dim()) if i != 1])
        return (finish(owned) if finish is not None else None), gw, gb, None

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.rows is not None:
            return _HaloConv._overlapped_backward(ctx, dy)
        x, weight, *pieces = ctx.saved_tensors
        spec, k = ctx.spec, ctx.spec.spatial
        xh = x
        for j, (d, own) in enumerate(ctx.parts):  # the haloed block, rebuilt
            xh = torch.cat([pieces[2 * j], xh.narrow(d, *own), pieces[2 * j + 1]], d)
        if spec.explicit is not None:
            xh = F.pad(xh, spec.explicit)
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                ctx.bias_size is not None and ctx.needs_input_grad[2]]
        gx, gw, gb = torch.ops.aten.convolution_backward(
            dy.contiguous(), xh, weight, ctx.bias_size, _tuple(spec.stride, k),
            _tuple(spec.padding, k), _tuple(spec.dilation, k), spec.transposed,
            _tuple(spec.output_padding or 0, k), spec.groups, mask)
        if gx is not None:
            if spec.explicit is not None:  # the adjoint of the explicit padding: rows dropped
                for i in range(k):
                    lo, hi = spec.explicit[2 * (k - 1 - i)], spec.explicit[2 * (k - 1 - i) + 1]
                    gx = gx.narrow(2 + i, lo, gx.shape[2 + i] - lo - hi)
            for d, _ in reversed(ctx.parts):
                gx = halo_adjoint(gx, spec.comms[d - 2], spec.plans[d - 2], d, None)
        return gx, gw, gb, None
