"""Module-level memos that thread ranks share: safe past their bound from several ranks at once.

Thread ranks (:mod:`distconv.comm.threads`) share one process's modules, so a memo of a pure
function of layouts (a checkpoint's write plan, a block's local shape, K-FAC's triangle indices)
is read and evicted by every rank at once. The switch interval is cut to a microsecond so the
ranks interleave inside the memo's code, as they do now and then on a loaded machine.
"""
from __future__ import annotations

import sys
import time

import pytest
import torch

from distconv.checkpoint import _save
from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.memo import BoundedMemo
from distconv.nn.sharding import ShardSpec
from distconv.testing import run_threads

RANKS, ROUNDS = 4, 24


class _SlowToIterate(dict):
    """A memo's store whose iteration pauses after reading its first key: a rank evicting the
    oldest entry is held between reading that key and deleting it, while the other ranks run
    (the window a loaded machine opens now and then, held open)."""

    def __iter__(self):  # noqa: ANN204
        for key in list(super().__iter__()):
            time.sleep(0.002)
            yield key


@pytest.fixture
def interleaved():
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _items(i: int) -> dict:
    """A state of one whole tensor whose shape names the round: a layout no other round has."""
    t = torch.zeros(i + 1, 3)
    return {f"w{i}": (t, ShardSpec(None, Dist((None, None)), tuple(t.shape)))}


def _plans(comm) -> list:  # noqa: ANN001
    # every rank walks the same rounds: past the bound of 8 each round evicts, all ranks at once
    out = []
    for i in range(ROUNDS):
        comm.barrier()  # the ranks miss the same key together, as a step's saves do
        out.append([(p.key, p.rank) for p in _save._plan(_items(i), comm.size)])
    return out


def test_the_save_planners_memo_is_safe_past_its_bound_from_several_ranks(
        interleaved, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(_save._PLANS, "_items", _SlowToIterate())
    got = run_threads(_plans, RANKS, timeout=120.0)
    want = [[(p.key, p.rank) for p in _save._plan(_items(i), RANKS)] for i in range(ROUNDS)]
    assert all(g == want for g in got)  # every rank's plan is the one process's
    assert len(_save._PLANS) <= 8


def _local_shapes(comm) -> list:  # noqa: ANN001
    from distconv.nn._activation import local_shape

    grid = ProcessorGrid({"N": comm.size}, comm=comm)
    dist = Dist(("N", None))
    return [local_shape(grid, dist, (n, 2)) for n in range(1, 5000, 7)]


def test_the_layers_local_shape_memo_is_safe_past_its_bound_from_several_ranks(
        interleaved) -> None:
    got = run_threads(_local_shapes, RANKS)
    for rank, shapes in enumerate(got):  # balanced blocks, written by hand: n // p + (r < n % p)
        assert shapes == [(n // RANKS + (rank < n % RANKS), 2) for n in range(1, 5000, 7)]


def test_a_bounded_memo_keeps_its_bound_and_evicts_the_oldest_first() -> None:
    memo: BoundedMemo[int] = BoundedMemo(3)
    for k in range(5):
        assert memo.get(k, lambda k=k: k * k) == k * k
    assert len(memo) == 3
    calls = []
    assert memo.get(4, lambda: calls.append(4) or -1) == 16 and not calls  # kept: not remade
    assert memo.get(0, lambda: calls.append(0) or -1) == -1 and calls == [0]  # evicted: remade


@pytest.mark.parametrize("bound", [0, -1, 2.0, True, None])
def test_a_bounded_memo_refuses_a_bound_that_is_not_a_positive_int(bound) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="bound must be a positive int"):
        BoundedMemo(bound)
