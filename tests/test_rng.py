"""distconv.testing.rank_generator: per-rank generators that do not share torch's global one."""

from __future__ import annotations

import threading

import pytest
import torch

from distconv.comm import SingleCommunicator
from distconv.testing import rank_generator, run_threads

_start = threading.Barrier(4)


def _draw(comm, seed, distinct):
    g = rank_generator(comm, seed, distinct=distinct)
    _start.wait()  # every rank draws at the same time, as in a training step
    return torch.cat([torch.randn(64, generator=g) for _ in range(50)])


def _reference(seed):
    torch.manual_seed(seed)
    return torch.cat([torch.randn(64) for _ in range(50)])


def test_same_seed_gives_every_thread_rank_the_same_stream():
    got = run_threads(_draw, 4, 7, False)
    want = _reference(7)
    for g in got:
        assert torch.equal(g, want)


def test_distinct_streams_differ_per_rank_and_repeat_per_run():
    first = run_threads(_draw, 4, 7, True)
    again = run_threads(_draw, 4, 7, True)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    for i in range(4):
        for j in range(i):
            assert not torch.equal(first[i], first[j])
    assert not any(torch.equal(f, _reference(7)) for f in first)


def test_rank_generator_leaves_the_global_generator_alone():
    torch.manual_seed(3)
    want = torch.randn(5)
    torch.manual_seed(3)
    torch.randn(5, generator=rank_generator(SingleCommunicator(), 11))
    assert torch.equal(torch.randn(5), want)


@pytest.mark.parametrize("args, exc", [
    ((1.5,), TypeError), ((-1,), ValueError), ((2**64,), ValueError), ((True,), TypeError),
])
def test_rank_generator_rejects_bad_seeds(args, exc):
    with pytest.raises(exc, match="seed"):
        rank_generator(SingleCommunicator(), *args)


def test_rank_generator_rejects_a_non_communicator():
    with pytest.raises(TypeError, match="comm"):
        rank_generator("world", 0)
