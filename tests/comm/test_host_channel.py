"""The shared-memory channel of small collectives: its protocol on thread ranks sharing one
mapping (hypothesis over ranks, op sequences, dtypes and wait orders, against reductions written
out here), and on real gloo worlds, where communicators route small collectives through it."""

from __future__ import annotations

import mmap
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distconv.comm import CollectiveMismatchError, CommError, CommTimeoutError
from distconv.comm import host_channel as hc
from tests.comm import programs

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.uint8, torch.complex64]


def _channels(size: int, timeout: float = 10.0, slots: int = hc.SLOTS,
              slot_bytes: int = hc.SLOT_BYTES) -> list[hc.HostChannel]:
    length = size * hc._CTRL + slots * size * (hc._HEAD + slot_bytes)
    mm = mmap.mmap(-1, length)  # one mapping, shared by the thread ranks
    return [hc.HostChannel(mm, rank=r, size=size, timeout=timeout, describe=f"rank {r}",
                           slots=slots, slot_bytes=slot_bytes)
            for r in range(size)]


def _on_threads(size: int, fn, *, timeout: float = 10.0, limit: float = 60.0,
                **ring: int) -> list:
    """fn(channel) on ``size`` threads over one mapping (``ring``: its slots and slot_bytes);
    results in rank order; the first exception raised again."""
    chans = _channels(size, timeout, **ring)
    out: list = [None] * size
    errors: list = [None] * size

    def body(r: int) -> None:
        try:
            out[r] = fn(chans[r])
        except BaseException as exc:  # noqa: BLE001 -- handed to the test thread
            errors[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit)
        assert not t.is_alive(), "a rank hung"
    for exc in errors:
        if exc is not None:
            raise exc
    return out


def _value(i: int, r: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * i + r)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 10).to(dtype)
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    low = 0 if dtype == torch.uint8 else -50
    return torch.randint(low, 50, shape, generator=g).to(dtype)


def _sum_in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """Rank 0's plus rank 1's, plus rank 2's...; half precisions summed in fp32, rounded once."""
    wide = parts[0].dtype in (torch.float16, torch.bfloat16)
    acc = parts[0].float() if wide else parts[0].clone()
    for p in parts[1:]:
        acc = acc + (p.float() if wide else p)
    return acc.to(parts[0].dtype)


OP = st.tuples(st.sampled_from(["allreduce", "allgather", "broadcast", "barrier", "max",
                                "reduce_scatter", "alltoall"]),
               st.sampled_from(DTYPES), st.integers(0, 40), st.integers(0, 3))


@settings(max_examples=40)
@given(size=st.integers(2, 4), ops=st.lists(OP, min_size=1, max_size=12),
       batch=st.integers(1, 2 * hc.SLOTS + 1), seed=st.integers(0, 2**16))
