"""Conformance of every op handler: each sample call, under each option it lists, equals one
process (fp64: output and every gradient) on thread ranks, and the bytes the communicators count
on every rank equal what ``explain`` prices from the same handler. A handler without samples
fails here."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from distconv import ops
from distconv.data import sample_block
from distconv.parallel import parallelize
from distconv.parallel.explain import explain
from distconv.testing import run_threads
from tests.parallel.cases import TOL, _gathered_grads, seeded

CASES = [(type(h).__name__, sample, world, config)
         for h in ops.REGISTRY for sample in h.samples() for world, config in sample.configs]


def test_every_handler_has_samples() -> None:
    missing = [type(h).__name__ for h in ops.REGISTRY if not h.samples()]
    assert not missing, f"handlers without conformance samples: {missing}"


def _run(comm: Any, model: Any, config: dict, x: torch.Tensor, y: torch.Tensor) -> dict:
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    b0 = comm.stats.total_bytes()
    out = pmodel(x[rows])
    b1 = comm.stats.total_bytes()
    F.cross_entropy(out, y[rows]).backward()
    b2 = comm.stats.total_bytes()
    return {"rows": rows, "out": out.detach(), "grads": _gathered_grads(pmodel),
            "counted": (b1 - b0, b2 - b1)}


@pytest.mark.parametrize("handler,sample,world,config", CASES,
                         ids=[f"{c[1].name}-{i}" for i, c in enumerate(CASES)])
def test_sample_equals_one_process_and_its_price(handler: str, sample: ops.Sample, world: int,
                                                 config: dict) -> None:
    gen = torch.Generator().manual_seed(11)
    model = seeded(sample.make().double(), gen)
    x = torch.randn(sample.shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (sample.shape[0],), generator=gen)
    ref = copy.deepcopy(model)
    out = ref(x)
    F.cross_entropy(out, y).backward()
    plan = explain(model, config, sample.shape, world_size=world, itemsize=8)
    for r, got in enumerate(run_threads(_run, world, model, config, x, y)):
        assert (got["out"] - out.detach()[got["rows"]]).abs().max() < TOL, (handler, config)
        for k, p in ref.named_parameters():
            assert (got["grads"][k] - p.grad).abs().max() < TOL, (handler, config, k)
        assert got["counted"] == tuple(plan.rank_bytes(r).values()), (handler, config, r)


class _Unsupported(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.GroupNorm(2, 8)
        self.up = torch.nn.Upsample(scale_factor=2)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.up(self.norm(self.conv(x)))
        x = x * x.mean((2, 3), keepdim=True)
        return self.head(x.mean((2, 3)))


def test_explain_lists_every_unsupported_node_at_once() -> None:
    config = {"default": {"grid": {"N": 1, "H": 2}, "algorithm": "spatial"},
              "data": {"N": 1, "H": 2}}
    with pytest.raises(ops.Unsupported, match="node 'norm'"):
        explain(_Unsupported(), config, (2, 3, 8, 8))  # strict: the first, as parallelize
    plan = explain(_Unsupported(), config, (2, 3, 8, 8), strict=False)
    assert [n for n, _, _ in plan.unsupported] == ["norm", "up", "mul"]
    reasons = dict((n, r) for n, _, r in plan.unsupported)
    assert "GroupNorm needs (C, H, W)" in reasons["norm"] and "H over H" in reasons["norm"]
    assert "Upsample is not supported" in reasons["up"] and "GroupNorm" in reasons["up"]
    assert "broadcasts" in reasons["mul"]
    assert "unsupported: 3 node(s)" in str(plan)
    assert [u["node"] for u in plan.to_dict()["unsupported"]] == ["norm", "up", "mul"]
