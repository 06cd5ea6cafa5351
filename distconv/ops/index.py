"""Indexing a value (``x[...]``): integers on dims other than the samples (``qkv[0]``, an
attention block's query, key and value taken from their stacked axis; ``x[:, 0]``, a ViT's class
token), slices (``:``, and partial ones: ``x[:, 1:]``, the tokens after the class token;
``x[..., :k]``; ``x[:, ::2]``), ``...`` and new size-1 dims (``None``: a squeeze-and-excitation
gate made broadcastable, ``s[:, :, None, None]``).

Each kept dim keeps its entry and each new dim is whole, so no data moves where the integers
and partial slices index whole dims: every rank takes the same elements of its block. An integer
on a split dim is taken by the rank whose block holds it; the others give zeros, and the result
is a pending sum over the grid dims that split that dim (``x[:, 0]`` of tokens split over H is
``Σ_H [o_N,*]``: completed by the consumer, an allreduce of the picked elements instead of an
allgather of the dim). A partial slice on a split dim makes that dim whole first (an allgather
over the grid dims that split it, priced as the conversion it is), then each rank takes the
elements: exact for any slice and any (uneven) blocks; the sliced dim is whole in the result.
The samples' dim
(``Step.samples``) moves to where the kept dims put it. An integer ``i`` into the tuple
``x.unbind(d)`` returns (:mod:`distconv.ops.unbind`) is placed as ``x`` indexed by ``i`` at dim
``d``; an item of ``nn.MultiheadAttention``'s ``(attn_output, attn_weights)`` as
:func:`distconv.ops.mha.tuple_item` places it. Refused by name: an integer or a partial
slice on the samples' dim (it picks samples), a new dim before the samples, and tensors or lists
as indices.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from distconv.distribution import Dist
from distconv.ops.base import SAMPLE_GRIDS, Handler, Sample, SampleNet
from distconv.ops.elementwise import is_constant
from distconv.ops.mha import tuple_item
from distconv.ops.shape import model_tensor
from distconv.ops.unbind import unbound_dim
from distconv.parallel.placement import Placement
from distconv.parallel.steps import samples_of

__all__ = ["IndexHandler", "indexed_dims", "sliced_dims"]

_WHOLE = slice(None, None, None)


def sliced_dims(index: Any, ndim: int) -> list[int]:
    """The input dims a partial slice of ``x[index]`` picks part of (``1:``, ``:k``, ``::2``;
    not ``:``), for a valid index (:func:`indexed_dims`)."""
    items = index if isinstance(index, tuple) else (index,)
    taken = sum(item is not None and item is not Ellipsis for item in items)
    found, dim = [], 0
    for item in items:
        if item is Ellipsis:
            dim += ndim - taken
        elif item is not None:
            if isinstance(item, slice) and item != _WHOLE:
                found.append(dim)
            dim += 1
    return found


def indexed_dims(index: Any, ndim: int) -> tuple[list[int | None], list[int]]:
    """For ``x[index]`` of a value of ``ndim`` dims: the input dim each output dim keeps (None:
    a new size-1 dim; a partially sliced dim is kept, :func:`sliced_dims` names it) and the input
    dims an integer drops. Raises ``TypeError`` for an item other than an int, ``None``, ``...``
    or a slice, ``ValueError`` for more items than dims."""
    items = index if isinstance(index, tuple) else (index,)
    for item in items:
        if not (item is None or item is Ellipsis or isinstance(item, slice)
                or (isinstance(item, int) and not isinstance(item, bool))):
            raise TypeError(f"{item!r} is not an int, None, '...' or a slice")
    if sum(item is Ellipsis for item in items) > 1:
        raise ValueError("an index has at most one '...'")
    taken = sum(item is not None and item is not Ellipsis for item in items)
    if taken > ndim:
        raise ValueError(f"it indexes {taken} dims of a value of {ndim}")
    kept: list[int | None] = []
    dropped: list[int] = []
    dim = 0
    for item in (*items, Ellipsis) if Ellipsis not in items else items:
        if item is None:
            kept.append(None)
        elif item is Ellipsis:
            kept.extend(range(dim, dim + ndim - taken))
            dim += ndim - taken
        else:
            (kept if isinstance(item, slice) else dropped).append(dim)
            dim += 1
    return kept, dropped


class IndexHandler(Handler):
    """``x[index]`` of a placed value (module-free: ``operator.getitem``): see the module
    docstring. An index into something that is not a placed tensor (a tuple of values a module
    returned) carries no value to place."""

    functions = frozenset({operator.getitem})
    samples_anywhere = True

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import LayerSpec, Step

        args = an.tensor_args(node)
        item = tuple_item(an, args[0], node.args[1]) if args and node.args[0] is args[0] else None
        if item is not None:  # an item of nn.MultiheadAttention's (attn_output, attn_weights)
            placed, samples = item
            if placed is None:
                return Step(node, "meta", None)  # attn_weights with need_weights=False: None
            return Step(node, "pointwise", placed, {}, samples=samples)  # the local item
        if not args or node.args[0] is not args[0]:
            return Step(node, "meta", None)  # an index into a shape or a tuple of values
        arg, index = args[0], node.args[1]
        if is_constant(arg):
            return model_tensor(an, node)  # a parameter's or buffer's element or dims
        p = an.placement(arg)
        if unbound_dim(arg, p.ndim) is not None:  # a slice of an unbind's tuple
            index = (slice(None),) * unbound_dim(arg, p.ndim) + (index,)
        try:
            kept, dropped = indexed_dims(index, p.ndim)
        except TypeError as exc:
            an.fail(node, "slice the plain model's input, or reduce (mean, sum) instead: "
                    f"indexing with {index!r} picks elements ({exc}); supported: integers and "
                    "slices on dims other than the samples, and adding size-1 dims (None with "
                    "slices and '...')")
        except ValueError as exc:
            an.fail(node, "index with at most one item per dim and one '...': index "
                    f"{index!r}: {exc}")
        samples = samples_of(arg)[0]
        if samples in dropped:
            an.fail(node, f"index the plain model's input instead: the index {index!r} picks "
                    f"one sample (dim {samples} holds the samples)")
        if samples in sliced_dims(index, p.ndim):
            an.fail(node, f"Slice the plain model's input instead: the index {index!r} picks "
                    f"part of the samples (dim {samples} holds them; each rank holds a block "
                    "of them, and the parallel model's output rows are its samples)")
        out_samples = kept.index(samples)
        if any(k is None for k in kept[:out_samples]):
            an.fail(node, f"put new dims behind the samples (dim {samples}): it adds a dim "
                    "before the samples, and the parallel model's output rows are its samples "
                    "and its layers find them there")
        entries = p.dist.entries
        picked = [d for d in dropped if entries[d] is not None]  # taken by their owners
        if picked and (unbound_dim(args[0], p.ndim) is not None or _traced_items(index)):
            picked = []  # an unbind's tuple, or an index the graph computes: gathered
        whole = set(sliced_dims(index, p.ndim)) | (set(dropped) - set(picked))
        if any(entries[d] is not None for d in whole):  # make the indexed dims whole first
            p = Placement(p.layout, Dist(tuple(None if d in whole else e
                                               for d, e in enumerate(entries))))
        pending = p.dist.pending | {g for d in picked for g in p.dist.grid_dims_of(d)}
        out = Placement(p.layout, Dist(tuple(None if k is None else p.dist.entries[k]
                                             for k in kept), pending))
        layer = LayerSpec("pick", node.name, p.layout, input=p) if picked else None
        node.meta[_PICKED] = tuple(picked)
        return Step(node, "pointwise", out, {arg: p}, layer, samples=out_samples)

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        if step.layer is None:
            return None
        return _Pick(node.args[1], node.meta[_PICKED], step.layer.input.dist, grid)

    def samples(self) -> Sequence[Sample]:
        return (Sample("index-stacked", lambda: SampleNet(_Stacked(), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),
                Sample("partial-slices", lambda: SampleNet(_Slices(), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS))


#: node.meta key: the split dims whose integer index their owners take (a pending sum)
_PICKED = "distconv_picked"


def _traced_items(index: Any) -> bool:
    """Whether an item of ``index`` is a value of the graph (a size it computes)."""
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(v, fx.Node) for item in items
               for v in ((item.start, item.stop, item.step) if isinstance(item, slice)
                         else (item,)))


class _Owned(torch.autograd.Function):
    """Forward: ``x[index]`` where this rank's block holds the picked elements, else zeros of its
    shape (``owned`` False). Backward: the cotangent put back at ``index`` in zeros of ``x``'s
    shape, or zeros. Every rank stays on the graph either way (its consumers' collectives run
    their adjoints on every rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: tuple, owned: bool,
                shape: tuple[int, ...]) -> torch.Tensor:
        ctx.index, ctx.owned, ctx.in_shape = index, owned, x.shape
        return x[index].clone() if owned else x.new_zeros(shape)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        gx = g.new_zeros(ctx.in_shape)
        if ctx.owned:
            gx[ctx.index] = g
        return gx, None, None, None


