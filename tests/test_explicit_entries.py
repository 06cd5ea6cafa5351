"""A layer's own stationary-x, -y or -w entry over a stage runs where the math allows: the
channels-last ``Linear`` layers of a ConvNeXt block channel-, filter- or channel-and-filter
parallel over their features (as 1×1 convolutions), and a RegNet's grouped convolutions whose
groups the channel blocks cut (x gathered over the blocks first). Each against one process in
fp64 (outputs and every gradient), and the bytes the communicators count equal ``explain``'s.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from distconv.parallel.explain import explain
from distconv.testing import run_threads
from tests.parallel.cases import TOL, counted_step, seeded
from tests.vision_ops import install

install()  # torchvision's models load in the gloo workers too

SHAPE = (4, 3, 32, 32)
#: a layer's own entry over the last stage, the rest sample-parallel on 4 ranks
GRIDS = {"stationary-x": {"N": 2, "C": 2}, "stationary-y": {"N": 2, "F": 2},
         "stationary-w": {"C": 2, "F": 2}}


def _timm_convnext() -> nn.Module:
    """timm's ConvNeXt with channels-last MLPs (``conv_mlp=False``: dwconv, permute to NHWC,
    LayerNorm, Linear(C, 4C), GELU, Linear(4C, C), permute back), 8 channels a stage."""
    timm = pytest.importorskip("timm")
    return timm.create_model("convnext_atto", num_classes=3, dims=(8, 8, 8, 8),
                             depths=(1, 1, 1, 1), conv_mlp=False)


def _timm_convnext_conv_mlp() -> nn.Module:
    """The same with its MLPs as 1×1 convolutions (``conv_mlp=True``, LayerNorm2d)."""
    timm = pytest.importorskip("timm")
    return timm.create_model("convnext_atto", num_classes=3, dims=(8, 8, 8, 8),
                             depths=(1, 1, 1, 1), conv_mlp=True)


def _torchvision_convnext() -> nn.Module:
    """torchvision's ConvNeXt (its CNBlock: dwconv, Permute, LayerNorm, Linear, GELU, Linear,
    Permute, layer scale), two stages of 8 channels."""
    pytest.importorskip("torchvision")
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(8, 8, 1), CNBlockConfig(8, None, 1)], num_classes=3)


def _torchvision_regnet() -> nn.Module:
    """torchvision's RegNet, two stages: 8 channels in 2 groups of 4, then 12 in 3 groups of
    4, whose 2 channel blocks (of 6) cut the middle group."""
    pytest.importorskip("torchvision")
    from torchvision.models.regnet import BlockParams, RegNet

    params = BlockParams(depths=[1, 1], widths=[8, 12], group_widths=[4, 4],
                         bottleneck_multipliers=[1.0, 1.0], strides=[2, 2])
    return RegNet(params, num_classes=3, stem_width=8)


MODELS = {"timm-convnext": (_timm_convnext, "stages.3*"),
          "timm-convnext-conv-mlp": (_timm_convnext_conv_mlp, "stages.3*"),
          "torchvision-convnext": (_torchvision_convnext, "features.3*"),
          "torchvision-regnet": (_torchvision_regnet, "trunk_output.block2*")}


def _config(match: str, algorithm: str) -> dict[str, Any]:
    return {"default": {"grid": {"N": 4}, "algorithm": "sample"},
            "layers": [{"match": match, "grid": GRIDS[algorithm], "algorithm": algorithm}]}


def _case(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    model = seeded(MODELS[name][0]().double(), gen)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (SHAPE[0],), generator=gen)


def _check(model: nn.Module, config: dict, x: torch.Tensor, y: torch.Tensor,
           results: list[dict[str, Any]]) -> None:
    ref = copy.deepcopy(model)
    out = ref(x)
    F.cross_entropy(out, y).backward()
    plan = explain(model, config, tuple(x.shape), world_size=len(results), itemsize=8)
    for r, got in enumerate(results):
        assert (got["out"] - out.detach()[got["rows"]]).abs().max() < TOL, r
        for k, p in ref.named_parameters():
            assert (got["grads"][k] - p.grad).abs().max() < TOL, (r, k)
        assert got["counted"] == tuple(plan.rank_bytes(r).values()), r


@pytest.mark.parametrize("algorithm", list(GRIDS))
@pytest.mark.parametrize("name", list(MODELS))
def test_an_own_entry_over_the_last_stage_equals_one_process_and_its_price(
        name: str, algorithm: str) -> None:
    model, x, y = _case(name)
    config = _config(MODELS[name][1], algorithm)
    _check(model, config, x, y, run_threads(counted_step, 4, model, config, x, y))


def test_explain_states_the_linear_and_grouped_layouts_of_an_own_entry() -> None:
    """The layouts in the paper's notation, written down: a ConvNeXt MLP's Linears under
    stationary-x (``w[*,o_C]``, y reduce-scattered over C) and -y (``w[o_F,*]``, x gathered
    over F); a RegNet's grouped convolution whose blocks cut groups gathers x over C."""
    model = _timm_convnext()
    plan = explain(model, _config("stages.3*", "stationary-x"), SHAPE, world_size=4)
    fc1 = next(lay for lay in plan.layers if lay.name == "stages.3.blocks.0.mlp.fc1")
    assert fc1.dists == {"x": "x[o_N,*,*,o_C]", "w": "w[*,o_C]", "y": "y[o_N,*,*,o_C]"}
    assert [s.what for s in fc1.steps] == ["y reduce-scatter over C", "dL/dy allgather over C"]
    plan = explain(model, _config("stages.3*", "stationary-y"), SHAPE, world_size=4)
    fc2 = next(lay for lay in plan.layers if lay.name == "stages.3.blocks.0.mlp.fc2")
    assert fc2.dists == {"x": "x[o_N,*,*,o_F]", "w": "w[o_F,*]", "y": "y[o_N,*,*,o_F]"}
    assert [s.what for s in fc2.steps] == ["x allgather over F", "dL/dx reduce-scatter over F"]
    plan = explain(_torchvision_regnet(), _config("trunk_output.block2*", "stationary-x"),
                   SHAPE, world_size=4)
    grouped = next(lay for lay in plan.layers
                   if lay.name == "trunk_output.block2.block2-0.f.b.0")
    assert grouped.note == "3 groups cut by the blocks: x gathered"


