"""Capture: a model's forward as a ``torch.fx`` graph that is the module's, or a refusal naming
the construct that keeps it from being so -- never the input.

:func:`trace` is ``torch.fx``'s symbolic tracing, with ``len()`` of a traced value recorded (a size
of the global shape, :mod:`distconv.ops.sizes`), modules without state that a forward builds per
call traced through, ``torch.jit.isinstance`` of a traced value refused where it is called (fx
answers it for its proxy: False, and MONAI's ``BasicUNet`` would lose its skip ``cat``), and an
error that names the model's own line and module where fx stops. :func:`check_capture` runs the
module itself on a meta input of a global shape (no data, no arithmetic) and refuses a graph that
fails where the module runs, returns other shapes, or never calls a module with parameters that
the module calls: Python fx cannot follow (``isinstance(x, torch.Tensor)`` of a traced value)
decided it.

Why fx and a check, not ``torch.export`` (non-strict), which runs the real Python: export yields
ATen operators with every module inlined (no module calls for the op handlers, the config's
module paths or the parameter shards to bind; ``nn_module_stack`` names them only as metadata),
specialises the graph to one input shape, and costs 5-30 times fx's trace per capture
(``benchmarks/capture.py``); the check costs one meta forward per model.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import inspect
import operator
import os
import sys
import threading
from typing import Any, Iterator, Sequence

import numpy
import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import map_aggregate

from distconv import ops
from distconv.ops.extents import CAPTURED_SHAPE
from distconv.ops.sizes import is_size

__all__ = ["MODULE_PATHS", "TRACING", "UntraceableModelError", "check_capture", "module_paths",
           "trace"]

#: the graph module's meta key: :func:`module_paths` of the model it was captured from (the
#: graph names each module by its first path only; config patterns match any)
MODULE_PATHS = "distconv_module_paths"

#: a guard of the sized capture (a ``torch._assert`` node's meta key: the size it decided on)
GUARD = "capture_guard"


#: torch.fx patches module-level functions and ``nn.Module.__call__`` process-wide while it
#: traces, so a module another thread calls meanwhile goes through the tracer: tracing and the
#: meta runs that find shapes (:func:`check_capture`, shape propagation) take turns (thread ranks)
TRACING = threading.RLock()


class UntraceableModelError(TypeError):
    """The model contains a construct ``torch.fx`` cannot capture faithfully."""


def trace(model: nn.Module, input_shape: Sequence[int] | None = None) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` with an error that names the construct fx stopped at, or the
    construct that would have made the captured graph compute something else than the module
    (``torch.jit.isinstance`` of a traced value, which fx answers for its proxy: False).

    With ``input_shape`` (the global input shape) the model is captured on that shape
    (:class:`_SizedTracer`): the same graph where fx alone follows the model, and where it cannot
    (a loop over ``range(len(x.shape) - 2)``, an ``if`` on sizes, ``torch.jit.isinstance``) the
    Python runs on the values a meta forward gives, each size it decided on checked by a guard in
    the graph (a ``torch._assert`` the program evaluates once per global input shape): another
    shape that would take another path is refused by name, never run on this one's graph. Each
    node also records its global shape on this input (:data:`~distconv.ops.extents.CAPTURED_SHAPE`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"pass an nn.Module as model: got {type(model).__name__}")
    if input_shape is not None:
        return _trace(model, _SizedTracer(model, input_shape))
    try:
        return _trace(model, _Tracer())
    except UntraceableModelError as exc:
        raise UntraceableModelError(
            "parallelize: pass input_shape= (the global input shape): with input_shape= given, "
            "the capture follows Python that decides on sizes or asks torch.jit.isinstance. "
            f"Without it: {str(exc).removeprefix('parallelize: ')}") from exc.__cause__


def _trace(model: nn.Module, tracer: _Tracer) -> fx.GraphModule:
    # the traced Python runs on the model's own buffers: an in-place update fx does not record
    # (a batch norm's ``num_batches_tracked.add_(1)``) would count the capture as a step
    kept = [(b, b.clone()) for b in model.buffers()]
    try:
        with TRACING, _capture_patches(tracer, type(model).__name__):
            graph = tracer.trace(model)
    except UntraceableModelError:
        raise
    except Exception as exc:  # fx raises TraceError, TypeError, ... with the construct's text
        raise UntraceableModelError(
            "parallelize: rewrite the Python named below, or convert layer by layer with "
            "DistConv2d.from_conv2d and Redistribute: torch.fx cannot trace "
            f"{type(model).__name__}{_where(exc, model)}: {exc}. Python that branches on a "
            "tensor's values, or iterates over them, cannot be captured (sizes can: "
            "x.shape[i], x.size(i), len(x), arithmetic on them, and with input_shape= given "
            "an if or a loop on them)"
        ) from exc
    finally:
        with torch.no_grad():
            for b, before in kept:
                b.copy_(before)
    if isinstance(tracer, _SizedTracer):
        tracer.add_guards(graph)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    _constants_out_of_state(gm, model)
    _keep_root_tensors(gm, model)
    _keep_uncalled(gm, model)
    _keep_traced_into(gm, model)
    _order_like(gm, model)  # fx registers modules in call order; users expect theirs
    gm.meta[MODULE_PATHS] = module_paths(model)
    return gm


def _constants_out_of_state(gm: fx.GraphModule, model: nn.Module) -> None:
    """The buffers of the graph's root that are no state of the model's root -- the tensors the
    trace made constants of (fx's ``_tensor_constant*``: a mask computed from sizes, say) and
    the model's own non-persistent buffers (fx registers every buffer it copies as persistent)
    -- are non-persistent, so ``state_dict()`` and checkpoints list the single-process model's
    keys only."""
    saved = {name for name, _ in model.named_buffers(recurse=False)
             if name not in model._non_persistent_buffers_set}
    for name, _ in gm.named_buffers(recurse=False):
        if name not in saved:
            gm._non_persistent_buffers_set.add(name)


def _keep_root_tensors(gm: fx.GraphModule, model: nn.Module) -> None:
    """Hold the root's own parameters and buffers that the graph never reads: a buffer the
    trace read into a constant (``self.index.clone()[:n]`` on the captured shape) or a tensor
    the forward does not use. The single-process model's ``state_dict()`` lists them, so the
    parallel model's does too (whole on every rank), and a checkpoint of one loads into the
    other."""
    have = {name for name, _ in gm.named_parameters(recurse=False)} | {
        name for name, _ in gm.named_buffers(recurse=False)}
    for name, p in model.named_parameters(recurse=False):
        if name not in have:
            gm.register_parameter(name, p)
    for name, b in model.named_buffers(recurse=False):
        if name not in have:
            gm.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)


def module_paths(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each module ``model`` registers under several paths: its first path (the one
    ``named_modules()`` and the traced graph name it by) to all its paths, first first."""
    paths: dict[int, list[str]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), []).append(path)
    return {every[0]: tuple(every) for every in paths.values() if len(every) > 1}


