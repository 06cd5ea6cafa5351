"""Per-rank values in a checkpoint (``save(..., rank_extra=)``): each rank's own value is stored
beside its shards and handed back to the rank of the same number; another world size is refused
before anything is loaded, and ``consolidate`` gives every saved rank's value to redistribute.

Expectations are built here, from each rank's number, never read back from the checkpoint code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.optional import need  # noqa: E402

need("safetensors")

import distconv
from distconv.checkpoint import INDEX_NAME, CheckpointError
from distconv.comm import SingleCommunicator
from distconv.parallel import parallelize
from distconv.testing import run_threads

SAMPLE = {"default": {"grid": {"N": 2}, "algorithm": "sample"}}


def model_on(comm: Any, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return parallelize(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 1)),
                       {"default": {"grid": {"N": comm.size}, "algorithm": "sample"}}, comm=comm)


def own_value(rank: int) -> dict[str, Any]:
    """A value that differs between the ranks in its numbers, tensors and structure: a torch
    generator's state (a uint8 tensor), a data position, and a list as long as the rank."""
    gen = torch.Generator().manual_seed(100 + rank)
    torch.rand(rank + 1, generator=gen)
    return {"rng": gen.get_state(), "position": {"epoch": 2, "next": 10 * rank},
            "seen": [f"batch-{i}" for i in range(rank)],
            "weights": torch.arange(rank + 2, dtype=torch.float64) / 3}


def same(a: Any, b: Any) -> bool:
    """Equal values, tensors bit for bit with the same dtype."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b)))
    return type(a) is type(b) and a == b


def save_own(comm: Any, path: str, async_save: bool = False) -> None:
    value = own_value(comm.rank)
    handle = distconv.save(model_on(comm), path, extra={"step": 7}, rank_extra=value,
                           comm=comm, async_save=async_save)
    if handle is not None:  # the value changes before it is written: the copy is saved
        value["weights"].add_(1)
        value["rng"].zero_()
        handle.wait()


def load_own(comm: Any, path: str) -> tuple[Any, Any]:
    return distconv.load(model_on(comm, seed=1), path, rank_extra=True)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("async_save", [False, True])
def test_each_rank_gets_back_its_own_value(tmp_path: Path, size: int, async_save: bool) -> None:
    path = str(tmp_path / "ckpt")
    run_threads(save_own, size, path, async_save, timeout=20.0)
    got = run_threads(load_own, size, path, timeout=20.0)
    for rank, (extra, mine) in enumerate(got):
        assert extra == {"step": 7}
        assert same(mine, own_value(rank)), rank
    # the plain load is unchanged: it returns extra alone
    plain = run_threads(lambda comm: distconv.load(model_on(comm), path), size)
    assert plain == [{"step": 7}] * size


def test_on_another_world_size_the_load_refuses_before_it_changes_anything(
    tmp_path: Path
) -> None:
    path = str(tmp_path / "ckpt")
    run_threads(save_own, 4, path, timeout=20.0)

    def load_on_two(comm: Any) -> str:
        model = model_on(comm, seed=1)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(CheckpointError) as err:
            distconv.load(model, path, rank_extra=True)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert distconv.load(model, path) == {"step": 7}  # without rank_extra it loads
        return str(err.value)

    for message in run_threads(load_on_two, 2, timeout=20.0):
        assert "saved on 4 ranks and this world has 2" in message
        assert "consolidate(path, section='rank_extra')" in message
    every = distconv.consolidate(path, section="rank_extra")
    assert isinstance(every, list) and len(every) == 4
    assert all(same(v, own_value(r)) for r, v in enumerate(every))


def test_ranks_without_a_value_get_none_and_a_model_without_tensors_still_stores_them(
    tmp_path: Path
) -> None:
    """Only rank 1 passes a value; the state is an empty module, so the ranks' files hold
    nothing but rank 1's tensors."""
    path = str(tmp_path / "ckpt")

    def run(comm: Any) -> Any:
        value = own_value(comm.rank) if comm.rank == 1 else None
        distconv.save(nn.Module(), path, rank_extra=value, comm=comm)
        return distconv.load(nn.Module(), path, rank_extra=True, comm=comm)

    got = run_threads(run, 2, timeout=20.0)
    assert got[0] == (None, None)
    assert got[1][0] is None and same(got[1][1], own_value(1))
    files = sorted(p.name for p in Path(path).glob("shard-*"))
    assert files == ["shard-00001-of-00002.safetensors"]


