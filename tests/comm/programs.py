"""Rank programs: module-level functions ``fn(comm, ...)`` run on threads, gloo and MPI worlds.

Every rank builds every rank's inputs from (seed, rank), so each rank checks its own results
against a local reference. Values are small integers, exact in every dtype used (bf16 included),
so results are compared exactly whatever order the backend reduces in.
"""

from __future__ import annotations

import math
import os
import time

import torch

from distconv.comm import CollectiveMismatchError, CommError, set_debug
from distconv.comm.base import allreduce_bytes


def data(shape, rank: int, salt: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + salt * 1009 + rank)
    return torch.randint(-3, 4, tuple(shape), generator=g).to(dtype)


def _equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {got.shape} != {want.shape}"
    assert torch.equal(got, want), f"{what}: got {got} want {want}"


def ag_shape(s: int) -> tuple[int, ...]:
    return (s % 3, 2)  # uneven; rank 0 empty


def rs_shape(d: int) -> tuple[int, ...]:
    return (d % 2 + 1, 3)


def a2a_shape(s: int, d: int) -> tuple[int, ...]:
    return ((s + d) % 3, d + 1)


REDUCE = {
    "sum": lambda xs: sum(xs[1:], xs[0].clone()),
    "max": lambda xs: torch.stack(xs).amax(0),
    "min": lambda xs: torch.stack(xs).amin(0),
    "prod": lambda xs: torch.stack(xs).prod(0).to(xs[0].dtype),
}


def check_all_ops(comm, dtype_name: str = "float32", seed: int = 0, noncontiguous: bool = False):
    """Every operation once (sync and async) against the local reference; checks the stats.

    Returns this rank's stats snapshot and backend name.
    """
    dtype = getattr(torch, dtype_name)
    P, r = comm.size, comm.rank
    isz = torch.empty((), dtype=dtype).element_size()
    comm.stats.reset()

    def mk(shape, s, salt):
        if noncontiguous and len(shape) == 2:
            t = data(shape[::-1], s, salt, dtype, seed).t()
            return t
        return data(shape, s, salt, dtype, seed)

    expect_bytes: dict[str, int] = {}

    def add(op, n):
        expect_bytes[op] = expect_bytes.get(op, 0) + n

    # allreduce: every op, sync and async
    x = mk((4, 3), r, 1)
    x0 = x.clone()
    for op, ref in REDUCE.items():
        want = ref([mk((4, 3), s, 1) for s in range(P)])
        _equal(comm.allreduce(x, op=op), want, f"allreduce {op}")
        add("allreduce", allreduce_bytes(12, r, P, isz))
    work = comm.allreduce(x, async_op=True)
    _equal(work.wait(), REDUCE["sum"]([mk((4, 3), s, 1) for s in range(P)]), "allreduce async")
    assert work.is_completed()
    add("allreduce", allreduce_bytes(12, r, P, isz))
    _equal(x, x0, "allreduce input unchanged")

    # allgather, uneven
    shapes = [ag_shape(s) for s in range(P)]
    got = comm.allgather(mk(shapes[r], r, 2), shapes=shapes)
    for s in range(P):
        _equal(got[s], mk(shapes[s], s, 2), f"allgather[{s}]")
    got = comm.allgather(mk((2, 2), r, 3), async_op=True).wait()
    for s in range(P):
        _equal(got[s], mk((2, 2), s, 3), f"allgather async[{s}]")
    others = sum(math.prod(shapes[s]) for s in range(P) if s != r)
    add("allgather", others * isz + (P - 1) * 4 * isz)

    # reduce_scatter, uneven
    chunks = [mk(rs_shape(d), r, 10 + d) for d in range(P)]
    want = REDUCE["sum"]([mk(rs_shape(r), s, 10 + r) for s in range(P)])
    _equal(comm.reduce_scatter(chunks), want, "reduce_scatter")
    _equal(comm.reduce_scatter(chunks, async_op=True).wait(), want, "reduce_scatter async")
    want_max = REDUCE["max"]([mk(rs_shape(r), s, 10 + r) for s in range(P)])
    _equal(comm.reduce_scatter(chunks, op="max"), want_max, "reduce_scatter max")
    add("reduce_scatter", 3 * (P - 1) * math.prod(rs_shape(r)) * isz)

    # alltoall, uneven
    chunks = [mk(a2a_shape(r, d), r, 20) for d in range(P)]
    rshapes = [a2a_shape(s, r) for s in range(P)]
    got = comm.alltoall(chunks, recv_shapes=rshapes)
    got_async = comm.alltoall(chunks, recv_shapes=rshapes, async_op=True).wait()
    for s in range(P):
        want = mk(a2a_shape(s, r), s, 20)
        _equal(got[s], want, f"alltoall[{s}]")
        _equal(got_async[s], want, f"alltoall async[{s}]")
    add("alltoall", 2 * sum(math.prod(rshapes[s]) for s in range(P) if s != r) * isz)

    # broadcast from the last rank
    root = P - 1
    buf = mk((3, 2), r, 30) if r == root else torch.zeros((3, 2), dtype=dtype)
    _equal(comm.broadcast(buf, root=root), mk((3, 2), root, 30), "broadcast")
    got = comm.broadcast(buf, root=root, async_op=True).wait()
    _equal(got, mk((3, 2), root, 30), "broadcast async")
    add("broadcast", 0 if r == root else 2 * 6 * isz)

    # point to point around a ring (async on both sides, so no ordering deadlock)
    if P > 1:
        nxt, prv = (r + 1) % P, (r - 1) % P
        sw = comm.isend(mk((2, 3), r, 40), dst=nxt, tag=7)
        rw = comm.irecv((2, 3), dtype, src=prv, tag=7)
        _equal(rw.wait(), mk((2, 3), prv, 40), "irecv")
        sw.wait()
        add("recv", 6 * isz)
        if r == 0:
            comm.send(mk((5,), r, 41), dst=1)
            _equal(comm.recv((5,), dtype, src=1, tag=2), mk((5,), 1, 42), "recv")
        elif r == 1:
            _equal(comm.recv((5,), dtype, src=0), mk((5,), 0, 41), "recv")
            comm.send(mk((5,), r, 42), dst=0, tag=2)
        if r < 2:
            add("recv", 5 * isz)
    comm.barrier()

    snap = comm.stats.snapshot()
    for op, n in expect_bytes.items():
        assert snap["bytes"].get(op, 0) == n, f"bytes[{op}] = {snap['bytes'].get(op)} != {n}"
    return snap, comm.backend


