"""``Linear`` layers. A head on features ``[N, F]`` (or a Linear a config entry names) runs
sample-parallel (``[o_N,*]``) on its entry's grid, its weights replicated; the gradient
completion (a bucketed allreduce) is the only traffic. A Linear on the last dim of a value with
more dims (a channels-last activation ``[N, H, W, C]`` of a ConvNeXt block, say) runs on the
split it meets: its leading dims are rows, split any way, so with the last dim whole it is the
plain module on each rank's rows; with the last dim split over grid dims ``C`` it is
stationary-x over them (:class:`~distconv.nn.linear.DistLinear`: a local matmul with
``w[*,o_C]``, then a reduce-scatter over ``C`` onto ``y[...,o_C]``). That is exact, moves the
output once (``Σ_C`` reduced into blocks, no gather of the input), and leaves the out-features
split like the in-features for the next channels-last op."""

from __future__ import annotations

import math
from typing import Any, Sequence

from torch import nn

from distconv.distribution import Dist
from distconv.nn.linear import DistLinear
from distconv.ops.base import SAMPLE_GRIDS, Handler, PriceContext, Sample, SampleNet
from distconv.pricing.timeline import CommStep, largest_block
from distconv.parallel.config import LayerChoice
from distconv.parallel.placement import Placement, paper_grid
from distconv.redistribute import plan_redistribution

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
        args = an.tensor_args(node)
        met = an.placement(args[0]).settled()
        if met.ndim > 2 and choice.source == "default":
            return self._in_place(node, args[0], name, met)
        if choice.algorithm != "sample" or choice.layout is None:
            choice = LayerChoice(an.config.data, "sample", "data")
        need = Placement(choice.layout, sample_dist(an.placement(args[0]).ndim))
        return Step(node, "linear", need, {args[0]: need},
                    LayerSpec("linear", name, choice.layout, "sample", input=need,
                              source=choice.source))

    @staticmethod
    def _in_place(node: Any, arg: Any, name: str, met: Placement) -> Any:
        """On the placement it meets: rows as they are; the last dim split: stationary-x."""
        from distconv.parallel.steps import LayerSpec, Step

        split = bool(met.dist.grid_dims_of(met.ndim - 1))
        return Step(node, "linear", met, {arg: met},
                    LayerSpec("linear", name, met.layout,
                              "stationary-x" if split else "rows", input=met, source="default"))

    @staticmethod
    def _split(step: Any) -> bool:
        return step.layer.algorithm == "stationary-x"

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        if not self._split(step):
            return None  # the plain module on local rows
        return DistLinear.from_module(module, grid=grid, input_dist=step.layer.input.dist)

    def param_dists(self, step: Any, module: Any) -> dict[str, Any] | None:
        if not self._split(step):
            return None
        entry = step.layer.input.dist.entries[-1]
        return {"weight": Dist((None, entry)), "bias": Dist((entry,))}

    def price(self, report: Any, step: Any, module: Any, ctx: PriceContext) -> None:
        if not self._split(step):
            report.param_elements = sum(p.numel() for p in module.parameters())
            report.dists["w"] = "w[*,*]"
            compute(report, step, module, ctx)
            return
        p = step.out
        dists = self.param_dists(step, module)
        w = Placement(p.layout, dists["weight"])
        report.param_elements = largest_block(w, tuple(module.weight.shape)) + (
            0 if module.bias is None else largest_block(Placement(p.layout, dists["bias"]),
                                                        (module.out_features,)))
        report.dists["w"] = w.dist.format("w")
        split = tuple(g for g in p.dist.grid_dims_of(p.ndim - 1))
        partial = Dist(p.dist.entries[:-1] + (None,), frozenset(split))
        shape = tuple(ctx.in_shape[:-1]) + (module.out_features,)
        plan = plan_redistribution(p.layout, partial, p.dist, shape)
        back = plan_redistribution(p.layout, p.dist.dual(paper_grid(p.layout, 0)),
                                   partial.dual(paper_grid(p.layout, 0)), shape)
        fwd = {r: plan.received_bytes(paper_grid(p.layout, r), ctx.itemsize) for r in ctx.ranks}
        bwd = {r: back.received_bytes(paper_grid(p.layout, r), ctx.itemsize)
               for r in ctx.ranks}
        peers = math.prod(dict(p.layout)[g] for g in split)
        label = "×".join(split)
        report.steps.append(CommStep("forward", f"y reduce-scatter over {label}",
                                     "reduce_scatter", fwd, peers, p.layout, split))
        report.steps.append(CommStep("backward", f"dL/dy allgather over {label}", "allgather",
                                     bwd, peers, p.layout, split))

    def samples(self) -> Sequence[Sample]:
        return (Sample("linear-head", lambda: SampleNet(nn.Identity(), 4), (5, 4, 6, 6), (
            (2, {"default": {"grid": {"N": 2}, "algorithm": "sample"}}),
            (4, {"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"},
                 "layers": [{"match": "head", "grid": {"N": 4}, "algorithm": "sample"}]}),
        )),
                Sample("linear-channels-last", lambda: SampleNet(_ChannelsLast(), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS))


class _ChannelsLast(nn.Module):
    """Two Linears on the last dim of a channels-last activation, as a ConvNeXt block's MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 4, bias=False)

    def forward(self, x: Any) -> Any:
        return self.fc2(self.fc1(x.permute(0, 2, 3, 1)).relu()).permute(0, 3, 1, 2)
