"""Taking a value apart along one dim: ``x.unbind(d)`` / ``torch.unbind(x, d)``, as an attention
block takes its query, key and value from their stacked axis (``q, k, v = qkv.unbind(0)``).

The node's value is the tuple of slices; the walk places it as its input, the unbound dim made
whole (an allgather over the grid dims that split it, priced as the conversion it is; nothing
moves where it is whole, as the stacked axis is). Each slice, taken from the tuple by
``operator.getitem`` (:mod:`distconv.ops.index`), keeps the other dims' splits, the samples
included, wherever they are (``Step.samples``). Refused by name: unbinding the samples' dim,
and the tuple used other than by taking its items (``torch.stack(x.unbind(1))``).
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

__all__ = ["UnbindHandler", "unbound_dim"]

_UNBIND = frozenset({torch.unbind, "unbind"})


def unbound_dim(node: Any, ndim: int) -> int | None:
    """The dim ``node`` unbinds (of an input of ``ndim`` dims), or None where it is no unbind."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method") or (
            node.target not in _UNBIND):
        return None
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    return dim % ndim if isinstance(dim, int) else None


class UnbindHandler(Handler):
    functions = frozenset({torch.unbind})
    methods = frozenset({"unbind"})
    samples_anywhere = True

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import Step

        args = an.tensor_args(node)
        if len(args) != 1 or node.args[0] is not args[0]:
            an.fail(node, "give it one tensor input (its other arguments as numbers): it "
                    f"takes {len(args)}")
        p = an.placement(args[0]).settled()
        dim = unbound_dim(node, p.ndim)
        if dim is None:
            an.fail(node, "give the dim as an int: it unbinds dim "
                    f"{node.kwargs.get('dim', node.args[1:])!r}", TypeError)
        for user in node.users:  # the tuple is placed as its input: only its items are values
            if user.target is not operator.getitem or not isinstance(user.args[1], int):
                an.fail(node, "take its items (q, k, v = x.unbind(0), or x.unbind(0)[i]), each a "
                        f"value of its own: its tuple is used whole by node {user.name!r}")
        samples = samples_of(args[0])[0]
        if dim == samples:
            an.fail(node, "unbind another dim, or take the samples apart in the plain model's "
                    f"input: it unbinds the samples (dim {dim}), giving one value per sample, and "
                    "the parallel model's values keep their samples")
        need = Placement(p.layout, Dist(tuple(None if d == dim else e
                                              for d, e in enumerate(p.dist.entries))))
        return Step(node, "pointwise", need, {args[0]: need}, samples=samples)

    def samples(self) -> Sequence[Sample]:
        return (Sample("unbind-stacked", lambda: SampleNet(_Unbound(), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),)


class _Unbound(nn.Module):
    """Three maps stacked on a leading axis, the samples moved behind it, taken apart by
    ``unbind(0)`` and combined; then ``torch.unbind`` of the channels (split under
    stationary-x: made whole first), each slice a map of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 12, 1)

    def forward(self, x: Any) -> Any:
        n, _, h, w = x.shape
        s = self.conv(x).reshape(n, 3, 4, h, w).permute(1, 0, 2, 3, 4)  # [3, N, C, H, W]
        q, k, v = s.unbind(0)
        y = q * k + v
        parts = torch.unbind(y, dim=1)  # 4 maps [N, H, W]
        return y + torch.sigmoid(parts[0] - parts[3] * parts[1])[:, None]
