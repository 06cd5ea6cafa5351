"""Group and instance normalisation of an activation whose spatial dims are split.

``nn.GroupNorm`` normalises each sample's group of channels over the group's channels and every
spatial position; ``nn.InstanceNorm1d/2d/3d`` each sample's channel over its spatial positions:
a group norm with one channel per group (its running statistics, if it tracks them, the means
over the global batch of its instances' statistics, allreduced over the grid dims that split
the samples). With the channels whole on
every rank and the samples and spatial dims blocked over grid dims, the statistics of a
(sample, group) are those of its blocks on the ranks that split its spatial dims::

    forward   1. n, mean_r, M2_r of each local (sample, group) block                   local
              2. {n, mean, M2}_r <- every rank of the spatial segment                 allgather
              3. mean, M2 combined (Chan et al.), y = (x - mean) / sqrt(M2/M + eps)   local
              4. y · w + b (per channel, w and b replicated)                          local
    backward  1. Σdx̂, Σdx̂·x̂ of each local (sample, group) block                       local
              2. Σdx̂, Σdx̂·x̂ <- Σ over the spatial segment                            allreduce
              3. dL/dx = (dx̂ - Σdx̂/M - x̂ Σdx̂·x̂/M) / sqrt(var + eps)                   local

with M the group's channels times the global spatial positions. Samples are independent: the
sample dim's grid dims take no part. The weight's and bias's gradients are local sums completed
with the other replicated parameters' (the bucketed allreduce over every rank).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.nn._activation import (
    check_activation_dist, check_grid, resolve_shape, show, split_dims,
)
from distconv.nn._amp import autocast_dtype
from distconv.nn.clip import register_parameter_specs
from distconv.nn.grad_sync import redundant_sync
from distconv.nn.sharding import ShardSpec, keep_requires_grad
from distconv.nn.batchnorm_statistics import _moments
from distconv.nn.recompute import is_recomputing

__all__ = ["DistGroupNorm", "DistInstanceNorm1d", "DistInstanceNorm2d", "DistInstanceNorm3d",
           "DistLayerNorm", "from_module"]


class _GroupedNorm(nn.Module):
    """``nn.GroupNorm`` or an ``nn.InstanceNorm1d/2d/3d`` (:class:`_DistInstanceNorm`) on an
    activation in ``input_dist`` (channels whole; samples and spatial dims split any way), its
    output in the same Dist (module docstring). Build one with :func:`from_module`; each is an
    instance of its torch class (:class:`DistGroupNorm`, :class:`DistInstanceNorm2d`, ...), so the
    idioms written for one process find it.

    Args:
        num_groups: groups of channels (an instance norm: one per channel).
        num_channels: the global channel count.
        eps: as the module's.
        affine: whether there are a per-channel weight and bias (replicated on every rank).
        grid: the :class:`~distconv.grid.ProcessorGrid` over all ranks.
        input_dist: the input's Dist (3 to 5 entries: N, C and the spatial dims; the channel
            entry whole, no pending dims).

    Raises:
        TypeError: ``grid`` or ``input_dist`` of the wrong type.
        ValueError: a channel entry that splits the channels, channels not divisible by the
            groups, a bad ``eps``.
    """

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5,
                 affine: bool = True, device: Any = None, dtype: torch.dtype | None = None, *,
                 grid: ProcessorGrid, input_dist: Dist) -> None:
        nn.Module.__init__(self)  # the torch class's init would allocate the global state
        name = type(self).__name__
        for what, v in (("num_groups", num_groups), ("num_channels", num_channels)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: {what} must be a positive int, got {v!r}")
        if num_channels % num_groups:
            raise ValueError(f"{name}: num_channels ({num_channels}) must be divisible by "
                             f"num_groups ({num_groups})")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"{name}: eps must be a non-negative number, got {eps!r}")
        self.grid = check_grid(name, grid)
        self.input_dist = self.output_dist = check_activation_dist(name, grid, input_dist,
                                                                   (3, 4, 5))
        if split_dims(grid, self.input_dist, 1):
            raise ValueError(f"{name}: {show(self.input_dist, 'x')} splits the channels; a "
                             "group's statistics need its channels whole on every rank")
        self.num_groups, self.num_channels = num_groups, num_channels
        self.eps, self.affine = float(eps), bool(affine)
        kw = {"device": device, "dtype": dtype}
        if self.affine:
            self.weight: nn.Parameter | None = nn.Parameter(torch.ones(num_channels, **kw))
            self.bias: nn.Parameter | None = nn.Parameter(torch.zeros(num_channels, **kw))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        # the spatial segment: created collectively, in the same order on every rank
        segment = [g for d in range(2, self.input_dist.ndim)
                   for g in split_dims(grid, self.input_dist, d)]
        self._comm = grid.subcomm(segment) if segment else None
        self._resolved: dict[Any, Any] = {}


    def forward(self, x: torch.Tensor, global_shape: Sequence[int] | None = None) -> torch.Tensor:
        """This rank's block of the normalised activation from its block ``x`` of the global
        input of ``global_shape`` (in :attr:`input_dist`)."""
        shape = resolve_shape(type(self).__name__, self.grid, self.input_dist, x, global_shape,
                              self._resolved)
        if shape[1] != self.num_channels:
            raise ValueError(f"{type(self).__name__}: the input has {shape[1]} channels, "
                             f"expected {self.num_channels}")
        if autocast_dtype(x.device.type) is not None:
            x = x.float()  # autocast runs group_norm in float32, as here
        count = (self.num_channels // self.num_groups) * math.prod(shape[2:])
        y, mean, var = _GroupNorm.apply(x, self.weight, self.bias, self._comm, self.eps,
                                        self.num_groups, count)
        self._track(mean, var, x.shape[0], shape[0], math.prod(shape[2:]))
        return y

    def _track(self, mean: torch.Tensor, var: torch.Tensor, n: int, total: int,
               count: int) -> None:
        """Running statistics (an instance norm that tracks them); nothing here."""

    def extra_repr(self) -> str:
        return (f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}, "
                f"grid={dict(self.grid.layout)}, x={show(self.input_dist, 'x')}")


class DistGroupNorm(_GroupedNorm, nn.GroupNorm):
    """``nn.GroupNorm`` on a spatially split activation (:class:`_GroupedNorm`); an
    ``nn.GroupNorm`` for ``isinstance``."""


class _DistInstanceNorm(_GroupedNorm):
    """An instance norm: one group per channel. With ``track_running_stats`` its running
    statistics are those of one process: in training, the means over the global batch of each
    instance's mean and unbiased variance (summed over the grid dims that split the samples),
    blended with ``momentum`` (None: not at all, as torch's instance norm); in eval mode it
    normalises with them, a local op. They are replicated on every rank."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = False, track_running_stats: bool = False, device: Any = None,
                 dtype: torch.dtype | None = None, *, grid: ProcessorGrid,
                 input_dist: Dist) -> None:
        super().__init__(num_features, num_features, eps, affine, device, dtype, grid=grid,
                         input_dist=input_dist)
        self.num_features = num_features
        self.momentum, self.track_running_stats = momentum, bool(track_running_stats)
        kw = {"device": device, "dtype": dtype}
        if self.track_running_stats:
            self.register_buffer("running_mean", torch.zeros(num_features, **kw))
            self.register_buffer("running_var", torch.ones(num_features, **kw))
            self.register_buffer("num_batches_tracked",
                                 torch.tensor(0, dtype=torch.long, device=device))
            samples = split_dims(grid, self.input_dist, 0)  # created on every rank alike
            self._sample_comm = grid.subcomm(samples) if samples else None
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)

    def forward(self, x: torch.Tensor, global_shape: Sequence[int] | None = None) -> torch.Tensor:
        if self.training or not self.track_running_stats:
            return super().forward(x, global_shape)
        resolve_shape(type(self).__name__, self.grid, self.input_dist, x, global_shape,
                      self._resolved)
        work = x.float() if autocast_dtype(x.device.type) is not None else x
        return F.instance_norm(work, self.running_mean, self.running_var, self.weight,
                               self.bias, False, 0.0, self.eps)

    @torch.no_grad()
    def _track(self, mean: torch.Tensor, var: torch.Tensor, n: int, total: int,
               count: int) -> None:
        if not (self.training and self.track_running_stats) or is_recomputing():
            return
        c = self.num_features
        unbiased = var * (count / (count - 1)) if count > 1 else var
        sums = torch.cat([mean.view(n, c).sum(0), unbiased.view(n, c).sum(0)])
        if self._sample_comm is not None:  # the other sample blocks' instances
            sums = self._sample_comm.allreduce(
                sums, meta=f"{type(self).__name__} running statistics over the samples")
        # as torch's instance norm: momentum None blends nothing, num_batches_tracked stays
        factor = 0.0 if self.momentum is None else float(self.momentum)
        batch = (sums / total).to(self.running_mean.dtype)
        self.running_mean.mul_(1 - factor).add_(factor * batch[:c])
        self.running_var.mul_(1 - factor).add_(factor * batch[c:])


