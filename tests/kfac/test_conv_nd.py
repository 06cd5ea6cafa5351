"""K-FAC of ``DistConvNd`` layers split over channels and filters (stationary-x, -y, -w), with
samples and space, direct and transposed: the factors are sharded like the weight (``'exact'``)
or are the whole layer's (C = F = 1, grouped layers whose blocks hold whole groups), and two
steps end with single-process K-FAC's gradients of the plain module or model (fp64).

Models are made outside ``run_threads``: thread ranks share torch's generator and its tracer."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import distkfac
from distconv.data import sample_block
from distconv.grid import ProcessorGrid
from distconv.nn.conv_nd import DistConvNd
from distconv.parallel import parallelize
from distconv.redistribute import gather
from distconv.testing import run_threads
from distkfac.sharded import ShardAdapter, ShardGeometry
from tests.parallel.cases import _gathered_grads

from .test_parallelized import KW, _unet_case, reference, train
from .test_parallelized import _volume_case as _parallelized_volume_case

RTOL, ATOL = 1e-9, 1e-11  # test_parallelized's
_KFAC = dict(damping=1e-2, kl_clip=1e-2, factor_decay=0.6)


# ---------------------------------------------------------------- one layer
def _layer(conv: nn.Module) -> nn.Module:
    conv = conv.double()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return conv


def _data(step: int, shape: tuple, y_shape: tuple, device: torch.device | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s input and target (drawn on the CPU, the same wherever they go)."""
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(shape, generator=gen, dtype=torch.float64).to(device),
            torch.randn(y_shape, generator=gen, dtype=torch.float64).to(device))


def _loss(y: torch.Tensor, t: torch.Tensor, n: int) -> torch.Tensor:
    return (torch.tanh(y) * t).sum() / n


def _train(layer: nn.Module, kfac: distkfac.KFAC, step_data, steps: int = 2) -> None:
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        _loss(*step_data(step)).backward()
        kfac.step()
        if step < steps - 1:
            opt.step()


def _single(conv: nn.Module, shape: tuple) -> dict[str, torch.Tensor]:
    """Single-process K-FAC's gradients after two steps, on ``conv``'s device."""
    conv = copy.deepcopy(conv)
    device = next(conv.parameters()).device
    y_shape = tuple(conv(torch.zeros(shape, dtype=torch.float64, device=device)).shape)

    def step_data(step: int):
        x, t = _data(step, shape, y_shape, device)
        return conv(x), t, shape[0]

    _train(conv, distkfac.KFAC(conv, comm=None, factor_dtype=torch.float64, **_KFAC), step_data)
    return {k: p.grad for k, p in conv.named_parameters()}


def _sharded(comm, conv: nn.Module, shape: tuple, dims: dict, algorithm: str, layout: str):
    """The split layer's gathered gradients after two steps of sharded K-FAC (on ``conv``'s
    device), its exact layers, and its layers' adapters."""
    grid = ProcessorGrid(dims, comm=comm)
    layer = DistConvNd.from_module(copy.deepcopy(conv), grid=grid, algorithm=algorithm)
    device = layer.weight.device
    y_shape = layer.output_shape(shape)
    # no comm: K-FAC takes the layer's grid's (the factors' all-to-alls run over all its ranks)
    kfac = distkfac.KFAC(layer, factor_dtype=torch.float64, factor_sharding=layout, **_KFAC)

    def step_data(step: int):
        x, t = _data(step, shape, y_shape, device)
        y = layer(x[layer.input_dist.local_slices(shape, grid)], shape)
        return y, t[layer.output_dist.local_slices(y_shape, grid)], shape[0]

    _train(layer, kfac, step_data)
    grads = {"weight": gather(layer.weight.grad, layer.weight_dist, grid, layer.weight_shape)}
    if layer.bias is not None:
        grads["bias"] = gather(layer.bias.grad, layer.bias_dist, grid, (layer.out_channels,))
    return grads, len(kfac.exact_layers), [type(ly.adapter).__name__ for ly in kfac.layers]


