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
from distconv.halo import halo_adjoint, halo_parts

__all__ = ["HaloConvSpec", "halo_conv"]

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

    @property
    def spatial(self) -> int:
        return len(self.plans)


def halo_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              spec: HaloConvSpec) -> torch.Tensor:
    """The local convolution of this rank's block ``x`` after the halo exchanges of ``spec``
    (differentiable in ``x``, ``weight`` and ``bias``)."""
    if any(p is not None and p.mode != "zeros" for p in spec.plans):
        raise ValueError("halo_conv takes zero-padding halo plans only")
    return _HaloConv.apply(x, weight, bias, spec)


def _tuple(value: Any, k: int) -> list[int]:
    return list(value) if isinstance(value, (tuple, list)) else [value] * k


class _HaloConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                spec: HaloConvSpec) -> torch.Tensor:
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
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
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
