"""The op-handler protocol: what one op family states about itself, as math only.

A handler binds every call form of its ops (a module type, an ``F.*`` or ``torch.*`` function, a
tensor method) and answers, for one traced node:

* :meth:`Handler.place` -- where the node's value lives and what its inputs must be converted to
  (a :class:`~distconv.parallel.graph.Step`), or :class:`Unsupported` naming the node, its
  target, why, and what would work;
* :meth:`Handler.build` -- the executable layer (from :mod:`distconv.nn`) when the op runs as a
  distributed layer;
* :meth:`Handler.price` -- the collectives it runs, with the exact bytes every rank receives, and
  its parameter elements per rank (what :func:`distconv.explain` reports);
* :meth:`Handler.param_dists` -- the Dist of each of its parameters (gradient completion);
* :meth:`Handler.samples` -- calls that the conformance test runs under every option.

The one walker over a traced graph (:mod:`distconv.parallel.graph`) asks the registry
(:mod:`distconv.ops`) for each node's handler; ``parallelize`` builds, ``explain`` prices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch.fx as fx
from torch import nn

if TYPE_CHECKING:
    from distconv.parallel.steps import Step

__all__ = ["SAMPLE_GRIDS", "SIGNAL_GRIDS", "VOLUME_GRIDS", "Handler", "PoolNet", "PriceContext",
           "Sample", "SampleNet", "Unsupported", "ViewHeadNet", "qualified_name"]


class Unsupported(NotImplementedError):
    """A node no handler can run: names the node, its target, why, and what would work."""


@dataclass(frozen=True)
class Sample:
    """A small model that exercises a handler, with the configs (options) to run it under.

    ``make()`` returns the plain model; ``shape`` is the global input shape; ``configs`` are
    ``(world size, config)`` pairs, each an option the handler takes.
    """

    name: str
    make: Callable[[], nn.Module]
    shape: tuple[int, ...]
    configs: tuple[tuple[int, dict], ...]


class SampleNet(nn.Module):
    """A conformance sample: a 1x1 stem convolution (placed by the config, so the layer under
    test meets every distribution the options give), the layer, a global mean and a head."""

    def __init__(self, layer: nn.Module, channels: int, out_channels: int | None = None) -> None:
        super().__init__()
        self.stem = nn.Conv2d(channels, channels, 1)
        self.layer = layer
        self.head = nn.Linear(out_channels or channels, 3)

    def forward(self, x: Any) -> Any:
        return self.head(self.layer(self.stem(x)).mean((2, 3)))


#: the options every layer sample runs under: sample, spatial (H), stationary-x, -y, -w
SAMPLE_GRIDS: tuple[tuple[int, dict], ...] = (
    (2, {"default": {"grid": {"N": 2}, "algorithm": "sample"}}),
    (2, {"default": {"grid": {"N": 1, "H": 2}, "algorithm": "spatial"},
         "data": {"N": 1, "H": 2}}),
    (4, {"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"}}),
    (4, {"default": {"grid": {"N": 2, "F": 2}, "algorithm": "stationary-y"}}),
    (4, {"default": {"grid": {"C": 2, "F": 2}, "algorithm": "stationary-w"}}),
)


#: the options of a volume's layers (N, C, D, H, W): sample-parallel, replicated over C (a
#: sample-parallel stem leaves it so), split over depth, over depth and rows
VOLUME_GRIDS: tuple[tuple[int, dict], ...] = (
    (2, {"default": {"grid": {"N": 2}, "algorithm": "sample"}}),
    (4, {"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"}}),
    (2, {"default": {"grid": {"N": 1, "D": 2}, "algorithm": "spatial"},
         "data": {"N": 1, "D": 2}}),
    (4, {"default": {"grid": {"D": 2, "H": 2}, "algorithm": "spatial"},
         "data": {"N": 1, "D": 2, "H": 2}}),
)

#: the options of a signal's layers (N, C, W): sample-parallel, split over its length
SIGNAL_GRIDS: tuple[tuple[int, dict], ...] = (
    (2, {"default": {"grid": {"N": 2}, "algorithm": "sample"}}),
    (4, {"default": {"grid": {"N": 2, "W": 2}, "algorithm": "spatial"}}),
)


class ViewHeadNet(nn.Module):
    """A conformance sample: a 1x1 stem convolution (placed by the config) whose ``[N, 4, 4, 4]``
    maps a head reads as ``y.view(y.size(0), -1)``: a view that merges every dim but the
    samples, sized by a shape read."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 4, 1)
        self.head = nn.Linear(64, 3)

    def forward(self, x: Any) -> Any:
        y = self.stem(x)
        return self.head(y.view(y.size(0), -1))


class PoolNet(nn.Module):
    """A conformance sample over ``dims`` spatial dims: a 1x1 stem convolution (placed by the
    config), the layer, a spatial mean and a head."""

    def __init__(self, layer: nn.Module, channels: int, dims: int) -> None:
        super().__init__()
        self.stem = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims](channels, channels, 1)
        self.layer = layer
        self.head = nn.Linear(channels, 3)
        self.dims = tuple(range(2, 2 + dims))

    def forward(self, x: Any) -> Any:
        return self.head(self.layer(self.stem(x)).mean(self.dims))


