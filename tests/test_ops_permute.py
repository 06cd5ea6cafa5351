"""Dims that move carry their distribution: channels-last blocks (ConvNeXt), transposes, channel
shuffles and views, each trained one step against one process in fp64 under sample, spatial and
channel-split configs, and the placements they take checked against ones written down here."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distconv import ops
from distconv.parallel.explain import explain
from distconv.parallel.config import ParallelConfig
from distconv.ops.shape import GLOBAL_SHAPE
from distconv.parallel.graph import analyse, trace
from distconv.testing import run_threads
from tests.parallel.cases import TOL, counted_step, max_errors, reference_step, seeded, train_step


class Permute(nn.Module):
    """torchvision's ``ops.misc.Permute``."""

    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.permute(x, self.dims)


class CNBlock(nn.Module):
    """torchvision's ``models.convnext.CNBlock`` as it is written there, its layer scale and
    stochastic depth left out (parameters multiplied in directly and stochastic depth are
    other op families)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim, bias=True),
            Permute([0, 2, 3, 1]),
            nn.LayerNorm(dim, eps=1e-6),
            nn.Linear(in_features=dim, out_features=4 * dim, bias=True),
            nn.GELU(),
            nn.Linear(in_features=4 * dim, out_features=dim, bias=True),
            Permute([0, 3, 1, 2]),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        result = self.block(input)
        result += input
        return result


class Mlp(nn.Module):
    """timm's ``layers.Mlp`` (no norm, dropout 0)."""

    def __init__(self, in_features: int, hidden_features: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(0.0)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden_features, in_features)
        self.drop2 = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop1(self.act(self.fc1(x)))
        return self.drop2(self.fc2(self.norm(x)))


class ConvNeXtBlock(nn.Module):
    """timm's ``ConvNeXtBlock`` with ``conv_mlp=False`` as written there (``ls_init_value=None``,
    ``drop_path=0``: no gamma, an identity shortcut)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim, bias=True)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, 4 * dim)
        self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.conv_dw(x)
        x = x.permute(0, 2, 3, 1)
        x = self.norm(x)
        x = self.mlp(x)
        x = x.permute(0, 3, 1, 2)
        x = x + self.shortcut(shortcut)
        return x


class LayerNorm2d(nn.LayerNorm):
    """timm's ``LayerNorm2d``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        x = x.permute(0, 3, 1, 2)
        return x


class ConvNeXtMini(nn.Module):
    """A stem, a torchvision block, timm's downsampling norm (LayerNorm2d), a timm block, and a
    head on the pooled features."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 3, padding=1)
        self.stage1 = CNBlock(dim)
        self.norm = LayerNorm2d(dim)
        self.stage2 = ConvNeXtBlock(dim)
        self.head = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.norm(self.stage1(self.stem(x))))
        return self.head(x.mean((2, 3)))


SHAPE = (6, 3, 8, 8)

#: sample, spatial (H), channel-split (stationary-x, stationary-w) and a hybrid whose blocks
#: are channel-split after a spatial stem
CONFIGS: list[tuple[int, dict[str, Any]]] = [
    (2, {"default": {"grid": {"N": 2}, "algorithm": "sample"}}),
    (4, {"default": {"grid": {"N": 2, "H": 2}, "algorithm": "spatial"},
         "data": {"N": 2, "H": 2}}),
    (4, {"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"}}),
    (4, {"default": {"grid": {"C": 2, "F": 2}, "algorithm": "stationary-w"},
         "layers": [{"match": "stem", "grid": {"N": 4}, "algorithm": "sample"}]}),
    (4, {"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"},
         "layers": [{"match": "stem", "grid": {"N": 2, "H": 2}, "algorithm": "spatial"}]}),
]


def convnext_case(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    model = seeded(ConvNeXtMini().double(), gen)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (SHAPE[0],), generator=gen)
    return model, x, y


@pytest.mark.parametrize("world, config", CONFIGS, ids=["sample", "spatial", "stationary-x",
                                                        "stationary-w", "hybrid"])
def test_convnext_blocks_train_as_one_process(world: int, config: dict) -> None:
    model, x, y = convnext_case()
    ref = reference_step(model, x, y)
    for got in run_threads(train_step, world, model, config, x, y):
        err = max_errors(ref, got)
        assert max(err.values()) < TOL, err


def _placements(model: nn.Module, config: dict, world: int) -> dict[str, tuple]:
    """Each value's Dist entries (grid dims per tensor dim) and pending sums."""
    analysis = analyse(trace(model), ParallelConfig(config, world_size=world), input_ndim=4)
    return {s.node.name: s.out.dist.entries + (tuple(sorted(s.out.dist.pending)),)
            for s in analysis.steps if s.out is not None}