class _Pick(nn.Module):
    """This rank's part of ``x[index]`` where integers index split dims (``picked``): each such
    integer made local to the rank's block of ``in_dist`` on ``grid`` (its owner takes the
    elements, the others give zeros: a pending sum over those grid dims)."""

    def __init__(self, index: Any, picked: tuple[int, ...], in_dist: Dist, grid: Any) -> None:
        super().__init__()
        self.index = index if isinstance(index, tuple) else (index,)
        self.picked, self.in_dist, self.grid = picked, in_dist, grid

    def forward(self, x: torch.Tensor, global_shape: Sequence[int]) -> torch.Tensor:
        ndim = len(global_shape)
        taken = sum(i is not None and i is not Ellipsis for i in self.index)
        local: list[Any] = []
        first: list[Any] = []  # the same index with 0 on the picked dims: the result's shape
        owned, dim = True, 0
        for item in self.index:
            at = item
            if item is Ellipsis:
                dim += ndim - taken
            elif item is not None:
                if dim in self.picked:
                    start, n = self.in_dist.block(dim, global_shape[dim], self.grid)
                    i = item % global_shape[dim] - start
                    owned = owned and 0 <= i < n
                    item, at = (i if 0 <= i < n else 0), 0
                dim += 1
            local.append(item)
            first.append(at)
        probe = torch.empty([1 if d in self.picked else k for d, k in enumerate(x.shape)],
                            device="meta")
        return _Owned.apply(x, tuple(local), owned, tuple(probe[tuple(first)].shape))

    def extra_repr(self) -> str:
        return f"index={self.index}, picked={self.picked}, in={self.in_dist}"