def test_stationary_w_linears_in_a_row_take_each_others_output_with_the_roles_swapped() -> None:
    """Under stationary-w on {C: 2, F: 2} a Linear's y is ``y[...,o_{F×C}]``: the next one takes
    it as it is, C and F trading roles (the paper's next layer), so no conversion runs between
    them. The ConvNeXt stage's fc1 meets ``x[...,o_{F×C}]`` (gathered over C, reduced over F,
    ``w[o_C,o_F]``), its fc2 the ``y[...,o_{C×F}]`` of fc1 (gathered over F, reduced over C)."""
    plan = explain(_timm_convnext(), _config("stages.3*", "stationary-w"), SHAPE, world_size=4)
    fc1, fc2 = (next(lay for lay in plan.layers if lay.name == f"stages.3.blocks.0.mlp.{n}")
                for n in ("fc1", "fc2"))
    assert fc1.dists == {"x": "x[*,*,*,o_{F×C}]", "w": "w[o_C,o_F]", "y": "y[*,*,*,o_{C×F}]"}
    assert [s.what for s in fc1.steps] == ["x allgather over C", "y reduce-scatter over F",
                                          "dL/dy allgather over F", "dL/dx reduce-scatter over C"]
    assert fc2.dists == {"x": "x[*,*,*,o_{C×F}]", "w": "w[o_F,o_C]", "y": "y[*,*,*,o_{F×C}]"}
    assert [s.what for s in fc2.steps] == ["x allgather over F", "y reduce-scatter over C",
                                          "dL/dy allgather over C", "dL/dx reduce-scatter over F"]


def test_a_linear_entry_on_a_grid_it_cannot_use_is_refused_saying_what_works() -> None:
    config = {"layers": [{"match": "stages.3.blocks.0.mlp.fc1", "grid": {"C": 2, "D": 2},
                          "algorithm": "stationary-x"}]}
    with pytest.raises(ValueError, match=r"fc1.*give layers\[0\].*a grid of N, C and F"):
        explain(_timm_convnext(), config, SHAPE, world_size=4)
    config = {"layers": [{"match": "head.fc", "grid": {"F": 4}, "algorithm": "stationary-y"}]}
    with pytest.raises(ValueError, match=r"use at most 3 C×F ranks.*out_features=3"):
        explain(_timm_convnext(), config, SHAPE, world_size=4)


