"""``Linear`` layers run sample-parallel (``[o_N,*,...]``) on their entry's grid, their weights
replicated; the gradient completion (a bucketed allreduce) is the only traffic. ``Conv1d``,
``Conv3d`` and the transposed convolutions run so too, or split over channels and filters
(stationary-x, -y, -w: :class:`~distconv.nn.channel_conv.DistChannelConv`) where their entry asks
for it; their spatial dims stay whole."""

from __future__ import annotations

import math
from typing import Any, Sequence

from torch import nn

from distconv.nn.channel_conv import DistChannelConv, channel_conv_dists
from distconv.ops.base import SAMPLE_GRIDS, Handler, PriceContext, Sample, SampleNet
from distconv.ops.pricing import CommStep, largest_block
from distconv.parallel.config import LayerChoice
from distconv.parallel.placement import Placement, paper_grid
from distconv.redistribute import plan_redistribution

_ROLES = {"N": "N", "C": "C", "F": "F"}


def _transposed(module: Any) -> bool:
    return isinstance(module, nn.modules.conv._ConvTransposeNd)

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
    ``ConvTranspose1d/2d/3d``) on their entry's grid.

    * an entry naming them (not the default, which plans the Conv2d layers) with
      ``stationary-x``, ``-y`` or ``-w`` on a grid of samples, channels and filters: split over
      channels and filters (:class:`~distconv.nn.channel_conv.DistChannelConv`), its spatial dims
      whole; the collectives of :class:`~distconv.nn.DistConv2d`, priced from their plans.
    * otherwise sample-parallel (``x[o_N,*,...]``), their weights replicated and their gradients
      completed by the bucketed allreduce, on the entry's grid (``algorithm: sample``) or the
      data grid.

    Their inputs arrive in any distribution and are converted. Spatial parallelism (halos) and
    grouped convolutions split over channels are not implemented for them: such an entry is
    refused by name."""

    modules = (nn.Conv1d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.graph import LayerSpec, Step

        name = str(node.target)
        choice = an.config.choice(name)
        kind = type(module).__name__
        split = choice.layout is not None and any(
            e > 1 for d, e in choice.layout if d in ("C", "F"))
        # a default entry is the Conv2d layers' plan: these layers run sample-parallel under it
        if choice.algorithm.startswith("stationary-") and split and choice.source != "default":
            spatial = [d for d, e in choice.layout if e > 1 and d in ("H", "W")]
            if spatial or module.groups > 1:
                why = (f"splits its spatial dims over {spatial} (halos are implemented for "
                       "Conv2d)" if spatial else f"is grouped (groups={module.groups})")
                an.fail(node, f"{choice.source} asks for {choice.algorithm} on "
                        f"{dict(choice.layout)}, but this {kind} {why}; channel and filter "
                        "parallelism for it takes a grid of N, C and F only and groups=1",
                        ValueError)
            if choice.pipeline > 1:
                an.fail(node, f"{choice.source} asks for pipeline: {choice.pipeline}, which is "
                        f"implemented for Conv2d; leave it out for this {kind}", ValueError)
            dists = self._dists(choice.algorithm, module)
            args = an.tensor_args(node)
            need = Placement(choice.layout, dists["input"])
            spec = LayerSpec("channel-conv", name, choice.layout, choice.algorithm,
                             tuple(sorted(_ROLES.items())), need, choice.source)
            return Step(node, "conv", Placement(choice.layout, dists["output"]),
                        {args[0]: need}, spec)
        if choice.algorithm not in ("sample", "auto") and choice.source != "default":
            an.fail(node, f"{choice.source} asks for {choice.algorithm} on "
                    f"{dict(choice.layout or ())}, but {kind} runs sample-parallel or split over "
                    "channels and filters (stationary-x, -y, -w on a grid of N, C and F); "
                    "spatial parallelism is implemented for Conv2d", ValueError)
        step = super().place(an, node, module)
        step.kind = "sample-layer"
        return step

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        if step.layer.kind != "channel-conv":
            return super().build(module, node, step, grid)
        return DistChannelConv.from_module(module, grid=grid, algorithm=step.layer.algorithm)

    def param_dists(self, step: Any, module: Any) -> dict[str, Any] | None:
        if step.layer is None or step.layer.kind != "channel-conv":
            return super().param_dists(step, module)
        d = self._dists(step.layer.algorithm, module)
        return {"weight": d["weight"], "bias": d["bias"]}

    @staticmethod
    def _dists(algorithm: str, module: Any) -> dict[str, Any]:
        return channel_conv_dists(algorithm, _ROLES, module.weight.dim() - 2, _transposed(module))

    def price(self, report: Any, step: Any, module: Any, ctx: PriceContext) -> None:
        if step.layer is None or step.layer.kind != "channel-conv":
            report.param_elements = sum(p.numel() for p in module.parameters())
            report.dists["w"] = "w[" + ",".join("*" * module.weight.dim()) + "]"
            compute(report, step, module, ctx)
            return
        layout, d = step.layer.layout, self._dists(step.layer.algorithm, module)
        x, y = tuple(ctx.in_shape), tuple(ctx.out_shape or ())
        report.dists = {k: Placement(layout, d[v]).dist.format(k)
                        for k, v in (("x", "input"), ("w", "weight"), ("y", "output"))}
        report.param_elements = largest_block(Placement(layout, d["weight"]),
                                              tuple(module.weight.shape))
        if module.bias is not None:
            report.param_elements += largest_block(Placement(layout, d["bias"]),
                                                   (module.out_channels,))
        ext = dict(layout)
        gathers = [("forward", "allgather x over F", "allgather", "F", d["input"], d["work"], x),
                   ("forward", "reduce-scatter y over C", "reduce_scatter", "C", d["partial"],
                    d["output"], y)]
        backward = [("backward", "allgather dL/dy over C", "allgather", "C", d["output"],
                     d["partial"], y, True)]
        if ctx.grad_in:
            backward.append(("backward", "reduce-scatter dL/dx over F", "reduce_scatter", "F",
                             d["work"], d["input"], x, True))
        for phase, what, op, dim, src, dst, shape, *dual in (*gathers, *backward):
            if ext.get(dim, 1) == 1 or src == dst:
                continue
            per = {}
            for r in ctx.ranks:
                g = paper_grid(layout, r)
                a, b = (src.dual(g), dst.dual(g)) if dual else (src, dst)
                per[r] = plan_redistribution(layout, a, b, shape).received_bytes(g, ctx.itemsize)
            report.steps.append(CommStep(phase, what, op, per, ext[dim], layout, (dim,)))
        if d["work"] != d["input"]:  # the gathered input the weight gradient keeps
            report.activation_elements += largest_block(Placement(layout, d["work"]), x)
        if ctx.machine is not None and y:  # each weight element meets each position once
            shape = x if _transposed(module) else y  # (the input's, for a transposed layer)
            samples = -(-shape[0] // ext.get("N", 1))
            block = largest_block(Placement(layout, d["weight"]), tuple(module.weight.shape))
            flops = 2 * samples * math.prod(shape[2:]) * block
            report.forward_seconds = flops / ctx.machine.flop_rate
            report.backward_seconds = 2 * report.forward_seconds

    def samples(self) -> Sequence[Sample]:
        return (
            Sample("conv-transpose2d",
                   lambda: SampleNet(nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1,
                                                        output_padding=1), 4),
                   (5, 4, 7, 6), SAMPLE_GRIDS),
            Sample("conv3d-transpose3d", lambda: _Volume(), (5, 2, 5, 6, 4),
                   _split(SAMPLE_GRIDS, ("conv", "up"))),
            Sample("conv1d-transpose1d", lambda: _Signal(), (5, 3, 11),
                   _split(SAMPLE_GRIDS, ("conv",))),  # its up-convolution is grouped
        )


def _split(grids: Sequence[tuple[int, dict]], names: Sequence[str]
           ) -> tuple[tuple[int, dict], ...]:
    """``grids`` with their stationary defaults also given as an entry for the layers ``names``,
    so that those convolutions of a sample split over channels and filters."""
    out = []
    for size, config in grids:
        out.append((size, config))
        default = config["default"]
        if default["algorithm"].startswith("stationary-"):
            out.append((size, {**config, "layers": [{"match": n, **default} for n in names]}))
    return tuple(out)


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
