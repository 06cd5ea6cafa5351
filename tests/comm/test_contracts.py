"""Promises the other communicator tests could not catch being broken: reductions in rank order
bit for bit, non-contiguous inputs on every backend, and timeouts that are kept."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from distconv.comm import CommTimeoutError
from distconv.testing import run_threads
from tests.comm import programs


def _spread(rank: int, n: int = 64) -> torch.Tensor:
    """fp32 values over many magnitudes, so a sum's rounding depends on its order."""
    g = torch.Generator().manual_seed(100 + rank)
    scale = 10.0 ** torch.randint(-4, 5, (n,), generator=g)
    return (torch.randn(n, generator=g) * scale).float()


def _in_rank_order(parts):
    out = parts[0].clone()
    for p in parts[1:]:
        out = out + p
    return out


def _reductions(comm):
    x = _spread(comm.rank)
    chunks = list(x.chunk(comm.size))
    return comm.allreduce(x), comm.allreduce(x, op="avg"), comm.reduce_scatter(chunks)


def _check_rank_order(results, size):
    parts = [_spread(r) for r in range(size)]
    want = _in_rank_order(parts)
    # the data must make the order visible, or the test could not fail
    assert not torch.equal(want, _in_rank_order(parts[::-1]))
    for r, (total, avg, mine) in enumerate(results):
        if total is not None:
            assert torch.equal(total, want)
            assert torch.equal(avg, want / size)
        assert torch.equal(mine, want.chunk(size)[r])


@pytest.mark.parametrize("size", [3, 4])
def test_thread_reductions_sum_in_rank_order_bit_for_bit(size):
    _check_rank_order(run_threads(_reductions, size), size)


def _reduce_scatter_only(comm):
    return None, None, comm.reduce_scatter(list(_spread(comm.rank).chunk(comm.size)))


@pytest.mark.gloo
def test_gloo_reduce_scatter_sums_in_rank_order_bit_for_bit(gloo4):
    _check_rank_order(gloo4.run(_reduce_scatter_only), 4)


@pytest.mark.parametrize("name", [
    "threads",
    pytest.param("gloo2", marks=pytest.mark.gloo),
    pytest.param("mpi4", marks=pytest.mark.mpi),
])
def test_noncontiguous_inputs_to_every_collective(request, name):
    if name == "threads":
        results = run_threads(programs.check_all_ops, 3, "float32", 5, True)
    else:
        results = request.getfixturevalue(name).run(programs.check_all_ops, "float32", 5, True)
    assert len(results) == (3 if name == "threads" else int(name[-1]))
    run = (lambda fn: run_threads(fn, 3)) if name == "threads" else (
        request.getfixturevalue(name).run)
    assert run(_strided_collectives) == [[]] * len(results)


def _avg_and_bytes(comm):
    x = torch.arange(10.0, dtype=torch.float64) * (comm.rank + 1)
    comm.stats.reset()
    out = comm.allreduce(x, op="avg")
    return out, comm.stats.bytes["allreduce"]


# Ring allreduce of 10 float64 over P ranks, b_r = 10 // P + (r < 10 % P) elements of its own:
# rank r receives ((P - 1) * b_r + (10 - b_r)) * 8 bytes, written out per rank.
_ALLREDUCE_BYTES = {2: [80, 80], 3: [112, 104, 104], 4: [128, 128, 112, 112]}


@pytest.mark.parametrize("name, size", [
    ("threads", 3), ("threads", 4),
    pytest.param("gloo2", 2, marks=pytest.mark.gloo),
    pytest.param("mpi4", 4, marks=pytest.mark.mpi),
])
def test_allreduce_average_and_byte_count(request, name, size):
    if name == "threads":
        results = run_threads(_avg_and_bytes, size)
    else:
        results = request.getfixturevalue(name).run(_avg_and_bytes)
    factor = sum(range(1, size + 1)) / size  # the mean of the ranks' multipliers 1..P
    for r, (out, nbytes) in enumerate(results):
        assert torch.equal(out, torch.arange(10.0, dtype=torch.float64) * factor)
        assert nbytes == _ALLREDUCE_BYTES[size][r]


