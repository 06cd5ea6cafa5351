"""A value broadcast or repeated to more elements: ``x.expand(*sizes)``, ``x.broadcast_to(s)``,
``x.expand_as(y)``, ``x.repeat(*factors)``, ``x.tile(dims)`` / ``torch.tile(x, dims)``.

The sizes a model gives are the global ones (:mod:`distconv.ops.sizes`: ``B = x.shape[0]`` is
the global batch on every rank), so run as written each rank would make the global value. Here
each rank makes its own block of it instead. Every output dim the op leaves alone (``-1``, a
repeat factor of 1, a size read from the same dim of the input itself) keeps the input's entry:
nothing moves. Every dim it grows is whole in the input (an allgather where it was split,
priced as the conversion it is) and, in the output, split like the dim its size is read from
where that is a dim of a placed value on the same grid (a ViT's class token
``cls_token.expand(x.shape[0], -1, -1)`` is ``[o_N,*,*]`` where ``x`` holds the samples as
``[o_N,*,*]``: each rank expands to its own samples' count, and ``torch.cat`` with ``x`` moves
nothing), else whole. The local block is the expansion (a view) narrowed to the rank's block
of the output's Dist on its grid (:class:`_Grow`, built per node). Its adjoint is local: the
sum over the expanded rows of the block, a pending sum over the grid dims that split them where
the input is replicated (the sum convention); a parameter's gradient is completed by the
replicated parameters' all-rank sum.

``x.expand_as(y)`` takes ``y``'s placement: ``x`` is converted to it, the dims it broadcasts
over whole (:func:`~distconv.ops.elementwise.broadcast_need`), and each rank expands its block
to ``y``'s. Refused by name: growing the samples' dim of an activation.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from distconv.distribution import Dist
from distconv.ops.base import SAMPLE_GRIDS, VOLUME_GRIDS, Handler, Sample
from distconv.ops.elementwise import is_constant
from distconv.ops.shape import model_tensor
from distconv.ops.sizes import is_size
from distconv.parallel.placement import Placement
from distconv.parallel.steps import samples_of

__all__ = ["ExpandHandler", "size_source"]

_GROW = frozenset({"expand", "broadcast_to", "repeat", "tile"})


def size_source(a: Any) -> tuple[fx.Node, int] | None:
    """``(value, dim)`` where ``a`` reads the global size of one dim of a traced value
    (``x.shape[i]``, ``x.size(i)``, ``x.size()[i]``, ``len(x)``), else None."""
    if not isinstance(a, fx.Node):
        return None
    if a.op == "call_method" and a.target == "size" and len(a.args) + len(a.kwargs) == 2:
        dim = a.kwargs.get("dim", a.args[1] if len(a.args) > 1 else None)
        return (a.args[0], dim) if isinstance(dim, int) else None
    if a.op == "call_function" and a.target is len and isinstance(a.args[0], fx.Node):
        return a.args[0], 0
    if a.op == "call_function" and a.target is operator.getitem and isinstance(a.args[1], int):
        s = a.args[0]
        if isinstance(s, fx.Node) and (
                (s.op == "call_method" and s.target == "size" and len(s.args) == 1
                 and not s.kwargs)
                or (s.op == "call_function" and s.target is getattr and s.args[1] == "shape")):
            return s.args[0], a.args[1]
    return None


def _name(node: fx.Node) -> str:
    return str(node.target) if node.op == "call_method" else node.target.__name__


def _sizes(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The sizes (expand, broadcast_to) or factors (repeat, tile) of a call, as a list."""
    rest = list(args[1:])
    if not rest:
        rest = [kwargs.get("size", kwargs.get("dims", kwargs.get("repeats", ())))]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        rest = list(rest[0])
    return rest


def _layout(ndim: int, sizes: list[Any], name: str) -> tuple[int, list[Any]]:
    """``(offset, per-output-dim size or factor)``: how many new leading dims the op adds
    (tile pads short factors with leading 1s, as torch does)."""
    if name == "tile" and len(sizes) < ndim:
        sizes = [1] * (ndim - len(sizes)) + sizes
    return len(sizes) - ndim, sizes


