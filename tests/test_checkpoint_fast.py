"""Fast checkpoints: every replicated byte is written once, by the ranks that hold it, spread
evenly; asynchronous saves snapshot the state, publish the index last and report failures.

Expectations come from outside the checkpoint code: which ranks hold which box is what each
saving rank reports from its layers' own specs (``ShardSpec.dist.local_slices``), the bytes in a
file are read from its safetensors header by hand, and loaded values are compared with the
model that was saved.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.optional import need  # noqa: E402

need("safetensors")

import distconv
from distconv.checkpoint import INDEX_NAME, CheckpointError, SaveHandle
from distconv.comm import SingleCommunicator
from distconv.nn import shard_specs
from distconv.parallel import parallelize
from distconv.testing import run_threads

SAMPLE = {"default": {"grid": {"N": 4}, "algorithm": "sample"}}
SAMPLE2 = {"default": {"grid": {"N": 2}, "algorithm": "sample"}}
SHARDED = {"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"}}
CHANNELS = {"default": {"grid": {"C": 2}, "algorithm": "stationary-x"}}


def cnn(seed: int = 0) -> nn.Sequential:
    """One wide convolution (1.5 MB in fp64, most of the bytes), a narrow one, a BatchNorm and a
    Linear that no layer distributes (a plain replicated tensor)."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(128, 160, 3, padding=1), nn.Conv2d(160, 8, 1),
                          nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8, 4)).double()
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype))
    return model


def global_state(seed: int = 0) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in cnn(seed).state_dict().items()}


def boxes(model: nn.Module) -> dict[str, list[list[int]]]:
    """The global box of every local tensor, from the layers' own specs."""
    out = {}
    for key, spec in shard_specs(model).items():
        if spec.grid is None:
            out[key] = [[0, n] for n in spec.global_shape]
        else:
            out[key] = [[s.start, s.stop] for s in
                        spec.dist.local_slices(spec.global_shape, spec.grid)]
    return out


def save_reporting(comm: Any, config: dict[str, Any], path: str) -> dict[str, Any]:
    model = parallelize(cnn(), config, comm=comm)
    distconv.save(model, path, comm=comm)
    return boxes(model)


