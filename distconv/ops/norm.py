"""Normalisation: ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` with the statistics of the whole
global batch (:class:`~distconv.nn.DistBatchNorm2d`, ``3d``, ``1d``), in its input's distribution
(any dim split; the statistics reduced over the grid dims of every entry but the channels');
GroupNorm and InstanceNorm1d/2d/3d on a spatially split input in place
(:class:`~distconv.nn.groupnorm.DistGroupNorm`, ``DistInstanceNorm1d/2d/3d``: the statistics of
each sample's group reduced over the spatial grid dims, the channels made whole first; an
instance norm's running statistics reduced over the grid dims that split the samples, with the
spatial dims split or not); LayerNorm over any trailing dims on any split in place
(``DistLayerNorm``); otherwise these on local blocks with the dims they reduce over whole.
The functional forms a module's forward writes: ``F.batch_norm`` on the module's own buffers
(timm's ``BatchNormAct2d``: :class:`~distconv.nn.batchnorm_call.DistBatchNormCall`),
``F.layer_norm``, ``F.group_norm`` and ``F.instance_norm``.

Per rank: forward, an allgather of (count, mean, M2) per local channel (per local sample and
group) over the statistics segment (the grid dims of the N and spatial entries; of the spatial
entries); backward, an allreduce of the two sums the gradient needs.
"""

from __future__ import annotations

import copy
import math
import weakref
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from distconv.comm.base import allreduce_bytes
from distconv.distribution import Dist
from distconv.nn._statistics import resolve_statistics, statistics_groups
from distconv.nn.batchnorm import DistBatchNorm1d, DistBatchNorm2d, DistBatchNorm3d
from distconv.nn.groupnorm import DistLayerNorm
from distconv.nn.groupnorm import from_module as norm_from_module
from distconv.ops.base import (
    SAMPLE_GRIDS, SIGNAL_GRIDS, VOLUME_GRIDS, Handler, PriceContext, Sample, SampleNet,
)
from distconv.ops.elementwise import is_constant
from distconv.pricing.timeline import CommStep, largest_block, segment_rank
from distconv.parallel.placement import Placement, paper_grid

__all__ = ["BatchNormHandler", "FunctionalBatchNormHandler", "FunctionalGroupNormHandler",
           "FunctionalInstanceNormHandler", "FunctionalLayerNormHandler", "GroupNormHandler",
           "InstanceNormHandler", "LayerNormHandler", "batch_norm_call", "batch_norm_owner"]


#: torch's batch norm forwards: a subclass that keeps one is the layer (fx would trace into it)
_TORCH_FORWARDS = (nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward)


