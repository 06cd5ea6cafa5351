"""The collectives of redistribution plans, unchecked per call: exact against references built
from every rank's inputs, counted as the public calls count them, on threads, gloo and MPI; on
one host the activation-sized ones go through the shared-memory bulk ring."""

from __future__ import annotations

import pytest

from distconv.comm.host_channel import BULK_BYTES
from distconv.comm.mpi_backend import RING_ALLGATHER, RING_REDUCE_SCATTER
from distconv.testing import run_threads
from tests.comm import programs


def test_planned_collectives_on_threads():
    for routes in run_threads(programs.planned_collectives, 3, False):
        assert len(routes) == 24 and all(r[-1] == 0 for r in routes.values())


@pytest.mark.gloo
def test_planned_collectives_on_gloo(gloo2):
    for routes in gloo2.run(programs.planned_collectives):
        # the small ones take the small ring, the activation-sized ones the bulk ring
        assert all(issued == (2 if big else 0) for big, _, _, issued in routes.values()), routes


@pytest.mark.mpi
def test_planned_collectives_on_mpi(mpi4):
    for routes in mpi4.run(programs.planned_collectives):
        assert any(r[-1] == 2 for r in routes.values()), routes
        for what, (_, width, rs_bytes, issued) in routes.items():
            # the ring takes allgathers of 8 KiB to a bulk slot per rank and reduce-scatters of
            # 32 KiB to a bulk slot in all; MPI the rest
            want = ((RING_ALLGATHER <= width <= BULK_BYTES)
                    + (RING_REDUCE_SCATTER <= rs_bytes <= BULK_BYTES))
            assert issued == want, (what, issued)
