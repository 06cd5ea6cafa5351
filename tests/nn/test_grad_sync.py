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


def _bucketed_steps(comm):  # noqa: ANN001, ANN202
    from distconv.nn.grad_sync import BucketedGradSync

    # the same weights on every rank from a generator of its own: thread ranks share torch's
    # global generator, so seeding it on each would interleave their draws
    gen = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    BucketedGradSync(comm, list(net.parameters()), bucket_bytes=64, where="test")
    xs = [torch.full((2, 4), float(i + comm.rank), dtype=torch.float64) for i in range(4)]

    def grads_of(x):  # noqa: ANN001, ANN202  the sum over ranks, computed independently
        ref = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).double()
        ref.load_state_dict(net.state_dict())
        for r in range(comm.size):
            ref(x - comm.rank + r).sum().backward()
        return [p.grad.clone() for p in ref.parameters()]

    kept = []
    net(xs[0]).sum().backward()
    kept.append(([p.grad for p in net.parameters()], grads_of(xs[0])))  # held, not cloned
    net.zero_grad()  # set_to_none: the buffer is free again unless someone holds a view
    net(xs[1]).sum().backward()
    kept.append(([p.grad for p in net.parameters()], grads_of(xs[1])))
    net.zero_grad(set_to_none=False)
    net(xs[2]).sum().backward()
    net(xs[3]).sum().backward()  # accumulates into the zeroed views
    want = [a + b for a, b in zip(grads_of(xs[2]), grads_of(xs[3]))]
    final = [p.grad for p in net.parameters()]
    return kept, final, want


def test_bucketed_gradients_the_user_keeps_never_change_and_accumulation_adds() -> None:
    """A bucket's reduced buffer is each .grad's storage; the next pass must not write into one
    a user still holds (plain PyTorch gives every pass fresh tensors), and gradients
    accumulated over zeroed views add up. One process reduces in place, so it is the case."""
    from distconv.comm import SingleCommunicator

    for kept, got, want in [_bucketed_steps(SingleCommunicator()), *run_threads(_bucketed_steps, 2)]:
        (first, first_ref), (second, _) = kept
        for g, r in zip(first, first_ref):  # held over zero_grad(): as it was
            assert torch.equal(g, r)
        for g, held, r in zip(got, second, want):
            assert torch.allclose(g, r, rtol=0, atol=1e-12)
            assert g is held  # zero_grad(set_to_none=False) zeroes and refills the same tensor
