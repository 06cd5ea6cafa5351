"""Whole-network cases: a model, a config, a global batch; the single-process reference training
step and the per-rank run of the user's loop. Module-level, so real worker processes import them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distconv.data import sample_block
from distconv.models import resnet_mini
from distconv.nn import shard_specs
from distconv.parallel import parallelize
from distconv.parallel.explain import explain
from distconv.redistribute import gather

#: fp64 tolerance of the whole-network checks (values and gradients are O(1)).
TOL = 1e-10

#: the options the op tests run a model under on 4 ranks: sample, spatial (H), stationary-x/-y/-w
OPTIONS = {
    "sample": {"default": {"grid": {"N": 4}, "algorithm": "sample"}},
    "spatial": {"default": {"grid": {"N": 2, "H": 2}, "algorithm": "spatial"},
                "data": {"N": 2, "H": 2}},
    "stationary-x": {"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"}},
    "stationary-y": {"default": {"grid": {"N": 2, "F": 2}, "algorithm": "stationary-y"}},
    "stationary-w": {"default": {"grid": {"C": 2, "F": 2}, "algorithm": "stationary-w"}},
}
LR, MOMENTUM = 0.1, 0.9

#: The paper's hybrid on 4 ranks in miniature: spatial N×H early, stationary-x, stationary-y
#: where y is wider than x, and C×F stationary-w in the last stage.
RESNET_CONFIG: dict[str, Any] = {"layers": [
    {"match": "conv1", "grid": {"N": 2, "H": 2}, "algorithm": "spatial"},
    {"match": "layer1.*", "grid": {"N": 2, "H": 2}, "algorithm": "spatial"},
    {"match": "layer2.*", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"},
    {"match": "layer3.0.conv[12]", "grid": {"N": 2, "F": 2}, "algorithm": "stationary-y"},
    {"match": "layer3.*", "grid": {"F": 2, "C": 2}, "algorithm": "stationary-w"},
]}
RESNET_SHAPE = (6, 3, 16, 16)


def seeded(model: nn.Module, gen: torch.Generator) -> nn.Module:
    """Re-draw every parameter from ``gen`` (thread ranks share torch's global generator, so a
    model drawn from it on several threads at once differs from rank to rank)."""
    with torch.no_grad():
        for p in model.parameters():
            fan_in = p[0].numel() if p.dim() > 1 else p.numel()
            p.copy_((torch.rand(p.shape, generator=gen, dtype=p.dtype) * 2 - 1) / fan_in ** 0.5)
    return model


def resnet_case(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    model = seeded(resnet_mini().double(), gen)
    x = torch.randn(RESNET_SHAPE, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (RESNET_SHAPE[0],), generator=gen)
    return model, x, y


def reference_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                   reduction: str = "mean") -> dict[str, Any]:
    """One single-process training step on the global batch: output, loss, gradients, and the
    parameters and buffers after SGD with momentum."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    out = model(x)
    loss = F.cross_entropy(out, y, reduction=reduction)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    opt.step()
    return {"out": out.detach(), "loss": loss.detach(), "grads": grads,
            "state": {k: v.clone() for k, v in model.state_dict().items()}}


def train_step(comm: Any, model: nn.Module, config: Any, x: torch.Tensor, y: torch.Tensor,
               reduction: str = "mean", input_shape: Any = None) -> dict[str, Any]:
    """The user's loop, verbatim, for one step on this rank's samples; then everything gathered."""
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm, loss_reduction=reduction,
                         input_shape=input_shape)
    opt = torch.optim.SGD(pmodel.parameters(), lr=LR, momentum=MOMENTUM)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    out = pmodel(x[rows])
    loss = F.cross_entropy(out, y[rows], reduction=reduction)
    loss.backward()
    grads = _gathered_grads(pmodel)
    opt.step()
    opt.zero_grad()
    return {"rows": rows, "out": out.detach(), "loss": loss.detach(), "grads": grads,
            "state": pmodel.gather_state_dict()}


