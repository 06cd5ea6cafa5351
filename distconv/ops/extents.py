"""What the traced graph states about a value's extents, whatever the input's shape: the dims
that are 1 (a squeeze-and-excitation's ``[N, C, 1, 1]`` maps). Placements decided from them are
shape-independent, so every rank decides alike for every input shape (a default entry runs a
convolution of one-row maps with those rows whole: :func:`distconv.ops.conv.whole_rows`)."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

__all__ = ["CAPTURED_SHAPE", "captured_shape", "unit_dims"]

#: node.meta key: the node's global shape on the input shape the model was captured on
#: (:func:`distconv.parallel.capture.trace` with ``input_shape``). A hint, not a fact of every
#: shape: only decisions exact on every input shape may read it (a default entry keeping maps
#: too small to split whole; another shape's larger maps run whole too, exactly)
CAPTURED_SHAPE = "distconv_captured_shape"


def captured_shape(node: Any) -> tuple[int, ...] | None:
    """``node``'s global shape on the captured input shape (:data:`CAPTURED_SHAPE`), if known."""
    shape = node.meta.get(CAPTURED_SHAPE) if isinstance(node, fx.Node) else None
    return tuple(shape) if shape is not None else None

#: reductions whose ``keepdim=True`` leaves the reduced dims of extent 1
_REDUCTIONS = frozenset({torch.mean, torch.sum, torch.amax, torch.amin, "mean", "sum", "amax",
                         "amin"})
#: adaptive pooling functions (their ``output_size`` of 1 leaves a dim of extent 1)
_ADAPTIVE = frozenset({F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
                       F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d})
#: steps whose value has its operands' (broadcast) extents
_ELEMENTWISE = frozenset({"pointwise", "dropout", "droppath", "batchnorm", "norm"})


def unit_dims(an: Any, node: fx.Node) -> frozenset[int]:
    """The dims of ``node``'s value that are 1 whatever the input's shape, as the graph states
    them: reduced with ``keepdim=True``, pooled by an adaptive pool to 1, added as new axes or
    written as a literal 1 in a ``view``/``reshape``, kept through elementwise ops (where every
    operand has them 1) and convolutions that map one row to one row. A placement decided from
    them is one every rank makes alike, for every input shape."""
    memo = an.__dict__.setdefault("_unit_dims", {})
    for n in node.graph.nodes:  # in order: each node's operands are known before it
        if n not in memo:
            memo[n] = _unit_dims_of(an, n, memo)
        if n is node:
            break
    return memo[node]


def _unit_dims_of(an: Any, node: fx.Node, memo: dict) -> frozenset[int]:
    placed = an.out.get(node)
    if node.op == "get_attr" and placed is not None:
        value = an.gm
        for part in str(node.target).split("."):
            value = getattr(value, part)
        return frozenset(d for d, n in enumerate(value.shape) if n == 1)
    step = next((s for s in reversed(an.steps) if s.node is node), None)
    if placed is None or step is None or not node.op.startswith("call_"):
        return frozenset()
    ndim, args = placed.ndim, an.tensor_args(node)
    module = an.modules.get(node.target) if node.op == "call_module" else None
    target = None if module is not None else node.target  # (a module's target is its path)
    first = memo.get(args[0], frozenset()) if args else frozenset()
    if target in _REDUCTIONS:
        dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        keep = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
        dims = (dims,) if isinstance(dims, int) else tuple(dims or ())
        return first | {d % ndim for d in dims} if keep is True and dims else frozenset()
    if isinstance(module, (nn.modules.pooling._AdaptiveAvgPoolNd,
                           nn.modules.pooling._AdaptiveMaxPoolNd)) or (
            target in _ADAPTIVE):
        size = module.output_size if module is not None else (
            node.kwargs.get("output_size", node.args[1] if len(node.args) > 1 else None))
        sizes = size if isinstance(size, (tuple, list)) else (size,) * (ndim - 2)
        return frozenset(d for d, n in enumerate(sizes, 2) if n == 1 or (
            n is None and d in first))
    if isinstance(module, nn.modules.conv._ConvNd) and not module.transposed:
        return frozenset(d for d in first if d >= 2 and _one_row(module, d - 2))
    if target in ("view", "reshape", torch.reshape):
        rest = node.args[1:]
        sizes = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
        return frozenset(d for d, n in enumerate(sizes) if isinstance(n, int) and n == 1)
    if target in (operator.getitem, torch.unsqueeze, "unsqueeze"):
        return _new_axes(node, first, ndim, an.out[args[0]].ndim)
    if step.kind in _ELEMENTWISE:  # broadcast: 1 where every operand is 1 (trailing dims)
        dims = set(range(ndim))
        if target is torch.cat:  # the joined dim grows
            dims.discard(node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
                         % ndim)
        for a in args:
            k = an.out[a].ndim
            dims &= {d for d in range(ndim) if d < ndim - k or d - (ndim - k) in memo[a]}
        return frozenset(dims)
    return frozenset()


def _one_row(conv: Any, i: int) -> bool:
    """Whether convolution ``conv`` maps an input of one row to an output of one row on its
    spatial dim ``i``: ``0 <= 2p - d(k-1) < s``."""
    if conv.padding == "same":
        return True
    pad = 0 if conv.padding == "valid" else conv.padding[i]
    reach = 2 * pad - conv.dilation[i] * (conv.kernel_size[i] - 1)
    return 0 <= reach < conv.stride[i]


def _new_axes(node: fx.Node, first: frozenset[int], ndim: int, in_ndim: int) -> frozenset[int]:
    """The unit dims after ``s[:, :, None, None]``, ``s[0, ..., None]`` or ``s.unsqueeze(d)``
    (``ndim``: the result's, ``in_ndim``: the input's)."""
    if node.target != operator.getitem:
        d = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0) % ndim
        return frozenset({d} | {e + (e >= d) for e in first})
    from distconv.ops.index import indexed_dims
    from distconv.ops.unbind import unbound_dim

    index, d = node.args[1], unbound_dim(node.args[0], in_ndim)
    try:
        kept, _ = indexed_dims(index if d is None else (slice(None),) * d + (index,), in_ndim)
    except (TypeError, ValueError):
        return frozenset()  # an index the index handler refuses, saying what to write instead
    return frozenset(i for i, k in enumerate(kept) if k is None or k in first)
