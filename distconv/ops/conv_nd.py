"""Convolutions over 1, 2 or 3 spatial dims other than a ``Conv2d`` -- ``Conv1d``, ``Conv3d``,
``ConvTranspose1d/2d/3d`` -- on their config entry's grid and algorithm
(:class:`~distconv.nn.conv_nd.DistConvNd`).

* ``spatial`` (the default's too) or ``stationary-x``/``-y``/``-w`` on a grid of N, C, F and the
  layer's spatial dims (``D``, ``H``, ``W`` of a volume; ``H``, ``W`` of an image; ``W`` of a
  signal): the layer split so, with halo exchanges over the split spatial dims; priced from the
  plans it runs.
* ``sample`` (and a stationary or ``auto`` default, which plans the ``Conv2d`` layers):
  sample-parallel (``x[o_N,*,...]``), the weights replicated and their gradients completed by
  the bucketed allreduce, on the entry's grid or the data grid.

Their inputs arrive in any distribution and are converted. A grouped convolution whose channel
blocks would not hold whole groups, ``pipeline`` and an explicit ``auto`` are refused by name: an
``auto`` entry is resolved by the whole-network planner (``plan_network(..., config=...)``,
which chooses among the options :func:`refusal` keeps and prices them with
:func:`layer_report`, this handler's own pricing), whose config names each layer's choice.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from torch import nn

from distconv.conv_geometry import HaloPlan
from distconv.nn.conv_nd import (
    DistConvNd, conv_nd_dims, conv_nd_dists, halo_bytes, spatial_roles,
)
from distconv.ops.base import (
    SAMPLE_GRIDS, SIGNAL_GRIDS, VOLUME_GRIDS, PriceContext, Sample, SampleNet,
)
from distconv.ops.linear import LinearHandler, compute
from distconv.nn.halo_conv import interior_share
from distconv.ops.conv import group_blocks, halo_overlap, row_refusal, whole_rows, whole_step
from distconv.pricing.timeline import CommStep, LayerReport, halo_hidden, largest_block
from distconv.parallel.placement import Placement, paper_grid
from distconv.redistribute import plan_redistribution

__all__ = ["ConvNdHandler", "layer_report", "refusal"]


def _roles(module: Any) -> dict[str, str]:
    rows = spatial_roles(module.weight.dim() - 2)
    return {"N": "N", "C": "C", "F": "F", **{r: r for r in rows}}


def _dists(algorithm: str, module: Any, layout: Any = ()) -> dict[str, Any]:
    ext = dict(layout or ())
    grouped = module.groups > 1 and ext.get("C", 1) * ext.get("F", 1) > 1
    return conv_nd_dists(algorithm, _roles(module), module.weight.dim() - 2,
                         bool(module.transposed), grouped)


def refusal(module: Any, layout: Any, algorithm: str, in_shape: Sequence[int]) -> str | None:
    """Why ``module`` (a ``Conv1d``, ``Conv3d`` or transposed convolution) cannot run with
    ``algorithm`` on the grid ``layout`` for the global input ``in_shape``, or None where it can:
    the rules :class:`~distconv.nn.conv_nd.DistConvNd` and its halo plans keep (every rank at
    least one sample, channel and filter, channel blocks holding whole groups, every rank at least
    one input and one output row on each split spatial dim)."""
    ext = {d: e for d, e in layout if e > 1}
    rows = spatial_roles(module.weight.dim() - 2)
    stray = sorted(set(ext) - {"N", "C", "F", *rows})
    if stray:
        return f"grid dims {stray} split no dim of a {type(module).__name__}"
    if algorithm in ("sample", "spatial") and {"C", "F"} & set(ext):
        return f"{algorithm} splits samples and spatial dims only"
    if algorithm == "sample" and set(ext) - {"N"}:
        return "sample splits samples only"
    c, f = ext.get("C", 1), ext.get("F", 1)
    if algorithm == "stationary-x" and f > 1 or algorithm == "stationary-y" and c > 1:
        return f"{algorithm} cannot split {'filters' if f > 1 else 'channels'}"
    if ext.get("N", 1) > in_shape[0]:
        return f"N={ext['N']} exceeds the batch {in_shape[0]}"
    if c > module.in_channels or f > module.out_channels:
        return f"C={c}, F={f} exceed the {module.in_channels} channels or {module.out_channels} " \
               "filters"
    if module.groups > 1 and module.groups % (c * f):
        return f"{c * f} channel blocks would not hold whole groups (groups={module.groups})"
    return row_refusal(module, layout, in_shape)


def layer_report(module: Any, layout: Any, algorithm: str, in_shape: Sequence[int],
                 out_shape: Sequence[int], *, ranks: Sequence[int], itemsize: int = 4,
                 machine: Any = None, grad_in: bool = True) -> LayerReport:
    """The report ``explain`` gives ``module`` placed with ``algorithm`` on the grid ``layout``
    (as a config entry places it: ``sample`` sample-parallel with full weights, ``spatial`` and
    the stationary algorithms split): its distributions, the collectives with the bytes each of
    ``ranks`` receives, its blocks and its compute seconds on ``machine`` (None: bytes only), by
    :meth:`ConvNdHandler.price` itself -- what the planner weighs a candidate with."""
    from distconv.parallel.steps import LayerSpec, Step, sample_dist

    layout = tuple(layout)
    kind = type(module).__name__
    report = LayerReport(kind, kind, str(dict(layout)), algorithm, {})
    if algorithm == "sample":
        need = Placement(layout, sample_dist(len(in_shape)))
        step = Step(None, "sample-layer", Placement(layout, sample_dist(len(out_shape))),
                    {"x": need}, LayerSpec("linear", kind, layout, "sample", input=need))
    else:
        run = "stationary-x" if algorithm == "spatial" else algorithm
        d = _dists(run, module, layout)
        need = Placement(layout, d["input"])
        step = Step(None, "conv", Placement(layout, d["output"]), {"x": need},
                    LayerSpec("conv-nd", kind, layout, run, tuple(sorted(_roles(module).items())),
                              need))
    ctx = PriceContext(tuple(in_shape), itemsize, list(ranks), grad_in, machine, tuple(out_shape))
    ConvNdHandler().price(report, step, module, ctx)
    return report


class ConvNdHandler(LinearHandler):
    """``Conv1d``, ``Conv3d`` and the transposed convolutions (module docstring)."""

    modules = (nn.Conv1d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import LayerSpec, Step, sample_dist

        name = str(node.target)
        choice = an.config.choice(name)
        kind = type(module).__name__
        live = {d for d, e in (choice.layout or ()) if e > 1}
        if choice.algorithm == "auto" and choice.source != "default":
            an.fail(node, "pass input_shape= to parallelize or explain (they plan it), or pass "
                    "the config() of distconv.planner.plan_network(model, input_shape, "
                    "config=..., world_size=..., machine=...), or give this "
                    f"{kind} sample, spatial or stationary-x/-y/-w: {choice.source} asks for "
                    "algorithm 'auto', which must be resolved before placement", ValueError)
        # a stationary default plans the Conv2d layers: these run sample-parallel under it
        split = choice.algorithm == "spatial" or (
            choice.algorithm.startswith("stationary-") and choice.source != "default")
        whole = whole_rows(an, node, module, choice) if split else ()
        if whole:
            return whole_step(an, node, an.tensor_args(node)[0], choice, whole)
        if split and live - {"N"}:
            roles = _roles(module)
            rows = [r for r in roles if r not in ("N", "C", "F")]
            stray = sorted(live - set(roles))
            if stray:
                an.fail(node, f"name grid dims {rows} (and N, C, F) instead: {choice.source} "
                        f"splits {stray} on {dict(choice.layout)}, but this {kind} has "
                        f"{len(rows)} spatial dim(s), split over grid dims {rows}", ValueError)
            ext = dict(choice.layout)
            blocks = ext.get("C", 1) * ext.get("F", 1)
            channels = min(module.in_channels, module.out_channels)
            if module.groups > 1 and module.groups % blocks:
                an.fail(node, "use C×F among "
                        f"{', '.join(map(str, group_blocks(module.groups, channels)))} "
                        f"(dividing {module.groups}), or split it over N and {rows} only: "
                        f"{choice.source} asks for {choice.algorithm} on {dict(choice.layout)}, "
                        f"but this {kind} is grouped (groups={module.groups}) and its {blocks} "
                        "channel blocks would not hold whole groups", ValueError)
            if choice.pipeline > 1:
                an.fail(node, f"leave pipeline out for {choice.source}: it asks for pipeline: "
                        f"{choice.pipeline}, which is implemented for Conv2d, not this {kind}",
                        ValueError)
            algorithm = "stationary-x" if choice.algorithm == "spatial" else choice.algorithm
            dists = _dists(algorithm, module, choice.layout)
            args = an.tensor_args(node)
            need = Placement(choice.layout, dists["input"])
            spec = LayerSpec("conv-nd", name, choice.layout, algorithm,
                             tuple(sorted(roles.items())), need, choice.source,
                             overlap=halo_overlap(an, node, module, choice,
                                                  dict(choice.layout)))
            return Step(node, "conv", Placement(choice.layout, dists["output"]),
                        {args[0]: need}, spec)
        # sample-parallel: on the entry's grid where it is a sample entry or names a grid that
        # splits samples only (spatial, stationary), else on the data grid
        own = choice.layout is not None and (choice.algorithm == "sample" or (
            choice.source != "default" and choice.algorithm != "auto"))
        layout = choice.layout if own else an.config.data
        args = an.tensor_args(node)
        need = Placement(layout, sample_dist(an.placement(args[0]).ndim))
        return Step(node, "sample-layer", need, {args[0]: need},
                    LayerSpec("linear", name, layout, "sample", input=need,
                              source=choice.source if own else "data"))

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        if step.layer.kind != "conv-nd":
            return super().build(module, node, step, grid)
        return DistConvNd.from_module(module, grid=grid, algorithm=step.layer.algorithm,
                                      overlap=step.layer.overlap)

    def refuse(self, step: Any, module: Any, in_shape: tuple[int, ...]) -> str | None:
        if step.layer is None or step.layer.kind != "conv-nd":
            return None
        return row_refusal(module, step.layer.layout, in_shape)

    def param_dists(self, step: Any, module: Any) -> dict[str, Any] | None:
        if step.layer is None or step.layer.kind != "conv-nd":
            return super().param_dists(step, module)
        d = _dists(step.layer.algorithm, module, step.layer.layout)
        return {"weight": d["weight"], "bias": d["bias"]}

    def price(self, report: Any, step: Any, module: Any, ctx: PriceContext) -> None:
        if step.layer is None or step.layer.kind != "conv-nd":
            report.param_elements = sum(p.numel() for p in module.parameters())
            report.dists["w"] = "w[" + ",".join("*" * module.weight.dim()) + "]"
            compute(report, step, module, ctx)
            return
        layout = step.layer.layout
        d = _dists(step.layer.algorithm, module, layout)
        x, y = tuple(ctx.in_shape), tuple(ctx.out_shape or ())
        report.dists = {k: Placement(layout, d[v]).dist.format(k)
                        for k, v in (("x", "input"), ("w", "weight"), ("y", "output"))}
        report.param_elements = largest_block(Placement(layout, d["weight"]),
                                              tuple(module.weight.shape))
        if module.bias is not None:
            report.param_elements += largest_block(Placement(layout, d["bias"]),
                                                   (module.out_channels,))
        ext = dict(layout)
        halos = {r: halo_bytes(module, d, layout, x, r, ctx.itemsize) for r in ctx.ranks}
        order = [dim for dim, _, _ in halos[ctx.ranks[0]]]
        self._collective(report, ctx, layout, "forward", "allgather x over F", "allgather",
                         "F", d["input"], d["work"], x)
        self._halo(report, ctx, layout, halos, order, "forward")
        self._collective(report, ctx, layout, "forward", "reduce-scatter y over C",
                         "reduce_scatter", "C", d["partial"], d["output"], y)
        self._collective(report, ctx, layout, "backward", "allgather dL/dy over C", "allgather",
                         "C", d["output"], d["partial"], y, dual=True)
        if ctx.grad_in:
            self._halo(report, ctx, layout, halos, order[::-1], "backward")
            self._collective(report, ctx, layout, "backward", "reduce-scatter dL/dx over F",
                             "reduce_scatter", "F", d["work"], d["input"], x, dual=True)
        if d["work"] != d["input"]:  # the gathered input the weight gradient keeps
            report.activation_elements += largest_block(Placement(layout, d["work"]), x)
        if ctx.machine is not None and y:  # each weight element meets each position once
            # (the input's positions, for a transposed layer: each scatters through the weight)
            shape = x if module.transposed else y
            rows = spatial_roles(len(shape) - 2)
            positions = -(-shape[0] // ext.get("N", 1)) * math.prod(
                -(-n // ext.get(r, 1)) for n, r in zip(shape[2:], rows))
            block = largest_block(Placement(layout, d["weight"]), tuple(module.weight.shape))
            report.forward_seconds = 2 * positions * block / ctx.machine.flop_rate
            report.backward_seconds = 2 * report.forward_seconds
            if step.layer.overlap:  # the interior rows run while the halo travels
                steps = {f"{s.what}": s.seconds(ctx.machine) for s in report.steps}
                steps["local conv forward"] = report.forward_seconds
                steps["local conv backward"] = report.backward_seconds
                report.overlap = halo_hidden(steps, _interior_nd(module, x, layout), ctx.machine)
        if step.layer.overlap:
            report.note = "halo overlapped"

    @staticmethod
    def _collective(report: Any, ctx: PriceContext, layout: Any, phase: str, what: str, op: str,
                    dim: str, src: Any, dst: Any, shape: tuple[int, ...],
                    dual: bool = False) -> None:
        ext = dict(layout)
        if ext.get(dim, 1) == 1 or src == dst:
            return
        per = {}
        for r in ctx.ranks:
            g = paper_grid(layout, r)
            a, b = (src.dual(g), dst.dual(g)) if dual else (src, dst)
            per[r] = plan_redistribution(layout, a, b, shape).received_bytes(g, ctx.itemsize)
        report.steps.append(CommStep(phase, what, op, per, ext[dim], layout, (dim,)))

    @staticmethod
    def _halo(report: Any, ctx: PriceContext, layout: Any, halos: dict, order: list[str],
              phase: str) -> None:
        what = "halo exchange" if phase == "forward" else "halo accumulate"
        for dim in order:
            per = {r: next(f if phase == "forward" else b for g, f, b in halos[r] if g == dim)
                   for r in ctx.ranks}
            report.steps.append(CommStep(phase, f"{what} {dim}", "alltoall", per,
                                         dict(layout)[dim], layout, (dim,)))

    def samples(self) -> Sequence[Sample]:
        return (
            Sample("conv-transpose2d",
                   lambda: SampleNet(nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1,
                                                        output_padding=1), 4),
                   (5, 4, 7, 6), SAMPLE_GRIDS),
            Sample("conv3d-transpose3d", lambda: _Volume(), (5, 2, 5, 6, 4),
                   _split(SAMPLE_GRIDS, ("conv", "up")) + VOLUME_GRIDS[2:]),
            Sample("conv1d-transpose1d", lambda: _Signal(), (5, 3, 11),  # its up-conv: 2 groups
                   _split(SAMPLE_GRIDS[:1] + SAMPLE_GRIDS[2:], ("conv",)) + SIGNAL_GRIDS[1:]),
            Sample("grouped-volume", lambda: _Volume(groups=4), (5, 4, 4, 5, 3),
                   _split(SAMPLE_GRIDS, ("conv", "up")) + VOLUME_GRIDS[2:]),
        )


def _interior_nd(module: Any, x_shape: tuple[int, ...], layout: Any) -> float:
    """The least share of a rank's output rows an overlapped N-d layer convolves while its halo
    travels (its one split spatial dim's interior rows)."""
    ext = dict(layout)
    rows = spatial_roles(len(x_shape) - 2)
    i = next(i for i, r in enumerate(rows) if ext.get(r, 1) > 1)
    plan = HaloPlan(conv_nd_dims(module, x_shape)[i], ext[rows[i]], "zeros")
    return min(interior_share(plan, r, module.kernel_size[i], module.stride[i],
                              module.dilation[i]) for r in range(ext[rows[i]]))


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
    """A Conv3d and a ConvTranspose3d (``groups``: both grouped, 4 channels each)."""

    def __init__(self, groups: int = 1) -> None:
        super().__init__()
        if groups == 1:
            self.conv = nn.Conv3d(2, 4, 3, padding=1, stride=(1, 2, 1))
            self.up = nn.ConvTranspose3d(4, 3, 2, stride=2)
        else:
            self.conv = nn.Conv3d(4, 4, 3, padding=1, stride=(1, 2, 1), groups=groups)
            self.up = nn.ConvTranspose3d(4, 4, 2, stride=2, groups=groups)
        self.head = nn.Linear(self.up.out_channels, 3)

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
