"""``Linear`` layers run sample-parallel (``[o_N,*,...]``) on their entry's grid, their weights
replicated; the gradient completion (a bucketed allreduce) is the only traffic."""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from distconv.ops.base import Handler, PriceContext, Sample, SampleNet
from distconv.ops.pricing import largest_block
from distconv.parallel.config import LayerChoice
from distconv.parallel.placement import Placement

__all__ = ["LinearHandler", "compute"]


def compute(report: Any, step: Any, module: Any, ctx: PriceContext) -> None:
    """Forward and backward seconds of a sample-parallel layer on its largest block: every weight
    meets every position once -- the output's positions (samples x spatial positions) for a
    Linear or a convolution, the input's for a transposed one, whose every input position
    scatters through the whole weight -- at two FLOPs each, at the machine's FLOP rate; the
    backward computes the input's and the weight's gradients, each as long."""
    if ctx.machine is None or ctx.out_shape is None:
        return
    transposed = isinstance(module, nn.modules.conv._ConvTransposeNd)
    shape = ctx.in_shape if transposed else ctx.out_shape
    placed = next(iter(step.needs.values())) if transposed else step.out
    channels = shape[-1] if isinstance(module, nn.Linear) or len(shape) < 3 else shape[1]
    positions = largest_block(placed, shape) // max(channels, 1)
    forward = 2 * positions * module.weight.numel() / ctx.machine.flop_rate
    report.forward_seconds = forward
    report.backward_seconds = 2 * forward


class LinearHandler(Handler):
    modules = (nn.Linear,)

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import LayerSpec, Step, sample_dist

        name = str(node.target)
        choice = an.config.choice(name)
        if choice.algorithm not in ("sample", "auto") and choice.source != "default":
            an.fail(node, f"{choice.source} asks for {choice.algorithm}, but Linear layers "
                    "run sample-parallel; give them algorithm 'sample'", ValueError)
        if choice.algorithm != "sample" or choice.layout is None:
            choice = LayerChoice(an.config.data, "sample", "data")
        args = an.tensor_args(node)
        need = Placement(choice.layout, sample_dist(an.placement(args[0]).ndim))
        return Step(node, "linear", need, {args[0]: need},
                    LayerSpec("linear", name, choice.layout, "sample", input=need,
                              source=choice.source))

    def price(self, report: Any, step: Any, module: Any, ctx: PriceContext) -> None:
        report.param_elements = sum(p.numel() for p in module.parameters())
        report.dists["w"] = "w[*,*]"
        compute(report, step, module, ctx)

    def samples(self) -> Sequence[Sample]:
        return (Sample("linear-head", lambda: SampleNet(nn.Identity(), 4), (5, 4, 6, 6), (
            (2, {"default": {"grid": {"N": 2}, "algorithm": "sample"}}),
            (4, {"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"},
                 "layers": [{"match": "head", "grid": {"N": 4}, "algorithm": "sample"}]}),
        )),)
