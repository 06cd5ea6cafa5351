"""The Redistribute module: moves activations between distributions, with the exact adjoint."""

from __future__ import annotations

import pytest
import torch

from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.nn import DistConv2d, Redistribute
from distconv.testing import run_threads

SHAPE = (3, 5, 4, 4)


def _roundtrip(comm):  # noqa: ANN001, ANN202
    grid = ProcessorGrid({"N": 2, "C": 2}, comm=comm)
    src = Dist.parse("x[o,o_C,o,o]", tensor_dims="NCHW")
    dst = Dist.parse("x[o,*,o,o]", tensor_dims="NCHW")
    X = torch.arange(float(torch.Size(SHAPE).numel()), dtype=torch.float64).reshape(SHAPE)
    x = X[src.local_slices(SHAPE, grid)].clone().requires_grad_(True)
    full = Redistribute(grid, src, dst, global_shape=SHAPE)(x)
    back = Redistribute(grid, dst, src)(full, SHAPE)
    full.sum().backward()
    # the replicated tensor's cotangent is a pending sum over C: each element counted C=2 times
    return torch.equal(full, X[dst.local_slices(SHAPE, grid)]), torch.equal(back, x), \
        torch.equal(x.grad, torch.full_like(x, 2.0))


def test_redistribute_module_roundtrip_and_adjoint() -> None:
    for ok in run_threads(_roundtrip, 4):
        assert all(ok)


def _no_shape(comm):  # noqa: ANN001, ANN202
    grid = ProcessorGrid({"C": 2}, comm=comm)
    Redistribute(grid, Dist((None, "C")), Dist((None, None)))(torch.zeros(2, 2))


def test_redistribute_module_needs_a_global_shape() -> None:
    with pytest.raises(ValueError, match="global shape"):
        run_threads(_no_shape, 2)


def _describe(comm):  # noqa: ANN001, ANN202
    grid = ProcessorGrid({"C": 2, "F": 2}, comm=comm)
    return DistConv2d(8, 8, 3, padding=1, grid=grid, algorithm="stationary-w",
                      init_seed=0).describe((2, 8, 6, 6))


def test_describe_lists_the_steps_in_the_papers_notation() -> None:
    text = run_threads(_describe, 4)[0]
    assert "allgather dim 1 over F" in text and "reduce-scatter dim 1 over C" in text
    assert "Σ_C y[o,o_F,o,o]" in text
