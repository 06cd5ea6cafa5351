"""The planner on networks of ``Conv1d``, ``Conv3d`` and transposed convolutions: what it plans
runs as one process, moving the bytes ``explain`` says, and is no dearer than any pure
alternative priced the same way."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distconv import models
from distconv.machines import lassen
from distconv.parallel.explain import explain
from distconv.planner import plan_network
from distconv.testing import run_threads
from tests.parallel.cases import TOL, counted_step


def _case(name: str, shape: tuple[int, ...]) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(7)
    if name == "unet":
        model, classes = models.unet3d(in_channels=shape[1], base=2, depth=1), 2
        target = (shape[0], *shape[2:])
    else:
        model, classes = models.cosmoflow_mini(in_channels=shape[1], size=shape[2]), 4
        target = (shape[0],)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    return model.double(), x, torch.randint(0, classes, target, generator=gen)


def _planned_step(comm: Any, explained: list, case: tuple, config: dict) -> dict:
    """One step under ``config`` against one process (a rank may hold no sample of a batch
    smaller than the world), and the bytes counted."""
    model, x, y = case
    ref = copy.deepcopy(model)
    out_ref = ref(x)
    F.cross_entropy(out_ref, y).backward()
    got = counted_step(comm, model, config, x, y)
    diff = (got["out"] - out_ref.detach()[got["rows"]]).abs()
    return {"out": diff.max().item() if diff.numel() else 0.0,
            "grads": max((got["grads"][k] - p.grad).abs().max().item()
                         for k, p in ref.named_parameters()),
            "counted": got["counted"], "explained": tuple(explained[comm.rank])}


@pytest.mark.parametrize("name, shape", [("unet", (2, 1, 8, 8, 8)), ("unet", (1, 1, 8, 8, 8)),
                                         ("cosmoflow", (2, 4, 8, 8, 8)),
                                         ("cosmoflow", (1, 4, 8, 8, 8))])
def test_the_planned_3d_network_trains_as_one_process_moving_what_explain_says(name, shape
                                                                               ) -> None:  # noqa: ANN001
    case = _case(name, shape)
    plan = plan_network(case[0], shape, world_size=4, machine=lassen(), itemsize=8)
    config = plan.config()
    ex = explain(case[0], config, shape, world_size=4)
    explained = [tuple(ex.rank_bytes(r).values()) for r in range(4)]
    for r in run_threads(_planned_step, 4, explained, case, config):
        assert r["out"] < TOL and r["grads"] < TOL, r
        assert r["counted"] == r["explained"], r
