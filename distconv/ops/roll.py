"""``torch.roll(x, shifts, dims)`` (and ``x.roll``), as Swin's shifted windows call it on a
channels-last map ``[N, H, W, C]`` (``dims=(1, 2)``).

A roll moves whole rows around the ends of each rolled dim: a rank that owns a block of a split
rolled dim needs rows from the owner of the other end (the wrapped-around ones) and from its
neighbour, up to a whole block away for any shift. Exact and simple: each rolled dim that is split
is made whole first (an allgather over the grid dims that split it, priced as the conversion it
is), each rank rolls its block, and the output keeps every other dim's split (the samples', the
channels') with the rolled dims whole; the next op that wants them split again slices them (no
communication). Dims not rolled keep their entries and nothing moves: under sample parallelism a
roll of the rows is local. Refused by name: a roll of the samples' dim (it would move one sample's
rows into another's), a roll without ``dims`` (of the flattened value) and shifts or dims that are
values of the graph other than sizes.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from distconv.distribution import Dist
from distconv.ops.base import SAMPLE_GRIDS, Handler, Sample, SampleNet
from distconv.ops.elementwise import is_constant
from distconv.ops.shape import model_tensor
from distconv.ops.sizes import is_size
from distconv.parallel.placement import Placement
from distconv.parallel.steps import samples_of

__all__ = ["RollHandler"]


def _argument(node: fx.Node, name: str, position: int) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[position] if len(node.args) > position else None


def rolled_dims(node: fx.Node, ndim: int) -> tuple[int, ...]:
    """The dims a roll node rolls, non-negative (``()``: none given, the flattened roll).
    Raises ``TypeError`` where dims or shifts are graph values other than sizes."""
    shifts, dims = _argument(node, "shifts", 1), _argument(node, "dims", 2)
    found: list[fx.Node] = []
    fx.node.map_arg((shifts, dims), found.append)
    if [n for n in found if not is_size(n)]:
        raise TypeError(f"its shifts or dims {[n.name for n in found]} are computed from a "
                        "tensor's values")
    if dims is None:
        return ()
    if isinstance(dims, fx.Node):
        raise TypeError("its dims are computed in the graph")
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    return tuple(d % ndim for d in dims)


class RollHandler(Handler):
    """``torch.roll`` / ``x.roll``: the rolled dims whole (gathered where split), every other dim
    keeping its entry; the traced call runs on each rank's block."""

    functions = frozenset({torch.roll})
    methods = frozenset({"roll"})
    samples_anywhere = True

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import Step

        arg = node.args[0] if node.args else node.kwargs.get("input")
        if not isinstance(arg, fx.Node) or is_constant(arg):
            return model_tensor(an, node)
        p = an.placement(arg)
        try:
            dims = rolled_dims(node, p.ndim)
        except TypeError as exc:
            an.fail(node, f"give the shifts and dims as numbers or sizes: {exc}", TypeError)
        if not dims:
            an.fail(node, "give dims= to torch.roll: without them it rolls the flattened value, "
                    "which moves elements across the samples", ValueError)
        samples = samples_of(arg)[0]
        if samples in dims:
            an.fail(node, f"roll a dim other than the samples (dim {samples}): rolling them "
                    "moves one sample's values into another's, and the parallel model's rows "
                    "are its samples")
        entries = tuple(None if d in dims else e for d, e in enumerate(p.dist.entries))
        need = Placement(p.layout, Dist(entries, p.dist.pending))
        return Step(node, "pointwise", need, {arg: need}, samples=samples)

    def samples(self) -> Sequence[Sample]:
        return (Sample("roll-shifted-rows", lambda: SampleNet(_Shift(), 4), (5, 4, 8, 6),
                       SAMPLE_GRIDS),)


class _Shift(nn.Module):
    """Swin's cyclic shift on a channels-last map and back, a 1x1 convolution between (so the
    shift is seen), in both call forms."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(4, 4)

    def forward(self, x: Any) -> Any:
        t = x.permute(0, 2, 3, 1)  # [N, H, W, C]
        s = torch.roll(t, shifts=(-3, -2), dims=(1, 2))
        s = self.mix(s).roll((3, 2), (1, 2))
        return x + s.permute(0, 3, 1, 2) + torch.roll(x, 1, 3)
