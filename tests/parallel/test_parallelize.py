"""parallelize: the user's loop on a parallelized model equals one process on the global batch."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from distconv.data import sample_block
from distconv.parallel import parallelize
from distconv.parallel.explain import explain
from distconv.testing import run_threads
from tests.parallel.cases import (
    RESNET_CONFIG, RESNET_SHAPE, TOL, max_errors, reference_step, resnet_bytes, resnet_case,
    resnet_run, train_step,
)


class RandomNet(nn.Module):
    """A stem conv, then a chain of conv / BN / ReLU / pooling / residual blocks, global average
    pooling, flatten and a linear head."""

    def __init__(self, kinds: list[str], channels: int, in_channels: int = 4,
                 classes: int = 5, mean_head: bool = False) -> None:
        super().__init__()
        self.kinds, self.mean_head = list(kinds), mean_head
        self.stem = nn.Conv2d(in_channels, channels, 3, padding=1)
        layers: list[nn.Module] = []
        for kind in kinds:
            layers.append({
                "conv": lambda: nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                "conv1x1": lambda: nn.Conv2d(channels, channels, 1),
                "bn": lambda: nn.BatchNorm2d(channels),
                "relu": lambda: nn.ReLU(),
                "maxpool": lambda: nn.MaxPool2d(3, stride=2, padding=1),
                "avgpool": lambda: nn.AvgPool2d(2, ceil_mode=True, count_include_pad=False),
                "res": lambda: nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1),
                                             nn.BatchNorm2d(channels), nn.ReLU()),
            }[kind]())
        self.layers = nn.ModuleList(layers)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for kind, layer in zip(self.kinds, self.layers):
            x = x + layer(x) if kind == "res" else layer(x)
        if self.mean_head:  # global average pooling written functionally
            return self.head(x.mean((2, 3)))
        return self.head(torch.flatten(self.pool(x), 1))


def _factor(draw: st.DrawFn, p: int, names: list[str]) -> dict[str, int]:
    """Extents over ``names`` (first gets what is left) multiplying to p, in a random order."""
    extents = {}
    rest = p
    for name in names[1:]:
        options = [d for d in range(1, rest + 1) if rest % d == 0 and d <= 2]
        extents[name] = draw(st.sampled_from(options))
        rest //= extents[name]
    extents[names[0]] = rest
    order = draw(st.permutations(list(extents)))
    return {n: extents[n] for n in order}


@st.composite
def layer_choices(draw: st.DrawFn, p: int) -> dict:
    algorithm = draw(st.sampled_from(
        ["sample", "spatial", "stationary-x", "stationary-y", "stationary-w"]))
    if algorithm == "sample":
        grid = {"N": p}
    elif algorithm == "spatial":
        grid = _factor(draw, p, ["N", "H", "W"])
    elif algorithm == "stationary-x":
        grid = _factor(draw, p, ["C", "N", "H"])
    elif algorithm == "stationary-y":
        grid = _factor(draw, p, ["F", "N", "W"])
    else:
        grid = _factor(draw, p, ["C", "F"])
    return {"grid": grid, "algorithm": algorithm}


@st.composite
def network_cases(draw: st.DrawFn) -> tuple:
    p = draw(st.sampled_from([2, 3, 4, 6, 8]))
    kinds = draw(st.lists(st.sampled_from(
        ["conv", "conv1x1", "bn", "relu", "maxpool", "avgpool", "res"]), min_size=1, max_size=5))
    channels = draw(st.integers(max(4, p), max(6, p + 1)))  # C×F blocks need channels
    torch.manual_seed(draw(st.integers(0, 2**16)))
    model = RandomNet(kinds, channels, in_channels=channels,
                      mean_head=draw(st.booleans())).double()
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    chosen = draw(st.lists(st.sampled_from(convs), unique=True, max_size=len(convs)))
    layers = [{"match": n, **draw(layer_choices(p))} for n in chosen]
    config: dict = {"layers": layers}
    if draw(st.booleans()):
        config["data"] = _factor(draw, p, ["N", "C"])
    batch = draw(st.integers(p, p + 3))
    size = draw(st.integers(7, 10))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(batch, channels, size, size, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (batch,), generator=gen)
    return p, model, config, x, y


@settings(max_examples=10, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(network_cases())
def test_user_loop_on_random_networks_equals_one_process(case: tuple) -> None:
    """Exact or refused: a drawn split that some layer cannot take (more row blocks than the
    rows pooling left it) is refused by ``explain``, and by the user's first forward before any
    layer runs, with the same message naming the node."""
    p, model, config, x, y = case
    try:
        explain(model, config, tuple(x.shape), world_size=p)
    except ValueError as exc:
        assert "exceeds what this layer can split" in str(exc), exc
        with pytest.raises(ValueError) as got:
            run_threads(train_step, p, model, config, x, y)
        assert str(exc) in str(got.value), (exc, got.value)
        return
    ref = reference_step(model, x, y)
    for got in run_threads(train_step, p, model, config, x, y):
        err = max_errors(ref, got)
        assert max(err.values()) < TOL, (config, err)


@pytest.mark.parametrize("dims", [2, 3], ids=["conv2d", "conv3d"])
def test_a_split_that_leaves_a_rank_no_rows_is_refused_naming_the_node(dims: int) -> None:
    """Pooling leaves the last convolution one row: H=2 there gives a rank none. explain
    refuses it, and the parallel model's first forward too, before any layer has run (no
    collective issued), naming the node, its layout and the input's global shape."""
    conv, pool = (nn.Conv2d, nn.MaxPool2d) if dims == 2 else (nn.Conv3d, nn.MaxPool3d)
    model = nn.Sequential(conv(2, 3, 3, padding=1), pool(2), pool(2), conv(3, 3, 3, padding=1))
    size = (4,) * dims
    config = {"layers": [{"match": "3", "grid": {"H": 2}, "algorithm": "spatial"}]}
    said = (r": node '_3' \(call_module 3\) on \{'H': 2\}, input of global shape "
            rf"\(2, 3, {', '.join(['1'] * dims)}\): grid dim H=2 exceeds what this layer can "
            r"split: .* so use H <= 1")
    with pytest.raises(ValueError, match="^explain" + said):  # each says who refuses
        explain(model, config, (2, 2, *size), world_size=2)
    want = "^parallelize" + said

    def rank(comm):
        pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
        before = comm.stats.total_bytes()
        with pytest.raises(ValueError, match=want):
            pmodel(torch.randn(1, 2, *size))  # one sample a rank: the global batch of 2
        return comm.stats.total_bytes() - before

    moved = run_threads(rank, 2)
    assert all(m <= 2 * 8 * (dims + 2) for m in moved), moved  # the batch's agreement only


