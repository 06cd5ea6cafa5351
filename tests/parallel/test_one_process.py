"""On one process a parallelized model is the plain module: every layer of a one-rank grid calls
the torch ops the plain module calls, no more, so a training loop is bitwise the plain module's
(outputs, gradients, parameters, BatchNorm's running statistics), across train/eval switches."""

from __future__ import annotations

import collections
import copy
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from distconv.comm import SingleCommunicator
from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.nn import DistBatchNorm2d, DistConv2d
from distconv.parallel import parallelize


class Net(nn.Module):
    """Convolutions with and without bias, zero and reflect padding, batch norms of every
    setting, a residual sum, pooling and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 6, 3, stride=2, padding=1, padding_mode="reflect")
        self.bn2 = nn.BatchNorm2d(6, momentum=None)
        self.conv3 = nn.Conv2d(6, 6, 1)
        self.bn3 = nn.BatchNorm2d(6, affine=False)
        self.bn4 = nn.BatchNorm2d(6, track_running_stats=False)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        x = x + self.bn4(self.bn3(self.conv3(x)))
        return self.head(self.pool(x).mean((2, 3)))


class _Ops(TorchDispatchMode):
    """Counts the aten ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _pair(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = Net().to(dtype)
    return plain, parallelize(copy.deepcopy(plain), {"default": {"grid": {"N": 1}}},
                              comm=SingleCommunicator())


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
          y: torch.Tensor) -> dict[str, torch.Tensor]:
    out = model(x)
    F.cross_entropy(out, y).backward()
    got = {"out": out.detach().clone()}
    got.update({f"grad {k}": p.grad.clone() for k, p in model.named_parameters()})
    opt.step()
    opt.zero_grad()
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_process_training_is_bitwise_the_plain_module(dtype: torch.dtype) -> None:
    plain, ours = _pair(dtype)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, ours)]
    gen = torch.Generator().manual_seed(1)
    for step, mode in enumerate(["train", "train", "eval", "train", "eval", "train"]):
        x = torch.randn(4 + step % 2, 3, 8, 8, generator=gen, dtype=dtype)
        y = torch.randint(0, 4, (x.shape[0],), generator=gen)
        results = []
        for model, opt in zip((plain, ours), opts):
            getattr(model, mode)()
            results.append(_step(model, opt, x, y))
        assert results[0].keys() == results[1].keys()
        for key, want in results[0].items():
            assert torch.equal(results[1][key], want), (step, mode, key)
        ours_state = ours.state_dict()
        for key, want in plain.state_dict().items():  # parameters and running statistics
            assert torch.equal(ours_state[key], want), (step, mode, key)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_one_process_step_runs_exactly_the_plain_modules_ops(mode: str) -> None:
    """No wrapper Function, copy or extra kernel: the same aten ops, as many times."""
    plain, ours = _pair()
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    counts = []
    for model in (plain, ours):
        getattr(model, mode)()
        F.cross_entropy(model(x), y).backward()  # the first call plans the shape
        model.zero_grad()
        with _Ops() as ops:
            F.cross_entropy(model(x), y).backward()
            model.zero_grad()
        counts.append(ops.counts)
    assert counts[1] == counts[0]


def test_one_process_frees_what_backward_does_not_keep_where_the_plain_module_does() -> None:
    """bn1's output is read by a ReLU only (which keeps its own output for backward): once the
    ReLU ran it is garbage in the plain module, and in the parallel model's step too (not held
    until the step returns)."""
    alive = {}
    for name, model in zip(("plain", "ours"), _pair()):
        seen: list[Any] = []
        model.get_submodule("bn1").register_forward_hook(
            lambda m, args, out, seen=seen: seen.append(weakref.ref(out)))
        model.get_submodule("head").register_forward_hook(
            lambda m, args, out, seen=seen, name=name: alive.update({name: seen[0]() is not None}))
        F.cross_entropy(model(torch.randn(4, 3, 8, 8)), torch.randint(0, 4, (4,))).backward()
    assert alive == {"plain": False, "ours": False}


def _one_rank_bn(**options: Any) -> tuple[nn.BatchNorm2d, DistBatchNorm2d]:
    torch.manual_seed(2)
    ref = nn.BatchNorm2d(5, dtype=torch.float64, **options)
    if ref.affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-0.5, 0.5)
    grid = ProcessorGrid({"N": 1}, comm=SingleCommunicator())
    return ref, DistBatchNorm2d.from_batchnorm2d(
        copy.deepcopy(ref), grid=grid, input_dist=Dist.parse("x[o,o_C,o,o]", "NCHW"))


