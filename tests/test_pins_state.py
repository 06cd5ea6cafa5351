"""Behaviours of saved state that hold today and that the other tests leave open: ranks whose
state differs only in one tensor's dtype, global shape or distribution are refused before
anything is written, and a GridSampler saved at the very end of a padded epoch resumes with the
next epoch. On thread ranks and once on a real gloo world."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distconv
from distconv.checkpoint import CheckpointError
from distconv.data import GridSampler
from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.nn.sharding import ShardSpec
from distconv.testing import run_threads


# ----------------------------------------------------------------------------- save refusals
class _One:
    """One tensor ``"t"`` with the spec its rank gives it (Shardable)."""

    def __init__(self, t: torch.Tensor, spec: ShardSpec) -> None:
        self.t, self.spec = t, spec

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"t": self.t}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.t = state["t"]

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {"t": self.spec}


def _state(differ: str, rank: int, grid: ProcessorGrid) -> _One:
    """The same key on every rank; rank 1's tensor differs in ``differ`` alone."""
    odd = rank == 1
    if differ == "dtype":  # x[o_N] of 4 values: float64, float32 on rank 1
        dtype = torch.float32 if odd else torch.float64
        return _One(torch.zeros(2, dtype=dtype), ShardSpec(grid, Dist(("N",)), (4,)))
    if differ == "shape":  # replicated: 3 values, 4 on rank 1
        n = 4 if odd else 3
        return _One(torch.zeros(n), ShardSpec(None, Dist((None,)), (n,)))
    # a (2, 2) value split by rows, by columns on rank 1
    dist = Dist((None, "N")) if odd else Dist(("N", None))
    return _One(torch.zeros((2, 1) if odd else (1, 2)), ShardSpec(grid, dist, (2, 2)))


def save_differing(comm: Any, differ: str, path: str) -> str:
    grid = ProcessorGrid({"N": 2}, comm=comm)
    try:
        distconv.save(nn.Module(), path, states={"s": _state(differ, comm.rank, grid)}, comm=comm)
    except CheckpointError as exc:
        return str(exc)
    return "saved"


def check_refused(messages: list[str], path: Path) -> None:
    for msg in messages:  # every rank raises, saying why
        assert "the ranks disagree on the state to save" in msg, msg
    written = [p for p in path.rglob("*") if p.is_file()] if path.exists() else []
    assert written == [], written


@pytest.mark.parametrize("differ", ["dtype", "shape", "dist"])
def test_ranks_that_differ_only_in_a_dtype_shape_or_dist_refuse_before_writing(
        tmp_path: Path, differ: str) -> None:
    path = tmp_path / "ckpt"
    check_refused(run_threads(save_differing, 2, differ, str(path), timeout=20.0), path)


def test_the_same_states_on_every_rank_are_saved(tmp_path: Path) -> None:
    """The refusals above are of the difference alone: rank 0's state on both ranks saves."""

    def save(comm: Any) -> str:
        grid = ProcessorGrid({"N": 2}, comm=comm)
        distconv.save(nn.Module(), tmp_path / "ok", states={"s": _state("dist", 0, grid)},
                      comm=comm)
        return "saved"

    assert run_threads(save, 2) == ["saved", "saved"]


# ----------------------------------------------------------------------------- async failures
def async_failure_seen_by_the_next_save(comm: Any, path: str, after: str) -> dict[str, Any]:
    """An asynchronous save that fails on rank 1 (its shard's name is taken by a directory),
    not waited for: the next save raises it; waiting on its handle afterwards raises nothing
    (a failure is raised once)."""
    from distconv.parallel import parallelize
    from tests.test_checkpoint_fast import SAMPLE2, cnn

    model = parallelize(cnn(), SAMPLE2, comm=comm)
    handle = distconv.save(model, path, comm=comm, async_save=True)
    try:
        distconv.save(model, after, comm=comm)
        next_save = "saved"
    except CheckpointError as exc:
        next_save = str(exc)
    try:
        handle.wait()
        waited = "returned"
    except Exception as exc:  # noqa: BLE001 -- what it raises is the finding
        waited = f"{type(exc).__name__}: {exc}"
    return {"next": next_save, "wait": waited, "repr": repr(handle)}


