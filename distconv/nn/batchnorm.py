"""Batch normalisation of a distributed activation with the statistics of the whole global batch."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.nn._statistics import (
    STATISTICS, check_statistics, resolve_statistics, statistics_groups,
)
from distconv.nn._activation import (
    check_activation_dist, check_grid, resolve_shape, show, split_dims,
)
# _moments stays importable from here, as before the statistics had their own module
from distconv.nn.batchnorm_statistics import _LOW_PRECISION, _BatchNorm, _moments  # noqa: F401
from distconv.nn.clip import register_parameter_specs
from distconv.nn.grad_sync import GradSync
from distconv.nn.recompute import is_recomputing
from distconv.nn.sharding import ShardSpec, keep_requires_grad
from distconv.redistribute import gather

__all__ = ["STATISTICS", "DistBatchNorm", "DistBatchNorm1d", "DistBatchNorm2d", "DistBatchNorm3d",
           "broadcast_running"]


class DistBatchNorm(nn.modules.batchnorm._BatchNorm):
    r"""Batch normalisation on a distributed activation, with the semantics of ``nn.SyncBatchNorm``
    over the whole global batch: the common base of :class:`DistBatchNorm2d`,
    :class:`DistBatchNorm3d` and :class:`DistBatchNorm1d`, each an ``nn.BatchNorm2d`` / ``3d`` /
    ``1d`` for ``isinstance``, so the idioms written for one process hold (``if isinstance(m,
    nn.BatchNorm2d): m.eval()`` freezes its statistics; parameter groups that exclude norms find
    it); its parameters and buffers are this rank's shards, and its ``forward`` takes the global
    input shape as a second, optional argument.

    The input ``x`` and output ``y`` are distributed as ``input_dist`` (e.g. ``x[o,o_C,o,o]``,
    ``x[o,o_{F×C},o,o]``, ``x[o,*,o,o]``); any grid dims may appear in any entry. The grid dims of
    the N, H and W entries form the *statistics segment*; the grid dims of the channel entry split
    the channels, whose blocks are independent; the remaining (redundant) grid dims hold replicas,
    which are never counted twice. Per channel, on a batch of M = N·H·W values::

        forward   1. n_r, mean_r, M2_r of the local block                        local
                  2. {n, mean, M2}_r <- every rank of the segment               allgather
                  3. mean = Σ n_r mean_r / M                                    local
                     M2 = Σ M2_r + Σ n_r (mean_r - mean)²  (Chan et al.)
                  4. y = (x - mean) / sqrt(M2 / M + eps) · w + b                local
        backward  1. Σdy, Σdy·x̂ of the local block                             local
                  2. Σdy, Σdy·x̂ <- Σ over the segment                         allreduce
                  3. dL/dx = w / sqrt(var + eps) · (dy - Σdy/M - x̂ Σdy·x̂/M)   local
                  4. dL/dw = Σdy·x̂, dL/db = Σdy, completed over the grid dims
                     w[o_C] leaves unused                                       allreduce

    The combination of step 3 is exact and numerically stable (no E[x²] - E[x]²); every rank of
    a segment combines the same gathered values in the same order, so all ranks holding a channel
    block get bitwise the same statistics and running statistics. Uneven and empty local blocks
    take part with their own counts. With the library's sum convention the cotangent of ``y``
    arrives as a pending sum over the redundant dims; backward step 2 therefore sums over the
    segment only, and the parameter gradients (``w[o_C]`` is replicated over the segment *and* the
    redundant dims) are completed by one segmented allreduce over all the grid dims ``w`` leaves
    unused, started from a gradient hook and finished before ``loss.backward()`` returns.

    ``weight``, ``bias``, ``running_mean`` and ``running_var`` are distributed like the channel
    entry (``w[o_C]``, ``w[o_{F×C}]``, ``w[*]``); ``num_batches_tracked`` is replicated. Running
    statistics follow ``nn.BatchNorm2d`` exactly (unbiased variance with the global count,
    ``momentum=None`` for a cumulative average). In eval mode with running statistics the layer
    is local (no communication); with ``track_running_stats=False`` it uses batch statistics in
    both modes.

    Example::

        grid = ProcessorGrid({"N": 2, "C": 2})
        bn = DistBatchNorm2d(64, grid=grid, input_dist=Dist.parse("x[o,o_C,o,o]", "NCHW"))
        y = bn(x, (32, 64, 28, 28))          # x, y: this rank's blocks of x[o,o_C,o,o]

    Args:
        num_features, eps, momentum, affine, track_running_stats, device, dtype: as
            ``nn.BatchNorm2d`` (``num_features`` is the global channel count).
        grid: the :class:`~distconv.grid.ProcessorGrid` over all ranks.
        input_dist: the Dist of the input (N, C and the spatial dims: 4 entries N, C, H, W for
            :class:`DistBatchNorm2d`, 5 for ``3d``, 2 or 3 for ``1d``; no pending dims); the
            output has the same Dist.
        statistics: ``'global'`` (default): the statistics of the whole global batch, as above.
            ``'local'``: each sample block's own statistics (the segment is the grid dims of the
            H and W entries only), DDP's plain-BN semantics; the running statistics are sample
            block 0's on every rank (as DDP's broadcast buffers make them), sent by one
            asynchronous broadcast of the block's batch statistics per step and applied at the
            next forward or ``state_dict``. An int ``k``: each group of k consecutive sample
            blocks normalises by the statistics of its samples (the segment is the group's
            ranks over the N, H and W entries), the running statistics sample block 0's group's,
            sent as with ``'local'``; k must divide the number of sample blocks (``1`` is
            ``'local'``, that number ``'global'``, and :attr:`statistics` says which runs).

    Raises:
        TypeError: ``grid`` or ``input_dist`` of the wrong type.
        ValueError: a bad ``num_features``, ``eps``, ``momentum`` or ``statistics``, an
            ``input_dist`` with the wrong number of entries, with pending dims or naming grid dims ``grid``
            lacks.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        grid: ProcessorGrid,
        input_dist: Dist,
        statistics: str = "global",
    ) -> None:
        nn.Module.__init__(self)  # nn.BatchNorm2d's own init would allocate the global state
        name = type(self).__name__
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features must be a positive int, got {num_features!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"eps must be a non-negative number, got {eps!r}")
        if momentum is not None and (
            isinstance(momentum, bool) or not isinstance(momentum, (int, float))
        ):
            raise ValueError(f"momentum must be a number or None, got {momentum!r}")
        check_statistics(statistics)
        self.num_features, self.eps, self.momentum = num_features, float(eps), momentum
        self.affine, self.track_running_stats = bool(affine), bool(track_running_stats)
        self.grid = check_grid(name, grid)
        self._dist = check_activation_dist(name, grid, input_dist, self._ndims)
        self.input_dist = self.output_dist = self._dist
        self.param_dist = Dist((self._dist.entries[1],))
        nd = self._dist.ndim
        #: the dims a channel's statistics reduce over (all but the channels)
        self._reduce = (0, *range(2, nd))
        self._view = (1, -1, *([1] * (nd - 2)))  # a per-channel vector against x
        samples = split_dims(grid, self._dist, 0)
        statistics = resolve_statistics(
            statistics, math.prod(grid.extent(g) for g in samples), f"{name}({num_features})")
        self.statistics = statistics
        # Sub-communicators are created collectively, in the same order on every rank.
        over = tuple(range(2, nd)) if statistics == "local" else self._reduce
        segment = [g for d in over for g in split_dims(grid, self._dist, d)]
        #: groups of k sample blocks: the sample blocks of this rank's group (their N coords)
        self._group: list[dict[str, int]] | None = None
        if isinstance(statistics, int):
            groups = statistics_groups(grid.layout, samples, segment, statistics)
            self._stats_comm = grid.comm.split(groups)
            mine = next(g for g in groups if grid.rank in g)
            seen = {tuple(grid.coords_of(r)[d] for d in samples): grid.coords_of(r)
                    for r in mine}
            self._group = list(seen.values())
        else:
            self._stats_comm = grid.subcomm(segment) if segment else None
        # statistics per sample block or group: the running statistics are sample block 0's
        # (DDP's broadcast buffers), sent to the other sample blocks asynchronously, off the
        # critical path
        blocks = samples if statistics != "global" else []
        self._block_comm = grid.subcomm(blocks) if blocks else None
        #: every value of this rank's channels is its own and its running statistics are no
        #: other rank's: the layer is torch's kernel on the block, as nn.BatchNorm runs it
        self._kernel_only = self._stats_comm is None and self._block_comm is None
        #: (block shape, global shape) -> values per channel, once checked (0: an empty block)
        self._counts: dict[tuple[Any, Any], int] = {}
        self._resolved: dict[Any, Any] = {}
        self._pending: tuple[RunningBroadcast, int, float | None] | None = None
        #: set by a ParallelModel for one forward: the layers' broadcasts go out as one
        self._collector: list[tuple[DistBatchNorm, torch.Tensor, float | None]] | None = None
        redundant = [d for d in self.param_dist.redundant(grid) if grid.extent(d) > 1]
        where = f"{name}({num_features}) over {'×'.join(redundant)}"
        self.grad_sync = GradSync(grid.subcomm(redundant), where=where) if redundant else None
        self._make_state(device, dtype)
        register_parameter_specs(self, grid.comm)  # for distconv.clip_grad_norm_

    # ------------------------------------------------------------------ state
    def _make_state(self, device: Any, dtype: torch.dtype | None) -> None:
        kw = {"device": device, "dtype": dtype}
        local = self.param_dist.local_shape((self.num_features,), self.grid)
        if self.affine:
            self.weight: nn.Parameter | None = nn.Parameter(torch.ones(local, **kw))
            self.bias: nn.Parameter | None = nn.Parameter(torch.zeros(local, **kw))
            if self.grad_sync is not None:
                self.grad_sync.register(self.weight)
                self.grad_sync.register(self.bias)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if self.track_running_stats:
            self.register_buffer("running_mean", torch.zeros(local, **kw))
            self.register_buffer("running_var", torch.ones(local, **kw))
            self.register_buffer(
                "num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device)
            )
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        """As torch's: running statistics reset, weight 1, bias 0 (no communication)."""
        self.reset_running_stats()
        if self.affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    @torch.no_grad()
    def load_global_state(
        self,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        running_mean: torch.Tensor | None = None,
        running_var: torch.Tensor | None = None,
        num_batches_tracked: torch.Tensor | int | None = None,
    ) -> None:
        """Copy this rank's shards of the given global tensors (the same on every rank) into the
        layer; ``None`` leaves a tensor as it is. No communication."""
        slices = self.param_dist.local_slices((self.num_features,), self.grid)
        for name, value in (("weight", weight), ("bias", bias), ("running_mean", running_mean),
                            ("running_var", running_var)):
            if value is None:
                continue
            mine = getattr(self, name)
            if mine is None:
                raise ValueError(f"{type(self).__name__} has no {name} (affine={self.affine}, "
                                 f"track_running_stats={self.track_running_stats})")
            if tuple(value.shape) != (self.num_features,):
                raise ValueError(
                    f"{name} must have the global shape ({self.num_features},), got "
                    f"{tuple(value.shape)}"
                )
            mine.copy_(value[slices])
        if num_batches_tracked is not None and self.num_batches_tracked is not None:
            self.num_batches_tracked.fill_(int(num_batches_tracked))

    #: the plain module this layer shards, the modules it takes and its input's numbers of dims
    #: (set by each subclass)
    _plain: type[nn.Module] = nn.BatchNorm2d
    _plain_types: tuple[type[nn.Module], ...] = (nn.BatchNorm2d, nn.SyncBatchNorm)
    _ndims: tuple[int, ...] = (4,)

    @classmethod
    def from_module(
        cls, layer: nn.Module, *, grid: ProcessorGrid, input_dist: Dist,
        statistics: str = "global",
    ) -> DistBatchNorm:
        """Shard a plain batch norm (``cls``'s torch module, or ``nn.SyncBatchNorm``), the same
        on every rank: its settings, parameters, running statistics and training mode."""
        if not isinstance(layer, cls._plain_types):
            names = " or ".join(f"nn.{t.__name__}" for t in cls._plain_types)
            raise TypeError(f"layer must be an {names}, got {type(layer).__name__}")
        ref = layer.weight if layer.weight is not None else layer.running_mean
        out = cls(
            layer.num_features, layer.eps, layer.momentum, layer.affine,
            layer.track_running_stats,
            None if ref is None else ref.device, None if ref is None else ref.dtype,
            grid=grid, input_dist=input_dist, statistics=statistics,
        )
        out.load_global_state(
            None if layer.weight is None else layer.weight.detach(),
            None if layer.bias is None else layer.bias.detach(),
            layer.running_mean, layer.running_var, layer.num_batches_tracked,
        )
        keep_requires_grad(out, layer, ("weight", "bias"))
        return out.train(layer.training)

    def _gather(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return gather(t.detach(), self.param_dist, self.grid, (self.num_features,))

    def to_plain(self) -> nn.Module:
        """The plain torch module (``nn.BatchNorm2d``, ``3d`` or ``1d``) with the gathered global
        state, on every rank (collective)."""
        state = [self._gather(t) for t in (self.weight, self.bias, self.running_mean,
                                           self.running_var)]
        ref = next((t for t in state if t is not None), None)
        layer = self._plain(
            self.num_features, self.eps, self.momentum, self.affine, self.track_running_stats,
            device=None if ref is None else ref.device, dtype=None if ref is None else ref.dtype,
        )
        with torch.no_grad():
            for name, value in zip(("weight", "bias", "running_mean", "running_var"), state):
                if value is not None:
                    getattr(layer, name).copy_(value)
            if self.num_batches_tracked is not None:
                layer.num_batches_tracked.copy_(self.num_batches_tracked)
        return layer.train(self.training)

    def _shard_specs(self) -> dict[str, ShardSpec]:
        shape = (self.num_features,)
        names = [n for n in ("weight", "bias", "running_mean", "running_var")
                 if getattr(self, n) is not None]
        specs = {n: ShardSpec(self.grid, self.param_dist, shape) for n in names}
        if self.num_batches_tracked is not None:
            specs["num_batches_tracked"] = ShardSpec(self.grid, Dist(()), ())
        return specs

    def finish_grad_sync(self) -> None:
        """Finish pending gradient allreduces (``loss.backward()`` does this itself)."""
        if self.grad_sync is not None:
            self.grad_sync.finish()

    # ------------------------------------------------------------------ forward
    def output_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        """The global output shape: the input's."""
        return tuple(int(s) for s in global_shape)

    def forward(self, x: torch.Tensor, global_shape: Sequence[int] | None = None) -> torch.Tensor:
        """Normalise this rank's block ``x`` of the global tensor of shape ``global_shape``
        (distributed as :attr:`input_dist`); returns this rank's block of the output (same Dist).

        ``global_shape`` may be left out only when ``input_dist`` splits nothing.
        """
        if self._kernel_only and (global_shape is None or type(global_shape) is tuple):
            key = (x.shape, global_shape)
            count = self._counts.get(key)
            if count is None:
                count = self._count(x, global_shape, key)
            if count > 1 and self._same_dtype(x):
                return self._kernel(x)
        self.settle()
        shape = self._shape(x, global_shape)
        self._check_dtype(x)
        if not self.training and self.track_running_stats:
            return self._normalize_with_running_stats(x)
        spatial = math.prod(shape[2:])
        count = shape[0] * spatial
        if self.training and count <= 1:
            raise ValueError(
                f"{type(self).__name__}: expected more than 1 value per channel when training, got "
                f"global input shape {shape}"
            )
        factor = 0.0
        # a checkpoint's recomputation in backward normalises the same batch again: the running
        # statistics were updated by the first forward
        running = self.training and self.track_running_stats and not is_recomputing()
        if running:
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                      else float(self.momentum))
        if self._group is not None:  # the samples of this rank's group of sample blocks
            count = spatial * sum(self._dist.local_shape(shape, self.grid, c)[0]
                                  for c in self._group)
        if self.statistics == "local":
            count = x.shape[0] * spatial  # this sample block's values per channel
            if self.training and count <= 1:
                raise ValueError(
                    f"{type(self).__name__}: expected more than 1 value per channel of a sample block "
                    f"when training with local statistics, got {x.shape[0]} sample(s) of "
                    f"{'x'.join(map(str, shape[2:])) or 'one value'}")
        if self._stats_comm is None and x.numel() and self._same_dtype(x):
            # every value of this rank's channels (of its sample block) is local: torch's own
            # kernel is exact (its backward is linear in dy, so a pending-sum cotangent gives
            # pending-sum gradients)
            mean, var = ((self.running_mean, self.running_var) if running
                         else self._running_stand_ins() if self.training and is_recomputing()
                         else (None, None))
            if self._block_comm is None:
                return F.batch_norm(x, mean, var, self.weight, self.bias, True, factor, self.eps)
            # the kernel updates this block's running statistics as one process would; sample
            # block 0's are sent to the others (DDP's broadcast buffers), applied by settle()
            y = F.batch_norm(x, mean, var, self.weight, self.bias, True, factor, self.eps)
            if running:
                self._send_running(torch.cat([self.running_mean, self.running_var]), None)
            return y
        y, mean, var = _BatchNorm.apply(
            x, self.weight, self.bias, self._stats_comm, self.eps, count,
        )
        if running:
            with torch.no_grad():
                unbiased = var * (count / (count - 1))
                if self._block_comm is None and mean.dtype == self.running_mean.dtype:
                    # in place: the same arithmetic as _update_running, without the concatenation
                    self.running_mean.mul_(1 - factor).add_(mean * factor)
                    self.running_var.mul_(1 - factor).add_(unbiased * factor)
                else:
                    self._send_running(torch.cat([mean, unbiased]), factor)
        return y

    def _shape(self, x: torch.Tensor, global_shape: Sequence[int] | None) -> tuple[int, ...]:
        """The global shape of block ``x``, checked."""
        shape = resolve_shape(type(self).__name__, self.grid, self._dist, x, global_shape,
                              self._resolved)
        if shape[1] != self.num_features:
            raise ValueError(
                f"{type(self).__name__}: global_shape {shape} has {shape[1]} channels, expected "
                f"num_features={self.num_features}"
            )
        return shape

    def _count(self, x: torch.Tensor, global_shape: tuple[int, ...] | None,
               key: tuple[Any, Any]) -> int:
        """The values per channel (N·H·W) of block ``x``, checked and remembered under ``key``;
        0 for a block without values (the general path handles it)."""
        shape = self._shape(x, global_shape)
        count = math.prod(shape[2:]) * shape[0] if x.numel() else 0
        if len(self._counts) > 64:
            self._counts.clear()
        self._counts[key] = count
        return count

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The forward of a layer whose statistics need no other rank (:attr:`_kernel_only`),
        on a block of more than one value per channel in the state's dtype: the one
        ``F.batch_norm`` call ``nn.BatchNorm`` makes, the same running-statistics update."""
        if not self.track_running_stats:
            return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        if is_recomputing():  # the first forward updated the running statistics
            mean, var = self._running_stand_ins()
            return F.batch_norm(x, mean, var, self.weight, self.bias, True, 0.0, self.eps)
        self.num_batches_tracked.add_(1)
        factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                  else float(self.momentum))
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True,
                            factor, self.eps)

    def _running_stand_ins(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What a checkpoint's recomputation gives ``F.batch_norm`` for the running statistics:
        copies (the kernel saves for backward what the first forward saved, which checkpoint
        requires, and the running statistics are not updated twice), or none without them."""
        if not self.track_running_stats:
            return None, None
        return self.running_mean.clone(), self.running_var.clone()

    @torch.no_grad()
    def _send_running(self, stats: torch.Tensor, factor: float | None) -> None:
        """Update the running statistics with the batch's ``[mean, unbiased var]``: at once, or,
        with local statistics over several sample blocks, with sample block 0's, broadcast
        asynchronously and applied by :meth:`settle`. ``factor=None``: ``stats`` are the
        updated running statistics themselves."""
        stats = stats.to(self.running_mean.dtype)
        if self._block_comm is None:
            self._update_running(stats, factor)
        elif self._collector is not None:
            self._collector.append((self, stats, factor))
        else:
            broadcast_running([(self, stats, factor)])

    @torch.no_grad()
    def _update_running(self, stats: torch.Tensor, factor: float | None) -> None:
        c = self.running_mean.shape[0]
        if factor is None:
            self.running_mean.copy_(stats[:c])
            self.running_var.copy_(stats[c:])
            return
        self.running_mean.copy_(factor * stats[:c] + (1 - factor) * self.running_mean)
        self.running_var.copy_(factor * stats[c:] + (1 - factor) * self.running_var)

    def settle(self) -> None:
        """Apply sample block 0's statistics of the last step to the running statistics (local
        statistics only; done by the next forward and by ``state_dict``). No new collective."""
        if self._pending is not None:
            shared, offset, factor = self._pending
            self._pending = None
            n = 2 * self.running_mean.shape[0]
            self._update_running(shared.result()[offset:offset + n], factor)

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        self.settle()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _same_dtype(self, x: torch.Tensor) -> bool:
        state = self.weight if self.weight is not None else self.running_mean
        return state is None or state.dtype == x.dtype

    def _check_dtype(self, x: torch.Tensor) -> None:
        state = self.weight if self.weight is not None else self.running_mean
        if state is None or x.dtype == state.dtype or (
            x.dtype in _LOW_PRECISION and state.dtype == torch.float32
        ):
            return
        raise TypeError(
            f"{type(self).__name__}: the input is {x.dtype} but the layer's parameters and running "
            f"statistics are {state.dtype}; convert one of them (nn.BatchNorm2d refuses mixed "
            "dtypes too, except a float16/bfloat16 input with float32 state)"
        )

    def _normalize_with_running_stats(self, x: torch.Tensor) -> torch.Tensor:
        if self._same_dtype(x) and x.shape[1]:  # torch's own kernel, as one process
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        v = self._view
        scale = (self.running_var + self.eps).rsqrt()
        y = (x - self.running_mean.view(v)) * scale.view(v)
        if self.affine:
            y = y * self.weight.view(v) + self.bias.view(v)
        return y

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
            f"affine={self.affine}, track_running_stats={self.track_running_stats}, "
            f"statistics={self.statistics!r}, grid={dict(self.grid.layout)}, "
            f"x={show(self.input_dist, 'x')}, "
            f"y={show(self.output_dist, 'y')}, w={show(self.param_dist, 'w')}"
        )


