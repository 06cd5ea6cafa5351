"""``Redistribute``: a module that moves an activation between two distributions."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.redistribute import redistribute

__all__ = ["Redistribute"]


class Redistribute(nn.Module):
    """Redistribute the local block of a tensor from ``src`` to ``dst`` on ``grid``.

    Differentiable with the exact adjoint (see :func:`distconv.redistribute.redistribute`).

    Args:
        grid: the processor grid both distributions refer to.
        src: distribution of the input block.
        dst: distribution of the output block.
        global_shape: the tensor's global shape when fixed. Default ``None``: pass it to
            :meth:`forward`.
    """

    def __init__(
        self,
        grid: ProcessorGrid,
        src: Dist,
        dst: Dist,
        *,
        global_shape: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(src, Dist) or not isinstance(dst, Dist):
            raise TypeError("src and dst must be distconv.distribution.Dist values")
        if src.ndim != dst.ndim:
            raise ValueError(f"src {src} and dst {dst} have different numbers of entries")
        self.grid, self.src, self.dst = grid, src, dst
        self.global_shape = None if global_shape is None else tuple(int(s) for s in global_shape)

    def forward(self, x: torch.Tensor, global_shape: Sequence[int] | None = None) -> torch.Tensor:
        shape = global_shape if global_shape is not None else self.global_shape
        if shape is None:
            raise ValueError(
                "Redistribute needs the global shape: pass global_shape to the constructor or to "
                "forward (local block sizes alone do not determine it)"
            )
        if self.src == self.dst:
            return x
        return redistribute(x, self.grid, self.src, self.dst, shape)

    def extra_repr(self) -> str:
        return (
            f"{self.src} -> {self.dst}, grid={dict(self.grid.layout)}, "
            f"global_shape={self.global_shape}"
        )
