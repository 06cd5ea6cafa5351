"""LayerNorm over trailing dims, split ones among them, normalised in place (DistLayerNorm):
the statistics of each row reduced over the grid dims that split the normalised dims."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distconv.nn.groupnorm import DistLayerNorm
from distconv.parallel import parallelize
from distconv.parallel.explain import explain
from distconv.testing import run_threads
from tests.parallel.cases import TOL, counted_step


class _Net(nn.Module):
    def __init__(self, norm: nn.LayerNorm) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = norm
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.conv(x))).mean((2, 3)))


CONFIGS = {
    "H": {"default": {"grid": {"N": 1, "H": 2}, "algorithm": "spatial"},
          "data": {"N": 1, "H": 2}},
    "CxW": {"default": {"grid": {"C": 2, "W": 2}, "algorithm": "stationary-x"}},
}


def _run(comm, model: nn.Module, config: dict, x: torch.Tensor, y: torch.Tensor,  # noqa: ANN001
         explained: list) -> dict:
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    got = counted_step(comm, model, config, x, y)
    kinds = [type(m).__name__ for m in parallelize(copy.deepcopy(model), config,
                                                   comm=comm).modules()]
    return {"grads": max((got["grads"][k] - p.grad).abs().max().item()
                         for k, p in ref.named_parameters()),
            "counted": got["counted"], "explained": explained[comm.rank], "kinds": kinds}


@pytest.mark.parametrize("shape", [(7, 6), (6,)], ids=["HW", "W"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_layernorm_over_trailing_split_dims_is_in_place_and_one_process(name, shape) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = _Net(nn.LayerNorm(shape)).double()
    with torch.no_grad():  # weights that are not all ones
        model.norm.weight.normal_()
        model.norm.bias.normal_()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((3, 3, 7, 6), generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (3,), generator=gen)
    config = CONFIGS[name]
    plan = explain(model, config, tuple(x.shape), world_size=4 if name == "CxW" else 2)
    explained = [tuple(plan.rank_bytes(r).values()) for r in range(plan.world_size)]
    for r in run_threads(_run, plan.world_size, model, config, x, y, explained):
        assert r["grads"] < TOL, r
        assert tuple(r["counted"]) == tuple(r["explained"]), r
        split_normalised = name == "H" and shape == (7, 6) or name == "CxW"
        assert ("DistLayerNorm" in r["kinds"]) == split_normalised, r["kinds"]


def test_a_layernorm_as_long_as_the_activation_is_refused() -> None:
    from distconv.distribution import Dist
    from distconv.grid import ProcessorGrid

    def build(comm):  # noqa: ANN001, ANN202
        with pytest.raises(ValueError, match="input_dist must have"):
            DistLayerNorm((3, 4, 5, 6), grid=ProcessorGrid({"H": 2}, comm=comm),
                          input_dist=Dist((None, None, "H", None)))
    run_threads(build, 2)


class _Norm2d(nn.Module):
    """A channels-last ``F.layer_norm`` over C between two permutes (timm's ``LayerNorm2d``),
    its weight positional and its bias by keyword."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.channels = channels
        self.weight = nn.Parameter(torch.randn(channels, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(channels, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.layer_norm(x.permute(0, 2, 3, 1), (self.channels,), self.weight, bias=self.bias,
                         eps=1e-6)
        return x.permute(0, 3, 1, 2)


class _ChannelsLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = _Norm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.conv(x))).mean((2, 3)))


@pytest.mark.parametrize("config, recomputed", [
    (CONFIGS["CxW"], []),
    ({"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"},
      "layers": [{"match": "norm", "checkpoint": True}]},
     ["recompute: statistics allgather over C"])], ids=["CxW", "NxC-checkpointed"])
def test_functional_layer_norm_over_split_channels_is_in_place_and_one_process(
        config, recomputed) -> None:
    """The channels stay split (``[o,*,*,o_C]``): the only collectives of the call are the
    statistics' allgather and their backward allreduce over C (weight and bias are sliced to
    ``w[o_C]``, moving nothing; checkpointed, the allgather again in backward), and the counters
    equal them."""
    torch.manual_seed(0)
    model = _ChannelsLast().double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((3, 3, 7, 6), generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (3,), generator=gen)
    plan = explain(model, config, tuple(x.shape), world_size=4)
    norm = next(lay for lay in plan.layers if lay.name.endswith("layer_norm"))
    assert sorted(s.what for s in norm.steps if any(s.bytes.values())) == sorted([
        "statistics allgather over C", *recomputed, "Σdx̂, Σdx̂·x̂ allreduce over C"])
    free = {re.search(r"redistribute (\w+):", s.what).group(1) for s in norm.steps
            if not any(s.bytes.values())}
    assert free == {"norm_weight", "norm_bias"}, free
    explained = [tuple(plan.rank_bytes(r).values()) for r in range(4)]
    for r in run_threads(_run, 4, model, config, x, y, explained):
        assert r["grads"] < TOL, r
        assert tuple(r["counted"]) == tuple(r["explained"]), r


@pytest.mark.gloo
def test_functional_layer_norm_over_split_channels_on_gloo(gloo4) -> None:
    torch.manual_seed(0)
    model = _ChannelsLast().double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((3, 3, 7, 6), generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (3,), generator=gen)
    config = {"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"}}
    plan = explain(model, config, tuple(x.shape), world_size=4)
    explained = [tuple(plan.rank_bytes(r).values()) for r in range(4)]
    for r in gloo4.run(_run, model, config, x, y, explained):
        assert r["grads"] < TOL, r
        assert tuple(r["counted"]) == tuple(r["explained"]), r