@pytest.mark.parametrize("options", [
    {}, {"momentum": None}, {"momentum": 0.7, "eps": 1e-3}, {"affine": False},
    {"track_running_stats": False},
])
@pytest.mark.parametrize("global_shape", [False, True])
def test_one_rank_batchnorm_is_bitwise_batchnorm2d(options: dict, global_shape: bool) -> None:
    """Output, dL/dx, dL/dw, dL/db, running statistics and ``num_batches_tracked`` over train
    and eval steps, with and without the global shape."""
    ref, bn = _one_rank_bn(**options)
    gen = torch.Generator().manual_seed(3)
    for mode in ["train", "train", "eval", "train", "eval"]:
        x = torch.randn(3, 5, 4, 2, generator=gen, dtype=torch.float64)
        dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        grads = []
        for layer, args in ((ref, ()), (bn, (tuple(x.shape),) if global_shape else ())):
            getattr(layer, mode)()
            xi = x.clone().requires_grad_()
            out = layer(xi, *args)
            out.backward(dy)
            grads.append([out.detach(), xi.grad] + [p.grad.clone() for p in layer.parameters()])
            layer.zero_grad()
        assert len(grads[0]) == len(grads[1])
        for want, got in zip(*grads):
            assert torch.equal(got, want), mode
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            want, got = getattr(ref, name), getattr(bn, name)
            assert (got is None and want is None) or torch.equal(got, want), (mode, name)


@pytest.mark.parametrize("shape_type", [tuple, list])
def test_one_rank_batchnorm_recomputed_under_checkpoint_counts_the_batch_once(
        shape_type: type) -> None:
    """The recomputation normalises as the first forward did and leaves the running statistics
    as the first forward left them (a tuple shape takes the kernel path, a list the general
    one)."""
    from distconv.nn.recompute import recompute_context

    ref, bn = _one_rank_bn()
    x = torch.randn(3, 5, 4, 2, dtype=torch.float64, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(bn, x, shape_type(x.shape), use_reentrant=False,
                                            context_fn=recompute_context)
    out.backward(torch.ones_like(out))
    xr = x.detach().clone().requires_grad_()
    want = ref(xr)
    want.backward(torch.ones_like(want))
    assert torch.equal(out, want) and torch.equal(x.grad, xr.grad)
    assert torch.equal(bn.weight.grad, ref.weight.grad)
    assert torch.equal(bn.running_mean, ref.running_mean)
    assert torch.equal(bn.running_var, ref.running_var)
    assert int(bn.num_batches_tracked) == 1


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "circular"])
def test_one_rank_conv_is_bitwise_conv2d(padding_mode: str) -> None:
    torch.manual_seed(4)
    ref = nn.Conv2d(4, 6, 3, stride=2, padding=1, padding_mode=padding_mode,
                    dtype=torch.float64)
    grid = ProcessorGrid({"N": 1}, comm=SingleCommunicator())
    conv = DistConv2d.from_conv2d(ref, grid=grid, algorithm="stationary-x")
    x = torch.randn(2, 4, 7, 5, dtype=torch.float64)
    dy = torch.randn(ref(x).shape, dtype=torch.float64)
    results = []
    for layer, args in ((ref, ()), (conv, ()), (conv, (tuple(x.shape),))):
        xi = x.clone().requires_grad_()
        out = layer(xi, *args)
        out.backward(dy)
        results.append([out.detach(), xi.grad, layer.weight.grad.clone(),
                        layer.bias.grad.clone()])
        layer.zero_grad()
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            assert torch.equal(a, b)


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


def test_layers_are_checked_through_replaced_containers() -> None:
    """A container on the way to a layer replaced by one holding the same layers runs on; a
    layer replaced inside a new container is refused by name, before anything runs."""
    torch.manual_seed(6)
    plain = Blocks()
    ours = parallelize(copy.deepcopy(plain), {"default": {"grid": {"N": 1}}},
                       comm=SingleCommunicator())
    x = torch.randn(2, 3, 5, 5)
    assert torch.equal(ours(x), plain(x))
    same = nn.Module()  # the same layers in a new container
    for name, child in ours.body.named_children():
        same.add_module(name, child)
    ours.body = same
    assert torch.equal(ours(x), plain(x))
    other = nn.Module()
    for name, child in ours.body.named_children():
        other.add_module(name, nn.BatchNorm2d(4) if name == "1" else child)
    ours.body = other
    with pytest.raises(TypeError, match="'body.1' was replaced after parallelize"):
        ours(x)
