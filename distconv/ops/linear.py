"""``Linear`` layers. A head on features ``[N, F]`` (or a Linear a config entry names) runs
sample-parallel (``[o_N,*]``) on its entry's grid, its weights replicated; the gradient
completion (a bucketed allreduce) is the only traffic. A Linear on the last dim of a value with
more dims (a channels-last activation ``[N, H, W, C]`` of a ConvNeXt block, say) runs on the
split it meets: its leading dims are rows, split any way, so with the last dim whole it is the
plain module on each rank's rows; with the last dim split over grid dims ``C`` it is
stationary-x over them (:class:`~distconv.nn.linear.DistLinear`: a local matmul with
``w[*,o_C]``, then a reduce-scatter over ``C`` onto ``y[...,o_C]``). That is exact, moves the
output once (``Σ_C`` reduced into blocks, no gather of the input), and leaves the out-features
split like the in-features for the next channels-last op.

A layer's own entry with ``stationary-x``, ``-y`` or ``-w`` (a stage of a ConvNeXt, whose MLP is
two channels-last Linears) runs it channel-, filter- or channel-and-filter-parallel on its
features, as a 1×1 convolution would: ``x[o_N,...,o_C]`` with ``w[*,o_C]`` and a reduce-scatter
of y over C; ``x[o_N,...,o_F]`` gathered over F with ``w[o_F,*]``; ``x[o_N,...,o_{C×F}]``
gathered over F with ``w[o_F,o_C]`` and y reduce-scattered over C onto ``y[o_N,...,o_{F×C}]``.
The leading dims are the samples (over N) and, of a 4-d value, its rows and columns (over H, W).
A grid that splits neither C nor F runs it on the rows.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from torch import nn

from distconv.distribution import Dist
from distconv.nn.linear import LINEAR_ALGORITHMS, DistLinear, linear_dists
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
    #: ``nn.Linear`` subclasses whose forward is ``F.linear`` of their own weight and bias (timm's
    #: classifier heads): one call, as ``nn.Linear``
    module_names = frozenset({"timm.layers.linear.Linear"})

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import LayerSpec, Step, sample_dist

        name = str(node.target)
        choice = an.config.choice(name)
        if (choice.algorithm not in ("sample", "auto", *LINEAR_ALGORITHMS)
                and choice.source != "default"):
            an.fail(node, "give this Linear algorithm 'sample' or stationary-x, -y or -w: "
                    f"{choice.source} asks for {choice.algorithm}, but Linear layers run "
                    "sample-parallel or stationary-x, -y, -w over their features", ValueError)
        args = an.tensor_args(node)
        met = an.placement(args[0]).settled()
        if met.ndim > 2 and choice.source == "default":
            return self._in_place(node, args[0], name, met)
        if (choice.algorithm in LINEAR_ALGORITHMS and choice.layout is not None
                and choice.source != "default"):
            return self._stationary(an, node, args[0], module, choice, met.ndim)
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
    def _stationary(an: Any, node: Any, arg: Any, module: Any, choice: Any, ndim: int) -> Any:
        """A layer's own stationary-x, -y or -w entry: the features over C, F or C×F (the
        algorithm the grid splits: stationary-w on a grid without F is stationary-x), the
        samples over N, a 4-d value's rows and columns over H and W. Stationary-w takes a
        value that arrives ``o_{F×C}`` on its grid (a stationary-w layer's y) with F and C in
        each other's roles, moving no data, as the paper's next layer does."""
        from distconv.parallel.steps import LayerSpec, Step

        ext = dict(choice.layout)
        c = "C" if ext.get("C", 1) > 1 and choice.algorithm != "stationary-y" else None
        f = "F" if ext.get("F", 1) > 1 and choice.algorithm != "stationary-x" else None
        algorithm = {(True, True): "stationary-w", (True, False): "stationary-x",
                     (False, True): "stationary-y", (False, False): "rows"}[(bool(c), bool(f))]
        unused = [d for d in ("C", "F", "D") if ext.get(d, 1) > 1 and d not in (c, f)]
        if unused or (ndim != 4 and (ext.get("H", 1) > 1 or ext.get("W", 1) > 1)):
            an.fail(node, f"give {choice.source} a grid of N, C and F (and H, W for a 4-d "
                    f"channels-last value) that {choice.algorithm} uses: this Linear on a "
                    f"{ndim}-d value cannot use {dict(choice.layout)}", ValueError)
        blocks = ext.get("C", 1) * ext.get("F", 1) if algorithm != "rows" else 1
        for what, n in (("in_features", module.in_features),
                        ("out_features", module.out_features)):
            if n < blocks:
                an.fail(node, f"use at most {n} C×F ranks for {choice.source}: layer "
                        f"{str(node.target)!r} has {what}={n}, fewer than the {blocks} "
                        f"feature blocks of {dict(choice.layout)}", ValueError)
        lead = ("N",) + (("H", "W") if ndim == 4 else (None,) * (ndim - 2))
        last = (c, f) if c and f else (c or f)
        need = Placement(choice.layout, Dist(lead + (last,)))
        met = an.placement(arg)
        if algorithm == "stationary-w" and met.layout == need.layout and (
                met.dist.entries[-1] == (f, c)):  # the y of a stationary-w layer: roles swap
            need = Placement(choice.layout, Dist(lead + ((f, c),)))
        out = need if algorithm == "rows" else Placement(
            choice.layout, linear_dists(algorithm, need.dist)["output"])
        return Step(node, "linear", out, {arg: need},
                    LayerSpec("linear", str(node.target), choice.layout, algorithm,
                              input=need, source=choice.source))

    @staticmethod
    def _split(step: Any) -> bool:
        return step.layer.algorithm in LINEAR_ALGORITHMS

    @staticmethod
    def _dists(step: Any) -> dict[str, Dist]:
        return linear_dists(step.layer.algorithm, step.layer.input.dist)

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        if not self._split(step):
            return None  # the plain module on local rows
        return DistLinear.from_module(module, grid=grid, input_dist=step.layer.input.dist,
                                      algorithm=step.layer.algorithm)

    def param_dists(self, step: Any, module: Any) -> dict[str, Any] | None:
        if not self._split(step):
            return None
        d = self._dists(step)
        return {"weight": d["weight"], "bias": d["bias"]}

    def price(self, report: Any, step: Any, module: Any, ctx: PriceContext) -> None:
        if not self._split(step):
            report.param_elements = sum(p.numel() for p in module.parameters())
            report.dists["w"] = "w[*,*]"
            compute(report, step, module, ctx)
            return
        layout = step.layer.layout
        d = self._dists(step)
        w = Placement(layout, d["weight"])
        report.param_elements = largest_block(w, tuple(module.weight.shape)) + (
            0 if module.bias is None else largest_block(Placement(layout, d["bias"]),
                                                        (module.out_features,)))
        report.dists = {"x": d["input"].format("x"), "w": w.dist.format("w"),
                        "y": d["output"].format("y")}
        x_shape = tuple(ctx.in_shape)
        y_shape = x_shape[:-1] + (module.out_features,)
        zero = paper_grid(layout, 0)
        moves = (("forward", "x allgather", d["input"], d["work"], x_shape, True),
                 ("forward", "y reduce-scatter", d["partial"], d["output"], y_shape, True),
                 ("backward", "dL/dy allgather", d["output"].dual(zero),
                  d["partial"].dual(zero), y_shape, True),
                 ("backward", "dL/dx reduce-scatter", d["work"].dual(zero),
                  d["input"].dual(zero), x_shape, ctx.grad_in))
        for phase, what, src, dst, shape, runs in moves:
            plan = plan_redistribution(layout, src, dst, shape)
            if not runs or not plan.steps:
                continue
            dims = tuple(g for g in (src.used() | src.pending | dst.used() | dst.pending)
                         - (src.used() & dst.used()) if dict(layout).get(g, 1) > 1)
            dims = tuple(g for g, _ in layout if g in dims)
            nbytes = {r: plan.received_bytes(paper_grid(layout, r), ctx.itemsize)
                      for r in ctx.ranks}
            report.steps.append(CommStep(
                phase, f"{what} over {'×'.join(dims)}", what.split()[-1].replace("-", "_"),
                nbytes, math.prod(dict(layout)[g] for g in dims), layout, dims))
        if ctx.machine is not None:
            rows = largest_block(Placement(layout, d["work"]), x_shape)
            outs = largest_block(Placement(layout, Dist((d["weight"].entries[0],))),
                                 (module.out_features,))
            report.forward_seconds = 2 * rows * outs / ctx.machine.flop_rate
            report.backward_seconds = 2 * report.forward_seconds

    def samples(self) -> Sequence[Sample]:
        def own(match: str, grid: dict, algorithm: str, world: int = 4) -> tuple[int, dict]:
            return (world, {"default": {"grid": {"N": world}, "algorithm": "sample"},
                            "layers": [{"match": match, "grid": grid, "algorithm": algorithm}]})

        return (Sample("linear-head", lambda: SampleNet(nn.Identity(), 4), (5, 4, 6, 6), (
            (2, {"default": {"grid": {"N": 2}, "algorithm": "sample"}}),
            (4, {"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"},
                 "layers": [{"match": "head", "grid": {"N": 4}, "algorithm": "sample"}]}),
            own("head", {"N": 2, "C": 2}, "stationary-x"),
            own("head", {"N": 2, "F": 2}, "stationary-y"),
        )),
                Sample("linear-channels-last", lambda: SampleNet(_ChannelsLast(), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS),
                # a layer's own entry over the MLP: its features over C, F, C×F (the second
                # Linear takes the first's y[...,o_{F×C}] with the roles swapped), and C with
                # the rows over H
                Sample("linear-channels-last-own-entry", lambda: SampleNet(_ChannelsLast(), 4),
                       (5, 4, 7, 6), (
                           own("layer.*", {"N": 2, "C": 2}, "stationary-x"),
                           own("layer.*", {"N": 2, "F": 2}, "stationary-y"),
                           own("layer.*", {"C": 2, "F": 2}, "stationary-w"),
                           own("layer.*", {"H": 2, "C": 2}, "stationary-x"),
                           own("layer.*", {"C": 3}, "stationary-x", 3),
                       )))


class _ChannelsLast(nn.Module):
    """Two Linears on the last dim of a channels-last activation, as a ConvNeXt block's MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 4, bias=False)

    def forward(self, x: Any) -> Any:
        return self.fc2(self.fc1(x.permute(0, 2, 3, 1)).relu()).permute(0, 3, 1, 2)
