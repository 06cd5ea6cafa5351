"""Pieces and stacks: ``chunk``/``split``/``tensor_split`` taken apart by their items, and
``torch.stack``, equal one process under every option -- torchvision's ShuffleNetV2 block (its
channel split and shuffle), a decoder that merges a stack by its sum -- on thread ranks and on a
gloo world; what cannot run is refused by name."""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import pytest
import torch
from torch import nn

from distconv import ops
from distconv.ops.base import SAMPLE_GRIDS, SampleNet
from distconv.parallel.explain import explain
from distconv.testing import run_threads
from tests.parallel.cases import TOL, seeded, square_mean_reference, square_mean_step

SHAPE = (5, 4, 7, 6)
IDS = ["sample", "spatial", "stationary-x", "stationary-y", "stationary-w"]


def _case(make: Any, shape: tuple[int, ...] = SHAPE, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    model = seeded(make().double(), gen)
    return model, torch.randn(shape, generator=gen, dtype=torch.float64)


def _check(model: nn.Module, config: dict, x: torch.Tensor, results: list[dict]) -> None:
    ref = square_mean_reference(model, x)
    for got in results:
        assert (got["out"] - ref["out"][got["rows"]]).abs().max() < TOL
        for k, g in ref["grads"].items():
            assert (got["grads"][k] - g).abs().max() < TOL, k


class Pieces(nn.Module):
    """Every form: the three methods and three functions, by count, sizes and indices, along
    the channels, rows and columns (negative dim), their items used out of order."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, padding=1)
        self.branch = nn.Conv2d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        a, b = torch.chunk(y, 2, dim=1)
        c, d, e = y.split([1, 3, 2], 1)
        f = torch.tensor_split(y, 3, dim=1)[2]
        g = y.tensor_split((1, 4), dim=1)[1]
        z = torch.cat((self.branch(b) * a, c + e.sum(1, keepdim=True),
                       d * g + f.amax(1, keepdim=True)), dim=1)
        rows = torch.split(z, 3, dim=2)  # 3, 3, 1 rows
        cols = z.chunk(4, dim=-1)  # 2, 2, 2 columns
        return (rows[2] + rows[0].mean(2, keepdim=True)) * cols[1].sum(3, keepdim=True)


@pytest.mark.parametrize("world,config", SAMPLE_GRIDS, ids=IDS)
def test_every_form_of_pieces_equals_one_process(world: int, config: dict) -> None:
    model, x = _case(lambda: SampleNet(Pieces(), 4, 7))
    _check(model, config, x, run_threads(square_mean_step, world, model, config, x))


class Merge(nn.Module):
    """segmentation-models-pytorch's FPN merge: pyramid levels brought to one size and stacked,
    ``torch.stack(levels).sum(dim=0)``; then a stack behind the channels and a maximum."""

    def __init__(self) -> None:
        super().__init__()
        self.p1 = nn.Conv2d(4, 4, 3, padding=1)
        self.p2 = nn.Conv2d(4, 4, 3, padding=1, stride=2)
        self.p3 = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        levels = [self.p1(x), nn.functional.interpolate(self.p2(x), size=x.shape[2:]), x]
        y = torch.stack(levels).sum(dim=0)
        return torch.stack([y, self.p3(y)], dim=-1).amax(-1)


@pytest.mark.parametrize("world,config", SAMPLE_GRIDS, ids=IDS)
def test_stack_merge_equals_one_process(world: int, config: dict) -> None:
    model, x = _case(lambda: SampleNet(Merge(), 4), (5, 4, 8, 6))
    _check(model, config, x, run_threads(square_mean_step, world, model, config, x))


VISION = importlib.util.find_spec("torchvision") is not None


def _shufflenet_blocks() -> nn.Module:
    from torchvision.models.shufflenetv2 import InvertedResidual

    return nn.Sequential(nn.Conv2d(4, 8, 1), InvertedResidual(8, 8, 1),
                         InvertedResidual(8, 16, 2))


@pytest.mark.skipif(not VISION, reason="needs torchvision")
@pytest.mark.parametrize("world,config", SAMPLE_GRIDS, ids=IDS)
def test_torchvisions_shufflenetv2_blocks_equal_one_process(world: int, config: dict) -> None:
    """Its stride-1 block's ``x.chunk(2, dim=1)`` and both blocks' channel shuffle."""
    model, x = _case(lambda: SampleNet(_shufflenet_blocks(), 4, 16), (4, 4, 8, 8))
    _check(model, config, x, run_threads(square_mean_step, world, model, config, x))


class _Whole(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(x.chunk(2, dim=1)[::-1], dim=1)


class _Batch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.split(2)
        return a.mean() + b


class _StackWhole(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(x.tensor_split(2, dim=2)[:1]).sum(0)


@pytest.mark.parametrize("layer,words", [
    (_Whole, "take the items of chunk's tuple"),
    (_Batch, "cut another dim, or cut the batch in the plain model's input: split along the "
             "samples (dim 0) cuts the batch"),
    (_StackWhole, "take the items of tensor_split's tuple"),
], ids=["tuple-whole", "samples", "stack-of-tuple"])
def test_what_cannot_run_is_refused_by_name(layer: Any, words: str) -> None:
    with pytest.raises(ops.Unsupported) as exc:
        explain(SampleNet(layer(), 4), SAMPLE_GRIDS[2][1], SHAPE, world_size=4)
    assert str(exc.value).split(": ", 2)[2].startswith(words), str(exc.value)


def test_pieces_and_stack_on_a_real_gloo_world(gloo4: Any) -> None:
    model, x = _case(lambda: SampleNet(nn.Sequential(Pieces(), nn.Conv2d(7, 4, 1), Merge()), 4))
    config = SAMPLE_GRIDS[2][1]
    _check(model, config, x, gloo4.run(square_mean_step, model, config, x))
