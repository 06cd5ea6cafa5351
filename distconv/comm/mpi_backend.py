"""mpi4py communicator for MPI-launched jobs (``mpiexec -n P python ...``).

Buffers are numpy views of torch CPU tensors (no staging copies, except where an operation needs
one contiguous send buffer: the chunks of a reduce-scatter or an all-to-all are concatenated,
unless they already lie back to back in one storage, see :func:`~distconv.comm.base.flat_concat`).

- Data movement (allgatherv, alltoallv, broadcast, send/recv) is done on byte views
  (``MPI.BYTE``), so every dtype moves bit for bit, bf16 and bool included.
- Reductions use the MPI datatype of the numpy view. bf16 and fp16 have none: they are reduced
  in fp32 and rounded back once (never a reduction on reinterpreted bits); bool is reduced as
  int32 (sum/max: any, prod/min: all); ``avg`` is a sum divided by the size.
- A blocking MPI call cannot be interrupted, so every operation is issued non-blocking
  (Iallreduce, Iallgatherv, Ireduce_scatter, Ialltoallv, Ibcast, Ibarrier, Isend/Irecv) and
  polled against a deadline; past it, :class:`CommTimeoutError` names rank, backend and op.
  After a timeout the communicator is unusable (the request cannot be cancelled).
- Each kind of operation runs on its own duplicate of the communicator, so ranks that enter
  different kinds of collective (one allreduce, one allgather) never match each other's
  messages: they time out instead of exchanging garbage. Ranks entering the same collective
  with different sizes cannot be detected without an exchange; debug mode does that.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable

import numpy as np
import torch

from distconv.comm.base import AlltoallBuffers, Communicator, Shape, Work, flat_concat
from distconv.comm.errors import CommError, CommTimeoutError
from distconv.comm.host_channel import (
    BULK_BYTES, BULK_SLOTS, SLOT_BYTES, HostChannel, enabled as host_channel_enabled, name_buffer,
    name_of, open_ring,
)
from distconv.comm.single import SingleCommunicator

__all__ = ["MPICommunicator", "init_mpi"]

_KINDS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast", "barrier", "p2p")
_WIDEN = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.bool: torch.int32}
_SPIN_S = 5e-3  # how long a wait only yields the core before it starts sleeping
_POLL_S = 50e-6  # how long it only polls, before it starts yielding
#: and, for an operation of many bytes, this much longer per byte it moves (1 GB/s): a wait
#: must not sleep while the transfer itself, progressed only by the tests, is under way
_SPIN_PER_BYTE = 1e-9


#: reduce-scatters of at least this many bytes (all chunks together) up to one bulk slot go
#: through the bulk ring where every rank shares this host: a channel- or filter-parallel
#: layer's activation gradients. On 2 ranks MPICH's Ireduce_scatter took 81 / 117 µs for 128 /
#: 256 KiB in all, the ring 73 / 92 µs (interleaved medians); at 32 KiB they were alike (64 /
#: 67 µs), at 8 KiB MPICH's was the faster (33 against 44 µs)
RING_REDUCE_SCATTER = 32 << 10
#: a planned allgather along a dim (a channel- or filter-parallel layer's activations) of at
#: least this many bytes per rank, up to one bulk slot, goes through the bulk ring, which
#: concatenates straight out of shared memory. On 2 ranks, 8 / 64 / 256 KiB per rank took
#: MPICH's allgather 38 / 54 / 118 us and the ring 31 / 48 / 105 us (interleaved medians),
#: before the concatenation that the ring's read does in its one copy
RING_ALLGATHER = 8 << 10


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


def _bytes_np(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def _pause(waited: float, spin: float = _SPIN_S) -> None:
    """Between two tests of a pending request that has been waited on for ``waited`` seconds.

    MPI progresses a non-blocking operation only inside MPI calls, so a sleep stalls every
    message still to be exchanged (a 0.4 MB all-to-all on 2 ranks polled with sleeps from the
    start took 0.8 ms, the blocking call 0.07-0.3 ms). For the first ``_SPIN_S`` this rank only
    yields the core, as a blocking MPI call spins; later it sleeps at most 1/20 of the time
    already waited (1 ms at most), so a long wait costs little CPU and at most ~5% more time.
    The first ``_POLL_S`` it does not even yield: a small collective needs a dozen tests to
    progress, and a yield between each (a system call) doubled its latency. ``spin`` replaces
    ``_SPIN_S`` for an operation of many bytes: a 16 MiB allreduce on 2 ranks, which MPICH
    pipelines through many tests, took 21-23 ms polled with sleeps after 5 ms and 6.4-9.0 ms
    (the blocking call: 6.3-6.8 ms) spun for as long as its bytes take at 1 GB/s.
    """
    if waited < _POLL_S:
        return
    if waited < spin:
        os.sched_yield()
    else:
        time.sleep(min(1e-3, waited / 20))


def _displs(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


class MPICommunicator(Communicator):
    """An ``mpi4py`` communicator (``backend == "mpi"``); CPU tensors."""

    backend = "mpi"

    def __init__(self, comm: Any, *, timeout: float = 60.0, parent: Communicator | None = None):
        super().__init__(rank=comm.Get_rank(), size=comm.Get_size(), timeout=timeout, parent=parent)
        self._comm = comm
        self._MPI = _mpi()
        self._by_op = {kind: comm.Dup() for kind in _KINDS}
        MPI = self._MPI
        self._ops = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX,
                     "min": MPI.MIN}
        # the bulk ring of large allreduces where every rank shares this host (opened at the
        # first one): through memory they take what a copy and a sum take, where a 16 MiB
        # non-blocking allreduce took MPICH 7-20 ms (its blocking call 5-7)
        self._bulk: HostChannel | None | bool = self.size > 1 and host_channel_enabled()

    # ---------------------------------------------------------------- polling
    def _issue(self, opname: str, start, finish, nbytes: int = 0) -> Work:
        MPI = self._MPI
        if not self._by_op:
            raise CommError(
                f"rank {self.rank}, backend 'mpi', op {opname!r}: the communicator is closed "
                "(distconv.comm.shutdown() or close() released it)"
            )
        deadline = time.monotonic() + self.timeout
        spin = _SPIN_S + nbytes * _SPIN_PER_BYTE  # (the bytes this rank sends and receives)
        try:
            reqs = start()
        except MPI.Exception as exc:
            raise self._error(opname, exc) from exc
        if isinstance(reqs, list):
            done: Callable[[], bool] = lambda: MPI.Request.Testall(reqs)  # noqa: E731
        else:
            done = reqs.Test  # one request (a collective): its own test, no list

        def wait() -> Any:
            begin = time.monotonic()
            try:
                while not done():
                    now = time.monotonic()
                    if now > deadline:
                        raise CommTimeoutError(
                            f"rank {self.rank}, backend 'mpi', op {opname!r}: did not complete "
                            f"within {self.timeout} s (a peer is missing, dead, or in a "
                            "different collective)"
                        )
                    _pause(now - begin, spin)
            except MPI.Exception as exc:
                raise self._error(opname, exc) from exc
            return finish()

        # ``start`` holds every buffer the operation was started with (a widened copy, a
        # concatenated send buffer, a temporary block to send): MPI may read and write them until
        # the request completes (Open MPI reads a send buffer during progress, not in the call),
        # so the Work keeps them until it completes, never only as long as the call
        return Work(wait, test_fn=done, keep=start)

    def _error(self, opname: str, exc: BaseException) -> CommError:
        return CommError(f"rank {self.rank}, backend 'mpi', op {opname!r}: {exc}")

    def _reduce_buffers(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
        wide = _WIDEN.get(t.dtype)
        return (t.to(wide), wide) if wide is not None else (t, None)

    def _mpi_op(self, op: str) -> Any:
        return self._ops[op]

    @staticmethod
    def _narrow(res: torch.Tensor, dtype: torch.dtype, op: str, size: int) -> torch.Tensor:
        if op == "avg":
            res = res / size
        if dtype == torch.bool:
            return res != 0
        return res.to(dtype) if res.dtype != dtype else res

    # ---------------------------------------------------------------- operations
    def _bulk_channel(self) -> HostChannel | None:
        """The bulk ring, or None: MPI carries large allreduces. Opened collectively at the
        first call (every rank makes it: the sizes and dtype are the same on every rank)."""
        if self._bulk is True:
            if not self._by_op:
                return None
            self._bulk = open_ring(self, slots=BULK_SLOTS, slot_bytes=BULK_BYTES)
        return self._bulk or None

    def _broadcast_name(self, name: str) -> str:
        return name_of(self._broadcast(name_buffer(name, self.rank), 0).wait())

    def _all_ok(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        out = torch.empty_like(flag)
        self._issue("allreduce", lambda: self._by_op["allreduce"].Iallreduce(
            flag.numpy(), out.numpy(), op=self._MPI.MIN), lambda: None).wait()
        return bool(out[0])

    def _allreduce(self, t: torch.Tensor, op: str, consume: bool = False) -> Work:
        if t.numel() * t.element_size() > SLOT_BYTES and t.dtype != torch.bool:
            bulk = self._bulk_channel()
            if bulk is not None:
                return bulk.allreduce(t, op, out=t if consume else None)
        src, wide = self._reduce_buffers(t)
        if src.numel() == 0:
            return Work.completed(torch.empty_like(t))
        # consuming: reduced in t's own storage (MPI_IN_PLACE), no new buffer whose pages the
        # reduction first faults in (a gradient bucket of megabytes each step)
        in_place = consume and wide is None
        out = src if in_place else torch.empty_like(src)
        send = self._MPI.IN_PLACE if in_place else src.numpy()

        def finish() -> torch.Tensor:
            if in_place:
                return out.div_(self.size) if op == "avg" else out
            return self._narrow(out, t.dtype, op, self.size)

        return self._issue(
            "allreduce",
            lambda: self._by_op["allreduce"].Iallreduce(send, out.numpy(), op=self._mpi_op(op)),
            finish,
            2 * src.numel() * src.element_size(),
        )

    def _allreduce_consuming(self, t: torch.Tensor, op: str) -> Work:
        return self._allreduce(t, op, consume=True)

    def _allgather(self, t: torch.Tensor, shapes: list[Shape], opname: str) -> Work:
        isz = t.element_size()
        B = self._MPI.BYTE
        if all(s == shapes[0] for s in shapes):
            # one shape (a BatchNorm's statistics): the plain allgather, its result viewed as
            # the P tensors (the v-variant's count lists and the split cost more than the call)
            shape = tuple(shapes[0])
            out = torch.empty((self.size, math.prod(shape) * isz), dtype=torch.uint8)
            return self._issue(
                opname,
                lambda: self._by_op["allgather"].Iallgather([_bytes_np(t), B], [out.numpy(), B]),
                lambda: list(out.view(t.dtype).view(self.size, *shape).unbind(0)),
                out.numel(),
            )
        counts = [torch.Size(s).numel() * isz for s in shapes]
        out = torch.empty(sum(counts), dtype=torch.uint8)

        def finish() -> list[torch.Tensor]:
            return [p.view(t.dtype).view(s) for p, s in zip(out.split(counts), shapes)]

        return self._issue(
            opname,
            lambda: self._by_op["allgather"].Iallgatherv(
                [_bytes_np(t), B], [out.numpy(), counts, _displs(counts), B]
            ),
            finish,
            out.numel(),
        )

    def _allgather_cat(self, t: torch.Tensor, shapes: list[Shape], dim: int) -> torch.Tensor:
        width = max(math.prod(s) for s in shapes) * t.element_size()
        if RING_ALLGATHER <= width <= BULK_BYTES:
            bulk = self._bulk_channel()
            if bulk is not None:  # (the shapes are every rank's: the same choice everywhere)
                return bulk.allgather(t, shapes, "allgather", dim=dim).wait()
        return super()._allgather_cat(t, shapes, dim)

    def _reduce_scatter_ring(self, nbytes: int, dtype: torch.dtype) -> HostChannel | None:
        """The bulk ring for a reduce-scatter of ``nbytes`` in all (every rank's chunks have
        the same shapes: the same choice everywhere), or None: MPI carries it."""
        if RING_REDUCE_SCATTER <= nbytes <= BULK_BYTES and dtype != torch.bool:
            return self._bulk_channel()
        return None

    def _reduce_scatter_dim(self, x: torch.Tensor, sizes: list[int], dim: int) -> torch.Tensor:
        bulk = self._reduce_scatter_ring(x.numel() * x.element_size(), x.dtype)
        if bulk is not None:
            return bulk.reduce_scatter_along(x, sizes, dim, "sum").wait()
        return super()._reduce_scatter_dim(x, sizes, dim)

    def _reduce_scatter(self, chunks: list[torch.Tensor], op: str) -> Work:
        dtype = chunks[0].dtype
        bulk = self._reduce_scatter_ring(sum(c.numel() for c in chunks)
                                         * chunks[0].element_size(), dtype)
        if bulk is not None:
            return bulk.reduce_scatter(chunks, op)
        mine = chunks[self.rank].shape
        wide = _WIDEN.get(dtype)
        flat = flat_concat(chunks)
        if wide is not None:
            flat = flat.to(wide)
        counts = [c.numel() for c in chunks]
        out = torch.empty(mine, dtype=flat.dtype)
        return self._issue(
            "reduce_scatter",
            lambda: self._by_op["reduce_scatter"].Ireduce_scatter(
                flat.numpy(), out.reshape(-1).numpy(), counts, op=self._mpi_op(op)
            ),
            lambda: self._narrow(out, dtype, op, self.size),
            flat.numel() * flat.element_size(),
        )

    def _alltoall(self, chunks: list[torch.Tensor], recv_shapes: list[Shape]) -> Work:
        buf = AlltoallBuffers(chunks, recv_shapes)
        B = self._MPI.BYTE
        return self._issue(
            "alltoall",
            lambda: self._by_op["alltoall"].Ialltoallv(
                [buf.send.numpy(), buf.send_counts, _displs(buf.send_counts), B],
                [buf.recv.numpy(), buf.recv_counts, _displs(buf.recv_counts), B],
            ),
            buf.received,
            buf.send.numel() + buf.recv.numel(),
        )

    def _broadcast(self, t: torch.Tensor, root: int) -> Work:
        out = t.clone() if self.rank == root else torch.empty_like(t)
        return self._issue(
            "broadcast",
            lambda: self._by_op["broadcast"].Ibcast([_bytes_np(out), self._MPI.BYTE], root=root),
            lambda: out,
            out.numel() * out.element_size(),
        )

    def _barrier(self) -> Work:
        return self._issue("barrier", lambda: self._by_op["barrier"].Ibarrier(), lambda: None)

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> Work:
        return self._issue(
            "send",
            lambda: self._by_op["p2p"].Isend([_bytes_np(t), self._MPI.BYTE], dest=dst, tag=tag),
            lambda: None,
        )

    def _recv(self, shape: Shape, dtype: torch.dtype, src: int, tag: int) -> Work:
        out = torch.empty(shape, dtype=dtype)
        return self._issue(
            "recv",
            lambda: self._by_op["p2p"].Irecv([_bytes_np(out), self._MPI.BYTE], source=src, tag=tag),
            lambda: out,
        )

    def _release(self) -> None:
        """Free the duplicated communicators (before mpi4py finalizes MPI at exit)."""
        bulk, self._bulk = self._bulk, None
        if isinstance(bulk, HostChannel):
            bulk.close()
        comms = list(self._by_op.values()) + [self._comm]
        self._by_op = {}
        MPI = self._MPI
        for c in comms:
            if c != MPI.COMM_NULL and c != MPI.COMM_WORLD and not MPI.Is_finalized():
                c.Free()

    def _split(self, groups, index, timeout) -> Communicator:
        members = groups[index]
        if len(members) == 1:
            return SingleCommunicator(timeout=timeout, parent=self)
        MPI = self._MPI
        try:
            group = self._comm.Get_group().Incl(list(members))
            sub = self._comm.Create_group(group, tag=index)
            group.Free()
        except MPI.Exception as exc:
            raise self._error("split", exc) from exc
        return MPICommunicator(sub, timeout=timeout, parent=self)


def init_mpi(*, timeout: float = 60.0) -> MPICommunicator:
    """The MPI world (a duplicate of ``COMM_WORLD``, so our traffic never meets the user's)."""
    MPI = _mpi()
    return MPICommunicator(MPI.COMM_WORLD.Dup(), timeout=timeout)
