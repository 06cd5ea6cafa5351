"""``F.batch_norm`` called by a module's forward on its own buffers and parameters (timm's
``BatchNormAct2d``): two training steps and an evaluation equal one process's -- outputs,
gradients, parameters, running statistics and batch counts -- under every option; a capture
leaves the model's buffers as they were; what cannot follow its module is refused by name."""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distconv import ops
from distconv.data import sample_block
from distconv.ops.base import SAMPLE_GRIDS, SampleNet
from distconv.ops.norm import _BatchNormAct
from distconv.parallel import parallelize
from distconv.parallel.explain import explain
from distconv.testing import run_threads
from tests.parallel.cases import LR, MOMENTUM, TOL, seeded

SHAPE = (5, 4, 7, 6)
IDS = ["sample", "spatial", "stationary-x", "stationary-y", "stationary-w"]


def steps_reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """One process: two SGD steps on the global batch, then an evaluation; the state after
    each step (running statistics and batch counts included)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    outs, states = [], []
    for _ in range(2):
        out = model(x)
        F.cross_entropy(out, y).backward()
        opt.step()
        opt.zero_grad()
        outs.append(out.detach())
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    model.eval()
    with torch.no_grad():
        outs.append(model(x))
    return {"outs": outs, "states": states}


def steps_parallel(comm: Any, model: nn.Module, config: Any, x: torch.Tensor,
                   y: torch.Tensor) -> dict[str, Any]:
    """The same on the parallel model, the user's loop on this rank's samples."""
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    opt = torch.optim.SGD(pmodel.parameters(), lr=LR, momentum=MOMENTUM)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    outs, states = [], []
    for _ in range(2):
        out = pmodel(x[rows])
        F.cross_entropy(out, y[rows]).backward()
        opt.step()
        opt.zero_grad()
        outs.append(out.detach())
        states.append({k: v.clone() for k, v in pmodel.gather_state_dict().items()})
    pmodel.eval()
    with torch.no_grad():
        outs.append(pmodel(x[rows]))
    return {"rows": rows, "outs": outs, "states": states}


def _case(make: Any, shape: tuple[int, ...] = SHAPE, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    model = seeded(make().double(), gen)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (shape[0],), generator=gen)
    return model, x, y


def _check(model: nn.Module, world: int, config: dict, x: torch.Tensor, y: torch.Tensor,
           runner: Any = None) -> None:
    ref = steps_reference(model, x, y)
    results = (runner or (lambda *a: run_threads(steps_parallel, world, *a)))(
        model, config, x, y)
    for got in results:
        for want, out in zip(ref["outs"], got["outs"]):
            assert (out - want[got["rows"]]).abs().max() < TOL
        for want, state in zip(ref["states"], got["states"]):
            assert set(state) == set(want)
            for k, v in want.items():
                assert (state[k].double() - v.double()).abs().max() < TOL, k
                assert state[k].dtype == v.dtype, k


class Cumulative(nn.Module):
    """Two timm-style batch norms (``F.batch_norm`` in the module's forward), one averaging its
    statistics cumulatively (``momentum=None``), between convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 4, 1)
        self.bn1 = _BatchNormAct(4, momentum=None)
        self.conv = nn.Conv2d(4, 6, 3, padding=1)
        self.bn2 = _BatchNormAct(6, eps=1e-3, momentum=0.25)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn2(self.conv(self.bn1(self.stem(x)))).mean((2, 3)))


@pytest.mark.parametrize("world,config", SAMPLE_GRIDS, ids=IDS)
def test_running_statistics_and_batch_counts_equal_one_process(world: int, config: dict) -> None:
    model, x, y = _case(Cumulative)
    _check(model, world, config, x, y)


@pytest.mark.parametrize("world,config", SAMPLE_GRIDS[2:3] + SAMPLE_GRIDS[4:], ids=IDS[2:3] + IDS[4:])
def test_untracked_and_plain_affine_free_norms_equal_one_process(world: int, config: dict) -> None:
    model, x, y = _case(lambda: SampleNet(nn.Sequential(
        _BatchNormAct(4, affine=False), _BatchNormAct(4, track_running_stats=False)), 4))
    _check(model, world, config, x, y)


class _Plain(nn.BatchNorm2d):
    """A subclass that keeps torch's forward."""


def test_subclass_with_torchs_forward_is_the_distributed_layer() -> None:
    model, x, y = _case(lambda: SampleNet(_Plain(4), 4))
    world, config = SAMPLE_GRIDS[2]
    gm_kinds = run_threads(_kinds, world, model, config)
    assert all("DistBatchNorm2d" in k for k in gm_kinds)
    _check(model, world, config, x, y)


def _kinds(comm: Any, model: nn.Module, config: Any) -> set[str]:
    return {type(m).__name__ for m in parallelize(copy.deepcopy(model), config,
                                                  comm=comm).modules()}


