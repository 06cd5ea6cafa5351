"""Configs and misuse are refused clearly, naming the entry, the node or the ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distconv.data import GridSampler, sample_block
from distconv.grid import ProcessorGrid
from distconv.nn.grad_sync import BucketedGradSync, plan_buckets
from distconv.parallel import ParallelConfig, parallelize
from distconv.parallel.explain import explain
from distconv.testing import run_threads
from tests.parallel.cases import reference_step, resnet_case


def _config_error(config: dict, world: int = 4) -> str:
    with pytest.raises(ValueError) as info:
        ParallelConfig(config, world_size=world)
    return str(info.value)


def test_config_errors_name_the_entry() -> None:
    assert "multiply to the world size" in _config_error({"default": {"grid": {"N": 2}}})
    msg = _config_error({"layers": [{"match": "a", "grid": {"F": 2, "N": 2},
                                     "algorithm": "stationary-x"}]})
    assert "layers[0]" in msg and "stationary-w" in msg
    msg = _config_error({"layers": [{"match": "a", "grid": {"C": 4}, "algorithm": "sample"}]})
    assert "splits only samples" in msg and "stationary-*" in msg
    assert "unknown keys ['lyers']" in _config_error({"lyers": []})
    assert "'X' is not one of" in _config_error({"default": {"grid": {"X": 4}}})
    assert "algorithm must be one of" in _config_error(
        {"default": {"grid": {"N": 4}, "algorithm": "fast"}})
    assert "match must be" in _config_error({"layers": [{"grid": {"N": 4}, "match": ""}]})
    assert "grid is required" in _config_error({"layers": [{"match": "a"}]})


def test_a_pattern_that_matches_nothing_is_refused() -> None:
    model, _, _ = resnet_case()
    with pytest.raises(ValueError, match=r"layers\[0\] \('layer9\.\*'\): the pattern matches no"):
        explain(model, {"default": {"grid": {"N": 4}},
                        "layers": [{"match": "layer9.*", "grid": {"N": 4}}]}, (4, 3, 16, 16))


def test_yaml_configs_load(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("default: {grid: {N: 2, C: 2}, algorithm: stationary-x}\n"
                    "layers:\n  - {match: 'fc', grid: {N: 4}, algorithm: sample}\n")
    cfg = ParallelConfig(str(path), world_size=4)
    assert cfg.choice("layer1.0.conv1").grid == {"N": 2, "C": 2}
    assert cfg.choice("fc").algorithm == "sample"
    with pytest.raises(ValueError, match="neither a dict nor an existing YAML file"):
        ParallelConfig(str(tmp_path / "missing.yaml"), world_size=4)


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("default:\n  grid: {N: 2, C: 2\n  algorithm: stationary-x\n")
    where = r"broken\.yaml', line 3, column \d+: not valid YAML"
    with pytest.raises(ValueError, match=where) as info:
        ParallelConfig(str(path), world_size=4)
    assert info.value.__cause__ is None and info.value.__suppress_context__


class Dropper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(self.conv(x)).mean((2, 3)))


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) if x.sum() > 0 else x


def _refusal(model: nn.Module, config: dict, exc: type[Exception], size: int = 2) -> str:
    def run(comm):
        with pytest.raises(exc) as info:
            parallelize(model, config, comm=comm)
        return str(info.value)

    return run_threads(run, size)[0]


def test_unsupported_constructs_are_refused_naming_the_node() -> None:
    split_c = {"default": {"grid": {"C": 2}, "algorithm": "stationary-x"},
               "layers": [{"match": "fc", "grid": {"N": 2}, "algorithm": "sample"}]}
    shuffler = nn.Sequential(nn.Conv2d(3, 4, 3), nn.PixelShuffle(2))
    msg = _refusal(shuffler, split_c | {"layers": []}, NotImplementedError)
    assert "node '_1'" in msg and "PixelShuffle is not supported" in msg
    assert "cannot trace Branchy" in _refusal(Branchy(), {}, TypeError)
    linear_h = {"layers": [{"match": "fc", "grid": {"H": 2}, "algorithm": "spatial"}]}
    assert "Linear layers run sample-parallel" in _refusal(Dropper(), linear_h, ValueError)
    model, _, _ = resnet_case()
    too_many = {"layers": [{"match": "conv1", "grid": {"C": 4}, "algorithm": "stationary-x"}]}
    msg = _refusal(copy.deepcopy(model), too_many, ValueError, size=4)
    assert "layer 'conv1'" in msg and "in_channels=3" in msg
    with pytest.raises(ValueError, match="loss_reduction must be one of"):
        parallelize(model, {}, loss_reduction="avg")


def _forward_error(blocks: list[int], data: dict) -> str:
    model, x, _ = resnet_case()

    def run(comm):
        pm = parallelize(copy.deepcopy(model), {"data": data}, comm=comm)
        with pytest.raises(ValueError) as info:
            pm(x[: blocks[comm.rank]])
        return str(info.value)

    return run_threads(run, 4)[0]


def test_wrong_sample_blocks_are_refused() -> None:
    assert "not balanced" in _forward_error([1, 3, 2, 2], {"N": 4})
    msg = _forward_error([2, 3, 2, 2], {"N": 2, "C": 2})
    assert "share sample block N=0" in msg and "GridSampler" in msg


def test_grid_sampler_deals_balanced_blocks_and_replicas_agree() -> None:
    data = list(range(11))

    def run(comm):
        grid = ProcessorGrid({"N": 2, "C": 2}, comm=comm)
        sampler = GridSampler(data, grid, shuffle=True, seed=3)
        sampler.set_epoch(1)
        return grid.coords["N"], list(sampler)

    got = run_threads(run, 4)
    assert got[0] == got[1] and got[2] == got[3]  # replicas of one N block: same samples
    assert len(got[0][1]) == len(got[2][1]) == 6  # padded to equal blocks, as DistributedSampler
    assert set(got[0][1]) | set(got[2][1]) == set(data)

    def block(comm):
        return sample_block(7, ProcessorGrid({"N": 4}, comm=comm))

    assert run_threads(block, 4) == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 7)]


def test_plan_buckets_fills_in_reverse_order() -> None:
    assert plan_buckets([4, 4, 4, 4], 8) == [[3, 2], [1, 0]]
    assert plan_buckets([4, 20, 4], 8) == [[2], [1], [0]]


def test_plan_buckets_takes_an_empty_block_first() -> None:
    # a rank's empty shard (3 filters over 4 ranks) is the last parameter registered
    assert plan_buckets([4, 0], 8) == [[1, 0]]
    assert plan_buckets([4, 4, 0], 4) == [[2, 1], [0]]


def test_bucketed_sync_sums_every_pass_and_unused_parameters() -> None:
    def run(comm):
        torch.manual_seed(0)
        lin = nn.Linear(3, 2).double()
        unused = nn.Parameter(torch.ones(2, dtype=torch.float64))
        BucketedGradSync(comm, [lin.weight, lin.bias, unused], bucket_bytes=16)
        x = torch.full((1, 3), float(comm.rank + 1), dtype=torch.float64)
        for _ in range(2):  # accumulation over two backward passes
            lin(x).sum().backward()
        return lin.weight.grad.clone(), lin.bias.grad.clone(), unused.grad

    results = run_threads(run, 2)
    for w, b, u in results:
        # d/dW sum(W x + b) = x per row; ranks' x are 1 and 2, two passes: 2 * (1 + 2) = 6
        assert torch.equal(w, torch.full((2, 3), 6.0, dtype=torch.float64))
        assert torch.equal(b, torch.full((2,), 4.0, dtype=torch.float64))
        assert u is None  # no rank reached it: None, as on one process (optimizers skip it)


def test_bucketed_sync_completes_a_parameter_only_some_ranks_reach() -> None:
    def run(comm):
        p = nn.Parameter(torch.zeros(2, dtype=torch.float64))
        q = nn.Parameter(torch.zeros(2, dtype=torch.float64))
        BucketedGradSync(comm, [p, q], bucket_bytes=1 << 20)
        loss = 3.0 * p.sum() + (q.sum() if comm.rank == 1 else 0.0)
        loss.backward()
        return p.grad.clone(), q.grad

    for p_grad, q_grad in run_threads(run, 2):
        assert torch.equal(p_grad, torch.full((2,), 6.0, dtype=torch.float64))  # 3 + 3
        assert torch.equal(q_grad, torch.ones(2, dtype=torch.float64))  # rank 1's 1, on both


def test_user_loop_trains_several_steps_exactly() -> None:
    """Three steps of SGD with momentum, BN running statistics included."""
    model, x, y = resnet_case(seed=2)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        F.cross_entropy(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    config = {"layers": [{"match": "layer2.*", "grid": {"N": 2, "C": 2},
                          "algorithm": "stationary-x"}]}

    def run(comm):
        pm = parallelize(copy.deepcopy(model), config, comm=comm)
        popt = torch.optim.SGD(pm.parameters(), lr=0.05, momentum=0.9)
        rows = sample_block(x.shape[0], pm.data_grid)
        for _ in range(3):
            F.cross_entropy(pm(x[rows]), y[rows]).backward()
            popt.step()
            popt.zero_grad()
        return pm.gather_module().state_dict()

    want = ref.state_dict()
    for state in run_threads(run, 4):
        for k, v in want.items():
            assert (state[k].double() - v.double()).abs().max() < 1e-10, k


def test_auto_layers_choose_by_the_model_and_stay_exact() -> None:
    from distconv.perfmodel import Machine

    model, x, y = resnet_case()
    machine = Machine(alpha=1e-5, beta=1e-9, flop_rate=1e9)
    config = {"layers": [{"match": "layer3.*", "algorithm": "auto"},
                         {"match": "layer2.*", "grid": {"C": 4}, "algorithm": "auto"}]}
    plan = explain(model, config, tuple(x.shape), world_size=4, machine=machine)
    notes = {layer.name: layer.note for layer in plan.layers}
    assert notes["layer2.0.conv1"].startswith("auto: stationary-x {'C': 4}")
    chosen = notes["layer3.0.conv2"].split(",")[0]
    layer = next(lay for lay in plan.layers if lay.name == "layer3.0.conv2")
    assert chosen.startswith(f"auto: {layer.algorithm}")
    ref = reference_step(model, x, y)

    def run(comm):
        pm = parallelize(copy.deepcopy(model), config, comm=comm, input_shape=x.shape,
                         machine=machine)
        rows = sample_block(x.shape[0], pm.data_grid)
        return {k: d.chosen[1] for k, d in pm.auto_decisions.items()}, pm(x[rows]).detach(), rows

    for choices, out, rows in run_threads(run, 4):
        assert choices["layer3.0.conv2"] == layer.algorithm
        assert (out - ref["out"][rows]).abs().max() < 1e-10
    with pytest.raises(ValueError, match="pass input_shape="):
        parallelize(model, {"default": {"algorithm": "auto"}})


def test_debug_mode_refuses_replicas_with_different_samples() -> None:
    from distconv.comm import set_debug

    model, x, _ = resnet_case()

    def run(comm):
        pm = parallelize(copy.deepcopy(model), {"data": {"N": 2, "C": 2}}, comm=comm)
        rows = sample_block(x.shape[0], pm.data_grid)
        mine = x[rows].clone()
        if comm.rank == 1:
            mine[0, 0, 0, 0] += 1.0  # rank 1 replicates rank 0's block, but not quite
        with pytest.raises(ValueError) as info:
            pm(mine)
        return str(info.value)

    set_debug(True)
    try:
        messages = run_threads(run, 4)
    finally:
        set_debug(False)
    assert "ranks 0 and 1 share sample block N=0" in messages[0]


def test_eval_mode_under_no_grad_equals_one_process() -> None:
    model, x, y = resnet_case(seed=3)
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()  # one training forward: running statistics move
    ref.eval()
    with torch.no_grad():
        want = ref(x)
    config = {"layers": [{"match": "layer1.*", "grid": {"N": 2, "H": 2}, "algorithm": "spatial"},
                         {"match": "layer3.*", "grid": {"C": 2, "F": 2},
                          "algorithm": "stationary-w"}]}

    def run(comm):
        pm = parallelize(copy.deepcopy(model), config, comm=comm)
        rows = sample_block(x.shape[0], pm.data_grid)
        F.cross_entropy(pm(x[rows]), y[rows]).backward()
        pm.eval()
        with torch.no_grad():
            return (pm(x[rows]) - want[rows]).abs().max().item()

    assert max(run_threads(run, 4)) < 1e-10


def test_an_entry_matches_a_module_by_any_of_its_paths() -> None:
    """``enc.1`` is also ``skips.0``: an entry by either path sets it (over the default), an
    ``auto`` entry agrees with the choice made for it, and the module keeps its first path."""
    from distconv.parallel.config import AliasedConfig

    cfg = ParallelConfig({"default": {"grid": {"N": 4}, "algorithm": "sample"}, "layers": [
        {"match": "enc.1", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"},
        {"match": "skips.*", "algorithm": "auto"},
        {"match": "skips.0.bn", "statistics": "local"},
        {"match": "skips", "checkpoint": True}]}, world_size=4)
    paths = {"enc.1": ("enc.1", "skips.0"), "enc.1.bn": ("enc.1.bn", "skips.0.bn")}
    aliased = AliasedConfig(cfg, paths)
    assert aliased.choice("enc.1").source == "layers[0] ('enc.1')"
    assert aliased.choice("enc.0").source == "default"
    assert (aliased.statistics("enc.1.bn"), cfg.statistics("enc.1.bn")) == ("local", "global")
    assert aliased.checkpointed("enc.1.bn") and not cfg.checkpointed("enc.1.bn")
    aliased.check_matches(["enc.0", "enc.1"], ["enc.1.bn"], ["enc", "enc.1", "enc.1.bn"])
    with pytest.raises(ValueError, match="matches no Conv2d or Linear module"):
        cfg.check_matches(["enc.0", "enc.1"], ["enc.1.bn"], ["enc", "enc.1", "enc.1.bn"])
