"""``run_threads``: a P-rank world of threads in this process."""

from __future__ import annotations

import threading
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
    for t in threads:
        t.join()
    bad = pick_error(errors)
    if bad is not None:
        exc = errors[bad]
        assert exc is not None
        new = with_rank(exc, bad, f"{size} threads")
        if new is exc:
            raise exc
        raise new from exc
    return results
