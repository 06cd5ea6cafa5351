"""Dropout on values split over model-parallel grid dims draws one process's masks: the global
mask from a generator every rank shares, each rank keeping its block. Exact against one process
whose generator is in the same state (both seeded alike, no other draws in between)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from distconv.data import sample_block
from distconv.nn import DistDropout
from distconv.parallel import parallelize
from distconv.testing import run_threads
from tests.parallel.cases import TOL, _gathered_grads

SEED = 7
SHAPE = (4, 4, 6, 6)
CONFIGS = {
    "stationary-x": {"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"}},
    "stationary-y": {"default": {"grid": {"N": 2, "F": 2}, "algorithm": "stationary-y"}},
    "stationary-w": {"default": {"grid": {"N": 4}, "algorithm": "sample"}, "layers": [
        {"match": "c*", "grid": {"C": 2, "F": 2}, "algorithm": "stationary-w"}]},
    "spatial": {"default": {"grid": {"N": 2, "H": 2}, "algorithm": "spatial"},
                "data": {"N": 2, "H": 2}},
}


class Net(nn.Module):
    def __init__(self, dropout: nn.Module) -> None:
        super().__init__()
        self.c1, self.drop = nn.Conv2d(4, 6, 3, padding=1), dropout
        self.c2, self.head = nn.Conv2d(6, 4, 1), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.c2(self.drop(torch.relu(self.c1(x)))).mean((2, 3)))


def _reference(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    model = copy.deepcopy(model)
    torch.manual_seed(SEED)  # the dropout's draw is the first after this
    out = model(x)
    out.square().mean().backward()
    return {"out": out.detach(), "grads": {k: p.grad for k, p in model.named_parameters()}}


def _step(comm: Any, model: nn.Module, config: Any, x: torch.Tensor) -> dict[str, Any]:
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    out = pmodel(x[rows])
    out.square().mean().backward()
    kinds = {type(m).__name__ for m in pmodel.modules()}
    # the layer keeps its torch class for the idioms (isinstance(m, nn.Dropout2d): m.eval())
    drops = [m for m in pmodel.modules() if type(m).__name__.startswith("DistDropout")]
    assert all(isinstance(m, type(model.drop)) for m in drops)
    return {"rows": rows, "out": out.detach(), "grads": _gathered_grads(pmodel), "kinds": kinds}


@pytest.mark.parametrize("dropout", [nn.Dropout(0.4), nn.Dropout2d(0.4)],
                         ids=["elements", "channels"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_split_dropout_equals_one_process(dropout: nn.Module, name: str) -> None:
    gen = torch.Generator().manual_seed(2)
    model = Net(dropout).double()
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    ref = _reference(model, x)
    torch.manual_seed(SEED)  # thread ranks share it: rank 0's seed is every rank's
    kind = "DistDropout2d" if isinstance(dropout, nn.Dropout2d) else "DistDropout"
    for got in run_threads(_step, 4, model, CONFIGS[name], x):
        assert kind in got["kinds"]
        assert (got["out"] - ref["out"][got["rows"]]).abs().max() < TOL
        for k, g in ref["grads"].items():
            assert (got["grads"][k] - g).abs().max() < TOL, k


class Volume(nn.Module):
    """A Conv3d or Conv1d, channel dropout, a convolution and a head."""

    def __init__(self, dims: int, dropout: nn.Module) -> None:
        super().__init__()
        conv = {1: nn.Conv1d, 3: nn.Conv3d}[dims]
        self.c1, self.drop, self.c2 = conv(2, 4, 3, padding=1), dropout, conv(4, 4, 1)
        self.head = nn.Linear(4, 3)
        self.dims = tuple(range(2, 2 + dims))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.c2(self.drop(torch.relu(self.c1(x)))).mean(self.dims))


@pytest.mark.parametrize("dims, dropout, config", [
    (3, nn.Dropout3d(0.4), {"default": {"grid": {"D": 2, "H": 2}, "algorithm": "spatial"},
                            "data": {"N": 1, "D": 2, "H": 2}}),
    (3, nn.Dropout3d(0.4), {"default": {"grid": {"N": 4}, "algorithm": "sample"}, "layers": [
        {"match": "c*", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"}]}),
    (1, nn.Dropout1d(0.4), {"default": {"grid": {"N": 2, "W": 2}, "algorithm": "spatial"},
                            "data": {"N": 2, "W": 2}}),
    (3, nn.Dropout(0.4), {"default": {"grid": {"N": 2, "D": 2}, "algorithm": "spatial"},
                          "data": {"N": 2, "D": 2}}),
], ids=["Dropout3d-DxH", "Dropout3d-C", "Dropout1d-W", "Dropout-D"])
def test_split_dropout_of_volumes_and_signals_equals_one_process(dims: int, dropout: nn.Module,
                                                                 config: dict) -> None:
    gen = torch.Generator().manual_seed(3)
    model = Volume(dims, dropout).double()
    x = torch.randn((4, 2, 4, 5, 3) if dims == 3 else (4, 2, 9), generator=gen,
                    dtype=torch.float64)
    ref = _reference(model, x)
    torch.manual_seed(SEED)
    for got in run_threads(_step, 4, model, config, x):
        assert f"Dist{type(dropout).__name__}" in got["kinds"], got["kinds"]
        assert (got["out"] - ref["out"][got["rows"]]).abs().max() < TOL
        for k, g in ref["grads"].items():
            assert (got["grads"][k] - g).abs().max() < TOL, k


def test_masks_really_drop_and_eval_is_identity() -> None:
    """A mask of the global tensor, blocks kept: the zeros of each rank's block are where one
    process's mask has them; in eval mode nothing changes."""
    from distconv.comm import SingleCommunicator
    from distconv.distribution import Dist
    from distconv.grid import ProcessorGrid

    torch.manual_seed(SEED)
    x = torch.ones(2, 4, 3, 3, dtype=torch.float64)
    want = nn.functional.dropout(x, 0.5)  # one process, generator seeded alike
    torch.manual_seed(SEED)
    layer = DistDropout(0.5, grid=ProcessorGrid({"N": 1}, comm=SingleCommunicator()),
                        input_dist=Dist((None,) * 4))
    got = layer(x, x.shape)
    assert torch.equal(got, want) and 0 < int((got == 0).sum()) < x.numel()
    assert torch.equal(layer.eval()(x, x.shape), x)


def test_sample_parallel_dropout_keeps_ddp_masks() -> None:
    """Split over samples only: each rank's own mask from torch's generator, as DDP does (no
    global draw)."""
    model = Net(nn.Dropout(0.4)).double()
    x = torch.randn(SHAPE, dtype=torch.float64)
    for got in run_threads(_step, 2, model, {"default": {"grid": {"N": 2}}}, x):
        assert "DistDropout" not in got["kinds"] and "Dropout" in got["kinds"]


def test_split_dropout_on_gloo(gloo4) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(2)
    model = Net(nn.Dropout(0.4)).double()
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    ref = _reference(model, x)
    for got in gloo4.run(_seeded_step, model, CONFIGS["stationary-x"], x):
        assert (got["out"] - ref["out"][got["rows"]]).abs().max() < TOL
        for k, g in ref["grads"].items():
            assert (got["grads"][k] - g).abs().max() < TOL, k


def _seeded_step(comm: Any, model: nn.Module, config: Any, x: torch.Tensor) -> dict[str, Any]:
    torch.manual_seed(SEED + comm.rank)  # ranks seeded differently: rank 0's seed is shared
    return _step(comm, model, config, x)
