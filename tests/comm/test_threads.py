"""Every operation on the in-process backend, sizes 1-8 and uneven shapes, against a reference;
the byte and call counters against the convention."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distconv.comm.base import allreduce_bytes
from distconv.testing import run_threads
from tests.comm import programs
from tests.comm.programs import REDUCE, data

SIZES = st.integers(1, 8)
SHAPES = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)
DTYPES = st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bfloat16])
SEEDS = st.integers(0, 99)
SETTINGS = settings(max_examples=25, deadline=None)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _assert_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), (got, want)


@SETTINGS
@given(size=SIZES, shape=SHAPES, dtype=DTYPES, op=st.sampled_from(sorted(REDUCE)), seed=SEEDS)
def test_allreduce_matches_reference(size, shape, dtype, op, seed):
    def fn(comm):
        x = data(shape, comm.rank, 0, dtype, seed)
        return comm.allreduce(x, op=op), comm.stats.snapshot()

    want = REDUCE[op]([data(shape, s, 0, dtype, seed) for s in range(size)])
    n = math.prod(shape)
    for r, (got, snap) in enumerate(run_threads(fn, size)):
        _assert_equal(got, want)
        assert snap["calls"] == {"allreduce": 1}
        assert snap["bytes"]["allreduce"] == allreduce_bytes(n, r, size, _itemsize(dtype))


@SETTINGS
@given(size=SIZES, shapes=st.data(), dtype=DTYPES)
def test_allgather_uneven_matches_reference(size, shapes, dtype):
    shapes = [shapes.draw(SHAPES) for _ in range(size)]

    def fn(comm):
        return comm.allgather(
            data(shapes[comm.rank], comm.rank, 1, dtype), shapes=shapes
        ), comm.stats.snapshot()

    isz = _itemsize(dtype)
    for r, (got, snap) in enumerate(run_threads(fn, size)):
        assert len(got) == size
        for s in range(size):
            _assert_equal(got[s], data(shapes[s], s, 1, dtype))
        want_bytes = sum(math.prod(shapes[s]) for s in range(size) if s != r) * isz
        assert snap["bytes"]["allgather"] == want_bytes
        assert snap["calls"]["allgather"] == 1


@SETTINGS
@given(size=SIZES, shapes=st.data(), dtype=DTYPES, op=st.sampled_from(["sum", "max"]))
def test_reduce_scatter_uneven_matches_reference(size, shapes, dtype, op):
    shapes = [shapes.draw(SHAPES) for _ in range(size)]

    def fn(comm):
        chunks = [data(shapes[d], comm.rank, 10 + d, dtype) for d in range(size)]
        return comm.reduce_scatter(chunks, op=op), comm.stats.snapshot()

    isz = _itemsize(dtype)
    for r, (got, snap) in enumerate(run_threads(fn, size)):
        _assert_equal(got, REDUCE[op]([data(shapes[r], s, 10 + r, dtype) for s in range(size)]))
        assert snap["bytes"]["reduce_scatter"] == (size - 1) * math.prod(shapes[r]) * isz


@SETTINGS
@given(size=SIZES, draw=st.data(), dtype=DTYPES)
def test_alltoall_uneven_matches_reference(size, draw, dtype):
    shape = {(s, d): draw.draw(SHAPES) for s in range(size) for d in range(size)}

    def fn(comm):
        r = comm.rank
        chunks = [data(shape[r, d], r, 20 + d, dtype) for d in range(size)]
        got = comm.alltoall(chunks, recv_shapes=[shape[s, r] for s in range(size)])
        return got, comm.stats.snapshot()

    isz = _itemsize(dtype)
    for r, (got, snap) in enumerate(run_threads(fn, size)):
        for s in range(size):
            _assert_equal(got[s], data(shape[s, r], s, 20 + r, dtype))
        want = sum(math.prod(shape[s, r]) for s in range(size) if s != r) * isz
        assert snap["bytes"]["alltoall"] == want


def test_alltoall_bound_is_checked_against_every_rank():
    """``max_bytes`` must cover this rank's bytes (ValueError at the call) and be the same on
    every rank (thread ranks compare it: ranks given different bounds could choose different
    transports on a real backend)."""
    from distconv.comm import CollectiveMismatchError

    def fn(comm, bounds):
        chunks = [torch.ones(2 + comm.rank) for _ in range(comm.size)]
        shapes = [(2 + s,) for s in range(comm.size)]
        try:
            got = comm.alltoall(chunks, recv_shapes=shapes, max_bytes=bounds[comm.rank])
        except (ValueError, CollectiveMismatchError) as exc:
            return type(exc).__name__ + ": " + str(exc)
        return [g.shape[0] for g in got]

    most = 2 * 3 * 4  # rank 1 sends two chunks of 3 floats
    assert run_threads(fn, 2, (most, most)) == [[2, 3], [2, 3]]
    low = run_threads(fn, 2, (8, 8))  # refused on each rank before anything moves
    assert low == [f"ValueError: max_bytes = 8 is less than the {n} bytes rank {r} sends; it "
                   "bounds every rank's chunks together" for r, n in enumerate((16, 24))]
    differ = run_threads(fn, 2, (most + 8, most))
    assert all(d.startswith("CollectiveMismatchError") and "max_bytes" in d for d in differ)
    with pytest.raises(TypeError, match="max_bytes must be an int or None"):
        run_threads(lambda comm: comm.alltoall([torch.ones(1)] * 2, max_bytes=1.5), 2)


@SETTINGS
@given(size=SIZES, shape=SHAPES, root=st.integers(0, 7), dtype=DTYPES)
def test_broadcast_from_any_root(size, shape, root, dtype):
    root %= size

    def fn(comm):
        if comm.rank == root:
            buf = data(shape, comm.rank, 30, dtype)
        else:
            buf = torch.empty(shape, dtype=dtype)
        return comm.broadcast(buf, root=root), comm.stats.snapshot()

    for r, (got, snap) in enumerate(run_threads(fn, size)):
        _assert_equal(got, data(shape, root, 30, dtype))
        want = 0 if r == root else math.prod(shape) * _itemsize(dtype)
        assert snap["bytes"]["broadcast"] == want


@SETTINGS
@given(size=st.integers(2, 8), shape=SHAPES, shift=st.integers(1, 7))
def test_send_recv_ring(size, shape, shift):
    shift %= size
    if shift == 0:
        shift = 1

    def fn(comm):
        r = comm.rank
        sw = comm.isend(data(shape, r, 40), dst=(r + shift) % size, tag=3)
        got = comm.recv(shape, torch.float32, src=(r - shift) % size, tag=3)
        sw.wait()
        return got, comm.stats.snapshot()

    for r, (got, snap) in enumerate(run_threads(fn, size)):
        _assert_equal(got, data(shape, (r - shift) % size, 40))
        assert snap["calls"] == {"send": 1, "recv": 1}
        assert snap["bytes"] == {"send": 0, "recv": math.prod(shape) * 4}


@SETTINGS
@given(size=SIZES, perm=st.data())
def test_split_gives_group_position_ranks(size, perm):
    order = perm.draw(st.permutations(range(size)))
    cuts = sorted(perm.draw(st.sets(st.integers(1, max(size - 1, 1)), max_size=3)))
    bounds = [0, *[c for c in cuts if c < size], size]
    groups = [list(order[a:b]) for a, b in itertools.pairwise(bounds) if b > a]

    def fn(comm):
        sub = comm.split(groups)
        assert comm.split(groups) is sub
        members = sub.allgather(torch.tensor([comm.rank]))
        return sub.rank, sub.size, [int(m) for m in members]

    for r, (sub_rank, sub_size, members) in enumerate(run_threads(fn, size)):
        group = next(g for g in groups if r in g)
        assert (sub_rank, sub_size, members) == (group.index(r), len(group), group)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int16", "bool"])
def test_every_op_sync_and_async(size, dtype):
    for snap, backend in run_threads(programs.check_all_ops, size, dtype, 3, dtype == "float32"):
        assert backend == "threads"
        assert snap["calls"]["allreduce"] == 5 and snap["calls"]["barrier"] == 1


@pytest.mark.parametrize("size", [1, 2, 4, 7])
def test_split_and_stats_roll_up(size):
    run_threads(programs.check_split, size)


def test_low_precision_sum_is_rounded_once():
    got, want = run_threads(programs.bf16_reduce, 4)[0]
    assert torch.equal(got, want)
