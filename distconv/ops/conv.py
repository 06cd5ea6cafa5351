"""Convolutions: ``nn.Conv2d`` on its config entry's grid and algorithm (Dryden et al. §3).

``sample`` and ``spatial`` are stationary-x with C = F = 1. The node takes ``x`` in the
algorithm's input distribution and gives ``y`` in its output distribution; a stationary-w layer
whose input arrives as ``x[o,o_{F×C},o,o]`` on its own grid swaps its channel/filter roles and
takes it with no data movement. Bytes and time per rank are the §4 model's
(:func:`distconv.pricing.traffic.conv_traffic`), which the communicators' counts equal.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from distconv.conv_groups import group_role, groups_aligned
from distconv.nn.conv import DistConv2d, conv_dists
from distconv.conv_geometry import HaloPlan
from distconv.nn.conv_nd import conv_nd_dims, spatial_roles
from distconv.nn.halo_conv import interior_share
from distconv.ops.base import SAMPLE_GRIDS, Handler, PriceContext, Sample, SampleNet
from distconv.ops.extents import captured_shape, unit_dims
from distconv.ops.linear import compute
from distconv.parallel.placement import Placement, paper_grid, same_blocks
from distconv.pricing.cost import conv_cost
from distconv.pricing.problem import ConvProblem
from distconv.pricing.timeline import CommStep, halo_hidden, largest_block
from distconv.pricing.traffic import conv_traffic

__all__ = ["ConvHandler", "group_blocks", "memory_elements", "moves_data", "row_refusal",
           "split_groups", "whole_rows", "whole_step"]


def _dists(step: Any, conv: nn.Conv2d) -> dict[str, Any]:
    spec = step.layer
    roles = dict(spec.roles)
    return conv_dists(spec.algorithm, roles, *grouping(conv, spec.layout, spec.algorithm, roles))


def grouping(conv: Any, layout: Any, algorithm: str, roles: dict[str, str]
             ) -> tuple[bool, bool]:
    """``(grouped, gather)`` of a convolution on ``layout`` under ``algorithm``: whether it is
    grouped and split over C, F or C×F, and whether its blocks then cut groups (x gathered over
    them first: :class:`~distconv.nn.conv.DistConv2d`)."""
    ext = dict(layout)
    if conv.groups == 1 or ext.get(roles["C"], 1) * ext.get(roles["F"], 1) == 1:
        return False, False
    _, extents = group_role(algorithm, ext, roles["C"], roles["F"])
    return True, not groups_aligned(conv.in_channels, conv.out_channels, conv.groups, extents)


def moves_data(layout: Any, dists: dict[str, Any]) -> bool:
    """Whether a convolution with ``dists`` (:func:`~distconv.nn.conv.conv_dists`) on
    ``layout`` runs a collective of its own (an allgather of x over F, a reduce-scatter of y over
    C): what pipelining can overlap."""
    return any(Placement(layout, dists[a]) != Placement(layout, dists[b])
               for a, b in (("input", "work"), ("partial", "output")))


def memory_elements(layout: Any, dists: dict[str, Any], conv: Any,
                    in_shape: Sequence[int]) -> tuple[int, int]:
    """Per rank (the largest blocks) of a convolution on ``layout`` with ``dists``
    (:func:`~distconv.nn.conv.conv_dists`): its parameter elements, the elements of its gathered
    working input that autograd keeps for the weight gradient (0 when the local convolution
    reads its input block as it arrives). ``conv`` needs
    ``in_channels``, ``out_channels``, ``groups``, ``kernel_size`` and ``bias``. What ``explain``
    reports and the planner's memory estimate uses."""
    kernel = tuple(conv.kernel_size) if not isinstance(conv.kernel_size, int) else (
        conv.kernel_size, conv.kernel_size)
    w_shape = (conv.out_channels, conv.in_channels // conv.groups, *kernel)
    params = largest_block(Placement(layout, dists["weight"]), w_shape)
    if conv.bias is not None and conv.bias is not False:
        params += largest_block(Placement(layout, dists["bias"]), (conv.out_channels,))
    work, given = Placement(layout, dists["work"]), Placement(layout, dists["input"])
    kept = largest_block(work, tuple(in_shape)) if work != given else 0
    return params, kept


def check_channel_blocks(an: Any, node: Any, module: Any, choice: Any) -> None:
    """Refuse a Conv2d entry whose C×F channel/filter blocks outnumber its channels or filters,
    as DistConv2d does, so that explain never prices what parallelize refuses."""
    ext = dict(choice.layout)
    parts = ext.get("C", 1) * ext.get("F", 1)
    for what, n in (("in_channels", module.in_channels), ("out_channels", module.out_channels)):
        if n < parts:
            an.fail(node, f"use at most {n} C×F ranks for {choice.source}: layer "
                    f"{str(node.target)!r}: {what}={n} is smaller than the {parts} "
                    f"channel/filter blocks of {dict(choice.layout)}", ValueError)


def row_refusal(module: Any, layout: Any, in_shape: Sequence[int]) -> str | None:
    """Why the grid ``layout`` cannot split the spatial dims of convolution ``module`` (any
    dimensionality) on the global input ``in_shape``: some rank would hold no input or no
    output row, or a padding mode cannot be split; None where it can."""
    ext = {d: e for d, e in layout if e > 1}
    rows = spatial_roles(module.weight.dim() - 2)
    for row, d in zip(rows, conv_nd_dims(module, in_shape)):
        if ext.get(row, 1) > 1:
            try:
                HaloPlan(d, ext[row], module.padding_mode).check(row)
            except ValueError as exc:
                return str(exc)
    return None


def halo_overlap(an: Any, node: Any, module: Any, choice: Any, ext: dict[str, int]) -> bool:
    """Whether the layer overlaps its halo exchange with its interior rows (``overlap`` in its
    config entry): where it splits one spatial dim with a halo and pads with zeros; a layer
    entry that asks for it elsewhere is refused, the default's applies where it can."""
    if not choice.overlap:
        return False
    rows = spatial_roles(module.weight.dim() - 2)
    split = [i for i, d in enumerate(rows) if ext.get(d, 1) > 1]
    kernel = _as_tuple(module.kernel_size, len(rows))
    dilation = _as_tuple(module.dilation, len(rows))
    transposed = isinstance(module, nn.modules.conv._ConvTransposeNd)
    if (len(split) == 1 and module.padding_mode == "zeros" and not transposed
            and (kernel[split[0]] - 1) * dilation[split[0]] > 0):
        return True
    if choice.overlap == "required":
        an.fail(node, "leave overlap out for this layer, or put it in the default entry (which "
                f"applies where it can): {choice.source} asks for overlap, but this "
                f"{type(module).__name__} on {dict(choice.layout)} has no halo of one split "
                "spatial dim to overlap (it needs exactly one split spatial dim, a kernel wider "
                "than one row there, zero padding and a direct convolution)", ValueError)
    return False


def _interior(conv: Any, x_shape: tuple[int, ...], spec: Any, roles: dict[str, str]) -> float:
    """The least share of a rank's output rows an overlapped layer convolves while its halo
    travels (the interior rows of its one split spatial dim)."""
    from distconv.conv_geometry import HaloPlan, conv_dims, normalize_padding

    ext = dict(spec.layout)
    i = next(i for i, r in enumerate(("H", "W")) if ext.get(roles[r], 1) > 1)
    kernel, stride = _as_tuple(conv.kernel_size, 2), _as_tuple(conv.stride, 2)
    dilation = _as_tuple(conv.dilation, 2)
    pads = normalize_padding(conv.padding, kernel, stride, dilation)
    dim = conv_dims(x_shape[2:], kernel, stride, dilation, pads)[i]
    parts = ext[roles[("H", "W")[i]]]
    plan = HaloPlan(dim, parts, "zeros")
    return min(interior_share(plan, r, kernel[i], stride[i], dilation[i]) for r in range(parts))


def _as_tuple(value: Any, k: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * k


def _roles_and_dists(an: Any, args: list, module: Any, choice: Any, algorithm: str
                     ) -> tuple[dict[str, str], dict[str, Any]]:
    """A Conv2d's grid-dim roles and distributions (:func:`~distconv.nn.conv.conv_dists`) for
    ``choice``: stationary-w takes C and F swapped when its input arrives split over F×C."""
    roles = {"N": "N", "C": "C", "F": "F", "H": "H", "W": "W"}
    if algorithm == "stationary-w" and args:
        src = an.placement(args[0])
        if src.layout == choice.layout and src.dist.entries[1] == ("F", "C"):
            roles["C"], roles["F"] = "F", "C"
    return roles, conv_dists(algorithm, roles,
                             *grouping(module, choice.layout, algorithm, roles))


def _takes_gathered(an: Any, node: Any, value: Any, choice: Any, dists: dict[str, Any]) -> bool:
    """Whether this unpipelined layer, which gathers x over F (its input and working
    distributions differ), takes x gathered as the operand's conversion instead: where ``value``
    must move anyway (it is not in the layer's input placement; no pending sums), since a move
    straight to the gathered placement receives on every rank only what that rank lacks of it,
    never more than the move to the input and the allgather after it (a sample-split value: one
    allgather, not an all-to-all and an allgather); or where another Conv2d reading ``value``
    gathers it to the same placement."""
    if choice.pipeline > 1 or dists["input"] == dists["work"]:
        return False
    mine = (Placement(choice.layout, dists["input"]), Placement(choice.layout, dists["work"]))
    src = an.placement(value)
    if not src.dist.pending and not same_blocks(src, mine[0]):
        return True
    for user in value.users:
        if user is node or user.op != "call_module":
            continue
        other = an.modules.get(user.target)
        if not isinstance(other, nn.Conv2d) or an.tensor_args(user)[:1] != [value]:
            continue
        ch = an.config.choice(str(user.target))
        if ch.algorithm not in ("stationary-y", "stationary-w") or ch.pipeline > 1:
            continue
        _, d = _roles_and_dists(an, [value], other, ch, ch.algorithm)
        if (Placement(ch.layout, d["input"]), Placement(ch.layout, d["work"])) == mine:
            return True
    return False


def gathered(step: Any, module: Any) -> bool:
    """Whether the analysis placed a Conv2d step's input gathered over F (its need is the
    layer's working distribution, not its input distribution)."""
    d, layout = _dists(step, module), step.layer.layout
    work = Placement(layout, d["work"])
    return Placement(layout, d["input"]) != work and step.layer.input == work


def whole_rows(an: Any, node: fx.Node, module: Any, choice: Any) -> tuple[str, ...]:
    """The spatial grid dims of a default entry that split a convolution's input of one row
    (:func:`unit_dims`), or maps too small to split on the input shape the model was captured on
    (:func:`captured_shape`; running whole is exact on every shape): that layer runs with them
    whole. Empty where the entry is a layer's own (it stays refused where it cannot split), or
    the rows split."""
    if choice.source != "default" or choice.layout is None:
        return ()
    ext = dict(choice.layout)
    rows = spatial_roles(module.weight.dim() - 2)
    split = [(d, r) for d, r in enumerate(rows, 2) if ext.get(r, 1) > 1]
    args = an.tensor_args(node)
    if not split or not args:
        return ()
    ones = unit_dims(an, args[0])
    if all(d in ones for d, _ in split):
        return tuple(r for _, r in split)
    hint = captured_shape(args[0])  # maps too small to split on the captured input shape
    if hint is not None and row_refusal(module, choice.layout, hint) is not None:
        return tuple(r for _, r in split)
    return ()


def group_blocks(groups: int, channels: int) -> list[int]:
    """The channel/filter block counts (C×F) whose blocks hold whole groups of a grouped
    convolution: the divisors of ``groups`` up to ``channels``."""
    return [p for p in range(1, min(groups, channels) + 1) if groups % p == 0]


def split_groups(an: Any, node: fx.Node, module: Any, choice: Any) -> tuple[str, ...]:
    """The grid dims a convolution keeps whole under a default entry where its C×F blocks
    would not divide its groups (RegNet's 25 groups over C = 2, a depthwise layer of odd width)
    or outnumber its channels (an RGB stem, a squeeze-and-excitation's narrow layer): it runs
    with its channels (and rows) whole, ``x[o_N,*,*,*]``, as the planner and K-FAC expect. A
    layer's own entry splits its groups as asked: locally where every block holds the same
    whole groups, else with x gathered over the blocks first
    (:class:`~distconv.nn.conv.DistConv2d`); :func:`check_channel_blocks` refuses one with too
    few channels."""
    ext = dict(choice.layout or ())
    blocks = ext.get("C", 1) * ext.get("F", 1)
    if choice.source == "default" and blocks > min(module.in_channels, module.out_channels):
        return tuple(d for d, e in choice.layout if e > 1 and d != "N")  # fewer channels
    if module.groups == 1 or blocks == 1 or choice.source != "default":
        return ()
    if module.groups % blocks == 0:
        return ()
    return tuple(d for d, e in choice.layout if e > 1 and d != "N")


def whole_step(an: Any, node: fx.Node, arg: fx.Node, choice: Any, whole: tuple[str, ...]
               ) -> Any:
    """A convolution a default entry cannot split as it asks (one-row maps under split rows,
    groups across channel blocks): it runs sample-parallel on the entry's grid, ``x[o_N,*,...]``
    (replicated over the other grid dims, its weights whole, its weight gradient the sum over
    every rank as a ``Linear``'s), exact by the sum convention; ``whole`` is recorded for
    ``explain``."""
    from distconv.parallel.steps import LayerSpec, Step, sample_dist

    need = Placement(choice.layout, sample_dist(an.placement(arg).ndim))
    return Step(node, "sample-layer", need, {arg: need},
                LayerSpec("linear", str(node.target), choice.layout, "sample", input=need,
                          source=choice.source, whole=whole))


def _whole_reason(conv: Any, spec: Any) -> str:
    """Why a default entry's convolution runs with ``spec.whole`` whole (for ``explain``)."""
    if set(spec.whole) <= {"D", "H", "W"}:
        return "maps too small to split"
    blocks = math.prod(e for d, e in spec.layout if d in ("C", "F"))
    channels = min(conv.in_channels, conv.out_channels)
    if blocks > channels:
        return f"{channels} channels over {blocks} channel/filter blocks"
    return f"{conv.groups} groups across {blocks} channel/filter blocks"


class ConvHandler(Handler):
    modules = (nn.Conv2d,)

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import LayerSpec, Step

        name = str(node.target)
        choice = an.config.choice(name)
        if choice.algorithm == "auto":
            an.fail(node, "pass input_shape= to parallelize (it plans the layer): algorithm "
                    "'auto' must be resolved before placement", ValueError)
        algorithm = "stationary-x" if choice.algorithm in ("sample", "spatial") else (
            choice.algorithm)
        ext = dict(choice.layout)
        if ext.get("D", 1) > 1:
            an.fail(node, f"split H and W instead, not D: {choice.source} splits D on "
                    f"{dict(choice.layout)}, but a Conv2d's spatial dims are H and W (D splits "
                    "a volume's depth)", ValueError)
        args = an.tensor_args(node)
        whole = whole_rows(an, node, module, choice) or split_groups(an, node, module, choice)
        if whole:
            return whole_step(an, node, args[0], choice, whole)
        check_channel_blocks(an, node, module, choice)
        roles, dists = _roles_and_dists(an, args, module, choice, algorithm)
        grouped, gather = grouping(module, choice.layout, algorithm, roles)
        if choice.pipeline > 1 and gather:
            an.fail(node, f"leave pipeline out for {choice.source}: this grouped {algorithm} "
                    f"convolution on {dict(choice.layout)} cuts its {module.groups} groups "
                    "across its channel/filter blocks, so it gathers x whole first, which is "
                    "not pipelined", ValueError)
        if choice.pipeline > 1 and not moves_data(choice.layout, dists):
            an.fail(node, f"leave pipeline out for {choice.source}: it asks for pipeline: "
                    f"{choice.pipeline}, but this {'grouped ' if grouped else ''}{algorithm} "
                    f"convolution on {dict(choice.layout)} moves no data to overlap (each "
                    "rank's channel block holds whole groups)", ValueError)
        need = Placement(choice.layout, dists["input"])
        if args and not grouped and _takes_gathered(an, node, args[0], choice, dists):
            # the allgather of x over F as the operand's conversion (with the move it needs
            # anyway), made once for every layer that gathers this value alike (the layer is
            # built with gathered_input)
            need = Placement(choice.layout, dists["work"])
        spec = LayerSpec("conv", name, choice.layout, algorithm,
                         tuple(sorted(roles.items())), need, choice.source,
                         pipeline=choice.pipeline,
                         overlap=halo_overlap(an, node, module, choice, ext))
        out = Placement(choice.layout, dists["output"])
        return Step(node, "conv", out, {args[0]: need}, spec)

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        if step.layer.kind == "linear":  # runs as traced (whole_step)
            return None
        roles = dict(step.layer.roles)
        return DistConv2d.from_conv2d(
            module, grid=grid, algorithm=step.layer.algorithm, channel_dim=roles["C"],
            filter_dim=roles["F"], sample_dim=roles["N"], spatial_dims=(roles["H"], roles["W"]),
            pipeline=step.layer.pipeline, overlap=step.layer.overlap,
            gathered_input=gathered(step, module))

    def refuse(self, step: Any, module: Any, in_shape: tuple[int, ...]) -> str | None:
        if step.layer.kind == "linear":
            return None
        return row_refusal(module, step.layer.layout, in_shape)

    def param_dists(self, step: Any, module: Any) -> dict[str, Any] | None:
        if step.layer.kind == "linear":
            return None
        d = _dists(step, module)
        return {"weight": d["weight"], "bias": d["bias"]}

    def price(self, report: Any, step: Any, conv: Any, ctx: PriceContext) -> None:
        spec = step.layer
        if spec.kind == "linear":
            report.param_elements = sum(p.numel() for p in conv.parameters())
            report.dists["w"] = "w[*,*,*,*]"
            report.note = f"{'×'.join(spec.whole)} whole: {_whole_reason(conv, spec)}"
            compute(report, step, conv, ctx)
            return
        roles = dict(spec.roles)
        x = ctx.in_shape
        problem = ConvProblem(x[0], conv.in_channels, conv.out_channels, x[2], x[3],
                              conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                              conv.groups, conv.bias is not None, conv.padding_mode)
        kw = dict(itemsize=ctx.itemsize, input_grad=ctx.grad_in, channel_dim=roles["C"],
                  filter_dim=roles["F"], sample_dim=roles["N"],
                  spatial_dims=(roles["H"], roles["W"]))
        d = _dists(step, conv)
        report.dists = {"x": Placement(spec.layout, d["input"]).dist.format("x"),
                        "w": Placement(spec.layout, d["weight"]).dist.format("w"),
                        "y": Placement(spec.layout, d["output"]).dist.format("y")}
        traffic = {r: conv_traffic(problem, spec.layout, spec.algorithm,
                                   paper_grid(spec.layout, r).coords, **kw) for r in ctx.ranks}
        first = traffic[ctx.ranks[0]]
        report.param_elements, kept = memory_elements(spec.layout, d, conv, x)
        report.activation_elements += kept  # the gathered input the weight gradient reads
        # a gathered input: the allgather over F and its adjoint are the operand's conversion
        moved = ({f"allgather x over {roles['F']}", f"reduce-scatter dL/dx over {roles['F']}"}
                 if gathered(step, conv) else set())
        for phase in ("forward", "backward"):
            names = [k for k in getattr(first, phase)
                     if not k.startswith("allreduce dL/d") and k not in moved]
            for key in names:
                report.steps.append(CommStep(phase, key, first.ops[key],
                                             {r: getattr(t, phase).get(key, 0)
                                              for r, t in traffic.items()}, first.peers[key],
                                             spec.layout, first.dims[key]))
        if spec.pipeline > 1:
            report.note = f"pipeline {spec.pipeline}"
        elif spec.overlap:
            report.note = "halo overlapped"
        elif moved:
            report.note = "x taken gathered"
        elif grouping(conv, spec.layout, spec.algorithm, roles)[1]:
            report.note = f"{conv.groups} groups cut by the blocks: x gathered"
        if ctx.machine is not None:
            cost = conv_cost(problem, spec.layout, spec.algorithm, ctx.machine, **{
                k: v for k, v in kw.items() if k != "input_grad"})
            report.forward_seconds = sum(v for k, v in cost.steps.items()
                                         if k.startswith("local") and "forward" in k)
            report.backward_seconds = sum(v for k, v in cost.steps.items()
                                          if k.startswith("local") and "backward" in k)
            if spec.pipeline > 1:
                piped = conv_cost(problem, spec.layout, spec.algorithm, ctx.machine,
                                  pipeline=spec.pipeline, **{
                                      k: v for k, v in kw.items() if k != "input_grad"})
                report.overlap = {"forward": cost.forward - piped.forward,
                                  "backward": cost.backward - piped.backward}
            elif spec.overlap:
                report.overlap = halo_hidden(cost.steps, _interior(conv, x, spec, roles),
                                             ctx.machine)

    def samples(self) -> Sequence[Sample]:
        return (Sample("conv3x3", lambda: SampleNet(nn.Conv2d(4, 6, 3, padding=1), 4, 6),
                       (5, 4, 7, 6), SAMPLE_GRIDS),
                Sample("conv-strided-grouped",
                       lambda: SampleNet(nn.Conv2d(4, 6, 3, stride=2, groups=2, bias=False),
                                         4, 6),
                       (5, 4, 9, 8), SAMPLE_GRIDS[:4]),
                Sample("conv-grouped-stationary-w",  # 4 groups over C×F: one a rank
                       lambda: SampleNet(nn.Conv2d(4, 8, 3, padding=1, groups=4), 4, 8),
                       (5, 4, 7, 6), SAMPLE_GRIDS[4:]),
                Sample("conv-groups-across-blocks",  # 3 groups over 2 or 4 blocks: whole
                       lambda: SampleNet(nn.Conv2d(6, 6, 3, padding=1, groups=3), 6),
                       (5, 6, 7, 6), SAMPLE_GRIDS),
                # a layer's own entry splits groups the blocks cut (x gathered over them), and
                # a depthwise layer of odd width (each block whole channels: local)
                Sample("conv-groups-cut-own-entry",
                       lambda: SampleNet(nn.Conv2d(6, 6, 3, padding=1, groups=3), 6),
                       (5, 6, 7, 6), _own_entries(("layer",))),
                Sample("conv-depthwise-odd-own-entry",
                       lambda: SampleNet(nn.Conv2d(5, 5, 3, padding=1, groups=5), 5),
                       (5, 5, 7, 6), _own_entries(("layer",))),
                Sample("conv-one-row-maps",  # squeeze-and-excitation: rows whole
                       lambda: SampleNet(_Excite(), 4), (5, 4, 7, 6), SAMPLE_GRIDS))


def _own_entries(matches: Sequence[str]) -> tuple[tuple[int, dict], ...]:
    """Options of a layer's own entry (``matches``) on 4 ranks, the rest sample-parallel:
    stationary-x over N×C, -y over N×F, -w over C×F, and -x with split rows (C×H)."""
    own = (({"N": 2, "C": 2}, "stationary-x"), ({"N": 2, "F": 2}, "stationary-y"),
           ({"C": 2, "F": 2}, "stationary-w"), ({"C": 2, "H": 2}, "stationary-x"))
    return tuple((4, {"default": {"grid": {"N": 4}, "algorithm": "sample"},
                      "layers": [{"match": m, "grid": grid, "algorithm": algorithm}
                                 for m in matches]}) for grid, algorithm in own)


class _Excite(nn.Module):
    """Squeeze-and-excitation's convolutions on ``[N, C, 1, 1]`` maps."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(4, 2, 1), nn.Conv2d(2, 4, 1)

    def forward(self, x: Any) -> Any:
        s = self.fc2(torch.relu(self.fc1(x.mean((2, 3), keepdim=True))))
        return x * torch.sigmoid(s)

