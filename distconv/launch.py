"""Run a function on P ranks: local processes (gloo on loopback) by default, or, inside a job that
``torchrun`` or ``mpiexec`` started, this process as one rank of that job's world."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["LAUNCH_BACKENDS", "launch"]

LAUNCH_BACKENDS = ("gloo", "mpi", "threads", "single")

#: the refusals the library raises: under a launcher each ends its rank with one line
_REFUSALS = (ValueError, TypeError, NotImplementedError)
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


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

    Inside a job, a refusal the library raises (a ``ValueError``, ``TypeError`` or
    ``NotImplementedError`` from distconv's own code, whose message says what to do) that the
    script does not catch ends its rank with one line, ``[rankR]: ValueError: ...``, instead of
    a traceback per rank (torchrun's error file carries the same line, so its summary's root
    cause names it). ``DISTCONV_TRACEBACK=1`` keeps Python's tracebacks.
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
        _one_line_refusals()
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


def _raised_by_library(tb: Any) -> bool:
    """Whether the innermost frame of traceback ``tb`` is distconv's code."""
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and os.path.abspath(
        last.tb_frame.f_code.co_filename).startswith(_PACKAGE)


def _one_line_refusals() -> None:
    """Under a launcher: an uncaught library refusal prints ``Type: message`` (and
    writes it to torchrun's error file) in place of Python's traceback; anything else, and
    everything with ``DISTCONV_TRACEBACK=1``, goes to the previous hook."""
    previous = sys.excepthook
    if getattr(previous, "_distconv_one_line", False):
        return

    def hook(etype: type[BaseException], value: BaseException, tb: Any) -> None:
        keep = os.environ.get("DISTCONV_TRACEBACK", "").strip() not in ("", "0")
        if keep or not issubclass(etype, _REFUSALS) or not _raised_by_library(tb):
            previous(etype, value, tb)
            return
        # torch.distributed prefixes a rank's stderr with "[rankR]:" itself; MPI does not
        rank = None if "RANK" in os.environ else next(
            (os.environ[v] for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
             if v in os.environ), "?")
        line = f"{'' if rank is None else f'rank {rank}: '}{etype.__name__}: {value}"
        print(line, file=sys.stderr, flush=True)
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:
            try:
                with open(error_file, "w") as f:
                    json.dump({"message": {"message": line, "extraInfo": {
                        "py_callstack": line, "timestamp": str(int(time.time()))}}}, f)
            except OSError:
                pass  # the line on stderr is the report

    hook._distconv_one_line = True  # type: ignore[attr-defined]
    sys.excepthook = hook