LAYERS = [  # (module, global input shape, grid, algorithm, exact layers expected)
    (nn.Conv1d(5, 4, 3, padding=1), (4, 5, 9), {"C": 2, "F": 2}, "stationary-w", 1),
    (nn.Conv1d(5, 4, 3, stride=2), (4, 5, 11), {"C": 2, "W": 2}, "stationary-x", 1),
    (nn.Conv2d(5, 4, 3, padding=1), (3, 5, 6, 5), {"F": 2, "H": 2}, "stationary-y", 1),
    (nn.Conv2d(5, 4, 2, padding="same"), (3, 5, 6, 5), {"C": 3, "W": 2}, "stationary-x", 1),
    (nn.Conv3d(3, 4, 3, padding=1, bias=False), (2, 3, 4, 3, 3), {"N": 2, "C": 2, "F": 2},
     "stationary-w", 1),
    (nn.ConvTranspose1d(3, 8, 3, stride=2, padding=1, output_padding=1), (4, 3, 7),
     {"F": 2, "W": 2}, "stationary-y", 1),
    (nn.ConvTranspose2d(5, 4, 3, stride=2, padding=1), (2, 5, 4, 3), {"C": 2, "F": 2},
     "stationary-w", 1),
    (nn.ConvTranspose3d(3, 4, 2, stride=2), (2, 3, 3, 2, 2), {"C": 3, "D": 2}, "stationary-x",
     1),
    (nn.ConvTranspose3d(3, 2, 3, stride=3, padding=1, dilation=2, output_padding=2),
     (2, 3, 3, 4, 2), {"D": 2, "H": 2}, "stationary-x", 0),
    (nn.Conv3d(4, 8, 3, padding=1, groups=4), (2, 4, 3, 3, 2), {"N": 2, "C": 2},
     "stationary-x", 0),
    (nn.ConvTranspose1d(4, 6, 3, stride=2, groups=2), (3, 4, 5), {"F": 2, "W": 2},
     "stationary-y", 0),
]


@pytest.mark.parametrize("conv, shape, dims, algorithm, exact", LAYERS,
                         ids=[f"{type(c[0]).__name__}-{'x'.join(c[2])}" for c in LAYERS])
def test_a_layer_split_over_channels_filters_and_space_equals_single_process_kfac(
        conv, shape, dims, algorithm, exact, one_torch_thread) -> None:  # noqa: ANN001
    """A DistConvNd's factors sharded like its weight (A over C's blocks of im2col rows, G over
    F's filters; a transposed layer read as the direct convolution it equals, its output block's
    rows from the input rows that scatter into it): two K-FAC steps equal one process's.
    Grouped layers hold whole groups (their factors local, ShardAdapter); uneven blocks, odd
    and even kernels, strides, dilation, output padding."""
    conv = _layer(conv)
    want = _single(conv, shape)
    size = 1
    for e in dims.values():
        size *= e
    for grads, n_exact, kinds in run_threads(_sharded, size, conv, shape, dims, algorithm,
                                             "exact"):
        assert n_exact == exact and (exact or kinds == ["ShardAdapter"]), (n_exact, kinds)
        for k, g in want.items():
            torch.testing.assert_close(grads[k], g, rtol=RTOL, atol=ATOL, msg=k)


# ---------------------------------------------------------------- inside a parallel model
def _split(match: str, grid: dict, algorithm: str, default: dict | None = None) -> dict:
    config = {"default": default or {"grid": {"N": 4}, "algorithm": "sample"},
              "layers": [{"match": match, "grid": grid, "algorithm": algorithm}]}
    if default is not None:
        config["data"] = {"N": 1, **default["grid"]}
    return config


def _volume_case():
    """A CosmoFlow-style network with 3 input channels and 4 filters (one filter per rank of
    a C×F = 4 split's output ``y[o, o_{F×C}, ..]``)."""
    return _parallelized_volume_case(in_channels=3, base=4)


VOLUME = [
    _split("features.0", {"N": 2, "C": 2}, "stationary-x"),
    _split("features.0", {"N": 2, "F": 2}, "stationary-y"),
    _split("features.0", {"C": 2, "F": 2}, "stationary-w"),
    _split("features.0", {"C": 2, "D": 2}, "stationary-x"),
]


@pytest.mark.parametrize("config", VOLUME, ids=["NxC", "NxF", "CxF", "CxD"])
def test_a_cosmoflow_convolution_split_over_channels_or_filters_equals_single_process(
        config, one_torch_thread) -> None:  # noqa: ANN001
    """A CosmoFlow-style network's Conv3d split over C, F or C×F with N or D inside the
    parallel model: its exact factors (A's rows over C, G's over F) are the global batch's."""
    want = reference(_volume_case)
    for grads, n_exact, _ in run_threads(_model_run, 4, config, _volume_case()):
        assert n_exact == 1, n_exact
        for k, g in want.items():
            torch.testing.assert_close(grads[k], g, rtol=RTOL, atol=ATOL, msg=k)