def test_a_failure_the_next_save_raised_is_not_raised_again_by_wait(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    (path / "shard-00001-of-00002.safetensors" / "keep").mkdir(parents=True)
    got = run_threads(async_failure_seen_by_the_next_save, 2, str(path),
                      str(tmp_path / "next"), timeout=20.0)
    for r in got:
        assert "previous asynchronous save" in r["next"], r
        assert r["wait"] == "returned", r
        assert "failed" in r["repr"], r


# ----------------------------------------------------------------------------- GridSampler
SAMPLES, BLOCKS, PER_BLOCK = 50, 4, 2  # 50 samples over 4 blocks: 52 positions, 2 of padding
DATA = TensorDataset(torch.arange(SAMPLES))
SEED = 5


def _epoch_batches(epoch: int) -> list[list[int]]:
    """The global batches of ``epoch`` by hand: the permutation of ``SEED + epoch``, padded with
    its first samples to a multiple of the blocks, position j to block j mod 4, 2 per block."""
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
    padded = order + order[: math.ceil(SAMPLES / BLOCKS) * BLOCKS - SAMPLES]
    per_block = [padded[b::BLOCKS] for b in range(BLOCKS)]
    steps = math.ceil(len(per_block[0]) / PER_BLOCK)
    return [sorted(i for blk in per_block for i in blk[s * PER_BLOCK:(s + 1) * PER_BLOCK])
            for s in range(steps)]


def sampler_run(comm: Any, path: str, *, save: bool) -> list[tuple[int, list[int]]]:
    """Epoch 0 then save (``save``), or load then deal the rest through epoch 1: the global
    batches (sorted sample ids) in the loop a user writes."""
    sampler = GridSampler(DATA, ProcessorGrid({"N": BLOCKS}, comm=comm), seed=SEED)
    loader = DataLoader(DATA, batch_size=PER_BLOCK, sampler=sampler)
    if not save:
        distconv.load(nn.Module(), path, states={"sampler": sampler})
    seen = []
    for epoch in range(sampler.epoch, 1 if save else 2):
        sampler.set_epoch(epoch)
        for (x,) in loader:
            seen.append((epoch, sorted(torch.cat(comm.allgather(x, shapes=None)).tolist())))
    if save:
        distconv.save(nn.Module(), path, states={"sampler": sampler}, comm=comm)
    return seen


def test_sampler_saved_at_the_end_of_a_padded_epoch_resumes_with_the_next_epoch(
        tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    first = run_threads(sampler_run, BLOCKS, path, save=True)
    assert first[0] == [(0, b) for b in _epoch_batches(0)]  # the padded epoch, all of it
    for seen in run_threads(sampler_run, BLOCKS, path, save=False):
        # the rest of epoch 0 is empty; epoch 1 follows from its first sample
        assert seen == [(1, b) for b in _epoch_batches(1)]


# ----------------------------------------------------------------------------- a real world
@pytest.mark.gloo
def test_state_pins_on_gloo(gloo2, tmp_path: Path) -> None:  # noqa: ANN001
    for differ in ("dtype", "shape", "dist"):
        path = tmp_path / differ
        check_refused(gloo2.run(save_differing, differ, str(path)), path)


@pytest.mark.gloo
def test_sampler_pin_on_gloo(gloo4, tmp_path: Path) -> None:  # noqa: ANN001
    path = str(tmp_path / "ckpt")
    assert gloo4.run(sampler_run, path, save=True)[0] == [(0, b) for b in _epoch_batches(0)]
    for seen in gloo4.run(sampler_run, path, save=False):
        assert seen == [(1, b) for b in _epoch_batches(1)]