class DistBatchNorm2d(DistBatchNorm, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` on a distributed activation ``x[N, C, H, W]`` in ``input_dist``
    (:class:`DistBatchNorm`); an ``nn.BatchNorm2d`` for ``isinstance``."""

    _plain = nn.BatchNorm2d
    _plain_types = (nn.BatchNorm2d, nn.SyncBatchNorm)

    @classmethod
    def from_batchnorm2d(cls, layer: nn.Module, *, grid: ProcessorGrid, input_dist: Dist,
                         statistics: str = "global") -> DistBatchNorm2d:
        """:meth:`DistBatchNorm.from_module` of an ``nn.BatchNorm2d`` or ``nn.SyncBatchNorm``."""
        return cls.from_module(layer, grid=grid, input_dist=input_dist, statistics=statistics)

    def to_batchnorm2d(self) -> nn.BatchNorm2d:
        """A plain ``nn.BatchNorm2d`` with the gathered global state, on every rank (collective)."""
        return self.to_plain()


class DistBatchNorm3d(DistBatchNorm, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` on a distributed activation ``x[N, C, D, H, W]`` in ``input_dist`` (any
    of its dims split: ``x[o,o_C,o,o,*]`` over N, C, D and H, and the like), with the statistics
    of the whole global batch (:class:`DistBatchNorm`: the statistics segment is the grid dims of
    the N, D, H and W entries); an ``nn.BatchNorm3d`` for ``isinstance``."""

    _plain = nn.BatchNorm3d
    _plain_types = (nn.BatchNorm3d, nn.SyncBatchNorm)
    _ndims = (5,)


class DistBatchNorm1d(DistBatchNorm, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` on a distributed activation ``x[N, C]`` or ``x[N, C, L]`` (its length
    split or whole), with the statistics of the whole global batch (:class:`DistBatchNorm`); an
    ``nn.BatchNorm1d`` for ``isinstance``."""

    _plain = nn.BatchNorm1d
    _plain_types = (nn.BatchNorm1d, nn.SyncBatchNorm)
    _ndims = (2, 3)


class RunningBroadcast:
    """One asynchronous broadcast of several layers' running statistics from sample block 0;
    each layer takes its slice when it settles."""

    def __init__(self, comm: Any, flat: torch.Tensor) -> None:
        self._flat = flat
        self._work = comm.broadcast(flat, root=0, async_op=True,
                                    meta="DistBatchNorm running statistics of sample block 0")
        self._result: torch.Tensor | None = None

    def result(self) -> torch.Tensor:
        if self._result is None:
            got = self._work.wait()
            self._result = got if isinstance(got, torch.Tensor) else self._flat
        return self._result


def broadcast_running(entries: list[tuple[DistBatchNorm, torch.Tensor, float | None]]) -> None:
    """Send the local-statistics layers' batch statistics of sample block 0 to the other blocks:
    one broadcast per communicator (in the order the layers ran, the same on every rank)."""
    groups: dict[int, list[tuple[DistBatchNorm, torch.Tensor, float | None]]] = {}
    for entry in entries:
        groups.setdefault(id(entry[0]._block_comm), []).append(entry)
    for group in groups.values():
        shared = RunningBroadcast(group[0][0]._block_comm, torch.cat([e[1] for e in group]))
        offset = 0
        for layer, stats, factor in group:
            layer._pending = (shared, offset, factor)
            offset += stats.numel()
