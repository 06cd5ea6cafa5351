"""Dropout on distributed activations, with one process's masks.

Where a value is split over model-parallel grid dims (channels, filters, rows, columns), a mask
drawn per rank would differ from one process's. ``DistDropout`` draws the mask of the *global*
tensor from a generator every rank shares (:meth:`~distconv.comm.Communicator.shared_generator`)
and keeps this rank's block: the same masks on every rank, the same values as one process whose
generator is in that state. It costs the global mask's draw on every rank (for feature dropout,
``[N, C, 1, ...]`` only).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd

from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.nn.recompute import replayed

__all__ = ["DistDropPath", "DistDropout", "DistDropout1d", "DistDropout2d", "DistDropout3d"]


class _DistDropout(_DropoutNd):
    """What both distributed dropouts share; ``features`` says whether whole channels drop."""

    features = False

    def __init__(self, p: float = 0.5, *, grid: ProcessorGrid, input_dist: Dist) -> None:
        super().__init__(p)
        if not isinstance(grid, ProcessorGrid):
            raise TypeError(f"{type(self).__name__}: grid must be a ProcessorGrid, got {grid!r}")
        if not isinstance(input_dist, Dist):
            raise TypeError(f"{type(self).__name__}: input_dist must be a Dist, got "
                            f"{input_dist!r}")
        self.grid, self.input_dist = grid, input_dist
        grid.comm.shared_generator()  # agreed here (a collective), not in a training step

    def forward(self, x: torch.Tensor, global_shape: Sequence[int]) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.p == 1:  # as torch.dropout: no draw
            return x * torch.zeros((), dtype=x.dtype, device=x.device)
        shape = tuple(int(s) for s in global_shape)
        dist = self.input_dist
        if self.features:
            shape = shape[:2] + (1,) * (len(shape) - 2)
            dist = Dist(dist.entries[:2] + (None,) * (len(shape) - 2), dist.pending,
                        dist.tensor_dims)
        generator = replayed(self.grid.comm.shared_generator())
        noise = torch.empty(shape, dtype=x.dtype, device=generator.device)
        noise.bernoulli_(1 - self.p, generator=generator)
        noise = noise[dist.local_slices(shape, self.grid)].to(x.device)
        return x * noise.div_(1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, grid={dict(self.grid.layout)}, x={self.input_dist.format('x')}"


class DistDropout(_DistDropout, nn.Dropout):
    """``nn.Dropout`` on this rank's block of an activation distributed as ``input_dist``; an
    ``nn.Dropout`` for ``isinstance``.

    Args:
        p: the probability of an element to be zeroed, in [0, 1]. Default 0.5.
        grid: the processor grid ``input_dist`` lives on (its communicator gives the shared
            generator).
        input_dist: the Dist of ``x``, e.g. ``x[o,o_C,o,o]`` or ``x[o,*,o_H,*]``; the output has
            the same Dist.

    ``forward(x_local, global_shape)``: in training, ``x_local * mask_block / (1 - p)`` with the
    global mask drawn as ``torch.dropout`` draws it (Bernoulli(1 - p) over the global shape); in
    eval mode or with ``p = 0``, ``x_local``.
    """


class DistDropout2d(_DistDropout, nn.Dropout2d):
    """``nn.Dropout2d`` (whole channels of a sample) on this rank's block of an activation
    distributed as ``input_dist``; an ``nn.Dropout2d`` for ``isinstance``. Arguments and
    ``forward`` as :class:`DistDropout`, the global mask being ``[N, C, 1, 1]``."""

    features = True


class DistDropout1d(_DistDropout, nn.Dropout1d):
    """``nn.Dropout1d`` (whole channels of a signal) as :class:`DistDropout2d`, the global mask
    being ``[N, C, 1]``; an ``nn.Dropout1d`` for ``isinstance``."""

    features = True


class DistDropout3d(_DistDropout, nn.Dropout3d):
    """``nn.Dropout3d`` (whole channels of a volume) as :class:`DistDropout2d`, the global mask
    being ``[N, C, 1, 1, 1]``; an ``nn.Dropout3d`` for ``isinstance``."""

    features = True


class DistDropPath(nn.Module):
    """Stochastic depth (``DropPath``, ``torchvision.ops.stochastic_depth``) on this rank's block
    of an activation distributed as ``input_dist``, with one process's masks: the mask of the
    global batch, ``[N, 1, ..., 1]`` (``per_sample``) or ``[1, ..., 1]``, is drawn from the
    generator every rank shares and each rank keeps its samples' entries ``m[o_N]``.

    Args:
        p: the probability of a sample's path to be dropped, in [0, 1].
        grid: the processor grid ``input_dist`` lives on (its communicator gives the shared
            generator).
        input_dist: the Dist of ``x``, e.g. ``x[o,o_C,o,o]``; the output has the same Dist.
        per_sample: one draw per sample (timm, MONAI, torchvision ``mode="row"``; default) or
            one for the whole batch (torchvision ``mode="batch"``).
        scale: divide the kept paths by ``1 - p`` (timm's ``scale_by_keep``; default True).

    ``forward(x_local, global_shape)``: in training, ``x_local * (mask / (1 - p))[block]`` with
    the mask drawn as one process draws it (``x.new_empty(shape).bernoulli_(1 - p)``); in eval
    mode or with ``p = 0``, ``x_local``.
    """

    def __init__(self, p: float, *, grid: ProcessorGrid, input_dist: Dist,
                 per_sample: bool = True, scale: bool = True) -> None:
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise ValueError(f"DistDropPath: p must be a probability in [0, 1], got {p!r}")
        if not isinstance(grid, ProcessorGrid):
            raise TypeError(f"DistDropPath: grid must be a ProcessorGrid, got {grid!r}")
        if not isinstance(input_dist, Dist):
            raise TypeError(f"DistDropPath: input_dist must be a Dist, got {input_dist!r}")
        self.p, self.per_sample, self.scale = float(p), bool(per_sample), bool(scale)
        self.grid, self.input_dist = grid, input_dist
        grid.comm.shared_generator()  # agreed here (a collective), not in a training step

    def forward(self, x: torch.Tensor, global_shape: Sequence[int]) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        ndim = len(global_shape)
        shape = ((int(global_shape[0]),) if self.per_sample else (1,)) + (1,) * (ndim - 1)
        keep = 1 - self.p
        generator = replayed(self.grid.comm.shared_generator())
        mask = torch.empty(shape, dtype=x.dtype, device=generator.device).bernoulli_(
            keep, generator=generator)
        if keep > 0 and self.scale:
            mask.div_(keep)
        if self.per_sample:
            dist = Dist((self.input_dist.entries[0],) + (None,) * (ndim - 1))
            mask = mask[dist.local_slices(shape, self.grid)]
        return x * mask.to(x.device)

    def extra_repr(self) -> str:
        return (f"p={self.p}, per_sample={self.per_sample}, scale={self.scale}, "
                f"grid={dict(self.grid.layout)}, x={self.input_dist.format('x')}")
