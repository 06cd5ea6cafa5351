"""Op handlers behind one registry: what each op family can run distributed, how it places its
values, how it is built and what it costs (see :mod:`distconv.ops.base`).

:data:`REGISTRY` is the one place an op kind is added; the walker over a traced graph
(:mod:`distconv.parallel.graph`) asks it for each node's handler, and refusals list the forms it
binds (:func:`supported`).
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from distconv.ops.base import Handler, PriceContext, Sample, Unsupported
from distconv.ops.conv import ConvHandler
from distconv.ops.conv_nd import ConvNdHandler
from distconv.ops.elementwise import BinaryHandler, CatHandler, DropoutHandler, PointwiseHandler
from distconv.ops.linear import LinearHandler
from distconv.ops.norm import (
    BatchNormHandler, GroupNormHandler, InstanceNormHandler, LayerNormHandler,
)
from distconv.ops.pool import AdaptiveAvgPoolHandler, MeanHandler, PoolHandler
from distconv.ops.resample import ResampleHandler
from distconv.ops.shape import FlattenHandler, NewAxisHandler, ReshapeHandler
from distconv.ops.sizes import SizeHandler

__all__ = ["CONFIGURABLE", "REGISTRY", "Handler", "PriceContext", "Sample", "Unsupported",
           "handler_for", "supported"]

#: Every op family, in matching order (the first that binds a node handles it).
REGISTRY: tuple[Handler, ...] = (
    SizeHandler(),  # first: Python arithmetic on sizes is no tensor op
    ConvHandler(), LinearHandler(), ConvNdHandler(), BatchNormHandler(),
    GroupNormHandler(), LayerNormHandler(), InstanceNormHandler(), PoolHandler(),
    AdaptiveAvgPoolHandler(), MeanHandler(), ResampleHandler(), DropoutHandler(),
    FlattenHandler(), ReshapeHandler(), NewAxisHandler(), PointwiseHandler(), BinaryHandler(),
    CatHandler(),
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


def supported(op: str) -> str:
    """The forms the registry binds for a node op (``call_module``, ``call_function``,
    ``call_method``), as a sentence for refusals."""
    forms: list[str] = []
    for handler in REGISTRY:
        if op == "call_module":
            forms += [m.__name__ for m in handler.modules]
        elif op == "call_function":
            forms += [f for f in handler.forms() if not f.startswith(".")
                      and f not in {m.__name__ for m in handler.modules}]
        else:
            forms += [f".{m}()" for m in sorted(handler.methods)]
    return ", ".join(dict.fromkeys(forms))
