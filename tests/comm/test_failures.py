"""A mismatched collective, a missing peer and a dead peer end in an exception within the
timeout, never a hang; debug mode names the mismatch. Short (3 s) sub-communicator timeouts.

The exception's type tells a detected mismatch from a timeout; the time limits only tell an
exception from a hang, so they are generous enough for a loaded machine."""

from __future__ import annotations

import time

import pytest

from distconv.comm import CollectiveMismatchError, CommError, CommTimeoutError
from distconv.testing import run_threads
from tests.comm import programs

T = 3.0  # communicator timeout for these tests
SLACK = 60.0  # a loaded machine; start-up of a restarted pool is not part of the failure


def _raises(exc_type, fn, *args, within: float, **kw):
    t0 = time.monotonic()
    with pytest.raises(exc_type) as info:
        fn(*args, **kw)
    assert time.monotonic() - t0 < within, f"took {time.monotonic() - t0:.1f} s"
    return str(info.value)


# ---------------------------------------------------------------- threads
@pytest.mark.parametrize("size", [2, 3])
def test_threads_mismatched_ops_raise(size):
    msg = _raises(CollectiveMismatchError, run_threads, programs.mismatched_ops, size, T,
                  within=T + SLACK)
    assert "rank 0: allreduce" in msg and "rank 1: allgather" in msg


def test_threads_mismatched_shapes_raise():
    msg = _raises(CollectiveMismatchError, run_threads, programs.mismatched_shapes, 2, T,
                  within=T + SLACK)
    assert "shape=(4,)" in msg and "shape=(5,)" in msg


@pytest.mark.parametrize("size", [2, 3])
def test_threads_missing_peer_times_out(size):
    msg = _raises(CommTimeoutError, run_threads, programs.missing_peer, size, 0.5, within=T + SLACK)
    assert "rank 0" in msg and "'threads'" in msg and "allreduce" in msg


def test_threads_failing_rank_releases_its_peers():
    msg = _raises(ValueError, run_threads, programs.raise_on_rank, 3, 1, within=20, timeout=30)
    assert "[rank 1 of 3 threads]" in msg


def test_threads_debug_mode_names_the_mismatch():
    for r, msg in enumerate(run_threads(programs.debug_mismatch, 3)):
        assert f"rank {r}" in msg
        assert "rank 0: allreduce" in msg and "rank 2: allgather" in msg
        assert "layer1.forward" in msg


# ---------------------------------------------------------------- real engines
POOLS = [pytest.param("gloo2", marks=pytest.mark.gloo), pytest.param("mpi4", marks=pytest.mark.mpi)]


@pytest.mark.parametrize("name", POOLS)
def test_mismatched_ops_raise(request, name):
    pool = request.getfixturevalue(name)
    _raises(CommError, pool.run, programs.mismatched_ops, T, within=T + SLACK)
    assert pool.run(programs.rank_and_size)[0][1] == pool.size


@pytest.mark.gloo
def test_gloo_mismatched_shapes_raise(gloo2):
    _raises(CommError, gloo2.run, programs.mismatched_shapes, T, within=T + SLACK)


@pytest.mark.parametrize("name", POOLS)
def test_missing_peer_times_out(request, name):
    pool = request.getfixturevalue(name)
    msg = _raises(CommTimeoutError, pool.run, programs.missing_peer, T, within=T + SLACK)
    assert "rank 0" in msg and "allreduce" in msg


@pytest.mark.parametrize("name", POOLS)
def test_dead_peer_raises_and_pool_recovers(request, name):
    pool = request.getfixturevalue(name)
    pool.run(programs.rank_and_size)  # a pool stopped by an earlier failure restarts here
    restarts = pool.restarts
    _raises(CommError, pool.run, programs.dead_peer, T, within=T + SLACK)
    ranks = [res[:2] for res in pool.run(programs.rank_and_size)]
    assert ranks == [(r, pool.size) for r in range(pool.size)]
    assert pool.restarts == restarts + 1


@pytest.mark.parametrize("name", POOLS)
def test_debug_mode_names_the_mismatch(request, name):
    pool = request.getfixturevalue(name)
    pool.run(programs.rank_and_size)
    restarts = pool.restarts
    for r, msg in enumerate(pool.run(programs.debug_mismatch)):
        assert f"rank {r}," in msg
        assert "rank 0: allreduce" in msg and "rank 1: allgather" in msg
        assert "meta='layer1.forward'" in msg
    assert pool.restarts == restarts  # the world stays usable


@pytest.mark.mpi
def test_mpi_debug_mode_catches_mismatched_shapes(mpi4):
    """MPI itself matches an allreduce of 4 with one of 5 elements (garbage): debug mode."""
    msg = _raises(CollectiveMismatchError, mpi4.run, programs.debug_mismatched_shapes,
                  within=T + SLACK)
    assert "shape=(4,)" in msg and "shape=(5,)" in msg


@pytest.mark.parametrize("name", POOLS)
def test_debug_mode_passes_agreeing_collectives(request, name):
    pool = request.getfixturevalue(name)
    for r, (out, shapes, calls) in enumerate(pool.run(programs.debug_agreement_passes)):
        assert out == [float(pool.size)] * 3
        assert shapes == [(r + 1, s + 1) for s in range(pool.size)]
        assert calls == {"allreduce": 1, "alltoall": 1}  # the check itself is not counted


@pytest.mark.gloo
def test_error_in_one_rank_is_reraised_with_its_rank(gloo2):
    msg = _raises(ValueError, gloo2.run, programs.raise_on_rank, 1, within=T + SLACK)
    assert "[rank 1 of gloo pool of 2]" in msg and "bad value on rank 1" in msg