@dataclass
class PriceContext:
    """What pricing a node needs: its input's global shape, the item size, the evaluated ranks,
    whether a gradient flows back into the input, the machine (None: bytes only) and the node's
    output's global shape (None where it has none)."""

    in_shape: tuple[int, ...]
    itemsize: int
    ranks: list[int]
    grad_in: bool
    machine: Any = None
    out_shape: tuple[int, ...] | None = None


class Handler:
    """One op family. Subclasses set the forms they bind and override what they state."""

    #: module types, functions and tensor-method names this handler binds
    modules: tuple[type, ...] = ()
    functions: frozenset[Any] = frozenset()
    methods: frozenset[str] = frozenset()
    #: module types and functions of packages that need not be installed, by qualified name
    #: (``"timm.layers.drop.DropPath"``): bound without importing them. Such module types are
    #: leaves of the trace (their forward runs as one call).
    module_names: frozenset[str] = frozenset()
    function_names: frozenset[str] = frozenset()
    #: whether the op takes its inputs' samples in any dim (its rule reads every Dist by
    #: position, and :meth:`place` sets ``Step.samples``, where the output holds them); else
    #: an input that holds them elsewhere than dim 0 is refused before :meth:`place`, naming
    #: the node that moved them
    samples_anywhere = False

    def binds(self, node: fx.Node, module: nn.Module | None) -> bool:
        if node.op == "call_module":
            return isinstance(module, self.modules) or self.binds_by_name(module)
        if node.op == "call_function":
            return node.target in self.functions or bool(self.function_names) and (
                qualified_name(node.target) in self.function_names)
        if node.op == "call_method":
            return node.target in self.methods
        return False

    def binds_by_name(self, module: nn.Module | None) -> bool:
        """Whether ``module``'s type, or a base of it, is one of :attr:`module_names`."""
        return bool(self.module_names) and module is not None and any(
            qualified_name(t) in self.module_names for t in type(module).__mro__)

    def place(self, an: Any, node: fx.Node, module: nn.Module | None) -> Step:
        raise NotImplementedError

    def build(self, module: nn.Module | None, node: fx.Node, step: Step, grid: Any) -> Any:
        """The distributed layer for ``step`` (None: the node runs as traced)."""
        return None

    def price(self, report: Any, step: Step, module: nn.Module | None,
              ctx: PriceContext) -> None:
        """Append the node's collectives (bytes per evaluated rank) and parameter elements to
        ``report`` (an explain ``LayerReport``)."""

    def param_dists(self, step: Step, module: nn.Module) -> dict[str, Any] | None:
        """Parameter name -> Dist on ``step.layer.layout`` (None: replicated everywhere)."""
        return None

    def refuse(self, step: Step, module: nn.Module | None,
               in_shape: tuple[int, ...]) -> str | None:
        """Why ``step`` cannot run on its first input's global shape ``in_shape`` (a layout
        that leaves some rank no rows, say), or None where it can. Asked by ``explain`` and by
        the parallel model for each input shape, before any step runs."""
        return None

    def refuse_operands(self, step: Step, shapes: dict[str, tuple[int, ...]]) -> str | None:
        """Why ``step`` cannot run on these global shapes of the graph's values (by node
        name; an operand that broadcasts against a split it was placed to share, say), or
        None. Asked with :meth:`refuse`, of every step."""
        return None

    #: whether :meth:`run` computes the node's local block (else the traced call runs as is)
    runs_locally = False
    #: whether a function node's layer (:meth:`build`) takes the call's other operands, each
    #: converted to its need, after its input and global shape: ``layer(x, shape,
    #: *handler.operands(args, kwargs))``
    layer_operands = False

    def operands(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The operands a function node's layer takes after its input, from the call's
        arguments (:attr:`layer_operands`)."""
        return ()

    def runs_as_traced(self, step: Step) -> bool:
        """Whether the traced call computes ``step``'s local block (else :meth:`run` does)."""
        return not self.runs_locally

    def run(self, node: fx.Node, args: Any, kwargs: Any, in_shape: tuple[int, ...]) -> Any:
        """This rank's block of the node's value from its inputs' blocks (``in_shape``: the
        first input's global shape)."""
        raise NotImplementedError

    def samples(self) -> Sequence[Sample]:
        return ()

    def forms(self) -> list[str]:
        """The call forms it binds, by name (for refusal messages and coverage tables)."""
        names = [m.__name__ for m in self.modules]
        names += [f"{getattr(f, '__module__', '') or ''}.{getattr(f, '__name__', str(f))}"
                  .replace("torch.nn.functional.", "F.").replace("_operator.", "operator.")
                  .lstrip(".") for f in self.functions]
        names += [f".{m}()" for m in sorted(self.methods)]
        names += sorted(self.module_names) + sorted(self.function_names)
        return names


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a class or function (as :attr:`Handler.module_names` spells it)."""
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