def file_bytes(path: Path) -> dict[str, dict[str, int]]:
    """Bytes of every tensor in every shard file, read from the safetensors headers."""
    out = {}
    for f in sorted(path.glob("shard-*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        out[f.name] = {k: v["data_offsets"][1] - v["data_offsets"][0]
                       for k, v in header.items() if k != "__metadata__"}
    return out


def check_loaded(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    held = boxes(model)
    for key, t in model.state_dict().items():
        want = expected[key][tuple(slice(a, b) for a, b in held[key])]
        assert t.dtype == want.dtype and torch.equal(t, want), key


@pytest.mark.parametrize("config, size", [(SAMPLE, 4), (SHARDED, 4)])
def test_each_block_is_written_once_by_one_of_its_holders(
    tmp_path: Path, config: dict[str, Any], size: int
) -> None:
    path = tmp_path / "ckpt"
    held = run_threads(save_reporting, size, config, str(path), timeout=20.0)
    index = json.loads((path / INDEX_NAME).read_text())
    written = file_bytes(path)
    expected = global_state()
    # every byte of the global state is in the files once: no replica is written twice
    total = sum(t.numel() * t.element_size() for t in expected.values())
    assert sum(sum(f.values()) for f in written.values()) == total
    for key, t in expected.items():
        shards = index["tensors"][f"model/{key}"]["shards"]
        assert sum(_volume(s["box"]) for s in shards) == t.numel(), key
        for s in shards:
            rank = int(s["file"][6:11])
            inside = all(lo <= a and b <= hi
                         for (a, b), (lo, hi) in zip(s["box"], held[rank][key]))
            assert inside, f"{key}: rank {rank} wrote {s['box']} but holds {held[rank][key]}"
    # the writers are spread: no rank writes more than an even share plus one piece, and a
    # piece is at most 1 MiB or an eighth of a share (what the plan promises)
    per_rank = [sum(written.get(f"shard-{r:05d}-of-{size:05d}.safetensors", {}).values())
                for r in range(size)]
    assert max(per_rank) <= total / size + max(2**20, total / (8 * size)), per_rank
    assert sum(n > 0 for n in per_rank) >= 2, per_rank


def test_a_dominant_replicated_tensor_is_cut_among_its_holders(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    run_threads(save_reporting, 4, SAMPLE, str(path), timeout=20.0)
    w = json.loads((path / INDEX_NAME).read_text())["tensors"]["model/0.weight"]
    # 1.5 MB of a 1.5 MB state held by all 4 ranks: whole, it would leave one rank all the bytes
    files = [s["file"] for s in w["shards"]]
    assert len(files) == len(set(files)) > 1
    rows = sorted(tuple(s["box"][0]) for s in w["shards"])
    assert rows[0][0] == 0 and rows[-1][1] == 160
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))  # contiguous row ranges
    assert all(s["box"][1:] == [[0, 128], [0, 3], [0, 3]] for s in w["shards"])


def _volume(box: list[list[int]]) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def load_into(comm: Any, config: dict[str, Any] | None, path: str) -> None:
    model = cnn(seed=1)  # other values: the load must overwrite them all
    if config is not None:
        model = parallelize(model, config, comm=comm)
    distconv.load(model, path, verify=True)
    check_loaded(model, global_state())


@pytest.mark.parametrize("saved, loaded, size", [
    (SAMPLE, SAMPLE, 4), (SHARDED, SHARDED, 4), (SAMPLE, CHANNELS, 2), (SHARDED, SAMPLE2, 2),
])
def test_round_trips_are_bitwise(tmp_path: Path, saved: Any, loaded: Any, size: int) -> None:
    path = str(tmp_path / "ckpt")
    run_threads(save_reporting, 4, saved, path, timeout=20.0)
    run_threads(load_into, size, loaded, path, timeout=20.0)
    load_into(SingleCommunicator(), None, path)


def test_a_checkpoint_written_before_the_plan_still_loads(tmp_path: Path) -> None:
    """Version 1 as the earlier writer laid it out: safetensors' own writer, one file."""
    from safetensors.torch import save_file

    state = global_state()
    path = tmp_path / "old"
    path.mkdir()
    name = "shard-00000-of-00001.safetensors"
    save_file({f"model/{k}": v for k, v in state.items()}, str(path / name),
              metadata={"format": "pt", "distconv.checkpoint": "1"})
    tensors = {
        f"model/{k}": {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape),
                       "dist": "[" + ",".join("*" * v.dim()) + "]", "grid": None,
                       "shards": [{"file": name, "key": f"model/{k}",
                                   "box": [[0, n] for n in v.shape],
                                   "sha256": hashlib.sha256(v.reshape(-1).view(torch.uint8)
                                                            .numpy()).hexdigest()}]}
        for k, v in state.items()
    }
    tree = {"dict": [[k, {"tensor": k}] for k in state]}
    index = {"format": "distconv.checkpoint", "version": 1, "world_size": 1,
             "files": {name: {"size": (path / name).stat().st_size}},
             "sections": {"model": tree, "extra": {"value": None}}, "tensors": tensors}
    (path / INDEX_NAME).write_text(json.dumps(index))
    load_into(SingleCommunicator(), None, str(path))
    run_threads(load_into, 2, CHANNELS, str(path), timeout=20.0)
    index["version"] = 2
    (path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="format version 2"):
        load_into(SingleCommunicator(), None, str(path))


# ---------------------------------------------------------------- asynchronous saves

def test_async_save_snapshots_the_state_and_loads_as_the_sync_one(tmp_path: Path) -> None:
    def run(comm: Any) -> None:
        model = parallelize(cnn(), SAMPLE2, comm=comm)
        distconv.save(model, tmp_path / "sync", comm=comm)
        handle = distconv.save(model, tmp_path / "async", comm=comm, async_save=True)
        assert isinstance(handle, SaveHandle)
        with torch.no_grad():  # the next optimizer step, while the save is writing
            for p in model.parameters():
                p.add_(1.0)
        handle.wait()
        assert handle.done() and "complete" in repr(handle)
        load_into(comm, CHANNELS, str(tmp_path / "async"))
    run_threads(run, 2, timeout=20.0)
    sync, done = distconv.consolidate(tmp_path / "sync"), distconv.consolidate(tmp_path / "async")
    assert sync.keys() == done.keys() and all(torch.equal(sync[k], done[k]) for k in sync)