def _views(rank: int, salt: int) -> dict[str, torch.Tensor]:
    """The same (4, 3) values as a strided slice, a transpose's transpose and a broadcast view."""
    g = torch.Generator().manual_seed(rank * 31 + salt)
    base = torch.randint(-5, 6, (4, 6), generator=g).double()
    return {
        "strided": base[:, ::2],
        "transposed": base[:, ::2].t().contiguous().t(),
        "expanded": base[:1, ::2].expand(4, 3),
    }


def _strided_collectives(comm):
    """Every collective fed views that are not contiguous, against contiguous references."""
    P, r = comm.size, comm.rank
    failures = []
    for kind in ("strided", "transposed", "expanded"):
        mine = _views(r, 0)[kind]
        every = [_views(s, 0)[kind].contiguous() for s in range(P)]
        assert not mine.is_contiguous()
        checks = {
            "allreduce": (comm.allreduce(mine), _in_rank_order(every)),
            "allgather": (torch.stack(comm.allgather(mine)), torch.stack(every)),
            "broadcast": (comm.broadcast(mine, root=P - 1), every[P - 1]),
            "reduce_scatter": (
                comm.reduce_scatter([mine.t()] * P), _in_rank_order([e.t() for e in every])),
            "alltoall": (torch.stack(comm.alltoall([mine.t()] * P)),
                         torch.stack([e.t() for e in every])),
        }
        for op, (got, want) in checks.items():
            if not torch.equal(got, want):
                failures.append(f"{op} of a {kind} view")
    return failures


