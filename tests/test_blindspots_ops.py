"""Blind spots of the op handlers' prices: what explain reports for a layer, against bytes counted
by hand from the layer's geometry."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distconv.parallel.explain import explain


class _PoolNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.pool = nn.MaxPool2d(3, stride=1, padding=1)
        self.head = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.conv(x)).mean((2, 3)))


def test_pool_halo_over_h_and_w_is_priced_with_its_corners() -> None:
    # x (4, 2, 4, 4) on {H: 2, W: 2}: each rank holds 4·2·2·2 values. A 3x3 window at stride 1
    # reads one row beyond its block: the H exchange brings 1 row of 2 columns (4·2·1·2 = 16
    # values), then the W exchange 1 column of the 3 rows it now holds (4·2·3·1 = 24 values),
    # corners included; backward sends the same back. float64: 8 bytes each.
    e = explain(_PoolNet().double(), {"default": {"grid": {"H": 2, "W": 2},
                                                  "algorithm": "spatial"}},
                (4, 2, 4, 4), world_size=4)
    (pool,) = [layer for layer in e.layers if layer.name == "pool"]
    for rank in range(4):
        assert pool.bytes("forward", rank) == (16 + 24) * 8
        assert pool.bytes("backward", rank) == (16 + 24) * 8


def test_a_cross_grid_move_reads_each_block_from_the_replica_on_the_same_rank() -> None:
    from distconv.distribution import Dist
    from distconv.planner import ACT, Value, sample_choice, transition_bytes

    # [o_N,*,*,*] on {N: 2, C: 2} (a channel concatenation's output): rank 2n + c holds sample
    # block n = samples 2n, 2n + 1, so every rank of [o_N,*,*,*] on {N: 4} (rank r: sample r)
    # already holds its sample: reading block n from replica r % 2 moves nothing
    src = Value((("N", 2), ("C", 2)), Dist(("N", None, None, None), frozenset(), ACT))
    for rank in range(4):
        assert transition_bytes(src, sample_choice(4), (4, 3, 5, 5), rank) == 0


def test_a_conv_that_gathers_its_input_keeps_the_gathered_block_for_backward() -> None:
    # conv 6 -> 6, 3x3, padding 1, on x (4, 6, 5, 5). Stationary-y on {F: 2} takes x with its
    # channels split (3 per rank) and allgathers them: the local convolution reads all 6
    # channels, and autograd keeps that gathered block (4·6·5·5 = 600 values) for the weight
    # gradient, beside the output block (filters split: 4·3·5·5 = 300). Stationary-x on {C: 2}
    # convolves its channel block as it arrives (kept: the output block only, 300). The planner
    # counts the same blocks.
    from distconv.planner import Choice, ConvNode, _memory, _problem

    conv = nn.Conv2d(6, 6, 3, padding=1)
    model = nn.Sequential(conv)
    for algorithm, dim, want in (("stationary-y", "F", 900), ("stationary-x", "C", 300)):
        e = explain(model, {"default": {"grid": {dim: 2}, "algorithm": algorithm}},
                    (4, 6, 5, 5), world_size=2)
        (layer,) = [lay for lay in e.layers if lay.kind == "conv"]
        assert layer.activation_elements == want, algorithm
        node = ConvNode("0", _problem(conv, (4, 6, 5, 5)), (4, 6, 5, 5))
        params = 6 * 3 * 9 + 3  # the weight's rows (filters) or columns (channels) halved
        got = _memory(node, Choice(((dim, 2),), algorithm), 1, 0, 1)
        assert got == 2 * params + want, algorithm


class _VolumeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1)
        self.up = nn.ConvTranspose3d(4, 3, 2, stride=2)
        self.head = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.up(self.conv(x)).mean((2, 3, 4)))


def test_sample_parallel_layers_are_priced_by_their_flops() -> None:
    # x (4, 2, 5, 5, 5) over {N: 2}: 2 samples per rank. Conv3d 2 -> 4, 3x3x3 (216 weights)
    # meets each of its 2·125 output positions: 2·250·216 FLOPs. ConvTranspose3d 4 -> 3, 2x2x2
    # (96 weights) scatters each of its 2·125 input positions: 2·250·96. Linear 3 -> 3 (9
    # weights) on 2 rows: 2·2·9. At 1e9 FLOP/s; backward twice the forward.
    from distconv.perfmodel import Machine

    machine = Machine(alpha=1e-5, beta=1e-9, flop_rate=1e9)
    e = explain(_VolumeNet(), {"default": {"grid": {"N": 2}, "algorithm": "sample"}},
                (4, 2, 5, 5, 5), world_size=2, machine=machine)
    got = {lay.name: (lay.forward_seconds, lay.backward_seconds) for lay in e.layers
           if lay.name in ("conv", "up", "head")}
    for name, flops in (("conv", 2 * 250 * 216), ("up", 2 * 250 * 96), ("head", 2 * 2 * 9)):
        assert got[name][0] == pytest.approx(flops / 1e9, rel=1e-12), name
        assert got[name][1] == pytest.approx(2 * flops / 1e9, rel=1e-12), name
