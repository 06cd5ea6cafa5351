"""Stochastic depth (``DropPath``): a residual branch dropped per sample, as torchvision
(``torchvision.ops.stochastic_depth``, ``StochasticDepth``), timm (``DropPath``, ``drop_path``)
and MONAI (``monai.networks.layers.DropPath``) write it.

The value keeps its input's settled placement. With ``p > 0``
:class:`~distconv.nn.DistDropPath` draws the mask of the global batch, ``m[N,1,1,1]``, from the
generator every rank shares and each rank keeps its samples' entries ``m[o_N,*,*,*]``: one
process's masks on every distribution (sample, spatial, channel or filter blocks, replicas), the
draw costing N numbers per rank and no communication. ``p = 0`` runs the module as traced (the
identity); eval mode is the identity. The packages are bound by the qualified names of their
types and functions, never imported; their modules are leaves of the trace (fx cannot follow
timm's body, which multiplies a tuple by a traced size).
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from distconv.ops.base import SAMPLE_GRIDS, Handler, Sample, SampleNet, qualified_name

__all__ = ["StochasticDepthHandler"]

_TORCHVISION = "torchvision.ops.stochastic_depth"
_TIMM = ("timm.layers.drop", "timm.models.layers.drop")


class StochasticDepthHandler(Handler):
    module_names = frozenset({f"{_TORCHVISION}.StochasticDepth",
                              "monai.networks.layers.drop_path.DropPath",
                              *(f"{m}.DropPath" for m in _TIMM)})
    function_names = frozenset({f"{_TORCHVISION}.stochastic_depth",
                                *(f"{m}.drop_path" for m in _TIMM)})

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import LayerSpec

        step = an.keep(node, "droppath")
        p, _, _, _ = _settings(an, node, module)
        if p > 0:
            step.layer = LayerSpec("droppath", str(node.target) if module is not None
                                   else node.name, step.out.layout, input=step.out)
        return step

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        from distconv.nn.dropout import DistDropPath

        p, per_sample, scale, training = _settings(None, node, module)
        layer = DistDropPath(p, grid=grid, input_dist=step.layer.input.dist,
                             per_sample=per_sample, scale=scale)
        return layer.train(training)

    def samples(self) -> Sequence[Sample]:
        return (Sample("drop-path-p0", lambda: SampleNet(_monai_drop_path(0.0), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS),
                Sample("drop-path-eval", lambda: SampleNet(_monai_drop_path(0.5).eval(), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS))


def _settings(an: Any, node: Any, module: Any) -> tuple[float, bool, bool, bool]:
    """(p, one draw per sample, scale by 1 - p, training) of a module or a function call, as its
    package reads them (timm's ``drop_path`` defaults to ``training=False``)."""
    if module is not None:
        if hasattr(module, "mode"):  # torchvision StochasticDepth(p, mode)
            p, per_sample, scale = module.p, _mode(an, node, module.mode), True
        else:  # timm, MONAI DropPath(drop_prob, scale_by_keep)
            p, per_sample, scale = module.drop_prob, True, getattr(module, "scale_by_keep", True)
        return float(p), per_sample, bool(scale), module.training

    def arg(i: int, name: str, default: Any) -> Any:
        return node.kwargs.get(name, node.args[i] if len(node.args) > i else default)

    if qualified_name(node.target).startswith(_TORCHVISION):
        return (float(arg(1, "p", 0.0)), _mode(an, node, arg(2, "mode", "row")), True,
                bool(arg(3, "training", True)))
    return (float(arg(1, "drop_prob", 0.0)), True, bool(arg(3, "scale_by_keep", True)),
            bool(arg(2, "training", False)))


def _mode(an: Any, node: Any, mode: Any) -> bool:
    """Whether torchvision's ``mode`` draws per sample ("row") or once ("batch")."""
    if mode not in ("row", "batch"):
        why = f"give stochastic depth mode 'row' or 'batch': got {mode!r}"
        if an is None:  # (building: placement refused it already)
            raise ValueError(why)
        an.fail(node, why, ValueError)
    return mode == "row"


def _monai_drop_path(p: float) -> nn.Module:
    from monai.networks.layers import DropPath

    return DropPath(p)
