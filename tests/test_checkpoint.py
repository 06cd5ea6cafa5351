"""Sharded checkpoints: round trips between layouts are bitwise, bad checkpoints are refused.

Expected values never come from the checkpoint code: a saving rank reports each local tensor with
its box (``ShardSpec.dist.local_slices``, the layers' own statement of their layout); the test
assembles the global tensors from those (checking that replicas agree), and every loading rank's
tensors must equal the global ones sliced to its new boxes, bit for bit.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
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
from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.nn import DistBatchNorm2d, DistConv2d, ShardSpec, shard_specs
from distconv.testing import run_threads

#: name -> (grid, algorithm, DistConv2d options); "single" is the plain model on one process.
LAYOUTS: dict[str, Any] = {
    "NC-x": ({"N": 2, "C": 2}, "stationary-x", {}),
    "C-y": ({"C": 4}, "stationary-y", {"channel_dim": "F", "filter_dim": "C"}),
    "CF-w": ({"C": 2, "F": 2}, "stationary-w", {}),
    "F-y": ({"F": 2}, "stationary-y", {}),
    "H-x": ({"H": 3}, "stationary-x", {}),
    "single": None,
}


def world_size(layout: str) -> int:
    spec = LAYOUTS[layout]
    return 1 if spec is None else math.prod(spec[0].values())


def reference_model(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Sequential:
    """Two convolutions (channel counts uneven over 2, 3 and 4 ranks), a BatchNorm (distributed
    like the second convolution's output on a grid; an int64 buffer) and a Linear (replicated)."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(5, 7, 3, padding=1), nn.Conv2d(7, 6, 1), nn.BatchNorm2d(6), nn.Linear(3, 4)
    ).to(dtype)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype))
        model[2].num_batches_tracked.fill_(seed + 5)
    return model


def build(comm: Any, layout: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    ref = reference_model(seed, dtype)
    if LAYOUTS[layout] is None:
        return ref
    dims, algorithm, options = LAYOUTS[layout]
    grid = ProcessorGrid(dims, comm=comm)
    convs = [DistConv2d.from_conv2d(c, grid=grid, algorithm=algorithm, **options) for c in ref[:2]]
    bn = DistBatchNorm2d.from_batchnorm2d(ref[2], grid=grid, input_dist=convs[1].output_dist)
    return nn.Sequential(*convs, bn, ref[3])


def make_optimizer(model: nn.Module, kind: str, lr: float = 0.1) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=lr, betas=(0.8, 0.95))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    """Optimizer steps on fixed global gradients (each rank takes its block), so the optimizer
    state is real and the same on every layout."""
    specs = shard_specs(model)
    for step in range(steps):
        for i, (name, p) in enumerate(model.named_parameters()):
            gen = torch.Generator().manual_seed(100 * step + i)
            g = torch.randn(specs[name].global_shape, generator=gen, dtype=p.dtype)
            p.grad = g[_slices(specs[name])].clone()
        optimizer.step()


def _slices(spec: ShardSpec) -> tuple[slice, ...]:
    if spec.grid is None:
        return tuple(slice(0, n) for n in spec.global_shape)
    return spec.dist.local_slices(spec.global_shape, spec.grid)


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Every local tensor (model and optimizer state by parameter name) with its global box."""
    specs = shard_specs(model)
    out = {f"model/{k}": (specs[k], v.clone()) for k, v in model.state_dict().items()}
    if optimizer is not None:
        names = [n for n, _ in model.named_parameters()]
        for i, fields in optimizer.state_dict()["state"].items():
            for field, v in fields.items():
                # moments are shaped like their parameter's block; the step count is a scalar
                spec = specs[names[i]] if v.dim() else ShardSpec(None, Dist.replicated(0), ())
                assert tuple(v.shape) == spec.local_shape, f"{names[i]}/{field}: {v.shape}"
                out[f"optim/{names[i]}/{field}"] = (spec, v.clone())
        out["lr"] = optimizer.param_groups[0]["lr"]
    return {k: v if k == "lr" else (_slices(v[0]), v[0].global_shape, v[1])
            for k, v in out.items()}


def assemble(ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Global tensors from every rank's local blocks; replicas must agree bit for bit."""
    out: dict[str, torch.Tensor] = {}
    for state in ranks:
        for key, value in state.items():
            if key == "lr":
                continue
            box, shape, t = value
            if key not in out:
                out[key] = torch.full(shape, float("nan"), dtype=torch.float64).to(t.dtype) \
                    if t.is_floating_point() else torch.full(shape, -1, dtype=t.dtype)
            seen = out[key][box]
            if t.is_floating_point() and not torch.isnan(seen).all():
                assert torch.equal(seen, t), f"{key}: replicas differ"
            out[key][box] = t
    return out