def _bounded(fn, limit):
    """Run ``fn`` in a thread; fail after ``limit`` s rather than at pytest's 300 s timeout."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"did not finish within {limit} s: a timeout was not kept"
    return out


def _rank1_missing(comm):
    if comm.rank == 1:
        return None
    return comm.allreduce(torch.ones(1))


def test_missing_rank_times_out_within_its_timeout():
    out = _bounded(lambda: run_threads(_rank1_missing, 2, timeout=0.5), 45)
    assert isinstance(out.get("error"), CommTimeoutError), out
    assert "rank 0" in str(out["error"])


def _rank1_ignores_timeout(comm, release):
    if comm.rank == 1:
        release.wait(60)  # outside any collective: no communicator timeout reaches it
        return None
    return comm.allreduce(torch.ones(1))


def test_rank_that_ignores_its_timeout_is_reported_within_the_timeouts():
    release = threading.Event()
    begin = time.monotonic()
    try:
        out = _bounded(lambda: run_threads(_rank1_ignores_timeout, 2, release, timeout=0.5), 45)
    finally:
        release.set()
    assert isinstance(out.get("error"), CommTimeoutError), out
    assert "rank(s) 1 of 2" in str(out["error"]), out["error"]
    assert time.monotonic() - begin < 45  # within the rank's 60 s wait: it was not waited for


def _mutate_own_results(comm):
    x = torch.full((2,), float(comm.rank))
    got = comm.allgather(x)
    comm.barrier()
    if comm.rank == 0:
        for g in got:
            g.add_(100.0)  # results are this rank's own tensors: others must not see this
    comm.barrier()
    return [float(g[0]) for g in got], any(g.data_ptr() == x.data_ptr() for g in got)


def test_thread_allgather_results_belong_to_each_rank():
    results = run_threads(_mutate_own_results, 3)
    assert results[0] == ([100.0, 101.0, 102.0], False)
    assert results[1:] == [([0.0, 1.0, 2.0], False)] * 2


def _unpaired_alltoall(comm):
    # rank 0 sends 2 elements to rank 1, which expects 3
    chunks = [torch.ones(2), torch.ones(2)]
    recv = [(3,) if comm.rank == 1 else (2,), (2,)]
    return comm.alltoall(chunks, recv_shapes=recv)


def test_alltoall_whose_shapes_do_not_pair_up_is_refused():
    from distconv.comm import CollectiveMismatchError

    with pytest.raises(CollectiveMismatchError, match=r"\(3,\)"):
        run_threads(_unpaired_alltoall, 2)


def _buffers_outlive_the_call(comm):
    """A non-blocking operation started with a temporary (a bf16 block widened to fp32 for an
    MPI sum, a concatenated send buffer, a block made only to be sent) keeps it alive until the
    operation completes: an MPI that reads a send buffer during progress (Open MPI) would
    otherwise read freed memory. The temporary here is the contiguous copy isend makes of a
    strided view: the Work holds it (and releases it once complete)."""
    import gc

    r = comm.rank
    mine = torch.arange(4096, dtype=torch.float64).reshape(64, 64)[:, ::2] * (r + 1)
    if r == 0:
        work = comm.isend(mine, dst=1, tag=7)
        gc.collect()
        held = work._keep is not None
        work.wait()
        return {"held": held, "released": work._keep is None}
    if r == 1:
        got = comm.recv((64, 32), torch.float64, src=0, tag=7)
        sent = torch.arange(4096, dtype=torch.float64).reshape(64, 64)[:, ::2]
        return {"equal": torch.equal(got, sent)}
    return {}


@pytest.mark.mpi
def test_mpi_operations_keep_their_buffers_until_they_complete(mpi4):
    out = mpi4.run(_buffers_outlive_the_call)
    assert out[0]["held"] and out[0]["released"]
    assert out[1]["equal"]
    # and the sums that widen bf16 and fp16 to fp32 (the temporaries Open MPI read freed)
    for name, results in (("bf16", mpi4.run(_widened_sums, "bfloat16")),
                          ("fp16", mpi4.run(_widened_sums, "float16"))):
        for r, (got, want) in enumerate(results):
            assert torch.equal(got, want), (name, r)


def _widened_sums(comm, dtype: str):
    """bf16/fp16 allreduce and reduce-scatter of small integers (exact in either dtype)."""
    dt = getattr(torch, dtype)
    P = comm.size
    vals = [torch.arange(P * 8, dtype=torch.float32).reshape(P * 2, 4) % 7 + s for s in range(P)]
    total = sum(vals)
    ar = comm.allreduce(vals[comm.rank].to(dt))
    rs = comm.reduce_scatter([c.to(dt) for c in vals[comm.rank].chunk(P, 0)])
    want = torch.cat([total.to(dt).reshape(-1), total.chunk(P, 0)[comm.rank].to(dt).reshape(-1)])
    return torch.cat([ar.reshape(-1), rs.reshape(-1)]), want


def _consumed(comm):
    sums = []
    for dtype in (torch.float64, torch.bfloat16):  # bf16: gloo reduces a widened copy
        x = torch.arange(6, dtype=dtype) * (comm.rank + 1)
        out = comm.allreduce(x, consume=True)
        sums.append((out.dtype, out.tolist(), out.data_ptr() == x.data_ptr()))
    try:
        comm.allreduce(torch.ones(2), consume=1)
    except TypeError as exc:
        refused = str(exc)
    return sums, refused


@pytest.mark.parametrize("name, size", [
    ("threads", 3), ("single", 1),
    pytest.param("gloo2", 2, marks=pytest.mark.gloo),
    pytest.param("mpi4", 4, marks=pytest.mark.mpi),
])
def test_allreduce_of_a_consumed_tensor_is_the_sum(request, name, size):
    """consume=True lets a backend reduce in the caller's buffer (the gradient buckets do): the
    result is still the sum, in the input's dtype, on every backend; a non-bool is refused."""
    if name == "threads":
        results = run_threads(_consumed, size)
    elif name == "single":
        from distconv.comm import SingleCommunicator

        results = [_consumed(SingleCommunicator())]
    else:
        results = request.getfixturevalue(name).run(_consumed)
    total = sum(range(1, size + 1))
    for sums, refused in results:
        for (dtype, got, _), want_dtype in zip(sums, (torch.float64, torch.bfloat16)):
            assert dtype == want_dtype and got == [float(i * total) for i in range(6)]
        assert "consume must be a bool" in refused
        if name in ("gloo2", "mpi4", "single"):  # fp64 reduced in the caller's buffer itself
            assert sums[0][2], name
