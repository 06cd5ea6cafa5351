"""Indexing a value (``x[...]``): integers on dims other than the samples (``qkv[0]``, an
attention block's query, key and value taken from their stacked axis), whole slices (``:``),
``...`` and new size-1 dims (``None``: a squeeze-and-excitation gate made broadcastable,
``s[:, :, None, None]``).

Each kept dim keeps its entry and each new dim is whole, so no data moves where the integers
index whole dims: every rank takes the same element of its block. An integer on a split dim
makes that dim whole first (an allgather over the grid dims that split it, priced as the
conversion it is), then each rank takes the element. The samples' dim (``Step.samples``) moves
to where the kept dims put it. An integer ``i`` into the tuple ``x.unbind(d)`` returns
(:mod:`distconv.ops.unbind`) is placed as ``x`` indexed by ``i`` at dim ``d``; an item of
``nn.MultiheadAttention``'s ``(attn_output, attn_weights)`` as :func:`distconv.ops.mha.tuple_item`
places it. Refused by name:
an integer that picks one sample, a new dim before the samples, a slice that picks part of a
dim, and tensors or lists as indices.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
from torch import nn

from distconv.distribution import Dist
from distconv.ops.base import SAMPLE_GRIDS, Handler, Sample, SampleNet
from distconv.ops.elementwise import is_constant
from distconv.ops.mha import tuple_item
from distconv.ops.shape import model_tensor
from distconv.ops.unbind import unbound_dim
from distconv.parallel.placement import Placement
from distconv.parallel.steps import samples_of

__all__ = ["IndexHandler", "indexed_dims"]

_WHOLE = slice(None, None, None)


def indexed_dims(index: Any, ndim: int) -> tuple[list[int | None], list[int]]:
    """For ``x[index]`` of a value of ``ndim`` dims: the input dim each output dim keeps (None:
    a new size-1 dim) and the input dims an integer drops. Raises ``TypeError`` for an item
    other than an int, ``None``, ``...`` or ``:``, ``ValueError`` for more items than dims."""
    items = index if isinstance(index, tuple) else (index,)
    for item in items:
        if isinstance(item, slice) and item != _WHOLE:
            raise TypeError(f"the slice {item.start}:{item.stop}:{item.step} picks part of a dim")
        if not (item is None or item is Ellipsis or isinstance(item, slice)
                or (isinstance(item, int) and not isinstance(item, bool))):
            raise TypeError(f"{item!r} is not an int, None, '...' or ':'")
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
        from distconv.parallel.steps import Step

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
            an.fail(node, f"indexing with {index!r} picks elements: {exc}. Supported: integers "
                    "on dims other than the samples, and adding size-1 dims (None with ':' and "
                    "'...'). Slice the plain model's input, or reduce (mean, sum) instead")
        except ValueError as exc:
            an.fail(node, f"index {index!r}: {exc}")
        samples = samples_of(arg)[0]
        if samples in dropped:
            an.fail(node, f"the index {index!r} picks one sample (dim {samples} holds the "
                    "samples); index the plain model's input instead")
        out_samples = kept.index(samples)
        if any(k is None for k in kept[:out_samples]):
            an.fail(node, f"it adds a dim before the samples (dim {samples}); the parallel "
                    "model's output rows are its samples and its layers find them there, so "
                    "new dims go behind it")
        entries = p.dist.entries
        if any(entries[d] is not None for d in dropped):  # make the indexed dims whole first
            p = Placement(p.layout, Dist(tuple(None if d in dropped else e
                                               for d, e in enumerate(entries))))
        out = Placement(p.layout, Dist(tuple(None if k is None else p.dist.entries[k]
                                             for k in kept), p.dist.pending))
        return Step(node, "pointwise", out, {arg: p}, samples=out_samples)

    def samples(self) -> Sequence[Sample]:
        return (Sample("index-stacked", lambda: SampleNet(_Stacked(), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),)


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
