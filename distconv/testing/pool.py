"""``WorkerPool``: a persistent real world (gloo processes or an ``mpiexec`` job) that runs tasks.

Starting P processes costs seconds, so a pool starts once and runs many tasks. Each worker
connects back to the driver over loopback (``multiprocessing.connection`` with a random authkey);
a task is a module-level function, sent by reference, plus pickled arguments; every rank runs
``fn(comm, *args, **kw)`` and sends back its result or its formatted exception.
Workers are fresh interpreters (never forked: a forked child of a process that has run a
multi-threaded torch op can hang) and use one thread each.
"""

from __future__ import annotations

import os
import pickle
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Any

from distconv.comm.base import check_timeout
from distconv.comm.errors import CollectiveMismatchError, CommError, CommTimeoutError
from distconv.testing import _protocol as _worker
from distconv.testing._errors import RemoteError, RemoteTraceback, pick_error, with_rank

__all__ = ["WorkerPool", "find_mpiexec"]

BACKENDS = ("gloo", "mpi")
_LOG_TAIL = 3000


def find_mpiexec() -> str | None:
    """The ``mpiexec`` beside this interpreter (a venv's mpich), else the first on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    return shutil.which("mpiexec")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fn_ref(fn: Callable[..., Any]) -> tuple[str, str, str | None]:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not callable(fn) or module is None or qualname is None or "<" in qualname:
        raise ValueError(
            f"fn must be a module-level function (workers import it by name), got {fn!r}"
        )
    main_path = None
    if module == "__main__":
        main_path = getattr(sys.modules["__main__"], "__file__", None)
        if main_path is None:
            raise ValueError(
                f"fn {qualname!r} is defined in an interactive __main__; "
                "define it in a module or a script file"
            )
        main_path = os.path.abspath(main_path)
    return (module, qualname, main_path)


class WorkerPool:
    """A persistent world of ``size`` worker processes.

    Args:
        backend: ``"gloo"`` (default; ``size`` processes on loopback, torch.distributed env
            variables) or ``"mpi"`` (``mpiexec -n size python -m distconv.testing.worker``).
        size: number of ranks (default 2).
        timeout: the workers' communicator timeout in seconds (default 60.0).
        task_timeout: default limit for one :meth:`run` in seconds (default ``2 * timeout + 30``);
            a task that exceeds it raises :class:`CommTimeoutError` and the pool restarts before
            the next task.
        start_timeout: seconds to wait for the world to come up (default 120.0).
        mpiexec: the launcher for ``backend="mpi"`` (default :func:`find_mpiexec`).
        env: extra environment variables for the workers (default none).
        echo: the workers print to this process's stdout and stderr instead of per-rank log
            files (default False; ``distconv.launch.launch`` sets it, so scripts show progress).

    The pool starts in the constructor. A task whose ranks died, timed out or failed in
    communication leaves the world in an unknown state: the pool restarts before the next task.
    """

    def __init__(
        self,
        backend: str = "gloo",
        size: int = 2,
        *,
        timeout: float = 60.0,
        task_timeout: float | None = None,
        start_timeout: float = 120.0,
        mpiexec: str | None = None,
        env: dict[str, str] | None = None,
        echo: bool = False,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        check_timeout(timeout)
        check_timeout(task_timeout, "task_timeout", allow_none=True)
        check_timeout(start_timeout, "start_timeout")
        self.backend = backend
        self.size = size
        self.echo = bool(echo)
        self.timeout = float(timeout)
        self.task_timeout = (
            float(task_timeout) if task_timeout is not None else 2 * self.timeout + 30
        )
        self.start_timeout = float(start_timeout)
        self.mpiexec = mpiexec
        if backend == "mpi":
            self.mpiexec = mpiexec or find_mpiexec()
            if self.mpiexec is None:
                raise RuntimeError("backend='mpi' needs mpiexec: none beside python or on PATH")
        self.env = dict(env or {})
        self.restarts = 0
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._logdir = tempfile.mkdtemp(prefix="distconv-pool-")
        self._running = False
        self._closed = False
        self._finalizer = weakref.finalize(self, WorkerPool._cleanup, self._procs, self._logdir)
        try:
            self.start()
        except BaseException:
            self._finalizer()
            raise

    def __repr__(self) -> str:
        return (
            f"WorkerPool(backend={self.backend!r}, size={self.size}, timeout={self.timeout}, "
            f"task_timeout={self.task_timeout}, start_timeout={self.start_timeout}, "
            f"running={self._running})"
        )

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- lifecycle
    def _worker_env(self, authkey: bytes, address: tuple[str, int]) -> dict[str, str]:
        env = dict(os.environ)
        for var in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "OMPI_COMM_WORLD_RANK",
            "PMI_RANK",
            "PMI_SIZE",
            "PMIX_RANK",
        ):
            env.pop(var, None)
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = "1"
        if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env[_worker.ENV_ADDRESS] = f"{address[0]}:{address[1]}"
        env[_worker.ENV_AUTHKEY] = authkey.hex()
        env[_worker.ENV_BACKEND] = self.backend
        env[_worker.ENV_TIMEOUT] = repr(self.timeout)
        env.update(self.env)
        return env

    def start(self) -> None:
        """Start the world (called by the constructor and after a failed task).

        A start that fails because a worker exited (e.g. the gloo port was taken between choosing
        and binding it) is tried once more.
        """
        if self._running:
            return
        for attempt in (1, 2):
            try:
                self._start_once()
                return
            except CommError as exc:
                if attempt == 2 or isinstance(exc, CommTimeoutError):
                    raise

    def _start_once(self) -> None:
        authkey = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), family="AF_INET", authkey=authkey)
        for name in os.listdir(self._logdir):
            os.unlink(os.path.join(self._logdir, name))
        env = self._worker_env(authkey, listener.address)
        cmd = [sys.executable, "-m", "distconv.testing.worker"]
        self._procs.clear()
        try:
            if self.backend == "gloo":
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
                for r in range(self.size):
                    env_r = dict(env, RANK=str(r), WORLD_SIZE=str(self.size), LOCAL_RANK=str(r))
                    self._procs.append(self._spawn(cmd, env_r, f"rank{r}"))
            else:
                assert self.mpiexec is not None
                launcher = [self.mpiexec, "-n", str(self.size), *cmd]
                self._procs.append(self._spawn(launcher, env, "mpi"))
            self._conns = self._handshake(listener)
        except BaseException:
            self._kill_all(self._procs)
            self._procs.clear()
            raise
        finally:
            listener.close()
        self._running = True

    def _spawn(self, cmd: list[str], env: dict[str, str], name: str) -> subprocess.Popen:
        # echo: the workers write to this process's terminal (scripts); else to per-rank logs
        log = None if self.echo else open(os.path.join(self._logdir, f"{name}.log"), "wb")
        try:
            return subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=None if self.echo else subprocess.STDOUT,
                start_new_session=True,
                cwd=os.getcwd(),
            )
        finally:
            if log is not None:
                log.close()

    def _handshake(self, listener: Listener) -> list[Connection]:
        accepted: list[Connection] = []

        def accept() -> None:
            try:
                while len(accepted) < self.size:
                    accepted.append(listener.accept())
            except OSError:
                pass

        acceptor = threading.Thread(target=accept, daemon=True, name="distconv-pool-accept")
        acceptor.start()
        deadline = time.monotonic() + self.start_timeout
        while len(accepted) < self.size:
            if time.monotonic() > deadline:
                raise CommTimeoutError(self._start_failure("workers did not connect in time"))
            if any(p.poll() is not None for p in self._procs):
                raise CommError(self._start_failure("a worker exited during start-up"))
            time.sleep(0.02)
        conns: list[Connection | None] = [None] * self.size
        for conn in accepted:
            left = deadline - time.monotonic()
            if not conn.poll(max(left, 0)):
                raise CommTimeoutError(self._start_failure("the world did not initialise in time"))
            msg = conn.recv()
            if msg[0] != "ready":
                raise CommError(self._start_failure(f"a worker failed to initialise:\n{msg[1][0]}"))
            conns[msg[1]] = conn
        return [c for c in conns if c is not None]

    def _logs(self) -> str:
        if not os.path.isdir(self._logdir):
            return ""
        parts = []
        for name in sorted(os.listdir(self._logdir)):
            text = Path(self._logdir, name).read_text(errors="replace")[-_LOG_TAIL:].strip()
            if text:
                parts.append(f"--- {name} ---\n{text}")
        return "\n".join(parts)

    def _start_failure(self, what: str) -> str:
        return f"{self!r} failed to start: {what}\n{self._logs()}"

    @staticmethod
    def _cleanup(procs: list[subprocess.Popen], logdir: str) -> None:
        WorkerPool._kill_all(procs)
        shutil.rmtree(logdir, ignore_errors=True)

    @staticmethod
    def _kill_all(procs: list[subprocess.Popen]) -> None:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def _stop(self, *, graceful: bool) -> None:
        if graceful:
            for conn in self._conns:
                try:
                    conn.send(None)
                except OSError:
                    pass
            deadline = time.monotonic() + 10
            for p in self._procs:
                try:
                    p.wait(timeout=max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    pass
        for conn in self._conns:
            conn.close()
        self._conns = []
        self._kill_all(self._procs)
        self._procs.clear()
        self._running = False

    def restart(self) -> None:
        """Kill the world and start a fresh one."""
        self._stop(graceful=False)
        self.restarts += 1
        self.start()

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop(graceful=self._running)
        self._finalizer()

    # ---------------------------------------------------------------- tasks
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kw: Any):
        """Run ``fn(comm, *args, **kw)`` on every rank; return the per-rank results in rank order.

        ``fn`` must be a module-level function (sent by reference), ``args``/``kw`` and the
        results picklable. ``timeout`` defaults to the pool's ``task_timeout``. When ranks raise,
        the most telling exception (an error in ``fn`` before the communication errors it
        caused; lowest rank first) is re-raised with its rank in the message, chained to the
        remote traceback text.
        """
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if not callable(fn):
            raise TypeError(f"fn must be a module-level function, got {fn!r}")
        check_timeout(timeout, allow_none=True)
        ref = _fn_ref(fn)
        payload = pickle.dumps((args, kw))
        if not self._running:
            self.restart()
        limit = self.task_timeout if timeout is None else float(timeout)
        name = ref[1]
        try:
            for conn in self._conns:
                conn.send((ref, payload))
        except OSError:  # a worker died since the last task: start afresh and retry once
            self.restart()
            for conn in self._conns:
                conn.send((ref, payload))
        replies: list[Any] = [None] * self.size
        pending = {conn: r for r, conn in enumerate(self._conns)}
        deadline = time.monotonic() + limit
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._stop(graceful=False)
                raise CommTimeoutError(
                    f"{self!r}: task {name!r} did not finish within {limit} s on ranks "
                    f"{sorted(pending.values())}; the pool restarts before the next task"
                )
            for conn in wait(list(pending), timeout=left):
                r = pending.pop(conn)  # type: ignore[call-overload]
                try:
                    replies[r] = conn.recv()
                except (EOFError, OSError):
                    replies[r] = ("died", None)
        return self._collect(name, replies)

    def _collect(self, name: str, replies: list[Any]) -> list[Any]:
        errors: list[BaseException | None] = [None] * self.size
        texts: list[str] = [""] * self.size
        for r, (kind, body) in enumerate(replies):
            if kind == "err":
                text, blob, summary = body
                texts[r] = text
                exc = None
                if blob is not None:
                    try:
                        exc = pickle.loads(blob)
                    except Exception:
                        exc = None
                errors[r] = exc if isinstance(exc, BaseException) else RemoteError(summary)
            elif kind == "died":
                errors[r] = CommError(f"rank {r} worker exited during task {name!r}")
                texts[r] = self._logs()
        lost = any(
            isinstance(e, CommError) and not isinstance(e, CollectiveMismatchError) for e in errors
        )
        if lost:
            self._stop(graceful=False)
        bad = pick_error(errors)
        if bad is not None:
            exc = errors[bad]
            assert exc is not None
            where = f"{self.backend} pool of {self.size}"
            raise with_rank(exc, bad, where) from RemoteTraceback(texts[bad])
        return [pickle.loads(body) for _, body in replies]
