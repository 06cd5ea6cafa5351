"""Run a function on P ranks: local processes (gloo on loopback) by default, or, inside a job that
``torchrun`` or ``mpiexec`` started, this process as one rank of that job's world."""

from __future__ import annotations

import json
import sys
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
    """Run ``fn(comm, *args, **kw)`` on ``nprocs`` ranks and return their results.

    Run by ``python script.py``, it starts ``nprocs`` local processes and returns every rank's
    result, in rank order. Run inside a job that ``torchrun --nproc-per-node P`` or
    ``mpiexec -n P`` started (their environment variables say so), this process is one rank of
    that job's world: ``fn(distconv.comm.init(timeout=timeout), ...)`` runs here and ``launch``
    returns ``[this rank's result]``. A job of another size than ``nprocs`` is refused at once
    (a ``ValueError`` saying what to run). So the same script runs unchanged under ``python``,
    ``torchrun`` and ``mpiexec``.

    Args:
        fn: a module-level function (a script's own functions work: workers load the script
            without running its ``if __name__ == "__main__"`` block; they see the script's
            ``sys.argv``).
        nprocs: number of ranks.
        backend: how ``launch`` starts the ranks when no launcher did: ``"gloo"`` (default:
            ``nprocs`` processes over loopback), ``"mpi"`` (``mpiexec``), ``"threads"`` (in this
            process, also inside a job) or ``"single"`` (``nprocs`` must be 1).
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
    from distconv import comm as dcomm

    launcher = dcomm._detect()
    if launcher != "single":
        return [fn(_job_world(launcher, nprocs, timeout), *args, **kw)]
    from distconv.testing import WorkerPool
    from distconv.testing._protocol import ENV_ARGV

    env = {ENV_ARGV: json.dumps(sys.argv)}
    with WorkerPool(backend, nprocs, timeout=timeout, task_timeout=None, echo=True,
                    env=env) as pool:
        return pool.run(fn, *args, **kw)


def _job_world(launcher: str, nprocs: int, timeout: float) -> Any:
    """The world of the job this process belongs to, when it has ``nprocs`` ranks."""
    from distconv import comm as dcomm

    world = dcomm.init(timeout=timeout)
    if world.size != nprocs:
        start = "torchrun --nproc-per-node" if launcher == "torch" else "mpiexec -n"
        raise ValueError(
            f"launch(fn, {nprocs}) runs in a job of {world.size} processes started by "
            f"{'torchrun' if launcher == 'torch' else 'an MPI launcher'}: start it with "
            f"`{start} {nprocs}`, or call fn(distconv.comm.init()) to run on the job's "
            f"{world.size} ranks")
    return world
