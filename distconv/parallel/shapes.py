"""The global input shape against the model: propagate it, or say what the model expects.

``torch.fx``'s shape propagation fails deep inside with a dump of the graph node; these helpers
turn a wrong ``input_shape`` into a ``ValueError`` that names it, the shape received and what
the model's first layer expects (its number of dims and channels or features), with no dump.
The propagation also gives every value of the global shape that is not a tensor (``x.shape[2]``,
``c // 2``: the program's constants, :mod:`distconv.ops.sizes`), checks the model's own
``torch._assert`` on them, and tells a capture that is not the module's forward from a shape
that does not fit (:func:`distconv.parallel.capture.check_capture`).
"""

from __future__ import annotations

import weakref
from typing import Any, NoReturn, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from distconv.ops.split import is_split
from distconv.parallel.capture import GUARD, TRACING, check_capture

__all__ = ["check_input_shape", "check_input_shape_error", "first_layer", "global_values",
           "propagate_shapes"]

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def first_layer(gm: fx.GraphModule) -> tuple[str, nn.Module, bool] | None:
    """``(name, module, direct)``: the first convolution, batch norm or linear layer of the
    graph, and whether it reads the model's input itself (no op between them)."""
    inputs = {n for n in gm.graph.nodes if n.op == "placeholder"}
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if isinstance(module, (*_CONVS, *_NORMS, nn.Linear)):
            direct = bool(node.args) and node.args[0] in inputs
            return str(node.target), module, direct
    return None


def _expects(name: str, module: nn.Module) -> tuple[int | None, int, int, str]:
    """``(ndim, dim, size, text)``: the input dims (None: any), the dim whose size is fixed,
    that size, and a sentence saying so."""
    kind = type(module).__name__
    if isinstance(module, _CONVS):
        spatial = len(module.kernel_size)
        form = ", ".join(["N", str(module.in_channels), *"DHW"[3 - spatial:]])
        return (2 + spatial, 1, module.in_channels,
                f"its first layer {name!r} ({kind}) expects a {2 + spatial}-dim input ({form}) "
                f"with {module.in_channels} channels")
    if isinstance(module, _NORMS):
        ndim = {nn.BatchNorm1d: None, nn.BatchNorm2d: 4, nn.BatchNorm3d: 5}[type(module)]
        dims = "" if ndim is None else f"a {ndim}-dim input with "
        return (ndim, 1, module.num_features,
                f"its first layer {name!r} ({kind}) expects {dims}{module.num_features} channels "
                "(dim 1)")
    assert isinstance(module, nn.Linear)
    return (None, -1, module.in_features,
            f"its first layer {name!r} ({kind}) expects {module.in_features} features in the "
            "last dim")


def _what_first_layer_expects(gm: fx.GraphModule) -> str:
    found = first_layer(gm)
    if found is None:
        return "the model has no convolution, batch norm or linear layer to say what it expects"
    return _expects(found[0], found[1])[3]


def check_input_shape(gm: fx.GraphModule, shape: Sequence[int], *,
                      argument: str = "input_shape") -> None:
    """Raise ``ValueError`` when the first layer reads the input directly and ``shape`` has the
    wrong number of dims or the wrong channel (feature) count for it."""
    found = first_layer(gm)
    if found is None or not found[2]:
        return
    ndim, dim, size, text = _expects(found[0], found[1])
    shape = tuple(shape)
    if ndim is not None and len(shape) != ndim:
        raise ValueError(f"{argument}={shape} has {len(shape)} dims, but {text}: give the "
                         "global input shape, samples first")
    if shape and len(shape) > max(dim, 0) and shape[dim] != size:
        raise ValueError(f"{argument}={shape} has {shape[dim]} in dim "
                         f"{dim if dim >= 0 else len(shape) - 1}, but {text}")


def check_input_shape_error(exc: BaseException, shape: Sequence[int], gm: fx.GraphModule, *,
                            argument: str = "input_shape",
                            node: fx.Node | None = None) -> NoReturn:
    """Raise the ``ValueError`` that says why shape propagation of ``shape`` through ``gm``
    failed with ``exc``: ``argument``, the shape, what the first layer expects, the failing
    layer (``node``, or the one ``exc`` names) and torch's own reason in one line. Call it in
    the ``except`` clause; the fx traceback is not chained (``from None``)."""
    root: BaseException = exc
    while root.__cause__ is not None:
        root = root.__cause__
    reason = (str(root).strip().splitlines() or [type(root).__name__])[0]
    where = ""
    if node is not None:
        target = node.target if node.op == "call_module" else node.name
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        kind = f" ({type(module).__name__})" if module is not None else ""
        where = f" at {str(target)!r}{kind}"
    raise ValueError(f"{argument}={tuple(shape)} does not fit the model: "
                     f"{_what_first_layer_expects(gm)}; shape propagation failed{where}: "
                     f"{reason}") from None


