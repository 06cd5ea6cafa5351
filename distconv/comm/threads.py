"""In-process communicator: P ranks as threads of one process (tests and simulation only).

All ranks of a group share one :class:`_ThreadGroup`: two alternating slot arrays and a
``threading.Barrier``. A collective posts a private copy of its inputs and a signature into the
current slot array, waits at the barrier, checks that every rank called the same thing (always on:
it costs nothing here), and computes its result from the posted copies. Alternating two slot
arrays needs one barrier per collective: a rank can only overwrite an array two collectives later,
after every rank has passed the barrier in between, i.e. finished reading it.
Sub-communicators are registered on the parent group, so all threads of a group share one object.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch

from distconv.comm.base import (
    CallSignature,
    Communicator,
    Shape,
    Work,
    find_mismatch,
    reduce_in_order,
)
from distconv.comm.errors import CollectiveMismatchError, CommError, CommTimeoutError

__all__ = ["ThreadCommunicator", "ThreadGroup"]


class ThreadGroup:
    """State shared by the thread-ranks of one group."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list[list[Any]] = [[None] * size, [None] * size]
        self.lock = threading.Lock()
        self.children: dict[Any, ThreadGroup] = {}
        self.mail: dict[tuple[int, int, int], queue.Queue] = {}
        self.failed: str | None = None
        self.timed_out = False

    def child(self, key: Any, size: int) -> ThreadGroup:
        with self.lock:
            return self.children.setdefault(key, ThreadGroup(size))

    def mailbox(self, key: tuple[int, int, int]) -> queue.Queue:
        with self.lock:
            return self.mail.setdefault(key, queue.Queue())

    def abort(self, reason: str, *, timed_out: bool = False) -> None:
        """Break every barrier of this group and its sub-groups (a rank failed)."""
        with self.lock:
            if self.failed is None:
                self.failed = reason
                self.timed_out = timed_out
            children = list(self.children.values())
        self.barrier.abort()
        for c in children:
            c.abort(reason, timed_out=timed_out)


