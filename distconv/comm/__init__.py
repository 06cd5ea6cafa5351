"""Communicators: the only place in distconv that talks to a communication library.

``init()`` picks a backend from the environment; ``world()`` returns the process-wide default.
See :class:`~distconv.comm.base.Communicator` for the operations and the byte-count convention.
"""

from __future__ import annotations

import atexit
import os
import threading

from distconv.comm.base import (
    CommStats, Communicator, Work, check_timeout, get_debug, set_debug,
)
from distconv.comm.errors import CollectiveMismatchError, CommError, CommTimeoutError
from distconv.comm.single import SingleCommunicator
from distconv.comm.threads import ThreadCommunicator

__all__ = [
    "BACKENDS",
    "CollectiveMismatchError",
    "CommError",
    "CommStats",
    "CommTimeoutError",
    "Communicator",
    "SingleCommunicator",
    "ThreadCommunicator",
    "Work",
    "get_debug",
    "init",
    "set_debug",
    "shutdown",
    "world",
]

BACKENDS = ("gloo", "nccl", "torch", "mpi", "single")
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_world: Communicator | None = None
_lock = threading.Lock()


def _detect() -> str:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torch"
    if any(v in env for v in _MPI_RANK_VARS):
        return "mpi"
    return "single"


def init(backend: str | None = None, *, timeout: float = 60.0) -> Communicator:
    """Create (once) and return this process's world communicator.

    Args:
        backend: ``None`` (default) detects it from the environment: torchrun variables (``RANK``,
            ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) give torch.distributed (NCCL when
            CUDA is available and ``LOCAL_RANK`` is set, else gloo); MPI launcher variables
            (``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``, ``PMIX_RANK``, ``MV2_COMM_WORLD_RANK``) give
            mpi4py; otherwise a size-1 communicator. Or one of ``"gloo"``, ``"nccl"``, ``"torch"``
            (gloo or NCCL, as detected), ``"mpi"``, ``"single"``.
        timeout: seconds (default 60.0) after which a collective that cannot complete raises
            :class:`CommTimeoutError`.

    A second call returns the existing world when ``backend`` is None or names its backend.
    """
    global _world
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")
    check_timeout(timeout)
    with _lock:
        if _world is not None:
            if backend is None or _matches(_world, backend):
                return _world
            raise RuntimeError(
                f"distconv.comm is already initialised with backend {_world.backend!r}; "
                f"cannot re-initialise with {backend!r}"
            )
        kind = backend or _detect()
        if kind in ("gloo", "nccl", "torch"):
            from distconv.comm.torch_backend import init_torch

            _world = init_torch(None if kind == "torch" else kind, timeout=timeout)
        elif kind == "mpi":
            from distconv.comm.mpi_backend import init_mpi

            _world = init_mpi(timeout=timeout)
        else:
            _world = SingleCommunicator(timeout=timeout)
        _register_shutdown()
        return _world


_registered = False


def _register_shutdown() -> None:
    # atexit handlers run before interpreter finalization, while background threads of the
    # communication libraries can still take the GIL (see TorchCommunicator._release)
    global _registered
    if not _registered:
        atexit.register(shutdown)
        _registered = True


def shutdown() -> None:
    """Release the world communicator, every sub-communicator split from it (newest first) and,
    when ``init()`` created it, torch's default process group. Idempotent and not collective.

    Runs by itself at interpreter exit, so a script that simply ends exits cleanly; call it
    earlier to free the resources sooner. A later ``init()`` creates a new world.
    """
    global _world
    with _lock:
        comm, _world = _world, None
        if comm is None:
            return
        comm.close()
        if comm.backend.startswith("torch-"):
            from distconv.comm.torch_backend import destroy_default_group

            destroy_default_group()


def _matches(comm: Communicator, backend: str) -> bool:
    if backend == "torch":
        return comm.backend.startswith("torch-")
    if backend in ("gloo", "nccl"):
        return comm.backend == f"torch-{backend}"
    return comm.backend == backend


def world() -> Communicator:
    """The process-wide default communicator (``init()`` with defaults on first use)."""
    return _world if _world is not None else init()