def test_async_save_publishes_no_index_before_every_shard_is_in_place(
    tmp_path: Path, monkeypatch: Any
) -> None:
    release = threading.Event()
    real = os.replace

    def held(src: Any, dst: Any) -> None:  # the shard files cannot be put in place yet
        if Path(dst).name.startswith("shard-"):
            assert release.wait(20.0)
        real(src, dst)

    monkeypatch.setattr(os, "replace", held)
    path = tmp_path / "ckpt"

    def run(comm: Any) -> str:
        model = parallelize(cnn(), SAMPLE2, comm=comm)
        handle = distconv.save(model, path, comm=comm, async_save=True)
        assert not handle.done() and "writing" in repr(handle)
        assert not (path / INDEX_NAME).exists()
        with pytest.raises(CheckpointError, match="no complete checkpoint"):
            distconv.load(cnn(), path)
        comm.barrier()
        if comm.rank == 0:
            release.set()
        handle.wait()
        assert (path / INDEX_NAME).exists()
        return repr(handle)
    reprs = run_threads(run, 2, timeout=20.0)
    assert all("complete" in r and f"rank={r_}" in r for r_, r in enumerate(reprs))
    load_into(SingleCommunicator(), None, str(path))
    assert not [f for f in os.listdir(path) if f.startswith(".")]  # no record left behind


def _take_shard_name(path: Path, rank: int, size: int) -> None:
    taken = path / f"shard-{rank:05d}-of-{size:05d}.safetensors"
    (taken / "keep").mkdir(parents=True)