#: the 3-D U-Net's bottleneck over channels (N×C) and channels×filters, its transposed
#: up-convolution over filters (N×F), its first decoder convolution over channels
UNET_CONFIG = {"default": {"grid": {"N": 4}, "algorithm": "sample"}, "layers": [
    {"match": "bottom.0", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"},
    {"match": "bottom.3", "grid": {"C": 2, "F": 2}, "algorithm": "stationary-w"},
    {"match": "up.*", "grid": {"N": 2, "F": 2}, "algorithm": "stationary-y"},
    {"match": "dec.0.0", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"},
]}
#: every layer over D×H (the transposed up-convolution's blocks from the input rows that
#: scatter into them), the bottleneck over channels and depth, the up-convolution over filters
#: and depth
SPATIAL_CONFIG = {"default": {"grid": {"D": 2, "H": 2}, "algorithm": "spatial"},
                  "data": {"N": 1, "D": 2, "H": 2}, "layers": [
                      {"match": "bottom.0", "grid": {"C": 2, "D": 2}, "algorithm": "stationary-x"},
                      {"match": "up.0", "grid": {"F": 2, "D": 2}, "algorithm": "stationary-y"}]}
UP_OVER_SPACE = _split("up.0", {"D": 2, "H": 2}, "spatial")


@pytest.mark.parametrize("config, exact", [(UNET_CONFIG, 4), (SPATIAL_CONFIG, 2),
                                           (UP_OVER_SPACE, 0)],
                         ids=["channels", "space", "up-over-DxH"])
def test_a_3d_unet_split_over_channels_filters_and_space_equals_single_process(
        config, exact, one_torch_thread) -> None:  # noqa: ANN001
    """A 3-D U-Net's Conv3d and ConvTranspose3d layers split over C, F, C×F with N or D, and
    the ConvTranspose3d over D×H (one block: its factors summed over the ranks of a volume)."""
    want = reference(_unet_case)
    for grads, n_exact, kinds in run_threads(_model_run, 4, config, _unet_case()):
        assert n_exact == exact, n_exact
        if not exact:
            assert "ShardAdapter" in kinds, kinds
        for k, g in want.items():
            torch.testing.assert_close(grads[k], g, rtol=RTOL, atol=ATOL, msg=k)


def _model_run(comm, config: dict, case: tuple) -> tuple[dict, int, list[str]]:  # noqa: ANN001
    """Two K-FAC steps of the model of ``case`` parallelized by ``config`` (test_parallelized's
    loop): the gathered gradients, the number of exact layers and the adapters' kinds."""
    model, x, y = case
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    kfac = distkfac.KFAC(pmodel, **KW)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    train(pmodel, x[rows], y[rows], kfac)
    return (_gathered_grads(pmodel), len(kfac.exact_layers),
            [type(ly.adapter).__name__ for ly in kfac.layers])


def _unet_on_world(comm) -> dict:  # noqa: ANN001
    return _model_run(comm, UNET_CONFIG, _unet_case())[0]


@pytest.mark.gloo
def test_a_channel_split_3d_unet_on_gloo_equals_single_process(gloo4) -> None:  # noqa: ANN001
    """The exact factors' all-to-alls and reduce-scatters over gloo (UNET_CONFIG)."""
    want = reference(_unet_case)
    for grads in gloo4.run(_unet_on_world):
        for k, g in want.items():
            torch.testing.assert_close(grads[k], g, rtol=RTOL, atol=ATOL, msg=k)


def test_shard_adapter_reads_a_transposed_shard_as_the_direct_convolution() -> None:
    """The gradient matrix of a transposed shard is the direct convolution's (channel dims
    swapped, kernel flipped), and writing it back is the inverse."""
    conv = _layer(nn.ConvTranspose2d(4, 6, 3, groups=2))
    layer = DistConvNd.from_module(conv, grid=ProcessorGrid({"N": 1}),
                                   algorithm="stationary-x")
    layer.weight.grad = torch.randn_like(layer.weight)
    layer.bias.grad = torch.randn_like(layer.bias)
    ad = ShardAdapter(layer, "up", ShardGeometry(layer))
    mat = ad.grad_matrix(torch.float64)
    w = layer.weight.grad.reshape(2, 2, 3, 3, 3)  # (g, in/g, out/g, kh, kw)
    assert mat.shape == (2, 3, 2 * 9 + 1) == (ad.groups, ad.g_dim, ad.a_dim)
    torch.testing.assert_close(mat[:, :, :-1].reshape(2, 3, 2, 3, 3),
                               w.transpose(1, 2).flip(3, 4), rtol=0, atol=0)
    before = layer.weight.grad.clone()
    ad.set_grad(mat)
    assert torch.equal(layer.weight.grad, before)


# ---------------------------------------------------------------- 'block'
def _block_single(conv: nn.Module, shape: tuple) -> tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
    """One process's factors A, G and raw gradient matrix V (the direct convolution's) of one
    step of ``conv``."""
    conv = copy.deepcopy(conv)
    kfac = distkfac.KFAC(conv, comm=None, factor_dtype=torch.float64, damping=1e-2,
                         kl_clip=None)
    x, t = _data(0, shape, tuple(conv(torch.zeros(shape, dtype=torch.float64)).shape))
    _loss(conv(x), t, shape[0]).backward()
    (layer,) = kfac.layers
    v = layer.adapter.grad_matrix(torch.float64)[0].clone()
    kfac.step()
    return layer.a.value[0], layer.g.value[0], v


def _block_sharded(comm, conv: nn.Module, shape: tuple, dims: dict, algorithm: str):
    grid = ProcessorGrid(dims, comm=comm)
    layer = DistConvNd.from_module(copy.deepcopy(conv), grid=grid, algorithm=algorithm)
    y_shape = layer.output_shape(shape)
    kfac = distkfac.KFAC(layer, comm=comm, factor_dtype=torch.float64, damping=1e-2,
                         kl_clip=None, factor_sharding="block")
    x, t = _data(0, shape, y_shape)
    y = layer(x[layer.input_dist.local_slices(shape, grid)], shape)
    _loss(y, t[layer.output_dist.local_slices(y_shape, grid)], shape[0]).backward()
    kfac.step()
    geo = ShardGeometry(layer)
    return geo.f, geo.c, geo.matrix(layer.weight.grad)[0], layer.bias.grad


@pytest.mark.parametrize("conv, shape, dims, algorithm", [
    (nn.Conv3d(4, 6, 3, padding=1), (2, 4, 3, 3, 2), {"C": 2, "F": 2}, "stationary-w"),
    (nn.ConvTranspose2d(5, 4, 3, stride=2), (2, 5, 3, 2), {"N": 2, "C": 2}, "stationary-x"),
    (nn.ConvTranspose1d(3, 8, 3, stride=2), (3, 3, 5), {"F": 2, "W": 2}, "stationary-y"),
], ids=["Conv3d-CxF", "ConvTranspose2d-NxC", "ConvTranspose1d-FxW"])
def test_block_layout_is_the_block_diagonal_of_single_process_factors(
        conv, shape, dims, algorithm, one_torch_thread) -> None:  # noqa: ANN001
    """``factor_sharding='block'``: each shard ``V[f, c]`` (a transposed one the direct
    convolution's) preconditioned by the diagonal blocks of the global A over its channels'
    im2col rows (with the bias row when C = 1) and of G over its filters; with C > 1 its bias
    shard by G's block over its filters alone (BlockLayout)."""
    from distkfac.sharded import BlockLayout

    from .reference import dense_precondition

    conv = _layer(conv)
    a, g, v = _block_single(conv, shape)
    k2 = math.prod(conv.kernel_size)
    layout = BlockLayout(conv.in_channels, conv.out_channels, k2, True, dims.get("C", 1),
                         dims.get("F", 1))

    def preconditioned(part: str, f: int, c: int) -> torch.Tensor:
        r = layout.ranges(part, f, c)
        (a0, a1), (g0, g1) = r["A"], r["G"]
        return dense_precondition(a[a0:a1, a0:a1][None], g[g0:g1, g0:g1][None],
                                  v[g0:g1, a0:a1][None], 1e-2)[0]

    for f, c, w, b in run_threads(_block_sharded, math.prod(dims.values()), conv, shape, dims,
                                  algorithm):
        want = preconditioned("weight", f, c)
        if layout.C == 1:
            want, want_b = want[:, :-1], want[:, -1]
        else:
            want_b = preconditioned("bias", f, c)[:, 0]
        torch.testing.assert_close(w, want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(b, want_b, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- checkpoints
def _saved(comm, case: tuple, path: str) -> None:
    import distconv

    model, x, y = case
    pmodel = parallelize(copy.deepcopy(model), UNET_CONFIG, comm=comm)
    kfac = distkfac.KFAC(pmodel, **KW)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    train(pmodel, x[rows], y[rows], kfac)
    distconv.save(pmodel, path, states={"kfac": kfac}, comm=comm)


def test_exact_factors_of_a_channel_split_3d_unet_load_onto_one_process(
        tmp_path) -> None:  # noqa: ANN001
    """The exact layers' row blocks (a transposed layer's in the direct convolution's order)
    are blocks of one process's factors: saved on 4 ranks, they load into single-process K-FAC
    on the plain model as that run's factors."""
    import distconv

    path = str(tmp_path / "unet")
    run_threads(_saved, 4, _unet_case(), path)
    model, x, y = _unet_case()
    ref = copy.deepcopy(model)
    ref_kfac = distkfac.KFAC(ref, comm=None, **KW)
    train(ref, x, y, ref_kfac)
    kfac = distkfac.KFAC(model, comm=None, **KW)
    distconv.load(model, path, states={"kfac": kfac})
    assert kfac.steps == 2 and len(kfac.layers) == len(ref_kfac.layers) == 8
    for got, want in zip(kfac.layers, ref_kfac.layers):
        assert got.name == want.name
        torch.testing.assert_close(got.a.value, want.a.value, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got.g.value, want.g.value, rtol=1e-12, atol=1e-14)
