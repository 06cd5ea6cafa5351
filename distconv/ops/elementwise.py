"""Elementwise ops: pointwise layers and functions keep their input's (settled) placement;
binary ops meet where the cheaper operand moves; ``torch.cat`` joins along a replicated dim;
dropout runs only where its masks match one process's (sample-parallel values)."""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from distconv.distribution import Dist
from distconv.ops.base import SAMPLE_GRIDS, Handler, Sample, SampleNet
from distconv.parallel.placement import Placement, conversion_bytes, evaluated_ranks

__all__ = ["BinaryHandler", "CatHandler", "DropoutHandler", "PointwiseHandler",
           "broadcast_need", "meeting"]


class PointwiseHandler(Handler):
    modules = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.ELU,
               nn.Hardswish, nn.Hardsigmoid, nn.Mish, nn.Softplus, nn.Identity, nn.PReLU)
    functions = frozenset({
        F.relu, torch.relu, F.relu6, F.gelu, F.silu, F.leaky_relu, F.elu, F.hardswish, F.mish,
        torch.sigmoid, torch.tanh, F.sigmoid, F.tanh, torch.clamp, torch.abs, operator.neg,
        torch.neg, F.softplus,
    })
    methods = frozenset({"relu", "relu_", "sigmoid", "tanh", "clamp", "abs", "neg", "contiguous",
                         "float", "double", "half", "bfloat16", "clone", "detach"})

    def place(self, an: Any, node: Any, module: Any) -> Any:
        step = an.keep(node, "pointwise")
        if isinstance(module, nn.PReLU) and module.num_parameters > 1 and (
                step.out.dist.grid_dims_of(1)):
            an.fail(node, f"PReLU with one weight per channel ({module.num_parameters}) on a "
                    "channel-split value: every rank would apply the first channels' weights. "
                    "Use PReLU() (one weight) there, or keep the channels whole before it")
        return step

    def samples(self) -> Sequence[Sample]:
        return (Sample("relu", lambda: SampleNet(nn.ReLU(), 4), (5, 4, 7, 6), SAMPLE_GRIDS),)


