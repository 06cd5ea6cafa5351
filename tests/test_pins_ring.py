"""The shared-memory ring never writes a slot a peer has not read: a rank that runs ahead of a
slow peer by more operations than the ring has slots waits for it, and every result is the
reduction of that operation's payloads."""

from __future__ import annotations

import threading

import torch

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
