"""Who decomposes which factor: placement policies, kept apart from how results move.

A policy maps a list of :class:`FactorTask` to an owner per task: a rank that decomposes it and
broadcasts the result, or :data:`EVERYWHERE` for a factor every rank decomposes itself (no
communication).  Policies must be deterministic functions of shared information (task list,
group size, a cost model agreed by all ranks), because the assignment decides collectives.

* :class:`RoundRobin` (Pauloski et al. SC'20): task ``i`` to rank ``i mod P``.
* :class:`LoadBalanced` (SPD-KFAC, Shi et al., Algorithm 1): tasks sorted by predicted
  decomposition time, largest first, each onto the currently least-loaded rank; a task whose
  decomposition is predicted cheaper than broadcasting its result is decomposed everywhere.
"""
from __future__ import annotations

import abc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["EVERYWHERE", "FactorTask", "CostModel", "Placement", "RoundRobin", "LoadBalanced",
           "placement_for", "PLACEMENTS"]

EVERYWHERE = -1
PLACEMENTS = ("round-robin", "lbp")


@dataclass(frozen=True)
class FactorTask:
    """One factor to decompose: ``groups`` blocks of side ``d``; ``payload`` numbers to send."""

    key: str
    groups: int
    d: int
    payload: int


@dataclass(frozen=True)
class CostModel:
    """Predicted seconds: decomposition ``groups * (c0 + c2 d^2 + c3 d^3)``; broadcast of n
    bytes ``alpha + beta n`` (zero on one rank)."""

    c0: float = 1e-5
    c2: float = 0.0
    c3: float = 1e-9
    alpha: float = 5e-5
    beta: float = 1e-9

    def decompose_s(self, task: FactorTask) -> float:
        d = task.d
        return task.groups * (self.c0 + self.c2 * d * d + self.c3 * d ** 3)

    def broadcast_s(self, nbytes: int) -> float:
        return self.alpha + self.beta * nbytes

    def as_tensor(self, device: Any = None) -> torch.Tensor:
        return torch.tensor([self.c0, self.c2, self.c3, self.alpha, self.beta],
                            dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> CostModel:
        return cls(*(float(v) for v in t.tolist()))

    @classmethod
    def fit(cls, comm, decompose: Callable[[torch.Tensor], object], *,
            dtype: torch.dtype = torch.float32, sizes: Sequence[int] = (16, 64, 160, 320),
            message_bytes: Sequence[int] = (1 << 10, 1 << 16, 1 << 20), repeats: int = 3,
            ) -> CostModel:
        """Measure ``decompose`` and broadcasts on this machine; fit by least squares.

        Collective over ``comm`` when it has more than one rank: every rank measures, rank 0's
        fit is broadcast so all ranks hold the same model (and so make the same placement).
        """
        times = []
        for d in sizes:
            m = torch.randn(1, d, d, dtype=dtype)
            m = m @ m.transpose(1, 2) + d * torch.eye(d, dtype=dtype)
            decompose(m)
            t0 = time.perf_counter()
            for _ in range(repeats):
                decompose(m)
            times.append((time.perf_counter() - t0) / repeats)
        d = np.asarray(sizes, dtype=np.float64)
        design = np.stack([np.ones_like(d), d ** 2, d ** 3], 1)
        c0, c2, c3 = np.clip(np.linalg.lstsq(design, np.asarray(times), rcond=None)[0], 0, None)
        alpha = beta = 0.0
        if comm is not None and comm.size > 1:
            btimes = []
            for nbytes in message_bytes:
                buf = torch.zeros(nbytes // 4, dtype=torch.float32,
                                  device=getattr(comm, "device", None))
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(repeats):
                    comm.broadcast(buf, root=0)
                btimes.append((time.perf_counter() - t0) / repeats)
            nb = np.asarray(message_bytes, dtype=np.float64)
            design = np.stack([np.ones_like(nb), nb], 1)
            alpha, beta = np.clip(np.linalg.lstsq(design, np.asarray(btimes), rcond=None)[0],
                                  0, None)
        model = cls(float(c0), float(c2), float(c3), float(alpha), float(beta))
        if comm is not None and comm.size > 1:
            model = cls.from_tensor(comm.broadcast(
                model.as_tensor(getattr(comm, "device", None)), root=0))
        return model


class Placement(abc.ABC):
    """Assign each task an owner rank in ``range(size)`` or :data:`EVERYWHERE`."""

    name: str

    @abc.abstractmethod
    def assign(self, tasks: Sequence[FactorTask], size: int) -> list[int]: ...

    def state_dict(self) -> dict[str, Any]:
        """What the policy has learned, for checkpoints (a resumed run then places as the
        uninterrupted one does, without measuring again): nothing by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class RoundRobin(Placement):
    name = "round-robin"

    def assign(self, tasks: Sequence[FactorTask], size: int) -> list[int]:
        return [i % size for i in range(len(tasks))]


class LoadBalanced(Placement):
    """SPD-KFAC's LBP: largest first onto the least-loaded rank; cheap factors everywhere."""

    name = "lbp"

    def __init__(self, cost_model: CostModel | None = None, *, itemsize: int = 4) -> None:
        self.cost_model = cost_model
        self.itemsize = itemsize

    def assign(self, tasks: Sequence[FactorTask], size: int) -> list[int]:
        model = self.cost_model or CostModel()
        owners = [EVERYWHERE] * len(tasks)
        if size == 1:
            return owners
        load = [0.0] * size
        order = sorted(range(len(tasks)), key=lambda i: (-model.decompose_s(tasks[i]), i))
        for i in order:
            cost = model.decompose_s(tasks[i])
            if cost <= model.broadcast_s(tasks[i].payload * self.itemsize):
                load = [x + cost for x in load]
                continue
            r = min(range(size), key=lambda k: (load[k], k))
            owners[i] = r
            load[r] += cost
        return owners

    def state_dict(self) -> dict[str, Any]:
        """The cost model's coefficients (None before it is fitted)."""
        m = self.cost_model
        return {"cost_model": None if m is None else [m.c0, m.c2, m.c3, m.alpha, m.beta]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the saved cost model, if one was fitted (else keep this one)."""
        saved = state.get("cost_model")
        if saved is not None:
            self.cost_model = CostModel(*(float(v) for v in saved))

    def __repr__(self) -> str:
        return f"LoadBalanced(cost_model={self.cost_model})"


def placement_for(name: str | Placement) -> Placement:
    if isinstance(name, Placement):
        return name
    if name == "round-robin":
        return RoundRobin()
    if name == "lbp":
        return LoadBalanced()
    raise ValueError(f"placement must be one of {PLACEMENTS} or a Placement, got {name!r}")
