"""Run a function on P local ranks: the embedded default for examples (gloo on loopback)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["LAUNCH_BACKENDS", "launch"]

LAUNCH_BACKENDS = ("gloo", "mpi", "threads", "single")


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 60.0,
    **kw: Any,
) -> list[Any]:
    """Run ``fn(comm, *args, **kw)`` on ``nprocs`` local ranks and return their results.

    Args:
        fn: a module-level function (a script's own functions work: workers load the script
            without running its ``if __name__ == "__main__"`` block).
        nprocs: number of ranks.
        backend: ``"gloo"`` (default: ``nprocs`` processes over loopback), ``"mpi"``
            (``mpiexec``), ``"threads"`` (in this process) or ``"single"`` (``nprocs`` must be 1).
        timeout: communicator timeout in seconds (default 60.0).

    With ``backend="threads"`` the ranks share torch's global random generator (one process):
    seed-then-draw on each rank gives the ranks different numbers. Use
    :func:`distconv.testing.rank_generator` for per-rank generators that behave the same on
    every backend.
    """
    if not callable(fn):
        raise TypeError(f"launch: fn must be a module-level function fn(comm, ...), got {fn!r}")
    if backend not in LAUNCH_BACKENDS:
        raise ValueError(f"backend must be one of {LAUNCH_BACKENDS}, got {backend!r}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    from distconv.comm.base import check_timeout

    check_timeout(timeout)
    if backend == "single":
        if nprocs != 1:
            raise ValueError(f"backend='single' runs one rank; got nprocs={nprocs}")
        from distconv.comm.single import SingleCommunicator

        return [fn(SingleCommunicator(timeout=timeout), *args, **kw)]
    if backend == "threads":
        from distconv.testing import run_threads

        return run_threads(fn, nprocs, *args, timeout=timeout, **kw)
    from distconv.testing import WorkerPool

    with WorkerPool(backend, nprocs, timeout=timeout, task_timeout=None, echo=True) as pool:
        return pool.run(fn, *args, **kw)
