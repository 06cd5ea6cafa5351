"""``run_threads``: a P-rank world of threads in this process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from distconv.comm.base import check_timeout
from distconv.comm.errors import CommTimeoutError
from distconv.comm.threads import ThreadCommunicator, ThreadGroup
from distconv.testing._errors import pick_error, with_rank

__all__ = ["run_threads"]


def run_threads(fn: Callable[..., Any], size: int, *args: Any, timeout: float = 30.0, **kw: Any):
    """Run ``fn(comm, *args, **kw)`` on ``size`` thread-ranks; return the results in rank order.

    Each rank gets its own :class:`~distconv.comm.ThreadCommunicator` with ``timeout`` seconds
    (default 30.0) per collective. When a rank raises, the others are released from their
    collectives at once, and the most telling exception (an error in ``fn`` before the
    communication errors it caused; lowest rank first) is raised, its message prefixed with
    its rank, chained to the original with its traceback.

    A rank still running ``timeout`` seconds after another rank failed (one that loops or
    sleeps outside any collective, so no communicator timeout can reach it) is abandoned (the
    threads are daemons) and :class:`~distconv.comm.CommTimeoutError` names it, instead of the
    run waiting for it forever.

    The ranks are threads of one process and share torch's global random generator: after
    ``torch.manual_seed(0)`` on every rank, ``torch.randn`` draws interleaved numbers from one
    stream and the ranks get different "same-seed" data. Give each rank its own generator with
    :func:`distconv.testing.rank_generator` (``torch.randn(..., generator=g)``), or draw the
    data before ``run_threads`` and pass it in.
    """
    if not callable(fn):
        raise TypeError(f"run_threads: fn must be callable as fn(comm, ...), got {fn!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    check_timeout(timeout)
    group = ThreadGroup(size)
    comms = [ThreadCommunicator(group, r, timeout=timeout) for r in range(size)]
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def target(r: int) -> None:
        try:
            results[r] = fn(comms[r], *args, **kw)
        except BaseException as exc:
            errors[r] = exc
            group.abort(
                f"rank {r} raised {type(exc).__name__}: {exc}",
                timed_out=isinstance(exc, CommTimeoutError),
            )

    threads = [
        threading.Thread(target=target, args=(r,), name=f"distconv-rank{r}", daemon=True)
        for r in range(size)
    ]
    for t in threads:
        t.start()
    _join(threads, group, timeout)
    bad = pick_error(errors)
    if bad is not None:
        exc = errors[bad]
        assert exc is not None
        new = with_rank(exc, bad, f"{size} threads")
        if new is exc:
            raise exc
        raise new from exc
    return results


def _join(threads: list[threading.Thread], group: ThreadGroup, timeout: float) -> None:
    """Join every rank; once one has failed, give the others ``timeout`` seconds more."""
    deadline = None
    while True:
        alive = [t for t in threads if t.is_alive()]
        if not alive:
            return
        if deadline is None and group.failed is not None:
            deadline = time.monotonic() + timeout
        if deadline is not None and time.monotonic() > deadline:
            ranks = ", ".join(t.name.removeprefix("distconv-rank") for t in alive)
            raise CommTimeoutError(
                f"run_threads: rank(s) {ranks} of {len(threads)} still running {timeout} s after "
                f"{group.failed}; a rank that waits outside the communicator (a loop, a sleep, "
                "a lock) ignores its timeout"
            )
        alive[0].join(0.05)