class DropoutHandler(Handler):
    """``Dropout`` and ``Dropout1d/2d/3d`` (module or ``F.*``). On values split over sample dims
    only,
    each rank draws its own block's mask from torch's generator, as DDP does; on values split
    over model-parallel dims (channels, rows, ...), :class:`~distconv.nn.DistDropout` draws the
    global mask from a generator every rank shares and keeps its block: one process's masks."""

    modules = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
    functions = frozenset({F.dropout, F.dropout1d, F.dropout2d, F.dropout3d})

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import LayerSpec

        step = an.keep(node, "dropout")
        model_dims = step.out.dist.used() - set(step.out.dist.grid_dims_of(0))
        if model_dims and _drop_p(node, module) > 0:
            step.layer = LayerSpec("dropout", str(node.target) if module is not None
                                   else node.name, step.out.layout, input=step.out)
        return step

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        from distconv.nn.dropout import (
            DistDropout, DistDropout1d, DistDropout2d, DistDropout3d,
        )

        kinds = {nn.Dropout1d: DistDropout1d, nn.Dropout2d: DistDropout2d,
                 nn.Dropout3d: DistDropout3d, F.dropout1d: DistDropout1d,
                 F.dropout2d: DistDropout2d, F.dropout3d: DistDropout3d}
        cls = kinds.get(type(module) if module is not None else node.target, DistDropout)
        layer = cls(_drop_p(node, module), grid=grid, input_dist=step.layer.input.dist)
        if module is not None:
            layer.train(module.training)
        elif not bool(node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)):
            layer.eval()
        return layer

    def samples(self) -> Sequence[Sample]:
        return (Sample("dropout-p0", lambda: SampleNet(nn.Dropout(0.0), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),
                Sample("dropout2d-eval", lambda: SampleNet(nn.Dropout2d(0.5).eval(), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS))


def _drop_p(node: Any, module: Any) -> float:
    if module is not None:
        return float(module.p)
    return float(node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5))


class BinaryHandler(Handler):
    functions = frozenset({operator.add, operator.iadd, operator.sub, operator.isub, operator.mul,
                           operator.imul, operator.truediv, operator.itruediv, torch.add,
                           torch.sub, torch.mul, torch.div})
    methods = frozenset({"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_"})

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import Step

        args = an.tensor_args(node)
        for a in fx.node.map_aggregate(node.args, lambda a: a):
            if isinstance(a, fx.Node) and an.out.get(a) is None and a.op == "get_attr":
                an.fail(node, "an elementwise op between an activation and a model tensor "
                        "(get_attr) is not supported: its broadcast over split dims is unplanned")
        if len(args) == 1:
            return an.keep(node, "pointwise")
        if len(args) != 2:
            an.fail(node, f"expected two tensor operands, got {len(args)}")
        a, b = (an.placement(x).settled() for x in args)
        if a.ndim != b.ndim:
            an.fail(node, "operands with different numbers of dims (broadcasting across "
                    "distributed dims) are not supported")
        target = meeting(a, b)
        return Step(node, "pointwise", target, {args[0]: target, args[1]: target})

    def samples(self) -> Sequence[Sample]:
        return (Sample("residual-add", lambda: SampleNet(_Residual(), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),
                Sample("squeeze-excitation", lambda: SampleNet(_Excite(), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS))


class CatHandler(Handler):
    functions = frozenset({torch.cat})

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import Step

        args = an.tensor_args(node)
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        first = an.placement(args[0]).settled()
        dim = dim % first.ndim
        if dim == 0:
            an.fail(node, "concatenating along the sample dim is not supported")

        def whole(p: Placement) -> Placement:  # the operand with the joined dim whole
            entries = list(p.dist.entries)
            entries[dim] = None
            return Placement(p.layout, Dist(tuple(entries)))

        # the operands meet where the others reach with fewer bytes, as at a residual add
        target = whole(first)
        for a in args[1:]:
            target = meeting(target, whole(an.placement(a).settled()))
        return Step(node, "pointwise", target, {a: target for a in args})

    def samples(self) -> Sequence[Sample]:
        return (Sample("cat-channels", lambda: SampleNet(_Cat(), 4, 8), (5, 4, 7, 6),
                       SAMPLE_GRIDS),)


def broadcast_need(need: Placement, shape: Sequence[int], out_shape: Sequence[int]) -> Placement:
    """What an operand of shape ``shape`` of a broadcasting elementwise op is converted to: the
    placement the operands meet in, with every dim it broadcasts over (size 1 against a larger
    result) whole on each rank -- each rank's block of the result needs that one row, e.g. the
    ``[N, C, 1, 1]`` gate of squeeze-and-excitation against a row- or channel-split activation.
    Its cotangent is then a pending sum over the grid dims that split those dims of the result,
    which the conversion's adjoint resolves."""
    if len(shape) != len(out_shape):
        return need
    entries = list(need.dist.entries)
    for d, (a, o) in enumerate(zip(shape, out_shape)):
        if a == 1 and o != 1:
            entries[d] = None
    if tuple(entries) == need.dist.entries:
        return need
    return Placement(need.layout, dataclasses.replace(need.dist, entries=tuple(entries)))


def meeting(a: Placement, b: Placement) -> Placement:
    """Where two operands meet: the placement the other reaches with fewer bytes in total (ties:
    ``a``), counted on a nominal shape whose every dim each extent divides, over the evaluated
    ranks (every rank of a world of up to 64; :func:`~distconv.parallel.placement.evaluated_ranks`).
    The one rule of the executor, ``explain`` and the planner."""
    if a == b:
        return a
    size = math.prod(e for _, e in a.layout)
    shape = (2 * size,) * a.ndim
    ranks = evaluated_ranks([a.layout, b.layout], size)
    cost_to_a = sum(conversion_bytes(b, a, shape, 1, r) for r in ranks)
    cost_to_b = sum(conversion_bytes(a, b, shape, 1, r) for r in ranks)
    return b if cost_to_b < cost_to_a else a


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: Any) -> Any:
        return x + self.conv(x)


class _Excite(nn.Module):
    """A gate of shape [N, C, 1, 1] broadcast over the rows and columns (squeeze-and-excitation),
    and a [N, 1, H, W] map broadcast over the channels (a spatial attention gate)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: Any) -> Any:
        x = x * torch.sigmoid(x.mean((2, 3), keepdim=True))
        return self.conv(x) * torch.sigmoid(x.mean(1, keepdim=True))


class _Cat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: Any) -> Any:
        return torch.cat([x, self.conv(x)], 1)