class ThreadCommunicator(Communicator):
    """One thread-rank of a :class:`ThreadGroup` (see ``distconv.testing.run_threads``)."""

    backend = "threads"

    def __init__(
        self,
        group: ThreadGroup,
        rank: int,
        *,
        timeout: float = 30.0,
        parent: Communicator | None = None,
    ) -> None:
        super().__init__(rank=rank, size=group.size, timeout=timeout, parent=parent)
        self._group = group
        self._seq = 0

    def _check_device(self, t: torch.Tensor, name: str) -> None:
        """Any device: the ranks are threads of one process, so several may share one GPU.
        Every rank of a collective must pass tensors on the same device (the device is part
        of each collective's signature, so a mismatch names every rank's device)."""

    # ---------------------------------------------------------------- core exchange
    def _fail(self, opname: str, what: str) -> str:
        return f"rank {self.rank}, backend 'threads', op {opname!r}: {what}"

    def _wait_barrier(self, opname: str) -> None:
        try:
            self._group.barrier.wait(timeout=self.timeout)
        except threading.BrokenBarrierError:
            if self._group.failed is not None and not self._group.timed_out:
                raise CommError(self._fail(opname, f"aborted: {self._group.failed}")) from None
            raise CommTimeoutError(
                self._fail(
                    opname,
                    f"not all {self.size} ranks reached the collective within {self.timeout} s",
                )
            ) from None

    def _exchange(self, opname: str, sig: CallSignature, payload: Any) -> list[Any]:
        slot = self._group.slots[self._seq & 1]
        self._seq += 1
        slot[self.rank] = (sig, payload)
        self._wait_barrier(opname)
        entries = list(slot)
        msg = find_mismatch([e[0] for e in entries])
        if msg is not None:
            raise CollectiveMismatchError(self._fail(opname, msg))
        return [e[1] for e in entries]

    # ---------------------------------------------------------------- operations
    def _allreduce(self, t: torch.Tensor, op: str) -> Work:
        sig = CallSignature(
            f"allreduce(op={op}, dtype={t.dtype}, shape={tuple(t.shape)}, device={t.device})",
            f"allreduce|{op}|{t.dtype}|{tuple(t.shape)}|{t.device}",
        )
        parts = self._exchange("allreduce", sig, t.clone())
        return Work.completed(reduce_in_order(parts, op, self.size))

    def _allgather(self, t: torch.Tensor, shapes: list[Shape], opname: str) -> Work:
        sig = CallSignature(
            f"allgather(dtype={t.dtype}, shapes={shapes}, device={t.device})",
            f"allgather|{t.dtype}|{shapes}|{t.device}",
        )
        parts = self._exchange(opname, sig, t.clone())
        return Work.completed([p.clone() for p in parts])

    def _reduce_scatter(self, chunks: list[torch.Tensor], op: str) -> Work:
        shapes = [tuple(c.shape) for c in chunks]
        sig = CallSignature(
            f"reduce_scatter(op={op}, dtype={chunks[0].dtype}, shapes={shapes}, "
            f"device={chunks[0].device})",
            f"reduce_scatter|{op}|{chunks[0].dtype}|{shapes}|{chunks[0].device}",
        )
        parts = self._exchange("reduce_scatter", sig, [c.clone() for c in chunks])
        return Work.completed(reduce_in_order([p[self.rank] for p in parts], op, self.size))

    def _alltoall_bounded(self, chunks: list[torch.Tensor], recv_shapes: list[Shape],
                          max_bytes: int) -> Work:
        # the bound is part of the signature: thread ranks check that every rank was given the
        # same one (the communicator checked that it covers this rank's bytes)
        return self._alltoall(chunks, recv_shapes, max_bytes)

    def _alltoall(self, chunks: list[torch.Tensor], recv_shapes: list[Shape],
                  max_bytes: int | None = None) -> Work:
        sends = tuple(str(tuple(c.shape)) for c in chunks)
        recvs = tuple(str(s) for s in recv_shapes)
        sig = CallSignature(
            f"alltoall(dtype={chunks[0].dtype}, send_shapes={list(sends)}, "
            f"recv_shapes={list(recvs)}, device={chunks[0].device}, max_bytes={max_bytes})",
            f"alltoall|{chunks[0].dtype}|{chunks[0].device}|{max_bytes}",
            sends,
            recvs,
        )
        parts = self._exchange("alltoall", sig, [c.clone() for c in chunks])
        return Work.completed([p[self.rank].clone() for p in parts])

    def _broadcast(self, t: torch.Tensor, root: int) -> Work:
        sig = CallSignature(
            f"broadcast(root={root}, dtype={t.dtype}, shape={tuple(t.shape)}, device={t.device})",
            f"broadcast|{root}|{t.dtype}|{tuple(t.shape)}|{t.device}",
        )
        parts = self._exchange("broadcast", sig, t.clone() if self.rank == root else None)
        return Work.completed(parts[root].clone())

    def _barrier(self) -> Work:
        self._exchange("barrier", CallSignature("barrier()", "barrier"), None)
        return Work.completed(None)

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> Work:
        self._group.mailbox((self.rank, dst, tag)).put(t.clone())
        return Work.completed(None)

    def _recv(self, shape: Shape, dtype: torch.dtype, src: int, tag: int) -> Work:
        box = self._group.mailbox((src, self.rank, tag))
        deadline = time.monotonic() + self.timeout

        def wait() -> torch.Tensor:
            while True:
                if self._group.failed is not None:
                    raise CommError(self._fail("recv", f"aborted: {self._group.failed}"))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(
                        self._fail(
                            "recv", f"nothing from rank {src} (tag {tag}) within {self.timeout} s"
                        )
                    )
                try:
                    t = box.get(timeout=min(left, 0.05))
                except queue.Empty:
                    continue
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise CollectiveMismatchError(
                        self._fail(
                            "recv",
                            f"expected {dtype}{list(shape)} from rank {src}, "
                            f"rank {src} sent {t.dtype}{list(t.shape)}",
                        )
                    )
                return t

        return Work(wait, test_fn=lambda: not box.empty())

    def _split(self, groups, index, timeout) -> Communicator:
        members = groups[index]
        child = self._group.child((groups, timeout, index), len(members))
        return ThreadCommunicator(child, members.index(self.rank), timeout=timeout, parent=self)