CF, CL = ("N", "C", None, None, ()), ("N", None, None, "C", ())  # channels first, last


def test_channels_last_values_keep_the_channel_split_in_their_last_dim() -> None:
    """Written down from the algorithm: under stationary-x the block's convolution leaves
    ``y[o,o_C,*,*]``; permuted channels-last it is ``[o,*,*,o_C]``, the LayerNorm, both Linears
    (stationary-x over C: their out-features split like their in-features) and GELU keep it, and
    the permute back restores ``[o,o_C,*,*]``, which the residual add meets in place -- the dims
    a layer-scale parameter of shape ``(C,)`` broadcasts against are ``[*,*,*,o_C]``."""
    model = ConvNeXtMini().double()
    got = _placements(model, CONFIGS[2][1], 4)
    assert got["stage1_block_0"] == CF and got["permute"] == CL
    for name in ("stage1_block_2", "stage1_block_3", "stage1_block_4", "stage1_block_5",
                 "permute_4", "stage2_norm", "stage2_mlp_fc1", "stage2_mlp_act",
                 "stage2_mlp_fc2"):
        assert got[name] == CL, name
    assert got["permute_1"] == got["add"] == got["permute_5"] == got["add_1"] == CF
    # timm's LayerNorm2d (F.layer_norm) normalises its split channels in place, as nn.LayerNorm
    assert got["layer_norm"] == CL
    plan = explain(model, CONFIGS[2][1], SHAPE, world_size=4, itemsize=8)
    moves = {lay.name: [s.what for s in lay.steps] for lay in plan.layers}
    assert moves["stage1.block.3"] == ["y reduce-scatter over C", "dL/dy allgather over C"]
    assert moves["stage1.block.5"] == ["y reduce-scatter over C", "dL/dy allgather over C"]
    assert not any(w.startswith("redistribute") for n in ("stage1.block.2", "add")
                   for w in moves.get(n, []))


def test_spatial_split_runs_the_channels_last_layers_on_local_rows() -> None:
    """Under a row split the channel dim is whole: LayerNorm and Linear run on each rank's rows
    (``[o,*,o_H,*]`` permuted channels-last is ``[o,o_H,*,*]``) and move nothing."""
    got = _placements(ConvNeXtMini().double(), CONFIGS[1][1], 4)
    rows_last = ("N", "H", None, None, ())
    assert got["permute"] == got["stage1_block_3"] == got["stage1_block_5"] == rows_last
    assert got["layer_norm"] == got["stage2_mlp_fc2"] == rows_last
    assert got["permute_1"] == got["add"] == ("N", None, "H", None, ())


