"""Mixed precision: a parallelized model under ``torch.autocast`` trains as one process does
under the same autocast. Parameters, gradients and BatchNorm statistics stay float32; the
activations (and so the collectives that move them) are in autocast's dtype.

Tolerance, written down per dtype: a low-precision run cannot equal another bitwise, so each is
measured against the float64 result of the same step, as a relative L2 error over all of a kind
(the outputs, all gradients, the state after the step; per tensor, BatchNorm gradients are
dominated by cancellation noise in one process already). The parallel run's error is at most
``FACTOR`` times one process's under the same autocast, plus ``ULP[dtype]``: a sum split into k
partial sums, each rounded to the low precision, carries up to k + 1 roundings where one process
rounds once, and these configs split a reduction at most 2 ways (FACTOR = 3).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from distconv.data import sample_block
from distconv.parallel import parallelize
from distconv.testing import run_threads
from tests.parallel.cases import LR, MOMENTUM, RESNET_CONFIG, _gathered_grads, resnet_case

FACTOR = 3.0
ULP = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
HYBRID = RESNET_CONFIG  # spatial, stationary-x, -y and -w layers
SAMPLE = {"default": {"grid": {"N": 4}, "algorithm": "sample"}}


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
          dtype: torch.dtype | None, scaler: Any = None) -> dict[str, Any]:
    """The user's step: forward and loss under autocast (if ``dtype``), backward, SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    with torch.autocast(x.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = model(x)
        loss = F.cross_entropy(out, y)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
    else:
        loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    return {"out": out.detach(), "grads": grads, "state": model.state_dict()}


def parallel_step(comm: Any, model: torch.nn.Module, config: Any, x: torch.Tensor,
                  y: torch.Tensor, dtype: torch.dtype, scaled: bool = False) -> dict[str, Any]:
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    opt = torch.optim.SGD(pmodel.parameters(), lr=LR, momentum=MOMENTUM)
    scaler = torch.amp.GradScaler(x.device.type, init_scale=2.0 ** 10) if scaled else None
    with torch.autocast(x.device.type, dtype=dtype):
        out = pmodel(x[rows])
        loss = F.cross_entropy(out, y[rows])
    (scaler.scale(loss) if scaler else loss).backward()
    if scaler:
        scaler.unscale_(opt)
    grads = _gathered_grads(pmodel)
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    return {"rows": rows, "out": out.detach(), "grads": grads,
            "state": pmodel.gather_state_dict(),
            "dtypes": {k: (p.dtype, p.grad.dtype) for k, p in pmodel.named_parameters()}}


def _relative(ours: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> float:
    num = sum((ours[k].double() - v.double()).square().sum() for k, v in truth.items())
    return float((num / sum(v.double().square().sum() for v in truth.values())).sqrt())


def _check(got: dict[str, Any], one: dict[str, Any], exact: dict[str, Any],
           dtype: torch.dtype) -> None:
    rows = got["rows"]
    assert got["out"].dtype == one["out"].dtype == dtype
    floats = [k for k, v in exact["state"].items() if v.is_floating_point()]
    for name, ours, theirs, truth in [
        ("out", {"": got["out"]}, {"": one["out"][rows]}, {"": exact["out"][rows]}),
        ("gradients", got["grads"], one["grads"], exact["grads"]),
        ("state", *({k: d["state"][k] for k in floats} for d in (got, one, exact))),
    ]:
        ours_err, one_err = _relative(ours, truth), _relative(theirs, truth)
        assert ours_err <= FACTOR * one_err + ULP[dtype], (name, ours_err, one_err)
    for k, (p, g) in got["dtypes"].items():
        assert p == torch.float32 and g == torch.float32, k
    for k, v in got["state"].items():
        if "running" in k:
            assert v.dtype == torch.float32, k


def _case(device: str = "cpu") -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    model, x, y = resnet_case()
    return model.float().to(device), x.float().to(device), y.to(device)


@pytest.mark.parametrize("config", [HYBRID, SAMPLE], ids=["hybrid", "sample"])
def test_bf16_autocast_trains_as_one_process_does(config: dict) -> None:
    model, x, y = _case()
    one = _step(copy.deepcopy(model), x, y, torch.bfloat16)
    exact = _step(copy.deepcopy(model).double(), x.double(), y, None)
    for got in run_threads(parallel_step, 4, model, config, x, y, torch.bfloat16):
        _check(got, one, exact, torch.bfloat16)


def test_fp16_autocast_with_a_grad_scaler() -> None:
    model, x, y = _case()
    one = _step(copy.deepcopy(model), x, y, torch.float16,
                torch.amp.GradScaler("cpu", init_scale=2.0 ** 10))
    exact = _step(copy.deepcopy(model).double(), x.double(), y, None)
    for got in run_threads(parallel_step, 4, model, HYBRID, x, y, torch.float16, True):
        _check(got, one, exact, torch.float16)


@pytest.mark.parametrize("pool", ["gloo4", pytest.param("mpi4", marks=pytest.mark.mpi)])
def test_bf16_on_real_worlds(pool: str, request: pytest.FixtureRequest) -> None:
    """gloo moves and sums bfloat16 itself; MPI has no bfloat16 reduction, so its backend widens
    to float32 for the sum and narrows back (never a byte-wise sum of bf16 bits)."""
    world = request.getfixturevalue(pool)
    model, x, y = _case()
    one = _step(copy.deepcopy(model), x, y, torch.bfloat16)
    exact = _step(copy.deepcopy(model).double(), x.double(), y, None)
    for got in world.run(parallel_step, model, HYBRID, x, y, torch.bfloat16):
        _check(got, one, exact, torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_on_cuda(dtype: torch.dtype) -> None:
    """Thread ranks sharing one GPU; fp16 with a grad scaler, as users train on GPUs."""
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    model, x, y = _case("cuda")
    scaled = dtype == torch.float16
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10) if scaled else None
    one = _step(copy.deepcopy(model), x, y, dtype, scaler)
    exact = _step(copy.deepcopy(model).double(), x.double(), y, None)
    for got in run_threads(parallel_step, 4, model, HYBRID, x, y, dtype, scaled):
        _check(got, one, exact, dtype)
