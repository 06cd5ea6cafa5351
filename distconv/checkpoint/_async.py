"""Writing a checkpoint in the background: :class:`SaveHandle` and the file-system rendezvous.

Everything collective (agreeing on the state, the plan) is done before ``save`` returns; the
background thread of each rank only touches files, because communicators are not safe to use from
two threads at once. The copy of the rank's share into host memory runs while the agreement's
exchange is in flight; a copy that fails after it is written to the directory as that rank's
record (step 2), so the save fails on every rank. The ranks meet in the checkpoint directory:

1. every rank writes its shard file (durable: written, ``fsync``'d, renamed);
2. every rank other than 0 then writes a small record ``.rank-RRRRR.json`` (its file's size and
   SHA-256s, or its error), tagged with the save's token;
3. rank 0 waits for every record, writes the index last, then removes the records; on a failure
   it writes ``.failed.json`` instead (and no index);
4. every other rank waits until the index (or ``.failed.json``) of its save appears.

So ``wait()`` returns on every rank only once the whole checkpoint is complete. A rank that
stops making progress (no file in the directory grows or appears) for ``timeout`` seconds is
reported by name. A program that ends normally finishes its saves in flight before it exits; one
that fails in its main thread stops waiting for its peers at once (no index is written).
"""

from __future__ import annotations

import _thread
import atexit
import json
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from distconv.checkpoint._index import INDEX_NAME, CheckpointError, write_atomic

__all__ = [
    "FAILED_NAME", "SaveHandle", "await_index", "await_records", "record_name", "report",
    "reusable", "start", "wait_previous",
]

FAILED_NAME = ".failed.json"