class _TwoBranches(nn.Module):
    """Products and sums of channels-last values: a Linear's output times its input, plus the
    input, in channels-last order, then a channels-first sum."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        a = x.permute(0, 2, 3, 1)
        b = self.fc(a) * a + a
        return self.head((b.permute(0, 3, 1, 2) + x).mean((2, 3)))


@pytest.mark.parametrize("world, config", CONFIGS[:4])
def test_binary_ops_between_channels_last_values_move_nothing(world: int, config: dict) -> None:
    gen = torch.Generator().manual_seed(3)
    model = seeded(_TwoBranches().double(), gen)
    x = torch.randn((5, 3, 6, 5), generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (5,), generator=gen)
    ref = reference_step(model, x, y)
    plan = explain(model, config, tuple(x.shape), world_size=world, itemsize=8)
    for lay in plan.layers:
        if lay.name in ("mul", "add", "add_1"):
            assert not lay.steps, (lay.name, lay.steps)
    for r, got in enumerate(run_threads(counted_step, world, model, config, x, y)):
        assert (got["out"] - ref["out"][got["rows"]]).abs().max() < TOL
        assert max((got["grads"][k] - g).abs().max() for k, g in ref["grads"].items()) < TOL
        assert got["counted"] == tuple(plan.rank_bytes(r).values())


class _PendingPermuted(nn.Module):
    """A row mean (a pending sum over the grid dims that split the rows) permuted
    channels-last, then a Linear on its channels; and a layer scale reshaped from a parameter,
    which is no activation to place."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 4)
        self.gamma = nn.Parameter(torch.ones(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        m = x.mean(2, keepdim=True).permute(0, 2, 3, 1)
        return self.head(self.fc(m).mean((1, 2)) + x.mean((2, 3)).mul(self.gamma.reshape(1, -1)))


def test_a_permuted_pending_sum_stays_pending_until_a_layer_needs_it() -> None:
    model = _PendingPermuted().double()
    config = {"default": {"grid": {"N": 2, "H": 2}, "algorithm": "spatial"},
              "data": {"N": 2, "H": 2}}
    got = _placements(model, config, 4)
    assert got["mean"] == ("N", None, None, None, ("H",))
    assert got["permute"] == ("N", None, None, None, ("H",))
    assert got["fc"] == ("N", None, None, None, ())
    # the parameter's reshape: a model tensor, whole on every rank (its user slices it)
    assert got["reshape"] == (None, None, ())  # gamma.reshape(1, -1): [1, C]
    gen = torch.Generator().manual_seed(7)
    model = seeded(model, gen)
    x = torch.randn((5, 3, 6, 5), generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (5,), generator=gen)
    ref = reference_step(model, x, y)
    for got in run_threads(train_step, 4, model, config, x, y):
        err = max_errors(ref, got)
        assert max(err.values()) < TOL, err


class _MovesSamples(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stem(x).transpose(0, 1).mean((2, 3)).t()


class _MergesSamples(_MovesSamples):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        return x.reshape(x.size(1), -1).mean(0)


class _WrongView(_MovesSamples):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stem(x).view(4, 5, 42).mean((1, 2))


def test_moving_or_merging_the_samples_is_refused_naming_the_node() -> None:
    config = {"default": {"grid": {"N": 2}, "algorithm": "sample"}}
    with pytest.raises(ops.Unsupported, match=r"node 'transpose'.*moves the samples"):
        explain(_MovesSamples(), config, (5, 3, 7, 6), world_size=2)
    with pytest.raises(ops.Unsupported, match=r"node 'reshape'.*merges or splits the samples"):
        explain(_MergesSamples(), config, (5, 3, 7, 6), world_size=2)


class _FrontAxis(_MovesSamples):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).mean((2, 3))
        return (x[None] if self.how == "index" else x.unsqueeze(0)).mean(2)


@pytest.mark.parametrize("how, node", [("index", "getitem"), ("unsqueeze", "unsqueeze")])
def test_a_dim_added_before_the_samples_is_refused_naming_the_node(how: str, node: str) -> None:
    with pytest.raises(ops.Unsupported, match=rf"node '{node}'.*adds a dim before the samples"):
        explain(_FrontAxis(how), {"default": {"grid": {"N": 2}}}, (5, 3, 7, 6), world_size=2)


def test_a_view_whose_sizes_do_not_keep_the_samples_is_refused_before_a_step() -> None:
    """Literal sizes are taken to keep the samples; on a shape where they do not (4 rows of a
    5-sample batch), the view is refused by name before anything runs."""
    with pytest.raises(ValueError, match=r"node 'view'.*does not keep input dim\(s\) \[0\]"):
        explain(_WrongView(), {"default": {"grid": {"N": 2}}}, (5, 3, 7, 6), world_size=2)


class _Shuffle(nn.Module):
    """ShuffleNet's ``channel_shuffle`` as torchvision writes it, between two convolutions."""

    def __init__(self, literal: bool) -> None:
        super().__init__()
        self.literal = literal
        self.a = nn.Conv2d(3, 6, 3, padding=1)
        self.b = nn.Conv2d(6, 6, 3, padding=1, groups=2)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if self.literal:  # sizes read from the value, the group sizes as numbers
            x = x.view(x.size(0), 2, 3, x.size(2), x.size(3))
            x = torch.transpose(x, 1, 2).contiguous()
            x = x.view(x.size(0), -1, x.size(3), x.size(4))
        else:
            batchsize, num_channels, height, width = x.size()
            channels_per_group = num_channels // 2
            x = x.view(batchsize, 2, channels_per_group, height, width)
            x = torch.transpose(x, 1, 2).contiguous()
            x = x.view(batchsize, -1, height, width)
        return self.head(self.b(x).mean((2, 3)))


SHUFFLE_CONFIGS = [CONFIGS[0], CONFIGS[1], CONFIGS[2],
                   (4, {"default": {"grid": {"N": 2, "F": 2}, "algorithm": "stationary-y"}})]


def _shuffle_check(literal: bool, world: int, config: dict) -> None:
    gen = torch.Generator().manual_seed(5)
    model = seeded(_Shuffle(literal).double(), gen)
    x = torch.randn((5, 3, 6, 5), generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (5,), generator=gen)
    ref = reference_step(model, x, y)
    for got in run_threads(train_step, world, model, config, x, y):
        err = max_errors(ref, got)
        assert max(err.values()) < TOL, err


@pytest.mark.parametrize("world, config", SHUFFLE_CONFIGS,
                         ids=["sample", "spatial", "stationary-x", "stationary-y"])
def test_channel_shuffle_trains_as_one_process(world: int, config: dict) -> None:
    _shuffle_check(True, world, config)


def test_channel_shuffle_keeps_rows_split_and_gathers_split_channels() -> None:
    """The shuffle's views keep the samples and rows (no data moves under a row split); where
    the channels are split the first view makes them whole (an allgather over C, priced), and
    the next convolution takes its block again."""
    model = _Shuffle(True).double()
    got = _placements(model, SHUFFLE_CONFIGS[1][1], 4)
    assert got["view"] == ("N", None, None, "H", None, ())
    assert got["view_1"] == ("N", None, "H", None, ())
    got = _placements(model, SHUFFLE_CONFIGS[2][1], 4)
    assert got["a"] == ("N", "C", None, None, ())
    assert got["view"] == ("N", None, None, None, None, ())
    plan = explain(model, SHUFFLE_CONFIGS[2][1], (5, 3, 6, 5), world_size=4, itemsize=8)
    view = next(lay for lay in plan.layers if lay.name == "view")
    assert [s.what.split(":")[0] for s in view.steps] == ["redistribute a", "adjoint of "
                                                          "redistribute a"]


def test_channel_shuffle_with_size_arithmetic_once_sizes_fold() -> None:
    """torchvision's own form (``num_channels // groups``) needs the capture that folds sizes
    into global constants."""
    pytest.importorskip("distconv.ops.sizes")
    for world, config in SHUFFLE_CONFIGS[1:3]:
        _shuffle_check(False, world, config)


def _convnext_run(comm: Any) -> dict[str, Any]:
    """The fixed ConvNeXt case on the channel-split config: errors against one process and the
    counted bytes against ``explain``'s."""
    model, x, y = convnext_case()
    world, config = CONFIGS[4]
    ref = reference_step(model, x, y)
    got = counted_step(comm, copy.deepcopy(model), config, x, y)
    explained = explain(model, config, SHAPE, world_size=comm.size, itemsize=8)
    return {"out": (got["out"] - ref["out"][got["rows"]]).abs().max().item(),
            "grads": max((got["grads"][k] - g).abs().max().item()
                         for k, g in ref["grads"].items()),
            "counted": got["counted"], "explained": tuple(explained.rank_bytes(comm.rank)
                                                          .values())}


@pytest.mark.gloo
def test_convnext_on_gloo(gloo4) -> None:  # noqa: ANN001
    for r in gloo4.run(_convnext_run):
        assert r["out"] < TOL and r["grads"] < TOL, r
        assert r["counted"] == r["explained"], r



def _dist_linear(comm: Any, whole: nn.Linear, x: torch.Tensor) -> dict[str, Any]:
    """A DistLinear on ``x[o_N,*,o_C]`` of a {N: 2, C: 2} grid: its output, input gradient and
    parameter gradients for a cotangent of ones, gathered whole."""
    from distconv.distribution import Dist
    from distconv.grid import ProcessorGrid
    from distconv.nn import DistLinear
    from distconv.redistribute import gather

    grid = ProcessorGrid({"N": 2, "C": 2}, comm=comm)
    dist = Dist(("N", None, "C"))
    layer = DistLinear.from_module(whole, grid=grid, input_dist=dist)
    mine = x[dist.local_slices(tuple(x.shape), grid)].clone().requires_grad_()
    out = layer(mine, tuple(x.shape))
    out.backward(torch.ones_like(out))
    layer.finish_grad_sync()
    rows = tuple(x.shape[:-1])
    return {"out": gather(out.detach(), dist, grid, rows + (whole.out_features,)),
            "dx": gather(mine.grad, dist, grid, tuple(x.shape)),
            "dw": gather(layer.weight.grad, layer.weight_dist, grid, tuple(whole.weight.shape)),
            "db": gather(layer.bias.grad, layer.bias_dist, grid, (whole.out_features,)),
            "local": tuple(layer.weight.shape), "repr": repr(layer)}


def test_dist_linear_is_the_whole_layer_with_its_weight_columns_split() -> None:
    """Stationary-x on the last dim: each rank holds w[:, C block] (3 x 3 or 3 x 2 of 3 x 5);
    output and every gradient equal the whole layer's (written down: x·wᵀ + b, and for a
    cotangent of ones dx = 1·w, dw = 1ᵀ·x, db = the row count)."""
    gen = torch.Generator().manual_seed(2)
    whole = seeded(nn.Linear(5, 3).double(), gen)
    x = torch.randn((3, 4, 5), generator=gen, dtype=torch.float64)
    want_out = x @ whole.weight.detach().T + whole.bias.detach()
    ones = torch.ones(3, 4, 3, dtype=torch.float64)
    for r, got in enumerate(run_threads(_dist_linear, 4, whole, x)):
        assert (got["out"] - want_out).abs().max() < TOL
        assert (got["dx"] - ones @ whole.weight.detach()).abs().max() < TOL
        assert (got["dw"] - ones.reshape(12, 3).T @ x.reshape(12, 5)).abs().max() < TOL
        assert (got["db"] - 12).abs().max() < TOL
        assert got["local"] == ((3, 3) if r % 2 == 0 else (3, 2))
        assert "grid={'N': 2, 'C': 2}" in got["repr"] and "w[*,o_C]" in got["repr"]


def test_dist_linear_refuses_an_input_whose_features_are_whole() -> None:
    from distconv.distribution import Dist
    from distconv.grid import ProcessorGrid
    from distconv.nn import DistLinear

    with pytest.raises(TypeError, match="grid must be a distconv.grid.ProcessorGrid"):
        DistLinear(4, 3, grid={"C": 1}, input_dist=Dist(("N", None)))
    with pytest.raises(ValueError, match=r"must split the last dim.*got \[o_N,\*\]"):
        DistLinear(4, 3, grid=ProcessorGrid({"N": 1}), input_dist=Dist(("N", None)))


class _MergeSplit(nn.Module):
    """Channels merged with the rows and split again, with literal sizes (as a capture that
    folds sizes writes them), between two convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x).reshape(5, 24, 5)
        x = torch.flatten(x.reshape(5, 4, 6, 5), 2).view(5, 4, 6, 5)
        return self.head(self.b(x).mean((2, 3)))


def _traced_with_shapes(shape: tuple[int, ...]) -> Any:
    """``trace`` that records every node's global shape, as a capture per input shape does."""
    from distconv.parallel.shapes import propagate_shapes

    def traced(model: nn.Module, input_shape: Any = None) -> Any:  # (the shape is given)
        gm = trace(model)
        meta = copy.deepcopy(gm).to("meta")
        propagate_shapes(meta, shape, dtype=torch.float64)
        for mine, theirs in zip(gm.graph.nodes, meta.graph.nodes):
            found = theirs.meta.get("tensor_meta")
            if found is not None and hasattr(found, "shape"):
                mine.meta[GLOBAL_SHAPE] = tuple(found.shape)
        return gm

    return traced


STATIONARY_X = CONFIGS[2][1]


def test_merges_and_splits_keep_the_major_split_where_the_capture_knows_the_shapes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Written down: the channels (4 over C: 2) merged with the rows keep their split
    (``[o,o_C,*]``, each block 2 x 6 = 12 of 24), split again they are ``[o,o_C,*,*]``, and the
    second convolution reads them where they are; flattening the rows and columns keeps them
    too. Without recorded shapes the same literal sizes make every regrouped dim whole. Either
    way one step equals one process, and the bytes counted are explain's."""
    model = _MergeSplit().double()
    shape = (5, 3, 6, 5)
    analysis = analyse(_traced_with_shapes(shape)(model),
                       ParallelConfig(STATIONARY_X, world_size=4), input_ndim=4)
    got = {s.node.name: s.out.dist.entries for s in analysis.steps if s.out is not None}
    assert got["reshape"] == ("N", "C", None) and got["reshape_1"] == ("N", "C", None, None)
    assert got["flatten"] == ("N", "C", None) and got["view"] == ("N", "C", None, None)
    plain = _placements(model, STATIONARY_X, 4)
    assert plain["reshape"] == ("N", None, None, ())
    assert plain["view"] == ("N", None, None, None, ())
    gen = torch.Generator().manual_seed(9)
    model = seeded(model, gen)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (5,), generator=gen)
    ref = reference_step(model, x, y)
    for recorded in (False, True):
        if recorded:
            monkeypatch.setattr("distconv.parallel.model.trace", _traced_with_shapes(shape))
            monkeypatch.setattr("distconv.parallel.explain.trace", _traced_with_shapes(shape))
        plan = explain(model, STATIONARY_X, shape, world_size=4, itemsize=8)
        moved = sum(s.bytes[0] for lay in plan.layers if lay.name.startswith(("reshape", "view"))
                    for s in lay.steps)
        assert (moved == 0) == recorded
        for r, got in enumerate(run_threads(counted_step, 4, model, STATIONARY_X, x, y)):
            assert (got["out"] - ref["out"][got["rows"]]).abs().max() < TOL
            assert max((got["grads"][k] - g).abs().max() for k, g in ref["grads"].items()) < TOL
            assert got["counted"] == tuple(plan.rank_bytes(r).values())


class _FlattenRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.a(x).flatten(2).mean(2))