def save_on(comm: Any, layout: str, path: str, optim: str | None) -> dict[str, Any]:
    model = build(comm, layout)
    optimizer = None if optim is None else make_optimizer(model, optim)
    if optimizer is not None:
        train(model, optimizer)
    distconv.save(model, path, optimizer=optimizer, extra={"epoch": 3, "note": "ok"}, comm=comm)
    return local_state(model, optimizer)


def load_on(comm: Any, layout: str, path: str, optim: str | None) -> dict[str, Any]:
    model = build(comm, layout, seed=1)  # different values: the load must overwrite them all
    optimizer = None if optim is None else make_optimizer(model, optim, lr=0.5)
    extra = distconv.load(model, path, optimizer=optimizer)
    assert extra == {"epoch": 3, "note": "ok"}
    return local_state(model, optimizer)


def run(layout: str, fn: Any, *args: Any) -> list[dict[str, Any]]:
    return run_threads(fn, world_size(layout), layout, *args, timeout=20.0)


def check_equal(expected: dict[str, torch.Tensor], ranks: list[dict[str, Any]]) -> None:
    for r, state in enumerate(ranks):
        assert set(state) - {"lr"} == set(expected), f"rank {r}: keys differ"
        for key, (box, _, t) in ((k, v) for k, v in state.items() if k != "lr"):
            want = expected[key][box]
            assert t.dtype == want.dtype and torch.equal(t, want), f"rank {r}: {key} differs"


ROUND_TRIPS = [
    ("NC-x", "C-y", "sgd"),
    ("NC-x", "single", "adam"),
    ("single", "CF-w", "adam"),
    ("F-y", "H-x", "sgd"),
    ("CF-w", "NC-x", None),
]


@pytest.mark.parametrize("source, target, optim", ROUND_TRIPS)
def test_checkpoint_reshards_bitwise(tmp_path: Path, source: str, target: str, optim: Any) -> None:
    path = str(tmp_path / "ckpt")
    expected = assemble(run(source, save_on, path, optim))
    assert not any(torch.isnan(t).any() for t in expected.values() if t.is_floating_point())
    loaded = run(target, load_on, path, optim)
    check_equal(expected, loaded)
    if optim is not None:
        assert all(state["lr"] == 0.1 for state in loaded), "param group settings not restored"
    plain = distconv.consolidate(path)
    assert set(plain) == {k.removeprefix("model/") for k in expected if k.startswith("model/")}
    for key, t in plain.items():
        assert torch.equal(t, expected[f"model/{key}"]), key


