"""``torch.compile`` of a parallelized model and of the user's step: the collectives, conversions
and distributed layers run eagerly (graph breaks), the local computation between them compiles,
and a training step equals one process. Compiling takes seconds: a small model, few cases."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distconv.comm import SingleCommunicator
from distconv.data import sample_block
from distconv.parallel import parallelize
from tests.parallel.cases import LR, MOMENTUM, TOL, _gathered_grads


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv1(x)))
        x = x + torch.relu(self.conv2(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    model = Small().double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return model, torch.randn(4, 3, 8, 8, generator=gen, dtype=torch.float64), \
        torch.randint(0, 4, (4,), generator=gen)


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    out = model(x)
    F.cross_entropy(out, y).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    opt.step()
    return {"out": out.detach(), "grads": grads, "state": model.state_dict()}


def compiled_steps(comm: Any, model: nn.Module, config: Any, x: torch.Tensor, y: torch.Tensor,
                   whole_step: bool) -> dict[str, Any]:
    """Two steps: ``torch.compile(pmodel)``, or (``whole_step``) the user's step function
    compiled; the first step's output and gradients, the state after it."""
    torch._dynamo.reset()
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    opt = torch.optim.SGD(pmodel.parameters(), lr=LR, momentum=MOMENTUM)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    net = pmodel if whole_step else torch.compile(pmodel)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        out = net(xb)
        F.cross_entropy(out, yb).backward()
        return out

    run = torch.compile(step) if whole_step else step
    out = run(x[rows], y[rows])
    got = {"rows": rows, "out": out.detach(), "grads": _gathered_grads(pmodel)}
    opt.step()
    got["state"] = pmodel.gather_state_dict()
    opt.zero_grad()
    run(x[rows], y[rows])  # a second call runs the compiled code, not the first trace
    return got


def _check(got: dict[str, Any], ref: dict[str, Any]) -> None:
    rows = got["rows"]
    assert (got["out"] - ref["out"][rows]).abs().max() < TOL
    for k, g in ref["grads"].items():
        assert (got["grads"][k] - g).abs().max() < TOL, k
    for k, v in ref["state"].items():
        assert (got["state"][k].double() - v.double()).abs().max() < TOL, k


def test_compiled_parallel_model_on_one_rank() -> None:
    model, x, y = _case()
    got = compiled_steps(SingleCommunicator(), model, {"default": {"grid": {"N": 1}}}, x, y,
                         False)
    _check(got, _reference(model, x, y))


def test_compiled_step_on_gloo(gloo2) -> None:  # noqa: ANN001
    """The user's whole step compiled (the parallel model's forward is traced inside it; its
    backward runs the gradient hooks and collectives eagerly)."""
    model, x, y = _case()
    ref = _reference(model, x, y)
    config = {"default": {"grid": {"N": 2}, "algorithm": "sample"},
              "layers": [{"match": "conv2", "grid": {"C": 2}, "algorithm": "stationary-x"}]}
    for got in gloo2.run(compiled_steps, model, config, x, y, True):
        _check(got, ref)
