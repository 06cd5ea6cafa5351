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

from distconv.distribution import Dist
from distconv.grid import ProcessorGrid

__all__ = ["DistDropout"]


class DistDropout(nn.Dropout):
    """``nn.Dropout`` (``features=False``) or ``nn.Dropout2d`` (``features=True``: whole channels
    of a sample) on this rank's block of an activation distributed as ``input_dist``.

    Args:
        p: the probability of an element (or a channel) to be zeroed, in [0, 1]. Default 0.5.
        features: drop whole channels (``Dropout2d``) instead of elements. Default False.
        grid: the processor grid ``input_dist`` lives on (its communicator gives the shared
            generator).
        input_dist: the Dist of ``x``, e.g. ``x[o,o_C,o,o]`` or ``x[o,*,o_H,*]``; the output has
            the same Dist.

    ``forward(x_local, global_shape)``: in training, ``x_local * mask_block / (1 - p)`` with the
    global mask drawn as ``torch.dropout`` draws it (Bernoulli(1 - p) over the global shape, or
    ``[N, C, 1, ...]`` for features); in eval mode or with ``p = 0``, ``x_local``.
    """

    def __init__(self, p: float = 0.5, *, features: bool = False, grid: ProcessorGrid,
                 input_dist: Dist) -> None:
        super().__init__(p)
        if not isinstance(grid, ProcessorGrid):
            raise TypeError(f"DistDropout: grid must be a ProcessorGrid, got {grid!r}")
        if not isinstance(input_dist, Dist):
            raise TypeError(f"DistDropout: input_dist must be a Dist, got {input_dist!r}")
        self.features, self.grid, self.input_dist = bool(features), grid, input_dist
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
        generator = self.grid.comm.shared_generator()
        noise = torch.empty(shape, dtype=x.dtype, device=generator.device)
        noise.bernoulli_(1 - self.p, generator=generator)
        noise = noise[dist.local_slices(shape, self.grid)].to(x.device)
        return x * noise.div_(1 - self.p)

    def extra_repr(self) -> str:
        return (f"p={self.p}, features={self.features}, grid={dict(self.grid.layout)}, "
                f"x={self.input_dist.format('x')}")