class DistInstanceNorm1d(_DistInstanceNorm, nn.InstanceNorm1d):
    """``nn.InstanceNorm1d`` on a split signal; an
    ``nn.InstanceNorm1d`` for ``isinstance``."""


class DistInstanceNorm2d(_DistInstanceNorm, nn.InstanceNorm2d):
    """``nn.InstanceNorm2d`` on a split image; an
    ``nn.InstanceNorm2d`` for ``isinstance``."""


class DistInstanceNorm3d(_DistInstanceNorm, nn.InstanceNorm3d):
    """``nn.InstanceNorm3d`` on a split volume; an
    ``nn.InstanceNorm3d`` for ``isinstance``."""


_INSTANCE = {nn.InstanceNorm1d: DistInstanceNorm1d, nn.InstanceNorm2d: DistInstanceNorm2d,
             nn.InstanceNorm3d: DistInstanceNorm3d}


def from_module(module: nn.Module, *, grid: ProcessorGrid, input_dist: Dist) -> nn.Module:
    """The distributed layer of an ``nn.GroupNorm``, an ``nn.InstanceNorm1d/2d/3d`` or an
    ``nn.LayerNorm`` (the same on every rank), with its parameters and running statistics."""
    if isinstance(module, nn.LayerNorm):
        return DistLayerNorm.from_module(module, grid=grid, input_dist=input_dist)
    ref = getattr(module, "weight", None)
    kw = {"device": None if ref is None else ref.device,
          "dtype": None if ref is None else ref.dtype, "grid": grid, "input_dist": input_dist}
    if isinstance(module, nn.GroupNorm):
        out: _GroupedNorm = DistGroupNorm(module.num_groups, module.num_channels, module.eps,
                                          module.affine, **kw)
    elif type(module) in _INSTANCE:
        out = _INSTANCE[type(module)](module.num_features, module.eps, module.momentum,
                                      module.affine, module.track_running_stats, **kw)
        if module.track_running_stats:
            with torch.no_grad():
                out.running_mean.copy_(module.running_mean)
                out.running_var.copy_(module.running_var)
                out.num_batches_tracked.copy_(module.num_batches_tracked)
    else:
        raise TypeError(f"module must be an nn.GroupNorm, nn.InstanceNorm1d/2d/3d or "
                        f"nn.LayerNorm, got {type(module).__name__}")
    if module.affine:
        with torch.no_grad():
            out.weight.copy_(module.weight)
            out.bias.copy_(module.bias)
        keep_requires_grad(out, module, ("weight", "bias"))
    return out.train(module.training)


