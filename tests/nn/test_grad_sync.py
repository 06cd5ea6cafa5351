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


def _hooks_in_other_orders(comm):  # noqa: ANN001, ANN202
    a = nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    b = nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    sync = GradSync(comm, where="test")
    sync.register(a)
    sync.register(b)
    fired: list[str] = []
    a.register_hook(lambda g: fired.append("a"))
    b.register_hook(lambda g: fired.append("b"))
    # autograd runs the later-made node first: rank 0 reaches a first, rank 1 b first
    terms = [a * 2.0, b * 3.0] if comm.rank else [b * 3.0, a * 2.0]
    (terms[0] + terms[1] * (comm.rank + 1)).sum().backward()
    return fired, a.grad.item(), b.grad.item()


def test_allreduces_pair_by_parameter_whatever_order_the_hooks_fire_in() -> None:
    """Ranks pair collectives by order: a rank whose backward reaches the parameters in another
    order (another kernel's backward, another graph) must still add a's gradient to a's."""
    (f0, a0, b0), (f1, a1, b1) = run_threads(_hooks_in_other_orders, 2)
    assert f0 != f1  # the hooks did fire in different orders
    # rank 0: loss = 3b + 2a, so d/da = 2, d/db = 3;  rank 1: loss = 2a + 2·3b: 2 and 6
    assert (a0, b0) == (a1, b1) == (2.0 + 2.0, 3.0 + 6.0)
