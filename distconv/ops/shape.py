"""Shape ops: ``flatten`` / ``unflatten`` / ``view`` / ``reshape`` keep the split of every dim
they keep (the same size at the same offset: the samples, say, or the rows a channel shuffle
does not touch) and, where the global shapes are known when the graph is analysed (a capture
that records them), of a merge whose major dim alone is split or a split whose major new dim
takes it, when the blocks align (:func:`carriers`). Every other dim they merge or split is
made whole first (an allgather over the grid dims that split it, priced as the conversion it
is), so each rank regroups whole dims of its own block. ``size()`` / ``dim()`` and attribute
reads carry no value to place."""

from __future__ import annotations

import math
import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from distconv.distribution import Dist
from distconv.ops.base import SAMPLE_GRIDS, Handler, Sample, SampleNet, ViewHeadNet
from distconv.ops.elementwise import is_constant
from distconv.parallel.placement import Placement, layout_str

__all__ = ["FlattenHandler", "NewAxisHandler", "ReshapeHandler", "carriers",
           "GLOBAL_SHAPE", "groups", "kept_dims", "model_tensor"]

#: node.meta key: a reshape's output dim -> the input dim whose entry it carries (its placement)
_CARRIERS = "distconv_carriers"


def to_samples(an: Any, node: Any, arg: Any, out_ndim: int) -> Any:
    """Every dim but the samples replicated (flatten, view, reshape act on local rows)."""
    return regroup(an, node, arg, out_ndim, {0: 0})


def model_tensor(an: Any, node: Any) -> Any:
    """The step of a shape op on a model tensor (a parameter or buffer, as ``self.gamma.reshape(
    1, -1, 1, 1)``): the same whole value on every rank, run as written and sliced by the op that
    uses it with an activation (:func:`distconv.ops.elementwise.with_constants`)."""
    from distconv.parallel.steps import Step

    value = _meta_value(an.gm, node)
    if not isinstance(value, torch.Tensor):
        return Step(node, "constant", None)
    return Step(node, "constant", Placement(an.config.data, Dist.replicated(value.dim())))


def _meta_value(gm: fx.GraphModule, node: Any) -> Any:
    """What a node computed from model tensors alone gives, on meta tensors (its dims)."""
    if not isinstance(node, fx.Node):
        return node
    size = node.meta.get("capture_value")  # a size the sized capture read off the global shape
    if size is not None and not isinstance(size, torch.Tensor):
        return size
    if node.op == "get_attr":
        value: Any = gm
        for part in str(node.target).split("."):
            value = getattr(value, part)
        return torch.empty_like(value, device="meta") if isinstance(value, torch.Tensor) else value
    args = fx.node.map_arg(node.args, lambda a: _meta_value(gm, a))
    kwargs = fx.node.map_arg(node.kwargs, lambda a: _meta_value(gm, a))
    if node.op == "call_method":
        return getattr(args[0], str(node.target))(*args[1:], **kwargs)
    if node.op == "call_module":
        return gm.get_submodule(str(node.target))(*args, **kwargs)
    return node.target(*args, **kwargs)


def regroup(an: Any, node: Any, arg: Any, out_ndim: int, kept: dict[int, int]) -> Any:
    """The step of a shape op whose output dim ``k`` carries the entry of input dim
    ``kept[k]`` (the dim itself, or a merge or split of it whose blocks align:
    :func:`carriers`); every other dim is whole, in the input and the output."""
    from distconv.parallel.steps import LayerSpec, Step

    if kept.get(0) != 0:
        an.fail(node, "Keep dim 0 as it is (write its size as x.size(0) or x.shape[0]): "
                "it merges or splits the samples (dim 0), and the parallel model's output rows "
                "are its samples")
    node.meta[_CARRIERS] = kept  # what run() regroups by and refuse() checks
    p = an.placement(arg)
    mine = set(kept.values())
    need = Placement(p.layout, Dist(tuple(e if i in mine else None
                                          for i, e in enumerate(p.dist.entries))))
    out = Placement(p.layout, Dist(tuple(p.dist.entries[kept[k]] if k in kept else None
                                         for k in range(out_ndim))))
    return Step(node, "reshape", out, {arg: need},
                LayerSpec("reshape", node.name, p.layout, input=need))