def check_split(comm):
    """Even/odd split, a split of the split, caching, and stats rolling up into the parent."""
    P, r = comm.size, comm.rank
    groups = [list(range(0, P, 2)), list(range(1, P, 2))] if P > 1 else [[0]]
    sub = comm.split(groups)
    assert comm.split(groups) is sub
    g = groups[r % 2]
    assert sub.size == len(g) and sub.rank == g.index(r)
    before, sub_before = comm.stats.bytes["allreduce"], sub.stats.bytes["allreduce"]
    got = sub.allreduce(torch.full((3,), float(r)))
    _equal(got, torch.full((3,), float(sum(g))), "sub allreduce")
    # the world is shared by the whole session: compare increments, not totals
    assert comm.stats.bytes["allreduce"] - before == sub.stats.bytes["allreduce"] - sub_before
    got = sub.allgather(torch.tensor([r]))
    assert [int(t) for t in got] == g
    halves = sub.split([[i] for i in range(sub.size)])
    assert halves.size == 1
    _equal(halves.allreduce(torch.ones(2)), torch.ones(2), "size-1 split")
    rev = comm.split([list(reversed(range(P)))])
    assert rev.rank == P - 1 - r
    got = rev.allgather(torch.tensor([r]))
    assert [int(t) for t in got] == list(reversed(range(P)))
    return sub.rank, sub.size


def bf16_reduce(comm):
    """bf16 values whose fp32 sum differs from a bf16 running sum: reduced exactly once."""
    base = torch.tensor([256.0, 1.0, -3.0], dtype=torch.bfloat16)
    got = comm.allreduce(base + comm.rank)
    want = (torch.stack([(base + s).float() for s in range(comm.size)]).sum(0)).bfloat16()
    return got, want


