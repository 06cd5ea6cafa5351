"""Behaviours of the newest handlers and of the capture that no other test pins: a softmax over
a negative dim that is split, an integer index into a split dim, two dropouts replayed in one
recomputed segment, the capture's check of the graph's output shapes, and never-called modules
that hold only buffers. Every expectation is one process's result (or written out here), on
thread ranks, and the split ops once on a real gloo world."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distconv.data import sample_block
from distconv.parallel import parallelize
from distconv.parallel.capture import UntraceableModelError
from distconv.parallel.explain import explain
from distconv.testing import run_threads
from tests.parallel.cases import (
    OPTIONS, TOL, _gathered_grads, max_errors, reference_step, seeded, train_step,
)


class _NegativeSoftmax(nn.Module):
    """Softmax over dim -2 (the rows, split under the spatial option) and log_softmax over dim
    -3 (the channels, split under stationary-x): each must normalise whole rows."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        z = torch.softmax(y, dim=-2) * 5 + F.log_softmax(y, -3)
        return self.head(z.mean((2, 3)))


class _SplitIndex(nn.Module):
    """``y[:, 1]``: the second channel of a value whose channels are split under stationary-x
    (held by one rank's block only), broadcast back over the channels."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.head((y * y[:, 1][:, None]).mean((2, 3)))


CASES = {"negative-softmax": (_NegativeSoftmax, ("spatial", "stationary-x")),
         "split-index": (_SplitIndex, ("stationary-x",))}


def _case(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    model = seeded(CASES[name][0]().double(), gen)
    x = torch.randn(4, 3, 6, 5, generator=gen, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (4,), generator=gen)


@pytest.mark.parametrize("name,option", [(n, o) for n, (_, opts) in CASES.items() for o in opts])
def test_a_split_dim_is_made_whole_where_the_op_reads_it_whole(name: str, option: str) -> None:
    model, x, y = _case(name)
    ref = reference_step(model, x, y)
    # the split dims are written here: the option splits the dim the op reads whole
    assert {"spatial": "H", "stationary-x": "C"}[option] in OPTIONS[option]["default"]["grid"]
    for got in run_threads(train_step, 4, model, OPTIONS[option], x, y):
        err = max_errors(ref, got)
        assert max(err.values()) < TOL, err


@pytest.mark.gloo
def test_a_split_dim_made_whole_on_gloo(gloo4) -> None:  # noqa: ANN001
    for name, option in (("negative-softmax", "spatial"), ("split-index", "stationary-x")):
        model, x, y = _case(name)
        ref = reference_step(model, x, y)
        for got in gloo4.run(train_step, model, OPTIONS[option], x, y):
            err = max_errors(ref, got)
            assert max(err.values()) < TOL, (name, err)


# ----------------------------------------------------------------------------- recomputation
TWO_DROPOUTS = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1),
                             nn.Sequential(nn.Dropout(0.5), nn.ReLU(), nn.Dropout(0.25)),
                             nn.Conv2d(6, 4, 1)).double()


def _two_dropouts(comm: Any, config: Any, x: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)  # rank 0's initial seed seeds the generator the ranks share
    pmodel = parallelize(copy.deepcopy(TWO_DROPOUTS), config, comm=comm)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    pmodel(x[rows]).square().sum().backward()
    return _gathered_grads(pmodel)


def test_two_dropouts_in_one_recomputed_segment_replay_their_own_masks() -> None:
    # rows split: each dropout draws its global mask from the generator the ranks share (one
    # process's masks, each rank keeps its block); the two masks differ in their probability,
    # so replaying them in another order changes the gradients
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    spatial = OPTIONS["spatial"]
    plain = run_threads(_two_dropouts, 4, spatial, x)
    recomputed = run_threads(_two_dropouts, 4, {**spatial, "layers": [
        {"match": "1", "checkpoint": True}]}, x)
    for a, b in zip(plain, recomputed):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- the capture
class _ShapeFromIsinstance(nn.Module):
    """fx answers ``isinstance(proxy, torch.Tensor)`` False: the captured graph returns the
    channels averaged to one, while the module returns them all (every module is called either way)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        if isinstance(x, torch.Tensor):
            return y
        return y.mean(1, keepdim=True)