def test_uneven_blocks_and_sum_reduction() -> None:
    model, x, y = resnet_case(seed=1)
    x, y = x[:5], y[:5]  # 5 samples over N=2 (3, 2) and over N=4 (2, 1, 1, 1)
    for reduction in ("mean", "sum"):
        ref = reference_step(model, x, y, reduction)
        for got in run_threads(train_step, 4, model, RESNET_CONFIG, x, y, reduction):
            err = max_errors(ref, got)
            assert max(err.values()) < TOL, (reduction, err)


def test_resnet_bytes_equal_explain_on_threads() -> None:
    for r in run_threads(resnet_run, 4, resnet_bytes(4)):
        assert r["out"] < TOL and r["grads"] < TOL, r
        assert r["counted"] == r["explained"], r


class TwoReaders(nn.Module):
    """One activation read by two convolutions (a downsampling block's main path and shortcut)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(3, 4, 3, padding=1)
        self.a = nn.Conv2d(4, 6, 3, padding=1)
        self.b = nn.Conv2d(4, 6, 1)
        self.fc = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv0(x))
        y = self.a(h) + self.b(h)
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(y, 1).flatten(1))


TWO_READERS_CONFIG = {"default": {"grid": {"N": 2}, "algorithm": "sample"},
                      "layers": [{"match": "[ab]", "grid": {"F": 2}, "algorithm": "stationary-y"}]}


def _two_readers_step(comm, model, x, y, config=TWO_READERS_CONFIG):  # noqa: ANN001, ANN202
    from distconv.nn import DistConv2d
    from tests.parallel.cases import counted_step

    got = counted_step(comm, model, config, x, y)
    layers = parallelize(copy.deepcopy(model), config, comm=comm).modules()
    got["gathered"] = sorted(m.gathered_input for m in layers if isinstance(m, DistConv2d))
    return got


def _two_readers_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    from tests.parallel.cases import seeded

    gen = torch.Generator().manual_seed(3)
    model = seeded(TwoReaders().double(), gen)
    x = torch.randn(4, 3, 6, 6, generator=gen, dtype=torch.float64)
    return model, x, torch.randint(0, 5, (4,), generator=gen)


def test_a_value_two_stationary_y_layers_read_is_gathered_once() -> None:
    """Both layers read h whole over F: one conversion gathers it (each rank receives the other
    rank's 2 samples of h, 2 x 4 x 6 x 6 doubles) and neither layer gathers it again; one
    process's step, and the bytes explain prices."""
    model, x, y = _two_readers_case()
    plan = explain(model, TWO_READERS_CONFIG, tuple(x.shape), world_size=2)
    steps = {lay.name: lay.steps for lay in plan.layers}
    assert not [s for s in steps["a"] + steps["b"] if s.what.startswith("allgather x")]
    [gather] = [s for s in steps["a"] + steps["b"] if s.phase == "forward"]
    assert gather.what.startswith("redistribute relu") and gather.bytes == {0: 2304, 1: 2304}
    explained = [tuple(plan.rank_bytes(r).values()) for r in range(2)]
    ref = reference_step(model, x, y)
    for r, got in enumerate(run_threads(_two_readers_step, 2, model, x, y)):
        assert (got["out"] - ref["out"][got["rows"]]).abs().max().item() < TOL
        assert max((got["grads"][k] - g).abs().max().item() for k, g in ref["grads"].items()) < TOL
        # conv0 is sample-parallel: nothing to gather
        assert got["counted"] == explained[r] and got["gathered"] == [False, True, True]


@pytest.mark.parametrize("pool, config", [
    ("gloo2", TWO_READERS_CONFIG),
    pytest.param("mpi4", {"default": {"grid": {"N": 4}, "algorithm": "sample"}, "layers": [
        {"match": "[ab]", "grid": {"N": 2, "F": 2}, "algorithm": "stationary-y"}]},
        marks=pytest.mark.mpi)])
def test_a_shared_gather_on_real_worlds(pool: str, config: dict,
                                        request: pytest.FixtureRequest) -> None:
    model, x, y = _two_readers_case()
    world = request.getfixturevalue(pool)
    plan = explain(model, config, tuple(x.shape), world_size=world.size)
    ref = reference_step(model, x, y)
    for r, got in enumerate(world.run(_two_readers_step, model, x, y, config)):
        assert (got["out"] - ref["out"][got["rows"]]).abs().max().item() < TOL
        assert max((got["grads"][k] - g).abs().max().item() for k, g in ref["grads"].items()) < TOL
        assert got["counted"] == tuple(plan.rank_bytes(r).values())
        assert got["gathered"] == [False, True, True]


class FilterThenChannel(nn.Module):
    """A filter-split layer feeding a channel-split one (each rank's output filters are the next
    layer's input channels), then a filter-split layer again."""

    def __init__(self) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(3, 4, 3, padding=1)
        self.a = nn.Conv2d(4, 6, 3, padding=1)
        self.b = nn.Conv2d(6, 6, 3, padding=1)
        self.c = nn.Conv2d(6, 4, 1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(torch.relu(self.conv0(x))))
        h = self.c(torch.relu(self.b(h)))
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(h, 1).flatten(1))


