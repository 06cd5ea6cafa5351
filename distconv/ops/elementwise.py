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
from distconv.memo import BoundedMemo
from distconv.ops.base import SAMPLE_GRIDS, Handler, Sample, SampleNet
from distconv.parallel.placement import Placement, conversion_bytes, evaluated_ranks
from distconv.parallel.steps import samples_of

__all__ = ["BinaryHandler", "CatHandler", "DropoutHandler", "PointwiseHandler", "StackHandler",
           "broadcast_need", "is_constant", "meeting", "with_constants"]


class PointwiseHandler(Handler):
    """Pointwise activations and maps of one value (module, ``F.*``, ``torch.*`` or method):
    each element of the result depends on the same element of the input only, so every rank
    maps its block, in its input's settled placement, and nothing moves."""

    modules = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.ELU,
               nn.Hardswish, nn.Hardsigmoid, nn.Mish, nn.Softplus, nn.Identity, nn.PReLU,
               nn.Hardtanh, nn.SELU, nn.CELU, nn.Softsign, nn.LogSigmoid, nn.Tanhshrink,
               nn.Softshrink, nn.Hardshrink, nn.Threshold)
    functions = frozenset({
        F.relu, torch.relu, F.relu6, F.gelu, F.silu, F.leaky_relu, F.elu, F.hardswish, F.mish,
        torch.sigmoid, torch.tanh, F.sigmoid, F.tanh, torch.clamp, torch.abs, operator.neg,
        torch.neg, F.softplus, F.hardsigmoid, F.hardtanh, F.selu, F.celu, F.softsign,
        F.logsigmoid, F.tanhshrink, F.softshrink, F.hardshrink, F.threshold, F.relu_,
        F.hardtanh_, F.elu_, F.leaky_relu_, torch.selu, torch.celu, torch.clamp_min,
        torch.clamp_max, torch.clip, torch.erf, torch.erfc, torch.exp, torch.expm1, torch.log,
        torch.log1p, torch.sqrt, torch.rsqrt, torch.square, torch.reciprocal, torch.sign,
        torch.sin, torch.cos, torch.floor, torch.ceil, torch.round,
    })
    methods = frozenset({
        "relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "clamp", "clamp_", "clamp_min",
        "clamp_max", "clip", "abs", "neg", "contiguous", "float", "double", "half", "bfloat16",
        "clone", "detach", "erf", "erfc", "exp", "expm1", "log", "log1p", "sqrt", "rsqrt",
        "square", "reciprocal", "sign", "sin", "cos", "floor", "ceil", "round"})
    #: activations of packages that need not be installed (their forward is one pointwise map)
    module_names = frozenset({"monai.networks.blocks.activation.MemoryEfficientSwish"})
    samples_anywhere = True

    def place(self, an: Any, node: Any, module: Any) -> Any:
        args = an.tensor_args(node)
        if len(args) > 1 and any(is_constant(a) for a in args):  # torch.clamp(x, max=self.t)
            return with_constants(an, node, args)
        step = an.keep(node, "pointwise")
        if isinstance(module, nn.PReLU) and module.num_parameters > 1 and (
                step.out.dist.grid_dims_of(1)):
            an.fail(node, "use PReLU() (one weight) here, or keep the channels whole before it: "
                    f"with one weight per channel ({module.num_parameters}) on a channel-split "
                    "value, every rank would apply the first channels' weights")
        return step

    def samples(self) -> Sequence[Sample]:
        return (Sample("relu", lambda: SampleNet(nn.ReLU(), 4), (5, 4, 7, 6), SAMPLE_GRIDS),
                Sample("activation-modules", lambda: SampleNet(_activation_modules(), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS),
                Sample("activation-functions", lambda: SampleNet(_Activations(), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS))


def _activation_modules() -> nn.Module:
    """Every activation module the handler binds, in a chain whose values stay O(1)."""
    return nn.Sequential(
        nn.Hardswish(), nn.Hardsigmoid(), nn.SiLU(), nn.GELU(), nn.GELU(approximate="tanh"),
        nn.Mish(), nn.SELU(), nn.CELU(0.7), nn.Softsign(), nn.Hardtanh(-0.4, 0.8),
        nn.LogSigmoid(), nn.Tanhshrink(), nn.Softshrink(0.01), nn.Hardshrink(0.001),
        nn.Threshold(-0.5, 0.1), nn.ReLU6(), nn.ELU(), nn.LeakyReLU(0.1), nn.Softplus(),
        nn.Sigmoid(), nn.Tanh())


class _Activations(nn.Module):
    """The functional and method forms (in place ones included) and elementwise maps, chained
    with scalars so values stay O(1)."""

    def forward(self, x: Any) -> Any:
        x = F.hardtanh(F.hardsigmoid(x) * 3 - 1, -0.5, 0.5) * 4
        x = F.gelu(F.relu6(x * 4) - 2, approximate="tanh")
        x = torch.erf(F.silu(x.clone(), inplace=True).sigmoid()) - 0.5
        x = torch.sqrt(torch.exp(-x.pow(2)) + 1).pow(3) - 2
        x = F.softsign(F.celu(F.selu(x)))
        x = torch.rsqrt(F.tanhshrink(F.logsigmoid(x)).square() + 1).clamp(-1, 0.9)
        return torch.log1p(F.hardswish(F.mish(x * 3 - 1)).abs()).clamp_min(0.1)


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
                           torch.sub, torch.mul, torch.div, operator.pow, torch.pow,
                           torch.maximum, torch.minimum})
    methods = frozenset({"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "pow",
                         "pow_", "maximum", "minimum"})
    samples_anywhere = True

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import Step

        args = an.tensor_args(node)
        if len(args) == 1:
            return an.keep(node, "pointwise")
        if len(args) != 2:
            an.fail(node, "split it into ops of two tensor operands each: it takes "
                    f"{len(args)}")
        if any(is_constant(x) for x in args):
            return with_constants(an, node, args)
        a, b = (an.placement(x).settled() for x in args)
        if a.ndim != b.ndim:
            an.fail(node, "give both operands one number of dims (unsqueeze the smaller): "
                    f"operands of {a.ndim} and {b.ndim} dims (broadcasting across distributed "
                    "dims) are not supported")
        samples = {samples_of(x)[0] for x in args}
        if len(samples) > 1:
            an.fail(node, "move the operands' samples to one dim first: they hold the samples "
                    f"in different dims {sorted(samples)}")
        target = meeting(a, b)
        return Step(node, "pointwise", target, {args[0]: target, args[1]: target},
                    samples=samples.pop())

    def samples(self) -> Sequence[Sample]:
        return (Sample("residual-add", lambda: SampleNet(_Residual(), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),
                Sample("squeeze-excitation", lambda: SampleNet(_Excite(), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),
                Sample("layer-scale", lambda: SampleNet(_Scaled(), 4), (5, 4, 7, 6),
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
            an.fail(node, "concatenate along another dim, or concatenate the batches outside "
                    "the model: concatenating along the sample dim (0) is not supported")

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


class StackHandler(Handler):
    """``torch.stack(values, dim)``: the values meet in one placement (as at a residual add:
    where the others reach with fewer bytes) and each rank stacks its blocks; the new dim is
    whole on every rank, the others keep their entries, so nothing else moves. A new dim at or
    before the samples' dim moves them behind it (an FPN decoder's ``torch.stack(fs).sum(0)``,
    whose sum then takes them back). Refused by name: values holding their samples in different
    dims, a tuple of values stacked whole (``torch.stack(x.unbind(1))``)."""

    functions = frozenset({torch.stack})
    samples_anywhere = True

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import Step

        values = node.kwargs.get("tensors", node.args[0] if node.args else None)
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        if not isinstance(values, (list, tuple)) or not values or not all(
                isinstance(v, fx.Node) and an.out.get(v) is not None for v in values):
            what = values.name if isinstance(values, fx.Node) else repr(values)
            an.fail(node, f"stack a list of values (torch.stack([a, b], dim)); this call stacks "
                    f"{what}, a tuple taken whole: take its items first ([*x] is not traced)")
        if not isinstance(dim, int) or isinstance(dim, bool):
            an.fail(node, f"give stack's dim as an int, got {dim!r}", TypeError)
        args = list(dict.fromkeys(values))
        if any(is_constant(a) for a in args):
            an.fail(node, "stack activations only; a parameter or buffer among them is whole "
                    "on every rank while the activations are split (add it to each instead)")
        placed = [an.placement(a).settled() for a in args]
        if len({p.ndim for p in placed}) > 1:
            an.fail(node, "stack values of one number of dims (torch requires one shape)",
                    ValueError)
        samples = {samples_of(a)[0] for a in args}
        if len(samples) > 1:
            an.fail(node, "move the values' samples to one dim first: they hold the samples in "
                    f"different dims {sorted(samples)}")
        s = samples.pop()
        target = placed[0]
        for p in placed[1:]:
            target = meeting(target, p)
        dim %= target.ndim + 1
        entries = list(target.dist.entries)
        entries.insert(dim, None)
        out = Placement(target.layout, Dist(tuple(entries)))
        return Step(node, "stack", out, {a: target for a in args}, samples=s + (dim <= s))

    def samples(self) -> Sequence[Sample]:
        return (Sample("stack-sum", lambda: SampleNet(_Stack(), 4), (5, 4, 7, 6), SAMPLE_GRIDS),)


def with_constants(an: Any, node: fx.Node, args: list[fx.Node]) -> Any:
    """An elementwise op of one activation and parameters or buffers (a layer scale, a
    positional term, a bound): the value stays where the activation is, and each parameter is
    sliced to the activation's blocks (trailing dims aligned, as broadcasting aligns them; the
    dims it broadcasts over then made whole by :func:`broadcast_need`), so its gradient is a
    pending sum that the replicated parameters' all-rank sum completes. Of parameters only: whole
    on every rank, as they are."""
    from distconv.parallel.steps import Step

    values = [a for a in args if not is_constant(a)]
    if len(values) > 1:
        an.fail(node, "split it into ops of two operands each: it combines "
                f"{len(values)} activations with a parameter or buffer, and one op takes model "
                "tensors with at most one activation")
    if not values:
        out = max((an.placement(a) for a in args), key=lambda p: p.ndim)
        return Step(node, "pointwise", out, {a: an.placement(a) for a in args})
    act = an.placement(values[0]).settled()
    needs = {}
    for a in args:
        k = an.placement(a).ndim
        if a is not values[0] and k > act.ndim:
            an.fail(node, f"give the parameter at most {act.ndim} dims (the activation's): a "
                    f"parameter of {k} dims broadcast against an activation of {act.ndim}: the "
                    "activation would gain dims")
        needs[a] = act if a is values[0] else Placement(
            act.layout, Dist(act.dist.entries[act.ndim - k:]))
    return Step(node, "pointwise", act, needs, samples=samples_of(values[0])[0])


def is_constant(node: fx.Node) -> bool:
    """Whether ``node``'s value comes from parameters and buffers only (``self.gamma``,
    ``self.gamma.view(1, -1, 1, 1)``, ``self.gamma[:, None, None]``), never from the input;
    sizes of the global shape may shape it (``table[index[:n, :n]].view(n, n, -1)``: the same
    on every rank)."""
    from distconv.ops.sizes import is_size

    if node.op == "get_attr":
        return True
    inputs = [a for a in node.all_input_nodes if not is_size(a)]
    return node.op.startswith("call_") and bool(inputs) and all(is_constant(a) for a in inputs)


def broadcast_need(need: Placement, shape: Sequence[int], out_shape: Sequence[int]) -> Placement:
    """What an operand of shape ``shape`` of a broadcasting elementwise op is converted to: the
    placement the operands meet in, with every dim it broadcasts over (size 1 against a larger
    result) whole on each rank -- each rank's block of the result needs that one row, e.g. the
    ``[N, C, 1, 1]`` gate of squeeze-and-excitation against a row- or channel-split activation.
    Its cotangent is then a pending sum over the grid dims that split those dims of the result,
    which the conversion's adjoint resolves."""
    if len(shape) > len(out_shape):
        return need
    out_shape = out_shape[len(out_shape) - len(shape):]  # broadcasting aligns trailing dims
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
    # (a pure function of the two placements, asked again for every plan a search prices: a
    # DenseNet's concatenations meet dozens of operands each)
    return b if _MEETS_AT_B.get((a, b), lambda: _meets_at_b(a, b)) else a


def _meets_at_b(a: Placement, b: Placement) -> bool:
    size = math.prod(e for _, e in a.layout)
    shape = (2 * size,) * a.ndim
    ranks = evaluated_ranks([a.layout, b.layout], size)
    cost_to_a = sum(conversion_bytes(b, a, shape, 1, r) for r in ranks)
    cost_to_b = sum(conversion_bytes(a, b, shape, 1, r) for r in ranks)
    return cost_to_b < cost_to_a


#: :func:`meeting`'s choices, per pair of placements (equality ignores the dims' names, and so
#: does the choice: it keeps the operand itself)
_MEETS_AT_B: BoundedMemo[bool] = BoundedMemo(1 << 14)


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


class _Scaled(nn.Module):
    """Parameters used directly in ops: a layer scale (viewed, indexed) and a positional term
    ``[1, C, H, W]``, each sliced to the activation's blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.gamma = nn.Parameter(torch.ones(4))
        self.pos = nn.Parameter(torch.zeros(1, 4, 7, 6))

    def forward(self, x: Any) -> Any:
        y = self.conv(x * self.gamma.view(1, -1, 1, 1) + self.pos)
        return y.mul(self.gamma[:, None, None])


class _Cat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: Any) -> Any:
        return torch.cat([x, self.conv(x)], 1)


class _Stack(nn.Module):
    """An FPN decoder's merge, ``torch.stack(features).sum(0)`` (the samples behind the new
    dim, then back), and a stack behind the channels reduced by a maximum."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 1)
        self.c = nn.Conv2d(4, 4, 1)

    def forward(self, x: Any) -> Any:
        y = torch.stack([x, self.a(x), self.b(x)]).sum(dim=0)
        return torch.stack((y, self.c(y).relu()), dim=2).amax(2) * 0.5
