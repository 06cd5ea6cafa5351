"""Small collectives through shared memory, for the ranks of one communicator on one host.

A gloo collective of a few hundred bytes between two processes on one machine costs 0.4-2 ms
(``benchmarks/latency.py``): two TCP round trips through gloo's worker threads. Global-batch
BatchNorm runs two such collectives per layer and step (its statistics forward, its sums
backward), the entry one more (the global batch), so a network of 20 BatchNorms waited 30 ms per
step on latency alone. Through memory both ranks can read the same collective takes a few
microseconds, as MPI's shared-memory transport does.

:class:`HostChannel` is that transport for one communicator: a ring of ``SLOTS`` slots, each
holding one payload of at most ``SLOT_BYTES`` per rank, in one file in ``/dev/shm`` that every
rank maps (rank 0 creates it, the others open it, rank 0 unlinks it once all have it mapped, so
no file outlives the run). Operation ``i`` uses slot ``i % SLOTS``:

* *issue*: wait until every rank has read operation ``i - SLOTS`` (its slot is free), write this
  rank's header and payload, then publish ``seq[rank] = i``;
* *wait*: wait until every ``seq[r] >= i``, check that every rank's header describes the same
  collective (else :class:`~distconv.comm.errors.CollectiveMismatchError`), compute the result
  from the payloads (a reduction in rank order, the same on every rank), then publish
  ``done[rank] = i``.

Operations complete in issue order (waiting for one first reads every earlier one). The writes
are ordered as the program orders them and x86-64 stores and loads are not reordered against
each other, so a reader that sees ``seq[r] >= i`` sees rank r's payload; the channel is used only
on x86-64 hosts. A wait yields the core while it spins, sleeps after a few milliseconds (after
50 us where the host's ranks outnumber its cores), and raises
:class:`~distconv.comm.errors.CommTimeoutError` after the communicator's timeout, or
:class:`~distconv.comm.errors.CommError` as soon as a rank it waits for has exited (each rank
records its process id and start time; checked where every rank sees the others' processes).

The communicator decides per call, from what every rank knows alike (the dtype and shapes of an
allreduce, allgather, broadcast or reduce-scatter), whether the payload fits; larger ones go to
its backend. A rank knows only its own row and column of an all-to-all's sizes, so an all-to-all
takes a ring only where the caller gives the bound on every rank's bytes (``max_bytes``: the
halo exchanges and the transitions between layers' layouts know it from their plans); its
payload starts with the rank's byte offsets per destination, which each reader looks its chunk
up in. Through gloo, two processes exchanged a halo in 0.7-1 ms (TCP); a spatially split
network's steps, of a dozen exchanges, took 60% longer on gloo than on MPI before.

Large allreduces (the gradient buckets of data parallelism) have a second channel of their own,
the *bulk* channel, on gloo and on MPI communicators: the same protocol over :data:`BULK_SLOTS`
slots of :data:`BULK_BYTES` per rank, opened at the first allreduce larger than a small slot;
an allreduce larger than a bulk slot goes as consecutive operations of one slot each. Through
gloo, two processes on this machine allreduced 4 MiB in 7 ms and 16 MiB in 22 ms (TCP through
the kernel, on gloo's threads), and MPICH's non-blocking allreduce took 7-20 ms for 16 MiB;
through memory it is a copy in, the reduction and nothing else (3-4 ms). On gloo the bulk ring
also carries allgathers, broadcasts and reduce-scatters of up to a bulk slot per rank (the
activations a channel- or filter-parallel layer exchanges): 128 KiB reduce-scattered in 86 us
and allgathered in 68 us, against 0.7 and 1.0 ms through gloo. Each rank reduces
every chunk itself, when it waits (or needs the slot again): no rank waits on another's
progress past its issue, as with the small operations, so mixing channel and backend
operations cannot deadlock.

``DISTCONV_HOST_CHANNEL=0`` turns both channels off.
"""

from __future__ import annotations