class ExpandHandler(Handler):
    """``expand`` / ``broadcast_to`` / ``expand_as`` / ``repeat`` / ``tile`` (methods, and
    ``torch.tile`` / ``torch.broadcast_to``): see the module docstring. The expanded dims' blocks
    are cut from the global sizes on the grid (:class:`_Grow`); ``expand_as`` runs as written on
    the blocks of its two operands."""

    functions = frozenset({torch.tile, torch.broadcast_to})
    methods = frozenset({"expand", "expand_as", "broadcast_to", "repeat", "tile"})
    samples_anywhere = True
    layer_operands = True

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import LayerSpec, Step

        x = node.args[0]
        if not isinstance(x, fx.Node) or an.out.get(x) is None:
            an.fail(node, f"call {_name(node)} on a tensor of the graph: here it takes a value "
                    "that is not one")
        if is_constant(node) and not any(is_size(a) for a in node.all_input_nodes):
            return model_tensor(an, node)  # a model tensor expanded by numbers: whole
        name = _name(node)
        if name == "expand_as":
            return self._expand_as(an, node, x)
        constant = is_constant(x)
        p = an.placement(x) if constant else an.placement(x).settled()
        offset, sizes = _layout(p.ndim, _sizes(name, node.args, node.kwargs), name)
        if offset < 0:
            an.fail(node, f"give {name} at least {p.ndim} sizes, one per dim of the value: "
                    f"{name} with {len(sizes)} sizes of a {p.ndim}-dim value", ValueError)
        kept = [d >= offset and self._keeps(name, sizes[d], x, d - offset)
                for d in range(len(sizes))]
        x_samples = None if constant else samples_of(x)[0] + offset
        if x_samples is not None and not kept[x_samples]:
            an.fail(node, f"Expand or repeat the samples outside the model: {name} grows dim "
                    f"{x_samples - offset}, which holds the samples (each rank holds a block "
                    "of them); the parallel model's output rows are its samples")
        entries: list[Any] = [p.dist.entries[d - offset] if kept[d] else None
                              for d in range(len(sizes))]
        layout = p.layout
        samples = x_samples if x_samples is not None else 0
        sources = [size_source(s) if name in ("expand", "broadcast_to") else None for s in sizes]
        if constant:  # a model tensor grown to a value's sizes: on that value's grid
            layout = next((an.placement(a).layout for a, _ in filter(None, sources)
                           if an.out.get(a) is not None and not is_constant(a)), layout)
        used = {g for e in entries for g in Dist((e,)).used()}
        for d, src in enumerate(sources):
            if kept[d] or src is None or an.out.get(src[0]) is None or is_constant(src[0]):
                continue
            a, k = src
            pa = an.placement(a).settled()
            grid_dims = pa.dist.grid_dims_of(k)
            if pa.layout != layout or used & set(grid_dims):
                continue  # another grid, or its grid dims taken: whole
            entries[d] = pa.dist.entries[k]
            used |= set(grid_dims)
            if constant and samples_of(a)[0] == k:
                samples = d
        need = p if constant else Placement(p.layout, Dist(tuple(
            p.dist.entries[i] if kept[i + offset] else None for i in range(p.ndim))))
        out = Placement(layout, Dist(tuple(entries)))
        node.meta[_KEPT] = tuple(kept)
        return Step(node, "pointwise", out, {x: need},
                    LayerSpec("expand", node.name, layout, input=need), samples=samples)

    @staticmethod
    def _keeps(name: str, size: Any, x: fx.Node, i: int) -> bool:
        """Whether the op leaves input dim ``i`` alone whatever the input's shape."""
        if name in ("repeat", "tile"):
            return isinstance(size, int) and size == 1
        return (isinstance(size, int) and size == -1) or size_source(size) == (x, i)

    def _expand_as(self, an: Any, node: Any, x: fx.Node) -> Any:
        from distconv.parallel.steps import Step

        y = node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
        if not isinstance(y, fx.Node) or an.out.get(y) is None or is_constant(y):
            an.fail(node, "Expand to a value of the model instead: expand_as of a model tensor's "
                    "or a non-tensor's shape is not supported")
        py = an.placement(y).settled()
        px = an.placement(x)
        offset = py.ndim - px.ndim
        if offset < 0:
            an.fail(node, f"give expand_as a value of at least {px.ndim} dims: expand_as of a "
                    f"{px.ndim}-dim value to a {py.ndim}-dim one", ValueError)
        if not is_constant(x) and samples_of(x)[0] + offset != samples_of(y)[0]:
            an.fail(node, "Move the samples to the same dim first: its operands hold the "
                    f"samples in dims {samples_of(x)[0]} and {samples_of(y)[0]}")
        need = Placement(py.layout, Dist(py.dist.entries[offset:]))
        return Step(node, "pointwise", py, {x: need, y: py}, samples=samples_of(y)[0])

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        if step.layer is None:
            return None
        return _Grow(_name(node), node.meta[_KEPT], step.out.dist, grid)

    def operands(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(_sizes("", args, kwargs))

    def samples(self) -> Sequence[Sample]:
        return (
            Sample("class-token-expand-cat", lambda: _ClassToken(), (5, 4, 7, 6), SAMPLE_GRIDS),
            Sample("repeat-tile-expand-as", lambda: _Repeats(), (5, 4, 7, 6), SAMPLE_GRIDS),
            Sample("vnet-input-repeat", lambda: _VNetInput(), (5, 1, 4, 3, 4), VOLUME_GRIDS),
        )


#: node.meta key: per output dim of an expand, whether the op leaves the input's dim alone
_KEPT = "distconv_expand_kept"


class _Grow(nn.Module):
    """This rank's block of ``x.expand(*sizes)`` / ``x.repeat(*factors)`` (and ``broadcast_to``,
    ``tile``) from ``x``'s block in the placement the handler asked for: the dims the op leaves
    alone at their local sizes, the grown dims at their global sizes (``x`` is whole there), then
    narrowed to this rank's block of ``out_dist`` on ``grid``. An expansion stays a view."""

    def __init__(self, op: str, kept: tuple[bool, ...], out_dist: Dist, grid: Any) -> None:
        super().__init__()
        self.op, self.kept, self.out_dist, self.grid = op, kept, out_dist, grid
        self._shapes: dict[tuple[Any, ...], tuple[int, ...]] = {}

    def forward(self, x: torch.Tensor, global_shape: Sequence[int], *sizes: Any) -> torch.Tensor:
        key = (tuple(global_shape), sizes)
        out = self._shapes.get(key)
        if out is None:  # the global result's shape, as torch gives it
            probe = torch.empty(tuple(global_shape), device="meta")
            if self.op == "tile":
                out = tuple(torch.tile(probe, tuple(sizes)).shape)
            else:
                out = tuple(getattr(probe, self.op)(*sizes).shape)
            self._shapes[key] = out
        offset = len(out) - x.dim()
        if self.op in ("expand", "broadcast_to"):
            y = x.expand([x.shape[d - offset] if k else n
                          for d, (k, n) in enumerate(zip(self.kept, out))])
        else:
            y = x.repeat([1 if k else n // (x.shape[d - offset] if d >= offset else 1)
                          for d, (k, n) in enumerate(zip(self.kept, out))])
        for d, k in enumerate(self.kept):
            if not k and self.out_dist.grid_dims_of(d):
                start, n = self.out_dist.block(d, out[d], self.grid)
                y = y.narrow(d, start, n)
        return y

    def extra_repr(self) -> str:
        return f"{self.op}, out={self.out_dist}"


class _ClassToken(nn.Module):
    """A ViT's token stem on a map: patches as tokens (``[N, HW, C]``), a class token expanded
    to the batch (``B = x.shape[0]``) and joined in front, a positional embedding added, and
    the head over the class token and the mean of the others."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 4, 1)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 4))
        self.pos_embed = nn.Parameter(torch.zeros(1, 43, 4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: Any) -> Any:
        t = self.stem(x).flatten(2).transpose(1, 2)
        B = t.shape[0]
        t = torch.cat((self.cls_token.expand(B, -1, -1), t), dim=1) + self.pos_embed
        return self.head(t[:, 0] * t[:, 1:].mean(1))


class _Repeats(nn.Module):
    """A channel repeat and a tile of a split map (grown dims gathered), a gate broadcast with
    ``expand_as``, and a parameter expanded to the rows of the map (split like them)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 2, 1)
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.row = nn.Parameter(torch.zeros(1, 4, 1, 6))
        self.head = nn.Linear(4, 3)

    def forward(self, x: Any) -> Any:
        s = self.stem(x)
        y = self.conv(s) + s.repeat(1, 2, 1, 1) * torch.tile(s, (2, 1, 1))
        g = torch.sigmoid(y.mean((2, 3), keepdim=True)).expand_as(y)
        r = self.row.expand(-1, -1, y.size(2), -1)
        return self.head((y * g + r).mean((2, 3)))


class _VNetInput(nn.Module):
    """MONAI VNet's input transition: a convolution of the one-channel volume plus the input
    repeated over the convolution's channels."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Any) -> Any:
        y = torch.relu(self.conv(x) + x.repeat(1, 4, 1, 1, 1))
        return self.head(y.mean((2, 3, 4)))