#: the in-flight save of each communicator (thread ranks share a process, so not one per process)
_PENDING: weakref.WeakKeyDictionary[Any, SaveHandle] = weakref.WeakKeyDictionary()
#: the host copy of each model's last finished asynchronous save, for its next one (fresh pages
#: cost several times the copy itself); it lives as long as the model
_REUSE: weakref.WeakKeyDictionary[Any, dict[Any, torch.Tensor]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def record_name(rank: int) -> str:
    return f".rank-{rank:05d}.json"


class SaveHandle:
    """An asynchronous :func:`~distconv.checkpoint.save` in flight on one rank.

    ``wait()`` blocks until the checkpoint is complete on disk (its index written) and raises the
    save's failure, if any; ``done()`` says whether it has finished (either way).
    """

    def __init__(self, path: Path, rank: int, snapshot: list[tuple[str, torch.Tensor]],
                 job: Callable[[], None], owner: Any) -> None:
        self.path, self.rank = path, rank
        self.nbytes = sum(t.nbytes for _, t in snapshot)
        self._snapshot, self._job = snapshot, job
        self._owner = _weak(owner)
        self._error: BaseException | None = None
        self._reported = False
        self._started = time.perf_counter()
        self._seconds: float | None = None
        self._go, self._finished = threading.Event(), threading.Event()

    def _run(self) -> None:
        # wait until save() has returned: a writer that starts at once holds the interpreter
        # lock through its first Python steps while the caller waits to get it back
        self._go.wait()
        try:
            self._job()
        except BaseException as exc:  # kept for wait(): a background thread has no caller
            self._error = exc
        finally:
            self._seconds = time.perf_counter() - self._started
            with _LOCK:
                _RUNNING.discard(self)
            self._finished.set()

    def done(self) -> bool:
        """Whether the save has finished, completed or failed (never blocks)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is complete on every rank (its index written).

        Args:
            timeout: seconds to wait at most. Default ``None`` (no limit).

        Raises:
            TimeoutError: still writing after ``timeout`` seconds.
            The save's failure (``OSError``, :class:`CheckpointError`, ...), once.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(
                f"checkpoint save to {str(self.path)!r} (rank {self.rank}) still running after "
                f"{timeout} s"
            )
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error

    def __repr__(self) -> str:
        if not self.done():
            state = "writing"
        elif self._error is not None:
            state = f"failed: {type(self._error).__name__}: {self._error}"
        else:
            state = "complete"
        took = "" if self._seconds is None else f", seconds={self._seconds:.3f}"
        return (f"SaveHandle(path={str(self.path)!r}, rank={self.rank}, state={state!r}, "
                f"bytes={self.nbytes}{took})")


#: set when the program fails with an uncaught exception: saves in flight stop waiting for their
#: peers (which may be gone) and leave their checkpoint incomplete (no index)
_ABANDONED = threading.Event()
#: the saves whose writer is running, which the program's exit waits for
_RUNNING: set[SaveHandle] = set()
_HOOKED = False


def _hook_exit() -> None:
    """Once: a program that ends normally finishes its saves first (at exit), and one failing
    in its main thread (``sys.excepthook``) stops waiting on its saves' peers at once instead of
    for the whole timeout."""
    global _HOOKED
    with _LOCK:
        if _HOOKED:
            return
        _HOOKED = True
        previous = sys.excepthook

        def hook(kind: Any, value: Any, tb: Any) -> None:
            _ABANDONED.set()
            previous(kind, value, tb)

        sys.excepthook = hook
        atexit.register(_finish_running)


def _finish_running() -> None:
    with _LOCK:
        running = list(_RUNNING)
    for handle in running:
        handle._finished.wait()


def start(comm: Any, handle: SaveHandle) -> SaveHandle:
    """Run ``handle``'s job on a thread of its own. The thread is started without waiting for
    it to be scheduled (``threading.Thread.start`` waits, which on a busy machine costs the
    caller milliseconds); the exit waits for it instead (:func:`_hook_exit`)."""
    _hook_exit()
    with _LOCK:
        _RUNNING.add(handle)
    try:
        _thread.start_new_thread(handle._run, ())
    except BaseException:
        with _LOCK:
            _RUNNING.discard(handle)
        raise
    with _LOCK:
        _PENDING[comm] = handle
    handle._go.set()
    return handle


def wait_previous(comm: Any) -> None:
    """Wait for ``comm``'s save still in flight, and raise its failure if nobody saw it yet.
    Its host copy is kept for :func:`reusable` (allocating fresh pages costs more than copying)."""
    with _LOCK:
        handle = _PENDING.pop(comm, None)
    if handle is None:
        return
    handle._finished.wait()
    owner = handle._owner() if handle._owner is not None else None
    if owner is not None:
        with _LOCK:
            _REUSE[owner] = {(key, tuple(t.shape), t.dtype): t for key, t in handle._snapshot}
    if handle._error is not None and not handle._reported:
        handle._reported = True
        raise CheckpointError(
            f"the previous asynchronous save to {str(handle.path)!r} failed: "
            f"{type(handle._error).__name__}: {handle._error}"
        ) from handle._error


def reusable(owner: Any) -> dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor]:
    """The host copy of the last finished asynchronous save of ``owner`` (the saved model), by
    key, shape and dtype, handed out once."""
    if _weak(owner) is None:
        return {}
    with _LOCK:
        return _REUSE.pop(owner, {})


def _weak(obj: Any) -> weakref.ref[Any] | None:
    try:
        return weakref.ref(obj)
    except TypeError:  # an object without weak references keeps no copy
        return None


def await_records(path: Path, size: int, token: str, timeout: float) -> list[dict[str, Any]]:
    """Rank 0: the record of every rank from 1 to ``size - 1`` (raises naming a failed rank)."""
    records: dict[int, dict[str, Any]] = {}

    def check() -> bool:
        for r in range(1, size):
            if r not in records:
                got = _read(path / record_name(r), token)
                if got is not None:
                    if "error" in got:
                        raise CheckpointError(f"checkpoint.save could not write the shards: "
                                              f"rank {r}: {got['error']}")
                    records[r] = got
        return len(records) == size - 1

    _await(path, check, timeout, lambda: f"ranks {sorted(set(range(1, size)) - set(records))} "
                                         "did not report their shards")
    return [records[r] for r in range(1, size)]


def await_index(path: Path, token: str, timeout: float) -> None:
    """Ranks other than 0: until rank 0 has written the index of save ``token``."""

    def check() -> bool:
        failed = _read(path / FAILED_NAME, token)
        if failed is not None:
            raise CheckpointError(f"checkpoint.save could not complete {str(path)!r}: rank 0 "
                                  f"reports {failed['error']}")
        return (path / INDEX_NAME).is_file() and _read(path / INDEX_NAME, token) is not None

    _await(path, check, timeout, lambda: "rank 0 did not write the index")


def report(path: Path, name: str, record: dict[str, Any]) -> None:
    write_atomic(path / name, json.dumps(record).encode())


def _read(file: Path, token: str) -> dict[str, Any] | None:
    """The JSON object in ``file`` if it exists and belongs to save ``token``."""
    try:
        got = json.loads(file.read_bytes())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) and got.get("token") == token else None


def _await(path: Path, check: Callable[[], bool], timeout: float,
           what: Callable[[], str]) -> None:
    """Poll ``check()`` until true; give up after ``timeout`` s in which no file changed."""
    pause, seen, deadline = 0.0005, None, time.monotonic() + timeout
    while not check():
        if _ABANDONED.is_set():
            raise CheckpointError(f"checkpoint.save of {str(path)!r} abandoned: the program "
                                  "failed before it completed (no index: not a checkpoint)")
        now = time.monotonic()
        progress = _progress(path)
        if progress != seen:
            seen, deadline = progress, now + timeout
        elif now > deadline:
            raise CheckpointError(
                f"checkpoint.save of {str(path)!r}: {what()} within {timeout} s without progress"
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.02)


def _progress(path: Path) -> tuple[tuple[str, int], ...]:
    try:
        return tuple(sorted((f.name, f.stat().st_size) for f in path.iterdir()))
    except OSError:
        return ()
