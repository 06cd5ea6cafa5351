"""The shared-memory ring never writes a slot a peer has not read: a rank that runs ahead of a
slow peer by more operations than the ring has slots waits for it, and every result is the
reduction of that operation's payloads. Without the ring, gloo's reduce-scatter (an all-to-all
and a local sum) still sums in rank order."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from tests.comm.programs import split_without_host_channel
from tests.comm.test_host_channel import _on_threads


def test_a_rank_ahead_by_more_than_the_slots_waits_for_its_peer() -> None:
    issued = threading.Event()

    def rank(ch):  # noqa: ANN001, ANN202
        if ch.rank == 1:
            # rank 0 issues what the ring lets it before rank 1 takes part: both slots, then it
            # must wait (the event is set only by a rank 0 that never waited)
            issued.wait(0.2)
        works = [ch.allreduce(torch.full((3,), 10.0 * k + ch.rank + 1), "sum") for k in range(4)]
        if ch.rank == 0:
            issued.set()
        return [w.wait() for w in works]

    for got in _on_threads(2, rank, slots=2):
        assert [g.tolist() for g in got] == [[20.0 * k + 3] * 3 for k in range(4)]


#: one value per rank whose sum depends on the order: in rank order ((1e16 + 1) - 1e16) + 1 = 1,
#: in reverse ((1 - 1e16) + 1) + 1e16 = 0 (float64 keeps no 1 next to 1e16)
ORDERED = (1e16, 1.0, -1e16, 1.0)


def reduce_scatter_without_the_ring(comm: Any) -> torch.Tensor:
    c = split_without_host_channel(comm)
    value = ORDERED[c.rank]
    return c.reduce_scatter([torch.full((2,), value, dtype=torch.float64)] * c.size)


@pytest.mark.gloo
def test_gloo_reduce_scatter_without_the_ring_sums_in_rank_order(gloo4) -> None:  # noqa: ANN001
    for got in gloo4.run(reduce_scatter_without_the_ring):
        assert got.tolist() == [1.0, 1.0]
