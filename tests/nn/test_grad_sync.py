"""Gradient completion: a segmented allreduce started from a hook, finished before backward returns."""

from __future__ import annotations

import torch
from torch import nn

from distconv.nn import GradSync, finish_grad_sync
from distconv.testing import run_threads


def _replicated(comm):  # noqa: ANN001, ANN202
    p = nn.Parameter(torch.ones(3, dtype=torch.float64))
    sync = GradSync(comm, where="test")
    sync.register(p)
    (p * (comm.rank + 1)).sum().backward()
    after_first = p.grad.clone()
    (p * (comm.rank + 1)).sum().backward()  # accumulates like PyTorch
    module = nn.Module()
    module.grad_sync = sync  # type: ignore[assignment]
    finish_grad_sync(module)  # nothing pending: idempotent
    return after_first, p.grad.clone(), comm.stats.snapshot()["calls"].get("allreduce", 0)


def test_gradient_is_the_sum_over_replicas_when_backward_returns() -> None:
    for first, second, calls in run_threads(_replicated, 3):
        assert torch.equal(first, torch.full((3,), 6.0, dtype=torch.float64))
        assert torch.equal(second, torch.full((3,), 12.0, dtype=torch.float64))
        assert calls == 2


def _explicit(comm):  # noqa: ANN001, ANN202
    p = nn.Parameter(torch.ones(2))
    sync = GradSync(comm)
    sync.register(p)
    torch.autograd.backward([(p * (comm.rank + 1)).sum()])
    sync.finish()
    return p.grad


def test_explicit_finish_after_autograd_backward() -> None:
    for g in run_threads(_explicit, 2):
        assert torch.equal(g, torch.full((2,), 3.0))
