"""Padding: ``nn.ConstantPad*``, ``ZeroPad*``, ``ReflectionPad*``, ``ReplicationPad*``,
``CircularPad*`` and ``F.pad`` (any mode, negative widths crop).

Padding a dim changes which global indices each block holds, and reflect, replicate and circular
padding read the far end of the dim: every padded dim is made whole on each rank first (an
allgather over the grid dims that split it, priced by the walker as the conversion it is), every
other dim keeps its split (``x[o,o_C,o,o]`` padded in W stays ``x[o,o_C,o,.]``), and the pad runs
on the local block as written. Widths computed in the graph from sizes are global constants in
the generated program; where any width is computed, every dim the pad tuple reaches is taken as
padded.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from distconv.distribution import Dist
from distconv.ops.base import SAMPLE_GRIDS, VOLUME_GRIDS, Handler, PoolNet, Sample, SampleNet
from distconv.parallel.placement import Placement

__all__ = ["PadHandler"]


def _pad_modules() -> tuple[type, ...]:
    names = [f"{kind}Pad{d}d" for kind in ("Constant", "Zero", "Reflection", "Replication",
                                           "Circular") for d in (1, 2, 3)]
    return tuple(getattr(nn, n) for n in names if hasattr(nn, n))  # some torch lack a few


def padded_dims(pad: Any, ndim: int) -> tuple[int, ...] | None:
    """The dims of an ``ndim``-dim value that ``pad`` (``F.pad``'s tuple, last dim first) pads
    or crops; a computed width counts its dim as padded. None: ``pad`` is one computed value."""
    if isinstance(pad, fx.Node):
        return None
    pad = tuple(pad)
    return tuple(ndim - 1 - i for i in range(len(pad) // 2)
                 if any(isinstance(w, fx.Node) or w != 0 for w in pad[2 * i:2 * i + 2]))


class PadHandler(Handler):
    """Every pad form: the padded dims of its input made whole, the rest as they come, and the
    call run as traced on each rank's block (its output in the same placement)."""

    modules = _pad_modules()
    functions = frozenset({F.pad})

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import Step

        args = an.tensor_args(node)
        if not args or node.args[0] is not args[0]:
            an.fail(node, "pass the value to pad as pad's first argument: here its first "
                    "argument is not a value of the graph")
        p = an.placement(args[0]).settled()
        pad = module.padding if module is not None else node.kwargs.get(
            "pad", node.args[1] if len(node.args) > 1 else None)
        if pad is None:
            an.fail(node, "give F.pad its pad widths: this call has none", TypeError)
        dims = padded_dims(pad, p.ndim)
        if dims is None:  # the whole tuple computed: every dim whole
            dims = tuple(range(p.ndim))
        entries = tuple(None if d in dims else e for d, e in enumerate(p.dist.entries))
        whole = Placement(p.layout, Dist(entries, frozenset(), p.dist.tensor_dims))
        return Step(node, "pad", whole, {args[0]: whole})

    def samples(self) -> Sequence[Sample]:
        return (
            Sample("pad-modules", lambda: SampleNet(_pad_chain(), 4, 4), (5, 4, 7, 6),
                   SAMPLE_GRIDS),
            Sample("F.pad-modes", lambda: SampleNet(_FunctionalPads(), 4), (5, 4, 7, 6),
                   SAMPLE_GRIDS),
            # D and W padded, H not: under the D x H split H keeps its split
            Sample("pad3d", lambda: PoolNet(nn.Sequential(
                nn.ReplicationPad3d((1, 0, 0, 0, 0, 1)), nn.ConstantPad3d((0, 2, 0, 0, 1, 1), 0.5)),
                2, 3), (5, 2, 7, 6, 5), VOLUME_GRIDS),
        )


def _pad_chain() -> nn.Module:
    """Each module form in 2-D, widths uneven and one negative (a crop)."""
    return nn.Sequential(
        nn.ConstantPad2d((1, 2, 0, 1), 0.25), nn.ZeroPad2d((0, 0, 2, 1)),
        nn.ReflectionPad2d((2, 1, 1, 0)), nn.ReplicationPad2d((0, 1, 1, 2)),
        *([nn.CircularPad2d((1, 0, 0, 2))] if hasattr(nn, "CircularPad2d") else []),
        nn.ConstantPad2d((-1, 0, 0, -2), 0.0))


class _FunctionalPads(nn.Module):
    """``F.pad`` in each mode, once over W only (H keeps its split), once with a width computed
    from a size, once cropping."""

    def forward(self, x: Any) -> Any:
        x = F.pad(x, (1, 2), value=0.5)
        x = F.pad(x, (0, 0, 1, x.shape[2] % 3), mode="reflect")
        x = F.pad(x, (2, 1, 1, 1), mode="replicate")
        x = F.pad(x, (1, 1, 0, 2), mode="circular")
        return F.pad(x, (0, -1, -1, 0))