def test_ops_equal_their_reference_whatever_is_in_flight(size, ops, batch, seed):
    """Up to ``batch`` operations issued before any is waited for (beyond the ring's slots), then
    waited for in a per-rank random order: every result is the reference's, bit for bit."""
    def shape(i, r, n, kind):
        return (n + (r if kind == "allgather" else 0) % 3,)

    def chunk_shape(n, d):
        return ((n + d) % 5, 2)  # uneven, some empty

    def want(i, kind, dtype, n, root, r):
        if kind == "barrier":
            return None
        if kind == "reduce_scatter":
            return _sum_in_rank_order([_value(i, s, (size, 7, 2), dtype)[r, :chunk_shape(n, r)[0]]
                                       for s in range(size)])
        if kind == "alltoall":  # rank s's chunk for r: its row r, of (n + s + 2r) % 5 rows
            return [_value(i, s, (size, 7, 2), dtype)[r, :(n + s + 2 * r) % 5]
                    for s in range(size)]
        if kind == "allgather":
            return [_value(i, s, shape(i, s, n, kind), dtype) for s in range(size)]
        parts = [_value(i, s, (n,), dtype) for s in range(size)]
        if kind == "broadcast":
            return parts[root % size]
        if kind == "max":
            return parts[0] if dtype.is_complex else torch.stack(parts).amax(0)
        return _sum_in_rank_order(parts)

    def rank(ch):
        gen = torch.Generator().manual_seed(seed + ch.rank)
        results, works = {}, []
        for i, (kind, dtype, n, root) in enumerate(ops):
            if kind == "max" and dtype.is_complex:
                kind = "allreduce"
            t = _value(i, ch.rank, shape(i, ch.rank, n, kind), dtype)
            if kind == "allreduce":
                w = ch.allreduce(t, "sum")
            elif kind == "max":
                w = ch.allreduce(t, "max")
            elif kind == "allgather":
                w = ch.allgather(t, [shape(i, s, n, kind) for s in range(size)], "allgather")
            elif kind == "broadcast":
                w = ch.broadcast(t, root % size)
            elif kind == "reduce_scatter":
                full = _value(i, ch.rank, (size, 7, 2), dtype)
                w = ch.reduce_scatter([full[d, :chunk_shape(n, d)[0]].contiguous()
                                       for d in range(size)], "sum")
            elif kind == "alltoall":
                full, r = _value(i, ch.rank, (size, 7, 2), dtype), ch.rank
                w = ch.alltoall([full[d, :(n + r + 2 * d) % 5].contiguous() for d in range(size)],
                                [((n + s + 2 * r) % 5, 2) for s in range(size)])
            else:
                w = ch.barrier()
            works.append((i, kind, w))
            if len(works) == batch or i == len(ops) - 1:
                for j in torch.randperm(len(works), generator=gen).tolist():
                    k, kk, work = works[j]
                    results[k] = (kk, work.wait())
                works = []
        return results

    for r, results in enumerate(_on_threads(size, rank)):
        for i, (kind, dtype, n, root) in enumerate(ops):
            got_kind, got = results[i]
            expect = want(i, got_kind, dtype, n, root, r)
            if expect is None:
                assert got is None
            elif isinstance(expect, list):
                assert len(got) == size
                for g, e in zip(got, expect):
                    assert g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e)
            else:
                assert got.dtype == expect.dtype and got.shape == expect.shape
                assert torch.equal(got, expect), (i, got_kind, dtype, got, expect)