def groups(in_shape: Sequence[int], out_shape: Sequence[int]
           ) -> list[tuple[list[int], list[int]]] | None:
    """The reshape of ``in_shape`` to ``out_shape`` as groups of consecutive input dims and the
    output dims they become, each the fewest with equal element counts (None: not a reshape of
    nonempty dims)."""
    if 0 in in_shape or 0 in out_shape or math.prod(in_shape) != math.prod(out_shape):
        return None
    found: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        ins, outs = [i][:i < len(in_shape)], [j][:j < len(out_shape)]
        a = in_shape[i] if i < len(in_shape) else 1
        b = out_shape[j] if j < len(out_shape) else 1
        i, j = i + 1, j + 1
        while a != b:
            if a < b:
                ins.append(i)
                a, i = a * in_shape[i], i + 1
            else:
                outs.append(j)
                b, j = b * out_shape[j], j + 1
        found.append((ins, outs))
    return found


def carriers(in_shape: Sequence[int], out_shape: Sequence[int], p: Placement) -> dict[int, int]:
    """Output dim -> the input dim whose entry it carries, on these global shapes: a dim the
    reshape leaves alone; a merge of dims whose major one alone is split, over ``P`` parts that
    divide it (each block of it, times the whole minors, is the merged dim's block); a split of
    a dim over ``P`` parts that divide the major new dim (its blocks are the old dim's). Every
    other dim of a regrouped group is whole."""
    ext = dict(p.layout)
    out: dict[int, int] = {}
    for ins, outs in groups(in_shape, out_shape) or ():
        if len(ins) == 1 and len(outs) == 1:
            out[outs[0]] = ins[0]
            continue
        parts = {i: math.prod(ext.get(g, 1) for g in p.dist.grid_dims_of(i)) for i in ins}
        if not outs or [i for i in ins if parts[i] > 1] != ins[:1]:
            continue  # nothing split, or a minor dim split: whole
        i, k = ins[0], outs[0]
        if (len(outs) == 1 and in_shape[i] % parts[i] == 0) or (
                len(ins) == 1 and out_shape[k] % parts[i] == 0):
            out[k] = i
    return out


