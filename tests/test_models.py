"""The networks of ``distconv.models`` beyond ResNets -- 2-D and 3-D U-Nets, a CosmoFlow-style 3-D
CNN, an SE-ResNet and a MobileNet-style net -- trained one step by the user's loop under random
per-layer configs on random grids of 2 to 8 thread ranks, with uneven batches: the output, every
gradient and the state after an SGD-with-momentum step equal one process on the global batch
(fp64, the suite's tolerance). The 2-D networks' Conv2d layers draw any algorithm and grid; the
3-D networks' Conv3d and ConvTranspose3d layers draw sample or spatial parallelism (over D, H and
W) or stationary-x, -y, -w on grids of samples, channels, filters and spatial dims, wherever every
rank keeps an input and an output row; the data grid may replicate them over a second grid
dim."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from distconv import models
from distconv.data import sample_block
from distconv.parallel import parallelize
from distconv.testing import run_threads
from tests.parallel.cases import LR, MOMENTUM, TOL, _gathered_grads, max_errors
from tests.parallel.test_parallelize import _factor, layer_choices

#: name -> (builder of the fp64 model, input shape after the batch, target kind)
NETWORKS_2D: dict[str, tuple[Any, tuple[int, ...], str]] = {
    "unet2d": (lambda: models.unet2d(in_channels=3, base=4, depth=2), (3, 8, 8), "pixels"),
    "unet2d-upsample-groupnorm": (
        lambda: models.unet2d(in_channels=3, base=4, depth=1, norm="group", up="upsample"),
        (3, 6, 6), "pixels"),
    "se-resnet": (lambda: models.se_resnet_mini(in_channels=3, base=4, num_classes=3),
                  (3, 8, 8), "classes"),
    "resnet18": (lambda: models.resnet18_mini(in_channels=3, widths=(4, 8), num_classes=3),
                 (3, 8, 8), "classes"),
    "mobilenet": (lambda: models.mobilenet_mini(in_channels=3, base=4, num_classes=3,
                                                blocks=2), (3, 8, 8), "classes"),
}
NETWORKS_3D: dict[str, tuple[Any, tuple[int, ...], str]] = {
    "unet3d": (lambda: models.unet3d(in_channels=1, base=2, depth=1), (1, 4, 4, 4), "pixels"),
    "unet3d-batchnorm-upsample": (
        lambda: models.unet3d(in_channels=1, base=2, depth=1, norm="batch", up="upsample"),
        (1, 4, 2, 4), "pixels"),
    "cosmoflow": (lambda: models.cosmoflow_mini(in_channels=2, base=2, size=4, depth=1,
                                                hidden=6), (2, 4, 4, 4), "values"),
}


def _loss(out: torch.Tensor, y: torch.Tensor, kind: str) -> torch.Tensor:
    return F.mse_loss(out, y) if kind == "values" else F.cross_entropy(out, y)


def _targets(kind: str, out_shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if kind == "values":
        return torch.randn(out_shape, generator=gen, dtype=torch.float64)
    classes = out_shape[1]
    return torch.randint(0, classes, (out_shape[0], *out_shape[2:]), generator=gen)


def reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, kind: str) -> dict[str, Any]:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    out = model(x)
    _loss(out, y, kind).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    opt.step()
    return {"out": out.detach(), "grads": grads,
            "state": {k: v.clone() for k, v in model.state_dict().items()}}


def users_step(comm: Any, model: nn.Module, config: dict, x: torch.Tensor, y: torch.Tensor,
               kind: str) -> dict[str, Any]:
    """The user's loop: parallelize, this rank's samples, forward, loss, backward, SGD."""
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    opt = torch.optim.SGD(pmodel.parameters(), lr=LR, momentum=MOMENTUM)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    out = pmodel(x[rows])
    _loss(out, y[rows], kind).backward()
    grads = _gathered_grads(pmodel)
    opt.step()
    return {"rows": rows, "out": out.detach(), "grads": grads,
            "state": pmodel.gather_state_dict()}


@st.composite
def cases(draw: st.DrawFn, networks: dict, model_parallel: bool) -> tuple:
    name = draw(st.sampled_from(sorted(networks)))
    make, shape, kind = networks[name]
    p = draw(st.sampled_from([2, 3, 4, 6, 8]))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    model = make().double()
    config: dict = {"layers": []}
    batch = draw(st.integers(p, p + 3))
    if model_parallel:
        kinds = (nn.Conv2d, nn.Conv3d, nn.ConvTranspose3d)
        convs = [(n, m) for n, m in model.named_modules() if type(m) in kinds]
        sizes = _spatial_sizes(model, (batch, *shape), kinds)
        for n, m in draw(st.lists(st.sampled_from(convs), unique_by=lambda c: c[0],
                                  max_size=len(convs))):
            def fits(c: dict, m: nn.Module = m, n: str = n) -> bool:
                """Every rank holds a channel or filter block and, on a split spatial dim, an
                input and an output row; a grouped layer's blocks hold whole groups (else
                refused by name, tested apart)."""
                blocks = c["grid"].get("C", 1) * c["grid"].get("F", 1)
                if blocks > min(m.in_channels, m.out_channels):
                    return False
                if type(m) is not nn.Conv2d:
                    return all(c["grid"].get(d, 1) <= min(sizes[n][0][i], sizes[n][1][i])
                               for i, d in enumerate("DHW")) and (m.groups == 1 or blocks == 1)
                return m.groups == 1 or c["algorithm"] in ("sample", "spatial") or (
                    m.groups % blocks == 0)

            draws = layer_choices(p) if type(m) is nn.Conv2d else volume_choices(p)
            choice = draw(draws.filter(fits))
            config["layers"].append({"match": n, **choice})
    if draw(st.booleans()):
        config["data"] = _factor(draw, p, ["N", "C"])  # samples replicated over C
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(batch, *shape, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        out_shape = tuple(copy.deepcopy(model).eval()(x).shape)
    return name, p, model, config, x, _targets(kind, out_shape, gen), kind


@st.composite
def volume_choices(draw: st.DrawFn, p: int) -> dict:
    """A 3-D layer's entry: any algorithm, on grids that may split D, H and W."""
    algorithm = draw(st.sampled_from(
        ["sample", "spatial", "stationary-x", "stationary-y", "stationary-w"]))
    names = {"sample": ["N"], "spatial": ["N", "D", "H", "W"], "stationary-x": ["C", "N", "D"],
             "stationary-y": ["F", "H", "D"], "stationary-w": ["C", "F", "W"]}[algorithm]
    return {"grid": _factor(draw, p, names), "algorithm": algorithm}