def test_async_failure_is_raised_at_wait(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _take_shard_name(path, 1, 2)  # rank 1's shard file cannot be put in place

    def run(comm: Any) -> str:
        handle = distconv.save(parallelize(cnn(), SAMPLE2, comm=comm), path, comm=comm,
                               async_save=True)
        with pytest.raises(Exception) as err:
            handle.wait()
        assert "failed" in repr(handle)
        return f"{type(err.value).__name__}: {err.value}"
    errors = run_threads(run, 2, timeout=20.0)
    assert errors[1].startswith("IsADirectoryError"), errors[1]
    assert errors[0].startswith("CheckpointError") and "rank 1: IsADirectoryError" in errors[0]
    assert not (path / INDEX_NAME).exists()


def test_async_failure_not_waited_for_is_raised_by_the_next_save(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _take_shard_name(path, 1, 2)

    def run(comm: Any) -> str:
        model = parallelize(cnn(), SAMPLE2, comm=comm)
        distconv.save(model, path, comm=comm, async_save=True)
        with pytest.raises(CheckpointError, match="previous asynchronous save") as err:
            distconv.save(model, tmp_path / "next", comm=comm)
        distconv.save(model, tmp_path / "next", comm=comm)  # reported once, then saves go on
        return str(err.value)
    run_threads(run, 2, timeout=20.0)
    load_into(SingleCommunicator(), None, str(tmp_path / "next"))


def test_each_rank_snapshots_only_the_bytes_it_writes_and_the_copy_is_what_is_written(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The 1.5 MB weight is held whole by both ranks and cut between them: each rank's host
    copy holds only its rows (its share of the state's bytes), yet the checkpoint holds every
    byte as it was when ``save`` returned, though every parameter changes before any file is
    written (the writers are held until then): without the copy it would hold the new values."""
    import distconv.checkpoint._save as save_module

    release = threading.Event()
    real = save_module.write_shard_file

    def held(*args: Any, **kwargs: Any) -> Any:
        assert release.wait(20.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(save_module, "write_shard_file", held)
    path = tmp_path / "ckpt"

    def run(comm: Any) -> int:
        model = parallelize(cnn(), SAMPLE2, comm=comm)
        handle = distconv.save(model, path, comm=comm, async_save=True)
        with torch.no_grad():
            for t in model.state_dict().values():
                t.add_(1) if t.is_floating_point() else t.zero_()
        comm.barrier()
        if comm.rank == 0:
            release.set()
        handle.wait()
        return handle.nbytes

    copied = run_threads(run, 2, timeout=20.0)
    state = global_state()
    total = sum(t.numel() * t.element_size() for t in state.values())
    weight = state["0.weight"].numel() * state["0.weight"].element_size()
    assert sum(copied) == total and max(copied) < total - weight / 4, copied
    shards = json.loads((path / INDEX_NAME).read_text())["tensors"]["model/0.weight"]["shards"]
    assert len(shards) == 2  # the weight is cut between the two ranks
    load_into(SingleCommunicator(), None, str(path))
    run_threads(load_into, 2, CHANNELS, str(path), timeout=20.0)


def test_a_copy_that_fails_on_one_rank_fails_the_save_on_every_rank(
    tmp_path: Path, monkeypatch: Any
) -> None:
    import distconv.checkpoint._save as save_module

    real = save_module._own

    def own(pieces: Any, items: Any, rank: int, **kwargs: Any) -> Any:
        if rank == 1:
            raise MemoryError("no host memory for the snapshot")
        return real(pieces, items, rank, **kwargs)

    monkeypatch.setattr(save_module, "_own", own)
    path = tmp_path / "ckpt"

    def run(comm: Any) -> str:
        model = parallelize(cnn(), SAMPLE2, comm=comm)
        if comm.rank == 1:
            with pytest.raises(MemoryError, match="no host memory"):
                distconv.save(model, path, comm=comm, async_save=True)
            return "raised"
        handle = distconv.save(model, path, comm=comm, async_save=True)
        with pytest.raises(CheckpointError) as err:
            handle.wait()
        return str(err.value)

    errors = run_threads(run, 2, timeout=20.0)
    assert "rank 1: MemoryError: no host memory" in errors[0], errors
    assert not (path / INDEX_NAME).exists()


def test_a_long_failure_in_the_agreement_is_reported_whole(tmp_path: Path) -> None:
    long_key = "k" * 400  # the error naming it does not fit the agreement's first exchange

    def run(comm: Any) -> str:
        model = parallelize(cnn(), SAMPLE2, comm=comm)
        extra = {long_key: object()} if comm.rank == 1 else {long_key: 1}
        with pytest.raises(Exception) as err:
            distconv.save(model, tmp_path / "ckpt", extra=extra, comm=comm, async_save=True)
        return f"{type(err.value).__name__}: {err.value}"

    errors = run_threads(run, 2, timeout=20.0)
    assert errors[1].startswith("TypeError") and long_key in errors[1]
    assert errors[0].startswith("CheckpointError") and "rank 1: TypeError" in errors[0]
    assert long_key in errors[0]


_ENDS_WITHOUT_WAITING = """
import sys, time
import torch
from torch import nn
import distconv
import distconv.checkpoint._save as save_module
from distconv.comm import SingleCommunicator

real = save_module.write_shard_file
def slow(*args, **kwargs):  # still writing when the program ends
    time.sleep(0.5)
    return real(*args, **kwargs)
save_module.write_shard_file = slow
model = nn.Linear(64, 32).double()
torch.save(model.state_dict(), sys.argv[2])  # the expected values, for the test to compare
handle = distconv.save(model, sys.argv[1], comm=SingleCommunicator(), async_save=True)
print("returned before written:", not handle.done())
"""


def test_a_program_that_ends_without_waiting_still_completes_its_save(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = tmp_path / "ends.py"
    script.write_text(_ENDS_WITHOUT_WAITING)
    path, expected = tmp_path / "ckpt", tmp_path / "expected.pt"
    done = subprocess.run([sys.executable, str(script), str(path), str(expected)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "returned before written: True" in done.stdout
    state = torch.load(expected)
    saved = distconv.consolidate(path, verify=True)
    assert saved.keys() == state.keys() and all(torch.equal(saved[k], state[k]) for k in state)


# ---------------------------------------------------------------- a real world

def async_save_real(comm: Any, path: str) -> None:
    torch.set_num_threads(1)
    model = parallelize(cnn(), SAMPLE2, comm=comm)
    handle = distconv.save(model, path, comm=comm, async_save=True)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    handle.wait()


@pytest.mark.gloo
def test_async_save_on_gloo_loads_bitwise(gloo2: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    gloo2.run(async_save_real, path)
    load_into(SingleCommunicator(), None, path)
    run_threads(load_into, 2, CHANNELS, path, timeout=20.0)
