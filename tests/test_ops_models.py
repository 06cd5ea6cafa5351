"""The ops popular model libraries use, exact against one process in fp64 on thread ranks (and
one fixed case of each kind that communicates on a real gloo world): stochastic depth as
torchvision, timm and MONAI write it, their activation modules, parameters used directly in
ops (layer scale, positional terms), squeeze-and-excitation maps under a default spatial grid,
and grouped convolutions whose groups cross channel blocks."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from distconv.data import sample_block
from distconv.parallel import parallelize
from distconv.testing import run_threads
from tests.parallel.cases import (
    OPTIONS, _gathered_grads, check_rows, seeded, square_mean_reference, square_mean_step,
)

from tests.optional import need  # noqa: E402

monai = need("monai")

SEED = 7
SHAPE = (5, 4, 6, 6)
CONFIGS = OPTIONS


# ---------------------------------------------------------------- stochastic depth
class DropPath(nn.Module):
    """timm's ``DropPath`` as timm writes it (``timm.layers.drop``), under timm's name: the
    handler binds it by that name, as it binds timm's own where timm is installed."""

    def __init__(self, drop_prob: float = 0.0, scale_by_keep: bool = True) -> None:
        super().__init__()
        self.drop_prob = drop_prob
        self.scale_by_keep = scale_by_keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep_prob = 1 - self.drop_prob
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)
        random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
        if keep_prob > 0.0 and self.scale_by_keep:
            random_tensor.div_(keep_prob)
        return x * random_tensor


DropPath.__module__ = "timm.layers.drop"


def stochastic_depth(input: torch.Tensor, p: float, mode: str,
                     training: bool = True) -> torch.Tensor:
    """``torchvision.ops.stochastic_depth`` as torchvision writes it, under its name (a
    function ``torch.fx.wrap`` keeps as one call, as torchvision's is)."""
    if not training or p == 0.0:
        return input
    survival_rate = 1.0 - p
    size = [input.shape[0]] + [1] * (input.ndim - 1) if mode == "row" else [1] * input.ndim
    noise = torch.empty(size, dtype=input.dtype, device=input.device)
    noise = noise.bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return input * noise


stochastic_depth.__module__ = "torchvision.ops.stochastic_depth"
torch.fx.wrap("stochastic_depth")


class StochasticDepth(nn.Module):
    """torchvision's ``StochasticDepth`` module, under its name."""

    def __init__(self, p: float, mode: str) -> None:
        super().__init__()
        self.p, self.mode = p, mode

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return stochastic_depth(input, self.p, self.mode, self.training)


StochasticDepth.__module__ = "torchvision.ops.stochastic_depth"


class Residual(nn.Module):
    """Two residual blocks, each branch through stochastic depth (two draws in order), and a
    head; ``functional``: the second block calls torchvision's function directly."""

    def __init__(self, make: Any, functional: bool = False) -> None:
        super().__init__()
        self.c1, self.d1 = nn.Conv2d(4, 4, 3, padding=1), make()
        self.c2, self.d2 = nn.Conv2d(4, 4, 3, padding=1), make()
        self.functional = functional
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.d1(torch.relu(self.c1(x)))
        y = torch.relu(self.c2(x))
        x = x + (stochastic_depth(y, 0.4, "row", True) if self.functional else self.d2(y))
        return self.head(x.mean((2, 3)))


DROP_PATHS = {
    "monai": lambda: monai.networks.layers.DropPath(0.4),
    "timm": lambda: DropPath(0.4),
    "timm-unscaled": lambda: DropPath(0.4, scale_by_keep=False),
    "torchvision-row": lambda: StochasticDepth(0.4, "row"),
    "torchvision-batch": lambda: StochasticDepth(0.5, "batch"),
}