import functools
import itertools
import math
import mmap
import os
import platform
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from distconv.comm.base import Shape, Work
from distconv.comm.errors import CollectiveMismatchError, CommError, CommTimeoutError
# the framing's public names stay importable from here, where the backends take them
from distconv.comm.host_framing import (  # noqa: F401
    NAME_BYTES, _reduce_rows, _signature, alltoall_bytes, name_buffer, name_of,
)

__all__ = ["BULK_BYTES", "BULK_SLOTS", "HostChannel", "SLOTS", "SLOT_BYTES", "alltoall_bytes",
           "enabled", "name_buffer", "name_of", "open_ring"]

SLOTS = 4  #: operations in flight before a rank waits for its peers to read the oldest
SLOT_BYTES = 32 << 10  #: largest payload per rank (a 2,000-channel BatchNorm's fp64 statistics)
#: the bulk channel of large allreduces (gradient buckets): its slots, and each slot's payload
#: per rank; a larger allreduce goes through it in chunks of this size
BULK_SLOTS = 2
BULK_BYTES = 2 << 20
_CTRL = 64  # bytes per rank's control record: seq, done, pid, start time (one cache line)
_HEAD = 64  # bytes of a slot's header: op id, signature, payload bytes
_SPIN_S = 2e-3  # how long a wait only yields the core before it starts sleeping
_SPIN_OVERSUBSCRIBED_S = 50e-6  # the same where the host's ranks outnumber its cores
_LIVENESS_S = 0.1  # how often a long wait checks that the ranks it waits for are alive


def enabled() -> bool:
    """Whether communicators may use the channel here: ``DISTCONV_HOST_CHANNEL`` is not ``0``,
    and the host is x86-64 (whose memory order the protocol relies on)."""
    if os.environ.get("DISTCONV_HOST_CHANNEL", "1").strip() in ("0", "false", "off", "no"):
        return False
    return platform.machine().lower() in ("x86_64", "amd64")


def open_ring(comm: Any, *, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES
              ) -> HostChannel | None:
    """:meth:`HostChannel.open` for the communicator ``comm`` (collective over its ranks),
    through its backend's own broadcast of the file's name (``comm._broadcast_name``) and
    allreduce of a flag (``comm._all_ok``), never through a ring."""
    try:
        return HostChannel.open(
            rank=comm.rank, size=comm.size, timeout=comm.timeout,
            describe=f"rank {comm.rank}, backend {comm.backend!r}",
            broadcast_name=comm._broadcast_name, all_ok=comm._all_ok, slots=slots,
            slot_bytes=slot_bytes)
    except CommError as exc:
        # opened at the first collective that fits it: a peer missing there is reported as a
        # failure of that call (the user's allreduce), not of the setup's own broadcast
        op = getattr(comm, "_op", "")
        raise type(exc)(f"rank {comm.rank}, backend {comm.backend!r}, op {op!r}: opening the "
                        f"communicator's host channel at this call failed: {exc}") from exc


def _start_time(pid: int) -> int | None:
    """A live process's start time in clock ticks since boot (``/proc/<pid>/stat``); None where
    the process has exited (gone, or a zombie not yet reaped) or cannot be read. With its pid,
    it names one process for as long as the host is up."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: skip past its last ')'
        fields = stat[stat.rindex(b")") + 2:].split()
        return None if fields[0] in (b"Z", b"X", b"x") else int(fields[19])
    except (ValueError, IndexError):
        return None


@functools.lru_cache(maxsize=4096)
def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _local_ranks(size: int) -> int:
    """The processes of this job on this host: torchrun's ``LOCAL_WORLD_SIZE`` where set, else
    at least the channel's own ranks."""
    try:
        return max(size, int(os.environ.get("LOCAL_WORLD_SIZE", "0")))
    except ValueError:
        return size


class _Op:
    __slots__ = ("id", "kind", "read", "result")

    def __init__(self, op_id: int, kind: str, read: Callable[[], Any]) -> None:
        self.id, self.kind, self.read = op_id, kind, read
        self.result: Any = None


