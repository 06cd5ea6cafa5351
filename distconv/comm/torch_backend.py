"""torch.distributed communicator: gloo on CPU tensors, NCCL on CUDA tensors.

Operations call the c10d process-group objects directly, with the communicator's timeout in each
operation's options, so a collective that cannot complete raises instead of hanging.

What gloo (torch 2.13) lacks, and what is done about it:

- ``allgather`` needs equal sizes on every rank: uneven inputs are padded to the largest and the
  results are views of the unpadded prefixes (padding is never counted in the stats).
- ``alltoall_base`` with split sizes (alltoallv) is native in gloo and used as it is. gloo's
  ``reduce_scatter`` exists but is slow (5-20x an all-to-all of the same bytes on 2-4 ranks), so
  on gloo a reduce-scatter is an all-to-all of the chunks and a local reduction in rank order (the
  bytes a ring reduce-scatter moves, and deterministic). NCCL uses its own reduce-scatter, padded
  like allgather when uneven; a backend that reports no reduce-scatter support falls back too.
- some dtypes cannot be reduced (int16, uint16, ...): they are reduced in a wider integer type
  and cast back (exact). ``avg`` is a sum divided by the size on every backend.
- data movement (allgather, alltoall, broadcast, send/recv) is done on uint8 views of the
  buffers, so every dtype moves, bit for bit.
- a collective of a few hundred bytes costs gloo 0.4-0.7 ms between two processes of one host
  (two TCP round trips through its worker threads). Where every rank of a gloo communicator is on
  one host, an allreduce, allgather, broadcast or reduce-scatter of at most
  :data:`~distconv.comm.host_channel.SLOT_BYTES` per rank, and the barrier, go through a
  :class:`~distconv.comm.host_channel.HostChannel` in shared memory instead (a few microseconds;
  the choice depends only on what every rank of the call knows alike). The channel is opened at
  the first such call, collectively. Larger allreduces (gradient buckets) go through a second,
  bulk channel of the same kind, in chunks of :data:`~distconv.comm.host_channel.BULK_BYTES`
  (gloo took 7 ms for 4 MiB between two processes here), and so do allgathers, broadcasts and
  reduce-scatters of up to one bulk slot per rank (a channel-parallel layer's activations).
  ``DISTCONV_HOST_CHANNEL=0`` keeps everything on gloo.

Sub-communicators are separate process groups built on a prefix of the world's store, named from
the parent's name and its split count, so only the members of a group take part in creating it
(no global ``new_group`` call order to keep in step).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceOp,
    ReduceScatterOptions,
)

from distconv.comm.base import (
    AlltoallBuffers, Communicator, Shape, Work, reduce_in_order,
)
from distconv.comm.errors import CommError, CommTimeoutError
from distconv.comm.host_channel import (
    BULK_BYTES, BULK_SLOTS, HostChannel, alltoall_bytes, enabled as host_channel_enabled,
    name_buffer, name_of, open_ring,
)
from distconv.comm.single import SingleCommunicator

__all__ = ["TorchCommunicator", "destroy_default_group", "init_torch"]

_OPS = {
    "sum": ReduceOp.SUM,
    "avg": ReduceOp.SUM,
    "prod": ReduceOp.PRODUCT,
    "max": ReduceOp.MAX,
    "min": ReduceOp.MIN,
}
# dtypes gloo cannot reduce, and the exact wider type they are reduced in
_GLOO_WIDEN = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


class TorchCommunicator(Communicator):
    """A torch.distributed process group (``backend`` is ``"torch-gloo"`` or ``"torch-nccl"``)."""

    def __init__(
        self,
        pg: Any,
        *,
        rank: int,
        size: int,
        timeout: float = 60.0,
        store: Any,
        kind: str = "gloo",
        name: str = "distconv",
        parent: Communicator | None = None,
    ) -> None:
        if kind not in ("gloo", "nccl"):
            raise ValueError(f"kind must be 'gloo' or 'nccl', got {kind!r}")
        super().__init__(rank=rank, size=size, timeout=timeout, parent=parent)
        self.backend = f"torch-{kind}"
        self._pg = pg
        self._store = store
        self._kind = kind
        self._name = name
        self._nsplits = 0
        # gloo's own reduce-scatter measured 5-20x slower than an all-to-all plus a local sum of
        # the same bytes (benchmarks/collectives.py); NCCL's is the fast one.
        self._native_reduce_scatter = kind == "nccl"
        # the shared-memory channel for small collectives: opened at the first one that fits
        self._host: HostChannel | None | bool = (
            kind == "gloo" and size > 1 and host_channel_enabled())
        # and the bulk channel of larger payloads: opened at the first one
        self._bulk: HostChannel | None | bool = self._host
        if kind == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())

    def _check_device(self, t: torch.Tensor, name: str) -> None:
        if self._kind == "nccl":
            if t.device != self._device:
                raise ValueError(
                    f"{name} is on device {t.device}; backend {self.backend!r} on rank "
                    f"{self.rank} takes tensors on {self._device}, its one device (NCCL: one "
                    "device per rank, the current CUDA device when the communicator was made)"
                )
        elif t.device.type != "cpu":
            raise ValueError(
                f"{name} is on device {t.device}; backend {self.backend!r} takes cpu tensors"
            )

    # ---------------------------------------------------------------- error handling
    def _error(self, opname: str, exc: BaseException) -> CommError:
        cls = CommTimeoutError if _is_timeout(exc) else CommError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return cls(f"rank {self.rank}, backend {self.backend!r}, op {opname!r}: {first}")

    def _issue(self, opname: str, start: Callable[[], Any], finish: Callable[[], Any]) -> Work:
        """Start a c10d operation; the Work waits (bounded by the timeout) and then finishes."""
        if self._pg is None:
            raise CommError(
                f"rank {self.rank}, backend {self.backend!r}, op {opname!r}: the communicator "
                "is closed (distconv.comm.shutdown() or close() released it)"
            )
        try:
            handle = start()
        except RuntimeError as exc:
            raise self._error(opname, exc) from exc

        def wait() -> Any:
            try:
                handle.wait(_td(self.timeout))
            except RuntimeError as exc:
                raise self._error(opname, exc) from exc
            return finish()

        return Work(wait, test_fn=handle.is_completed)

    @property
    def host(self) -> Communicator:
        """This communicator on gloo; on NCCL, a gloo communicator of the same ranks (made at
        the first use, collectively, over this group's store), so that control messages go
        between the hosts without a device round trip (:attr:`Communicator.host`)."""
        if self._kind == "gloo":
            return self
        sibling = getattr(self, "_host_sibling", None)
        if sibling is None or sibling.closed:
            sibling = self._host_sibling = self._gloo_sibling()
        return sibling

    def _gloo_sibling(self) -> TorchCommunicator:
        """A gloo communicator of this group's ranks, its group built on a prefix of the store."""
        name = f"{self._name}/host"
        store = dist.PrefixStore(name + "/", self._store)
        try:
            pg = dist.ProcessGroupGloo(store, self.rank, self.size, _td(self.timeout))
        except RuntimeError as exc:
            raise self._error("host", exc) from exc
        return TorchCommunicator(pg, rank=self.rank, size=self.size, timeout=self.timeout,
                                 store=self._store, kind="gloo", name=name, parent=self)

    # ---------------------------------------------------------------- the host channel
    def _channel(self, nbytes: int) -> HostChannel | None:
        """The host channel, for a payload of ``nbytes`` per rank (the same on every rank of the
        call), or None: gloo carries it. Opens the channel collectively at the first fit."""
        if self._host is False or self._host is None or not HostChannel.fits(nbytes):
            return None
        if self._host is True:
            if self._pg is None:
                return None  # closed: the backend path raises
            self._host = open_ring(self)
        return self._host

    def _bulk_channel(self) -> HostChannel | None:
        """The bulk channel (payloads beyond a small slot), or None: gloo carries them. Opens
        it collectively at the first call (every rank makes the call: the sizes are the same)."""
        if self._bulk is True:
            if self._pg is None:
                return None
            self._bulk = open_ring(self, slots=BULK_SLOTS, slot_bytes=BULK_BYTES)
        return self._bulk or None

    def _ring(self, nbytes: int) -> HostChannel | None:
        """The ring for a payload of ``nbytes`` per rank that goes in one operation: the small
        one where it fits a slot, else the bulk one where it fits a bulk slot; else None."""
        if HostChannel.fits(nbytes):
            return self._channel(nbytes)
        return self._bulk_channel() if nbytes <= BULK_BYTES else None

    def _broadcast_name(self, name: str) -> str:
        buf = name_buffer(name, self.rank)
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, _td(self.timeout)
        self._issue("broadcast", lambda: self._pg.broadcast([buf], opts), lambda: None).wait()
        return name_of(buf)

    def _all_ok(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        opts = AllreduceOptions()
        opts.reduceOp, opts.timeout = ReduceOp.MIN, _td(self.timeout)
        self._issue("allreduce", lambda: self._pg.allreduce([flag], opts), lambda: None).wait()
        return bool(flag[0])

    # ---------------------------------------------------------------- operations
    def _allreduce(self, t: torch.Tensor, op: str, consume: bool = False) -> Work:
        nbytes = t.numel() * t.element_size()
        host = self._channel(nbytes) if HostChannel.fits(nbytes) else self._bulk_channel()
        if host is not None:
            return host.allreduce(t, op, out=t if consume else None)
        wide = _GLOO_WIDEN.get(t.dtype) if self._kind == "gloo" else None
        out = t.to(wide) if wide is not None else (t if consume else t.clone())
        opts = AllreduceOptions()
        opts.reduceOp = _OPS[op]
        opts.timeout = _td(self.timeout)

        def finish() -> torch.Tensor:
            res = out.to(t.dtype) if wide is not None else out
            return res.div_(self.size) if op == "avg" else res

        return self._issue("allreduce", lambda: self._pg.allreduce([out], opts), finish)

    def _allreduce_consuming(self, t: torch.Tensor, op: str) -> Work:
        return self._allreduce(t, op, consume=True)

    def _allgather(self, t: torch.Tensor, shapes: list[Shape], opname: str) -> Work:
        isz = t.element_size()
        nbytes = [torch.Size(s).numel() * isz for s in shapes]
        width = max(nbytes)
        if width == 0:
            return Work.completed([torch.empty(s, dtype=t.dtype, device=t.device) for s in shapes])
        host = self._ring(width)
        if host is not None:
            return host.allgather(t, shapes, opname)
        src = _flat_bytes(t)
        if src.numel() != width:
            send = torch.zeros(width, dtype=torch.uint8, device=t.device)
            send[: src.numel()] = src
        else:
            send = src
        out = torch.empty((self.size, width), dtype=torch.uint8, device=t.device)
        opts = AllgatherOptions()
        opts.timeout = _td(self.timeout)

        def finish() -> list[torch.Tensor]:
            return [out[r, : nbytes[r]].view(t.dtype).view(shapes[r]) for r in range(self.size)]

        return self._issue(
            opname, lambda: self._pg.allgather([list(out.unbind(0))], [send], opts), finish
        )

    def _allgather_cat(self, t: torch.Tensor, shapes: list[Shape], dim: int) -> torch.Tensor:
        width = max(torch.Size(s).numel() for s in shapes) * t.element_size()
        host = self._ring(width) if width else None
        if host is not None:  # concatenated straight out of the channel
            return host.allgather(t, shapes, "allgather", dim=dim).wait()
        return super()._allgather_cat(t, shapes, dim)

    def _reduce_scatter_dim(self, x: torch.Tensor, sizes: list[int], dim: int) -> torch.Tensor:
        host = (None if self._native_reduce_scatter or not x.numel()
                else self._ring(x.numel() * x.element_size()))  # (as _reduce_scatter_by_alltoall)
        if host is not None:  # written into the channel in one copy
            return host.reduce_scatter_along(x, sizes, dim, "sum").wait()
        return super()._reduce_scatter_dim(x, sizes, dim)

    def _reduce_scatter(self, chunks: list[torch.Tensor], op: str) -> Work:
        if not self._native_reduce_scatter:
            return self._reduce_scatter_by_alltoall(chunks, op)
        try:
            return self._reduce_scatter_native(chunks, op)
        except CommError as exc:
            if "support" not in str(exc).lower():
                raise
            self._native_reduce_scatter = False  # same torch on every rank: all fall back
            return self._reduce_scatter_by_alltoall(chunks, op)

    def _reduce_scatter_by_alltoall(self, chunks: list[torch.Tensor], op: str) -> Work:
        """Each rank receives every rank's chunk for it and reduces them in rank order: the
        bytes a ring reduce-scatter moves, for a gloo without (uneven) reduce-scatter."""
        host = self._ring(sum(c.numel() for c in chunks) * chunks[0].element_size())
        if host is not None:  # (every rank's chunks have the same shapes: the same total)
            return host.reduce_scatter(chunks, op)
        mine = tuple(chunks[self.rank].shape)
        work = self._alltoall(chunks, [mine] * self.size)
        return Work(lambda: reduce_in_order(work.wait(), op, self.size), test_fn=work.is_completed)

    def _reduce_scatter_native(self, chunks: list[torch.Tensor], op: str) -> Work:
        dtype = chunks[0].dtype
        wide = _GLOO_WIDEN.get(dtype) if self._kind == "gloo" else None
        mine = chunks[self.rank].shape
        flats = [c.reshape(-1) if wide is None else c.reshape(-1).to(wide) for c in chunks]
        counts = [f.numel() for f in flats]
        if self._kind == "nccl" and len(set(counts)) > 1:
            width = max(counts)
            padded = torch.zeros((self.size, width), dtype=flats[0].dtype, device=flats[0].device)
            for r, f in enumerate(flats):
                padded[r, : counts[r]] = f
            flats = list(padded.unbind(0))
        out = torch.empty(flats[self.rank].numel(), dtype=flats[0].dtype, device=flats[0].device)
        opts = ReduceScatterOptions()
        opts.reduceOp = _OPS[op]
        opts.timeout = _td(self.timeout)

        def finish() -> torch.Tensor:
            res = out[: counts[self.rank]].to(dtype).view(mine)
            return res.div_(self.size) if op == "avg" else res

        return self._issue(
            "reduce_scatter", lambda: self._pg.reduce_scatter([out], [flats], opts), finish
        )

    def _alltoall(self, chunks: list[torch.Tensor], recv_shapes: list[Shape]) -> Work:
        buf = AlltoallBuffers(chunks, recv_shapes)
        opts = AllToAllOptions()
        opts.timeout = _td(self.timeout)
        return self._issue(
            "alltoall",
            lambda: self._pg.alltoall_base(
                buf.recv, buf.send, buf.recv_counts, buf.send_counts, opts
            ),
            buf.received,
        )

    def _alltoall_bounded(self, chunks: list[torch.Tensor], recv_shapes: list[Shape],
                          max_bytes: int) -> Work:
        # the bound is the same on every rank, so every rank makes the same choice
        host = self._ring(alltoall_bytes(self.size, max_bytes))
        if host is not None:
            return host.alltoall(chunks, recv_shapes)
        return self._alltoall(chunks, recv_shapes)

    def _broadcast(self, t: torch.Tensor, root: int) -> Work:
        host = self._ring(t.numel() * t.element_size()) if t.numel() else None
        if host is not None:
            return host.broadcast(t, root)
        out = t.clone() if self.rank == root else torch.empty_like(t)
        if out.numel() == 0:
            return Work.completed(out)
        opts = BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        opts.timeout = _td(self.timeout)
        return self._issue(
            "broadcast", lambda: self._pg.broadcast([_flat_bytes(out)], opts), lambda: out
        )

    def _barrier(self) -> Work:
        host = self._channel(0)
        if host is not None:
            return host.barrier()
        opts = BarrierOptions()
        opts.timeout = _td(self.timeout)
        return self._issue("barrier", lambda: self._pg.barrier(opts), lambda: None)

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> Work:
        buf = _flat_bytes(t)
        if buf.numel() == 0:
            return Work.completed(None)
        return self._issue("send", lambda: self._pg.send([buf], dst, tag), lambda: None)

    def _recv(self, shape: Shape, dtype: torch.dtype, src: int, tag: int) -> Work:
        out = torch.empty(shape, dtype=dtype, device=self._device)
        if out.numel() == 0:
            return Work.completed(out)
        buf = _flat_bytes(out)
        return self._issue("recv", lambda: self._pg.recv([buf], src, tag), lambda: out)

    # ---------------------------------------------------------------- sub-communicators
    def _split(self, groups, index, timeout) -> Communicator:
        self._nsplits += 1
        members = groups[index]
        if len(members) == 1:
            return SingleCommunicator(timeout=timeout, parent=self)
        name = f"{self._name}/s{self._nsplits}g{index}"
        sub_rank = members.index(self.rank)
        store = dist.PrefixStore(name + "/", self._store)
        try:
            pg = self._new_group(store, sub_rank, len(members), timeout)
        except RuntimeError as exc:
            raise self._error("split", exc) from exc
        return TorchCommunicator(
            pg,
            rank=sub_rank,
            size=len(members),
            timeout=timeout,
            store=self._store,
            kind=self._kind,
            name=name,
            parent=self,
        )

    def _release(self) -> None:
        """Stop this group's worker threads now, while the interpreter is alive.

        A gloo worker thread that drops the last reference to a finished operation's tensors
        needs the GIL; if that happens during interpreter finalization, Python ends the thread
        with ``pthread_exit``, whose unwinding through C++ code calls ``std::terminate`` (the
        abort at exit of a script that simply ends). Shutting the groups down here, before
        finalization, joins those threads. The default group is destroyed by
        :func:`distconv.comm.shutdown` when distconv created it.
        """
        for host in (self._host, self._bulk):
            if isinstance(host, HostChannel):
                host.close()
        self._host = self._bulk = None
        sibling = getattr(self, "_host_sibling", None)
        if sibling is not None:
            sibling.close()
        pg, self._pg = self._pg, None
        if pg is None or pg is dist.group.WORLD:
            return
        try:
            pg.shutdown()
        except (RuntimeError, AttributeError):
            pass  # already shut down, or a torch without ProcessGroup.shutdown

    def _new_group(self, store: Any, rank: int, size: int, timeout: float) -> Any:
        if self._kind == "gloo":
            return dist.ProcessGroupGloo(store, rank, size, _td(timeout))
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _td(timeout)
        return dist.ProcessGroupNCCL(store, rank, size, opts)


_owns_default_group = False


def destroy_default_group() -> None:
    """Destroy torch's default process group if :func:`init_torch` created it."""
    global _owns_default_group
    if _owns_default_group and dist.is_initialized():
        dist.destroy_process_group()
    _owns_default_group = False


def _attempt_store(timeout: float) -> Any:
    """Under torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``), a view of it private to
    this restart attempt: the store outlives the attempt, and a restarted world that read the
    dead attempt's keys (gloo's peer addresses) could not connect. None elsewhere."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           is_master=False, timeout=_td(timeout))
    return dist.PrefixStore(f"distconv/attempt{attempt}/", client)


def init_torch(kind: str | None = None, *, timeout: float = 60.0) -> TorchCommunicator:
    """The world of an initialised (or, from the torchrun variables, a new) default group.

    ``kind`` None: "nccl" when CUDA is available and ``LOCAL_RANK`` is set, else "gloo".
    """
    global _owns_default_group
    if not dist.is_initialized():
        _owns_default_group = True
        if kind is None:
            kind = "nccl" if torch.cuda.is_available() and "LOCAL_RANK" in os.environ else "gloo"
        if kind == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        store = _attempt_store(timeout)
        if store is None:
            dist.init_process_group(backend=kind, timeout=_td(timeout))
        else:
            dist.init_process_group(backend=kind, timeout=_td(timeout), store=store,
                                    rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
    actual = str(dist.get_backend()).lower()
    if kind is not None and actual != kind:
        raise ValueError(f"torch.distributed is already initialised with {actual!r}, not {kind!r}")
    store = dist.distributed_c10d._get_default_store()
    return TorchCommunicator(
        dist.group.WORLD,
        rank=dist.get_rank(),
        size=dist.get_world_size(),
        timeout=timeout,
        store=store,
        kind=actual,
    )
