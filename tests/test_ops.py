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
        self.norm = torch.nn.LocalResponseNorm(2)
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
    assert "LocalResponseNorm is not supported" in reasons["norm"]
    assert "PixelShuffle is not supported" in reasons["up"] and "GroupNorm" in reasons["up"]
    assert "unsupported: 2 node(s)" in str(plan)
    assert [u["node"] for u in plan.to_dict()["unsupported"]] == ["norm", "up"]


def _tracked_steps(comm, model: torch.nn.Module, config: dict, xs: list) -> dict:  # noqa: ANN001
    from distconv.data import sample_block
    from distconv.parallel import parallelize

    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    for x in xs:  # two training steps: the running statistics move twice
        rows = sample_block(x.shape[0], pmodel.data_grid)
        pmodel(x[rows]).sum().backward()
    pmodel.eval()
    rows = sample_block(xs[0].shape[0], pmodel.data_grid)
    return {"state": pmodel.gather_state_dict(), "rows": rows,
            "eval": pmodel(xs[0][rows]).detach()}


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("world, grid", [(2, {"N": 2}), (4, {"N": 2, "H": 2})])
def test_tracked_instance_norm_over_split_samples_keeps_one_process_s_statistics(
        world, grid, momentum) -> None:  # noqa: ANN001
    """Running statistics of an instance norm average its instances over the global batch: with
    the samples split (and the rows), each step's means over the sample blocks (uneven: 5
    samples on 2 blocks) move the running statistics as one process's do, and eval mode then
    normalises with them as one process does."""
    from distconv.ops.base import SampleNet

    torch.manual_seed(0)
    model = SampleNet(torch.nn.InstanceNorm2d(4, affine=True, track_running_stats=True,
                                              momentum=momentum), 4).double()
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn((5, 4, 8, 6), generator=gen, dtype=torch.float64) * 3 + 1
          for _ in range(2)]
    ref = copy.deepcopy(model)
    for x in xs:
        ref(x).sum().backward()
    ref.eval()
    want = ref(xs[0]).detach()
    config = {"default": {"grid": grid, "algorithm": "spatial" if "H" in grid else "sample"},
              "data": grid}
    for got in run_threads(_tracked_steps, world, model, config, xs):
        for k in ("layer.running_mean", "layer.running_var", "layer.num_batches_tracked"):
            assert torch.allclose(got["state"][k].double(), ref.state_dict()[k].double(),
                                  rtol=0, atol=TOL), k
        moved = not torch.equal(ref.state_dict()["layer.running_var"],
                                torch.ones(4, dtype=torch.float64))
        assert moved == (momentum is not None)  # torch's: momentum None blends nothing
        torch.testing.assert_close(got["eval"], want[got["rows"]], rtol=TOL, atol=TOL)

class _Picks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)[:, [1, 2]].mean((1, 2, 3))


def test_indexing_that_picks_elements_is_refused_naming_the_node() -> None:
    """Only integers, slices and new size-1 dims (None with slices and '...') index a value; a
    list that picks channels is refused before anything runs, naming the node and what would
    work."""
    with pytest.raises(ops.Unsupported, match=r"node 'getitem'.*picks elements.*None"):
        explain(_Picks(), {"default": {"grid": {"N": 2}}}, (4, 3, 5, 5), world_size=2)


def test_explain_refuses_more_conv2d_channel_blocks_than_channels_as_parallelize_does() -> None:
    """DistConv2d refuses C×F blocks beyond its channels; explain (and so the planner's final
    pricing) refuses the same entry, naming the layer, instead of pricing what cannot run."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU())
    config = {"layers": [{"match": "0", "grid": {"C": 4}, "algorithm": "stationary-x"}]}
    with pytest.raises(ValueError, match=r"layer '0': in_channels=3 is smaller than the 4 "
                                         r"channel/filter blocks"):
        explain(model, config, (4, 3, 8, 8), world_size=4)