def test_index_records_each_block_once_in_the_paper_notation(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    run("NC-x", save_on, str(path), "adam")
    index = json.loads((path / INDEX_NAME).read_text())
    w = index["tensors"]["model/0.weight"]
    assert (w["dtype"], w["shape"], w["dist"]) == ("float64", [7, 5, 3, 3], "[*,o_C,*,*]")
    assert w["grid"] == [["N", 2], ["C", 2]]
    assert Dist.parse(w["dist"]) == Dist((None, "C", None, None))
    # w[*,o_C] is replicated over N: each o_C block is written once, by one of the two ranks
    # that hold it (C = 0: ranks 0 and 2; C = 1: ranks 1 and 3)
    assert [s["box"] for s in w["shards"]] == [
        [[0, 7], [0, 3], [0, 3], [0, 3]], [[0, 7], [3, 5], [0, 3], [0, 3]],
    ]
    assert w["shards"][0]["file"] in {"shard-00000-of-00004.safetensors",
                                      "shard-00002-of-00004.safetensors"}
    assert w["shards"][1]["file"] in {"shard-00001-of-00004.safetensors",
                                      "shard-00003-of-00004.safetensors"}
    b = index["tensors"]["model/1.bias"]  # b[o_C] of the second layer, 6 over 2
    assert b["dist"] == "[o_C]" and [s["box"] for s in b["shards"]] == [[[0, 3]], [[3, 6]]]
    m = index["tensors"]["optimizer/state/0.weight/exp_avg"]  # shaped like its parameter
    assert m["dist"] == "[*,o_C,*,*]" and len(m["shards"]) == 2
    step = index["tensors"]["optimizer/state/0.weight/step"]
    assert (step["dist"], step["grid"], step["shape"], len(step["shards"])) == ("[]", None, [], 1)
    lin = index["tensors"]["model/3.weight"]  # replicated: written once
    assert (lin["dist"], lin["grid"], len(lin["shards"])) == ("[*,*]", None, 1)
    # replicated tensors are spread over the ranks, not all written by rank 0 (that the bytes
    # are spread evenly is checked in test_checkpoint_fast.py)
    writers = {s["file"] for t in index["tensors"].values() for s in t["shards"]
               if t["grid"] is None}
    assert len(writers) > 1


class CountingParts:
    """Wraps the loader's read of a part of a shard file: counts the elements each thread-rank
    takes out of the files."""

    def __init__(self, real: Any) -> None:
        self.real, self.read = real, {}

    def method(self) -> Any:
        def part(files: Any, *args: Any) -> torch.Tensor:
            got = self.real(files, *args)
            name = threading.current_thread().name
            self.read[name] = self.read.get(name, 0) + got.numel()
            return got

        return part


def test_each_rank_reads_only_its_blocks(tmp_path: Path, monkeypatch: Any) -> None:
    from distconv.checkpoint import _load

    path = str(tmp_path / "ckpt")
    run("NC-x", save_on, path, "adam")
    counting = CountingParts(_load._Files._part)
    monkeypatch.setattr(_load._Files, "_part", counting.method())
    loaded = run("CF-w", load_on, path, "adam")
    for r, state in enumerate(loaded):
        held = sum(t.numel() for k, v in state.items() if k != "lr" for t in [v[2]])
        assert counting.read[f"distconv-rank{r}"] == held, f"rank {r}"


def plain_to(comm: Any, layout: str, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    model = build(comm, layout, seed=1)
    distconv.load_global_state_dict(model, state)
    return local_state(model, None)


@pytest.mark.parametrize("layout", ["CF-w", "H-x", "single"])
def test_plain_state_dict_loads_into_any_layout(layout: str) -> None:
    state = reference_model(seed=2).state_dict()
    loaded = run(layout, plain_to, state)
    check_equal({f"model/{k}": v for k, v in state.items()}, loaded)


class FactorStats:
    """A stand-in for K-FAC state: a factor blocked like a weight's channel dim, a replicated
    matrix and plain counters, described by ``shard_specs()``."""

    def __init__(self, grid: ProcessorGrid | None, global_factor: torch.Tensor) -> None:
        self.grid = grid
        self.dist = Dist(("C", None)) if grid is not None else Dist.replicated(2)
        self.shape = tuple(global_factor.shape)
        self.factor = global_factor[self.box()].clone()
        self.inverse = global_factor.T.clone()
        self.steps = 7

    def box(self) -> tuple[slice, ...]:
        if self.grid is None:
            return (slice(None), slice(None))
        return self.dist.local_slices(self.shape, self.grid)

    def state_dict(self) -> dict[str, Any]:
        return {"layers": {"conv1": {"A": self.factor, "inv": self.inverse}}, "steps": self.steps}

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {"layers/conv1/A": ShardSpec(self.grid, self.dist, self.shape)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.factor = state["layers"]["conv1"]["A"]
        self.inverse = state["layers"]["conv1"]["inv"]
        self.steps = state["steps"]


def stats_round_trip(
    comm: Any, dims: dict[str, int] | None, path: str, save: bool, rows: int
) -> Any:
    grid = None if dims is None else ProcessorGrid(dims, comm=comm)
    factor = torch.arange(rows * 5, dtype=torch.float32).reshape(rows, 5)
    model = nn.Linear(2, 2)
    if save:
        distconv.save(model, path, states={"kfac": FactorStats(grid, factor)}, comm=comm)
        return None
    stats = FactorStats(grid, torch.zeros(rows, 5))
    stats.steps = 0
    distconv.load(model, path, states={"kfac": stats})
    return stats.factor, factor[stats.box()], stats.inverse, stats.steps


@pytest.mark.parametrize("rows", [7, 2])  # 2 rows over 3 ranks: one block is empty
def test_shardable_state_reshards_like_parameters(tmp_path: Path, rows: int) -> None:
    path = str(tmp_path / "ckpt")
    run_threads(stats_round_trip, 3, {"C": 3}, path, True, rows)
    for dims, size in (({"C": 2}, 2), ({"C": 4}, 4), (None, 1)):
        for got, want, inverse, steps in run_threads(
            stats_round_trip, size, dims, path, False, rows
        ):
            assert torch.equal(got, want) and steps == 7
            assert torch.equal(inverse, torch.arange(rows * 5.0).reshape(rows, 5).T)
    index = json.loads((tmp_path / "ckpt" / INDEX_NAME).read_text())
    assert index["tensors"]["kfac/layers/conv1/A"]["dist"] == "[o_C,*]"


def small_cnn() -> nn.Sequential:
    gen = torch.Generator().manual_seed(4)
    model = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                          nn.Conv2d(6, 5, 3, padding=1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


#: the first config splits the first conv's channels and the last conv's filters over 4 ranks,
#: the second samples over 2 ranks and the last conv's channels
PARALLEL_CONFIGS = [
    {"default": {"grid": {"N": 4}, "algorithm": "sample"},
     "layers": [{"match": "0", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"},
                {"match": "3", "grid": {"F": 4}, "algorithm": "stationary-y"}]},
    {"default": {"grid": {"N": 2}, "algorithm": "sample"},
     "layers": [{"match": "3", "grid": {"C": 2}, "algorithm": "stationary-x"}]},
]


def parallel_round_trip(comm: Any, config: dict[str, Any], path: str, save: bool) -> Any:
    from distconv.parallel import parallelize

    model = parallelize(small_cnn(), config, comm=comm)
    if save:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.5)
        distconv.save(model, path, comm=comm)
    else:
        distconv.load(model, path)
    return local_state(model, None)


def test_parallelized_model_resumes_on_another_config(tmp_path: Path) -> None:
    expected = {f"model/{k}": v for k, v in small_cnn().state_dict().items()}
    for key in ("0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"):
        expected[f"model/{key}"] = expected[f"model/{key}"] + 1.5
    path = str(tmp_path / "ckpt")
    check_equal(expected, run_threads(parallel_round_trip, 4, PARALLEL_CONFIGS[0], path, True))
    check_equal(expected, run_threads(parallel_round_trip, 2, PARALLEL_CONFIGS[1], path, False))
    plain = distconv.consolidate(path)
    assert all(torch.equal(plain[k.removeprefix("model/")], v) for k, v in expected.items())


def test_kfac_state_round_trips_and_continues_identically(tmp_path: Path) -> None:
    distkfac = pytest.importorskip("distkfac")
    from distconv.checkpoint._tree import flatten

    def model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(64, 2))

    x = torch.randn(5, 3, 6, 6, generator=torch.Generator().manual_seed(3))
    saved = model(0)
    kfac = distkfac.KFAC(saved)
    saved(x).square().sum().backward()
    kfac.step()
    distconv.save(saved, tmp_path, states={"kfac": kfac}, comm=SingleCommunicator())
    loaded = model(1)
    kfac2 = distkfac.KFAC(loaded)
    distconv.load(loaded, tmp_path, states={"kfac": kfac2})
    tree, tensors = flatten(kfac.state_dict(), where="kfac")
    tree2, tensors2 = flatten(kfac2.state_dict(), where="kfac")
    assert tree == tree2 and tensors and all(torch.equal(tensors[k], tensors2[k]) for k in tensors)
    for m, k in ((saved, kfac), (loaded, kfac2)):  # the next step preconditions identically
        m.zero_grad()
        m(x).square().sum().backward()
        k.step()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(saved.parameters(), loaded.parameters()))


# ---------------------------------------------------------------- bad checkpoints

@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "good"
    run("NC-x", save_on, str(path), "sgd")
    return path


@pytest.fixture
def broken(saved: Path, tmp_path: Path) -> Path:
    path = tmp_path / "broken"
    shutil.copytree(saved, path)
    return path


def load_single(path: Path, **kw: Any) -> nn.Module:
    model = reference_model(seed=1)
    distconv.load(model, path, **kw)
    return model


def edit_index(path: Path, fn: Any) -> None:
    index = json.loads((path / INDEX_NAME).read_text())
    fn(index)
    (path / INDEX_NAME).write_text(json.dumps(index))


def test_directory_without_index_is_refused(broken: Path) -> None:
    (broken / INDEX_NAME).unlink()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_single(broken)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        distconv.consolidate(broken / "nowhere")


def test_missing_shard_file_names_the_tensor(broken: Path) -> None:
    (broken / "shard-00001-of-00004.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"tensor 'model/\d\.\w+': shard file .* missing"):
        load_single(broken)


def test_truncated_shard_file_names_the_tensor(broken: Path) -> None:
    f = broken / "shard-00000-of-00004.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match=r"tensor 'model/.*truncated"):
        load_single(broken)


def test_corrupt_header_names_the_tensor(broken: Path) -> None:
    f = broken / "shard-00000-of-00004.safetensors"
    data = bytearray(f.read_bytes())
    data[8:16] = b"\xff" * 8  # inside the JSON header; the file keeps its size
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensor 'model/.*cannot be read"):
        load_single(broken)


def test_corrupt_data_is_caught_by_verify(broken: Path) -> None:
    f = broken / "shard-00000-of-00004.safetensors"
    data = bytearray(f.read_bytes())
    header = int.from_bytes(data[:8], "little")  # safetensors: u64 header size, JSON header, data
    start, _ = json.loads(data[8:8 + header])["model/0.weight"]["data_offsets"]
    data[8 + header + start + 5] ^= 0x10  # one bit of one element; the file keeps its size
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensor 'model/0.weight': .* is corrupt"):
        load_single(broken, verify=True)


def test_missing_tensor_is_named(broken: Path) -> None:
    edit_index(broken, lambda ix: ix["tensors"].pop("model/1.bias"))
    with pytest.raises(CheckpointError, match=r"tensor 'model/1.bias' is missing"):
        load_single(broken)


def test_shards_that_do_not_tile_are_named(broken: Path) -> None:
    def shrink(ix: dict[str, Any]) -> None:
        ix["tensors"]["model/0.weight"]["shards"][1]["box"][1] = [2, 5]  # overlaps block 0
    edit_index(broken, shrink)
    with pytest.raises(CheckpointError, match=r"tensor 'model/0.weight': shards .* overlap"):
        load_single(broken)


def test_wrong_global_shape_is_named(saved: Path) -> None:
    model = reference_model()
    model[0] = nn.Conv2d(5, 7, 2, dtype=torch.float64)
    with pytest.raises(CheckpointError, match=r"tensor 'model/0.weight'.*\(7, 5, 3, 3\)"):
        distconv.load(model, saved)


def test_wrong_dtype_is_named(saved: Path) -> None:
    with pytest.raises(CheckpointError, match=r"tensor 'model/0.weight'.*float64.*float32"):
        distconv.load(reference_model(dtype=torch.float32), saved)


def test_unknown_and_missing_keys(saved: Path) -> None:
    small = reference_model()[:3]
    with pytest.raises(CheckpointError, match=r"does not have: \['3.weight', '3.bias'\]"):
        distconv.load(small, saved)
    distconv.load(small, saved, strict=False)
    assert torch.equal(small[0].weight, distconv.consolidate(saved)["0.weight"])
    bigger = nn.Sequential(*reference_model(), nn.Linear(4, 2, dtype=torch.float64))
    with pytest.raises(CheckpointError, match=r"tensor '4.weight' is missing"):
        distconv.load(bigger, saved)


def test_plain_state_dict_of_another_shape_is_named() -> None:
    state = reference_model().state_dict()
    state["1.weight"] = torch.zeros(6, 8, 1, 1, dtype=torch.float64)
    with pytest.raises(CheckpointError, match=r"tensor 'model/1.weight'.*\(6, 8, 1, 1\)"):
        distconv.load_global_state_dict(reference_model(), state)


def failing_save(comm: Any, path: str) -> str:
    """Save on NC-x where rank 2's file cannot be written; return the error this rank raised."""
    model = build(comm, "NC-x")
    try:
        distconv.save(model, path, comm=comm)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_failed_save_leaves_no_checkpoint(broken: Path) -> None:
    # rank 2's shard file cannot be put in place: its name is taken by a directory
    taken = broken / "shard-00002-of-00004.safetensors"
    taken.unlink(missing_ok=True)
    (taken / "keep").mkdir(parents=True)
    errors = run_threads(failing_save, 4, str(broken), timeout=20.0)
    assert errors[2].startswith("IsADirectoryError: "), errors[2]
    for r in (0, 1, 3):  # the others raise naming it, instead of waiting for rank 2
        assert errors[r] == ("CheckpointError: checkpoint.save could not write the shards: "
                             f"rank 2: {errors[2]}")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_single(broken)


def test_ranks_that_disagree_refuse_to_save(tmp_path: Path) -> None:
    def save(comm: Any) -> None:
        model = reference_model()[: 3 + (comm.rank == 1)]
        distconv.save(model, tmp_path / "ckpt", comm=comm)
    with pytest.raises(CheckpointError, match="disagree"):
        run_threads(save, 2, timeout=20.0)
    assert not (tmp_path / "ckpt" / INDEX_NAME).exists()

    def save_rank(comm: Any) -> None:  # a plain value that differs per rank would be lost
        distconv.save(reference_model(), tmp_path / "ckpt", extra={"rank": comm.rank}, comm=comm)
    with pytest.raises(CheckpointError, match="disagree"):
        run_threads(save_rank, 2, timeout=20.0)


def test_bad_arguments_are_refused(saved: Path) -> None:
    model = reference_model()
    with pytest.raises(TypeError, match="path must be a str or os.PathLike directory, got 3"):
        distconv.load(model, 3)
    with pytest.raises(TypeError, match="strict must be True or False, got 'yes'"):
        distconv.load(model, saved, strict="yes")
    with pytest.raises(TypeError, match="model must be an nn.Module or an object with"):
        distconv.load([1], saved)
    with pytest.raises(ValueError, match="states: name 'model' must be"):
        distconv.load(model, saved, states={"model": model})
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got dict"):
        distconv.load(model, saved, optimizer={})
    with pytest.raises(CheckpointError, match="has no 'kfac' section"):
        distconv.consolidate(saved, section="kfac")


def test_state_that_is_not_tensors_or_values_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"extra: 'when' is a object"):
        distconv.save(nn.Linear(2, 2), tmp_path, extra={"when": object()},
                      comm=SingleCommunicator())


# ---------------------------------------------------------------- real worlds

def save_real(comm: Any, path: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return save_on(comm, "NC-x", path, "adam")


@pytest.mark.gloo
def test_saved_on_gloo_loads_on_threads(gloo4: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    expected = assemble(gloo4.run(save_real, path))
    check_equal(expected, run("C-y", load_on, path, "adam"))


@pytest.mark.mpi
def test_saved_on_mpi_loads_on_one_process(mpi4: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    expected = assemble(mpi4.run(save_real, path))
    check_equal(expected, [load_on(SingleCommunicator(), "single", path, "adam")])