def _where(exc: BaseException, model: nn.Module) -> str:
    """`` at file:line in module 'path'``: the model's own line the trace failed at (the last
    frame outside torch), and the module whose code it is."""
    root = os.path.dirname(torch.__file__)
    frame = None
    tb = exc.__traceback__
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(root):
            frame = tb.tb_frame
        tb = tb.tb_next
    if frame is None or frame.f_code.co_filename == __file__:
        return ""
    this = frame.f_locals.get("self")
    path = next((p for p, m in model.named_modules() if m is this), None)
    module = f" in module {path or '(the root)'!r}" if path is not None else ""
    return f" at {frame.f_code.co_filename}:{frame.f_lineno}{module}"


def _is_array_protocol(name: str) -> bool:
    """numpy's protocols, which it asks for by attribute (``__array_struct__``, ...): a proxy
    must not answer them with a proxy of the attribute, as fx's would."""
    return name.startswith("__array") and name != "__array__"


class _Proxy(fx.Proxy):
    """fx's proxy, which numpy reads as a refusal that says what would work: a size read
    through numpy (``np.array(x.shape[2:])``) is captured with ``input_shape=`` given."""

    def __getattr__(self, name: str) -> Any:
        if _is_array_protocol(name):
            raise AttributeError(name)
        return super().__getattr__(name)

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        raise fx.proxy.TraceError(
            "give input_shape= so the capture reads sizes through numpy (as Python ints, "
            f"checked once per input shape): numpy reads the traced value {self.node.name!r}, "
            "and a tensor's values cannot be read into numpy")


