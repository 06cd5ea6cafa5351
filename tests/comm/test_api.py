"""Argument errors, the size-1 backend, initialisation from the environment, Work, launch and
WorkerPool behaviour."""

from __future__ import annotations

import time

import pytest
import torch

import distconv.comm as dcomm
from distconv.comm import (
    CollectiveMismatchError,
    CommTimeoutError,
    SingleCommunicator,
    Work,
    set_debug,
)
from distconv.launch import launch
from distconv.testing import run_threads
from tests.comm import programs


def _raise_on_every_rank(size, call, exc_type, match):
    """``call(comm)`` must raise ``exc_type`` on every rank, before any communication."""

    def fn(comm):
        with pytest.raises(exc_type, match=match):
            call(comm)
        return comm.stats.snapshot()

    for snap in run_threads(fn, size, timeout=5):
        assert snap == {"calls": {}, "bytes": {}}


ONES = torch.ones(2)
BAD_CALLS = [
    (lambda c: c.reduce_scatter([torch.ones(2)]), ValueError, "per rank: expected 3, got 1"),
    (lambda c: c.alltoall([torch.ones(2)] * 4), ValueError, "expected 3, got 4"),
    (lambda c: c.reduce_scatter(torch.ones(3)), TypeError, "sequence of 3 tensors"),
    (
        lambda c: c.reduce_scatter([torch.ones(2), torch.ones(2, dtype=torch.int32), ONES]),
        TypeError,
        "one dtype",
    ),
    (
        lambda c: c.alltoall([torch.ones(1), torch.ones(1), torch.ones(1, dtype=torch.int64)]),
        TypeError,
        "one dtype",
    ),
    (lambda c: c.broadcast(torch.ones(2), root=3), ValueError, r"root must be a rank in \[0, 3\)"),
    (lambda c: c.broadcast(torch.ones(2), root=-1), ValueError, "root"),
    (lambda c: c.broadcast(torch.ones(2), root=1.0), TypeError, "root must be an int"),
    (lambda c: c.allgather(torch.ones(2), shapes=[(2,)]), ValueError, "one shape per rank"),
    (lambda c: c.allgather(torch.ones(2), shapes=[(3,)] * 3), ValueError, r"must equal this rank"),
    (lambda c: c.allgather(torch.ones(2), shapes=[(-1,)] * 3), ValueError, "non-negative"),
    (lambda c: c.alltoall([torch.ones(1)] * 3, recv_shapes=[(1,)] * 2), ValueError, "one shape"),
    (lambda c: c.alltoall([torch.ones(1)] * 3, recv_shapes=[(2,)] * 3), ValueError, "own chunk"),
    (lambda c: c.allreduce(torch.ones(2), op="mean"), ValueError, "op must be one of"),
    (lambda c: c.allreduce(torch.ones(2, dtype=torch.int64), op="avg"), TypeError, "avg"),
    (lambda c: c.allreduce(torch.ones(2, dtype=torch.complex64), op="max"), TypeError, "complex"),
    (lambda c: c.allreduce([1.0, 2.0]), TypeError, "t must be a torch.Tensor, got list"),
    (lambda c: c.allreduce(torch.ones(2), meta=3), TypeError, "meta must be a str"),
    (lambda c: c.send(torch.ones(2), dst=c.rank), ValueError, "dst must differ"),
    (lambda c: c.send(torch.ones(2), dst=5), ValueError, "dst must be a rank"),
    (lambda c: c.send(torch.ones(2), dst=(c.rank + 1) % 3, tag=-1), ValueError, "tag"),
    (lambda c: c.recv((2,), "float32", src=(c.rank + 1) % 3), TypeError, "must be a torch.dtype"),
    (lambda c: c.split([[0, 1]]), ValueError, r"partition range\(3\)"),
    (lambda c: c.split([[0, 1], [1, 2]]), ValueError, "partition"),
    (lambda c: c.split([[0, 1, 2]], timeout=0), ValueError, "timeout"),
    (lambda c: c.split([[0, "1", 2]]), TypeError, "int ranks"),
]


@pytest.mark.parametrize("call,exc_type,match", BAD_CALLS)
def test_bad_arguments_raise_clear_errors(call, exc_type, match):
    _raise_on_every_rank(3, call, exc_type, match)


