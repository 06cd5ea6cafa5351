"""Softmax and its kin over one dim (``softmax``, ``log_softmax``, ``softmin``: module,
``F.*``, ``torch.*`` or method), as attention weights are normalised over their keys.

Each element of the result depends on its whole row along ``dim``, so that dim is made whole
first (an allgather over the grid dims that split it, priced as the conversion it is; nothing
moves where it is whole, as an attention row is under sample or head splits) and every other
dim keeps its split: each rank normalises its block's rows, exactly as one process does. The
samples may be in any dim (``Step.samples``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from distconv.distribution import Dist
from distconv.ops.base import SAMPLE_GRIDS, Handler, Sample, SampleNet
from distconv.parallel.placement import Placement
from distconv.parallel.steps import samples_of

__all__ = ["SoftmaxHandler"]


class SoftmaxHandler(Handler):
    modules = (nn.Softmax, nn.LogSoftmax, nn.Softmin)
    functions = frozenset({F.softmax, F.log_softmax, F.softmin, torch.softmax,
                           torch.log_softmax})
    methods = frozenset({"softmax", "log_softmax"})
    samples_anywhere = True

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import Step

        args = an.tensor_args(node)
        if len(args) != 1 or node.args[0] is not args[0]:
            an.fail(node, "give it one tensor input (its other arguments as numbers): it "
                    f"takes {len(args)}")
        p = an.placement(args[0]).settled()
        dim = module.dim if module is not None else node.kwargs.get(
            "dim", node.args[1] if len(node.args) > 1 else None)
        if not isinstance(dim, int):
            an.fail(node, "give the dim as an int (torch's implicit dim is deprecated and "
                    f"depends on the number of dims): it normalises over dim {dim!r}", TypeError)
        dim %= p.ndim
        need = Placement(p.layout, Dist(tuple(None if d == dim else e
                                              for d, e in enumerate(p.dist.entries))))
        return Step(node, "pointwise", need, {args[0]: need}, samples=samples_of(args[0])[0])

    def samples(self) -> Sequence[Sample]:
        return (Sample("softmax-dims", lambda: SampleNet(_Softmaxes(), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),)


class _Softmaxes(nn.Module):
    """Over the channels (split under stationary-x), the rows (split under spatial) and the
    columns, in each call form."""

    def __init__(self) -> None:
        super().__init__()
        self.channels = nn.Softmax(dim=1)
        self.log = nn.LogSoftmax(-1)

    def forward(self, x: Any) -> Any:
        a = self.channels(x) + F.softmin(x, 2) * torch.softmax(x, dim=-1)
        b = self.log(x).exp() * x.softmax(2) + F.log_softmax(x, dim=1) / 9
        return a * x.log_softmax(3).exp() + b