class _Tracer(fx.Tracer):
    """fx's tracer, keeping as one call each module and loaded function a handler binds by name
    (:func:`distconv.ops.is_leaf`, :func:`distconv.ops.loaded_functions`: e.g. stochastic depth,
    whose body fx cannot follow); a module without state made inside a forward (a pooling layer
    built per call, as MONAI's ResNet shortcut does) is traced through as the functions it
    calls: fx would refuse it, as it is installed under no path."""

    def __init__(self) -> None:
        super().__init__(autowrap_functions=ops.loaded_functions())

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return super().is_leaf_module(m, module_qualified_name) or ops.is_leaf(m)

    def _proxy_placeholder(self, name: str, concrete_args: Any, sig: inspect.Signature,
                           fn_for_analysis: Any) -> Any:
        """The forward's arguments after the input that have defaults (timm's
        ``VisionTransformer.forward(x, attn_mask=None, is_causal=False)``) are their defaults:
        the parallel model takes one input, so the Python runs as the plain call ``model(x)``
        runs it (an ``if attn_mask is not None`` included), and no placeholder stands for them."""
        names = [n for n in sig.parameters if n != "self"]
        param = sig.parameters.get(name)
        if (param is not None and names and name != names[0] and not concrete_args
                and param.default is not inspect.Parameter.empty):
            return param.default
        return super()._proxy_placeholder(name, concrete_args, sig, fn_for_analysis)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            self.path_of_module(m)
        except NameError:
            if next(iter(m.parameters()), None) is None and next(iter(m.buffers()), None) is None:
                return forward(*args, **kwargs)
            raise
        return super().call_module(m, forward, args, kwargs)


#: the torch functions that make a tensor from sizes (:meth:`_SizedTracer._from_sizes`)
_FACTORIES = frozenset({torch.zeros, torch.ones, torch.full, torch.empty, torch.arange,
                        torch.eye, torch.linspace})

#: a node's value on the sized capture's meta input (``node.meta`` key)
_VALUE = "capture_value"


class _SizedProxy(_Proxy):
    """A traced value whose meta value the tracer knows. Where Python needs a size as a plain
    value (an ``if``, ``range()``, a list's length, an index, numpy's ``np.array(x.shape[2:])``
    or ``np.ceil(h / w)``), it gets the global one and the tracer records a guard on it;
    tensors' values stay out of reach (fx's refusal, or numpy's, naming the value)."""

    @property
    def known(self) -> bool:
        return _VALUE in self.node.meta

    @property
    def value(self) -> Any:
        return self.node.meta[_VALUE]

    def concrete(self) -> Any:
        """The value, guarded, if it is a size (:func:`distconv.ops.sizes.is_size`); else fx's
        refusal of a traced value used as a Python value."""
        assert isinstance(self.tracer, _SizedTracer)
        return self.tracer.concrete(self)

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        """The size as numpy reads it (guarded); a tensor's values are refused by name."""
        assert isinstance(self.tracer, _SizedTracer)
        if not (self.known and is_size(self.node)):
            raise fx.proxy.TraceError(
                "keep it a torch op in the model, or read only sizes (x.shape) through numpy: "
                f"numpy reads the values of {self.node.name!r}, which are a tensor's, not its "
                "sizes, and each rank holds a block of it")
        return numpy.asarray(self.concrete(), dtype=dtype)

    def __getattr__(self, name: str) -> Any:
        if _is_array_protocol(name):
            raise AttributeError(name)
        if name == "ndim" and self.known and isinstance(self.value, torch.Tensor):
            return self.tracer.create_proxy("call_function", getattr, (self, name), {}).concrete()
        return super().__getattr__(name)

    def __index__(self) -> int:
        return operator.index(self.concrete())

    def __int__(self) -> int:
        return int(self.concrete())

    def __len__(self) -> int:
        length = self.tracer.create_proxy("call_function", builtins.len, (self,), {})
        return length.concrete() if isinstance(length, _SizedProxy) else len(self.concrete())


