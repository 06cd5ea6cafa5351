"""Shape ops: ``flatten`` / ``view`` / ``reshape`` of the features act on local rows, so every
dim but the samples is replicated first (sizes and attribute reads: :mod:`distconv.ops.sizes`)."""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
from torch import nn

from distconv.distribution import Dist
from distconv.ops.base import SAMPLE_GRIDS, Handler, Sample
from distconv.parallel.placement import Placement

__all__ = ["FlattenHandler", "NewAxisHandler", "ReshapeHandler"]


def to_samples(an: Any, node: Any, arg: Any, out_ndim: int) -> Any:
    """Every dim but the samples replicated (flatten, view, reshape act on local rows)."""
    from distconv.parallel.graph import Step

    p = an.placement(arg)
    need = Placement(p.layout, Dist((p.dist.entries[0],) + (None,) * (p.ndim - 1)))
    out = Placement(p.layout, Dist((p.dist.entries[0],) + (None,) * (out_ndim - 1)))
    return Step(node, "reshape", out, {arg: need})


class FlattenHandler(Handler):
    modules = (nn.Flatten,)
    functions = frozenset({torch.flatten})
    methods = frozenset({"flatten"})

    def place(self, an: Any, node: Any, module: Any) -> Any:
        if module is not None:
            start, end = module.start_dim, module.end_dim
        else:
            start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0)
            end = node.kwargs.get("end_dim", node.args[2] if len(node.args) > 2 else -1)
        args = an.tensor_args(node)
        ndim = an.placement(args[0]).ndim
        start, end = start % ndim, end % ndim
        if start != 1 or end != ndim - 1:
            an.fail(node, f"flatten(start_dim={start}, end_dim={end}) is not supported; only "
                    "flattening every dim after the samples (start_dim=1) is")
        return to_samples(an, node, args[0], 2)

    def samples(self) -> Sequence[Sample]:
        return (Sample("flatten-head", lambda: _FlatNet(), (5, 4, 4, 4), SAMPLE_GRIDS),)


class ReshapeHandler(Handler):
    functions = frozenset({torch.reshape})
    methods = frozenset({"view", "reshape"})

    def place(self, an: Any, node: Any, module: Any) -> Any:
        rest = node.args[1:]
        ndim = len(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else len(rest)
        return to_samples(an, node, node.args[0], ndim)

    def samples(self) -> Sequence[Sample]:
        return (Sample("view-head", lambda: _ViewNet(), (5, 4, 4, 4), SAMPLE_GRIDS),)


class NewAxisHandler(Handler):
    """Size-1 dims added to a value: ``s[:, :, None, None]``, ``s[..., None]``,
    ``s.unsqueeze(d)`` (e.g. a squeeze-and-excitation gate made broadcastable). No data moves:
    every rank's block gains the same size-1 dims, which no grid dim splits. Indexing that picks
    elements (integers, ranges, tensors) is refused by name; an index into something that is not
    a placed tensor (a tuple, a shape) carries no value to place."""

    functions = frozenset({operator.getitem, torch.unsqueeze})
    methods = frozenset({"unsqueeze"})

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.graph import Step

        args = an.tensor_args(node)
        if not args or node.args[0] is not args[0]:
            return Step(node, "meta", None)  # an index into a shape or a tuple of values
        p = an.placement(args[0])
        entries = list(p.dist.entries)
        if node.target == operator.getitem:
            index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            whole = slice(None, None, None)
            if any(i is not None and i is not Ellipsis and i != whole for i in index) or (
                    sum(i is Ellipsis for i in index) > 1):
                an.fail(node, f"indexing with {node.args[1]!r} picks elements; only adding "
                        "size-1 dims (None with ':' and '...') is supported. Slice the plain "
                        "model's input, or reduce (mean, sum) instead")
            taken = sum(i == whole for i in index if i is not None and i is not Ellipsis)
            if taken > len(entries):
                an.fail(node, f"index {node.args[1]!r} has more dims than the value's "
                        f"{len(entries)}")
            out: list[Any] = []
            rest = iter(entries)
            for i in index:
                if i is None:
                    out.append(None)
                elif i is Ellipsis:
                    out.extend(next(rest) for _ in range(len(entries) - taken))
                else:
                    out.append(next(rest))
            out.extend(rest)
        else:
            dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
            if not isinstance(dim, int):
                an.fail(node, f"unsqueeze needs an int dim, got {dim!r}")
            out = entries[:]
            out.insert(dim % (len(entries) + 1), None)
        placed = Placement(p.layout, Dist(tuple(out), p.dist.pending))
        return Step(node, "pointwise", placed, {args[0]: p})

    def samples(self) -> Sequence[Sample]:
        return (Sample("excite-new-axes", lambda: _Gate(), (5, 4, 7, 6), SAMPLE_GRIDS),)


class _Gate(nn.Module):
    """A squeeze-and-excitation gate: the channel means through a Linear, back as [N, C, 1, 1]
    by indexing with None, and a spatial gate [N, 1, H, W] by unsqueeze."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Any) -> Any:
        x = self.stem(x)
        s = torch.sigmoid(self.fc(x.mean((2, 3))))
        x = x * s[:, :, None, None] * torch.sigmoid(x.mean(1)).unsqueeze(1)
        return self.head(x[..., None].mean((2, 3, 4)))


class _FlatNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 4, 1)
        self.head = nn.Linear(64, 3)

    def forward(self, x: Any) -> Any:
        return self.head(torch.flatten(self.stem(x), 1))


class _ViewNet(_FlatNet):
    def forward(self, x: Any) -> Any:
        y = self.stem(x)
        return self.head(y.view(y.size(0), -1))
