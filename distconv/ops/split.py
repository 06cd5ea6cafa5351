"""Cutting a value into pieces along one dim: ``x.chunk(k, d)``, ``x.split(sizes, d)``,
``x.tensor_split(indices, d)`` and their ``torch.*`` forms (ShuffleNetV2's channel split
``x1, x2 = x.chunk(2, dim=1)``; CSPNet's ``x.split(c, dim=1)``; a parallel block's
``torch.split(y, sizes, dim=-1)``).

The node's value is the tuple of pieces; the walk places it as its input with the cut dim whole
on every rank (an allgather over the grid dims that split it, priced as the conversion it is;
nothing moves where it is whole, as the channels are under sample and spatial parallelism, and
a single chunk keeps its split). Each rank then cuts its block as one process cuts the whole
value: the cut dim is whole, so the pieces' sizes are the global ones. A piece, taken from the
tuple by ``operator.getitem`` (an int), keeps the other dims' splits, the samples included,
wherever they are. A piece's own balanced blocks never coincide with the pieces of the input's
blocks (each rank's block of a split dim is one run of it), so a split dim is made whole rather
than kept. Refused by name: cutting the samples' dim, the tuple used other than by taking its
items (``torch.cat(x.chunk(2, 1))``), a dim or sizes that are not numbers.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from distconv.distribution import Dist
from distconv.ops.base import SAMPLE_GRIDS, Handler, Sample, SampleNet
from distconv.parallel.placement import Placement
from distconv.parallel.steps import samples_of

__all__ = ["SplitHandler", "is_split"]

_FUNCTIONS = frozenset({torch.chunk, torch.split, torch.tensor_split})
_METHODS = frozenset({"chunk", "split", "tensor_split"})
#: the keyword of the pieces' count, sizes or indices (positional: the second argument)
_PIECES = ("chunks", "split_size_or_sections", "split_size", "indices_or_sections", "sections",
           "indices", "tensor_indices_or_sections")


def is_split(node: Any) -> bool:
    """Whether ``node`` cuts a value into a tuple of pieces (chunk, split, tensor_split)."""
    return isinstance(node, fx.Node) and (
        (node.op == "call_function" and node.target in _FUNCTIONS)
        or (node.op == "call_method" and node.target in _METHODS))


class SplitHandler(Handler):
    """See the module docstring; also binds ``operator.getitem`` of such a tuple (before
    :class:`~distconv.ops.index.IndexHandler`, which binds the other indexing)."""

    functions = _FUNCTIONS
    methods = _METHODS
    samples_anywhere = True

    def binds(self, node: fx.Node, module: nn.Module | None) -> bool:
        if node.op == "call_function" and node.target is operator.getitem:
            return bool(node.args) and is_split(node.args[0])
        return super().binds(node, module)

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import Step

        if node.target is operator.getitem:  # a piece: where the tuple is
            piece = node.args[0]
            p = an.placement(piece)
            return Step(node, "pointwise", p, {piece: p}, samples=samples_of(piece)[0])
        args = an.tensor_args(node)
        what = node.target if isinstance(node.target, str) else node.target.__name__
        if len(args) != 1 or node.args[0] is not args[0]:
            an.fail(node, f"give {what}'s sizes or indices as numbers; here {len(args)} tensors "
                    "are operands", TypeError)
        p = an.placement(args[0]).settled()
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
        if not isinstance(dim, int) or isinstance(dim, bool):
            an.fail(node, f"give {what}'s dim as an int, got {dim!r}", TypeError)
        dim %= p.ndim
        samples = samples_of(args[0])[0]
        if dim == samples:
            an.fail(node, "cut another dim, or cut the batch in the plain model's input: "
                    f"{what} along the samples (dim {dim}) cuts the batch, whose pieces the ranks "
                    "hold in other blocks")
        for user in node.users:  # the tuple is placed as its input: only its items are values
            if user.target is not operator.getitem or not isinstance(user.args[1], int):
                an.fail(node, f"take the items of {what}'s tuple (a, b = x.{what}(...), or "
                        f"x.{what}(...)[i]), each a value of its own; node {user.name!r} uses "
                        "the tuple whole")
        pieces = next((node.kwargs[k] for k in _PIECES if k in node.kwargs),
                      node.args[1] if len(node.args) > 1 else None)
        keep = what == "chunk" and pieces == 1  # one chunk: the value itself
        need = p if keep else Placement(p.layout, Dist(tuple(
            None if d == dim else e for d, e in enumerate(p.dist.entries))))
        return Step(node, "split", need, {args[0]: need}, samples=samples)

    def samples(self) -> Sequence[Sample]:
        return (Sample("chunk-split", lambda: SampleNet(_Pieces(), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),)


class _Pieces(nn.Module):
    """ShuffleNetV2's channel split (a branch on the second half, joined back), a split by
    sizes along the channels, a tensor_split along the rows (split under spatial parallelism:
    made whole first) and chunks of the columns."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x: Any) -> Any:
        x1, x2 = x.chunk(2, dim=1)
        y = torch.cat((x1, self.branch(x2)), dim=1)
        a, b = torch.split(y, [1, 3], dim=1)
        y = torch.cat((b, a * 2), dim=1)
        top, bottom = torch.tensor_split(y, (3,), dim=2)
        left = y.chunk(3, dim=-1)[0]
        return (top.sum(2, keepdim=True) + bottom.amax(2, keepdim=True)
                + left.mean(3, keepdim=True) * torch.chunk(y, 1, 1)[0].mean((2, 3), True))