def test_a_flatten_keeps_split_rows_where_they_align_and_is_refused_where_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows split over H: 2 merged with the columns keep the split where 2 divides the rows
    (6: blocks of 3 x 5 = 15 of 30, the merged dim's own balanced blocks); placed so from the
    recorded shapes, an input of 7 rows (blocks 4 and 3: 20 and 15 of 35, not 18 and 17) is
    refused by name before a step, and the aligned one trains as one process."""
    config = {"default": {"grid": {"N": 2, "H": 2}, "algorithm": "spatial"},
              "data": {"N": 2, "H": 2}}
    monkeypatch.setattr("distconv.parallel.explain.trace", _traced_with_shapes((5, 3, 6, 5)))
    monkeypatch.setattr("distconv.parallel.model.trace", _traced_with_shapes((5, 3, 6, 5)))
    gen = torch.Generator().manual_seed(4)
    model = seeded(_FlattenRows().double(), gen)
    with pytest.raises(ValueError, match=r"node 'flatten'.*does not keep input dim\(s\) \[2\]"):
        explain(model, config, (5, 3, 7, 5), world_size=4)
    plan = explain(model, config, (5, 3, 6, 5), world_size=4, itemsize=8)
    assert not [s for lay in plan.layers if lay.name == "flatten" for s in lay.steps]
    x = torch.randn((5, 3, 6, 5), generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (5,), generator=gen)
    ref = reference_step(model, x, y)
    for r, got in enumerate(run_threads(counted_step, 4, model, config, x, y)):
        assert (got["out"] - ref["out"][got["rows"]]).abs().max() < TOL
        assert max((got["grads"][k] - g).abs().max() for k, g in ref["grads"].items()) < TOL
        assert got["counted"] == tuple(plan.rank_bytes(r).values())
