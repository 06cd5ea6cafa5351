"""What :class:`~distkfac.preconditioner.KFAC` keeps per preconditioned layer (``Layer``) and per
factor for stale statistics (``Stale``), and the device its control values travel on."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from distkfac.factors import RunningFactor
from distkfac.layers import LayerAdapter

__all__ = ["Layer", "Stale", "control_device"]


class Stale:
    """Stale-statistics state of one factor: its value at the last decomposition, the current
    interval (in scheduled decompositions) and how many are left before the next look."""

    __slots__ = ("ref", "interval", "wait")

    def __init__(self) -> None:
        self.ref: Tensor | None = None
        self.interval = 1
        self.wait = 1


class Layer:
    """Runtime state of one preconditioned module (or DistConv2d shard block)."""

    def __init__(self, adapter: LayerAdapter, comm, dtype: torch.dtype) -> None:
        self.adapter = adapter
        self.comm = comm
        g = adapter.groups
        self.a = RunningFactor(g, adapter.a_dim, dtype=dtype)
        self.g = RunningFactor(g, adapter.g_dim, dtype=dtype)
        self.a_payload: Tensor | None = None
        self.g_payload: Tensor | None = None
        self.inverses: tuple[float, Tensor, Tensor] | None = None  # (damping, A^-1, G^-1)
        self.uses = 0  # steps preconditioned with the current payloads
        self.stale = (Stale(), Stale())
        self.handles: list = []

    @property
    def name(self) -> str:
        return self.adapter.name

    @property
    def replication(self) -> int:
        """Ranks holding the same gradient (each counts it once in the KL clip's sum)."""
        return 1 if self.comm is None else self.comm.size


def control_device(comm: Any) -> torch.device:
    """Where control values travel: the communicator's device (NCCL's GPU), else the CPU."""
    return getattr(comm, "device", None) or torch.device("cpu")