def misplaced(step: Any, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> str | None:
    """Why a shape op's placed carriers (output dim -> the split input dim whose entry it
    carries) do not hold on these global shapes (the sizes regroup a dim taken as kept, or a
    split's blocks do not align), or None where they do."""
    found = carriers(in_shape, out_shape, step.layer.input)
    entries = step.layer.input.dist.entries
    wrong = sorted(i for k, i in step.node.meta[_CARRIERS].items()
                   if entries[i] is not None and found.get(k) != i)
    if not wrong:
        return None
    return ("write the kept dims' sizes as x.size(i) / x.shape[i] of the input itself: "
            f"{step.node.target} to {out_shape} does not keep input dim(s) {wrong} (split on "
            f"{layout_str(step.layer.layout)}) in place as placed")


def _size_of(a: Any, x: fx.Node, ndim: int) -> int | None:
    """The dim of ``x`` whose size ``a`` reads (``x.size(i)``, ``x.shape[i]``,
    ``x.size()[i]``), or None."""
    if not isinstance(a, fx.Node):
        return None
    if a.op == "call_method" and a.target == "size" and a.args[:1] == (x,):
        dim = a.kwargs.get("dim", a.args[1] if len(a.args) > 1 else None)
        return dim % ndim if isinstance(dim, int) else None
    if a.op == "call_function" and a.target is operator.getitem and isinstance(a.args[1], int):
        s = a.args[0]
        if isinstance(s, fx.Node) and s.args[:1] == (x,) and (
                (s.op == "call_method" and s.target == "size" and len(s.args) == 1)
                or (s.op == "call_function" and s.target is getattr and s.args[1] == "shape")):
            return a.args[1] % ndim
    return None


#: node.meta key: a node's global shape, where a capture per input shape recorded it for the
#: analysis (the placements of a graph analysed without it are the same for every input shape;
#: fx's own ``tensor_meta``, which shape propagations leave behind, is not read)
GLOBAL_SHAPE = "distconv_global_shape"


def _global_shape(node: Any) -> tuple[int, ...] | None:
    """A node's global shape where a capture recorded it for the analysis (:data:`GLOBAL_SHAPE`)."""
    shape = node.meta.get(GLOBAL_SHAPE) if isinstance(node, fx.Node) else None
    return tuple(int(n) for n in shape) if shape is not None else None


def target_sizes(node: fx.Node) -> list[Any]:
    """The sizes a ``view``/``reshape`` node asks for (ints, -1 or graph values)."""
    rest = list(node.args[1:]) or [node.kwargs.get("shape", node.kwargs.get("size", ()))]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        return list(rest[0])
    return rest


def kept_dims(node: fx.Node, p: Placement) -> dict[int, int]:
    """Output dim -> input dim whose entry it carries (:func:`carriers`), for a ``view`` /
    ``reshape`` of a value in ``p``: from both global shapes where the capture recorded them;
    else the dims whose sizes are read from the input itself (``x.size(i)``, ``x.shape[i]``, in
    order) and the samples (dim 0), which :meth:`ReshapeHandler.refuse` checks against the
    global shapes before a step runs."""
    x = node.args[0]
    shapes = _global_shape(x), _global_shape(node)
    if shapes[0] is not None and shapes[1] is not None:
        return carriers(shapes[0], shapes[1], p)
    kept: dict[int, int] = {}
    last = -1
    sizes = target_sizes(node)
    for k, a in enumerate(sizes):
        i = _size_of(a, x, p.ndim)
        if i is not None and i > last:
            kept[k], last = i, i
    if 0 not in kept and sizes and _size_of(sizes[0], x, p.ndim) is None:
        kept[0] = 0  # the samples, as every model writes them: checked by refuse
    return kept


class FlattenHandler(Handler):
    """``flatten(start_dim, end_dim)`` (module or function) and ``unflatten(dim, sizes)``: the
    other dims keep their entries, the merged (split) dim is whole -- a merged dim keeps its
    major dim's split where the capture recorded the global shapes and the blocks align
    (:func:`carriers`)."""

    modules = (nn.Flatten, nn.Unflatten)
    functions = frozenset({torch.flatten, torch.unflatten})
    methods = frozenset({"flatten", "unflatten"})

    def place(self, an: Any, node: Any, module: Any) -> Any:
        args = an.tensor_args(node)
        if not args or is_constant(args[0]):
            return model_tensor(an, node)
        ndim = an.placement(args[0]).ndim
        if isinstance(module, nn.Unflatten) or (
                module is None and "unflatten" in str(getattr(node.target, "__name__",
                                                              node.target))):
            if module is not None:
                dim, sizes = module.dim, module.unflattened_size
            else:
                dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
                sizes = node.kwargs.get("sizes", node.args[2] if len(node.args) > 2 else None)
            if not isinstance(dim, int) or not isinstance(sizes, (tuple, list)):
                an.fail(node, "give unflatten an int dim and a tuple of sizes: got "
                        f"{dim!r}, {sizes!r}", TypeError)
            dim, extra = dim % ndim, len(sizes) - 1
            kept = {(i if i < dim else i + extra): i for i in range(ndim) if i != dim}
            return regroup(an, node, args[0], ndim + extra, kept)
        if module is not None:
            start, end = module.start_dim, module.end_dim
        else:
            start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0)
            end = node.kwargs.get("end_dim", node.args[2] if len(node.args) > 2 else -1)
        start, end = start % ndim, end % ndim
        if end < start:
            an.fail(node, "give flatten a start_dim at or before its end_dim: "
                    f"flatten(start_dim={start}, end_dim={end})", ValueError)
        merged = end - start
        kept = {(i if i < start else i - merged): i for i in range(ndim)
                if not start <= i <= end or merged == 0}
        shapes = _global_shape(args[0]), _global_shape(node)
        if shapes[0] is not None and shapes[1] is not None:  # the major's split, where aligned
            kept = carriers(shapes[0], shapes[1], an.placement(args[0]))
        return regroup(an, node, args[0], ndim - merged, kept)

    def refuse(self, step: Any, module: Any, in_shape: tuple[int, ...]) -> str | None:
        """Where a merged dim placed as keeping its major dim's split does not align on this
        input shape: say so, before any step runs."""
        node, probe = step.node, torch.empty(in_shape, device="meta")
        if module is not None:
            out = module(probe).shape
        elif node.op == "call_method":
            out = getattr(probe, str(node.target))(*node.args[1:], **node.kwargs).shape
        else:
            out = node.target(probe, *node.args[1:], **node.kwargs).shape
        return misplaced(step, in_shape, tuple(out))

    def samples(self) -> Sequence[Sample]:
        return (Sample("flatten-head", lambda: _FlatNet(), (5, 4, 4, 4), SAMPLE_GRIDS),
                Sample("flatten-unflatten-rows", lambda: SampleNet(_Unflatten(), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS))


class ReshapeHandler(Handler):
    """``view`` / ``reshape`` (any call form): the dims that carry an input dim's entry
    (:func:`kept_dims`) keep it, every other regrouped dim is whole; each rank regroups its
    block with those dims' local sizes (as a ``reshape``: a block need not be contiguous where
    the global value is)."""

    functions = frozenset({torch.reshape})
    methods = frozenset({"view", "reshape"})
    runs_locally = True

    def place(self, an: Any, node: Any, module: Any) -> Any:
        sizes = target_sizes(node)
        if any(isinstance(s, torch.dtype) for s in sizes):
            an.fail(node, "convert with .to(dtype) instead: view(dtype) reinterprets the "
                    "bytes, which is not supported", TypeError)
        arg = node.args[0]
        if not isinstance(arg, fx.Node) or is_constant(arg):
            return model_tensor(an, node)
        return regroup(an, node, arg, len(sizes), kept_dims(node, an.placement(arg)))

    def runs_as_traced(self, step: Any) -> bool:
        return step.kind == "constant"  # a model tensor's reshape: whole, as written

    def run(self, node: Any, args: Any, kwargs: Any, in_shape: tuple[int, ...]) -> Any:
        """This rank's block: the requested sizes, each dim that carries an input dim's entry
        sized from that dim's local size (its global ratio: 1 for a dim left alone)."""
        x = args[0]
        sizes = list(args[1:]) or [kwargs.get("shape", kwargs.get("size", ()))]
        if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
            sizes = list(sizes[0])
        out = _global_shape(node)
        if out is None:  # the global sizes asked for (the program binds them), -1 resolved
            out = tuple(torch.empty(in_shape, device="meta").reshape(sizes).shape)
        for k, i in node.meta[_CARRIERS].items():
            sizes[k] = (x.shape[i] if out is None or in_shape[i] == out[k]
                        else x.shape[i] * out[k] // in_shape[i])
        return x.reshape(sizes)

    def refuse(self, step: Any, module: Any, in_shape: tuple[int, ...]) -> str | None:
        """Where the dims placed as carrying their input dim's entry do not on this input shape
        (the sizes given regroup them, or their blocks do not align): say so, before any step
        runs."""
        node = step.node
        sizes = []
        for a in target_sizes(node):
            i = _size_of(a, node.args[0], len(in_shape))
            if i is not None:
                a = in_shape[i]
            if not isinstance(a, int):
                return None  # a size the graph computes: the capture folds it
            sizes.append(a)
        try:
            out = torch.empty(in_shape, device="meta").reshape(sizes).shape
        except RuntimeError as exc:
            return (f"give sizes that fit the input shape {tuple(in_shape)}: {node.target} to "
                    f"{tuple(sizes)}: {exc}")
        return misplaced(step, in_shape, tuple(out))

    def samples(self) -> Sequence[Sample]:
        return (Sample("view-head", lambda: ViewHeadNet(), (5, 4, 4, 4), SAMPLE_GRIDS),
                Sample("channel-shuffle", lambda: SampleNet(_ChannelShuffle(), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS))


class NewAxisHandler(Handler):
    """A size-1 dim added to a value: ``s.unsqueeze(d)`` (e.g. a spatial gate made
    broadcastable; ``s[:, :, None, None]`` is :class:`~distconv.ops.index.IndexHandler`'s). No
    data moves: every rank's block gains the same size-1 dim, which no grid dim splits; a dim
    added before the samples (``unsqueeze(0)``) is refused by name."""

    functions = frozenset({torch.unsqueeze})
    methods = frozenset({"unsqueeze"})
    samples_anywhere = True

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import Step, samples_of

        args = an.tensor_args(node)
        if is_constant(args[0]):
            return model_tensor(an, node)  # a model tensor's new axis (a bias's batch dim)
        p = an.placement(args[0])
        out = list(p.dist.entries)
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        if not isinstance(dim, int):
            an.fail(node, f"give unsqueeze an int dim: got {dim!r}")
        dim %= len(out) + 1
        out.insert(dim, None)
        samples = samples_of(args[0])[0]
        if dim <= samples:
            an.fail(node, f"put new dims behind the samples (dim {samples}): it adds a dim "
                    "before the samples, and the parallel model's output rows are its samples "
                    "and its layers find them there")
        placed = Placement(p.layout, Dist(tuple(out), p.dist.pending))
        return Step(node, "pointwise", placed, {args[0]: p}, samples=samples)

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




class _ChannelShuffle(nn.Module):
    """ShuffleNet's channel shuffle of 4 channels in 2 groups, the kept sizes read from the
    value itself."""

    def forward(self, x: Any) -> Any:
        x = x.view(x.size(0), 2, 2, x.size(2), x.size(3))
        x = torch.transpose(x, 1, 2).contiguous()
        return x.view(x.size(0), -1, x.size(3), x.size(4))


class _Unflatten(nn.Module):
    """Rows and columns merged and split again, then the columns split in two (the rows
    kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.unflatten = nn.Unflatten(2, (7, 6))

    def forward(self, x: Any) -> Any:
        x = self.unflatten(torch.flatten(x, 2))
        y = x.unflatten(3, (2, 3)).flatten(3, 4)
        return x * y.reshape(y.shape[0], y.shape[1], y.shape[2], 6)
