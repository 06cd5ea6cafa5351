"""Multi-rank test worlds for distconv and for users' own suites.

- :func:`run_threads` — P thread-ranks in this process (milliseconds per run; property tests).
- :class:`WorkerPool` — a persistent real world (gloo processes or an ``mpiexec`` job), started
  once, that runs module-level functions on every rank.
- :func:`rank_generator` — a random generator of the rank's own: thread ranks share torch's
  global generator, so same-seed draws from it differ between them.

Names are imported on first use (the worker entry module needs none of them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distconv.testing._errors import RemoteError, RemoteTraceback
    from distconv.testing.pool import WorkerPool, find_mpiexec
    from distconv.testing.rng import rank_generator
    from distconv.testing.threads import run_threads

__all__ = [
    "RemoteError", "RemoteTraceback", "WorkerPool", "find_mpiexec", "rank_generator", "run_threads",
]

_WHERE = {
    "RemoteError": "distconv.testing._errors",
    "RemoteTraceback": "distconv.testing._errors",
    "WorkerPool": "distconv.testing.pool",
    "find_mpiexec": "distconv.testing.pool",
    "rank_generator": "distconv.testing.rng",
    "run_threads": "distconv.testing.threads",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