class BatchNormHandler(Handler):
    # all with global-batch statistics
    modules = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)

    def binds_by_name(self, module: nn.Module | None) -> bool:
        """A subclass of these defined outside ``torch.nn`` that keeps torch's forward is one
        call of the trace, as the class itself is (:func:`distconv.ops.is_leaf`); one that
        writes its own forward is traced into (:class:`FunctionalBatchNormHandler`)."""
        return isinstance(module, self.modules) and type(module).forward in _TORCH_FORWARDS

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import LayerSpec

        name = str(node.target)
        step = an.keep(node, "batchnorm")
        dist = step.out.dist
        if dist.ndim not in (2, 3, 4, 5):
            an.fail(node, f"give {type(module).__name__} (N, C) to (N, C, D, H, W) inputs: it "
                    f"got {dist.ndim} dims")
        ext = dict(step.out.layout)
        blocks = math.prod(ext[g] for g in dist.grid_dims_of(0))
        try:
            statistics = resolve_statistics(an.config.statistics(name), blocks, name)
        except ValueError as exc:
            an.fail(node, str(exc).split(": ", 1)[1], ValueError)
        step.layer = LayerSpec("batchnorm", name, step.out.layout, input=step.out,
                               statistics=statistics)
        return step

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        cls = {4: DistBatchNorm2d, 5: DistBatchNorm3d}.get(step.layer.input.ndim, DistBatchNorm1d)
        return cls.from_module(module, grid=grid, input_dist=step.layer.input.dist,
                               statistics=step.layer.statistics)

    def param_dists(self, step: Any, module: Any) -> dict[str, Any]:
        d = Dist((step.out.dist.entries[1],))
        return {"weight": d, "bias": d}

    def price(self, report: Any, step: Any, bn: Any, ctx: PriceContext) -> None:
        p = step.out
        ext = dict(p.layout)
        statistics = step.layer.statistics
        local = statistics == "local"
        over = (() if local else (0,)) + tuple(range(2, p.dist.ndim))  # all but the channels
        seg = [g for i in over for g in p.dist.grid_dims_of(i)]
        per_block = statistics != "global"  # running statistics: sample block 0's, broadcast
        blocks = list(p.dist.grid_dims_of(0)) if per_block and bn.track_running_stats else []
        s = math.prod(ext[g] for g in seg)
        # groups of k sample blocks: each group's ranks reduce together (sub-rank = position)
        group_of = ({r: g for g in statistics_groups(p.layout, p.dist.grid_dims_of(0), seg,
                                                     statistics) for r in g}
                    if isinstance(statistics, int) else None)
        label = "×".join(seg) + (f" (groups of {statistics} sample blocks)" if group_of else "")
        if group_of:
            s = s // math.prod(ext[g] for g in p.dist.grid_dims_of(0)) * statistics
        fwd, bwd, running, params = {}, {}, {}, 0
        isz = ctx.itemsize
        for r in ctx.ranks:
            g = paper_grid(p.layout, r)
            c = p.dist.local_shape(ctx.in_shape, g)[1]
            params = max(params, 2 * c if bn.affine else 0)
            fwd[r] = (s - 1) * (1 + 2 * c) * isz
            sub = (group_of[r].index(r) if group_of
                   else segment_rank(p.layout, seg, g.coords))
            bwd[r] = allreduce_bytes(2 * c, sub, s, isz)
            root = all(g.coords.get(d, 0) == 0 for d in blocks)
            running[r] = 0 if root else 2 * c * isz
        report.param_elements = params
        report.dists["w"] = Placement(p.layout, Dist((p.dist.entries[1],))).dist.format("w")
        if s > 1:
            report.steps.append(CommStep("forward", f"statistics allgather over {label}",
                                         "allgather", fwd, s, p.layout, tuple(seg)))
            report.steps.append(CommStep("backward", f"Σdy, Σdy·x̂ allreduce over {label}",
                                         "allreduce", bwd, s, p.layout, tuple(seg)))
        if blocks:
            report.steps.append(CommStep(
                "forward", f"running statistics of sample block 0, broadcast over "
                f"{'×'.join(blocks)} (asynchronous)", "broadcast", running,
                math.prod(ext[g] for g in blocks), p.layout, tuple(blocks)))

    def samples(self) -> Sequence[Sample]:
        return (Sample("batchnorm", lambda: SampleNet(nn.BatchNorm2d(4), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),
                Sample("batchnorm3d", lambda: _VolumeNorm(nn.BatchNorm3d(4, momentum=None)),
                       (5, 2, 3, 4, 3), VOLUME_GRIDS),
                Sample("batchnorm1d-features", lambda: _FeatureNorm(), (5, 4, 7, 6),
                       SAMPLE_GRIDS),
                Sample("batchnorm1d-signal", lambda: _SignalNorm(), (5, 3, 9), SIGNAL_GRIDS))


class FunctionalBatchNormHandler(Handler):
    """``F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)`` as
    a module's forward writes it on its own buffers and parameters (timm's ``BatchNormAct2d``,
    whose forward is ``nn.BatchNorm2d``'s followed by a drop layer and an activation; a subclass
    of ``nn.BatchNorm2d`` with a forward of its own), on ``x`` in any distribution
    (:class:`~distconv.nn.batchnorm_call.DistBatchNormCall`): the batch statistics of each channel
    over the whole global batch, reduced over the grid dims of the N and spatial entries, as
    ``nn.BatchNorm`` modules run (:class:`BatchNormHandler`). ``weight`` and ``bias`` are sliced
    to the channel blocks (``w[o_C]``; their gradients pending sums that the replicated
    parameters' all-rank sum completes, as a layer scale's); the running statistics stay whole on
    every rank, updated in training from every channel block's statistics (an allgather over the
    grid dims of the channel entry, where it is split) exactly as one process updates them.

    The call follows its module (the ``nn.BatchNorm`` whose ``running_mean`` and ``weight`` it
    passes) as torch's forward does: training or eval as the module is set now, momentum,
    ``momentum=None`` (a cumulative average) and ``num_batches_tracked`` (which the trace cannot
    record) counted per call; its module's config entry must leave ``statistics`` 'global'.
    Refused by name: operands computed in the graph, a call that does not follow its module's
    mode or momentum, running statistics of no BatchNorm module updated in training."""

    functions = frozenset({F.batch_norm})
    layer_operands = True

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import LayerSpec, Step

        call = batch_norm_call(node.args, node.kwargs)
        x = call["input"]
        if not isinstance(x, fx.Node) or an.out.get(x) is None or is_constant(x):
            an.fail(node, "pass batch_norm an activation to normalise: its input here is no "
                    "value computed from the model's input")
        for k in _TENSORS:
            v = call[k]
            if v is not None and not (isinstance(v, fx.Node) and v.op == "get_attr"):
                an.fail(node, f"pass batch_norm's {k} as a module's own parameter or buffer (or "
                        f"None); here it is {getattr(v, 'name', v)!r}, computed in the graph")
        for k in ("training", "momentum", "eps"):
            if isinstance(call[k], fx.Node):
                an.fail(node, f"give batch_norm's {k} as a number; here it is computed in the "
                        f"graph (node {call[k].name!r})", TypeError)
        p = an.placement(x).settled()
        if p.ndim < 2:
            an.fail(node, f"give batch_norm (N, C, ...) inputs: it got {p.ndim} dims", ValueError)
        path, owner = batch_norm_owner(an.gm, call)
        if owner is not None:
            _check_follows(an, node, call, path, owner, p)
        elif call["training"] and call["running_mean"] is not None:
            an.fail(node, "give the running statistics to an nn.BatchNorm module (or pass None): "
                    "this call updates buffers of no BatchNorm module in training, which only "
                    "one process's own arithmetic defines")
        elif not call["training"] and (call["running_mean"] is None
                                       or call["running_var"] is None):
            an.fail(node, "pass running_mean and running_var to batch_norm with training=False "
                    "(torch requires them)", ValueError)
        needs = {x: p}
        w = Placement(p.layout, Dist((p.dist.entries[1],)))
        for k in ("weight", "bias"):
            if call[k] is not None:
                needs[call[k]] = w
        return Step(node, "norm", p, needs,
                    LayerSpec("batchnorm-call", path or node.name, p.layout, input=p))

    def operands(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """``running_mean``, ``running_var``, ``weight``, ``bias`` of the call (None where
        absent), positional or by keyword."""
        call = batch_norm_call(args, kwargs)
        return tuple(call[k] for k in _TENSORS)

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        from distconv.nn.batchnorm_call import DistBatchNormCall

        call = batch_norm_call(node.args, node.kwargs)
        _, owner = batch_norm_owner(node.graph.owning_module, call)
        return DistBatchNormCall(grid=grid, input_dist=step.layer.input.dist, eps=call["eps"],
                                 training=bool(call["training"]), owner=owner)

    def price(self, report: Any, step: Any, module: Any, ctx: PriceContext) -> None:
        call = batch_norm_call(step.node.args, step.node.kwargs)
        _, owner = batch_norm_owner(step.node.graph.owning_module, call)
        training = owner.training if owner is not None else bool(call["training"])
        if not training and call["running_mean"] is not None:
            return  # normalised by the running statistics: local
        p, isz = step.out, ctx.itemsize
        ext = dict(p.layout)
        seg = [g for i in (0, *range(2, p.ndim)) for g in p.dist.grid_dims_of(i)]
        chan = list(p.dist.grid_dims_of(1))
        s = math.prod(ext[g] for g in seg)
        running = (owner is not None and training and owner.track_running_stats
                   and call["running_mean"] is not None and chan)
        fwd, bwd, gathered = {}, {}, {}
        for r in ctx.ranks:
            g = paper_grid(p.layout, r)
            c = p.dist.local_shape(ctx.in_shape, g)[1]
            fwd[r] = (s - 1) * (1 + 2 * c) * isz
            bwd[r] = allreduce_bytes(2 * c, segment_rank(p.layout, seg, g.coords), s, isz)
            gathered[r] = 2 * (ctx.in_shape[1] - c) * isz
        label = "×".join(seg)
        if s > 1:
            report.steps.append(CommStep("forward", f"statistics allgather over {label}",
                                         "allgather", fwd, s, p.layout, tuple(seg)))
            if ctx.grad_in:
                report.steps.append(CommStep("backward", f"Σdy, Σdy·x̂ allreduce over {label}",
                                             "allreduce", bwd, s, p.layout, tuple(seg)))
        if running:
            report.steps.append(CommStep(
                "forward", f"running statistics allgather over {'×'.join(chan)}", "allgather",
                gathered, math.prod(ext[g] for g in chan), p.layout, tuple(chan)))

    def samples(self) -> Sequence[Sample]:
        return (Sample("batchnormact", lambda: SampleNet(_BatchNormAct(4), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),
                Sample("batchnormact-no-affine",
                       lambda: SampleNet(_BatchNormAct(4, momentum=0.3, affine=False), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS),
                Sample("batchnormact-untracked",
                       lambda: SampleNet(_BatchNormAct(4, track_running_stats=False), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS),
                Sample("batchnormact-eval", lambda: _eval(SampleNet(_BatchNormAct(4), 4)),
                       (5, 4, 7, 6), SAMPLE_GRIDS),
                Sample("batchnormact3d", lambda: _VolumeNorm(_BatchNormAct3d(4)),
                       (5, 2, 3, 4, 3), VOLUME_GRIDS))


#: the tensor operands of ``F.batch_norm`` after its input, in :meth:`operands`' order
_TENSORS = ("running_mean", "running_var", "weight", "bias")
_ORDER = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_DEFAULTS = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}


def batch_norm_call(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``F.batch_norm``'s arguments by name, positional or by keyword, defaults filled in."""
    call = dict(_DEFAULTS)
    call.update(zip(_ORDER, args))
    call.update(kwargs)
    return call


def batch_norm_owner(gm: Any, call: dict[str, Any]) -> tuple[str, nn.Module | None]:
    """The ``nn.BatchNorm`` module whose own buffers and parameters the call passes (its path
    and itself), or ``("", None)``: every tensor operand must be that module's attribute of the
    operand's name."""
    targets = {k: str(call[k].target) for k in _TENSORS if isinstance(call[k], fx.Node)}
    paths = {t.rpartition(".")[0] for t in targets.values()}
    if len(paths) != 1 or gm is None:
        return "", None
    path = paths.pop()
    try:
        owner = gm.get_submodule(path)
    except AttributeError:
        return "", None
    if not isinstance(owner, nn.modules.batchnorm._BatchNorm) or any(
            t != f"{path}.{k}" if path else t != k for k, t in targets.items()):
        return "", None
    return path, owner


def _check_follows(an: Any, node: Any, call: dict[str, Any], path: str, owner: nn.Module,
                   p: Placement) -> None:
    """Refuse a call that does not follow its module as ``nn.BatchNorm``'s forward does (the
    layer follows the module, in the mode the model is set to when it runs), or whose module's
    config asks for other statistics than the global batch's."""
    where = f"module {path!r} ({type(owner).__name__})"
    running = call["running_mean"] is not None
    if bool(call["training"]) != (owner.training or not running):
        an.fail(node, f"call batch_norm as nn.BatchNorm's forward does (training={owner.training} "
                f"for {where} in its mode): the call passes training={call['training']}")
    if (call["weight"] is None) != (owner.weight is None) or (
            running != (owner.running_mean is not None
                        and (not owner.training or owner.track_running_stats))):
        an.fail(node, f"pass {where}'s own weight, bias and running statistics to batch_norm, "
                "as nn.BatchNorm's forward does")
    counted = owner.num_batches_tracked
    if owner.training and owner.track_running_stats and counted is not None:
        want = owner.momentum if owner.momentum is not None else 1.0 / float(counted + 1)
        if call["momentum"] != want:
            an.fail(node, f"pass {where}'s momentum to batch_norm, as nn.BatchNorm's forward "
                    f"does ({want}; the call passes {call['momentum']})")
        if not _counts_batches(owner, p.ndim):
            an.fail(node, f"count {where}'s batches in its forward (num_batches_tracked += 1 in "
                    "training, as nn.BatchNorm's forward does); the parallel layer counts them")
    blocks = math.prod(dict(p.layout)[g] for g in p.dist.grid_dims_of(0))
    try:
        statistics = resolve_statistics(an.config.statistics(path), blocks, path)
    except ValueError as exc:
        an.fail(node, str(exc).split(": ", 1)[1], ValueError)
    if statistics != "global":
        an.fail(node, f"leave {where}'s statistics 'global' (the default): its batch norm is a "
                "call in its forward, whose running statistics every rank keeps whole; "
                "per-sample-block statistics are for nn.BatchNorm modules", ValueError)


#: whether a module's forward counts its batches (:func:`_counts_batches`), by module
_COUNTS: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _counts_batches(owner: nn.Module, ndim: int) -> bool:
    """Whether ``owner``'s forward adds one to its ``num_batches_tracked`` in training, as
    ``nn.BatchNorm``'s does: a copy of it run once on zeros (torch's generator left as it was).
    The trace cannot see it: fx records no in-place update of a buffer."""
    found = _COUNTS.get(owner)
    if found is None:  # (placement runs after the capture: no trace intercepts this call)
        twin = copy.deepcopy(owner)
        if any(t.is_meta for t in twin.state_dict().values()):
            twin = twin.to_empty(device="cpu")
        ref = next((t for t in (twin.weight, twin.running_mean) if t is not None), None)
        x = torch.zeros((2, owner.num_features) + (2,) * (ndim - 2),
                        dtype=None if ref is None else ref.dtype,
                        device=None if ref is None else ref.device)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                twin.num_batches_tracked.zero_()
                twin.train()(x)
            found = int(twin.num_batches_tracked) == 1
        except Exception:  # noqa: BLE001 - a forward that cannot run on zeros tells nothing
            found = False
        _COUNTS[owner] = found
    return found


def _eval(model: nn.Module) -> nn.Module:
    return model.eval()


class _BatchNormAct(nn.BatchNorm2d):
    """timm's ``BatchNormAct2d``: ``nn.BatchNorm2d``'s forward written out (``F.batch_norm`` on
    the module's own buffers), then an activation."""

    def forward(self, x: Any) -> Any:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                      else self.momentum)
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        x = F.batch_norm(x, self.running_mean if tracked else None,
                         self.running_var if tracked else None, self.weight, self.bias,
                         use_batch, factor, self.eps)
        return F.silu(x)


class _BatchNormAct3d(_BatchNormAct, nn.BatchNorm3d):
    """The same over volumes."""

    def __init__(self, channels: int) -> None:
        nn.BatchNorm3d.__init__(self, channels, eps=1e-3)


class _VolumeNorm(nn.Module):
    """Conv3d, the normalisation under test, a global mean and a head."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1)
        self.norm = norm
        self.head = nn.Linear(4, 3)

    def forward(self, x: Any) -> Any:
        return self.head(self.norm(self.conv(x)).relu().mean((2, 3, 4)))


class _FeatureNorm(nn.Module):
    """A BatchNorm1d over the features of a head, after a convolution placed by the config."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(4, 5)
        self.norm = nn.BatchNorm1d(5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: Any) -> Any:
        return self.head(self.norm(self.fc(self.stem(x).mean((2, 3)))).relu())


class _SignalNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Any) -> Any:
        return self.head(self.norm(self.conv(x)).tanh().mean(2))



class _LocalNorm(Handler):
    """A normalisation whose statistics stay within one sample: it runs as the plain module on
    local blocks, exactly, where its input keeps whole the dims it reduces over (and, with
    per-channel affine weights, the channels). Where its input splits them, they are made whole
    first (an allgather over the grid dims that split them, priced as the conversion it is), so
    every rank of such a group normalises the whole of its samples; the next layer takes its own
    blocks of the output (a local slice) -- except where :meth:`in_place` says the layer
    normalises a spatially split input where it is (:class:`DistGroupNorm`)."""

    #: tensor dims (of N, C, H, W) the statistics reduce over
    reduces: tuple[int, ...] = ()

    def whole(self, module: Any, ndim: int) -> tuple[int, ...]:
        """The dims a rank must hold whole: those reduced over (and more for some settings)."""
        return self.reduces

    #: whether a spatially split input is normalised in place (:class:`DistGroupNorm`)
    def in_place(self, module: Any) -> bool:
        return False

    def needs_layer(self, module: Any, dist: Any, ext: dict[str, int]) -> bool:
        """Whether the distributed layer runs even with the spatial dims whole (its state
        reduces over split samples)."""
        return False

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import LayerSpec

        step = an.keep(node, "norm")
        dist = step.out.dist
        ext = dict(step.out.layout)
        spatial = [g for d in range(2, dist.ndim) for g in dist.grid_dims_of(d)
                   if ext.get(g, 1) > 1]
        if ((spatial or self.needs_layer(module, dist, ext)) and dist.ndim > 2
                and self.in_place(module)):
            # the statistics reduced over the spatial grid dims; only the channels made whole
            entries = (dist.entries[0], None, *dist.entries[2:])
            p = Placement(step.out.layout, Dist(entries, frozenset(), dist.tensor_dims))
            step.out, step.needs = p, {a: p for a in step.needs}
            step.layer = LayerSpec("groupnorm", str(node.target), p.layout, input=p)
            return step
        whole = self.whole(module, dist.ndim)
        ext = dict(step.out.layout)
        split = {d: [g for g in dist.grid_dims_of(d) if ext.get(g, 1) > 1] for d in whole}
        if split.get(0):
            an.fail(node, "keep the samples whole before it, or use track_running_stats=False: "
                    f"{type(module).__name__} with running statistics averages them over the "
                    f"samples, which the input splits over {'×'.join(split[0])}")
        if any(split.values()):
            entries = tuple(None if d in whole else e for d, e in enumerate(dist.entries))
            p = Placement(step.out.layout, Dist(entries, frozenset(), dist.tensor_dims))
            step.out, step.needs = p, {a: p for a in step.needs}
        return step

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        if step.layer is None or step.layer.kind != "groupnorm":
            return None  # the plain module on local blocks
        return norm_from_module(module, grid=grid, input_dist=step.layer.input.dist)

    def price(self, report: Any, step: Any, module: Any, ctx: PriceContext) -> None:
        report.param_elements = sum(p.numel() for p in module.parameters())
        if step.layer is None or step.layer.kind != "groupnorm":
            return
        groups = module.num_groups if isinstance(module, nn.GroupNorm) else module.num_features
        if any(dict(step.out.layout).get(g, 1) > 1 for d in range(2, step.out.dist.ndim)
               for g in step.out.dist.grid_dims_of(d)):
            _sample_statistics(report, step.out, ctx, 2, groups)  # per (sample, group)
        if getattr(module, "track_running_stats", False) and module.training:
            _running_statistics(report, step.out, ctx, module.num_features)


def _sample_statistics(report: Any, p: Placement, ctx: PriceContext, first: int,
                       per_sample: int, lead: int = 1) -> None:
    """The collectives of statistics kept per row (each local index of the first ``lead``
    entries; ``per_sample`` sets of each) and reduced over the grid dims of the entries from
    ``first`` on: the forward allgather of (count, mean, M2) and the backward allreduce of the
    two sums."""
    ext = dict(p.layout)
    seg = [g for d in range(first, p.dist.ndim) for g in p.dist.grid_dims_of(d)]
    s = math.prod(ext[g] for g in seg)
    fwd, bwd = {}, {}
    for r in ctx.ranks:
        g = paper_grid(p.layout, r)
        stats = math.prod(p.dist.local_shape(ctx.in_shape, g)[:lead]) * per_sample
        fwd[r] = (s - 1) * (1 + 2 * stats) * ctx.itemsize
        bwd[r] = allreduce_bytes(2 * stats, segment_rank(p.layout, seg, g.coords), s,
                                 ctx.itemsize)
    report.steps.append(CommStep("forward", f"statistics allgather over {'×'.join(seg)}",
                                 "allgather", fwd, s, p.layout, tuple(seg)))
    if ctx.grad_in:
        report.steps.append(CommStep("backward", f"Σdx̂, Σdx̂·x̂ allreduce over "
                                     f"{'×'.join(seg)}", "allreduce", bwd, s, p.layout,
                                     tuple(seg)))


def _running_statistics(report: Any, p: Placement, ctx: PriceContext, channels: int) -> None:
    """An instance norm's running statistics: the sums of its instances' means and variances
    (2C values) allreduced over the grid dims that split the samples, once per forward."""
    ext = dict(p.layout)
    seg = [g for g in p.dist.grid_dims_of(0) if ext.get(g, 1) > 1]
    if not seg:
        return
    s = math.prod(ext[g] for g in seg)
    per = {r: allreduce_bytes(2 * channels, segment_rank(p.layout, seg,
                                                          paper_grid(p.layout, r).coords),
                              s, ctx.itemsize) for r in ctx.ranks}
    report.steps.append(CommStep("forward", f"running statistics allreduce over "
                                 f"{'×'.join(seg)}", "allreduce", per, s, p.layout, tuple(seg)))


class GroupNormHandler(_LocalNorm):
    modules = (nn.GroupNorm,)

    def binds_by_name(self, module: nn.Module | None) -> bool:
        """A subclass keeping torch's forward is one call of the trace (as
        :meth:`BatchNormHandler.binds_by_name`)."""
        return isinstance(module, self.modules) and type(module).forward is nn.GroupNorm.forward

    def in_place(self, module: Any) -> bool:
        return True

    def whole(self, module: Any, ndim: int) -> tuple[int, ...]:
        return tuple(range(1, ndim))  # each group's channels and every spatial dim

    def samples(self) -> Sequence[Sample]:
        return (Sample("groupnorm", lambda: SampleNet(nn.GroupNorm(2, 4), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),
                Sample("groupnorm3d", lambda: _VolumeNorm(nn.GroupNorm(2, 4)), (5, 2, 3, 4, 3),
                       VOLUME_GRIDS))


class LayerNormHandler(_LocalNorm):
    """``nn.LayerNorm`` over the trailing dims of an activation (``(C, H, W)``, ``(H, W)``,
    ``(W,)``, ...). With any of those dims split, in place (:class:`DistLayerNorm`: the
    statistics reduced over the grid dims that split them, the elementwise weight sharded like
    them); otherwise the plain module on local blocks."""

    modules = (nn.LayerNorm,)

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import LayerSpec

        step = an.keep(node, "norm")
        dist, ext = step.out.dist, dict(step.out.layout)
        k = len(module.normalized_shape)
        split = [g for d in range(dist.ndim - k, dist.ndim) for g in dist.grid_dims_of(d)
                 if ext.get(g, 1) > 1]
        if split and k <= dist.ndim - 1:
            step.layer = LayerSpec("layernorm", str(node.target), step.out.layout,
                                   input=step.out)
            return step
        return super().place(an, node, module)

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        if step.layer is not None and step.layer.kind == "layernorm":
            return DistLayerNorm.from_module(module, grid=grid,
                                             input_dist=step.layer.input.dist)
        return super().build(module, node, step, grid)

    def param_dists(self, step: Any, module: Any) -> dict[str, Any] | None:
        if step.layer is None or step.layer.kind != "layernorm":
            return None
        entries = step.layer.input.dist.entries
        d = Dist(entries[len(entries) - len(module.normalized_shape):])
        return {"weight": d, "bias": d}

    def price(self, report: Any, step: Any, module: Any, ctx: PriceContext) -> None:
        if step.layer is None or step.layer.kind != "layernorm":
            super().price(report, step, module, ctx)
            return
        first = step.out.dist.ndim - len(module.normalized_shape)
        w = Placement(step.out.layout, Dist(step.out.dist.entries[first:]))
        report.param_elements = sum(largest_block(w, tuple(t.shape))
                                    for t in module.parameters())
        _sample_statistics(report, step.out, ctx, first, 1, first)  # one set per row

    def whole(self, module: Any, ndim: int) -> tuple[int, ...]:
        return tuple(range(ndim - len(module.normalized_shape), ndim))

    def samples(self) -> Sequence[Sample]:
        return (Sample("layernorm-chw", lambda: SampleNet(nn.LayerNorm((4, 7, 6)), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS),
                Sample("layernorm-cdhw", lambda: _VolumeNorm(nn.LayerNorm((4, 3, 4, 3))),
                       (5, 2, 3, 4, 3), VOLUME_GRIDS),
                Sample("layernorm-w", lambda: SampleNet(nn.LayerNorm(6, bias=False), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS[1:2]),
                Sample("layernorm-hw", lambda: SampleNet(nn.LayerNorm((7, 6)), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS),
                Sample("layernorm-dhw", lambda: _VolumeNorm(nn.LayerNorm((3, 4, 3))),
                       (5, 2, 3, 4, 3), VOLUME_GRIDS),
                Sample("layernorm-w-of-hw", lambda: SampleNet(nn.LayerNorm(6), 4),
                       (5, 4, 7, 6), ((2, {"default": {"grid": {"N": 1, "W": 2},
                                                       "algorithm": "spatial"},
                                           "data": {"N": 1, "W": 2}}),
                                      (4, {"default": {"grid": {"H": 2, "W": 2},
                                                       "algorithm": "spatial"},
                                           "data": {"N": 1, "H": 2, "W": 2}}))))


class FunctionalLayerNormHandler(Handler):
    """``F.layer_norm(x, normalized_shape, weight, bias, eps)`` as a module's forward writes it
    (timm's ``LayerNorm2d``: ``F.layer_norm`` between two permutes, with the module's own
    ``weight`` and ``bias`` read as model tensors). Where ``x`` keeps the normalised (trailing)
    dims whole -- sample or row splits -- the call runs on each rank's rows as written; where
    some are split (a channels-last value ``x[o,*,*,o_C]``), in place, as ``nn.LayerNorm``
    (:class:`LayerNormHandler`): the statistics of each row reduced over the grid dims that split
    the normalised dims (:class:`~distconv.nn.groupnorm.DistLayerNorm`), ``weight`` and ``bias``
    sliced to the blocks (``w[o_C]``; their gradients pending sums that the replicated
    parameters' all-rank sum completes, as a layer scale's)."""

    functions = frozenset({F.layer_norm, torch.layer_norm})
    layer_operands = True

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import LayerSpec, Step

        args = [a for a in an.tensor_args(node) if not is_constant(a)]
        if len(args) != 1 or node.args[0] is not args[0]:
            an.fail(node, "pass layer_norm's weight and bias as model tensors (parameters, "
                    "buffers) or None: here they are values computed from the input")
        shape = _normalized_shape(node)
        found: list[fx.Node] = []
        fx.node.map_arg(shape, found.append)
        if shape is None or found:
            an.fail(node, "give normalized_shape as numbers (a module's normalized_shape "
                    f"attribute is): {shape!r} is computed in the graph", TypeError)
        k = 1 if isinstance(shape, int) else len(shape)
        p = an.placement(args[0]).settled()
        if not 1 <= k < p.ndim:
            an.fail(node, f"give a normalized_shape of 1 to {p.ndim - 1} trailing dims of the "
                    f"{p.ndim}-dim value: got {shape!r}", ValueError)
        ext = dict(p.layout)
        if not any(ext.get(g, 1) > 1 for d in range(p.ndim - k, p.ndim)
                   for g in p.dist.grid_dims_of(d)):
            return Step(node, "norm", p, {args[0]: p})  # whole rows: as written
        needs = {args[0]: p}
        for operand in self.operands(node.args, node.kwargs):
            if isinstance(operand, fx.Node):  # sliced like the normalised dims it scales
                needs[operand] = Placement(p.layout, Dist(p.dist.entries[p.ndim - k:]))
        return Step(node, "norm", p, needs, LayerSpec("layernorm", node.name, p.layout, input=p))

    def operands(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """``weight`` and ``bias`` of the call, positional or by keyword (None where absent)."""
        return tuple(kwargs.get(name, args[i] if len(args) > i else None)
                     for i, name in ((2, "weight"), (3, "bias")))

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        if step.layer is None:
            return None
        shape = _normalized_shape(node)
        eps = node.kwargs.get("eps", node.args[4] if len(node.args) > 4 else 1e-5)
        return _DistLayerNormCall(DistLayerNorm(
            (shape,) if isinstance(shape, int) else shape, eps, elementwise_affine=False,
            grid=grid, input_dist=step.layer.input.dist))

    def price(self, report: Any, step: Any, module: Any, ctx: PriceContext) -> None:
        if step.layer is not None:
            shape = _normalized_shape(step.node)
            first = step.out.dist.ndim - (1 if isinstance(shape, int) else len(shape))
            _sample_statistics(report, step.out, ctx, first, 1, first)  # one set per row

    def samples(self) -> Sequence[Sample]:
        return (Sample("layernorm2d", lambda: SampleNet(_LayerNorm2d(4), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),
                Sample("F.layer_norm-channels-first", lambda: SampleNet(_ChannelsFirstNorm(4), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS[:3]))


def _normalized_shape(node: fx.Node) -> Any:
    return node.kwargs.get("normalized_shape", node.args[1] if len(node.args) > 1 else None)


class _DistLayerNormCall(nn.Module):
    """One ``F.layer_norm`` call on a value whose normalised dims are split: the normalisation
    of :class:`~distconv.nn.groupnorm.DistLayerNorm` (no parameters of its own), then the
    call's ``weight`` and ``bias``, given as their blocks."""

    def __init__(self, norm: DistLayerNorm) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor, global_shape: Sequence[int], weight: Any = None,
                bias: Any = None) -> torch.Tensor:
        y = self.norm(x, global_shape)
        if weight is not None:
            y = y * weight.to(y.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y


class _LayerNorm2d(nn.LayerNorm):
    """timm's ``LayerNorm2d``: a LayerNorm over the channels of an ``[N, C, H, W]`` value."""

    def forward(self, x: Any) -> Any:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class _ChannelsFirstNorm(nn.Module):
    """A channels-first LayerNorm written with ``F.layer_norm`` on a permuted value and
    permuted back (MONAI, timm)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.channels = channels
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: Any) -> Any:
        return F.layer_norm(x.permute(0, 2, 3, 1), (self.channels,), self.weight, self.bias,
                            1e-6).permute(0, 3, 1, 2)


class InstanceNormHandler(_LocalNorm):
    modules = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)

    def binds_by_name(self, module: nn.Module | None) -> bool:
        """A subclass keeping torch's forward is one call of the trace (as
        :meth:`BatchNormHandler.binds_by_name`)."""
        return isinstance(module, self.modules) and (
            type(module).forward is nn.modules.instancenorm._InstanceNorm.forward)

    def in_place(self, module: Any) -> bool:
        return True

    def needs_layer(self, module: Any, dist: Any, ext: dict[str, int]) -> bool:
        # running statistics average over the samples: reduced over the grid dims that split
        # them by the layer
        return module.track_running_stats and any(ext.get(g, 1) > 1
                                                  for g in dist.grid_dims_of(0))

    def whole(self, module: Any, ndim: int) -> tuple[int, ...]:
        # the spatial dims of each sample and channel; per-channel weights and running
        # statistics need the channels
        return ((1,) if module.affine or module.track_running_stats else ()) + tuple(
            range(2, ndim))

    def samples(self) -> Sequence[Sample]:
        return (Sample("instancenorm", lambda: SampleNet(nn.InstanceNorm2d(4), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),
                Sample("instancenorm-affine-tracked",
                       lambda: SampleNet(nn.InstanceNorm2d(4, affine=True,
                                                          track_running_stats=True), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS),
                Sample("instancenorm3d-tracked",
                       lambda: _VolumeNorm(nn.InstanceNorm3d(4, track_running_stats=True,
                                                             momentum=None)),
                       (5, 2, 3, 4, 3), VOLUME_GRIDS),
                Sample("instancenorm3d",
                       lambda: _VolumeNorm(nn.InstanceNorm3d(4, affine=True)), (5, 2, 3, 4, 3),
                       VOLUME_GRIDS))


class FunctionalGroupNormHandler(Handler):
    """``F.group_norm(x, num_groups, weight, bias, eps)`` as a module's forward writes it (timm's
    ``GroupNorm``), ``weight`` and ``bias`` model tensors or None: as ``nn.GroupNorm``
    (:class:`GroupNormHandler`): each group's channels made whole first (an allgather over the
    grid dims that split them, priced as the conversion it is); on a spatially split value, in
    place (:class:`~distconv.nn.groupnorm.DistGroupNorm`: the statistics of each sample's group
    reduced over the spatial grid dims), ``weight`` and ``bias`` applied whole after it (their
    gradients' local sums completed by the replicated parameters' all-rank sum); otherwise the
    call as written on each rank's samples."""

    functions = frozenset({F.group_norm})
    layer_operands = True
    #: the call's arguments in order, and the defaults of those that have one
    order: tuple[str, ...] = ("input", "num_groups", "weight", "bias", "eps")
    defaults: dict[str, Any] = {"weight": None, "bias": None, "eps": 1e-5}

    def call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        found = dict(self.defaults)
        found.update(zip(self.order, args))
        found.update(kwargs)
        return found

    def groups(self, an: Any, node: Any, call: dict[str, Any]) -> int | None:
        """The number of groups (None: one per channel)."""
        groups = call.get("num_groups")
        if not isinstance(groups, int) or isinstance(groups, bool):
            an.fail(node, f"give group_norm's num_groups as an int, got {groups!r}", TypeError)
        return groups

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import LayerSpec, Step

        call = self.call(node.args, node.kwargs)
        x = call["input"]
        name = getattr(node.target, "__name__", "norm")
        if not isinstance(x, fx.Node) or an.out.get(x) is None or is_constant(x):
            an.fail(node, f"pass {name} an activation to normalise: its input here is no value "
                    "computed from the model's input")
        for k in ("weight", "bias"):
            v = call[k]
            if v is not None and not (isinstance(v, fx.Node) and is_constant(v)):
                an.fail(node, f"pass {name}'s {k} as a model tensor (a parameter or buffer) or "
                        f"None; here it is {getattr(v, 'name', v)!r}, computed from the input")
        if isinstance(call["eps"], fx.Node):
            an.fail(node, f"give {name}'s eps as a number", TypeError)
        self.groups(an, node, call)
        p = an.placement(x).settled()
        if p.ndim < 2:
            an.fail(node, f"give {name} (N, C, ...) inputs: it got {p.ndim} dims", ValueError)
        need = Placement(p.layout, Dist((p.dist.entries[0], None, *p.dist.entries[2:])))
        needs = {x: need}
        for k in ("weight", "bias"):
            if call[k] is not None:
                needs[call[k]] = Placement(p.layout, Dist((None,)))
        ext = dict(p.layout)
        spatial = any(ext.get(g, 1) > 1 for d in range(2, p.ndim) for g in p.dist.grid_dims_of(d))
        layer = LayerSpec("groupnorm-call", node.name, p.layout, input=need) if spatial else None
        return Step(node, "norm", need, needs, layer)

    def operands(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """``weight`` and ``bias`` of the call (None where absent)."""
        call = self.call(args, kwargs)
        return call["weight"], call["bias"]

    def build(self, module: Any, node: Any, step: Any, grid: Any) -> Any:
        call = self.call(node.args, node.kwargs)
        return _DistGroupNormCall(call.get("num_groups"), float(call["eps"]), grid=grid,
                                  input_dist=step.layer.input.dist)

    def price(self, report: Any, step: Any, module: Any, ctx: PriceContext) -> None:
        if step.layer is not None:
            call = self.call(step.node.args, step.node.kwargs)
            _sample_statistics(report, step.out, ctx, 2, call.get("num_groups")
                               or ctx.in_shape[1])  # per (sample, group)

    def samples(self) -> Sequence[Sample]:
        return (Sample("F.group_norm", lambda: SampleNet(_GroupNormCall(2, 4), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),
                Sample("F.group_norm-3d", lambda: _VolumeNorm(_GroupNormCall(4, 4, affine=False)),
                       (5, 2, 3, 4, 3), VOLUME_GRIDS))


class FunctionalInstanceNormHandler(FunctionalGroupNormHandler):
    """``F.instance_norm(x, None, None, weight, bias, use_input_stats=True, momentum, eps)``:
    a group norm of one group per channel (:class:`FunctionalGroupNormHandler`). Refused by
    name: running statistics (use ``nn.InstanceNorm`` modules, which track them exactly)."""

    functions = frozenset({F.instance_norm})
    order = ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats",
             "momentum", "eps")
    defaults = {"running_mean": None, "running_var": None, "weight": None, "bias": None,
                "use_input_stats": True, "momentum": 0.1, "eps": 1e-5}

    def groups(self, an: Any, node: Any, call: dict[str, Any]) -> int | None:
        if call["running_mean"] is not None or call["running_var"] is not None or (
                call["use_input_stats"] is not True):
            an.fail(node, "use an nn.InstanceNorm module (track_running_stats=True) for running "
                    "statistics: this instance_norm call passes its own, which no layer keeps")
        return None

    def samples(self) -> Sequence[Sample]:
        return (Sample("F.instance_norm", lambda: SampleNet(_InstanceNormCall(4), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS),)


class _DistGroupNormCall(nn.Module):
    """One ``F.group_norm`` / ``F.instance_norm`` call on a spatially split value: the
    normalisation of :class:`~distconv.nn.groupnorm.DistGroupNorm` (made for the channels of the
    first input; no parameters of its own), then the call's ``weight`` and ``bias``, whole."""

    def __init__(self, groups: int | None, eps: float, *, grid: Any, input_dist: Dist) -> None:
        super().__init__()
        self.groups, self.eps, self.grid, self.input_dist = groups, eps, grid, input_dist
        segment = [g for d in range(2, input_dist.ndim) for g in input_dist.grid_dims_of(d)
                   if grid.extent(g) > 1]
        grid.subcomm(segment)  # collective: now, in the same order on every rank
        self._norms: dict[int, nn.Module] = {}

    def forward(self, x: torch.Tensor, global_shape: Sequence[int], weight: Any = None,
                bias: Any = None) -> torch.Tensor:
        from distconv.nn.groupnorm import DistGroupNorm

        channels = int(global_shape[1])
        norm = self._norms.get(channels)
        if norm is None:
            norm = self._norms[channels] = DistGroupNorm(
                self.groups or channels, channels, self.eps, affine=False, grid=self.grid,
                input_dist=self.input_dist)
        y = norm(x, global_shape)
        view = (1, -1) + (1,) * (y.dim() - 2)
        if weight is not None:
            y = y * weight.to(y.dtype).view(view)
        if bias is not None:
            y = y + bias.to(y.dtype).view(view)
        return y


class _GroupNormCall(nn.GroupNorm):
    """timm's ``GroupNorm``: ``F.group_norm`` in the module's forward."""

    def forward(self, x: Any) -> Any:
        return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


class _InstanceNormCall(nn.Module):
    """An instance norm written as ``F.instance_norm`` with the module's own weight and bias."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: Any) -> Any:
        return F.instance_norm(x, weight=self.weight, bias=self.bias, eps=1e-3)
