"""The same checks on real engines: gloo (2 and 4 processes) and MPI (mpiexec -n 4).

Each backend runs its whole fixed set in one ``pool.run``; failures name the rank and the check.
"""

from __future__ import annotations

import pytest
import torch

from distconv.testing import WorkerPool
from tests.comm import programs

POOLS = [
    pytest.param("gloo2", marks=pytest.mark.gloo),
    pytest.param("gloo4", marks=pytest.mark.gloo),
    pytest.param("mpi4", marks=pytest.mark.mpi),
]
BACKEND = {"gloo2": "torch-gloo", "gloo4": "torch-gloo", "mpi4": "mpi"}


def every_op_every_dtype(comm):
    """check_all_ops for several dtypes, contiguous and not, then the split checks."""
    out = {}
    for dtype in ("float32", "float64", "bfloat16", "float16", "int64", "int16", "bool"):
        for noncontiguous in (False, True):
            out[dtype, noncontiguous] = programs.check_all_ops(comm, dtype, 7, noncontiguous)
    out["split"] = programs.check_split(comm)
    return out


def _pool(request, name: str) -> WorkerPool:
    return request.getfixturevalue(name)


@pytest.mark.parametrize("name", POOLS)
def test_every_op_matches_reference(request, name):
    pool = _pool(request, name)
    results = pool.run(every_op_every_dtype)
    assert len(results) == pool.size
    for r, res in enumerate(results):
        snap, backend = res["float32", False]
        assert backend == BACKEND[name]
        assert snap["calls"]["allreduce"] == 5
        assert res["split"][0] == r // 2


@pytest.mark.parametrize("name", POOLS)
def test_world_ranks(request, name):
    pool = _pool(request, name)
    assert pool.run(programs.rank_and_size) == [
        (r, pool.size, BACKEND[name]) for r in range(pool.size)
    ]


@pytest.mark.mpi
def test_mpi_bf16_reduction_is_fp32_rounded_once(mpi4):
    for got, want in mpi4.run(programs.bf16_reduce):
        assert torch.equal(got, want)


@pytest.mark.mpi
def test_mpi_noncontiguous_bf16_buffers(mpi4):
    for snap, _ in mpi4.run(programs.check_all_ops, "bfloat16", 11, True):
        assert snap["calls"]["alltoall"] == 2


@pytest.mark.gloo
@pytest.mark.parametrize("name", ["gloo2", "gloo4"])
def test_gloo_native_reduce_scatter_matches(request, name):
    for snaps in _pool(request, name).run(programs.reduce_scatter_native):
        assert all(s["calls"]["reduce_scatter"] == 3 for s in snaps)


@pytest.mark.parametrize("name", POOLS)
def test_chunks_of_one_tensor_are_exchanged_exactly(request, name):
    pool = _pool(request, name)
    for dtype in ("float32", "bfloat16", "int16"):
        assert pool.run(programs.chunks_of_one_tensor, dtype) == [BACKEND[name]] * pool.size