class HostChannel:
    """One shared-memory ring of a communicator: its small collectives' (``SLOTS`` slots of
    ``SLOT_BYTES``) or its bulk one (module docstring).

    Made collectively by :meth:`open`; ``rank`` and ``size`` are the communicator's.
    """

    def __init__(self, mm: mmap.mmap, *, rank: int, size: int, timeout: float,
                 describe: str, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> None:
        self._mm = mm
        self.rank, self.size, self.timeout = rank, size, timeout
        self.slots, self.slot_bytes = slots, slot_bytes
        self._describe = describe  # "rank r, backend 'torch-gloo'": the start of every message
        raw = torch.frombuffer(mm, dtype=torch.uint8)
        ctrl = np.ndarray((size, _CTRL // 8), dtype=np.int64, buffer=mm)
        self._ctrl = ctrl
        self._seq = ctrl[:, 0]
        self._done = ctrl[:, 1]
        stride = _HEAD + slot_bytes
        base = size * _CTRL
        self._heads = [np.ndarray((size, _HEAD // 8), dtype=np.int64, buffer=mm,
                                  offset=base + s * size * stride, strides=(stride, 8))
                       for s in range(slots)]
        # slot s as one [size, slot_bytes] byte tensor: row r is rank r's payload
        self._payloads = [raw[base + s * size * stride:base + (s + 1) * size * stride]
                          .view(size, stride)[:, _HEAD:] for s in range(slots)]
        self._mine = [p[rank] for p in self._payloads]  # this rank's row of each slot
        #: (slot, bytes, dtype) -> every rank's payload of a slot as rows of that dtype, and
        #: (slot, bytes, None) -> this rank's: the views a step's collectives use again and
        #: again, made once
        self._rows: dict[tuple[int, int, Any], list[torch.Tensor]] = {}
        self._issued = 0
        self._pending: deque[_Op] = deque()
        self._visible = [False] * size  # whose process this rank sees (set by open)
        #: a waiting rank that yields is still runnable and takes its share of a core from the
        #: ranks it waits for: where the ranks outnumber the cores, it soon sleeps instead
        self._spin_s = _SPIN_S if _local_ranks(size) <= _cores() else _SPIN_OVERSUBSCRIBED_S
        self._next_liveness = 0.0

    # ---------------------------------------------------------------- setup
    @classmethod
    def open(cls, *, rank: int, size: int, timeout: float, describe: str,
             broadcast_name: Callable[[str], str], all_ok: Callable[[bool], bool],
             slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> HostChannel | None:
        """Collective over the communicator's ranks: rank 0 creates the shared file and passes
        its path through ``broadcast_name`` (the backend's broadcast of a string); every rank maps
        it; ``all_ok`` (the backend's allreduce of a flag) says whether all could. Returns the
        channel on every rank, or None on every rank (ranks on several hosts, no ``/dev/shm``).
        ``slots`` and ``slot_bytes``: the ring's operations in flight and payload per rank (the
        bulk channel: :data:`BULK_SLOTS`, :data:`BULK_BYTES`)."""
        length = size * _CTRL + slots * size * (_HEAD + slot_bytes)
        path = ""
        if rank == 0:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
            if folder is not None:
                path = os.path.join(folder, f"distconv-{os.getpid()}-{uuid.uuid4().hex}")
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                    try:
                        os.ftruncate(fd, length)
                        # the pages now, not at the first write: a full /dev/shm then fails
                        # here (and gloo carries everything) instead of a SIGBUS mid-step
                        if hasattr(os, "posix_fallocate"):
                            os.posix_fallocate(fd, 0, length)
                    finally:
                        os.close(fd)
                except OSError:
                    if os.path.exists(path):
                        os.unlink(path)
                    path = ""
        created, mm = path, None
        try:
            path = broadcast_name(path)
            if path:
                try:
                    fd = os.open(path, os.O_RDWR)
                    try:
                        if os.fstat(fd).st_size == length:
                            mm = mmap.mmap(fd, length)
                    finally:
                        os.close(fd)
                except OSError:
                    mm = None
            if mm is not None:  # who this rank is, for its peers' liveness checks
                ctrl = np.ndarray((size, _CTRL // 8), dtype=np.int64, buffer=mm)
                ctrl[rank, 2], ctrl[rank, 3] = os.getpid(), _start_time(os.getpid()) or 0
                del ctrl
            ok = all_ok(mm is not None)  # also: every rank's record above is written
        except BaseException:
            if mm is not None:
                mm.close()
            raise
        finally:
            # every rank has it mapped, or none will use it (or the opening failed: a peer in
            # another collective): the name is no longer needed
            if created:
                try:
                    os.unlink(created)
                except OSError:
                    pass
        if not ok:
            if mm is not None:
                mm.close()
            return None
        channel = cls(mm, rank=rank, size=size, timeout=timeout, describe=describe,
                      slots=slots, slot_bytes=slot_bytes)
        ctrl = channel._ctrl
        channel._visible = [r != rank and ctrl[r, 3] > 0
                            and _start_time(int(ctrl[r, 2])) == int(ctrl[r, 3])
                            for r in range(size)]
        return channel

    def close(self) -> None:
        """Unmap the shared file (idempotent). Results handed out are copies and stay valid."""
        mm, self._mm = self._mm, None
        if mm is None:
            return
        self._pending.clear()
        self._heads, self._payloads, self._mine = [], [], []  # the views of the mapping
        self._rows = {}
        self._ctrl = self._seq = self._done = None
        try:
            mm.close()
        except BufferError:  # a view is still exported somewhere: the mapping goes with it
            pass

    # ---------------------------------------------------------------- the protocol
    def _check_open(self, kind: str) -> None:
        if self._mm is None:
            raise CommError(f"{self._describe}, op {kind!r}: the communicator is closed")

    def _spin(self, ready: Callable[[], bool], kind: str, ranks: Callable[[], list[int]]) -> None:
        """Wait until ``ready()``; ``ranks()`` names the ranks still waited for."""
        if ready():
            return
        begin = time.monotonic()
        deadline = begin + self.timeout
        while not ready():
            now = time.monotonic()
            if now > deadline:
                raise CommTimeoutError(
                    f"{self._describe}, op {kind!r}: rank(s) {ranks()} did not arrive within "
                    f"{self.timeout} s (a peer is missing, dead, or in a different collective)")
            waited = now - begin
            if waited < self._spin_s:
                os.sched_yield()
            else:
                time.sleep(min(1e-3, waited / 20))
                if now >= self._next_liveness:
                    self._next_liveness = now + _LIVENESS_S
                    self._check_alive(kind, ranks())

    def _check_alive(self, kind: str, ranks: list[int]) -> None:
        """Raise if a rank waited for has exited: its process id no longer names the process
        with its start time. Only for ranks whose process this rank could see at
        :meth:`open` (the same process namespace); others are bounded by the timeout alone."""
        for r in ranks:
            if not self._visible[r]:
                continue
            pid = int(self._ctrl[r, 2])
            if _start_time(pid) != int(self._ctrl[r, 3]):
                raise CommError(f"{self._describe}, op {kind!r}: rank {r} (process {pid}) has "
                                "exited in the middle of the collective")

    def _issue(self, kind: str, signature: int,
               payload: torch.Tensor | list[torch.Tensor] | Callable[[torch.Tensor], int] | None,
               read: Callable[[int], Any]) -> Work:
        """Write this rank's part of one operation; the Work reads everyone's (``read`` gets the
        operation's slot: :meth:`_rows_of` gives its payloads) and returns what ``read``
        returns."""
        self._check_open(kind)
        op_id = self._issued + 1
        slot = op_id % self.slots
        free = op_id - self.slots
        done = self._done
        if free > 0 and min(done.tolist()) < free:
            if done[self.rank] < free:  # this rank has not read that one yet: read it now
                self._complete_through(free)
            self._spin(lambda: min(done.tolist()) >= free, kind,
                       lambda: [r for r in range(self.size) if done[r] < free])
        nbytes = 0
        if callable(payload):  # writes this rank's row itself, gives its bytes
            nbytes = payload(self._mine[slot])
        elif isinstance(payload, torch.Tensor):  # one byte tensor: into this rank's row
            nbytes = payload.numel()
            if nbytes:
                self._view(slot, nbytes, None)[0].copy_(payload)
        else:
            for part in payload or ():  # byte tensors, back to back
                if part.numel():
                    self._mine[slot][nbytes:nbytes + part.numel()].copy_(part)
                    nbytes += part.numel()
        head = self._heads[slot][self.rank]
        head[0], head[1], head[2] = op_id, signature, nbytes
        self._issued = op_id
        self._seq[self.rank] = op_id  # last: publishes the header and payload above
        op = _Op(op_id, kind, lambda: read(slot))
        self._pending.append(op)
        return Work(lambda: self._complete_through(op_id) or op.result,
                    test_fn=lambda: self._arrived(op_id))

    def _arrived(self, op_id: int) -> bool:
        return self._mm is not None and min(self._seq.tolist()) >= op_id

    def _complete_through(self, op_id: int) -> None:
        """Read every pending operation up to ``op_id``, in issue order."""
        while self._pending and self._pending[0].id <= op_id:
            op = self._pending[0]
            self._check_open(op.kind)
            seq = self._seq
            if min(seq.tolist()) < op.id:
                self._spin(lambda: min(seq.tolist()) >= op.id, op.kind,
                           lambda: [r for r in range(self.size) if seq[r] < op.id])
            heads = self._heads[op.id % self.slots][:, :2].tolist()  # [op id, signature] per rank
            if any(h != heads[self.rank] for h in heads) or heads[0][0] != op.id:
                self._pending.popleft()
                raise CollectiveMismatchError(
                    f"{self._describe}, op {op.kind!r}: the ranks called different collectives "
                    f"(operation {op.id} on this communicator; signatures "
                    f"{[hex(h[1]) for h in heads]}); set_debug(True) names what each rank "
                    "called")
            op.result = op.read()
            self._done[self.rank] = op.id  # after the read: the slot may be written again
            self._pending.popleft()

    # ---------------------------------------------------------------- operations
    @staticmethod
    def fits(nbytes: int) -> bool:
        return nbytes <= SLOT_BYTES

    def allreduce(self, t: torch.Tensor, op: str, out: torch.Tensor | None = None) -> Work:
        """``t`` (contiguous) reduced over the ranks in rank order (every rank computes the same
        sums); the result is written into ``out`` when given (``t`` itself for a consuming
        allreduce). One larger than a slot goes in slot-sized chunks, each one operation."""
        flat = t.reshape(-1)
        per = max(1, self.slot_bytes // flat.element_size())
        if flat.numel() <= per:
            return self._allreduce_part(flat, op, out, t.shape)
        dst = out if out is not None else torch.empty_like(t)
        into = dst.view(-1)
        parts = [self._allreduce_part(flat[i:i + per], op, into[i:i + per], None)
                 for i in range(0, flat.numel(), per)]

        def wait() -> torch.Tensor:
            for w in parts:
                w.wait()
            return dst

        return Work(wait, test_fn=lambda: all(w.is_completed() for w in parts))

    def _view(self, slot: int, nbytes: int, dtype: torch.dtype | None) -> list[torch.Tensor]:
        """Every rank's first ``nbytes`` of ``slot`` as ``dtype``, or (``dtype`` None) this
        rank's as bytes: views, made once per slot and size."""
        key = (slot, nbytes, dtype)
        rows = self._rows.get(key)
        if rows is None:
            if len(self._rows) > 1024:
                self._rows.clear()
            rows = self._rows[key] = (
                [self._mine[slot][:nbytes]] if dtype is None
                else list(self._payloads[slot][:, :nbytes].view(dtype).unbind(0)))
        return rows

    def _rows_of(self, slot: int) -> torch.Tensor:
        """``slot``'s payloads as one ``[size, slot_bytes]`` byte tensor: row r is rank r's."""
        return self._payloads[slot]

    def _allreduce_part(self, flat: torch.Tensor, op: str, out: torch.Tensor | None,
                        shape: Any) -> Work:
        """One operation: ``flat`` reduced into ``out`` (returned as it is), or into a new
        tensor of ``shape``."""
        nbytes = flat.numel() * flat.element_size()
        dtype = flat.dtype
        sig = _signature("allreduce", op, dtype, flat.numel())
        if dtype in (torch.bfloat16, torch.float16) or op != "sum" or self.size != 2:
            def read(slot: int) -> torch.Tensor:
                rows = self._rows_of(slot)[:, :nbytes].view(dtype)
                if out is not None:
                    _reduce_rows(rows, op, out.view(-1))
                    return out
                return _reduce_rows(rows, op).view(shape)
        else:  # the common case, two ranks' sum: rank 0's row plus rank 1's, on cached views
            def read(slot: int) -> torch.Tensor:
                a, b = self._view(slot, nbytes, dtype)
                if out is not None:
                    torch.add(a, b, out=out.view(-1))
                    return out
                return torch.add(a, b).view(shape)

        return self._issue("allreduce", sig, flat.view(torch.uint8), read)

    def allgather(self, t: torch.Tensor, shapes: list[Shape], opname: str,
                  dim: int | None = None) -> Work:
        """Every rank's ``t`` (of shape ``shapes[r]``), copied out of the channel; with ``dim``,
        their concatenation along it, copied once, straight out of the channel."""
        isz = t.element_size()
        nbytes = [math.prod(s) * isz for s in shapes]
        width = max(nbytes)
        key = tuple(map(tuple, shapes))
        sig = _signature("allgather", t.dtype, key)

        if dim is not None:
            def read(slot: int) -> torch.Tensor:
                parts = self._rows.get((slot, key, t.dtype))
                if parts is None:  # every rank's block, viewed in the slot once
                    if len(self._rows) > 1024:
                        self._rows.clear()
                    rows = self._rows_of(slot)
                    parts = self._rows[slot, key, t.dtype] = [
                        rows[r, :nbytes[r]].view(t.dtype).view(shapes[r])
                        for r in range(self.size)]
                return torch.cat(parts, dim)
        elif all(s == shapes[0] for s in shapes):  # one shape: one copy, viewed as the P results
            shape = tuple(shapes[0])

            def read(slot: int) -> list[torch.Tensor]:
                return list(self._rows_of(slot)[:, :width].clone().view(t.dtype)
                            .view(self.size, *shape).unbind(0))
        else:
            def read(slot: int) -> list[torch.Tensor]:
                out = self._rows_of(slot)[:, :width].clone()
                return [out[r, :nbytes[r]].view(t.dtype).view(shapes[r])
                        for r in range(self.size)]

        return self._issue(opname, sig, t.reshape(-1).view(torch.uint8), read)

    def reduce_scatter(self, chunks: list[torch.Tensor], op: str) -> Work:
        """The reduction over the ranks, in rank order, of every rank's ``chunks[self.rank]``
        (each rank writes all its chunks back to back; every rank knows where each starts, as
        every rank's chunk for one destination has one shape)."""
        return self._reduce_scatter([tuple(c.shape) for c in chunks], chunks[0].dtype, op,
                                    [c.reshape(-1).view(torch.uint8) for c in chunks])

    def reduce_scatter_along(self, x: torch.Tensor, sizes: list[int], dim: int,
                             op: str) -> Work:
        """:meth:`reduce_scatter` of ``x``'s chunks of ``sizes`` along ``dim`` (``x``
        contiguous), written into this rank's row in one copy: a transposing one where the
        chunks are equal and strided."""
        dtype, isz, p = x.dtype, x.element_size(), len(sizes)
        pre, post = math.prod(x.shape[:dim]), math.prod(x.shape[dim + 1:])
        counts = [pre * n * post for n in sizes]

        def fill(row: torch.Tensor) -> int:
            if not x.numel():
                return 0
            buf = row[:x.numel() * isz].view(dtype)
            if pre == 1:  # the chunks lie back to back already
                buf.copy_(x.view(-1))
            elif all(n == sizes[0] for n in sizes):
                buf.view(p, pre, -1).copy_(x.view(pre, p, -1).transpose(0, 1))
            else:
                start = 0
                for n, c in zip(counts, torch.split(x, list(sizes), dim)):
                    buf[start:start + n].view(c.shape).copy_(c)
                    start += n
            return x.numel() * isz

        return self._reduce_scatter([(*x.shape[:dim], n, *x.shape[dim + 1:]) for n in sizes],
                                    dtype, op, fill)

    def _reduce_scatter(self, shapes: list[Shape], dtype: torch.dtype, op: str,
                        payload: Any) -> Work:
        """One reduce-scatter of chunks of ``shapes`` (one per rank, back to back in every
        rank's row, written by ``payload`` as :meth:`_issue` takes it): the sum of row slices
        that are this rank's chunk."""
        counts = [math.prod(s) * dtype.itemsize for s in shapes]
        lo = sum(counts[:self.rank])
        hi = lo + counts[self.rank]
        shape = shapes[self.rank]
        sig = _signature("reduce_scatter", op, dtype, tuple(shapes))

        def read(slot: int) -> torch.Tensor:
            return _reduce_rows(self._rows_of(slot)[:, lo:hi].view(dtype), op).view(shape)

        return self._issue("reduce_scatter", sig, payload, read)

    def alltoall(self, chunks: list[torch.Tensor], recv_shapes: list[Shape]) -> Work:
        """``chunks[r]`` to rank r; the result's ``[s]`` is what rank s sent here (of shape
        ``recv_shapes[s]``), copied out of the channel. A rank knows only its own row and column
        of the sizes, so its payload starts with its row's byte offsets (one int64 per rank),
        which each reader looks its chunk up in. The caller chooses the channel only where
        every rank's payload fits a slot (:func:`alltoall_bytes`)."""
        dtype, isz = chunks[0].dtype, chunks[0].element_size()
        sizes = [c.numel() * isz for c in chunks]
        if alltoall_bytes(self.size, sum(sizes)) > self.slot_bytes:
            raise ValueError(f"{self._describe}: an all-to-all of {sum(sizes)} bytes does not fit "
                             f"a slot of {self.slot_bytes}")
        table = torch.tensor([0, *itertools.accumulate(sizes[:-1])], dtype=torch.int64)
        head = 8 * self.size
        counts = [math.prod(s) * isz for s in recv_shapes]
        sig = _signature("alltoall", dtype)

        def read(slot: int) -> list[torch.Tensor]:
            rows = self._rows_of(slot)
            starts = rows[:, :head].view(torch.int64)[:, self.rank].tolist()
            out = torch.empty(sum(counts), dtype=torch.uint8)
            at = 0
            for s, n in enumerate(counts):
                if n:
                    out[at:at + n].copy_(rows[s, head + starts[s]:head + starts[s] + n])
                at += n
            return [part.view(dtype).view(shape)
                    for part, shape in zip(out.split(counts), recv_shapes)]

        return self._issue("alltoall", sig, [table.view(torch.uint8)]
                           + [c.reshape(-1).view(torch.uint8) for c in chunks], read)

    def broadcast(self, t: torch.Tensor, root: int) -> Work:
        """Root's ``t`` on every rank (a copy)."""
        nbytes = t.numel() * t.element_size()
        sig = _signature("broadcast", root, t.dtype, tuple(t.shape))
        payload = t.reshape(-1).view(torch.uint8) if self.rank == root else None

        def read(slot: int) -> torch.Tensor:
            return self._rows_of(slot)[root, :nbytes].clone().view(t.dtype).view(t.shape)

        return self._issue("broadcast", sig, payload, read)

    def barrier(self) -> Work:
        return self._issue("barrier", _signature("barrier"), None, lambda slot: None)
