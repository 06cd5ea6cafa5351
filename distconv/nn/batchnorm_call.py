"""One ``F.batch_norm`` call of a module's forward on a distributed activation: the call as one
process makes it, on the statistics of the whole global batch, with the module's own parameters
and running statistics given as operands (timm's ``BatchNormAct2d``, whose forward is
``nn.BatchNorm2d``'s followed by an activation and a drop layer)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.nn._activation import entry_comm, split_dims
from distconv.nn.batchnorm_statistics import _BatchNorm
from distconv.nn.recompute import is_recomputing

__all__ = ["DistBatchNormCall"]


class DistBatchNormCall(nn.Module):
    r"""``F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)`` on
    this rank's block of ``x`` distributed as ``input_dist`` (any dim split, e.g. ``x[o,o_C,o,o]``,
    ``x[o,*,o_H,o]``); the output has the same Dist. No parameters of its own: the call's
    ``weight`` and ``bias`` arrive as this rank's channel blocks (``w[o_C]``, sliced from the
    module's replicated parameters, whose all-rank gradient sum completes their local sums), the
    running statistics whole, as the module holds them on every rank.

    Per channel, on a batch of M = N·D·H·W values, where batch statistics are used::

        forward   1. n_r, mean_r, M2_r of the local block                        local
                  2. {n, mean, M2}_r <- the ranks of the N and spatial entries  allgather
                  3. y = (x - mean) / sqrt(M2 / M + eps) · w + b                 local
                  4. running statistics (training, tracked): [mean, M2/(M-1)] of every channel
                     block <- the ranks of the channel entry                     allgather
                     running = (1 - f)·running + f·[mean, var]  on every rank    local
        backward  Σdy, Σdy·x̂ over the N and spatial entries                     allreduce

    (:class:`~distconv.nn.DistBatchNorm`'s statistics and backward.) With running statistics and
    not training, the call is local: each rank normalises its channels by their slice of them.

    ``owner``: the ``nn.BatchNorm`` module whose forward makes the call (None: a call of no
    module's). With an owner, the call follows the module as ``nn.BatchNorm``'s forward does:
    batch statistics in training or without running statistics, the running statistics updated
    in training when tracked, ``num_batches_tracked`` counted and ``momentum=None`` a cumulative
    average; without, it is the call as captured (``training``), which then updates no running
    statistics (:class:`~distconv.ops.norm.FunctionalBatchNormHandler` refuses one that would).

    Args:
        grid: the :class:`~distconv.grid.ProcessorGrid` over all ranks.
        input_dist: the Dist of ``x`` (no pending dims).
        eps, training: the call's (default: ``training=True``).
        owner: see above (default: None).
    """

    def __init__(self, *, grid: ProcessorGrid, input_dist: Dist, eps: float,
                 training: bool = True, owner: nn.Module | None = None) -> None:
        super().__init__()
        self.grid, self.input_dist, self.eps = grid, input_dist, float(eps)
        self.call_training = bool(training)
        object.__setattr__(self, "_owner", owner)  # (not a child: the model holds it)
        nd = input_dist.ndim
        # sub-communicators are created collectively, in the same order on every rank
        segment = [g for d in (0, *range(2, nd)) for g in split_dims(grid, input_dist, d)]
        self._stats_comm = grid.subcomm(segment) if segment else None
        self._channel_dims = split_dims(grid, input_dist, 1)
        self._channel_comm = entry_comm(grid, self._channel_dims)
        self._channel = Dist((input_dist.entries[1],))
        self._slices: dict[int, slice] = {}

    def _slice(self, channels: int) -> slice:
        s = self._slices.get(channels)
        if s is None:
            s = self._slices[channels] = self._channel.local_slices((channels,), self.grid)[0]
        return s

    def forward(self, x: torch.Tensor, global_shape: Sequence[int], running_mean: Any = None,
                running_var: Any = None, weight: Any = None, bias: Any = None) -> torch.Tensor:
        shape = tuple(int(s) for s in global_shape)
        owner = self._owner
        training = owner.training if owner is not None else self.call_training
        batch = training or running_mean is None
        if not batch:
            sl = self._slice(shape[1])
            return F.batch_norm(x, running_mean[sl], running_var[sl], weight, bias, False, 0.0,
                                self.eps)
        count = shape[0] * math.prod(shape[2:])
        if count <= 1:
            raise ValueError(f"{type(owner).__name__ if owner is not None else 'batch_norm'}: "
                             "expected more than 1 value per channel when training, got global "
                             f"input shape {shape}")
        factor = self._count(owner) if owner is not None and training else None
        y, mean, var = _BatchNorm.apply(x, weight, bias, self._stats_comm, self.eps, count)
        if factor is not None and running_mean is not None:
            self._update(running_mean, running_var, mean, var * (count / (count - 1)), factor,
                         shape[1])
        return y

    def _count(self, owner: nn.Module) -> float | None:
        """The module's batch count and averaging factor, as ``nn.BatchNorm``'s forward takes
        them (None: nothing to update; a checkpoint's recomputation updated them already)."""
        if not owner.track_running_stats or is_recomputing():
            return None
        momentum = owner.momentum
        if owner.num_batches_tracked is not None:
            owner.num_batches_tracked.add_(1)
            if momentum is None:
                return 1.0 / float(owner.num_batches_tracked)
        return 0.0 if momentum is None else float(momentum)

    @torch.no_grad()
    def _update(self, running_mean: torch.Tensor, running_var: torch.Tensor,
                mean: torch.Tensor, var: torch.Tensor, factor: float, channels: int) -> None:
        stats = torch.cat([mean, var]).to(running_mean.dtype)
        if self._channel_comm is not None:  # every channel block's, in block order
            sizes = [self._channel.local_shape((channels,), self.grid, c)[0]
                     for c in self._block_coords()]
            parts = self._channel_comm.allgather(
                stats, shapes=[(2 * n,) for n in sizes],
                meta="batch_norm running statistics of the channel blocks")
            stats = torch.cat([p[:n] for p, n in zip(parts, sizes)]
                              + [p[n:] for p, n in zip(parts, sizes)])
        running_mean.mul_(1 - factor).add_(stats[:channels] * factor)
        running_var.mul_(1 - factor).add_(stats[channels:] * factor)

    def _block_coords(self) -> list[dict[str, int]]:
        """The coords of the channel blocks, in block order (the channel communicator's)."""
        dims, coords = self._channel_dims, dict(self.grid.coords)
        out = []
        for index in range(math.prod(self.grid.extent(d) for d in dims)):
            c = dict(coords)
            for d in reversed(dims):
                index, c[d] = divmod(index, self.grid.extent(d))
            out.append(c)
        return out

    def extra_repr(self) -> str:
        owner = type(self._owner).__name__ if self._owner is not None else None
        return (f"eps={self.eps}, owner={owner}, grid={dict(self.grid.layout)}, "
                f"x={self.input_dist.format('x')}")