class _SizedTracer(_Tracer):
    """fx's tracer that also runs every node on meta values of one global input shape (the
    module's meta twin: no data, no arithmetic), so the model's Python can decide on sizes:
    each size it turned into a plain value (:meth:`_SizedProxy.concrete`) is a guard, and
    :meth:`add_guards` writes the guards into the graph as ``torch._assert`` nodes naming where
    the Python decided. ``torch.jit.isinstance`` of a traced value is answered with its value."""

    def __init__(self, model: nn.Module, input_shape: Sequence[int]) -> None:
        super().__init__()
        self.twin = _meta_twin(model).eval()  # shapes are the same in either mode; some
        # training-mode checks are not (an instance norm of one element per channel)
        self._twins = {id(m) for m in self.twin.modules()}
        self.shape = tuple(int(s) for s in input_shape)
        self.guards: dict[fx.Node, tuple[Any, str]] = {}
        self._inputs = 0

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _SizedProxy(node, self)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        if id(m) in self._twins:  # a meta value being computed: the module itself runs
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def create_proxy(self, kind: str, target: Any, args: Any, kwargs: Any, *rest: Any,
                     **more: Any) -> fx.Proxy:
        if kind in ("call_function", "call_method"):
            made = self._from_sizes(kind, target, args, kwargs)
            if made is not None:
                return made
        if kind == "call_method" and target == "to" and self._same_dtype(args, kwargs):
            return args[0]  # x.to(v.dtype) of a value of that dtype: x itself (MONAI's Swin)
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **more)
        try:
            value = proxy.node.meta[_VALUE] = self._evaluate(proxy.node)
        except Exception:  # noqa: BLE001 - unknown value: Python deciding on it is refused
            return proxy
        if isinstance(value, torch.Tensor):
            proxy.node.meta[CAPTURED_SHAPE] = tuple(value.shape)
        return proxy

    def _from_sizes(self, kind: str, target: Any, args: Any, kwargs: Any) -> Any:
        """A tensor made from sizes and metadata alone (``torch.zeros((1, hp, wp, 1),
        device=x.device)``, where Swin builds its shifted-window mask), or computed from such a
        tensor and sizes (its window partition, ``view(h // ws, ...)``): made here, on the
        model's own device, each size guarded, so the Python that fills it in runs on a tensor
        and the graph holds the result as a constant (the same on every rank). None where an
        argument is another traced value, a tensor that needs a gradient, or nothing is made
        (no factory, no tensor)."""
        device = next((t.device for t in self.root.parameters()), torch.device("cpu"))
        plain, tensors = True, 0

        def value(a: Any) -> Any:
            nonlocal plain, tensors
            if isinstance(a, torch.Tensor):
                tensors += 1
                plain = plain and not a.requires_grad
                return a
            if not isinstance(a, fx.Proxy):
                return a
            node = a.node
            if node.op == "call_function" and node.target is getattr and node.args[1] in (
                    "device", "dtype") and _VALUE in node.meta:
                return device if node.args[1] == "device" else node.meta[_VALUE]
            if _VALUE in node.meta and is_size(node):
                return a
            plain = False
            return None

        args, kwargs = map_aggregate((args, kwargs), value)
        if not plain or not (tensors or (kind == "call_function" and target in _FACTORIES)):
            return None
        args, kwargs = map_aggregate((args, kwargs), lambda a: self.concrete(a) if isinstance(
            a, fx.Proxy) else a)
        if kind == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        return target(*args, **kwargs)

    @staticmethod
    def _same_dtype(args: Any, kwargs: Any) -> bool:
        """Whether ``x.to(dtype)`` (one dtype argument, as a value of the graph or a constant)
        asks for the dtype ``x`` has on the captured shape."""
        if kwargs or len(args) != 2 or not isinstance(args[0], fx.Proxy):
            return False
        value = args[0].node.meta.get(_VALUE)
        dtype = args[1].node.meta.get(_VALUE) if isinstance(args[1], fx.Proxy) else args[1]
        return isinstance(value, torch.Tensor) and isinstance(dtype, torch.dtype) and (
            dtype == value.dtype)

    def _value_of(self, node: fx.Node) -> Any:
        """An argument's value; a constant the trace made while it traced (fx's
        ``_tensor_constant``, a ``get_attr`` it creates without a proxy) is evaluated here."""
        if _VALUE not in node.meta and node.op == "get_attr":
            node.meta[_VALUE] = self._evaluate(node)
        return node.meta[_VALUE]

    def _evaluate(self, node: fx.Node) -> Any:
        if node.op == "placeholder":
            self._inputs += 1
            if self._inputs == 1:
                dtype = next((p.dtype for p in self.twin.parameters() if p.is_floating_point()),
                             None)
                return torch.empty(self.shape, dtype=dtype, device="meta")
            if not node.args:
                raise LookupError(node.name)
            return node.args[0]  # a default
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), self._value_of)
        if node.op == "get_attr":
            value: Any = self.twin
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            if value is None:  # a constant the trace made (:meth:`_from_sizes`): its shape
                value = torch.empty_like(getattr(self.root, str(node.target)), device="meta")
            return value
        if node.op == "call_module":
            return self.twin.get_submodule(str(node.target))(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        return node.target(*args, **kwargs)

    def concrete(self, obj: fx.Proxy) -> Any:
        """``obj``'s value, guarded, if it is a size (:func:`distconv.ops.sizes.is_size`);
        else fx's refusal of a traced value used as a Python value."""
        node = obj.node  # (an attribute's node is made when asked for)
        if _VALUE not in node.meta or not is_size(node):
            raise fx.proxy.TraceError(
                "branch on sizes only (x.shape[i], len(x)), not on a tensor's values: "
                "symbolically traced variables cannot be used as inputs to control flow")
        self.guard(node, node.meta[_VALUE])
        return node.meta[_VALUE]

    def to_bool(self, obj: fx.Proxy) -> bool:
        return bool(self.concrete(obj))

    def iter(self, obj: fx.Proxy) -> Iterator[Any]:
        value = obj.node.meta.get(_VALUE)
        if isinstance(value, (tuple, list)) and is_size(obj.node):
            length = self.create_proxy("call_function", builtins.len, (obj,), {})
            return iter([obj[i] for i in range(length.concrete())])
        return super().iter(obj)

    def guard(self, node: fx.Node, value: Any) -> None:
        """Record that the capture decided on ``node`` being ``value``, and where."""
        if node not in self.guards:
            self.guards[node] = (value, _caller(self))

    def add_guards(self, graph: fx.Graph) -> None:
        """Each guard as ``torch._assert(node == value)`` right after its node (before anything
        the decision shaped): the program checks it once per global input shape, and a shape it
        fails is refused naming the guard."""
        for node, (value, where) in self.guards.items():
            with graph.inserting_after(node):
                same = graph.call_function(operator.eq, (node, value))
            with graph.inserting_after(same):
                check = graph.call_function(torch._assert, (same, (
                    "parallelize the model with input_shape= this shape (an input of this "
                    "shape needs a capture of its own): the model was captured on the global "
                    f"input shape {self.shape}, where {_expression(node)} is {value!r} and its "
                    f"Python {where} decided on it")))
            check.meta[GUARD] = (node.name, value, where)


_SYMBOLS = {operator.eq: "==", operator.ne: "!=", operator.lt: "<", operator.le: "<=",
            operator.gt: ">", operator.ge: ">=", operator.add: "+", operator.sub: "-",
            operator.mul: "*", operator.floordiv: "//", operator.mod: "%"}


def _expression(node: Any, depth: int = 4) -> str:
    """A size expression as the model wrote it, near enough: ``enc.shape[-1] != up.shape[-1]``
    (graph values by their node names)."""
    if not isinstance(node, fx.Node):
        return repr(node)
    if depth == 0 or node.op not in ("call_function", "call_method"):
        return node.name
    args = [_expression(a, depth - 1) for a in node.args]
    if node.target is getattr:
        return f"{args[0]}.{node.args[1]}"
    if node.target is operator.getitem:
        return f"{args[0]}[{node.args[1]!r}]"
    if node.target is builtins.len:
        return f"len({args[0]})"
    if node.target in _SYMBOLS and len(args) == 2:
        return f"({args[0]} {_SYMBOLS[node.target]} {args[1]})"
    if node.op == "call_method":
        return f"{args[0]}.{node.target}({', '.join(args[1:])})"
    return node.name


def _caller(tracer: fx.Tracer) -> str:
    """``at file:line in module 'path'``: the model's own frame that asked for a value."""
    root = os.path.dirname(torch.__file__)
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or frame.f_code.co_filename.startswith(root)):
        frame = frame.f_back
    path = list(tracer.module_stack)[-1] if tracer.module_stack else ""
    line = f"at {frame.f_code.co_filename}:{frame.f_lineno} " if frame is not None else ""
    return f"{line}in module {path or '(the root)'!r}"