def test_split_with_different_groups_on_different_ranks_raises():
    def fn(comm):
        return comm.split([[0, 1]] if comm.rank == 0 else [[1], [0]])

    with pytest.raises(CollectiveMismatchError, match="split"):
        run_threads(fn, 2, timeout=5)


def test_single_backend_returns_copies():
    comm = SingleCommunicator()
    assert (comm.rank, comm.size, comm.backend) == (0, 1, "single")
    x = torch.arange(6.0).reshape(2, 3)
    results = [
        comm.allreduce(x),
        comm.allgather(x)[0],
        comm.reduce_scatter([x]),
        comm.alltoall([x])[0],
        comm.broadcast(x, root=0),
        comm.allreduce(x, async_op=True).wait(),
    ]
    for out in results:
        assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    comm.barrier()
    assert comm.split([[0]]).size == 1
    assert comm.stats.total_bytes() == 0
    assert comm.stats.calls["allreduce"] == 2
    assert "timeout=60.0" in repr(comm)


def test_work_wait_is_idempotent_and_reraises():
    calls = []
    w = Work(lambda: calls.append(1) or 5)
    assert not w.is_completed()
    assert w.wait() == 5 and w.wait() == 5 and calls == [1]
    assert w.is_completed()

    def fail():
        raise CommTimeoutError("x")

    bad = Work(fail)
    for _ in range(2):
        with pytest.raises(CommTimeoutError):
            bad.wait()


def test_set_debug_takes_a_bool():
    with pytest.raises(TypeError, match="bool"):
        set_debug(1)


@pytest.fixture
def fresh_world(monkeypatch):
    monkeypatch.setattr(dcomm, "_world", None)
    for var in ("RANK", "WORLD_SIZE", *dcomm._MPI_RANK_VARS):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_init_detects_the_launcher(fresh_world):
    assert dcomm._detect() == "single"
    fresh_world.setenv("PMI_RANK", "0")
    assert dcomm._detect() == "mpi"
    fresh_world.setenv("RANK", "0")
    fresh_world.setenv("WORLD_SIZE", "1")
    assert dcomm._detect() == "torch"


def test_init_without_launcher_is_single_and_world_reuses_it(fresh_world):
    comm = dcomm.init(timeout=5.0)
    assert comm.backend == "single" and comm.timeout == 5.0
    assert dcomm.world() is comm and dcomm.init() is comm and dcomm.init("single") is comm
    with pytest.raises(RuntimeError, match="already initialised"):
        dcomm.init("mpi")


def test_init_rejects_bad_arguments(fresh_world):
    with pytest.raises(ValueError, match="backend must be None or one of"):
        dcomm.init("tcp")
    with pytest.raises(ValueError, match="timeout"):
        dcomm.init(timeout=0)


def test_launch_threads_and_single():
    assert launch(programs.rank_and_size, 3, backend="threads") == [
        (r, 3, "threads") for r in range(3)
    ]
    assert launch(programs.rank_and_size, 1, backend="single") == [(0, 1, "single")]
    with pytest.raises(ValueError, match="backend must be one of"):
        launch(programs.rank_and_size, 2, backend="nccl2")
    with pytest.raises(ValueError, match="runs one rank"):
        launch(programs.rank_and_size, 2, backend="single")


@pytest.mark.gloo
def test_launch_gloo_processes():
    assert launch(programs.rank_and_size, 2) == [(0, 2, "torch-gloo"), (1, 2, "torch-gloo")]


@pytest.mark.gloo
def test_pool_rejects_functions_workers_cannot_import(gloo2):
    def local(comm):
        return comm.rank

    with pytest.raises(ValueError, match="module-level function"):
        gloo2.run(local)
    with pytest.raises(ValueError, match="module-level function"):
        gloo2.run(lambda comm: comm.rank)


@pytest.mark.gloo
def test_pool_task_timeout_restarts_the_pool(gloo2):
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match="did not finish within 1.0 s"):
        gloo2.run(programs.sleep_for, 300, timeout=1.0)
    assert time.monotonic() - t0 < 60  # far from the task's 300 s, generous for a loaded machine
    assert gloo2.run(programs.rank_and_size)[1][:2] == (1, 2)
