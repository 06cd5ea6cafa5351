"""Blind spots of checkpoints: a block that does not start at row 0 cut among its holders, and an
optimizer loaded into one whose parameters are listed in another order. Expectations are the
saved values themselves, compared bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.optional import need  # noqa: E402

need("safetensors")

import distconv
from distconv.comm import SingleCommunicator
from distconv.parallel import parallelize
from distconv.testing import run_threads

FILTERS = {"default": {"grid": {"N": 2, "F": 2}, "algorithm": "stationary-y"}}


def _wide(seed: int = 0) -> nn.Sequential:
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(256, 160, 3, padding=1)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def _save(comm: Any, path: str) -> None:
    distconv.save(parallelize(_wide(), FILTERS, comm=comm), path, comm=comm)


def test_a_filter_block_cut_among_its_holders_keeps_its_rows(tmp_path: Path) -> None:
    # w[o_F,*,*,*] on {N: 2, F: 2}: filter block 1 (rows 80..159, 1.5 MB) is held by both N
    # ranks and cut between them; its pieces must land on rows 80..159, not 0..79
    path = tmp_path / "ckpt"
    run_threads(_save, 4, str(path), timeout=30.0)
    want = _wide().state_dict()
    got = distconv.consolidate(path)
    for key, t in want.items():
        assert torch.equal(got[key], t), key


def _stepped(seed: int, params_reversed: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _small(seed)
    params = list(model.parameters())
    opt = torch.optim.SGD(params[::-1] if params_reversed else params, lr=0.1, momentum=0.9)
    return model, opt


def _small(seed: int) -> nn.Sequential:
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 1)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


@pytest.mark.parametrize("params_reversed", [False, True])
def test_optimizer_state_follows_its_parameter_by_name(tmp_path: Path,
                                                      params_reversed: bool) -> None:
    model, opt = _stepped(0, params_reversed=False)
    x = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    model(x).square().sum().backward()
    opt.step()  # a momentum buffer per parameter, each its own gradient
    saved = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}
    distconv.save(model, tmp_path / "ckpt", optimizer=opt, comm=SingleCommunicator())
    other, other_opt = _stepped(1, params_reversed)
    distconv.load(other, tmp_path / "ckpt", optimizer=other_opt)
    for n, p in other.named_parameters():
        assert torch.equal(other_opt.state[p]["momentum_buffer"], saved[n]), n
