"""What a communicator counts: calls and the logical bytes each rank receives, per operation."""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterator

__all__ = ["CommStats"]


class CommStats:
    """Calls and logical bytes received, per operation name.

    ``calls[op]`` counts every public call (``isend``/``irecv`` count as ``send``/``recv``; a
    ``split`` that creates a sub-communicator counts as ``split`` with 0 bytes). ``bytes[op]`` is
    what rank r receives from other ranks, never padding (itemsize ``i``, size ``P``):

    - allgather: sum over s != r of numel(shapes[s]) * i
    - reduce_scatter: (P - 1) * numel(chunks[r]) * i
    - allreduce of n elements: ((P - 1) * b_r + (n - b_r)) * i, b_r = n // P + (r < n % P)
      (ring reduce-scatter + allgather)
    - alltoall: sum over s != r of numel(recv_shapes[s]) * i
    - broadcast: n * i on non-roots, 0 on the root; recv: n * i; send and barrier: 0

    The debug agreement check is not counted. A sub-communicator's traffic is also added to its
    parent's stats, so the world's stats are this process's totals.

    While :meth:`journal` is open, every collective call on this communicator and its
    sub-communicators is also written down in order as ``(op, group size, meta)``: which ranks
    each collective of a step ran among (tests and benchmarks pin it).
    """

    def __init__(self, *, parent: CommStats | None = None) -> None:
        self.calls: defaultdict[str, int] = defaultdict(int)
        self.bytes: defaultdict[str, int] = defaultdict(int)
        self._parent = parent
        self._lock = threading.Lock()
        self._journal: list[tuple[str, int, str]] | None = None

    def add(self, op: str, nbytes: int) -> None:
        with self._lock:
            self.calls[op] += 1
            self.bytes[op] += nbytes
        if self._parent is not None:
            self._parent.add(op, nbytes)

    def note(self, op: str, size: int, meta: str) -> None:
        """Write a collective call down in every open :meth:`journal` (this one's, its
        parents')."""
        stats: CommStats | None = self
        while stats is not None:
            if stats._journal is not None:
                stats._journal.append((op, size, meta))
            stats = stats._parent

    @contextlib.contextmanager
    def journal(self) -> Iterator[list[tuple[str, int, str]]]:
        """``with stats.journal() as calls:`` -- ``calls`` fills with ``(op, group size, meta)``
        of every collective called on this communicator or a sub-communicator meanwhile."""
        calls: list[tuple[str, int, str]] = []
        previous, self._journal = self._journal, calls
        try:
            yield calls
        finally:
            self._journal = previous

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.bytes.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A copy: ``{"calls": {op: n}, "bytes": {op: n}}``."""
        with self._lock:
            return {"calls": dict(self.calls), "bytes": dict(self.bytes)}

    def total_bytes(self) -> int:
        with self._lock:
            return sum(self.bytes.values())

    def __repr__(self) -> str:
        snap = self.snapshot()
        return f"CommStats(calls={snap['calls']}, bytes={snap['bytes']})"
