"""Blind spots of the op handlers' prices: what explain reports for a layer, against bytes counted
by hand from the layer's geometry."""

from __future__ import annotations

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