class _GroupNorm(torch.autograd.Function):
    """Training-mode group normalisation over the segment of ``comm`` with the per-channel affine
    fused in (module docstring), in as few passes over the activation as torch's own kernel: the
    statistics in one (``var_mean``), the output in one (``y = x·scale + shift`` with per-(sample,
    channel) coefficients), and in backward two reductions and two passes. Saves the input and
    the per-(sample, group) statistics only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, comm: Any, eps: float, groups: int,
                count: int) -> torch.Tensor:
        n, c = x.shape[:2]
        work = x.float() if x.dtype in _LOW else x
        per_group = c // groups * math.prod(x.shape[2:])  # explicit: a block may be empty
        mean, var = _moments(work.reshape(1, n * groups, per_group), comm, count)
        invstd = (var + eps).rsqrt()
        scale, shift = _coefficients(mean, invstd, weight, bias, n, c, groups, work.dtype)
        view = (n, c, *([1] * (x.dim() - 2)))
        y = torch.addcmul(shift.view(view), work, scale.view(view))
        ctx.comm, ctx.groups, ctx.count = comm, groups, count
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.mark_non_differentiable(mean, var)
        return y.to(x.dtype), mean, var

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        (n, c), g = x.shape[:2], ctx.groups
        work = x.float() if x.dtype in _LOW else x
        dy = dy.to(work.dtype).contiguous()
        positions = math.prod(x.shape[2:])
        rows = dy.reshape(n * c, 1, positions)
        sum_dy = rows.sum(2).view(n, c)  # per (sample, channel)
        sum_dy_x = torch.bmm(rows, work.reshape(n * c, positions, 1)).view(n, c)
        m, s = mean.view(n, g, 1), invstd.view(n, g, 1)
        # per (sample, channel): Σ dy·x̂ = s (Σ dy·x - m Σ dy)
        sum_dy_xhat = (s * (sum_dy_x.view(n, g, -1) - m * sum_dy.view(n, g, -1))).view(n, c)
        dw = sum_dy_xhat.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = sum_dy.sum(0).to(weight.dtype) if ctx.needs_input_grad[2] else None
        dx = None
        if ctx.needs_input_grad[0]:
            w = (weight.to(work.dtype) if weight is not None
                 else work.new_ones(c)).view(1, g, -1)
            # the group sums of dx̂ = dy·w and of dx̂·x̂
            sums = torch.stack([(w * sum_dy.view(n, g, -1)).sum(2),
                                (w * sum_dy_xhat.view(n, g, -1)).sum(2)])
            if ctx.comm is not None:
                sums = ctx.comm.allreduce(sums, meta="DistGroupNorm backward sums")
            a, b = sums[0].view(n, g, 1) / ctx.count, sums[1].view(n, g, 1) / ctx.count
            # dx = s (dy·w - a - x̂ b) = dy·(s w) + x·(-s² b) + (m s² b - s a)
            on_dy = (s * w).view(n, c)
            on_x = (-s * s * b).expand(n, g, c // g).reshape(n, c)
            const = (m * s * s * b - s * a).expand(n, g, c // g).reshape(n, c)
            view = (n, c, *([1] * (x.dim() - 2)))
            dx = torch.addcmul(const.view(view), work, on_x.view(view))
            dx.addcmul_(dy, on_dy.view(view))
            dx = dx.to(x.dtype)
        return dx, dw, db, None, None, None, None


_LOW = (torch.float16, torch.bfloat16)


def _coefficients(mean: torch.Tensor, invstd: torch.Tensor, weight: torch.Tensor | None,
                  bias: torch.Tensor | None, n: int, c: int, groups: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (sample, channel): ``scale = invstd·w`` and ``shift = b - mean·scale``, so that the
    normalised, affine output is ``x·scale + shift``."""
    s = invstd.view(n, groups, 1)
    w = (weight.to(dtype).view(1, groups, -1) if weight is not None
         else s.new_ones(1, groups, c // groups))
    scale = s * w
    shift = -mean.view(n, groups, 1) * scale
    if bias is not None:
        shift = shift + bias.to(dtype).view(1, groups, -1)
    return scale.reshape(n, c), shift.reshape(n, c)


class DistLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` over the trailing dims of an activation (``(C, H, W)`` or ``(H, W)`` of
    an image, ``(C, D, H, W)`` of a volume, ``(W,)`` of a signal) in ``input_dist``, any of its
    dims split; the output in the same Dist. The statistics of each row (a sample and its
    leading dims' indices) are those of its blocks on the ranks that split the normalised dims
    (the allgather and allreduce of :class:`DistGroupNorm` with one group, over the grid dims of
    the normalised entries). The elementwise weight and bias (shape ``normalized_shape``) are
    sharded like those entries (``w[o_C,o_H,*]``, ``w[o_H,*]`` and the like), replicated over
    the other grid dims, whose gradient allreduce completes them. Build it with
    :meth:`from_module`.

    Raises:
        TypeError: ``grid`` or ``input_dist`` of the wrong type.
        ValueError: a ``normalized_shape`` with as many dims as the activation or more.
    """

    def __init__(self, normalized_shape: Sequence[int], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, device: Any = None,
                 dtype: torch.dtype | None = None, *, grid: ProcessorGrid,
                 input_dist: Dist) -> None:
        nn.Module.__init__(self)  # the torch class's init would allocate the global weight
        name = type(self).__name__
        self.grid = check_grid(name, grid)
        self.normalized_shape = tuple(int(s) for s in normalized_shape)
        k = len(self.normalized_shape)
        if not 1 <= k <= 4:
            raise ValueError(f"{name}: normalized_shape must have 1 to 4 dims, got "
                             f"{self.normalized_shape}")
        self.input_dist = self.output_dist = check_activation_dist(
            name, grid, input_dist, tuple(range(max(k + 1, 2), 6)))
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"{name}: eps must be a non-negative number, got {eps!r}")
        self.eps, self.elementwise_affine = float(eps), bool(elementwise_affine)
        #: the weight's and bias's Dist: the activation's normalised (trailing) entries
        self.param_dist = Dist(self.input_dist.entries[self.input_dist.ndim - k:])
        kw = {"device": device, "dtype": dtype}
        local = self.param_dist.local_shape(self.normalized_shape, grid)
        # (registered, None included: an attribute set to None first could not be)
        self.register_parameter("weight", nn.Parameter(torch.ones(local, **kw))
                                if elementwise_affine else None)
        self.register_parameter("bias", nn.Parameter(torch.zeros(local, **kw))
                                if elementwise_affine and bias else None)
        # created collectively, in the same order on every rank
        segment = [g for d in range(self.input_dist.ndim - k, self.input_dist.ndim)
                   for g in split_dims(grid, self.input_dist, d)]
        self._comm = grid.subcomm(segment) if segment else None
        self.grad_sync = redundant_sync(grid, self.param_dist, name, (self.weight, self.bias))
        register_parameter_specs(self, grid.comm)
        self._resolved: dict[Any, Any] = {}

    @classmethod
    def from_module(cls, module: nn.LayerNorm, *, grid: ProcessorGrid,
                    input_dist: Dist) -> DistLayerNorm:
        """The layer for an ``nn.LayerNorm`` (the same on every rank) with its shards."""
        if not isinstance(module, nn.LayerNorm):
            raise TypeError(f"module must be an nn.LayerNorm, got {type(module).__name__}")
        ref = module.weight
        out = cls(module.normalized_shape, module.eps, module.elementwise_affine,
                  module.bias is not None, None if ref is None else ref.device,
                  None if ref is None else ref.dtype, grid=grid, input_dist=input_dist)
        slices = out.param_dist.local_slices(out.normalized_shape, grid)
        with torch.no_grad():
            for mine, theirs in ((out.weight, module.weight), (out.bias, module.bias)):
                if mine is not None:
                    mine.copy_(theirs[slices])
                    mine.requires_grad_(theirs.requires_grad)
        return out.train(module.training)

    def _shard_specs(self) -> dict[str, ShardSpec]:
        return {n: ShardSpec(self.grid, self.param_dist, self.normalized_shape)
                for n in ("weight", "bias") if getattr(self, n) is not None}

    def finish_grad_sync(self) -> None:
        """Finish pending gradient allreduces (``loss.backward()`` does this itself)."""
        if self.grad_sync is not None:
            self.grad_sync.finish()

    def forward(self, x: torch.Tensor, global_shape: Sequence[int] | None = None) -> torch.Tensor:
        """This rank's block of the normalised activation from its block ``x`` of the global
        input of ``global_shape`` (in :attr:`input_dist`)."""
        shape = resolve_shape(type(self).__name__, self.grid, self.input_dist, x, global_shape,
                              self._resolved)
        k = len(self.normalized_shape)
        if tuple(shape[-k:]) != self.normalized_shape:
            raise ValueError(f"{type(self).__name__}: the input {shape} does not end in "
                             f"normalized_shape {self.normalized_shape}")
        if autocast_dtype(x.device.type) is not None:
            x = x.float()  # autocast runs layer_norm in float32, as here
        lead = x.shape[:x.dim() - k]  # one row of statistics per sample and leading index
        rows = x.reshape(math.prod(lead), 1, *x.shape[x.dim() - k:])
        y = _GroupNorm.apply(rows, None, None, self._comm, self.eps, 1,
                             math.prod(self.normalized_shape))[0].view(x.shape)
        if self.weight is not None:
            y = y * self.weight.to(y.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, grid={dict(self.grid.layout)}, "
                f"x={show(self.input_dist, 'x')}, w={self.param_dist.format('w')}")
