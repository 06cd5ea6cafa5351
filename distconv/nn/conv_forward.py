"""The forward steps of :class:`~distconv.nn.conv.DistConv2d`, apart from the layer that holds them.

:func:`layer_geometry` derives, once per global input shape, what the steps need from it (output
shape, halo plans, the padding left to the local convolution); :func:`conv_forward` runs the
algorithm's steps (allgather over F, halo exchange, local convolution, reduce-scatter over C, as
the layer's docstring writes them), whose adjoints are the backward steps. Global shapes come from
the caller, the layer, or one allgather of the local sizes (:func:`_agree_shape`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn.functional as F

from distconv.conv_geometry import HaloPlan, check_padding_mode, conv_dims
from distconv.distribution import as_shape
from distconv.halo import haloed
from distconv.nn._activation import local_shape
from distconv.nn._amp import autocast_dtype
from distconv.nn.halo_conv import HaloConvSpec, halo_conv
from distconv.nn.pipeline import pipelined_conv
from distconv.redistribute import redistribute

if TYPE_CHECKING:
    from distconv.nn.conv import DistConv2d

__all__ = ["ConvGeometry", "conv_forward", "layer_geometry"]


@dataclass(frozen=True)
class ConvGeometry:
    """Everything a forward pass derives from the global input shape (cached per shape)."""

    x_shape: tuple[int, int, int, int]
    y_shape: tuple[int, int, int, int]
    halo: tuple[HaloPlan | None, HaloPlan | None]
    conv_padding: tuple[int, int]
    explicit_pad: tuple[int, int, int, int] | None


def layer_geometry(layer: DistConv2d, x_shape: tuple[int, ...]) -> ConvGeometry:
    """What a forward pass derives from the global input shape ``x_shape``, checked against the
    layer (cached per shape on the layer)."""
    geo = layer._geometries.get(x_shape)
    if geo is not None:
        return geo
    layer._check_input_shape(x_shape)
    dims = conv_dims(x_shape[2:], layer.kernel_size, layer.stride, layer.dilation, layer._pads)
    halo: list[HaloPlan | None] = []
    conv_padding, explicit = [0, 0], [0, 0, 0, 0]
    for i, (d, role) in enumerate(zip(dims, ("H", "W"))):
        if d.out_length == 0:
            raise ValueError(
                f"the kernel does not fit the input {x_shape} (kernel {layer.kernel_size}, "
                f"dilation {layer.dilation}, padding {layer.padding})"
            )
        parts = layer._ext(layer.roles[role])
        if parts > 1:
            plan = HaloPlan(d, parts, layer.padding_mode)
            plan.check(layer.roles[role])
            halo.append(plan)
            continue
        check_padding_mode(d, layer.padding_mode, role)
        halo.append(None)
        lo, hi = layer._pads[i]
        if lo == hi:
            conv_padding[i] = lo
        explicit[2 - 2 * i], explicit[3 - 2 * i] = lo, hi
    need_explicit = any(explicit) and (layer.padding_mode != "zeros" or any(
        halo[i] is None and layer._pads[i][0] != layer._pads[i][1] for i in range(2)
    ))
    if need_explicit:
        conv_padding = [0, 0]
    y_shape = (x_shape[0], layer.out_channels, dims[0].out_length, dims[1].out_length)
    geo = ConvGeometry(
        tuple(x_shape), y_shape, (halo[0], halo[1]), (conv_padding[0], conv_padding[1]),
        tuple(explicit) if need_explicit else None,  # type: ignore[arg-type]
    )
    layer._geometries[tuple(x_shape)] = geo
    return geo



def _global_shape(layer: DistConv2d, x: torch.Tensor,
                  given: Sequence[int] | None) -> tuple[int, ...]:
    if given is not None:
        return as_shape(given, "DistConv2d.forward: global_shape")
    if layer.input_shape is not None:
        return layer.input_shape
    if layer._shape_comm is None:
        return (x.shape[0], layer.in_channels, x.shape[2], x.shape[3])
    return _agree_shape(layer, x)


def _agree_shape(layer: DistConv2d, x: torch.Tensor) -> tuple[int, ...]:
    """Global (N, C, H, W) from one allgather of the local (N, H, W) over the N×H×W segment:
    each global size is the sum of the blocks along its own grid dim."""
    roles = [layer.roles[r] for r in ("sample_dim", "H", "W")]
    split = [d for d in roles if layer._ext(d) > 1]
    segment = next(g for g in layer.grid.segments(split) if layer.grid.rank in g)
    local = torch.tensor([x.shape[0], x.shape[2], x.shape[3]], dtype=torch.int64,
                         device=layer._shape_comm.device)
    sizes = layer._shape_comm.allgather(local, meta="DistConv2d global shape agreement")
    total = [0, 0, 0]
    for rank, s in zip(segment, sizes):
        coords = layer.grid.coords_of(rank)
        for k, role in enumerate(roles):
            if all(coords.get(o, 0) == 0 for o in roles if o != role):
                total[k] += int(s[k])
    return (total[0], layer.in_channels, total[1], total[2])



def conv_forward(layer: DistConv2d, x: torch.Tensor,
                 global_shape: Sequence[int] | None = None) -> torch.Tensor:
    """:meth:`DistConv2d.forward`: the algorithm's forward steps on this rank's block ``x``
    (``layer.input_dist``), returning its block of y (``layer.output_dist``); the backward steps
    are the adjoints autograd runs back through the same calls."""
    _check_input(layer, x)
    if layer.work_hook is not None and layer._group_parts > 1 and (
            layer.groups % layer._group_parts):
        raise NotImplementedError(
            f"use C×F dividing groups={layer.groups} (or sample or spatial parallelism) for "
            f"this grouped {layer.algorithm} layer under K-FAC: its {layer._group_parts} "
            "channel blocks hold unequal or partial groups, which K-FAC's work hook does not "
            "read")
    if layer._local and global_shape is None and layer.input_shape is None:
        if x.dim() not in (3, 4) or x.shape[-3] != layer.in_channels:
            raise ValueError(
                f"DistConv2d(in_channels={layer.in_channels}, out_channels="
                f"{layer.out_channels}, kernel_size={layer.kernel_size}).forward: x has shape "
                f"{tuple(x.shape)}, but the layer takes (N, {layer.in_channels}, H, W) or "
                f"({layer.in_channels}, H, W)")
        return _local_conv(layer, x)
    key = (x.shape, global_shape) if type(global_shape) is tuple else None
    shape = layer._checked.get(key) if key is not None else None
    if shape is None:  # a block and global shape not seen yet: checked once
        shape = _check_block(layer, x, global_shape, key)
    if layer._local:  # no communication: torch's convolution of the block, as nn.Conv2d
        return _local_conv(layer, x)
    geo = layer_geometry(layer, shape)
    if (layer.pipeline > 1 and x.shape[0] > 1 and layer.work_hook is None
            and autocast_dtype(x.device.type) is None):
        y = pipelined_conv(layer, x, geo, shape, None if layer._reduce_y else layer.bias)
        if layer._reduce_y and layer.bias is not None:
            y = y + layer.bias.to(y.dtype).view(1, -1, 1, 1)
        return y
    if layer._gather_x:
        x = redistribute(x, layer.grid, layer.input_dist, layer.work_dist, shape)
    weight, fused_bias = layer.weight, None if layer._reduce_y else layer.bias
    if layer._gather_groups:
        x, weight, fused_bias = _group_window(layer, x)
    if (layer.padding_mode == "zeros" and layer.work_hook is None and any(geo.halo)
            and autocast_dtype(x.device.type) is None):
        # the exchanges and the convolution as one step: no haloed copy kept for backward
        y = halo_conv(x, weight, fused_bias, _halo_spec(layer, geo))
    else:
        x = haloed(x, layer._halo_comms, geo.halo, geo.explicit_pad, layer.padding_mode)
        y = F.conv2d(
            x, weight, fused_bias, layer.stride, geo.conv_padding, layer.dilation,
            layer._local_groups,
        )
        if layer.work_hook is not None:
            (ph, pw) = geo.conv_padding
            layer.work_hook(layer, x, (pw, pw, ph, ph), y, geo.y_shape)
    if layer._gather_groups:
        y = y.narrow(1, layer._span.lead, layer._span.filters)
    if layer._reduce_y:
        y = redistribute(y, layer.grid, layer.partial_dist, layer.output_dist, geo.y_shape)
        if layer.bias is not None:  # in y's dtype, as autocast's conv adds it
            y = y + layer.bias.to(y.dtype).view(1, -1, 1, 1)
    return y


def _group_window(layer: DistConv2d, x: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A grouped layer whose blocks cut groups, on its gathered ``x[o,*,o,o]``: the channels of
    the groups its filters reach into, and its weight and bias with zero rows for the filters of
    those groups that other ranks own (their outputs are dropped after the convolution)."""
    span = layer._span
    per = layer.in_channels // layer.groups
    x = x.narrow(1, span.g0 * per, (span.g1 - span.g0) * per)

    def padded(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or span.lead == span.trail == 0:
            return t
        return torch.cat([t.new_zeros((span.lead, *t.shape[1:])), t,
                          t.new_zeros((span.trail, *t.shape[1:]))])

    return x, padded(layer.weight), padded(layer.bias)


def _check_block(layer: DistConv2d, x: torch.Tensor, global_shape: Sequence[int] | None,
                 key: tuple[Any, tuple[int, ...]] | None) -> tuple[int, ...]:
    """The global input shape of block ``x``, checked against the layer's geometry and
    input distribution; remembered under ``key`` (None: not remembered)."""
    if x.dim() != 4:
        raise ValueError(
            f"DistConv2d on a distributed grid (or given a global shape) takes a 4-d input, "
            f"got {tuple(x.shape)}"
        )
    shape = _global_shape(layer, x, global_shape)
    layer_geometry(layer, shape)
    expected = local_shape(layer.grid, layer.input_dist, tuple(shape))
    if tuple(x.shape) != expected:
        raise ValueError(
            f"rank {layer.grid.rank} (coords {layer.grid.coords}) got an input block of "
            f"shape {tuple(x.shape)}, but {layer.input_dist.format('x')} of the global "
            f"shape {shape} gives it {expected}"
        )
    if key is not None:
        if len(layer._checked) > 64:
            layer._checked.clear()
        layer._checked[key] = shape
    return shape


def _halo_spec(layer: DistConv2d, geo: ConvGeometry) -> HaloConvSpec:
    spec = layer._specs.get(geo.x_shape)
    if spec is None:
        spec = layer._specs[geo.x_shape] = HaloConvSpec(
            layer._halo_comms, geo.halo, geo.explicit_pad, layer.stride, geo.conv_padding,
            layer.dilation, layer._local_groups, overlap=layer.overlap)
    return spec


def _check_input(layer: DistConv2d, x: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"DistConv2d.forward: x must be a torch.Tensor (this rank's block of the input), "
            f"got {type(x).__name__}"
        )
    weight = layer.weight
    if x.dtype == weight.dtype and x.device == weight.device:
        return
    if x.dtype != weight.dtype and x.dtype != autocast_dtype(x.device.type):
        raise TypeError(
            f"DistConv2d.forward: x has dtype {x.dtype} but the layer's weight is "
            f"{weight.dtype}; convert one of them (e.g. x.to({weight.dtype}))"
        )
    if x.device != weight.device:
        raise ValueError(
            f"DistConv2d.forward: x is on {x.device} but the layer's weight is on "
            f"{layer.weight.device}"
        )


def _local_conv(layer: DistConv2d, x: torch.Tensor) -> torch.Tensor:
    """The convolution of a layer that splits no channel, filter or spatial dim: the calls
    ``nn.Conv2d`` makes."""
    if layer.padding_mode == "zeros":
        y = F.conv2d(
            x, layer.weight, layer.bias, layer.stride, layer.padding, layer.dilation, layer.groups
        )
        padding = layer._reversed_padding
    else:
        x, padding = F.pad(x, layer._reversed_padding, mode=layer.padding_mode), (0, 0, 0, 0)
        y = F.conv2d(x, layer.weight, layer.bias, layer.stride, 0, layer.dilation, layer.groups)
    if layer.work_hook is not None:
        layer.work_hook(layer, x, padding, y, (-1, *y.shape[1:]))
    return y
