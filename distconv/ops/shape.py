"""Shape ops: ``flatten`` / ``view`` / ``reshape`` of the features act on local rows, so every
dim but the samples is replicated first; ``size()`` / ``dim()`` and attribute reads carry no
value to place."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from distconv.distribution import Dist
from distconv.ops.base import SAMPLE_GRIDS, Handler, Sample
from distconv.parallel.placement import Placement

__all__ = ["FlattenHandler", "MetaHandler", "ReshapeHandler"]


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


class MetaHandler(Handler):
    """``x.size()``, ``x.dim()``, ``getattr(x, "shape")``: values of the global shape, not
    tensors."""

    functions = frozenset({getattr})
    methods = frozenset({"size", "dim"})

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.graph import Step

        return Step(node, "meta", None)

    def samples(self) -> Sequence[Sample]:
        return (Sample("size-view-head", lambda: _ViewNet(), (5, 4, 4, 4), SAMPLE_GRIDS[:3]),)


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
