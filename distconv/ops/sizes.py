"""Values of the global shape: ``x.shape``, ``x.size()``, ``x.size(i)``, ``x.dim()``, ``x.ndim``,
``x.numel()``, ``len(x)``, Python arithmetic, comparisons and indexing on them
(``c // groups``, ``h * 2``, ``b, c, h, w = x.size()``, ``x.shape[2:]``), and ``torch._assert``
on them.

Each rank holds a block of every tensor, so a size read from the block would be the block's (the
rows of a spatially split map, the samples of a sample block), and code that sizes an op by it
(``F.interpolate(x, size=skip.shape[2:])``) would make a wrongly sized block. The executor
generates one program per global input shape (:mod:`distconv.parallel.program`), so these values
are constants there: the meta-device propagation of the global shape
(:mod:`distconv.parallel.shapes`) computes them and the program binds the global values, the same
on every rank, on every distribution. An assert on them is checked there, once per shape (a false
one is refused naming its node and module). Values read from a tensor's *contents* (``.item()``,
``.tolist()``) would differ from rank to rank and are refused by name; tensor metadata that every
block shares (``x.dtype``, ``x.device``) is read locally.
"""

from __future__ import annotations

import builtins
import math
import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from distconv.ops.base import SAMPLE_GRIDS, Handler, Sample, ViewHeadNet

__all__ = ["SizeHandler", "is_size"]

#: tensor methods and attributes whose value is (a function of) the shape
SIZE_METHODS = frozenset({"size", "dim", "numel", "nelement", "ndimension"})
SIZE_ATTRS = frozenset({"shape", "ndim"})
#: tensor attributes that are tensors (views of the tensor: ops, not metadata)
TENSOR_ATTRS = frozenset({"T", "mT", "H", "mH", "data", "real", "imag", "grad"})
#: tensor methods that read the tensor's values into Python (different on every rank)
VALUE_METHODS = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__",
                           "__index__"})
#: Python functions of plain values: of sizes, they give values of the global shape
SCALAR_FUNCTIONS = frozenset(
    [f for f in vars(operator).values() if callable(f) and not isinstance(f, type)]
    + [builtins.getattr, builtins.len, builtins.min, builtins.max, builtins.abs,
       builtins.int, builtins.float, builtins.round, builtins.divmod, builtins.tuple]
    + [f for f in vars(math).values() if callable(f)])


def is_size(node: Any) -> bool:
    """Whether ``node``'s value is a function of tensor shapes alone (so the global shape fixes
    it): a shape read, or a Python function of such values only."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method":
        return node.target in SIZE_METHODS or (bool(node.args) and is_size(node.args[0]))
    if node.op != "call_function" or node.target not in SCALAR_FUNCTIONS:
        return False
    if (node.target is getattr and node.args[1] in SIZE_ATTRS) or node.target is len:
        return True  # len(x) is x.shape[0]
    inputs = node.all_input_nodes
    return bool(inputs) and all(is_size(a) for a in inputs)


class SizeHandler(Handler):
    """Shape reads and what is computed from them: constants of the global shape, bound in the
    program (step kind ``size``; nothing runs per step). ``getattr`` of other attributes is
    metadata every block shares (kind ``meta``, read locally), except tensor-valued ones, which
    are ops (another handler's, or refused by name)."""

    functions = frozenset({torch._assert, getattr})
    methods = SIZE_METHODS

    def binds(self, node: fx.Node, module: nn.Module | None) -> bool:
        if node.op == "call_method" and node.target in SIZE_METHODS | VALUE_METHODS:
            return True
        if node.op != "call_function":
            return is_size(node)
        if node.target is getattr:  # a tensor-valued attribute is an op (or refused as one)
            return node.args[1] not in TENSOR_ATTRS
        return node.target is torch._assert or is_size(node)

    def place(self, an: Any, node: fx.Node, module: nn.Module | None) -> Any:
        from distconv.parallel.steps import Step

        if node.op == "call_method" and node.target in VALUE_METHODS:
            an.fail(node, f"Keep it a tensor (x.sum(), not x.sum().item()), or compute it "
                    f"outside the model: .{node.target}() reads the tensor's values into Python; "
                    "each rank holds a block of the tensor, so the value would differ by rank "
                    "and nothing computed from it could be exact")
        if node.target is torch._assert:
            cond = node.args[0] if node.args else node.kwargs.get("condition")
            if isinstance(cond, fx.Node) and not is_size(cond):
                an.fail(node, "check only sizes with torch._assert (checked once per global "
                        "input shape), or check the values outside the model: torch._assert on "
                        "a tensor's values would differ by rank, as each rank holds a block of it")
            return Step(node, "size", None)
        if is_size(node):
            return Step(node, "size", None)
        return Step(node, "meta", None)  # shared metadata, or an attribute of a non-tensor

    def forms(self) -> list[str]:
        return ["torch._assert", "getattr", ".shape", ".ndim",
                "Python arithmetic and comparisons on sizes"]

    def samples(self) -> Sequence[Sample]:
        spatial = ((2, {"default": {"grid": {"H": 2}, "algorithm": "spatial"},
                        "data": {"H": 2}}),)
        return (
            Sample("size-view-head", lambda: ViewHeadNet(), (5, 4, 4, 4), SAMPLE_GRIDS[:3]),
            Sample("decoder-interpolate-to-skip", lambda: _Decoder(), (5, 2, 8, 6),
                   SAMPLE_GRIDS[:3] + spatial),
        )


class _Decoder(nn.Module):
    """A segmentation decoder step: the coarse map interpolated to the skip's size
    (``h, w = skip.shape[2:]``), concatenated with it; an assert on the rank as timm writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(2, 4, 3, padding=1)
        self.down = nn.MaxPool2d(2)
        self.mid = nn.Conv2d(4, 4, 3, padding=1)
        self.dec = nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x: Any) -> Any:
        torch._assert(x.ndim == 4, "expected a 4-d input")
        skip = self.enc(x)
        y = self.mid(self.down(skip))
        h, w = skip.shape[2:]
        y = F.interpolate(y, size=(h, w), mode="bilinear", align_corners=False)
        return self.dec(torch.cat([y, skip], 1)).mean((2, 3))