def _spatial_sizes(model: nn.Module, shape: tuple[int, ...], kinds: tuple[type, ...]
                   ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each convolution's input and output spatial sizes on an input of ``shape``."""
    sizes, hooks = {}, []
    for name, m in model.named_modules():
        if type(m) in kinds:
            hooks.append(m.register_forward_hook(
                lambda mod, args, out, name=name: sizes.__setitem__(
                    name, (tuple(args[0].shape[2:]), tuple(out.shape[2:])))))
    with torch.no_grad():
        model.eval()(torch.zeros(shape, dtype=torch.float64))
    model.train()
    for h in hooks:
        h.remove()
    return sizes


def _check(case: tuple) -> None:
    name, p, model, config, x, y, kind = case
    ref = reference(model, x, y, kind)
    for got in run_threads(users_step, p, model, config, x, y, kind):
        err = max_errors(ref, got)
        assert max(err.values()) < TOL, (name, config, err)


@settings(max_examples=12, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(cases(NETWORKS_2D, model_parallel=True))
def test_2d_networks_under_random_configs_equal_one_process(case: tuple) -> None:
    _check(case)


@settings(max_examples=6, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(cases(NETWORKS_3D, model_parallel=True))
def test_3d_networks_on_random_grids_equal_one_process(case: tuple) -> None:
    _check(case)


@pytest.mark.parametrize("name", sorted({**NETWORKS_2D, **NETWORKS_3D}))
def test_each_network_on_four_ranks_equals_one_process(name: str) -> None:
    """Every network at least once, whatever hypothesis draws: a fixed hybrid on 4 ranks (the 2-D
    networks' 3×3 convolutions spatial over rows, their 1×1 ones channel-split; the 3-D
    networks' convolutions each on the next of spatial over depth, stationary-x, -y (with depth),
    -w, transposed ones too)."""
    make, shape, kind = {**NETWORKS_2D, **NETWORKS_3D}[name]
    torch.manual_seed(1)
    model = make().double()
    config: dict = {"default": {"grid": {"N": 4}, "algorithm": "sample"}, "layers": []}
    volume = iter([({"N": 2, "D": 2}, "spatial"), ({"N": 2, "C": 2}, "stationary-x"),
                   ({"D": 2, "F": 2}, "stationary-y"), ({"C": 2, "F": 2}, "stationary-w")] * 20)
    for n, m in model.named_modules():
        if type(m) is nn.Conv2d and m.groups == 1:
            grid, alg = (({"N": 2, "H": 2}, "spatial") if m.kernel_size != (1, 1)
                         else ({"N": 2, "C": 2}, "stationary-x"))
            config["layers"].append({"match": n, "grid": grid, "algorithm": alg})
        elif type(m) in (nn.Conv3d, nn.ConvTranspose3d) and min(m.in_channels,
                                                                 m.out_channels) >= 2:
            grid, alg = next(volume)
            config["layers"].append({"match": n, "grid": grid, "algorithm": alg})
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, *shape, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        out_shape = tuple(copy.deepcopy(model).eval()(x).shape)
    _check((name, 4, model, config, x, _targets(kind, out_shape, gen), kind))


def test_resnet18_mini_is_resnet18s_layout_and_refuses_bad_sizes() -> None:
    model = models.resnet18_mini()
    blocks = [m for m in model.modules() if isinstance(m, models.BasicBlock)]
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(blocks) == 8 and len(convs) == 1 + 16 + 3  # stem, two per block, 3 projections
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="widths must name at least one stage"):
        models.BasicResNet(())
    with pytest.raises(ValueError, match="blocks must be a positive int, got 0"):
        models.BasicResNet((4,), blocks=0)