# ---------------------------------------------------------------- failures
def mismatched_ops(comm, timeout: float):
    """Rank 0 allreduces while the others allgather."""
    c = comm.split([list(range(comm.size))], timeout=timeout)
    if c.rank == 0:
        return c.allreduce(torch.ones(4))
    return c.allgather(torch.ones(4))


def mismatched_shapes(comm, timeout: float):
    c = comm.split([list(range(comm.size))], timeout=timeout)
    return c.allreduce(torch.ones(4 + c.rank))


def missing_peer(comm, timeout: float):
    """The last rank never joins the collective."""
    c = comm.split([list(range(comm.size))], timeout=timeout)
    if c.rank == c.size - 1:
        return None
    return c.allreduce(torch.ones(4))


def debug_mismatch(comm):
    """In debug mode the mismatch is reported at once, naming what each rank called."""
    set_debug(True)
    try:
        if comm.rank == 0:
            comm.allreduce(torch.ones(4), meta="layer1.forward")
        else:
            comm.allgather(torch.ones(4), meta="layer1.forward")
    except CollectiveMismatchError as exc:
        return str(exc)
    finally:
        set_debug(False)
    raise AssertionError("no CollectiveMismatchError")


def debug_mismatched_shapes(comm):
    set_debug(True)
    try:
        return comm.allreduce(torch.ones(4 + comm.rank % 2))
    finally:
        set_debug(False)


def debug_agreement_passes(comm):
    set_debug(True)
    try:
        comm.stats.reset()
        out = comm.allreduce(torch.ones(3), meta="ok")
        got = comm.alltoall(
            [torch.ones(r + 1, comm.rank + 1) for r in range(comm.size)],
            recv_shapes=[(comm.rank + 1, s + 1) for s in range(comm.size)],
        )
        return out.tolist(), [tuple(g.shape) for g in got], comm.stats.snapshot()["calls"]
    finally:
        set_debug(False)


def dead_peer(comm, timeout: float):
    """The last rank exits in the middle of the task; the others enter an allreduce."""
    c = comm.split([list(range(comm.size))], timeout=timeout)
    c.allreduce(torch.ones(2))
    if c.rank == c.size - 1:
        os._exit(3)
    time.sleep(0.1)
    t0 = time.monotonic()
    try:
        c.allreduce(torch.ones(2))
    except CommError as exc:
        raise CommError(f"{exc} (after {time.monotonic() - t0:.1f} s)") from exc
    raise AssertionError("allreduce with a dead peer returned")


def rank_and_size(comm):
    return comm.rank, comm.size, comm.backend


def raise_on_rank(comm, bad: int):
    if comm.rank == bad:
        raise ValueError(f"bad value on rank {bad}")
    return comm.rank


def sleep_for(comm, seconds: float):
    time.sleep(seconds)
    return comm.rank


def reduce_scatter_native(comm):
    """gloo's own reduce-scatter (not the default on gloo, where an all-to-all plus a local
    reduction in rank order is faster) gives the same results and byte counts."""
    c = comm.split([list(range(comm.size))])
    c._native_reduce_scatter = True
    try:
        return [check_all_ops(c, dtype, 5)[0] for dtype in ("float32", "bfloat16", "int16")]
    finally:
        c._native_reduce_scatter = False



def chunks_of_one_tensor(comm, dtype_name: str = "float32"):
    """All-to-all and reduce-scatter of chunks that are views of one tensor: split along dim 0
    (back to back in its storage, sent in place) and along dim 1 (packed). Results equal those of
    separate chunks, the input is unchanged and no result shares its storage."""
    dtype = getattr(torch, dtype_name)
    P, r = comm.size, comm.rank
    sizes = [d % 2 + 1 for d in range(P)]
    for dim, shape in ((0, (sum(sizes), 5)), (1, (3, sum(sizes)))):
        for_me = [data(shape, s, 50 + dim, dtype).split(sizes, dim)[r] for s in range(P)]
        x = data(shape, r, 50 + dim, dtype)
        x0 = x.clone()
        chunks = list(x.split(sizes, dim))
        got = comm.alltoall(chunks, recv_shapes=[tuple(chunks[r].shape)] * P)
        for s in range(P):
            _equal(got[s], for_me[s], f"alltoall dim {dim} [{s}]")
        got.append(comm.reduce_scatter(chunks))
        _equal(got[-1], REDUCE["sum"](for_me), f"reduce_scatter dim {dim}")
        _equal(x, x0, f"input of dim {dim} unchanged")
        storage = x.untyped_storage().data_ptr()
        assert all(g.untyped_storage().data_ptr() != storage for g in got), "result aliases input"
    return comm.backend