FILTER_THEN_CHANNEL = {"default": {"grid": {"N": 2}, "algorithm": "sample"}, "layers": [
    {"match": "[ac]", "grid": {"F": 2}, "algorithm": "stationary-y"},
    {"match": "b", "grid": {"C": 2}, "algorithm": "stationary-x"}]}


def _calls_step(comm, model, x, y):  # noqa: ANN001, ANN202
    from tests.parallel.cases import counted_step

    got = counted_step(comm, model, FILTER_THEN_CHANNEL, x, y)
    pmodel = parallelize(copy.deepcopy(model), FILTER_THEN_CHANNEL, comm=comm)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    comm.stats.reset()
    torch.nn.functional.cross_entropy(pmodel(x[rows]), y[rows]).backward()
    got["calls"] = comm.stats.snapshot()["calls"]
    return got


def test_grids_that_number_the_ranks_alike_convert_on_one_grid() -> None:
    """{F: 2} and {C: 2} (and {N: 2}) put rank r at coordinate r: a's filter blocks are b's
    channel blocks as they lie (no collective), and the moves between the sample-parallel layers
    and the filter-split ones are one allgather and one slice on one grid, never the general
    all-to-all; one process's step, and the bytes explain prices."""
    gen = torch.Generator().manual_seed(5)
    from tests.parallel.cases import seeded

    model = seeded(FilterThenChannel().double(), gen)
    x = torch.randn(4, 3, 6, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (4,), generator=gen)
    plan = explain(model, FILTER_THEN_CHANNEL, tuple(x.shape), world_size=2)
    moves = {lay.name: [s for s in lay.steps if s.what.startswith("redistribute")]
             for lay in plan.layers}
    assert [s.bytes for s in moves["b"]] == [{0: 0, 1: 0}]  # a's y[*,o_F] is b's x[*,o_C]
    # a takes x gathered: each rank receives the other's 2 samples, 2 x 4 x 6 x 6 doubles
    assert [s.bytes for s in moves["a"] if s.phase == "forward"] == [{0: 2304, 1: 2304}]
    ref = reference_step(model, x, y)
    for r, got in enumerate(run_threads(_calls_step, 2, model, x, y)):
        assert (got["out"] - ref["out"][got["rows"]]).abs().max().item() < TOL
        assert max((got["grads"][k] - g).abs().max().item() for k, g in ref["grads"].items()) < TOL
        assert got["counted"] == tuple(plan.rank_bytes(r).values())
        assert "alltoall" not in got["calls"], got["calls"]