@settings(max_examples=30)
@given(size=st.integers(2, 4), slots=st.integers(1, 3), slot_bytes=st.sampled_from([8, 24, 64]),
       ops=st.lists(st.tuples(st.sampled_from([torch.float32, torch.float64, torch.bfloat16,
                                                torch.int64, torch.int16]),
                              st.integers(0, 50), st.sampled_from(["sum", "avg", "max"]),
                              st.booleans()), min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_allreduces_larger_than_a_slot_go_in_chunks(size, slots, slot_bytes, ops, seed):
    """The bulk channel's case on a ring of tiny slots: allreduces of up to 50 elements in
    chunks of a slot, all issued before any is waited for (chunks beyond the ring wait for the
    peers to read the oldest), waited for in a per-rank random order, into the input or a new
    tensor: each equals the reduction in rank order, bit for bit."""
    ops = [(d, n, "sum" if op == "avg" and not d.is_floating_point else op, into)
           for d, n, op, into in ops]

    def want(i, dtype, n, op):
        parts = [_value(i, s, (n,), dtype) for s in range(size)]
        if op == "max":
            return torch.stack(parts).amax(0)
        total = _sum_in_rank_order(parts)
        if op == "avg":
            wide = dtype in (torch.float16, torch.bfloat16)
            acc = parts[0].float() if wide else parts[0].clone()
            for q in parts[1:]:
                acc = acc + (q.float() if wide else q)
            total = (acc / size).to(dtype)
        return total

    def rank(ch):
        gen = torch.Generator().manual_seed(seed + ch.rank)
        ins, works = [], []
        for i, (dtype, n, op, into) in enumerate(ops):
            t = _value(i, ch.rank, (n,), dtype)
            ins.append(t)
            works.append(ch.allreduce(t, op, out=t if into else None))
        got = {}
        for j in torch.randperm(len(works), generator=gen).tolist():
            got[j] = works[j].wait()
        return [(got[i], got[i].data_ptr() == ins[i].data_ptr()) for i in range(len(ops))]

    for results in _on_threads(size, rank, slots=slots, slot_bytes=slot_bytes):
        for i, ((dtype, n, op, into), (got, in_place)) in enumerate(zip(ops, results)):
            expect = want(i, dtype, n, op)
            assert got.dtype == expect.dtype and got.shape == expect.shape
            assert torch.equal(got, expect), (i, dtype, n, op, got, expect)
            assert in_place == into or n == 0


def test_results_are_copies_that_outlive_the_slot():
    """A result stays what it was after its slot has been written by later operations."""
    def rank(ch):
        first = ch.allgather(torch.full((4,), float(ch.rank)), [(4,)] * 2, "allgather").wait()
        for k in range(3 * hc.SLOTS):
            ch.allreduce(torch.full((4,), 100.0 + k), "sum").wait()
        return first

    for got in _on_threads(2, rank):
        assert torch.equal(got[0], torch.zeros(4)) and torch.equal(got[1], torch.ones(4))


def test_a_payload_of_the_whole_slot_and_the_size_test():
    n = hc.SLOT_BYTES // 8
    assert hc.HostChannel.fits(hc.SLOT_BYTES) and not hc.HostChannel.fits(hc.SLOT_BYTES + 1)

    def rank(ch):
        return ch.allreduce(torch.arange(n, dtype=torch.float64) * (ch.rank + 1), "sum").wait()

    for got in _on_threads(3, rank):
        assert torch.equal(got, torch.arange(n, dtype=torch.float64) * 6)


def test_consuming_allreduce_writes_into_its_input():
    def rank(ch):
        t = torch.full((5,), float(ch.rank + 1))
        out = ch.allreduce(t, "sum", out=t).wait()
        return out is t, t

    for same, t in _on_threads(2, rank):
        assert same and torch.equal(t, torch.full((5,), 3.0))


def test_different_collectives_raise_a_mismatch_on_every_rank():
    def rank(ch):
        t = torch.ones(4)
        try:
            if ch.rank == 0:
                ch.allreduce(t, "sum").wait()
            else:
                ch.allgather(t, [(4,)] * ch.size, "allgather").wait()
        except CollectiveMismatchError as exc:
            return str(exc)
        return None

    t0 = time.monotonic()
    msgs = _on_threads(2, rank)
    assert time.monotonic() - t0 < 30  # raised, not hung (generous for a loaded machine)
    assert all(m is not None and "different collectives" in m for m in msgs), msgs


def test_a_missing_rank_times_out_naming_it():
    def rank(ch):
        if ch.rank == 2:
            return None
        with pytest.raises(CommTimeoutError) as info:
            ch.allreduce(torch.ones(2), "sum").wait()
        return str(info.value)

    t0 = time.monotonic()
    msgs = _on_threads(3, rank, timeout=0.5)
    assert time.monotonic() - t0 < 30  # raised, not hung (generous for a loaded machine)
    for r in (0, 1):
        assert f"rank {r}, op 'allreduce': rank(s) [2] did not arrive within 0.5 s" in msgs[r]


def test_a_closed_channel_raises_and_releases_its_mapping():
    ch = _channels(1)[0]
    mm = ch._mm
    kept = ch.allgather(torch.arange(3), [(3,)], "allgather").wait()
    ch.close()
    assert mm.closed  # no view of the mapping outlives the channel
    assert torch.equal(kept[0], torch.arange(3))
    ch.close()  # idempotent
    with pytest.raises(CommError, match="closed"):
        ch.allreduce(torch.ones(1), "sum")


def test_the_switch(monkeypatch):
    monkeypatch.setenv("DISTCONV_HOST_CHANNEL", "0")
    assert not hc.enabled()
    monkeypatch.setenv("DISTCONV_HOST_CHANNEL", "1")
    monkeypatch.setattr(hc.platform, "machine", lambda: "aarch64")
    assert not hc.enabled()  # its memory order is not x86-64's
    monkeypatch.setattr(hc.platform, "machine", lambda: "x86_64")
    assert hc.enabled()


# ---------------------------------------------------------------- real gloo worlds
GLOO = [pytest.param("gloo2", marks=pytest.mark.gloo), pytest.param("gloo4", marks=pytest.mark.gloo)]


@pytest.mark.parametrize("name", GLOO)
def test_gloo_routes_small_and_large_allreduces_through_the_channels(request, name):
    pool = request.getfixturevalue(name)
    for r, res in enumerate(pool.run(programs.host_channel_routes)):
        assert res["opened"] and res["no_file_left"], res
        assert res["big_on_bulk"] and res["consumed_in_place"], res
        assert res["bytes"] == res["bytes_expected"], res


@pytest.mark.parametrize("name", GLOO)
def test_gloo_routes_bounded_alltoalls_through_the_rings(request, name):
    pool = request.getfixturevalue(name)
    for res in pool.run(programs.alltoall_routes):
        assert res["routed"] == (1, 1), res  # the unbounded one went over gloo
        assert "max_bytes = 0 is less than" in res["refused"], res
        assert res["bytes"] == res["bytes_expected"], res


@pytest.mark.mpi
def test_mpi_routes_large_allreduces_through_the_bulk_ring(mpi4):
    for res in mpi4.run(programs.bulk_ring_routes):
        assert res["bulk"] and res["small_on_backend"] and res["no_file_left"], res
        assert res["in_place"] and res["bytes"] == res["bytes_expected"], res
        assert res["reduce_scatter_routes"] == [1, 0], res


@pytest.mark.gloo
def test_gloo_without_the_channel_still_passes_every_op(gloo2):
    """``DISTCONV_HOST_CHANNEL=0``: the communicators made afterwards carry everything on gloo."""
    for res in gloo2.run(programs.without_host_channel):
        assert res["channel"] is None and res["bulk"] is None
        assert res["backend"] == "torch-gloo"


@pytest.mark.gloo
@pytest.mark.parametrize("elements", [2, hc.BULK_BYTES // 4 + 5], ids=["small", "bulk"])
def test_gloo_dead_peer_is_seen_before_the_timeout(gloo2, tmp_path, elements):
    """A rank that exits in the middle of a collective (of the small ring, or a chunked one of
    the bulk ring) is reported within about a second, not after the communicator's 30 s
    timeout."""
    gloo2.run(programs.rank_and_size)
    path = tmp_path / "rank0.txt"
    with pytest.raises(CommError):
        gloo2.run(programs.dead_peer_in_channel, 30.0, str(path), elements)
    waited, msg = path.read_text().split(" ", 1)
    assert float(waited) < 3.0, msg
    assert msg.startswith("CommError: rank 0, backend 'torch-gloo', op 'allreduce': rank 1 "), msg
    assert "has exited in the middle of the collective" in msg
    assert [r[:2] for r in gloo2.run(programs.rank_and_size)] == [(0, 2), (1, 2)]


@pytest.mark.gloo
def test_gloo_sibling_for_control_messages(gloo4):
    """What an NCCL communicator's ``host`` makes: a gloo group of the same ranks."""
    for r, (rank, size, backend, counted) in enumerate(gloo4.run(programs.host_sibling)):
        assert (rank, size, backend) == (r, 4, "torch-gloo")
        assert counted == 3 * 2 * 8  # the three other ranks' two int64s


@pytest.mark.gloo
def test_gloo_without_room_in_shared_memory_stays_on_gloo(gloo2):
    for res in gloo2.run(programs.host_channel_without_room):
        assert res == {"channel": None, "no_file_left": True}
