"""Session fixtures: real multi-process worlds, each started once per pytest session.

``gloo2`` / ``gloo4``: torch.distributed gloo worlds of 2 / 4 processes on loopback;
``mpi4``: an ``mpiexec -n 4`` job (skipped when mpi4py or mpiexec is missing).
Each is a :class:`distconv.testing.WorkerPool`: ``pool.run(fn, *args)`` runs the module-level
function ``fn(comm, *args)`` on every rank and returns the per-rank results. The workers import
``tests.*`` modules by name (pytest's ``pythonpath = ["."]``). A task that kills or wedges the
world makes the pool restart itself before its next task.
"""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import settings

# Timing belongs in benchmarks/: on a shared 2-core machine a per-example deadline only adds flakes.
settings.register_profile("distconv", deadline=None, print_blob=True)
settings.load_profile("distconv")

from distconv.testing import WorkerPool, find_mpiexec
from tests.vision_ops import install as install_vision_ops

# torchvision's models load here even where its compiled extension cannot (tests/vision_ops.py)
install_vision_ops()

# Communicator timeout in the workers: a hung collective fails in 120 s. Generous, so a slow rank
# on a loaded machine (compiling, importing) is never taken for a hung one; a run's own limit is
# the pool's default, 2 * 120 + 30 s, within pytest-timeout's 300 s hang guard.
POOL_TIMEOUT = 120.0


def _pool(backend: str, size: int):
    pool = WorkerPool(backend, size, timeout=POOL_TIMEOUT)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def gloo2():
    yield from _pool("gloo", 2)


@pytest.fixture(scope="session")
def gloo4():
    yield from _pool("gloo", 4)


@pytest.fixture(scope="session")
def mpi4():
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4 needs mpi4py (pip install mpi4py mpich)")
    if find_mpiexec() is None:
        pytest.skip("mpi4 needs an mpiexec beside python or on PATH (pip install mpich)")
    yield from _pool("mpi", 4)


#: the session's real worlds: under pytest-xdist (``make test`` runs ``-n auto --dist loadgroup``)
#: every test that uses one runs in the same worker, so each world is still started once
WORLDS = frozenset({"gloo2", "gloo4", "mpi4"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if WORLDS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("worlds"))