@pytest.mark.gloo
def test_resnet_on_gloo(gloo4) -> None:
    for r in gloo4.run(resnet_run):
        assert r["out"] < TOL and r["grads"] < TOL, r
        assert r["counted"] == r["explained"], r


@pytest.mark.mpi
def test_resnet_on_mpi(mpi4) -> None:
    for r in mpi4.run(resnet_run):
        assert r["out"] < TOL and r["grads"] < TOL, r
        assert r["counted"] == r["explained"], r


def test_distributions_follow_the_paper() -> None:
    """Expected layouts typed from the paper's algorithms, not read from the layers."""
    model, _, _ = resnet_case()
    plan = explain(model, RESNET_CONFIG, RESNET_SHAPE, world_size=4)
    dists = {layer.name: layer.dists for layer in plan.layers}
    assert dists["conv1"] == {"x": "x[o,*,o,*]", "w": "w[*,*,*,*]", "y": "y[o,*,o,*]"}
    assert dists["layer2.0.conv2"] == {"x": "x[o,o_C,*,*]", "w": "w[*,o_C,*,*]",
                                       "y": "y[o,o_C,*,*]"}
    assert dists["layer3.0.conv1"] == {"x": "x[o,o_F,*,*]", "w": "w[o_F,*,*,*]",
                                       "y": "y[o,o_F,*,*]"}
    assert dists["layer3.0.conv3"] == {"x": "x[*,o_{C×F},*,*]", "w": "w[o_F,o_C,*,*]",
                                       "y": "y[*,o_{F×C},*,*]"}
    assert dists["layer2.0.bn2"]["w"] == "w[o_C]"


class TwoW(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(8, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_consecutive_stationary_w_layers_move_no_data_between_them() -> None:
    config = {"layers": [{"match": "*", "grid": {"C": 2, "F": 2}, "algorithm": "stationary-w"}]}
    plan = explain(TwoW(), config, (4, 8, 6, 6), world_size=4)
    b = next(layer for layer in plan.layers if layer.name == "b")
    assert b.dists["x"] == "x[*,o_{F×C},*,*]"  # a's y, taken as it is: roles swapped
    assert not any(s.what.startswith("redistribute a") for s in b.steps)
    torch.manual_seed(0)
    model = TwoW().double()
    x = torch.randn(4, 8, 6, 6, dtype=torch.float64)
    ref = model(x)

    def run(comm):
        out = parallelize(copy.deepcopy(model), config, comm=comm)(x)
        return (out - ref).abs().max().item()

    assert max(run_threads(run, 4)) < TOL


def test_explain_is_pure_and_scales_to_many_ranks() -> None:
    model, _, _ = resnet_case()
    config = {"default": {"grid": {"N": 64}, "algorithm": "sample"},
              "layers": [{"match": "layer3.*", "grid": {"N": 16, "C": 4},
                          "algorithm": "stationary-x"}]}
    plan = explain(model, config, (128, 3, 16, 16))
    assert plan.world_size == 64
    text = str(plan)
    assert "layer3.0.conv2" in text and "sample parallel:" in text
    d = plan.to_dict()
    assert d["totals"]["memory_per_rank"]["parameters"] < \
        d["sample_parallel_totals"]["memory_per_rank"]["parameters"]


def test_memory_of_model_parallel_layers_is_a_pth() -> None:
    """Parameters of a stationary-w layer on C×F = 4 take a quarter per rank."""
    full = sum(p.numel() for p in TwoW().parameters())
    plan = explain(TwoW(), {"default": {"grid": {"C": 2, "F": 2}, "algorithm": "stationary-w"}},
                   (4, 8, 6, 6))
    per_rank = sum(layer.param_elements for layer in plan.layers)
    # weights 8×8×3×3 split 4 ways (2×2 blocks of 4 rows and 4 columns), biases o_{F×C}: 2 each
    assert per_rank == 2 * (4 * 4 * 9 + 2) and per_rank * 4 == full
    assert math.isclose(per_rank / full, 0.25)