def test_a_capture_that_returns_other_shapes_than_the_module_is_refused() -> None:
    config = {"default": {"grid": {"N": 2}, "algorithm": "sample"}}
    with pytest.raises(UntraceableModelError, match=r"returns shapes \[\(4, 1, 6, 6\)\]"):
        explain(_ShapeFromIsinstance(), config, (4, 3, 6, 6), world_size=2)


class _Statistics(nn.Module):
    """Buffers only (no parameter), in a module the forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.arange(4.0, dtype=torch.float64))


class _WithUncalled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.stats = _Statistics()  # never called
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).mean((2, 3)))


def _state_keys(comm: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    pmodel = parallelize(copy.deepcopy(model),
                         {"default": {"grid": {"N": 2}, "algorithm": "sample"}}, comm=comm)
    return pmodel.gather_state_dict()


def test_a_never_called_module_with_only_buffers_keeps_them_in_the_state() -> None:
    model = _WithUncalled().double()
    want = model.state_dict()
    assert "stats.mean" in want  # one process's state lists the buffer
    for got in run_threads(_state_keys, 2, model):
        assert list(got) == list(want)
        assert torch.equal(got["stats.mean"], torch.arange(4.0, dtype=torch.float64))


class _Unsaved(nn.Module):
    """A non-persistent buffer read in the forward (timm's relative position index) and a mask
    built from sizes (Swin's shifted-window mask, a constant of the capture): neither is state."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 4, dtype=torch.float64)[:, None,
                                                                                       None],
                             persistent=False)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[2:]
        mask = torch.zeros((h, w), dtype=x.dtype, device=x.device)
        mask[: h // 2] = 1.0
        return self.head((self.conv(x) * self.scale * (1 + mask)).mean((2, 3)))


def _unsaved_state(comm: Any, model: nn.Module, x: torch.Tensor) -> tuple[list, list]:
    pmodel = parallelize(copy.deepcopy(model),
                         {"default": {"grid": {"N": 2}, "algorithm": "sample"}}, comm=comm,
                         input_shape=tuple(x.shape))
    return list(pmodel.state_dict()), list(pmodel.gather_state_dict())


def test_unsaved_buffers_and_the_captures_constants_stay_out_of_the_state() -> None:
    model = _Unsaved().double()
    x = torch.randn(4, 3, 6, 5, dtype=torch.float64)
    want = ["conv.weight", "conv.bias", "head.weight", "head.bias"]
    assert list(model.state_dict()) == want
    for local, gathered in run_threads(_unsaved_state, 2, model, x):
        assert local == want and gathered == want


# ----------------------------------------------------------------------------- root tensors
class _TableBias(nn.Module):
    """A relative-position-style bias: a parameter table indexed by the root's own buffer,
    sliced to the captured size (the capture reads the buffer into a constant, so the graph
    never reads the buffer itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.table = nn.Parameter(torch.randn(9, 4))
        self.register_buffer("index", torch.arange(36).remainder(9).view(6, 6))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        n = y.shape[2]
        bias = self.table[self.index.clone()[:n, :n].reshape(-1)].view(n, n, -1)
        y = y + bias.permute(2, 0, 1)[None, :, :, :y.shape[3]]
        return self.head(y.mean((2, 3)))


def test_a_root_buffer_the_graph_never_reads_stays_in_the_state() -> None:
    gen = torch.Generator().manual_seed(11)
    model = seeded(_TableBias().double(), gen)
    x = torch.randn(4, 3, 6, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (4,), generator=gen)
    ref = reference_step(model, x, y)
    assert "index" in ref["state"]  # (the one-process model's state lists it)
    for got in run_threads(train_step, 4, model, OPTIONS["spatial"], x, y, "mean",
                           tuple(x.shape)):
        assert sorted(got["state"]) == sorted(ref["state"])
        err = max_errors(ref, got)
        assert max(err.values()) < TOL, err
