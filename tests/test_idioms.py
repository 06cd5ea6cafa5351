"""The idioms of ordinary training loops, on a parallel model: each equals one process (fp64), or
is refused before the first step with a message naming the module or node.

Every idiom is written once, as a user writes it, as a function of the model it trains (the plain
model on one process, or the :class:`~distconv.ParallelModel` on every rank with its samples) and
of the clip function the user calls (torch's on one process, :func:`distconv.clip_grad_norm_` in
parallel). The reference is the same loop on one process with torch alone.
"""

from __future__ import annotations

import contextlib
import copy
import io
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch.nn.functional as F
from torch import nn

import distconv
from distconv.comm import SingleCommunicator, set_debug
from distconv.data import sample_block
from distconv.nn import DistAdaptiveAvgPool2d, DistAvgPool2d, DistBatchNorm2d, DistMaxPool2d
from distconv.parallel import parallelize
from distconv.parallel.explain import explain
from distconv.testing import run_threads
from tests.parallel.cases import (
    RESNET_CONFIG, TOL, _gathered_grads, counted_step, max_errors, reference_step, resnet_case,
    seeded, train_step,
)
from tests.parallel.test_parallelize import network_cases

STEPS = 2
Loop = Callable[..., dict]


# ----------------------------------------------------------------------------- the user's loops
def _batches(x: torch.Tensor, y: torch.Tensor, micro: bool = False
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two global batches: the samples in two orders (each cut in two micro-batches)."""
    perm = torch.arange(x.shape[0] - 1, -1, -1)
    batches = [(x, y), (x[perm], y[perm])]
    if micro:
        batches = [(bx[s], by[s]) for bx, by in batches for s in (slice(0, 3), slice(3, None))]
    return batches


def loop_clip(model, batches, clip, norm_type=2.0) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norms = []
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()
        norms.append(clip(model.parameters(), 1e-3, norm_type=norm_type))
        opt.step()
        opt.zero_grad()
    return {"norms": torch.stack(norms)}


def loop_clip_value(model, batches, clip) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        opt.step()
        opt.zero_grad()
    return {}


def freeze_stem(model: nn.Module) -> None:
    """Fine-tuning: a frozen stem and first stage (before parallelize)."""
    for p in list(model.conv1.parameters()) + list(model.bn1.parameters()):
        p.requires_grad_(False)
    for p in model.layer1.parameters():
        p.requires_grad_(False)


def loop_frozen(model, batches, clip) -> dict:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                          momentum=0.9, weight_decay=0.1)
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    return {"frozen_without_grad": all(p.grad is None for p in model.parameters()
                                       if not p.requires_grad), "frozen": frozen}


def loop_unfreeze(model, batches, clip) -> dict:
    """Frozen for the first step, the stage unfrozen for the second (progressive fine-tuning)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(batches):
        if i == 1:
            for p in model.layer1.parameters():
                p.requires_grad_(True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {}


def loop_bn_eval(model, batches, clip) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        model.train()
        for m in model.modules():  # the usual way to freeze BN statistics
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {}


def loop_submodule_eval(model, batches, clip) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(batches):
        model.train()
        if i == 0:
            model.layer2.eval()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    return {"eval_out": model(batches[0][0]).detach()}


def loop_accumulate(model, batches, clip) -> dict:
    """Gradient accumulation over two micro-batches, gradients zeroed (not set to None)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(len(batches) // 2):
        for xs, ys in batches[2 * step:2 * step + 2]:
            (F.cross_entropy(model(xs), ys) / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return {}


def loop_no_sync(model, batches, clip) -> dict:
    """DDP's accumulation recipe: the first micro-batch's backward inside ``no_sync``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(len(batches) // 2):
        (x0, y0), (x1, y1) = batches[2 * step:2 * step + 2]
        no_sync = getattr(model, "no_sync", contextlib.nullcontext)
        with no_sync():
            (F.cross_entropy(model(x0), y0) / 2).backward()
        (F.cross_entropy(model(x1), y1) / 2).backward()
        opt.step()
        opt.zero_grad()
    return {}


def loop_param_groups(model, batches, clip) -> dict:
    """No weight decay for norms and biases, found by type and by name; a step LR schedule."""
    norms = {id(p) for m in model.modules() if isinstance(m, nn.BatchNorm2d)
             for p in m.parameters()}
    decay = [p for n, p in model.named_parameters()
             if id(p) not in norms and not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters()
                if id(p) in norms or n.endswith("bias")]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 0.5},
                           {"params": no_decay, "weight_decay": 0.0}], lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return {"groups": [len(decay), len(no_decay)]}


def loop_double(model, batches, clip) -> dict:
    """A float32 model turned into float64 after it was built."""
    model = model.double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        F.cross_entropy(model(x.double()), y).backward()
        opt.step()
        opt.zero_grad()
    return {}


LOOPS: dict[str, tuple[Loop, Callable[[nn.Module], None] | None, dict]] = {
    "clip-2": (loop_clip, None, {"norm_type": 2.0}),
    "clip-1": (loop_clip, None, {"norm_type": 1.0}),
    "clip-inf": (loop_clip, None, {"norm_type": float("inf")}),
    "clip-value": (loop_clip_value, None, {}),
    "frozen": (loop_frozen, freeze_stem, {}),
    "unfreeze": (loop_unfreeze, lambda m: [p.requires_grad_(False)
                                           for p in m.layer1.parameters()], {}),
    "bn-eval": (loop_bn_eval, None, {}),
    "submodule-eval": (loop_submodule_eval, None, {}),
    "accumulate": (loop_accumulate, None, {}),
    "no-sync": (loop_no_sync, None, {}),
    "param-groups": (loop_param_groups, None, {}),
    "double": (loop_double, None, {}),
}


MICRO = ("accumulate", "no-sync")  # loops that take micro-batches


# ----------------------------------------------------------------------------- the two sides
def _case(idiom: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model, x, y = resnet_case(seed=3)
    x, y = x[:5], y[:5]  # uneven: 5 samples over N=2 blocks of 3 and 2
    if idiom == "double":
        model, x = model.float(), x.float()
    prepare = LOOPS[idiom][1]
    if prepare is not None:
        prepare(model)
    return model, x, y


def reference(idiom: str) -> dict[str, Any]:
    loop, _, kw = LOOPS[idiom]
    model, x, y = _case(idiom)
    model = copy.deepcopy(model)
    out = loop(model, _batches(x, y, idiom in MICRO), torch.nn.utils.clip_grad_norm_,
               **kw)
    out["state"] = {k: v.detach().clone() for k, v in model.double().state_dict().items()}
    out["global"] = x.shape[0]
    return out


def parallel(comm: Any, idiom: str) -> dict[str, Any]:
    loop, _, kw = LOOPS[idiom]
    model, x, y = _case(idiom)
    pmodel = parallelize(copy.deepcopy(model), RESNET_CONFIG, comm=comm)
    batches = []
    for bx, by in _batches(x, y, idiom in MICRO):  # each rank its block of each batch
        rows = sample_block(bx.shape[0], pmodel.data_grid)
        batches.append((bx[rows], by[rows]))
    out = loop(pmodel, batches, distconv.clip_grad_norm_, **kw)
    out["state"] = {k: v.double() for k, v in pmodel.gather_state_dict().items()}
    out["rows"] = sample_block(x.shape[0], pmodel.data_grid)
    return out


def _compare(ref: dict[str, Any], got: dict[str, Any]) -> None:
    for key, value in ref.items():
        if key in ("state", "global"):
            continue
        if key == "eval_out":
            assert (got[key] - value[got["rows"]]).abs().max() < TOL, key
        elif isinstance(value, torch.Tensor):
            assert (got[key].double() - value.double()).abs().max() < TOL, (key, got[key], value)
        else:
            assert got[key] == value, (key, got[key], value)
    assert set(got["state"]) == set(ref["state"])
    err = max((got["state"][k] - v).abs().max().item() for k, v in ref["state"].items())
    assert err < TOL, err


@pytest.mark.parametrize("idiom", sorted(LOOPS))
def test_idiom_equals_one_process(idiom: str) -> None:
    ref = reference(idiom)
    for got in run_threads(parallel, 4, idiom):
        _compare(ref, got)


def test_clip_really_clips_and_counts_every_shard_once() -> None:
    """The reference's norm is torch's on one process; it is far above max_norm, so the step is
    clipped, and the parallel norm equals it on every rank (replicas and shards counted once)."""
    ref = reference("clip-2")
    assert (ref["norms"] > 1e-2).all()
    for got in run_threads(parallel, 4, "clip-2"):
        assert torch.allclose(got["norms"], ref["norms"], rtol=1e-12, atol=0)


def _clip_step(comm: Any, model: nn.Module, config: Any, x: torch.Tensor, y: torch.Tensor,
               norm_type: float) -> dict[str, Any]:
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
    total = distconv.clip_grad_norm_(pmodel.parameters(), 1e-3, norm_type=norm_type)
    return {"total": total, "grads": _gathered_grads(pmodel)}


@settings(max_examples=8, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(network_cases(), st.sampled_from([2.0, 1.0, 3.0, float("inf")]))
def test_clip_on_random_grids_and_networks_equals_torch(case: tuple, norm_type: float) -> None:
    p, model, config, x, y = case
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3, norm_type=norm_type)
    for got in run_threads(_clip_step, p, model, config, x, y, norm_type):
        assert abs(got["total"].item() - total.item()) <= 1e-12 * total.item(), (config, got)
        for k, q in ref.named_parameters():
            assert (got["grads"][k] - q.grad).abs().max() < TOL, (config, k)


def _torch_clip_step(comm: Any, model: nn.Module, config: Any, x: torch.Tensor, y: torch.Tensor,
                     clip: dict[str, Any]) -> dict[str, Any]:
    """The user's step with torch's own clipping (and get_total_norm) on the parallel model."""
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
    before = torch.nn.utils.get_total_norm(
        [p.grad for p in pmodel.parameters() if p.grad is not None], clip["norm_type"])
    total = torch.nn.utils.clip_grad_norm_(pmodel.parameters(), **clip)
    return {"before": before, "total": total, "grads": _gathered_grads(pmodel)}


def _torch_clip_reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                          clip: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    total = torch.nn.utils.clip_grad_norm_(ref.parameters(), **clip)
    return total, {k: q.grad for k, q in ref.named_parameters()}


def _check_torch_clip(got: dict[str, Any], total: torch.Tensor,
                      grads: dict[str, torch.Tensor]) -> None:
    for key in ("before", "total"):
        assert type(got[key]) is torch.Tensor, key  # a plain tensor, the global norm
        assert abs(got[key].item() - total.item()) <= 1e-12 * total.item(), (key, got, total)
    for k, g in grads.items():
        assert (got["grads"][k] - g).abs().max() < TOL, k


@settings(max_examples=6, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(network_cases(), st.sampled_from([2.0, float("inf")]), st.sampled_from([1e-3, 1e6]),
       st.sampled_from([True, False]))
def test_torchs_own_clip_on_random_grids_and_networks_equals_one_process(
        case: tuple, norm_type: float, max_norm: float, foreach: bool) -> None:
    """torch.nn.utils.clip_grad_norm_ on the parallel model takes the global norm: a sharded
    parameter's gradient knows it is a shard. max_norm 1e6 is far above the norm (the coefficient
    is clamped at 1: nothing changes), 1e-3 far below (every gradient is scaled)."""
    p, model, config, x, y = case
    clip = {"max_norm": max_norm, "norm_type": norm_type, "foreach": foreach}
    total, grads = _torch_clip_reference(model, x, y, clip)
    assert (total > 1e-2) and (total < 1e6)
    for got in run_threads(_torch_clip_step, p, model, config, x, y, clip):
        _check_torch_clip(got, total, grads)


def _torch_clip_refused(comm: Any) -> list[str]:
    model, x, y = resnet_case()[:3]
    pmodel = parallelize(copy.deepcopy(model), RESNET_CONFIG, comm=comm)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
    before = {k: p.grad.clone() for k, p in pmodel.named_parameters()}
    messages = []
    for norm_type in (0.0, -float("inf")):
        with pytest.raises(ValueError) as info:
            torch.nn.utils.clip_grad_norm_(pmodel.parameters(), 1e-3, norm_type=norm_type)
        messages.append(str(info.value))
    assert all(torch.equal(p.grad, before[k]) for k, p in pmodel.named_parameters())
    return messages


def test_torchs_own_clip_refuses_a_norm_of_shards_it_cannot_combine() -> None:
    """Neither the 0-"norm" (torch counts the parameters whose gradient has a nonzero) nor the
    -inf one is combined over shards: refused before any gradient is scaled."""
    for messages in run_threads(_torch_clip_refused, 4):
        for norm_type, msg in zip((0.0, -float("inf")), messages):
            assert "norm_type > 0 or inf" in msg and repr(norm_type) in msg, msg
            assert "distconv.clip_grad_norm_" in msg


def _torch_clip_on_world(pool: Any, norm_type: float, foreach: bool) -> None:
    model, x, y = resnet_case()[:3]
    clip = {"max_norm": 1e-3, "norm_type": norm_type, "foreach": foreach}
    total, grads = _torch_clip_reference(model, x, y, clip)
    for got in pool.run(_torch_clip_step, model, RESNET_CONFIG, x, y, clip):
        _check_torch_clip(got, total, grads)


@pytest.mark.gloo
def test_torchs_own_clip_on_gloo(gloo4) -> None:
    _torch_clip_on_world(gloo4, 2.0, True)


@pytest.mark.mpi
def test_torchs_own_clip_on_mpi(mpi4) -> None:
    _torch_clip_on_world(mpi4, float("inf"), False)


def test_parameters_and_state_dict_keep_the_models_order() -> None:
    """Optimizers (and their state dicts) address parameters by position."""
    model = resnet_case()[0]
    pmodel = parallelize(copy.deepcopy(model), {"default": {"grid": {"N": 1}}},
                         comm=SingleCommunicator())
    assert [n for n, _ in pmodel.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(pmodel.state_dict()) == list(model.state_dict())


def test_frozen_parameters_get_no_gradient() -> None:
    ref = reference("frozen")
    assert ref["frozen_without_grad"] and ref["frozen"]
    for got in run_threads(parallel, 4, "frozen"):
        assert got["frozen"] == ref["frozen"] and got["frozen_without_grad"]


def _on_world(pool: Any, idioms: tuple[str, ...]) -> None:
    for idiom in idioms:
        ref = reference(idiom)
        for got in pool.run(parallel, idiom):
            _compare(ref, got)


@pytest.mark.gloo
def test_idioms_on_gloo(gloo4) -> None:
    _on_world(gloo4, ("clip-2", "clip-inf", "frozen", "bn-eval", "no-sync"))


@pytest.mark.mpi
def test_idioms_on_mpi(mpi4) -> None:
    _on_world(mpi4, ("clip-2", "clip-1", "frozen", "bn-eval", "no-sync"))


# ----------------------------------------------------------------------------- shared modules
class Tied(nn.Module):
    """Two convolutions sharing one weight, and one convolution called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.b = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.b.weight = self.a.weight
        self.c = nn.Conv2d(4, 4, 1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c(torch.relu(self.a(x)))
        x = self.c(torch.relu(self.b(x)))  # c again
        return self.head(x.mean((2, 3)))


TIED_CONFIG = {"layers": [{"match": "[abc]", "grid": {"N": 2, "C": 2},
                           "algorithm": "stationary-x"}]}


def _tied_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    model = seeded(Tied().double(), gen)
    x = torch.randn(5, 4, 6, 6, generator=gen, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (5,), generator=gen)


def _tied_parallel(comm: Any, config: Any) -> dict[str, Any]:
    model, x, y = _tied_case()
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    for _ in range(STEPS):
        F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    return {"count": len(list(pmodel.parameters())),
            "tied": pmodel.a.weight is pmodel.b.weight,
            "state": pmodel.gather_state_dict()}


def test_tied_weights_stay_one_parameter_and_a_module_called_twice_is_exact() -> None:
    model, x, y = _tied_case()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(STEPS):
        F.cross_entropy(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    plain_count = len(list(model.parameters()))
    assert plain_count == 5  # a.weight (= b.weight), c.weight, c.bias, head.weight, head.bias
    for got in run_threads(_tied_parallel, 4, TIED_CONFIG):
        assert got["tied"] and got["count"] == len(list(ref.parameters()))
        for k, v in ref.state_dict().items():
            assert (got["state"][k] - v).abs().max() < TOL, k


def test_tied_weights_sharded_differently_are_refused_naming_both() -> None:
    config = {"layers": [{"match": "a", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"},
                         {"match": "[bc]", "grid": {"N": 2, "F": 2},
                          "algorithm": "stationary-y"}]}

    def run(comm):
        with pytest.raises(ValueError) as info:
            _tied_parallel(comm, config)
        return str(info.value)

    for msg in run_threads(run, 4):
        assert "'a.weight'" in msg and "'b.weight'" in msg and "same grid" in msg


class CalledTwice(nn.Module):
    """One module (``shared``: a BatchNorm, a max-pool, ...) called after each of two
    convolutions, as U-Nets call their one max-pool at every level."""

    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(self.b(self.shared(self.a(x)))).mean((2, 3))


def _equal_to_one_process(model: nn.Module, config: dict, world: int,
                          shape: tuple[int, ...]) -> None:
    torch.manual_seed(8)
    model = model.double()
    x = torch.randn(*shape, dtype=torch.float64)
    y = torch.randint(0, 4, (shape[0],))
    ref = reference_step(model, x, y)
    for got in run_threads(train_step, world, model, config, x, y):
        err = max_errors(ref, got)
        assert max(err.values()) < TOL, err


def test_a_module_called_in_two_layouts_is_refused_naming_both_calls() -> None:
    config = {"layers": [{"match": "a", "grid": {"N": 2, "H": 2}, "algorithm": "spatial"},
                         {"match": "b", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"}]}

    def run(comm):
        with pytest.raises(ValueError) as info:
            parallelize(CalledTwice(nn.BatchNorm2d(4)), config, comm=comm)
        return str(info.value)

    for msg in run_threads(run, 4):
        assert "'shared' is called twice" in msg and "copy.deepcopy" in msg


def test_a_module_called_twice_in_the_same_layout_up_to_extent_one_dims_is_one_layer() -> None:
    """One BatchNorm after two convolutions whose grids differ only by dims of extent 1
    ({N: 2} and {N: 2, H: 1, W: 1}: every rank at the same coordinates): one layer serves both
    calls, exactly as one process (a U-Net's one max-pool module serves every level so)."""
    config = {"layers": [{"match": "a", "grid": {"N": 2}, "algorithm": "sample"},
                         {"match": "b", "grid": {"N": 2, "H": 1, "W": 1},
                          "algorithm": "spatial"}]}
    _equal_to_one_process(CalledTwice(nn.BatchNorm2d(4)), config, 2, (5, 4, 6, 5))


@pytest.mark.parametrize("first, second", [
    ({"grid": {"N": 2}, "algorithm": "sample"}, {"grid": {"N": 1, "H": 2}, "algorithm": "spatial"}),
    ({"grid": {"N": 1, "H": 2}, "algorithm": "spatial"}, {"grid": {"N": 2}, "algorithm": "sample"}),
], ids=["local-then-split", "split-then-local"])
def test_a_module_without_state_called_in_two_layouts_is_a_layer_per_call(first: dict,
                                                                          second: dict) -> None:
    """A max-pool called on samples split over N and on rows split over H, in either order: it
    holds no parameters or buffers, so each call gets its own layer (or its own plain module,
    where it runs as traced), exactly as one process (a module with state is refused, above)."""
    config = {"layers": [{"match": "a", **first}, {"match": "b", **second}],
              "default": {"grid": {"N": 2}, "algorithm": "sample"}}
    _equal_to_one_process(CalledTwice(nn.MaxPool2d(2)), config, 2, (3, 4, 8, 6))


def test_a_dropout_called_in_two_layouts_follows_eval_at_both_calls() -> None:
    """A dropout whose first call runs as traced (samples split: each rank's own masks) and whose
    second is split over rows (one process's masks): each call has its own module, a child of
    the parallel model. A training step runs both (the second call's layer once ran the first
    call's blocks and refused their shape), and model.eval() turns off both."""
    config = {"layers": [{"match": "a", "grid": {"N": 2}, "algorithm": "sample"},
                         {"match": "b", "grid": {"N": 1, "H": 2}, "algorithm": "spatial"}]}
    torch.manual_seed(8)
    model = CalledTwice(nn.Dropout(0.5)).double().eval()
    x = torch.randn(4, 4, 6, 5, dtype=torch.float64)

    def run(comm: Any) -> Any:
        pmodel = parallelize(copy.deepcopy(model).train(), config, comm=comm)
        rows = sample_block(x.shape[0], pmodel.data_grid)
        pmodel(x[rows]).sum().backward()  # training: both calls run, with their masks
        pmodel.eval()
        rows = sample_block(x.shape[0], pmodel.data_grid)
        return pmodel(x[rows]), rows

    want = model(x)
    for out, rows in run_threads(run, 2):
        assert (out - want[rows]).abs().max() < TOL


def _one_step(comm: Any, seed: int) -> tuple[nn.Module, torch.Tensor, nn.Module, Any]:
    """The user's loop for one SGD step of the ResNet case: (plain model, input, parallel model,
    this rank's rows)."""
    model, x, y = resnet_case(seed=seed)
    pmodel = parallelize(copy.deepcopy(model), RESNET_CONFIG, comm=comm)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
    torch.optim.SGD(pmodel.parameters(), lr=0.1).step()
    return model, x, pmodel, rows


def _second_copy(comm: Any) -> dict[str, Any]:
    model, x, pmodel, rows = _one_step(comm, 12)
    try:
        copy.deepcopy(pmodel)
        refused = ""
    except TypeError as exc:
        refused = str(exc)
    twin = parallelize(copy.deepcopy(model), RESNET_CONFIG, comm=comm)  # the recipe it names
    twin.load_state_dict(pmodel.state_dict())
    return {"refused": refused, "same": torch.equal(twin(x[rows]), pmodel(x[rows]))}


def test_a_parallel_model_is_not_deep_copied_and_the_refusal_names_the_recipe() -> None:
    """An EMA or snapshot written as copy.deepcopy(pmodel) is refused (its layers hold this
    job's communicators), naming what works: a second parallelize of the plain model loaded with
    this one's state_dict, which then computes what it computes."""
    for got in run_threads(_second_copy, 4):
        assert "cannot be deep-copied" in got["refused"] and "state_dict()" in got["refused"]
        assert got["same"]


# ----------------------------------------------------------------------------- layer families
def test_distributed_layers_keep_their_torch_families() -> None:
    one = SingleCommunicator()
    pmodel = parallelize(resnet_case()[0], {"default": {"grid": {"N": 1}}}, comm=one)
    kinds = {type(m) for m in pmodel.modules()}
    assert DistBatchNorm2d in kinds
    for cls, base in ((DistBatchNorm2d, nn.BatchNorm2d), (DistMaxPool2d, nn.MaxPool2d),
                      (DistAvgPool2d, nn.AvgPool2d),
                      (DistAdaptiveAvgPool2d, nn.AdaptiveAvgPool2d)):
        assert issubclass(cls, base)
    bns = [m for m in pmodel.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns and all(isinstance(m, DistBatchNorm2d) for m in bns)


def _sync_bn_run(comm: Any) -> dict[str, Any]:
    model, x, y = resnet_case(seed=4)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # a DDP recipe, before parallelize
    pmodel = parallelize(model, RESNET_CONFIG, comm=comm)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
    out = pmodel(x[rows]).detach()
    return {"state": pmodel.gather_state_dict(), "out": out, "rows": rows}


def test_sync_batchnorm_models_parallelize_with_global_statistics() -> None:
    model, x, y = resnet_case(seed=4)
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    out = ref(x).detach()
    for got in run_threads(_sync_bn_run, 4):
        assert (got["out"] - out[got["rows"]]).abs().max() < TOL
        for k, v in ref.state_dict().items():
            assert (got["state"][k].double() - v.double()).abs().max() < TOL, k


def test_a_layer_replaced_after_parallelize_is_refused_by_name() -> None:
    one = SingleCommunicator()
    model, x, _ = resnet_case()
    pmodel = parallelize(model, {"default": {"grid": {"N": 1}}}, comm=one)
    pmodel = nn.SyncBatchNorm.convert_sync_batchnorm(pmodel)
    with pytest.raises(TypeError, match="'bn1' was replaced after parallelize"):
        pmodel(x)


def test_a_module_that_runs_as_traced_swapped_after_parallelize_is_the_one_that_runs() -> None:
    """Eager semantics: a module the parallel model runs as traced (an activation here) is
    looked up at each call, so swapping it between steps changes the next step, exactly as the
    same swap changes the plain model."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 1))
    x = torch.randn(3, 3, 5, 5, dtype=torch.float64)
    model.double()
    pmodel = parallelize(copy.deepcopy(model), {"default": {"grid": {"N": 1}}},
                         comm=SingleCommunicator())
    assert torch.equal(pmodel(x), model(x))
    model[1] = nn.Tanh()
    setattr(pmodel, "1", nn.Tanh())
    got, want = pmodel(x), model(x)
    assert not torch.equal(want, nn.Sequential(model[0], nn.ReLU(), model[2])(x))
    assert torch.equal(got, want)


def test_batchnorm_1d_and_3d_are_their_torch_types_so_the_freeze_idiom_holds() -> None:
    """Each parallel batch norm is an instance of its own torch class and no other: freezing
    ``nn.BatchNorm3d`` in a model that also has a BatchNorm1d freezes the 3-d one only, as on one
    process (outputs and running statistics after a training forward equal the plain model's)."""
    torch.manual_seed(6)
    model = nn.Sequential(
        nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(), nn.AdaptiveAvgPool3d(1),
        nn.Flatten(), nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)).double()
    x = torch.randn(6, 2, 3, 4, 3, dtype=torch.float64)
    pmodel = parallelize(copy.deepcopy(model), {"default": {"grid": {"N": 1}}},
                         comm=SingleCommunicator())
    kinds = {type(m).__name__: m for m in pmodel.modules()}
    assert isinstance(kinds["DistBatchNorm3d"], nn.BatchNorm3d)
    assert not isinstance(kinds["DistBatchNorm3d"], (nn.BatchNorm2d, nn.BatchNorm1d))
    assert isinstance(kinds["DistBatchNorm1d"], nn.BatchNorm1d)
    assert not isinstance(kinds["DistBatchNorm1d"], (nn.BatchNorm2d, nn.BatchNorm3d))
    for m in [*model.modules(), *pmodel.modules()]:
        if isinstance(m, nn.BatchNorm3d):
            m.eval()
    assert (pmodel(x) - model(x)).abs().max() < TOL
    got, want = pmodel.gather_state_dict(), model.state_dict()
    assert torch.equal(got["1.running_mean"], want["1.running_mean"])  # frozen: untouched
    assert not torch.equal(want["6.running_mean"], torch.zeros(5, dtype=torch.float64))
    assert (got["6.running_mean"] - want["6.running_mean"]).abs().max() < TOL


# ----------------------------------------------------------------------------- state dicts
def _state_dict_run(comm: Any) -> dict[str, Any]:
    model, x, pmodel, rows = _one_step(comm, 6)
    buf = io.BytesIO()
    torch.save(pmodel.state_dict(), buf)  # this rank's shards
    trained = pmodel.gather_state_dict()
    out: dict[str, Any] = {}
    # 1. its own shards load back (also through torch.save / torch.load)
    fresh = parallelize(copy.deepcopy(model), RESNET_CONFIG, comm=comm)
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf))
    out["own"] = max((fresh.gather_state_dict()[k] - v).abs().max().item()
                     for k, v in trained.items())
    # 2. a plain single-process state dict is sharded
    other = parallelize(copy.deepcopy(model), RESNET_CONFIG, comm=comm)
    other.load_state_dict(trained)
    out["plain"] = max((other.gather_state_dict()[k] - v).abs().max().item()
                       for k, v in trained.items())
    # 3. another rank's shards are refused
    neighbour = pmodel.state_dict()
    neighbour._metadata[""]["distconv_shards"] = dict(
        neighbour._metadata[""]["distconv_shards"], rank=(comm.rank + 1) % comm.size)
    try:
        other.load_state_dict(neighbour)
        out["neighbour"] = "loaded"
    except ValueError as exc:
        out["neighbour"] = str(exc)
    # 4. local shards stripped of their tag are not taken for global tensors
    try:
        other.load_state_dict(dict(pmodel.state_dict()))
        out["untagged"] = "loaded"
    except ValueError as exc:
        out["untagged"] = str(exc)
    return out


def test_state_dict_loads_own_shards_or_plain_tensors_and_refuses_the_rest() -> None:
    for got in run_threads(_state_dict_run, 4):
        assert got["own"] == 0 and got["plain"] == 0
        assert "distconv.load" in got["neighbour"], got["neighbour"]
        assert "shape" in got["untagged"], got["untagged"]


# ----------------------------------------------------------------------------- refusals
def test_a_wrongly_shaped_input_names_the_shape_and_the_first_layer() -> None:
    one = SingleCommunicator()
    pmodel = parallelize(resnet_case()[0], {"default": {"grid": {"N": 1}}}, comm=one)
    with pytest.raises(ValueError) as info:
        pmodel(torch.zeros(2, 5, 16, 16, dtype=torch.float64))
    msg = str(info.value)
    assert "(2, 5, 16, 16)" in msg and "'conv1'" in msg and "(N, 3, H, W)" in msg
    assert "ShapeProp" not in msg and len(msg) < 600


class SE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        x = x * torch.sigmoid(x.mean((2, 3), keepdim=True))  # squeeze-and-excitation
        return self.head(x.mean((2, 3)))


def test_se_broadcast_over_split_rows_is_exact_and_explained() -> None:
    """The [N, C, 1, 1] gate meets a row-split activation: each rank keeps the gate whole (its
    one row), the gate's gradient sums over the rows' ranks."""
    config = {"default": {"grid": {"N": 1, "H": 2}, "algorithm": "spatial"},
              "data": {"N": 1, "H": 2}}
    gen = torch.Generator().manual_seed(8)
    model = seeded(SE().double(), gen)
    x = torch.randn(2, 4, 8, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (2,), generator=gen)
    ref = reference_step(model, x, y)
    plan = explain(model, config, (2, 4, 8, 8), world_size=2)
    for r, got in enumerate(run_threads(counted_step, 2, model, config, x, y)):
        assert (got["out"] - ref["out"][got["rows"]]).abs().max() < TOL
        for k, g in ref["grads"].items():
            assert (got["grads"][k] - g).abs().max() < TOL, k
        assert got["counted"] == tuple(plan.rank_bytes(r).values())


def test_se_broadcast_on_sample_parallel_values_is_exact() -> None:
    gen = torch.Generator().manual_seed(8)
    model = seeded(SE().double(), gen)
    x = torch.randn(5, 4, 8, 8, generator=gen, dtype=torch.float64)
    ref = model(x).detach()

    def run(comm):
        pmodel = parallelize(copy.deepcopy(model), {"default": {"grid": {"N": 2}}}, comm=comm)
        rows = sample_block(5, pmodel.data_grid)
        return (pmodel(x[rows]).detach() - ref[rows]).abs().max().item()

    assert max(run_threads(run, 2)) < TOL


def test_debug_mode_reports_the_global_batch_on_every_rank() -> None:
    model, x, _ = resnet_case()

    def run(comm):
        pmodel = parallelize(copy.deepcopy(model), {"default": {"grid": {"N": 2}}}, comm=comm)
        with pytest.raises(ValueError) as info:
            pmodel(x)  # the whole batch on every rank: two blocks of identical samples
        return str(info.value)

    set_debug(True)  # process-wide: every thread rank checks
    try:
        msgs = run_threads(run, 2)
    finally:
        set_debug(False)
    for msg in msgs:
        assert "identical samples" in msg and "GridSampler" in msg


def _assign_run(comm: Any) -> dict[str, Any]:
    model, x, y = resnet_case(seed=6)
    pmodel = parallelize(copy.deepcopy(model), RESNET_CONFIG, comm=comm)
    pmodel.load_state_dict(pmodel.state_dict(), assign=True)  # new Parameter objects
    rows = sample_block(x.shape[0], pmodel.data_grid)
    F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
    return {"grads": _gathered_grads(pmodel), "rows": rows}


def test_parameters_replaced_by_assign_are_still_reduced() -> None:
    model, x, y = resnet_case(seed=6)
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    for got in run_threads(_assign_run, 4):
        for k, p in ref.named_parameters():
            assert (got["grads"][k] - p.grad).abs().max() < TOL, k