def _gathered_grads(pmodel: nn.Module) -> dict[str, torch.Tensor]:
    specs = shard_specs(pmodel)
    out = {}
    for k, p in pmodel.named_parameters():
        s = specs[k]
        out[k] = p.grad.clone() if s.grid is None else gather(p.grad, s.dist, s.grid,
                                                              s.global_shape)
    return out


def max_errors(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, float]:
    rows = got["rows"]
    err = {"out": (got["out"] - ref["out"][rows]).abs().max().item()}
    err["grads"] = max((got["grads"][k] - g).abs().max().item() for k, g in ref["grads"].items())
    err["state"] = max((got["state"][k].double() - v.double()).abs().max().item()
                       for k, v in ref["state"].items())
    return err


def resnet_bytes(world_size: int) -> list[tuple[int, int]]:
    """``explain``'s (forward, backward) bytes of every rank for the fixed ResNet case."""
    plan = explain(resnet_case()[0], RESNET_CONFIG, RESNET_SHAPE, world_size=world_size)
    return [tuple(plan.rank_bytes(r).values()) for r in range(world_size)]


def resnet_run(comm: Any, explained: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    """The fixed ResNet case: errors against one process and counted bytes against ``explain``,
    per rank. Thread worlds pass ``explained`` from outside: tracing (``explain``) while another
    thread rank runs a model would intercept its module calls."""
    model, x, y = resnet_case()
    ref = reference_step(model, x, y)
    got = counted_step(comm, model, RESNET_CONFIG, x, y)
    explained = explained or resnet_bytes(comm.size)
    return {
        "out": (got["out"] - ref["out"][got["rows"]]).abs().max().item(),
        "grads": max((got["grads"][k] - g).abs().max().item() for k, g in ref["grads"].items()),
        "counted": got["counted"],
        "explained": tuple(explained[comm.rank]),
    }


def counted_step(comm: Any, model: nn.Module, config: Any, x: torch.Tensor, y: torch.Tensor
                 ) -> dict[str, Any]:
    """One forward and backward of the user's loop on this rank's samples: its rows, output,
    the gathered gradients and the bytes the communicator counted (forward, backward)."""
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    b0 = comm.stats.total_bytes()
    out = pmodel(x[rows])
    b1 = comm.stats.total_bytes()
    F.cross_entropy(out, y[rows]).backward()
    b2 = comm.stats.total_bytes()
    return {"rows": rows, "out": out.detach(), "grads": _gathered_grads(pmodel),
            "counted": (b1 - b0, b2 - b1)}


def square_mean_reference(model: nn.Module, x: torch.Tensor, seed: int | None = None
                          ) -> dict[str, Any]:
    """One process: the output and parameter gradients of ``model(x).square().mean()`` (torch's
    generator seeded with ``seed`` first, where the model draws)."""
    model = copy.deepcopy(model)
    if seed is not None:
        torch.manual_seed(seed)
    out = model(x)
    out.square().mean().backward()
    return {"out": out.detach(), "grads": {k: p.grad for k, p in model.named_parameters()}}


def square_mean_step(comm: Any, model: nn.Module, config: Any, x: torch.Tensor
                     ) -> dict[str, Any]:
    """The same on the parallel model: this rank's samples, its output rows, the gathered
    gradients and the module types it built."""
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    out = pmodel(x[rows])
    out.square().mean().backward()
    kinds = {type(m).__name__ for m in pmodel.modules()}
    return {"rows": rows, "out": out.detach(), "grads": _gathered_grads(pmodel), "kinds": kinds}


def check_rows(ref: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """Every rank's output rows and every gathered gradient equal one process's."""
    for got in results:
        assert (got["out"] - ref["out"][got["rows"]]).abs().max() < TOL
        for k, g in ref["grads"].items():
            assert (got["grads"][k] - g).abs().max() < TOL, k
