"""Dims that move: ``permute``, ``transpose``, ``swapaxes``/``swapdims``, ``movedim``/
``moveaxis``, ``t``, ``x.T``/``x.mT``/``x.H``/``x.mH`` and ``contiguous`` carry the distribution
with the dims. A Dist names each tensor dim's grid dims positionally, so the output's Dist is
the input's entries in the output's dim order, its pending sums kept: ``x[o,o_C,o_H,o]``
permuted by ``(0, 2, 3, 1)`` is ``x[o,o_H,o,o_C]`` (a channels-last ``[N, H, W, C]`` value
whose last dim is split over C). Every rank's block of the output is its block of the input
with its dims moved (``H``/``mH`` also conjugated, elementwise), so no data moves.

Every consumer reads the Dist by position, as torch reads the tensor: a ``LayerNorm(C)`` or a
``Linear`` on the last dim of a channels-last value meets its channels split where the
channel-first value had them split (:mod:`distconv.ops.norm`, :mod:`distconv.ops.linear`).

The samples move like any dim: an attention block's ``"b h (qkv l d) -> qkv b l h d"`` (einops)
permutes ``[o_N,*,*,*,*]`` to ``[*,o_N,*,*,*]``, and ``qkv[0]`` takes them back to dim 0
(:mod:`distconv.ops.index`). The ops between find them where the value's step says
(``Step.samples``); every other op, and the model's output, is refused there by name."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from distconv.distribution import Dist
from distconv.ops.base import SAMPLE_GRIDS, Handler, Sample, SampleNet
from distconv.ops.elementwise import is_constant
from distconv.ops.shape import model_tensor
from distconv.parallel.placement import Placement
from distconv.parallel.steps import samples_of

__all__ = ["PermuteHandler", "moved_dims"]

#: attribute reads that move dims (read through ``getattr`` in a traced graph)
_ATTRIBUTES = frozenset({"T", "mT", "H", "mH"})


def moved_dims(node: fx.Node, ndim: int) -> tuple[int, ...]:
    """``perm`` such that output dim ``i`` is input dim ``perm[i]``: the node's own call applied
    to a meta tensor whose dims have distinct sizes, so every call form (negative dims, tuples,
    ``movedim`` of lists) is read as torch reads it. Raises ``TypeError`` where a dim argument
    is not a number the graph knows (a value computed from a tensor)."""
    rest = (node.args[1:], node.kwargs)
    found: list[fx.Node] = []
    fx.node.map_arg(rest, found.append)
    if found:
        raise TypeError(f"its dims {[n.name for n in found]} are computed in the graph")
    probe = torch.empty(tuple(range(2, 2 + ndim)), device="meta")
    if node.op == "call_method":
        out = getattr(probe, str(node.target))(*node.args[1:], **node.kwargs)
    elif node.target is getattr:
        out = getattr(probe, node.args[1])
    else:
        out = node.target(probe, *node.args[1:], **node.kwargs)
    return tuple(d - 2 for d in out.shape)


def permuted(p: Placement, perm: Sequence[int]) -> Placement:
    """``p`` with its dims in the order ``perm`` (pending sums kept)."""
    dist = p.dist
    names = None if dist.tensor_dims is None else tuple(dist.tensor_dims[d] for d in perm)
    return Placement(p.layout, Dist(tuple(dist.entries[d] for d in perm), dist.pending, names))


class PermuteHandler(Handler):
    """Every form that moves dims, and ``contiguous`` (no dims moved): the output's Dist is the
    input's with its entries moved alike, its pending sums kept; nothing is communicated and the
    traced call runs on each rank's block. The samples move with their dim (``Step.samples``)."""

    functions = frozenset({torch.permute, torch.transpose, torch.swapaxes, torch.swapdims,
                           torch.movedim, torch.moveaxis, torch.t, torch.adjoint})
    methods = frozenset({"permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis",
                         "t", "adjoint", "contiguous"})

    samples_anywhere = True

    def binds(self, node: fx.Node, module: nn.Module | None) -> bool:
        if node.op == "call_function" and node.target is getattr:
            return len(node.args) == 2 and node.args[1] in _ATTRIBUTES
        return super().binds(node, module)

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import Step

        arg = node.args[0]
        if not isinstance(arg, fx.Node) or is_constant(arg):
            return model_tensor(an, node)  # a parameter's or buffer's dims
        p = an.placement(arg)
        try:
            perm = moved_dims(node, p.ndim)
        except TypeError as exc:
            an.fail(node, f"give the dims as numbers: {exc}", TypeError)
        except (RuntimeError, IndexError) as exc:  # dims that do not fit the value
            an.fail(node, f"give dims that fit the value's {p.ndim} dims: {exc}", ValueError)
        return Step(node, "reshape", permuted(p, perm), {arg: p},
                    samples=perm.index(samples_of(arg)[0]))

    def samples(self) -> Sequence[Sample]:
        return (Sample("convnext-block", lambda: SampleNet(ConvNeXtBlock(4), 4), (5, 4, 8, 6),
                       SAMPLE_GRIDS),
                Sample("transposes", lambda: SampleNet(_Transposes(), 4), (5, 4, 5, 6),
                       SAMPLE_GRIDS))


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block as its reference implementation writes it (Liu et al. 2022; torchvision's
    ``CNBlock`` and timm's ``ConvNeXtBlock`` compute the same): a 7×7 depthwise convolution, then
    channels-last LayerNorm and MLP, permuted back and added to the input (layer scale and
    stochastic depth left out)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)

    def forward(self, x: Any) -> Any:
        shortcut = x
        x = self.dwconv(x)
        x = x.permute(0, 2, 3, 1)  # (N, C, H, W) -> (N, H, W, C)
        x = self.norm(x)
        x = self.pwconv1(x)
        x = self.act(x)
        x = self.pwconv2(x)
        x = x.permute(0, 3, 1, 2)  # (N, H, W, C) -> (N, C, H, W)
        return shortcut + x


class _Transposes(nn.Module):
    """Every form that moves dims, each undone by another, with products of channels-last
    values on the way."""

    def forward(self, x: Any) -> Any:
        a = torch.permute(x, (0, 2, 3, 1)).contiguous()      # N H W C
        b = a.transpose(1, 3).swapaxes(2, 3)                  # N C H W
        c = torch.movedim(b, 1, -1) * a                       # N H W C
        d = c.mT.mT.moveaxis(3, 1)                            # N C H W
        return torch.swapdims(torch.transpose(d, 2, 3), 2, 3) * d