# ---------------------------------------------------------------- the host channel (gloo)
def host_channel_routes(comm):
    """Small collectives go through the shared-memory channel, opened at the first one, its
    file already unlinked; a larger allreduce through the bulk channel (its file unlinked too),
    one larger than a bulk slot in chunks, consuming its input or not; an allgather larger than
    a small slot through the bulk one, and one larger than a bulk slot on gloo; all kinds in
    flight at once complete correctly, waited for in reverse order; bytes are counted as for
    gloo."""
    import glob

    from distconv.comm.host_channel import BULK_BYTES, SLOT_BYTES, HostChannel

    c = comm.split([list(range(comm.size))], timeout=29.0)
    P, r = c.size, c.rank
    c.stats.reset()
    got = c.allreduce(torch.full((3,), float(r)))
    _equal(got, torch.full((3,), float(sum(range(P)))), "small allreduce")
    opened = isinstance(c._host, HostChannel)
    pid = int(c.broadcast(torch.tensor([os.getpid()]), root=0)[0])
    issued = c._host._issued if opened else 0
    n_big = SLOT_BYTES // 4 + 1
    big = c.allreduce(torch.full((n_big,), float(r + 1)))
    _equal(big, torch.full((n_big,), float(P * (P + 1) // 2)), "big allreduce")
    bulk = isinstance(c._bulk, HostChannel) and c._host._issued == issued
    c.barrier()
    no_file_left = not glob.glob(f"/dev/shm/distconv-{pid}-*")
    n_huge = 2 * BULK_BYTES // 8 + 3  # three chunks, the last of 3 elements
    huge = torch.arange(n_huge, dtype=torch.float64) * (r + 1)
    w_huge = c.allreduce(huge, async_op=True, consume=True)
    w_big = c.allreduce(torch.full((n_big,), 1.0), async_op=True)
    w_small = c.allreduce(torch.tensor([r], dtype=torch.int64), async_op=True)
    w_gather = c.allgather(torch.tensor([r, -r]), async_op=True)
    in_bulk = c._bulk._issued if bulk else 0
    w_wide = c.allgather(torch.full((n_big,), float(r)), async_op=True)  # the bulk ring
    wide_in_bulk = bulk and c._bulk._issued == in_bulk + 1
    n_gloo = BULK_BYTES // 4 + 1
    w_gloo = c.allgather(torch.full((n_gloo,), float(r)), async_op=True)  # beyond it: gloo
    gloo_outside = bulk and c._bulk._issued == in_bulk + 1
    wide = w_wide.wait()
    on_gloo = w_gloo.wait()
    gathered = w_gather.wait()
    _equal(w_small.wait(), torch.tensor([sum(range(P))]), "small async allreduce")
    _equal(w_big.wait(), torch.full((n_big,), float(P)), "big async allreduce")
    summed = w_huge.wait()
    _equal(summed, torch.arange(n_huge, dtype=torch.float64) * (P * (P + 1) // 2),
           "chunked allreduce")
    for s in range(P):
        _equal(gathered[s], torch.tensor([s, -s]), f"allgather[{s}]")
        _equal(wide[s], torch.full((n_big,), float(s)), f"wide allgather[{s}]")
        _equal(on_gloo[s], torch.full((n_gloo,), float(s)), f"allgather on gloo[{s}]")
    c.barrier()
    expected = (allreduce_bytes(3, r, P, 4) + 2 * allreduce_bytes(n_big, r, P, 4)
                + allreduce_bytes(n_huge, r, P, 8) + allreduce_bytes(1, r, P, 8)
                + (P - 1) * (2 * 8 + n_big * 4 + n_gloo * 4) + (0 if r == 0 else 8))
    return {"opened": opened, "no_file_left": no_file_left,
            "big_on_bulk": bulk and wide_in_bulk and gloo_outside,
            "consumed_in_place": summed.data_ptr() == huge.data_ptr(), "bytes": c.stats.total_bytes(),
            "bytes_expected": expected}


def alltoall_routes(comm):
    """An all-to-all given the bound on every rank's bytes goes through the small ring where it
    fits a slot, through the bulk ring where it fits a bulk slot, and without the bound over
    gloo; uneven and empty chunks, in flight together, arrive where they should; a bound below
    this rank's bytes is refused before anything moves; bytes are counted as for gloo."""
    from distconv.comm.host_channel import SLOT_BYTES, HostChannel

    c = comm.split([list(range(comm.size))], timeout=29.0)
    P, r = c.size, c.rank
    c.allreduce(torch.zeros(1))  # the small ring, opened
    c.allreduce(torch.zeros(SLOT_BYTES // 4 + 1))  # and the bulk one
    assert isinstance(c._host, HostChannel) and isinstance(c._bulk, HostChannel)
    c.stats.reset()

    def rows(src, dst, scale):  # uneven, some empty
        return ((src + 2 * dst) % 3) * scale

    def chunk(src, dst, scale):
        return torch.arange(rows(src, dst, scale) * 2, dtype=torch.float64).view(-1, 2) + (
            1000 * src + 100 * dst)

    def call(scale, bounded):
        most = max(sum(rows(s, d, scale) for d in range(P)) for s in range(P)) * 2 * 8
        return c.alltoall([chunk(r, d, scale) for d in range(P)],
                          recv_shapes=[(rows(s, r, scale), 2) for s in range(P)],
                          async_op=True, max_bytes=most if bounded else None)

    small, bulk = c._host._issued, c._bulk._issued
    wide = SLOT_BYTES // 16 // 2 + 1  # a rank's rows then pass a small slot
    works = [(1, call(1, True)), (wide, call(wide, True)), (1, call(1, False))]
    routed = (c._host._issued - small, c._bulk._issued - bulk)
    refused = ""
    try:
        c.alltoall([chunk(r, d, 1) for d in range(P)],
                   recv_shapes=[(rows(s, r, 1), 2) for s in range(P)], max_bytes=0)
    except ValueError as exc:
        refused = str(exc)
    for scale, work in reversed(works):
        got = work.wait()
        for s in range(P):
            _equal(got[s], chunk(s, r, scale), f"alltoall of scale {scale} from rank {s}")
    expected = sum(rows(s, r, scale) * 2 * 8 for scale, _ in works for s in range(P) if s != r)
    return {"routed": routed, "refused": refused, "bytes": c.stats.total_bytes(),
            "bytes_expected": expected}


def bulk_ring_routes(comm):
    """On any backend whose ranks share this host (MPI here): an allreduce larger than a small
    slot takes the bulk ring, opened at the first one, its file unlinked; one of three chunks
    consumes its input and is exact; small ones and bool ones stay on the backend. A
    reduce-scatter of at least 32 KiB takes the ring too, a smaller one the backend."""
    import glob

    from distconv.comm.host_channel import BULK_BYTES, HostChannel

    c = comm.split([list(range(comm.size))], timeout=29.0)
    P, r = c.size, c.rank
    c.stats.reset()
    _equal(c.allreduce(torch.full((3,), float(r))), torch.full((3,), float(sum(range(P)))),
           "small allreduce")
    small_on_backend = c._bulk is True  # not opened by a small one
    pid = int(c.broadcast(torch.tensor([os.getpid()]), root=0)[0])
    n = 2 * BULK_BYTES // 8 + 3
    huge = torch.arange(n, dtype=torch.float64) * (r + 1)
    summed = c.allreduce(huge, consume=True)
    _equal(summed, torch.arange(n, dtype=torch.float64) * (P * (P + 1) // 2), "chunked allreduce")
    flags = c.allreduce(torch.full((BULK_BYTES + 1,), r == 0))  # bool: the backend's any
    _equal(flags, torch.ones(BULK_BYTES + 1, dtype=torch.bool), "bool allreduce")
    # a reduce-scatter of an activation's size (uneven chunks, 40 KiB in all) through the ring,
    # a small one on the backend; both exact
    issued = c._bulk._issued
    routed = []
    for total in (10_000, 97):
        sizes = [total // P + (d < total % P) for d in range(P)]
        chunks = list((torch.arange(total, dtype=torch.float32) * (r + 1)).split(sizes))
        want = torch.arange(total, dtype=torch.float32).split(sizes)[r] * (P * (P + 1) // 2)
        _equal(c.reduce_scatter(chunks), want, f"reduce_scatter of {total} floats")
        routed.append(c._bulk._issued - issued)
        issued = c._bulk._issued
    c.barrier()
    return {"bulk": isinstance(c._bulk, HostChannel), "small_on_backend": small_on_backend,
            "reduce_scatter_routes": routed,
            "no_file_left": not glob.glob(f"/dev/shm/distconv-{pid}-*"),
            "in_place": summed.data_ptr() == huge.data_ptr(), "bytes": c.stats.total_bytes(),
            "bytes_expected": (allreduce_bytes(3, r, P, 4) + allreduce_bytes(n, r, P, 8)
                               + allreduce_bytes(BULK_BYTES + 1, r, P, 1) + (0 if r == 0 else 8)
                               + 4 * (P - 1) * (10_000 // P + (r < 10_000 % P) + 97 // P
                                                + (r < 97 % P)))}


def split_without_host_channel(comm):
    """A communicator over every rank of ``comm`` split with DISTCONV_HOST_CHANNEL=0: it opens no
    shared-memory channel, so its collectives run on the backend alone."""
    old = os.environ.get("DISTCONV_HOST_CHANNEL")
    os.environ["DISTCONV_HOST_CHANNEL"] = "0"
    try:
        return comm.split([list(range(comm.size))], timeout=28.0)
    finally:
        if old is None:
            del os.environ["DISTCONV_HOST_CHANNEL"]
        else:
            os.environ["DISTCONV_HOST_CHANNEL"] = old


def without_host_channel(comm):
    """With DISTCONV_HOST_CHANNEL=0 a new communicator opens no channel and passes every check
    on gloo alone."""
    c = split_without_host_channel(comm)
    for dtype in ("float32", "bfloat16", "int16"):
        programs_snap, backend = check_all_ops(c, dtype, 3)
    from distconv.comm.host_channel import SLOT_BYTES

    n = SLOT_BYTES // 4 + 1  # beyond a small slot: the bulk ring's, were it on
    _equal(c.allreduce(torch.full((n,), float(c.rank + 1))),
           torch.full((n,), float(c.size * (c.size + 1) // 2)), "large allreduce on gloo")
    return {"channel": c._host or None, "bulk": c._bulk or None, "backend": backend}


def dead_peer_in_channel(comm, timeout: float, path: str, elements: int = 2):
    """The last rank exits while the others wait in an allreduce of ``elements`` float32s (the
    small ring's, or the bulk ring's in chunks); rank 0 writes the seconds it waited and its
    error to ``path`` (the pool reports the exit itself)."""
    c = comm.split([list(range(comm.size))], timeout=timeout)
    c.allreduce(torch.ones(elements))
    if c.rank == c.size - 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        c.allreduce(torch.ones(elements))
    except CommError as exc:
        if c.rank == 0:
            with open(path, "w") as f:
                f.write(f"{time.monotonic() - t0:.3f} {type(exc).__name__}: {exc}")
        raise
    raise AssertionError("allreduce with a dead peer returned")


def host_sibling(comm):
    """The gloo group an NCCL communicator makes for control messages, made here from a gloo
    communicator by the same code: the same ranks in the same order, its own group, its bytes
    counted in the parent's stats, closed with it."""
    c = comm.split([list(range(comm.size))], timeout=27.0)
    assert c.host is c  # gloo moves CPU tensors itself
    sib = c._gloo_sibling()
    before = c.stats.total_bytes()
    got = sib.allgather(torch.tensor([c.rank, 10 * c.rank]))
    _equal(torch.stack(got), torch.tensor([[s, 10 * s] for s in range(c.size)]), "sibling")
    counted = c.stats.total_bytes() - before
    sib.close()
    return sib.rank, sib.size, sib.backend, counted


def host_channel_without_room(comm):
    """A /dev/shm without room for the channel (its pages cannot be allocated): no channel, no
    file left behind, and every collective on gloo alone."""
    import errno
    import glob

    real = getattr(os, "posix_fallocate", None)

    def full(fd, offset, length):  # noqa: ANN001, ANN202
        raise OSError(errno.ENOSPC, "No space left on device")

    os.posix_fallocate = full
    try:
        c = comm.split([list(range(comm.size))], timeout=26.0)
        got = c.allreduce(torch.full((3,), float(c.rank)))
    finally:
        if real is None:
            del os.posix_fallocate
        else:
            os.posix_fallocate = real
    _equal(got, torch.full((3,), float(sum(range(c.size)))), "allreduce without a channel")
    pid = int(c.broadcast(torch.tensor([os.getpid()]), root=0)[0])
    return {"channel": c._host, "no_file_left": not glob.glob(f"/dev/shm/distconv-{pid}-*")}


def planned_collectives(comm, debug_too: bool = True):
    """The collectives of redistribution plans (``_allgather_along``, ``_reduce_scatter_along``)
    against references built here from every rank's inputs: blocks along dims 0, 1 and 2, equal
    and uneven, small (the backend) and of an activation's size (the shared-memory ring where
    the ranks share this host), fp32, fp64 and bf16; the calls and bytes counted as the public
    calls count them; in debug mode the same values through the public calls. Returns, per
    case, the ring operations each call issued."""
    P, r = comm.size, comm.rank
    routes = {}
    ring = getattr(comm, "_bulk_channel", lambda: None)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for dim, big in ((0, False), (1, False), (1, True), (2, True)):
            for uneven in (False, True):
                base = [3, 6, 4, 5] if big else [2, 3, 1, 2]
                base[dim] = 4 * P if big else P
                shape = tuple(base)
                n = shape[dim]
                sizes = ([n // P + (d < n % P) for d in range(P)] if not uneven
                         else [(d % 2) + (2 if big else 0) for d in range(P)])
                total = list(shape)
                total[dim] = sum(sizes)
                if big:  # an activation's size: more than a small ring slot (32 KiB) per rank
                    total[-1] *= 256
                blocks = [data([*total[:dim], sizes[s], *total[dim + 1:]], s, 40 + dim, dtype)
                          for s in range(P)]
                what = f"{dtype} dim {dim} sizes {sizes} of {tuple(total)}"
                shapes = [tuple(b.shape) for b in blocks]
                for debug in (False, True) if debug_too else (False,):
                    set_debug(debug)
                    try:
                        before = comm.stats.snapshot()
                        issued = getattr(ring() if not debug else None, "_issued", 0)
                        got = comm._allgather_along(blocks[r], shapes, dim, "planned allgather")
                        _equal(got, torch.cat(blocks, dim), f"allgather along: {what}")
                        full = data(total, r, 50 + dim, dtype)
                        part = comm._reduce_scatter_along(full, sizes, dim, "planned rs")
                        want = sum(data(total, s, 50 + dim, dtype).split(sizes, dim)[r]
                                   for s in range(P))
                        _equal(part, want.to(dtype), f"reduce-scatter along: {what}")
                        after = comm.stats.snapshot()
                    finally:
                        set_debug(False)
                    if not debug:
                        width = max(b.numel() for b in blocks) * blocks[0].element_size()
                        routes[what] = (big, width, full.numel() * full.element_size(),
                                        getattr(ring(), "_issued", 0) - issued)
                    for op, nbytes in (
                            ("allgather", sum(math.prod(s) for i, s in enumerate(shapes)
                                              if i != r) * blocks[0].element_size()),
                            ("reduce_scatter", (P - 1) * want.numel() * want.element_size())):
                        calls = after["calls"][op] - before["calls"].get(op, 0)
                        got_bytes = after["bytes"][op] - before["bytes"].get(op, 0)
                        assert (calls, got_bytes) == (1, nbytes), (what, op, calls, got_bytes)
    return routes