@contextlib.contextmanager
def _capture_patches(tracer: fx.Tracer, model: str) -> Iterator[None]:
    """While ``tracer`` traces: ``len`` of a traced value is recorded as a node (a size of the
    global shape, :mod:`distconv.ops.sizes`; fx refuses it, as ``__len__`` must return an int),
    and ``torch.jit.isinstance`` of a traced value raises :class:`UntraceableModelError` naming
    where (fx would answer False for its proxy, and the graph would take a branch the module
    does not: MONAI's ``UpCat`` drops its skip ``cat``). Both are process-wide: the parallel
    model's ranks trace between barriers."""
    real_isinstance, real_len = torch.jit.isinstance, builtins.len

    def jit_isinstance(obj: Any, target_type: Any) -> bool:
        if isinstance(obj, _SizedProxy) and obj.known:  # the value the module would see
            return real_isinstance(obj.value, target_type)
        if isinstance(obj, fx.Proxy):
            caller = sys._getframe(1)
            where = list(tracer.module_stack)[-1] if tracer.module_stack else ""
            raise UntraceableModelError(
                "parallelize: rewrite the check (e.g. 'x is not None'), or convert layer by "
                "layer with DistConv2d.from_conv2d and Redistribute: "
                f"{model} calls torch.jit.isinstance on a traced value "
                f"({obj.node.name}) in module {where or '(the root)'!r} at "
                f"{caller.f_code.co_filename}:{caller.f_lineno}: torch.fx answers it for its "
                "proxy, not the tensor, so the captured graph would not be the module's")
        return real_isinstance(obj, target_type)

    def length(obj: Any) -> Any:
        if isinstance(obj, fx.Proxy):
            size = obj.tracer.create_proxy("call_function", real_len, (obj,), {})
            return size.concrete() if isinstance(size, _SizedProxy) and size.known else size
        return real_len(obj)

    def as_tensor(data: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(data, fx.Proxy) and not args and not kwargs:
            return data  # a tensor as a tensor is itself (fx would ask it for an array interface)
        return real_as_tensor(data, *args, **kwargs)

    real_as_tensor = torch.as_tensor
    torch.jit.isinstance, builtins.len, torch.as_tensor = jit_isinstance, length, as_tensor
    try:
        with _einops_on_proxies():
            yield
    finally:
        torch.jit.isinstance, builtins.len, torch.as_tensor = (real_isinstance, real_len,
                                                                real_as_tensor)


@contextlib.contextmanager
def _einops_on_proxies() -> Iterator[None]:
    """While tracing, einops' functions (``rearrange(x, "b c h w -> b h w c")``, as MONAI's
    SwinUNETR calls them on traced values) take a traced value as torch's backend takes a tensor:
    its ``permute``/``reshape`` are recorded as nodes, and the sizes it reads are the global
    shape's, as Python ints under guards (the sized capture's; without ``input_shape=`` they
    stay traced values). Registered for the proxy types alone, and removed after."""
    try:  # (a forward may import einops itself, while it is traced)
        import einops._backends as backends
    except ImportError:
        yield
        return
    table = backends._type2backend
    torch_backend = next((b for b in list(backends._loaded_backends.values())
                          if b.framework_name == "torch"), None)
    if torch_backend is None:
        torch_backend = backends.TorchBackend()
    mine = _EinopsProxyBackend(torch_backend)
    saved = {t: table.get(t) for t in (_Proxy, _SizedProxy)}
    table.update(dict.fromkeys(saved, mine))
    try:
        yield
    finally:
        for t, b in saved.items():
            if b is None:
                table.pop(t, None)
            else:
                table[t] = b


class _EinopsProxyBackend:
    """einops' torch backend for traced values: every op delegated to it (each runs on the
    proxy and is recorded), the shape read as the global one where the capture knows it."""

    def __init__(self, torch_backend: Any) -> None:
        self._torch = torch_backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def is_appropriate_type(self, tensor: Any) -> bool:
        return isinstance(tensor, fx.Proxy)

    def shape(self, x: Any) -> Any:
        if isinstance(x, _SizedProxy) and x.known:
            return tuple(int(x.shape[i]) for i in range(x.value.dim()))
        return x.shape


def _keep_uncalled(gm: nn.Module, model: nn.Module) -> None:
    """Hold, at their paths, the modules with parameters or buffers that the forward never calls
    (MONAI's ``TransformerBlock`` builds a cross-attention it runs only when asked): the
    single-process model's ``parameters()`` and ``state_dict()`` list their tensors, so the
    parallel model's do too (whole on every rank; no gradient reaches them, as in one process).
    A module the graph calls under another path is an alias, registered by the parallel model."""
    held = {id(m) for m in gm.modules()}
    paths = dict(gm.named_modules())
    kept: list[str] = []
    for path, m in model.named_modules():
        if (not path or path in paths or id(m) in held
                or any(path.startswith(k + ".") for k in kept)):
            continue
        if next(m.parameters(), None) is None and next(m.buffers(), None) is None:
            continue
        parent, _, leaf = path.rpartition(".")
        if parent in paths or not parent:
            paths[parent].add_module(leaf, m)
            kept.append(path)


def _keep_traced_into(gm: nn.Module, model: nn.Module) -> None:
    """Hold, at their paths, the modules whose forward the trace followed, themselves: fx puts a
    bare ``nn.Module`` there holding only the tensors the graph reads, which loses the module's
    type, settings and other buffers (a batch norm's ``num_batches_tracked``, which handlers and
    ``state_dict()`` read). Their tensors and the modules the graph calls in them are the same
    objects either way."""
    originals = dict(model.named_modules())
    kept: list[str] = []
    for path, m in list(gm.named_modules()):
        if not path or type(m) is not nn.Module or any(path.startswith(k + ".") for k in kept):
            continue
        original = originals.get(path)
        if original is None or type(original) is nn.Module:
            continue
        parent, _, leaf = path.rpartition(".")
        gm.get_submodule(parent)._modules[leaf] = original
        kept.append(path)


def _order_like(module: nn.Module, original: nn.Module) -> None:
    """Register ``module``'s submodules in the order ``original`` defines them (recursively), so
    that ``parameters()`` and ``state_dict()`` list the shards in the single-process model's
    order: optimizers and their state dicts address parameters by position."""
    rank = {name: i for i, name in enumerate(original._modules)}
    names = sorted(module._modules, key=lambda n: rank.get(n, len(rank)))
    module._modules = {n: module._modules[n] for n in names}
    for n in names:
        child, twin = module._modules[n], original._modules.get(n)
        if child is not None and twin is not None and child is not twin and child._modules:
            _order_like(child, twin)


def check_capture(gm: fx.GraphModule, module: nn.Module, shape: Sequence[int], *,
                  out: Any = None, failed: tuple[fx.Node | None, BaseException] | None = None
                  ) -> None:
    """Raise :class:`UntraceableModelError` where the captured graph
    ``gm`` is not ``module``'s forward on a meta input of ``shape``: the graph failed (``failed``:
    its node and exception) where the module runs, or its output shapes (``out``: its output)
    differ from the module's, or the module calls a module with parameters the graph never
    calls. Python that ``torch.fx`` cannot follow decided the capture then, not the input."""
    module = _meta_twin(module)  # in its own mode: the one fx captured (a branch on
    called: list[nn.Module] = []  # self.training is the graph's)
    for m in module.modules():
        m.register_forward_pre_hook(lambda m, _: called.append(m))
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    try:
        with TRACING:
            own = module(torch.empty(tuple(shape), dtype=dtype, device="meta"))
    except Exception:  # noqa: BLE001 - the module itself cannot run on this shape (or not on
        return  # meta): nothing tells the capture wrong
    name = type(module).__name__
    fix = ("parallelize: rewrite the Python that torch.fx cannot follow (isinstance(x, "
           "torch.Tensor) on a traced value, a branch taken on something fx stands in for), or "
           "convert layer by layer with DistConv2d.from_conv2d and Redistribute: ")
    if failed is not None:
        node, exc = failed
        at = f" at node {node.name!r} ({node.format_node()})" if node is not None else ""
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UntraceableModelError(
            f"{fix}the graph torch.fx captured of {name} is not its forward: {name} "
            f"runs on an input of shape {tuple(shape)}, its captured graph fails{at}: {reason}"
            ) from None
    mine, theirs = _shapes_of(out), _shapes_of(own)
    if mine != theirs:
        raise UntraceableModelError(
            f"{fix}the graph torch.fx captured of {name} is not its forward: on an "
            f"input of shape {tuple(shape)} it returns shapes {mine}, {name} returns {theirs}")
    paths: dict[int, list[str]] = {}
    for path, m in module.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), []).append(path)
    leaves = tuple(str(n.target) + "." for n in gm.graph.nodes if n.op == "call_module")
    seen = {str(n.target) for n in gm.graph.nodes if n.op in ("call_module", "get_attr")}
    seen |= {p for n in gm.graph.nodes for p, _ in (n.meta.get("nn_module_stack") or {}).values()}
    seen = {prefix for p in seen for prefix in _prefixes(p)} | {""}  # the graph is the root's

    def captured(m: nn.Module) -> bool:  # a module of the graph's, or inside one it calls
        return any(p in seen or (p + ".").startswith(leaves) for p in paths[id(m)])

    missed = sorted({paths[id(m)][0] for m in called
                     if any(True for _ in m.parameters(recurse=False)) and not captured(m)})
    if missed:
        raise UntraceableModelError(
            f"{fix}the graph torch.fx captured of {name} is not its forward: {name} "
            f"calls {missed} on an input of shape {tuple(shape)}, its captured graph never "
            "does")


def _meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are meta tensors of theirs (no data
    copied; a tensor under several names is one tensor in the copy too)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def _shapes_of(value: Any) -> list[tuple[int, ...]]:
    found: list[tuple[int, ...]] = []
    map_aggregate(value, lambda v: found.append(tuple(v.shape)) if isinstance(
        v, torch.Tensor) else None)
    return found


def _prefixes(path: str) -> list[str]:
    """``a.b.c`` -> ``a``, ``a.b``, ``a.b.c`` (a parameter's path names its modules)."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
