"""Activation checkpointing per config entry (``checkpoint: true``): the checkpointed modules keep
only their inputs for backward and run their forward again there, collectives included. Training
equals one process (and the plain parallel run) exactly, running statistics advance once, the
communicators count what ``explain`` prices (the recomputed collectives in backward), and the
activations kept for backward shrink."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from distconv.data import sample_block
from distconv.parallel import parallelize
from distconv.parallel.explain import explain
from distconv.testing import run_threads
from tests.parallel.cases import (
    RESNET_CONFIG, RESNET_SHAPE, TOL, counted_step, max_errors, reference_step, resnet_case,
    train_step,
)

#: the hybrid of the fixed ResNet case with its stationary-x stage and two stationary-y
#: convolutions of the next one checkpointed
CHECKPOINTED = {"layers": [*RESNET_CONFIG["layers"], {"match": "layer2", "checkpoint": True},
                           {"match": "layer3.0.conv[12]", "checkpoint": True}]}


def test_checkpointed_training_equals_one_process() -> None:
    model, x, y = resnet_case()
    ref = reference_step(model, x, y)
    for got in run_threads(train_step, 4, model, CHECKPOINTED, x, y):
        err = max_errors(ref, got)  # state: parameters, running statistics, batches tracked
        assert max(err.values()) < TOL, err


def test_recomputed_collectives_are_counted_and_priced() -> None:
    model, x, y = resnet_case()
    plain = explain(model, RESNET_CONFIG, RESNET_SHAPE, world_size=4)
    plan = explain(model, CHECKPOINTED, RESNET_SHAPE, world_size=4)
    for r, got in enumerate(run_threads(counted_step, 4, model, CHECKPOINTED, x, y)):
        assert got["counted"] == tuple(plan.rank_bytes(r).values()), r
        # the forward moves what it moved; backward moves more (the recomputation)
        assert plan.rank_bytes(r)["forward"] == plain.rank_bytes(r)["forward"]
        assert plan.rank_bytes(r)["backward"] > plain.rank_bytes(r)["backward"]
    notes = {lay.name: lay.note for lay in plan.layers}
    assert "recomputed in backward" in notes["layer2.0.conv1"]
    assert "recomputed" not in notes.get("layer1.0.conv1", "")


def kept_bytes(comm: Any, model: torch.nn.Module, config: Any, x: torch.Tensor) -> int:
    """Bytes of the tensors the forward keeps for backward on this rank."""
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = pmodel(x[rows])
    out.sum().backward()
    return sum(seen.values())


def test_checkpointing_keeps_fewer_activations_and_explain_says_so() -> None:
    model, x, _ = resnet_case()
    plain = run_threads(kept_bytes, 4, model, RESNET_CONFIG, x)
    kept = run_threads(kept_bytes, 4, model, CHECKPOINTED, x)
    assert all(k < p for k, p in zip(kept, plain)), (kept, plain)
    before = explain(model, RESNET_CONFIG, RESNET_SHAPE, world_size=4).memory()["activations"]
    after = explain(model, CHECKPOINTED, RESNET_SHAPE, world_size=4).memory()["activations"]
    assert after < before


def _dropout_step(comm: Any, config: Any, x: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed + comm.rank)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.Dropout(0.5),
                                torch.nn.ReLU(), torch.nn.Conv2d(6, 4, 1)).double()
    torch.manual_seed(seed + comm.rank)
    pmodel = parallelize(model, config, comm=comm)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    pmodel(x[rows]).square().sum().backward()
    return torch.cat([p.grad.flatten() for p in pmodel.parameters()])


def test_a_recomputed_dropout_draws_the_mask_it_drew() -> None:
    # one rank: thread ranks share torch's global generator, whose draws they would race for
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    sample = {"default": {"grid": {"N": 1}, "algorithm": "sample"}}
    plain = run_threads(_dropout_step, 1, sample, x, 5)
    checkpointed = run_threads(_dropout_step, 1, {**sample, "layers": [
        {"match": "1", "checkpoint": True}, {"match": "2", "checkpoint": True}]}, x, 5)
    for a, b in zip(plain, checkpointed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("entry,words", [
    ({"match": "layer2", "checkpoint": "yes"}, "checkpoint must be true or false"),
    ({"match": "nothing.here", "checkpoint": True}, "matches no module"),
    ({"match": "layer2"}, "grid is required"),
])
def test_bad_checkpoint_entries_are_refused(entry: dict, words: str) -> None:
    model, _, _ = resnet_case()
    with pytest.raises(ValueError, match=words):
        explain(model, {"layers": [entry]}, RESNET_SHAPE, world_size=4)


def test_checkpointing_on_gloo(gloo4) -> None:  # noqa: ANN001
    model, x, y = resnet_case()
    ref = reference_step(model, x, y)
    for got in gloo4.run(train_step, model, CHECKPOINTED, x, y):
        err = max_errors(ref, got)
        assert max(err.values()) < TOL, err
