"""A ResNet-style chain through spatial -> stationary-x -> stationary-y -> spatial on ``P``
ranks in sample rows of ``q`` (grids ``{N: P/q, H: q}``, ``{N: P/q, C: q}``, ``{N: P/q, F: q}``),
the samples arriving sample-parallel on every rank, and a journal of every collective one training step
calls with the size of the group it runs on. Shared by the test on 16 thread ranks and the
benchmark on 64 (``benchmarks/segments.py``)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distconv import parallelize
from distconv.data import sample_block

WIDTH = 8  # channels: every channel/filter block of q <= 8 ranks holds at least one


class Chain(nn.Module):
    """stem (spatial) -> bn -> relu -> mid (stationary-x) -> bn -> relu -> late
    (stationary-y) -> bn -> relu -> last (spatial) + the stem's output -> pool -> head."""

    def __init__(self, width: int = WIDTH, classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(width)
        self.mid = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.late = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.last = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(self.bn0(self.stem(x)))
        b = F.relu(self.bn1(self.mid(a)))
        c = F.relu(self.bn2(self.late(b)))
        d = F.relu(self.last(c) + a)
        return self.head(d.mean((2, 3)))


def chain_config(world: int, row: int = 4) -> dict[str, Any]:
    """The chain's layers on sample rows of ``row`` ranks (``world // row`` of them)."""
    q, n = row, world // row
    return {"default": {"grid": {"N": world}, "algorithm": "sample"},
            "layers": [
                {"match": "stem", "grid": {"N": n, "H": q}, "algorithm": "spatial"},
                {"match": "mid", "grid": {"N": n, "C": q}, "algorithm": "stationary-x"},
                {"match": "late", "grid": {"N": n, "F": q}, "algorithm": "stationary-y"},
                {"match": "last", "grid": {"N": n, "H": q}, "algorithm": "spatial"}]}


def chain_case(world: int, seed: int = 0, *, row: int = 4, width: int = WIDTH,
               batch: int | None = None, pixels: tuple[int, int] | None = None,
               dtype: torch.dtype = torch.float64) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model (``width`` channels), a global batch (default ``world`` samples of 3 x 2 row x
    4) and labels."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = Chain(width).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    batch = world if batch is None else batch
    h, w = (2 * row, 4) if pixels is None else pixels
    x = torch.randn(batch, 3, h, w, generator=gen, dtype=dtype)
    y = torch.randint(0, 4, (batch,), generator=gen)
    return model, x, y


def journaled_step(comm: Any, steps: int = 2) -> dict[str, Any]:
    """Runs on every rank: ``steps`` training steps of the chain (SGD); the collectives of the
    last one, ``(op, group size, what)`` in order, and its output and input gradient norms."""
    model, x, y = chain_case(comm.size)
    pmodel = parallelize(copy.deepcopy(model), chain_config(comm.size), comm=comm)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    calls: list[tuple[str, int, str]] = []
    for i in range(steps):
        with comm.stats.journal() as calls:
            out = pmodel(x[rows])
            loss = F.cross_entropy(out, y[rows])
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"calls": calls, "out": out.detach(), "rows": rows}


def reference_outputs(steps: int, world: int) -> torch.Tensor:
    """One process's output at the last of ``steps`` SGD steps on the whole batch."""
    model, x, y = chain_case(world)
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        out = model(x)
        F.cross_entropy(out, y).backward()
        opt.step()
        opt.zero_grad()
    return out.detach()
