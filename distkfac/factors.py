"""Kronecker factors: running averages in a fixed dtype and upper-triangle packing.

A factor is a batch of symmetric blocks ``(groups, d, d)``.  Only the upper triangle of each
block travels between ranks (``d(d+1)/2`` of ``d^2`` numbers): ``pack`` / ``unpack`` convert.
"""
from __future__ import annotations

import torch
from torch import Tensor

from distconv.memo import BoundedMemo

__all__ = ["pack", "unpack", "packed_numel", "RunningFactor"]

_TRIU_CACHE: BoundedMemo[tuple[Tensor, Tensor]] = BoundedMemo(256)  # thread ranks share it


def _triu(d: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Flat indices into a ``d x d`` block of its upper triangle, row by row, and of the
    mirrored entries: one-dimensional gathers and scatters, several times faster than
    two-dimensional advanced indexing."""
    def make() -> tuple[Tensor, Tensor]:
        r, c = torch.triu_indices(d, d, device=device)
        return r * d + c, c * d + r

    return _TRIU_CACHE.get((d, str(device)), make)


def packed_numel(groups: int, d: int, *, symmetric: bool = True) -> int:
    """Numbers in one packed factor: ``groups * d(d+1)/2``, or ``groups * d^2`` unpacked."""
    return groups * (d * (d + 1) // 2 if symmetric else d * d)


def pack(blocks: Tensor, *, symmetric: bool = True) -> Tensor:
    """Flatten ``(groups, d, d)`` to 1-D, keeping only upper triangles when ``symmetric``."""
    if not symmetric:
        return blocks.reshape(-1)
    upper, _ = _triu(blocks.shape[-1], blocks.device)
    return blocks.reshape(blocks.shape[0], -1).index_select(1, upper).reshape(-1)


def unpack(flat: Tensor, groups: int, d: int, *, symmetric: bool = True) -> Tensor:
    """Inverse of :func:`pack`: the full symmetric ``(groups, d, d)``."""
    if not symmetric:
        return flat.reshape(groups, d, d)
    upper, lower = _triu(d, flat.device)
    out = flat.new_empty(groups, d * d)
    vals = flat.reshape(groups, -1)
    out.index_copy_(1, lower, vals)
    out.index_copy_(1, upper, vals)  # together every entry, the diagonal twice
    return out.reshape(groups, d, d)


class RunningFactor:
    """Exponential moving average of a factor, stored in ``dtype`` whatever its inputs' dtype.

    The first update sets the factor to the new estimate; later ones compute
    ``F <- decay * F + (1 - decay) * new``.
    """

    def __init__(self, groups: int, d: int, *, dtype: torch.dtype) -> None:
        self.groups, self.d, self.dtype = groups, d, dtype
        self.value: Tensor | None = None
        self.updates = 0

    def update(self, new: Tensor, decay: float) -> None:
        new = new.to(self.dtype)
        if self.value is None:
            self.value = new.clone()
        else:
            self.value.mul_(decay).add_(new, alpha=1.0 - decay)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"value": self.value, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        v = state["value"]
        if v is not None and tuple(v.shape) != (self.groups, self.d, self.d):
            raise ValueError(f"factor of shape {tuple(v.shape)} does not fit "
                             f"{(self.groups, self.d, self.d)}")
        self.value = None if v is None else v.to(self.dtype).clone()
        self.updates = int(state["updates"])

    def __repr__(self) -> str:
        return f"RunningFactor(groups={self.groups}, d={self.d}, updates={self.updates})"