def test_capture_leaves_the_models_buffers_as_they_were() -> None:
    """fx runs the forward's Python on the real buffers; ``num_batches_tracked.add_(1)`` is
    not in the graph, and a capture is no training step."""
    model, _, _ = _case(Cumulative)
    explain(model, SAMPLE_GRIDS[0][1], SHAPE, world_size=2)
    assert int(model.bn1.num_batches_tracked) == 0 and int(model.bn2.num_batches_tracked) == 0


class _AlwaysTraining(nn.BatchNorm2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                            True, 0.1, self.eps)


class _NotCounting(nn.BatchNorm2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                            self.training, self.momentum, self.eps)


class _Stats(nn.Module):
    """Running statistics of a module that is no BatchNorm, updated in training."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.mean, self.var, None, None, True, 0.1, 1e-5)


@pytest.mark.parametrize("layer,words", [
    (lambda: _AlwaysTraining(4).eval(), "call batch_norm as nn.BatchNorm's forward does"),
    (lambda: _NotCounting(4), "count module 'layer'"),
    (lambda: _Stats(), "give the running statistics to an nn.BatchNorm module"),
], ids=["always-training", "not-counting", "no-batchnorm"])
def test_a_call_that_does_not_follow_its_module_is_refused_by_name(layer: Any, words: str) -> None:
    model = SampleNet(layer(), 4)
    with pytest.raises(ops.Unsupported, match="node 'batch_norm'.*in module 'layer'") as exc:
        explain(model, SAMPLE_GRIDS[0][1], SHAPE, world_size=2)
    assert str(exc.value).split(": ", 2)[2].startswith(words)


def test_per_sample_block_statistics_are_refused_by_name() -> None:
    config = {"default": {"grid": {"N": 2}, "algorithm": "sample", "statistics": "local"}}
    with pytest.raises(ValueError, match="node 'batch_norm'.*: leave module 'layer'"):
        explain(SampleNet(_BatchNormAct(4), 4), config, SHAPE, world_size=2)


def test_on_a_real_gloo_world(gloo4: Any) -> None:
    model, x, y = _case(Cumulative)
    _check(model, 4, SAMPLE_GRIDS[4][1], x, y, runner=lambda *a: gloo4.run(steps_parallel, *a))


TIMM = importlib.util.find_spec("timm") is not None


class TimmNet(nn.Module):
    """A small CNN of timm's ``BatchNormAct2d`` (its real class, with a SiLU and a drop layer
    slot), as timm's EfficientNet and RegNetY stems and blocks are built."""

    def __init__(self) -> None:
        super().__init__()
        from timm.layers.norm_act import BatchNormAct2d

        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = BatchNormAct2d(4, act_layer=nn.SiLU)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1, stride=2)
        self.bn2 = BatchNormAct2d(6, momentum=None, act_layer=nn.ReLU)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn2(self.conv2(self.bn1(self.conv1(x)))).mean((2, 3)))


@pytest.mark.skipif(not TIMM, reason="needs timm")
@pytest.mark.parametrize("world,config", SAMPLE_GRIDS, ids=IDS)
def test_timms_batchnormact2d_equals_one_process(world: int, config: dict) -> None:
    model, x, y = _case(TimmNet, (4, 3, 8, 6))
    _check(model, world, config, x, y)


class _TrackedInstance(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.instance_norm(x, self.mean, self.var, use_input_stats=True)


def test_instance_norm_call_with_running_statistics_is_refused_by_name() -> None:
    with pytest.raises(ops.Unsupported, match="node 'instance_norm'.*: use an nn.InstanceNorm"):
        explain(SampleNet(_TrackedInstance(), 4), SAMPLE_GRIDS[1][1], SHAPE, world_size=2)


class _PlainGroups(nn.GroupNorm):
    """A subclass that keeps torch's forward."""


def test_group_norm_subclass_with_torchs_forward_is_the_distributed_layer() -> None:
    model, x, y = _case(lambda: SampleNet(_PlainGroups(2, 4), 4))
    world, config = SAMPLE_GRIDS[1]
    assert all("DistGroupNorm" in k for k in run_threads(_kinds, world, model, config))
    _check(model, world, config, x, y)


@pytest.mark.parametrize("option", [2, 4], ids=["stationary-x", "stationary-w"])
def test_functional_batch_norm_moves_the_bytes_explain_prices(option: int) -> None:
    """Channels split: each block's statistics (its 2·C moments and the count) are gathered
    over the sample and row splits, and the running statistics over the channel blocks; the
    communicators count what explain prices, rank by rank."""
    from tests.parallel.cases import counted_step

    world, config = SAMPLE_GRIDS[option]
    model = seeded(SampleNet(_BatchNormAct(4), 4).double(), torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (SHAPE[0],), generator=gen)
    plan = explain(model, config, SHAPE, world_size=world)
    for r, got in enumerate(run_threads(counted_step, world, model, config, x, y)):
        assert got["counted"] == tuple(plan.rank_bytes(r).values()), r
