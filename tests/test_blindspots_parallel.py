"""Blind spots of the parallel model: the training contract where the data grid holds replicas
over more than one grid dim, against one process on the global batch."""

from __future__ import annotations

import torch
from torch import nn

from distconv.parallel.config import ParallelConfig
from distconv.testing import run_threads
from tests.parallel.cases import TOL, max_errors, reference_step, train_step


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).mean((2, 3)))


def test_data_grid_with_two_replica_dims_counts_each_sample_once() -> None:
    # {N: 1, C: 2, F: 2}: every rank holds the whole batch; exactly one of the four copies of
    # the output's cotangent may enter the gradients, else they come out 2x or 4x too large
    torch.manual_seed(0)
    model = _Net().double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 6, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (5,), generator=gen)
    config = {"default": {"grid": {"N": 4}, "algorithm": "sample"},
              "data": {"N": 1, "C": 2, "F": 2}}
    ref = reference_step(model, x, y)
    for got in run_threads(train_step, 4, model, config, x, y):
        err = max_errors(ref, got)
        assert max(err.values()) < TOL, err


def test_the_first_entry_stating_statistics_wins() -> None:
    # "those of the first matching entry that states them" (ParallelConfig.statistics)
    cfg = ParallelConfig({"layers": [
        {"match": "block1.bn", "statistics": "local"},
        {"match": "*.bn", "statistics": "global"},
        {"match": "block2.*", "statistics": "local"},
    ]}, world_size=2)
    assert cfg.statistics("block1.bn") == "local"
    assert cfg.statistics("block2.bn") == "global"
    assert cfg.statistics("block3.bn") == "global"
    assert cfg.statistics("block2.other") == "local"
