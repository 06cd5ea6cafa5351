"""parallelize starts every rank from rank 0's parameters and buffers (DDP's construction): a
model seeded differently on each rank trains as one process trains rank 0's model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from distconv.parallel import parallelize
from distconv.testing import run_threads
from tests.parallel.cases import RESNET_CONFIG, TOL, max_errors, reference_step, resnet_case, \
    train_step


def rank_model(seed: int) -> nn.Module:
    """resnet_case's model drawn from ``seed``, its normalisation buffers too (running
    statistics and step counts that differ from rank to rank)."""
    model = resnet_case(seed)[0]
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=gen,
                                                 dtype=m.running_mean.dtype))
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen,
                                               dtype=m.running_var.dtype) + 0.5)
                m.num_batches_tracked.fill_(seed + 3)
    return model


def seeded_per_rank_step(comm: Any) -> dict[str, Any]:
    """Each rank builds its own model from its own seed; the batch is the same everywhere."""
    _, x, y = resnet_case(0)
    model = rank_model(comm.rank)
    before = copy.deepcopy(model.state_dict())
    got = train_step(comm, model, RESNET_CONFIG, x, y)
    got["caller_model_kept"] = all(torch.equal(v, model.state_dict()[k])
                                   for k, v in before.items())
    return got


def _check_equal_to_rank0(results: list[dict[str, Any]]) -> None:
    _, x, y = resnet_case(0)
    ref = reference_step(rank_model(0), x, y)
    for r, got in enumerate(results):
        err = max_errors(ref, got)
        assert max(err.values()) < TOL, (r, err)
        assert got["caller_model_kept"], r  # the caller's model is left as it was
    # the reference differs from another rank's model: the test would fail without the sync
    other = reference_step(rank_model(1), x, y)
    assert max(max_errors(other, results[1]).values()) > 1e-3


def test_ranks_seeded_differently_train_as_one_process_on_rank0s_model() -> None:
    """Every layer kind of the paper's hybrid (spatial, stationary-x/-y/-w: sharded weights whose
    blocks all come from rank 0's tensors) and batch-norm buffers, on 4 thread ranks."""
    _check_equal_to_rank0(run_threads(seeded_per_rank_step, 4))


@pytest.mark.gloo
def test_ranks_seeded_differently_on_gloo(gloo4) -> None:
    _check_equal_to_rank0(gloo4.run(seeded_per_rank_step))


def _differing_structure(comm: Any) -> str:
    width = 4 if comm.rank == 0 else 5
    model = nn.Sequential(nn.Conv2d(3, width, 3), nn.ReLU())
    try:
        parallelize(model, {"default": {"grid": {"N": 2}, "algorithm": "sample"}}, comm=comm)
    except ValueError as exc:
        return str(exc)
    return ""


def test_ranks_that_build_different_models_are_refused_naming_them() -> None:
    for msg in run_threads(_differing_structure, 2):
        assert msg.startswith("build the same model on every rank"), msg
        assert "ranks [1]" in msg, msg


def _identically_seeded(comm: Any, model: nn.Module) -> bool:
    pmodel = parallelize(model, {"default": {"grid": {"N": 2}, "algorithm": "sample"}},
                         comm=comm)
    return all(torch.equal(p, q) for p, q in zip(pmodel.parameters(), model.parameters()))


def test_identical_models_keep_their_values_bit_for_bit() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2)).double()
    assert all(run_threads(_identically_seeded, 2, model))


def _own_values_passed(comm: Any) -> tuple[bool, bool]:
    """This rank's model holds ``rank + 1`` in every parameter and buffer; parallelize is given
    it directly (no copy in between)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).double()
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            t.fill_(comm.rank + 1)
    pmodel = parallelize(model, {"default": {"grid": {"N": 2}, "algorithm": "sample"}},
                         comm=comm)
    caller_kept = all(torch.equal(t, torch.full_like(t, comm.rank + 1))
                      for t in (*model.parameters(), *model.buffers()))
    from_rank0 = all(torch.equal(t, torch.full_like(t, 1))
                     for t in (*pmodel.parameters(), *pmodel.buffers()))
    return caller_kept, from_rank0


def test_the_callers_model_is_left_as_it_was_and_the_parallel_one_holds_rank0s() -> None:
    assert run_threads(_own_values_passed, 2) == [(True, True), (True, True)]
