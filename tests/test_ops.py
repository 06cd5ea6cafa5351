"""Conformance of every op handler: each sample call, under each option it lists, equals one
process (fp64: output and every gradient) on thread ranks, and the bytes the communicators count
on every rank equal what ``explain`` prices from the same handler. A handler without samples
fails here."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from distconv import ops
from distconv.parallel.explain import explain
from distconv.testing import run_threads
from tests.parallel.cases import TOL, counted_step, seeded

CASES = [(type(h).__name__, sample, world, config)
         for h in ops.REGISTRY for sample in h.samples() for world, config in sample.configs]


def test_every_handler_has_samples() -> None:
    missing = [type(h).__name__ for h in ops.REGISTRY if not h.samples()]
    assert not missing, f"handlers without conformance samples: {missing}"


@pytest.mark.parametrize("handler,sample,world,config", CASES,
                         ids=[f"{c[1].name}-{i}" for i, c in enumerate(CASES)])
def test_sample_equals_one_process_and_its_price(handler: str, sample: ops.Sample, world: int,
                                                 config: dict) -> None:
    gen = torch.Generator().manual_seed(11)
    model = seeded(sample.make().double(), gen)
    x = torch.randn(sample.shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (sample.shape[0],), generator=gen)
    ref = copy.deepcopy(model)
    out = ref(x)
    F.cross_entropy(out, y).backward()
    plan = explain(model, config, sample.shape, world_size=world, itemsize=8)
    _planner_prices_alike(model, config, sample.shape, world)
    for r, got in enumerate(run_threads(counted_step, world, model, config, x, y)):
        assert (got["out"] - out.detach()[got["rows"]]).abs().max() < TOL, (handler, config)
        for k, p in ref.named_parameters():
            assert (got["grads"][k] - p.grad).abs().max() < TOL, (handler, config, k)
        assert got["counted"] == tuple(plan.rank_bytes(r).values()), (handler, config, r)


def _planner_prices_alike(model: torch.nn.Module, config: dict, shape: tuple[int, ...],
                          world: int) -> None:
    """The planner prices the config as ``explain`` does, to the bit; it plans chains of
    convolutions and residual adds only, and refuses another join by name."""
    from distconv.perfmodel import Machine
    from distconv.planner import predict

    machine = Machine(alpha=1e-5, beta=1e-9, flop_rate=1e9)
    try:
        planned = predict(model, config, shape, world_size=world, machine=machine, itemsize=8)
    except NotImplementedError as exc:
        assert "joins several values" in str(exc)
        return
    priced = explain(model, config, shape, world_size=world, itemsize=8, machine=machine)
    assert planned.step_time == priced.seconds() > 0


class _Unsupported(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.InstanceNorm2d(8, track_running_stats=True)
        self.up = torch.nn.PixelShuffle(2)
        self.head = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.up(self.norm(self.conv(x)))
        x = x * x.mean((2, 3), keepdim=True)
        return self.head(x.mean((2, 3)))


def test_explain_lists_every_unsupported_node_at_once() -> None:
    config = {"default": {"grid": {"N": 2, "H": 2}, "algorithm": "spatial"}}
    with pytest.raises(ops.Unsupported, match="node 'norm'"):
        explain(_Unsupported(), config, (2, 3, 8, 8))  # strict: the first, as parallelize
    plan = explain(_Unsupported(), config, (2, 3, 8, 8), strict=False)
    assert [n for n, _, _ in plan.unsupported] == ["norm", "up"]
    reasons = dict((n, r) for n, _, r in plan.unsupported)
    assert "averages them over the samples" in reasons["norm"] and "over N" in reasons["norm"]
    assert "PixelShuffle is not supported" in reasons["up"] and "GroupNorm" in reasons["up"]
    assert "unsupported: 2 node(s)" in str(plan)
    assert [u["node"] for u in plan.to_dict()["unsupported"]] == ["norm", "up"]


def test_tracked_instance_norm_over_split_samples_is_refused_naming_the_node() -> None:
    from distconv.ops.base import SAMPLE_GRIDS, SampleNet

    world, config = SAMPLE_GRIDS[0]  # samples split over N
    norm = torch.nn.InstanceNorm2d(4, track_running_stats=True)
    with pytest.raises(ops.Unsupported, match=r"node 'layer'") as info:
        explain(SampleNet(norm, 4), config, (5, 4, 7, 6), world_size=world)
    assert "averages them over the samples" in str(info.value)

class _Picks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)[:, 1:3].mean((1, 2, 3))


def test_indexing_that_picks_elements_is_refused_naming_the_node() -> None:
    """Only size-1 dims may be added by indexing (None with ':' and '...'); a slice that picks
    channels is refused before anything runs, naming the node and what would work."""
    with pytest.raises(ops.Unsupported, match=r"node 'getitem'.*picks elements.*None"):
        explain(_Picks(), {"default": {"grid": {"N": 2}}}, (4, 3, 5, 5), world_size=2)
