"""``Linear`` layers -- and the per-sample layers without a model-parallel implementation yet
(``Conv1d``, ``Conv3d``, transposed convolutions) -- run sample-parallel (``[o_N,*,...]``) on
their entry's grid, their weights replicated; the gradient completion (a bucketed allreduce) is the
only traffic."""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from distconv.ops.base import SAMPLE_GRIDS, Handler, PriceContext, Sample, SampleNet
from distconv.ops.pricing import largest_block
from distconv.parallel.config import LayerChoice
from distconv.parallel.placement import Placement

__all__ = ["LinearHandler", "SampleLayerHandler"]


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
        from distconv.parallel.graph import LayerSpec, Step, sample_dist

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


class SampleLayerHandler(LinearHandler):
    """Convolutions over 1 or 3 spatial dims and transposed convolutions (``Conv1d``, ``Conv3d``,
    ``ConvTranspose1d/2d/3d``): per-sample layers that run sample-parallel (``x[o_N,*,...]``),
    their weights replicated and their gradients completed by the bucketed allreduce, on their
    entry's grid (``algorithm: sample``) or the data grid; their inputs arrive in any
    distribution and are converted. Channel, filter and spatial parallelism for them is not
    implemented: such an entry is refused by name."""

    modules = (nn.Conv1d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)

    def place(self, an: Any, node: Any, module: Any) -> Any:
        choice = an.config.choice(str(node.target))
        if choice.algorithm not in ("sample", "auto") and choice.source != "default":
            an.fail(node, f"{choice.source} asks for {choice.algorithm}, but "
                    f"{type(module).__name__} runs sample-parallel (channel, filter and spatial "
                    "parallelism are implemented for Conv2d); give it algorithm 'sample'",
                    ValueError)
        step = super().place(an, node, module)
        step.kind = "sample-layer"
        return step

    def price(self, report: Any, step: Any, module: Any, ctx: PriceContext) -> None:
        report.param_elements = sum(p.numel() for p in module.parameters())
        report.dists["w"] = "w[" + ",".join("*" * module.weight.dim()) + "]"
        compute(report, step, module, ctx)

    def samples(self) -> Sequence[Sample]:
        sample_only = ((2, {"default": {"grid": {"N": 2}, "algorithm": "sample"}}),)
        return (
            Sample("conv-transpose2d",
                   lambda: SampleNet(nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1,
                                                        output_padding=1), 4),
                   (5, 4, 7, 6), SAMPLE_GRIDS),
            Sample("conv3d-transpose3d", lambda: _Volume(), (5, 2, 5, 6, 4), sample_only),
            Sample("conv1d-transpose1d", lambda: _Signal(), (5, 3, 11), sample_only),
        )


class _Volume(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1, stride=(1, 2, 1))
        self.up = nn.ConvTranspose3d(4, 3, 2, stride=2, groups=1)
        self.head = nn.Linear(3, 3)

    def forward(self, x: Any) -> Any:
        return self.head(self.up(self.conv(x).relu()).mean((2, 3, 4)))


class _Signal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 5, padding=2, dilation=1)
        self.up = nn.ConvTranspose1d(4, 4, 4, stride=2, padding=1, groups=2)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Any) -> Any:
        return self.head(self.up(self.conv(x).tanh()).mean(2))