class _Stacked(nn.Module):
    """Three maps stacked on a leading axis, the samples moved behind it (as an attention
    block stacks query, key and value), taken apart by integers and combined; then an integer
    on the channels (split under stationary-x: made whole first), one on the rows of a
    new-axis view, and a parameter's row (a model tensor, whole on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 12, 1)
        self.scale = nn.Parameter(torch.rand(2, 4, 1, 1))

    def forward(self, x: Any) -> Any:
        n, _, h, w = x.shape
        s = self.conv(x).reshape(n, 3, 4, h, w).permute(1, 0, 2, 3, 4)  # [3, N, C, H, W]
        y = s[0] * s[1] + s[-1] * self.scale[1]
        g = y[:, 1][:, None, ..., None]  # [N, 1, H, W, 1]
        return y + torch.sigmoid(g[..., 0] + y[:, :, 2, None])


class _Slices(nn.Module):
    """Partial slices of rows (split under a spatial config: gathered first), of channels with a
    step over the columns, a row taken by an integer (its owner's: a pending sum, indexed again
    before it is completed), and slices of the results."""

    def forward(self, x: Any) -> Any:
        a = x[:, :, 1:]  # [N, C, 6, 6]
        b = x[:, 1:3, :, ::2]  # [N, 2, 7, 3]
        c = x[:, :, 5]  # [N, C, 6]: the second row block's
        return a[:, :, :4] * c[:, :, None, :] + b.mean((1, 3), keepdim=True)[:, :, -4:]