class _ShapeRecorder(fx.Interpreter):
    """``torch.fx``'s ShapeProp (``node.meta['tensor_meta']`` and ``['type']`` of every node),
    without its printing a traceback when a node fails; remembers the failing node."""

    failed: fx.Node | None = None
    #: names of nodes refused by the analysis (``explain(strict=False)``): where one fails, its
    #: value is taken to be its first tensor input's, as the analysis takes it, and the rest runs
    tolerate: frozenset[str] = frozenset()

    def run_node(self, n: fx.Node) -> Any:
        self.failed = n
        try:
            result = super().run_node(n)
        except Exception:  # noqa: BLE001 - a refused node's own failure is its refusal's
            if n.name not in self.tolerate:
                raise
            args = [self.env[a] for a in n.all_input_nodes if a in self.env]
            result = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if result is None:
                raise
        self.failed = None
        found = False

        def extract(obj: Any) -> Any:
            nonlocal found
            if isinstance(obj, torch.Tensor):
                found = True
                return _extract_tensor_metadata(obj)
            return obj

        meta = map_aggregate(result, extract)
        if n.target in (torch.unbind, "unbind") or is_split(n):  # placed as the value it
            meta = n.args[0].meta["tensor_meta"]  # takes apart (distconv.ops.unbind, .split)
        if found:
            n.meta["tensor_meta"] = meta
        else:  # a value of the global shape (a size, a comparison of sizes): the program's
            n.meta["global_value"] = result  # constant (distconv.ops.sizes)
        n.meta["type"] = type(result)
        return result


def propagate_shapes(gm: fx.GraphModule, shape: Sequence[int], *,
                     dtype: torch.dtype | None = None, argument: str = "input_shape",
                     module: nn.Module | None = None,
                     tolerate: frozenset[str] = frozenset()) -> None:
    """Shape propagation of a meta ``shape`` input through ``gm`` (a copy on the meta device),
    filling ``node.meta['tensor_meta']`` as ``ShapeProp`` does (and ``['global_value']`` of
    every value that is not a tensor: sizes); a shape the model cannot take raises the
    ``ValueError`` of :func:`check_input_shape_error`, a false ``torch._assert`` of the model one
    naming it. ``module``: the plain model ``gm`` was captured from; where its own forward on this
    shape disagrees with the graph's (the graph fails where the module runs, or gives other output
    shapes, or skips a module with parameters that the module calls) the capture is not the
    module's, and :func:`~distconv.parallel.capture.check_capture` refuses it. ``tolerate``:
    names of nodes already refused (``explain(strict=False)``), whose failure here is theirs,
    not the shape's: each stands in with its first tensor input."""
    prop = _ShapeRecorder(gm)
    prop.tolerate = frozenset(tolerate)
    # in eval mode: a batch norm with momentum=None reads its batch count (.item(), which meta
    # tensors cannot give) in training, and no layer's shapes depend on the mode
    training = {m: m.training for m in gm.modules()}
    gm.eval()
    try:
        with TRACING:
            out = prop.run(torch.empty(tuple(shape), dtype=dtype, device="meta"))
    except Exception as exc:  # noqa: BLE001 - any failure of propagation is the shape's
        if prop.failed is not None and prop.failed.target is torch._assert:
            _refuse_assert(exc, shape, prop.failed, argument)
        if module is not None:
            check_capture(gm, module, shape, failed=(prop.failed, exc))
        check_input_shape_error(exc, shape, gm, argument=argument, node=prop.failed)
    finally:
        for m, mode in training.items():
            m.training = mode
    if module is not None and module not in _FAITHFUL:  # what fx captured does not depend on
        check_capture(gm, module, shape, out=out)     # the shape: once a module is enough
        _FAITHFUL.add(module)


#: the modules :func:`check_capture` found their captured graph faithful to
_FAITHFUL: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def global_values(gm: fx.GraphModule) -> dict[str, Any]:
    """Every non-tensor value of the last :func:`propagate_shapes` of ``gm``, by node name: on
    the global input shape, so a size is the global one (the program's constants)."""
    return {n.name: n.meta["global_value"] for n in gm.graph.nodes if "global_value" in n.meta}


def _refuse_assert(exc: BaseException, shape: Sequence[int], node: fx.Node,
                   argument: str) -> NoReturn:
    """A model's own ``torch._assert`` on sizes is false on this global shape: say which."""
    from distconv.parallel.graph import module_path

    where = module_path(node)
    if GUARD in node.meta:  # not the model's check: the capture's, on what its Python decided
        raise ValueError(f"{argument}={tuple(shape)} cannot run on this graph: "
                         f"{node.args[1]}") from None
    raise ValueError(f"{argument}={tuple(shape)} fails the model's own check at node "
                     f"{node.name!r} (torch._assert) in module {where or '(the root)'!r}: "
                     f"{str(exc).strip() or type(exc).__name__}") from None