def _reference(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    return square_mean_reference(model, x, SEED)  # the masks are the first draws after SEED


def _seeded_step(comm: Any, model: nn.Module, config: Any, x: torch.Tensor) -> dict[str, Any]:
    """``_step`` on a world whose ranks' own generators differ, the shared one seeded as the
    reference seeds its (the worker pool's communicator keeps its shared generator from earlier
    tasks)."""
    torch.manual_seed(SEED + 1 + comm.rank)
    comm.shared_generator().manual_seed(SEED)
    return square_mean_step(comm, model, config, x)


def _case(make: Any, functional: bool = False) -> tuple[nn.Module, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    model = seeded(Residual(make, functional).double(), gen)
    return model, torch.randn(SHAPE, generator=gen, dtype=torch.float64)


def test_the_masks_drop_some_paths_and_keep_others() -> None:
    """The reference really drops: with this seed, of the 5 samples' two draws some are dropped
    and some kept (else the exactness below could not fail on a wrong mask)."""
    torch.manual_seed(SEED)
    masks = torch.empty(2, 5, dtype=torch.float64).bernoulli_(0.6)
    assert 0 < int(masks.sum()) < 10


@pytest.mark.parametrize("kind, name", [("monai", name) for name in CONFIGS] + [
    (kind, name) for kind in list(DROP_PATHS)[1:] for name in ("spatial", "stationary-x")])
def test_drop_path_equals_one_process(kind: str, name: str) -> None:
    model, x = _case(DROP_PATHS[kind])
    ref = _reference(model, x)
    torch.manual_seed(SEED)  # thread ranks share it: rank 0's seed is every rank's
    results = run_threads(square_mean_step, 4, model, CONFIGS[name], x)
    assert all("DistDropPath" in got["kinds"] for got in results)
    check_rows(ref, results)


@pytest.mark.parametrize("name", ["sample", "stationary-x"])
def test_torchvision_stochastic_depth_function_equals_one_process(name: str) -> None:
    model, x = _case(lambda: StochasticDepth(0.4, "row"), functional=True)
    ref = _reference(model, x)
    torch.manual_seed(SEED)
    check_rows(ref, run_threads(square_mean_step, 4, model, CONFIGS[name], x))


@pytest.mark.parametrize("make", [lambda: DropPath(0.0), lambda: DropPath(0.4).eval(),
                                  lambda: monai.networks.layers.DropPath(0.0)],
                         ids=["p0", "eval", "monai-p0"])
def test_drop_path_with_p0_or_in_eval_is_the_identity(make: Any) -> None:
    model, x = _case(make)
    ref = _reference(model, x)
    with torch.no_grad():
        plain = copy.deepcopy(model)
        plain.d1, plain.d2 = nn.Identity(), nn.Identity()
        assert torch.equal(plain(x), ref["out"])
    check_rows(ref, run_threads(square_mean_step, 4, model, CONFIGS["spatial"], x))


def test_drop_path_is_one_call_of_the_trace() -> None:
    """fx cannot follow timm's body (a tuple times a traced size): the module is a leaf."""
    from distconv.parallel.graph import trace

    gm = trace(Residual(lambda: DropPath(0.4)))
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == [
        "c1", "d1", "c2", "d2", "head"]


def test_drop_path_on_gloo(gloo4) -> None:  # noqa: ANN001
    model, x = _case(DROP_PATHS["monai"])  # (a type pickle finds by its name)
    ref = _reference(model, x)
    check_rows(ref, gloo4.run(_seeded_step, model, CONFIGS["stationary-x"], x))


# ---------------------------------------------------------------- MONAI's activations
class Activations(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from monai.networks.blocks.activation import MemoryEfficientSwish, Mish, Swish

        self.c1, self.c2 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.acts = nn.Sequential(Swish(0.7), MemoryEfficientSwish(), Mish())
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.c2(self.acts(self.c1(x))).mean((2, 3)))


@pytest.mark.parametrize("name", ["spatial", "stationary-x"])
def test_monai_activations_equal_one_process(name: str) -> None:
    gen = torch.Generator().manual_seed(3)
    model = seeded(Activations().double(), gen)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    ref = _reference(model, x)
    check_rows(ref, run_threads(square_mean_step, 4, model, CONFIGS[name], x))


# ---------------------------------------------------------------- parameters used in ops
class LayerScale(nn.Module):
    """Parameters used directly in ops, each form models write: a layer scale viewed, indexed
    and multiplied in as a method, one on trailing dims ``[C, 1, 1]``, a positional term
    ``[1, C, H, W]`` added, a buffer divided by, and arithmetic between parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.gamma = nn.Parameter(torch.rand(4))
        self.beta = nn.Parameter(torch.rand(4, 1, 1))
        self.pos = nn.Parameter(torch.rand(1, 4, 6, 6))
        self.register_buffer("scale", torch.rand(1, 4, 1, 1) + 1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c1(x) * self.gamma.view(1, -1, 1, 1) + self.pos
        y = torch.relu(y).mul(self.gamma[:, None, None]) / self.scale
        y = x + self.c2(y) * (self.beta * 2 - self.gamma[:, None, None])
        return self.head(y.mean((2, 3)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameters_used_in_ops_equal_one_process(name: str) -> None:
    gen = torch.Generator().manual_seed(4)
    model = seeded(LayerScale().double(), gen)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    ref = _reference(model, x)
    check_rows(ref, run_threads(square_mean_step, 4, model, CONFIGS[name], x))


def test_parameters_used_in_ops_on_gloo(gloo4) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(4)
    model = seeded(LayerScale().double(), gen)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    ref = _reference(model, x)
    check_rows(ref, gloo4.run(square_mean_step, model, CONFIGS["spatial"], x))


# ---------------------------------------------------------------- one-row maps
class Excite(nn.Module):
    """Squeeze-and-excitation with convolutions on ``[N, C, 1, 1]`` maps, squeezed each way
    models write it: a keepdim mean, ``AdaptiveAvgPool2d(1)``, ``F.adaptive_avg_pool2d(x, 1)``,
    and a mean re-expanded with new axes or a view (MobileNetV3, EfficientNet, RegNet)."""

    def __init__(self, squeeze: str) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(4, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Conv2d(4, 2, 1), nn.Conv2d(2, 4, 1)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)
        self.squeeze = squeeze

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.c1(x))
        s = {"mean": lambda: x.mean((2, 3), keepdim=True), "pool": lambda: self.pool(x),
             "functional": lambda: F.adaptive_avg_pool2d(x, 1),
             "axes": lambda: x.mean((2, 3))[:, :, None, None],
             "ellipsis": lambda: x.mean((2, 3))[..., None].unsqueeze(-1),
             "view": lambda: x.mean((2, 3)).view(x.size(0), -1, 1, 1)}[self.squeeze]()
        s = F.hardsigmoid(self.fc2(F.relu(self.fc1(s))))
        return self.head(self.c2(x * s).mean((2, 3)))


SPATIAL_DEFAULT = {"default": {"grid": {"N": 1, "H": 2}, "algorithm": "spatial"},
                   "data": {"N": 1, "H": 2}}


HW_DEFAULT = {"default": {"grid": {"H": 2, "W": 2}, "algorithm": "spatial"},
              "data": {"N": 1, "H": 2, "W": 2}}


@pytest.mark.parametrize("squeeze, config", [
    *((sq, SPATIAL_DEFAULT) for sq in ("mean", "pool", "functional", "axes", "ellipsis", "view")),
    ("mean", CONFIGS["spatial"]), ("pool", HW_DEFAULT), ("axes", HW_DEFAULT)],
    ids=lambda v: v if isinstance(v, str) else "x".join(
        f"{d}{e}" for d, e in v["default"]["grid"].items()))
def test_one_row_maps_under_a_default_spatial_grid_equal_one_process(squeeze: str,
                                                                     config: dict) -> None:
    gen = torch.Generator().manual_seed(5)
    model = seeded(Excite(squeeze).double(), gen)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    ref = _reference(model, x)
    world = 2 if config is SPATIAL_DEFAULT else 4
    check_rows(ref, run_threads(square_mean_step, world, model, config, x))


def test_explain_says_which_layers_keep_their_rows_whole() -> None:
    from distconv.parallel.explain import explain

    plan = explain(Excite("pool"), SPATIAL_DEFAULT, SHAPE, world_size=2)
    whole = {lay.name: lay.note for lay in plan.layers if "whole" in (lay.note or "")}
    assert set(whole) == {"fc1", "fc2"} and "H whole" in whole["fc1"]
    assert "H whole" in str(plan)


def test_an_explicit_entry_that_cannot_split_one_row_maps_stays_refused() -> None:
    from distconv.parallel.explain import explain

    config = {**SPATIAL_DEFAULT, "layers": [{"match": "fc1", "grid": {"N": 1, "H": 2},
                                             "algorithm": "spatial"}]}
    with pytest.raises(ValueError, match=r"node 'fc1'.*grid dim H=2 exceeds"):
        explain(Excite("pool"), config, SHAPE, world_size=2)


class Excite3d(nn.Module):
    """Squeeze-and-excitation of a volume: a keepdim mean, ``AdaptiveAvgPool3d(1)`` (MONAI's)
    or ``AdaptiveMaxPool3d(1)``."""

    def __init__(self, squeeze: str) -> None:
        super().__init__()
        self.c1, self.fc = nn.Conv3d(2, 4, 3, padding=1), nn.Conv3d(4, 4, 1)
        self.pool = {"mean": None, "avg": nn.AdaptiveAvgPool3d(1),
                     "max": nn.AdaptiveMaxPool3d(1)}[squeeze]
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.c1(x))
        s = x.mean((2, 3, 4), keepdim=True) if self.pool is None else self.pool(x)
        return self.head((x * torch.sigmoid(self.fc(s))).mean((2, 3, 4)))


@pytest.mark.parametrize("squeeze", ["mean", "avg", "max"])
def test_one_row_volumes_under_a_default_spatial_grid_equal_one_process(squeeze: str) -> None:
    gen = torch.Generator().manual_seed(6)
    model = seeded(Excite3d(squeeze).double(), gen)
    x = torch.randn((3, 2, 4, 5, 3), generator=gen, dtype=torch.float64)
    ref = _reference(model, x)
    config = {"default": {"grid": {"D": 2, "H": 2}, "algorithm": "spatial"},
              "data": {"N": 1, "D": 2, "H": 2}}
    check_rows(ref, run_threads(square_mean_step, 4, model, config, x))


# ---------------------------------------------------------------- groups across channel blocks
class Grouped(nn.Module):
    """A grouped convolution between two plain ones: ``groups`` groups of ``width`` channels
    (RegNet: 25 groups over 2 channel blocks; depthwise of odd width)."""

    def __init__(self, groups: int, width: int) -> None:
        super().__init__()
        channels = groups * width
        self.stem = nn.Conv2d(4, channels, 1)
        self.grouped = nn.Conv2d(channels, channels, 3, padding=1, groups=groups)
        self.out = nn.Conv2d(channels, 4, 1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.out(torch.relu(self.grouped(torch.relu(self.stem(x)))))
                         .mean((2, 3)))


@pytest.mark.parametrize("groups, width, name", [
    (25, 2, "stationary-x"), (5, 1, "stationary-x"), (5, 1, "stationary-y"),
    (3, 2, "stationary-w"), (25, 2, "spatial")])
def test_groups_across_channel_blocks_under_a_default_entry_equal_one_process(
        groups: int, width: int, name: str) -> None:
    gen = torch.Generator().manual_seed(8)
    model = seeded(Grouped(groups, width).double(), gen)
    x = torch.randn((4, 4, 5, 4), generator=gen, dtype=torch.float64)
    ref = _reference(model, x)
    check_rows(ref, run_threads(square_mean_step, 4, model, CONFIGS[name], x))


def test_explain_says_which_grouped_layers_keep_their_channels_whole() -> None:
    from distconv.parallel.explain import explain

    plan = explain(Grouped(25, 2), CONFIGS["stationary-x"], (4, 4, 5, 4), world_size=4)
    notes = {lay.name: lay.note for lay in plan.layers}
    assert notes["grouped"] == "C whole: 25 groups across 2 channel/filter blocks"
    assert "whole" not in (notes["stem"] or "") and "whole" not in (notes["out"] or "")


def test_an_explicit_entry_whose_blocks_cut_groups_gathers_x_and_equals_one_process() -> None:
    """A layer's own entry splits its 25 groups over 2 channel blocks as asked: x gathered
    over C, each rank convolving the groups its filters reach into (explain says so)."""
    from distconv.parallel.explain import explain

    config = {"layers": [{"match": "grouped", "grid": {"N": 2, "C": 2},
                          "algorithm": "stationary-x"}]}
    plan = explain(Grouped(25, 2), config, (4, 4, 5, 4), world_size=4)
    grouped = next(lay for lay in plan.layers if lay.name == "grouped")
    assert grouped.note == "25 groups cut by the blocks: x gathered"
    own = [s.what for s in grouped.steps if "redistribute" not in s.what]  # its operand's move
    assert own == ["allgather x over C", "reduce-scatter dL/dx over C"]
    gen = torch.Generator().manual_seed(8)
    model = seeded(Grouped(25, 2).double(), gen)
    x = torch.randn((4, 4, 5, 4), generator=gen, dtype=torch.float64)
    check_rows(_reference(model, x), run_threads(square_mean_step, 4, model, config, x))


def test_a_default_entry_with_more_channel_blocks_than_channels_runs_them_whole() -> None:
    """An RGB stem under a default that splits channels 4 ways runs with its channels whole (a
    layer's own entry stays refused: test_ops)."""
    from distconv.parallel.explain import explain

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3),
                          nn.Flatten(), nn.Linear(8 * 3 * 2, 3))
    config = {"default": {"grid": {"C": 4}, "algorithm": "stationary-x"}}
    notes = {lay.name: lay.note for lay in explain(model, config, (4, 3, 5, 4),
                                                   world_size=4).layers}
    assert notes["0"] == "C whole: 3 channels over 4 channel/filter blocks"
    gen = torch.Generator().manual_seed(9)
    model = seeded(model.double(), gen)
    x = torch.randn((4, 3, 5, 4), generator=gen, dtype=torch.float64)
    check_rows(_reference(model, x), run_threads(square_mean_step, 4, model, config, x))


@pytest.mark.parametrize("kind", ["drop-path", "dropout"])
def test_masks_recomputed_under_checkpointing_are_the_first_forward_s(kind: str) -> None:
    """A checkpointed segment's recomputation in backward draws the masks its forward drew (the
    shared generator's state replayed, as torch's checkpoint restores its own generators)."""
    make = DROP_PATHS["monai"] if kind == "drop-path" else (lambda: nn.Dropout(0.4))
    model, x = _case(make)
    ref = _reference(model, x)
    config = {**CONFIGS["stationary-x"], "layers": [
        {"match": "c1", "checkpoint": True}, {"match": "d1", "checkpoint": True},
        {"match": "c2", "checkpoint": True}, {"match": "d2", "checkpoint": True}]}
    torch.manual_seed(SEED)
    check_rows(ref, run_threads(square_mean_step, 4, model, config, x))


def drop_path(x: torch.Tensor, drop_prob: float = 0.0, training: bool = False,
              scale_by_keep: bool = True) -> torch.Tensor:
    """timm's ``drop_path`` as timm writes it."""
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor


class CallsDropPath(Residual):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + drop_path(torch.relu(self.c1(x)), 0.4, True)
        return self.head((x + drop_path(torch.relu(self.c2(x)), 0.3, True)).mean((2, 3)))


def test_timm_drop_path_called_as_a_function_equals_one_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where timm is loaded, its ``drop_path`` called in a model's forward is one node of the
    trace (fx cannot follow its body). Here this module stands in for ``timm.layers.drop``."""
    import sys
    import types

    timm_drop = types.ModuleType("timm.layers.drop")
    timm_drop.drop_path = drop_path
    monkeypatch.setitem(sys.modules, "timm.layers.drop", timm_drop)
    monkeypatch.setattr(drop_path, "__module__", "timm.layers.drop")
    gen = torch.Generator().manual_seed(2)
    model = seeded(CallsDropPath(nn.Identity).double(), gen)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    ref = _reference(model, x)
    torch.manual_seed(SEED)
    check_rows(ref, run_threads(square_mean_step, 4, model, CONFIGS["spatial"], x))


# ---------------------------------------------------------------- K-FAC of the layers run whole
def _kfac_case(which: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10)
    model = seeded((Grouped(25, 2) if which == "groups" else Excite("pool")).double(), gen)
    x = torch.randn((4, 4, 6, 4), generator=gen, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (4,), generator=gen)


def _kfac_train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, kfac: Any) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        kfac.step()
        opt.step()


KFAC_KW = dict(factor_dtype=torch.float64, damping=1e-2, kl_clip=1e-2, factor_decay=0.6)


def _kfac_run(comm: Any, which: str, config: dict) -> dict[str, torch.Tensor]:
    import distkfac

    model, x, y = _kfac_case(which)
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    kfac = distkfac.KFAC(pmodel, **KFAC_KW)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    _kfac_train(pmodel, x[rows], y[rows], kfac)
    return _gathered_grads(pmodel)


@pytest.mark.parametrize("which, config", [("groups", CONFIGS["stationary-x"]),
                                           ("excite", SPATIAL_DEFAULT)])
def test_kfac_of_layers_run_whole_equals_one_process(which: str, config: dict) -> None:
    """A convolution run with its channels or rows whole is a replicated layer inside the
    model: its K-FAC factors complete their output gradients over the replicas."""
    import distkfac

    model, x, y = _kfac_case(which)
    _kfac_train(model, x, y, distkfac.KFAC(model, comm=None, **KFAC_KW))
    world = 2 if config is SPATIAL_DEFAULT else 4
    for grads in run_threads(_kfac_run, world, which, config):
        for k, p in model.named_parameters():
            torch.testing.assert_close(grads[k], p.grad, rtol=1e-9, atol=1e-11, msg=k)


class Bounded(nn.Module):
    """Buffers as bounds of a pointwise function: a 0-d one and one per channel."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.register_buffer("top", torch.tensor(0.3))
        self.register_buffer("bottom", -torch.rand(4, 1, 1))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.clamp(self.c1(x), min=self.bottom, max=self.top)
        return self.head(self.c2(y).mean((2, 3)))


@pytest.mark.parametrize("name", ["spatial", "stationary-x"])
def test_buffers_bounding_a_pointwise_function_equal_one_process(name: str) -> None:
    gen = torch.Generator().manual_seed(11)
    model = seeded(Bounded().double(), gen)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    check_rows(_reference(model, x), run_threads(square_mean_step, 4, model, CONFIGS[name], x))


class Extents(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.same, self.valid = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3)
        self.strided = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool2d((1, None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.mean((2, 3), keepdim=True)
        a = self.same(m) + self.strided(m) + torch.relu(m) * x.mean(3, keepdim=True)
        b = x.mean((2, 3))[..., None, None] + x.mean(2).unsqueeze(2)
        c = x.mean((2, 3)).view(x.size(0), -1, 1, 1) + self.pool(x)
        return a + b + c + self.valid(m) + torch.cat([m, m], 2)


def test_unit_dims_are_what_the_graph_states() -> None:
    """Dims of extent 1 whatever the input: keepdim reductions, an adaptive pool's 1s, new axes,
    a view's literal 1s, elementwise ops where every operand has them, convolutions mapping one
    row to one row (not a valid 3×3 one), not a cat along them."""
    from distconv.ops.extents import unit_dims
    from distconv.parallel.config import ParallelConfig
    from distconv.parallel.graph import _Analyser, trace

    gm = trace(Extents())
    an = _Analyser(gm, ParallelConfig({"default": {"grid": {"N": 1}}}, world_size=1), 4)
    an.run()
    got = {n.name: set(unit_dims(an, n)) for n in gm.graph.nodes if an.out.get(n) is not None}
    assert got["mean"] == {2, 3} and got["same"] == {2, 3} and got["strided"] == {2, 3}
    assert got["mul"] == {3} and got["add_1"] == {3}  # m (1, 1) times a (H, 1) map
    assert got["getitem"] == {2, 3} and got["unsqueeze"] == {2} and got["add_2"] == {2}
    assert got["view"] == {2, 3} and got["pool"] == {2} and got["add_3"] == {2}
    assert got["valid"] == set() and got["cat"] == {3} and got["mean_2"] == set()