def test_a_checkpoint_without_rank_extra_loads_on_any_world(tmp_path: Path) -> None:
    """Saved without it (laid out as before it existed: no section in the index), it gives
    ``None`` on any world size."""
    path = str(tmp_path / "ckpt")
    run_threads(lambda comm: distconv.save(model_on(comm), path, extra=[1, "a"], comm=comm), 2)
    index = json.loads((Path(path) / INDEX_NAME).read_text())
    assert set(index["sections"]) == {"model", "extra"}
    for size in (1, 2, 4):
        got = run_threads(lambda comm: distconv.load(model_on(comm), path, rank_extra=True), size)
        assert got == [([1, "a"], None)] * size
    assert distconv.load(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 1)), path,
                         rank_extra=True, comm=SingleCommunicator()) == ([1, "a"], None)


def test_bad_rank_extra_is_refused_naming_it(tmp_path: Path) -> None:
    one = SingleCommunicator()
    with pytest.raises(TypeError, match=r"rank_extra: 'when' is a object"):
        distconv.save(nn.Linear(2, 2), tmp_path / "a", rank_extra={"when": object()}, comm=one)
    with pytest.raises(TypeError, match=r"rank_extra: tensor 'z' has dtype torch.complex64"):
        distconv.save(nn.Linear(2, 2), tmp_path / "b",
                      rank_extra={"z": torch.zeros(2, dtype=torch.complex64)}, comm=one)
    with pytest.raises(ValueError, match="states: name 'rank_extra'"):
        distconv.save(nn.Linear(2, 2), tmp_path / "c", states={"rank_extra": nn.Linear(1, 1)},
                      comm=one)
    distconv.save(nn.Linear(2, 2), tmp_path / "d", comm=one)
    with pytest.raises(TypeError, match="rank_extra must be True or False"):
        distconv.load(nn.Linear(2, 2), tmp_path / "d", rank_extra="yes")
    with pytest.raises(TypeError, match="comm must be a distconv Communicator"):
        distconv.load(nn.Linear(2, 2), tmp_path / "d", rank_extra=True, comm=0)


def test_a_bad_value_on_one_rank_fails_the_save_on_every_rank_naming_it(tmp_path: Path) -> None:
    def run(comm: Any) -> str:
        value = {"ok": 1} if comm.rank == 0 else {"handle": open}
        with pytest.raises(Exception) as err:
            distconv.save(model_on(comm), tmp_path / "ckpt", rank_extra=value, comm=comm)
        return f"{type(err.value).__name__}: {err.value}"

    errors = run_threads(run, 2, timeout=20.0)
    assert errors[1].startswith("TypeError: rank_extra: 'handle'"), errors[1]
    assert errors[0].startswith("CheckpointError") and "rank 1: TypeError" in errors[0]
    assert not (tmp_path / "ckpt" / INDEX_NAME).exists()


# ---------------------------------------------------------------- a real world

def save_own_real(comm: Any, path: str) -> None:
    torch.set_num_threads(1)
    save_own(comm, path, async_save=True)


@pytest.mark.gloo
def test_saved_on_gloo_each_process_gets_its_own(gloo2: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    gloo2.run(save_own_real, path)
    got = gloo2.run(load_own, path)
    assert all(extra == {"step": 7} and same(mine, own_value(r))
               for r, (extra, mine) in enumerate(got))
