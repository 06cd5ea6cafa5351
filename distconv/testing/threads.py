"""``run_threads``: a P-rank world of threads in this process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

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

    ``run_threads`` never waits forever, whatever the ranks do. Threads cannot be killed, so a
    rank that cannot be reached is abandoned (the threads are daemons, left behind) and
    :class:`~distconv.comm.CommTimeoutError` names the ranks still running:

    * ``timeout`` seconds after another rank failed (a rank that loops or sleeps outside any
      collective, so no communicator timeout can reach it);
    * when the world has been silent for ``timeout`` seconds: no rank was inside a
      communicator call (those end within their own timeouts), started one or finished, e.g.
      every running rank waits on an event, a lock or a ``torch.compile`` that never returns.
      So ``timeout`` is also the longest all ranks may compute without communicating; raise
      it for long local work.

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
            # autograd runs a device's backward work on one worker thread: thread ranks whose
            # backward holds collectives would wait on each other there (CUDA), so each rank
            # runs its own backward
            with torch.autograd.set_multithreading_enabled(False):
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
    _join(threads, group, comms, timeout)
    bad = pick_error(errors)
    if bad is not None:
        exc = errors[bad]
        assert exc is not None
        new = with_rank(exc, bad, f"{size} threads")
        if new is exc:
            raise exc
        raise new from exc
    return results


def _join(threads: list[threading.Thread], group: ThreadGroup,
          comms: list[ThreadCommunicator], timeout: float) -> None:
    """Join every rank; once one has failed, give the others ``timeout`` seconds more; raise
    when the world stays silent (no rank inside or starting a communicator call, none
    finishing) for ``timeout`` seconds."""
    deadline = None
    seen: tuple[int, int] | None = None
    quiet_since = time.monotonic()
    while True:
        alive = [t for t in threads if t.is_alive()]
        if not alive:
            return
        now = time.monotonic()
        ranks = ", ".join(t.name.removeprefix("distconv-rank") for t in alive)
        if deadline is None and group.failed is not None:
            deadline = now + timeout
        if deadline is not None and now > deadline:
            raise CommTimeoutError(
                f"run_threads: rank(s) {ranks} of {len(threads)} still running {timeout} s after "
                f"{group.failed}; a rank that waits outside the communicator (a loop, a sleep, "
                "a lock) ignores its timeout"
            )
        activity = (len(alive), _calls(comms))
        if activity != seen or _in_communicator(group):
            seen, quiet_since = activity, now
        elif deadline is None and now - quiet_since > timeout:
            reason = (f"run_threads: rank(s) {ranks} of {len(threads)} still running with no "
                      f"communication from any rank for {timeout} s")
            group.abort(reason, timed_out=True)  # a rank that wakes up fails at its next call
            raise CommTimeoutError(
                f"{reason}; they wait outside the communicator (an event, a lock, a loop, a "
                "torch.compile that never returns on thread ranks) where no communicator "
                "timeout reaches them, and are left behind as daemon threads"
            )
        alive[0].join(0.05)


def _calls(comms: list[ThreadCommunicator]) -> int:
    """Communicator calls the world has started (sub-communicators add to their parent's)."""
    return sum(sum(c.stats.snapshot()["calls"].values()) for c in comms)


def _in_communicator(group: ThreadGroup) -> bool:
    """Whether a rank waits in a collective of ``group`` or a sub-group (its own timeout ends
    it). Read from the barriers, never from other threads' frames, which may be torn down while
    they are read."""
    if group.barrier.n_waiting:
        return True
    with group.lock:
        children = list(group.children.values())
    return any(_in_communicator(c) for c in children)
