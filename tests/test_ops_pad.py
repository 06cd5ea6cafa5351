"""Padding as models write it, exact against one process in fp64 on thread ranks and once on a
real gloo world: TensorFlow-style "same" padding with a ``ConstantPad2d`` module before an
unpadded convolution (MONAI's EfficientNet stem), ``F.pad`` with widths computed from sizes
(MONAI's MedNeXt, U-Net decoders), each mode, and a crop. A padded dim is made whole first (the
allgather is priced as the conversion it is); an unpadded one keeps its split."""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from distconv import explain
from distconv.testing import run_threads
from tests.parallel.cases import (
    OPTIONS, check_rows, seeded, square_mean_reference, square_mean_step,
)

SHAPE = (5, 4, 6, 6)
CONFIGS = {k: OPTIONS[k] for k in ("sample", "spatial", "stationary-x")}


class Padded(nn.Module):
    """Convolutions around each pad form; the head sees every padded value."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(4, 4, 3, padding=1)
        self.same = nn.ConstantPad2d((0, 1, 0, 1), 0.0)  # "same" for a stride-2 3x3
        self.c2 = nn.Conv2d(4, 4, 3, stride=2)
        self.reflect = nn.ReflectionPad2d(1)
        self.c3 = nn.Conv2d(4, 4, 3)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c1(x)
        # widths from sizes, as decoders match a skip's size
        y = F.pad(y, (1, 8 - y.shape[3] - 1, 0, 8 - y.shape[2]), mode="replicate")
        y = F.pad(y, (0, -1, -1, 0))  # a crop back to 7 x 7
        y = F.pad(y, (1, 0, 0, 1), mode="circular")  # 8 x 8
        y = self.c2(self.same(y))  # 4 x 4
        y = self.c3(self.reflect(y))  # 4 x 4
        return self.head(F.pad(y, (2, 2), value=0.5).mean((2, 3)))  # W only


def _case() -> tuple[nn.Module, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    model = seeded(Padded().double(), gen)
    return model, torch.randn(SHAPE, generator=gen, dtype=torch.float64)


def test_the_reference_pads_as_written() -> None:
    """The widths the forward computes give the sizes its comments state (else the sample
    would not exercise the forms it names)."""
    model, x = _case()
    y = model.c1(x)
    assert F.pad(y, (1, 1, 0, 2), mode="replicate").shape[2:] == (8, 8)
    assert model(x).shape == (5, 3)


def test_padding_equals_one_process() -> None:
    model, x = _case()
    ref = square_mean_reference(model, x)
    for name in ("sample", "spatial", "stationary-x"):
        check_rows(ref, run_threads(square_mean_step, 4, model, CONFIGS[name], x))


def test_padding_on_gloo(gloo4) -> None:  # noqa: ANN001
    model, x = _case()
    ref = square_mean_reference(model, x)
    check_rows(ref, gloo4.run(square_mean_step, model, CONFIGS["spatial"], x))


class _PadW(nn.Module):
    """A pad in H and W and one in W only, between 1x1 convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)
        self.pad = nn.ZeroPad2d(1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.pad(self.c1(x), (1, 2))
        return self.head(self.c2(self.pad(y)).mean((2, 3)))


def test_explain_prices_the_gather_of_a_split_padded_dim_and_nothing_else() -> None:
    """Under N:2 x H:2 on (5, 4, 6, 6) a rank holds 3 (or 2) samples' 3 rows of 4 x 9
    (after the W pad): gathering H it receives the other 3 rows, 3 * 4 * 3 * 9 elements of 8
    bytes at most. The W-only pad keeps H split and moves nothing; under sample parallelism
    nothing moves at all."""
    model = _PadW().double()
    plan = explain(model, CONFIGS["spatial"], SHAPE, world_size=4, itemsize=8)
    # the report names the F.pad node and the module after the same "pad", in graph order
    w_only, both = [lay for lay in plan.layers if lay.name == "pad"]
    assert not w_only.steps
    forward = [s for s in both.steps if s.phase == "forward"]
    assert len(forward) == 1 and max(forward[0].bytes.values()) == 3 * 4 * 3 * 9 * 8
    plan = explain(model, CONFIGS["sample"], SHAPE, world_size=4, itemsize=8)
    assert [lay.steps for lay in plan.layers if lay.name == "pad"] == [[], []]