# ------------------------------------------------------------------ DistLinear on its own
@st.composite
def _linear_cases(draw: st.DrawFn) -> dict[str, Any]:
    algorithm = draw(st.sampled_from(list(GRIDS)))
    c = draw(st.integers(2, 3)) if algorithm != "stationary-y" else 1
    f = draw(st.integers(2, 8 // c if c > 1 else 3)) if algorithm != "stationary-x" else 1
    n = draw(st.integers(1, 8 // (c * f)))
    grid = {k: v for k, v in (("N", n), ("C", c), ("F", f)) if v > 1} or {"N": 1}
    last = {"stationary-x": "C", "stationary-y": "F", "stationary-w": ("C", "F")}[algorithm]
    lead = draw(st.integers(0, 2))
    return {"algorithm": algorithm, "grid": grid, "last": last, "lead": lead,
            "rows": (draw(st.integers(n, n + 2)),) + tuple(
                draw(st.integers(1, 3)) for _ in range(lead)),
            "in": draw(st.integers(c * f, c * f + 4)), "out": draw(st.integers(c * f, c * f + 4)),
            "bias": draw(st.booleans()), "seed": draw(st.integers(0, 2**16))}


def _dist_linear(comm: Any, case: dict[str, Any], whole: nn.Linear, x: torch.Tensor,
                 dy: torch.Tensor) -> dict[str, Any]:
    from distconv.distribution import Dist
    from distconv.grid import ProcessorGrid
    from distconv.nn import DistLinear
    from distconv.redistribute import gather

    grid = ProcessorGrid(case["grid"], comm=comm)
    dist = Dist(("N" if "N" in case["grid"] else None,) + (None,) * case["lead"]
                + (case["last"],))
    layer = DistLinear.from_module(whole, grid=grid, input_dist=dist,
                                   algorithm=case["algorithm"])
    mine = x[dist.local_slices(tuple(x.shape), grid)].clone().requires_grad_()
    out = layer(mine, tuple(x.shape))
    out.backward(dy[layer.output_dist.local_slices(tuple(dy.shape), grid)])
    layer.finish_grad_sync()
    got = {"out": gather(out.detach(), layer.output_dist, grid, tuple(dy.shape)),
           "dx": gather(mine.grad, dist, grid, tuple(x.shape)),
           "dw": gather(layer.weight.grad, layer.weight_dist, grid, tuple(whole.weight.shape))}
    if whole.bias is not None:
        got["db"] = gather(layer.bias.grad, layer.bias_dist, grid, (whole.out_features,))
    return got


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_linear_cases())
def test_dist_linear_equals_the_whole_layer_under_every_algorithm(case: dict[str, Any]) -> None:
    """Output and every gradient equal the whole layer's, written down: ``x·wᵀ + b``, and for
    a cotangent ``g``: ``dx = g·w``, ``dw = gᵀ·x``, ``db = Σ g`` over the rows."""
    gen = torch.Generator().manual_seed(case["seed"])
    whole = seeded(nn.Linear(case["in"], case["out"], bias=case["bias"]).double(), gen)
    x = torch.randn(case["rows"] + (case["in"],), generator=gen, dtype=torch.float64)
    dy = torch.randn(case["rows"] + (case["out"],), generator=gen, dtype=torch.float64)
    w = whole.weight.detach()
    want = {"out": x @ w.T + (0 if whole.bias is None else whole.bias.detach()),
            "dx": dy @ w, "dw": dy.reshape(-1, case["out"]).T @ x.reshape(-1, case["in"]),
            "db": dy.reshape(-1, case["out"]).sum(0)}
    world = math.prod(case["grid"].values())
    for got in run_threads(_dist_linear, world, case, whole, x, dy):
        for k, v in got.items():
            assert (v - want[k]).abs().max() < TOL, (case, k)


# ------------------------------------------------------------------ a real gloo world
def _gloo_run(comm: Any, name: str, algorithm: str) -> dict[str, Any]:
    model, x, y = _case(name)
    config = _config(MODELS[name][1], algorithm)
    got = counted_step(comm, model, config, x, y)
    explained = explain(model, config, SHAPE, world_size=comm.size, itemsize=8)
    ref = copy.deepcopy(model)
    out = ref(x)
    F.cross_entropy(out, y).backward()
    return {"out": (got["out"] - out.detach()[got["rows"]]).abs().max().item(),
            "grads": max((got["grads"][k] - p.grad).abs().max().item()
                         for k, p in ref.named_parameters()),
            "counted": got["counted"],
            "explained": tuple(explained.rank_bytes(comm.rank).values())}


@pytest.mark.gloo
@pytest.mark.parametrize("name", ["timm-convnext", "torchvision-regnet"])
def test_an_own_stationary_x_entry_on_gloo(gloo4, name: str) -> None:  # noqa: ANN001
    for r in gloo4.run(_gloo_run, name, "stationary-x"):
        assert r["out"] < TOL and r["grads"] < TOL, r
        assert r["counted"] == r["explained"], r
