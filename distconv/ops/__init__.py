"""Op handlers behind one registry: what each op family can run distributed, how it places its
values, how it is built and what it costs (see :mod:`distconv.ops.base`).

:data:`REGISTRY` is the one place an op kind is added; the walker over a traced graph
(:mod:`distconv.parallel.graph`) asks it for each node's handler, and refusals list the forms it
binds (:func:`supported`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch.fx as fx
from torch import nn

from distconv.ops.base import Handler, PriceContext, Sample, Unsupported
from distconv.ops.conv import ConvHandler
from distconv.ops.conv_nd import ConvNdHandler
from distconv.ops.einsum import EinsumHandler
from distconv.ops.elementwise import (
    BinaryHandler, CatHandler, DropoutHandler, PointwiseHandler, StackHandler,
)
from distconv.ops.expand import ExpandHandler
from distconv.ops.index import IndexHandler
from distconv.ops.linear import LinearHandler
from distconv.ops.mha import MultiheadAttentionHandler
from distconv.ops.norm import (
    BatchNormHandler, FunctionalBatchNormHandler, FunctionalGroupNormHandler,
    FunctionalInstanceNormHandler, FunctionalLayerNormHandler, GroupNormHandler,
    InstanceNormHandler, LayerNormHandler,
)
from distconv.ops.pad import PadHandler
from distconv.ops.permute import PermuteHandler
from distconv.ops.pool import (
    AdaptiveAvgPoolHandler, AdaptivePoolHandler, MeanHandler, PoolHandler, ReduceHandler,
)
from distconv.ops.resample import ResampleHandler
from distconv.ops.roll import RollHandler
from distconv.ops.shape import FlattenHandler, NewAxisHandler, ReshapeHandler
from distconv.ops.sizes import SizeHandler
from distconv.ops.sdpa import SdpaHandler
from distconv.ops.softmax import SoftmaxHandler
from distconv.ops.split import SplitHandler
from distconv.ops.stochastic import StochasticDepthHandler
from distconv.ops.unbind import UnbindHandler

__all__ = ["CONFIGURABLE", "REGISTRY", "Handler", "PriceContext", "Sample", "Unsupported",
           "MAX_LISTED", "handler_for", "instead", "is_leaf", "loaded_functions", "supported"]

#: Every op family, in matching order (the first that binds a node handles it).
REGISTRY: tuple[Handler, ...] = (
    SizeHandler(),  # first: Python arithmetic on sizes is no tensor op
    ConvHandler(), LinearHandler(), ConvNdHandler(), BatchNormHandler(),
    GroupNormHandler(), LayerNormHandler(), InstanceNormHandler(), PoolHandler(),
    AdaptiveAvgPoolHandler(), AdaptivePoolHandler(), MeanHandler(), ReduceHandler(),
    ResampleHandler(), DropoutHandler(), StochasticDepthHandler(), FunctionalLayerNormHandler(),
    FunctionalBatchNormHandler(), FunctionalGroupNormHandler(), FunctionalInstanceNormHandler(),
    PadHandler(), FlattenHandler(), ReshapeHandler(), SplitHandler(), IndexHandler(),
    NewAxisHandler(), PermuteHandler(), PointwiseHandler(), BinaryHandler(), CatHandler(),
    StackHandler(), SoftmaxHandler(), EinsumHandler(), UnbindHandler(), SdpaHandler(),
    ExpandHandler(), RollHandler(), MultiheadAttentionHandler(),
)


#: The module types a config entry may name (their grid and algorithm are configurable).
CONFIGURABLE: tuple[type, ...] = (
    ConvHandler.modules + LinearHandler.modules + ConvNdHandler.modules)


def handler_for(node: fx.Node, module: nn.Module | None) -> Handler | None:
    """The handler that binds ``node`` (``module``: its module for ``call_module``), or None."""
    for handler in REGISTRY:
        if handler.binds(node, module):
            return handler
    return None


def is_leaf(module: nn.Module) -> bool:
    """Whether the trace keeps ``module`` as one call: a module type a handler binds by name
    (:attr:`Handler.module_names`), whose forward ``torch.fx`` need not (or cannot) follow."""
    return any(handler.binds_by_name(module) for handler in REGISTRY)


def loaded_functions() -> tuple[Any, ...]:
    """The functions handlers bind by name (:attr:`Handler.function_names`) whose packages are
    loaded: the trace keeps each call of them as one node (fx's ``autowrap_functions``), as it
    keeps the modules :func:`is_leaf` names."""
    found = []
    for handler in REGISTRY:
        for name in sorted(handler.function_names):
            module, _, attr = name.rpartition(".")
            fn = getattr(sys.modules.get(module), attr, None)
            if callable(fn):
                found.append(fn)
    return tuple(found)


#: at most this many supported forms are named in one refusal; docs/support.md lists them all
MAX_LISTED = 10

#: refused forms whose supported relative computes what is usually meant
_INSTEAD = {"max": "amax", "min": "amin"}

_KINDS = {"call_module": "module types", "call_function": "functions",
          "call_method": "tensor methods"}


def _forms(op: str) -> list[str]:
    forms: list[str] = []
    for handler in REGISTRY:
        if op == "call_module":
            forms += [m.__name__ for m in handler.modules]
            forms += [n.rsplit(".", 1)[-1] for n in sorted(handler.module_names)]
        elif op == "call_function":
            forms += [f for f in handler.forms() if not f.startswith(".")
                      and f not in {m.__name__ for m in handler.modules}]
        else:
            forms += [f".{m}()" for m in sorted(handler.methods)]
    return list(dict.fromkeys(forms))


def _family_heads(op: str) -> list[str]:
    """One form of each handler (its first), in registry order: what a refusal lists when no
    form is near the refused one."""
    heads: list[str] = []
    for handler in REGISTRY:
        if op == "call_module":
            own = [m.__name__ for m in handler.modules]
        elif op == "call_function":
            own = [f for f in handler.forms() if not f.startswith(".")
                   and f not in {m.__name__ for m in handler.modules}]
        else:
            own = [f".{m}()" for m in sorted(handler.methods)]
        public = [f for f in own if "._" not in f and not f.startswith("_")]
        if public and public[0] not in heads:
            heads.append(public[0])
    return heads


def supported(op: str, name: str | None = None) -> str:
    """The forms the registry binds for a node op (``call_module``, ``call_function``,
    ``call_method``), as a clause for refusals: at most :data:`MAX_LISTED` of them -- those
    nearest ``name`` (the refused form's short name, e.g. ``"max"`` or ``"PixelShuffle"``) first,
    then one of each op family -- and where the whole list is (docs/support.md)."""
    import difflib

    forms = _forms(op)
    short = {f: f.strip(".()").rsplit(".", 1)[-1] for f in forms}
    picked: list[str] = []
    if name:
        key = name.strip(".()").rsplit(".", 1)[-1]
        near = difflib.get_close_matches(key, list(dict.fromkeys(short.values())),
                                         n=MAX_LISTED, cutoff=0.6)
        picked = [f for n in near for f in forms if short[f] == n]
    picked = list(dict.fromkeys(picked + _family_heads(op)))[:MAX_LISTED]
    return (f"{', '.join(picked)}, ... ({len(forms)} supported {_KINDS.get(op, 'forms')}, "
            "all in docs/support.md)")


def instead(op: str, name: str) -> str | None:
    """The supported form to write in place of the refused ``name`` (``"max"`` -> ``.amax()``),
    where one computes what is usually meant; else None."""
    key = name.strip(".()").rsplit(".", 1)[-1]
    alt = _INSTEAD.get(key)
    if alt is None:
        return None
    if op == "call_method":
        return f".{alt}()" if f".{alt}()" in _forms(op) else None
    return f"torch.{alt}" if f"torch.{alt}" in _forms(op) else None
