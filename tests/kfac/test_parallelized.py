"""K-FAC on a model from ``distconv.parallelize``: exact against single-process K-FAC on the
gathered model, with the user's loop of the training contract (each rank's loss a mean over its
own samples; no gradient allreduce in the loop)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import distkfac
from distconv.data import sample_block
from distconv.parallel import parallelize
from tests.parallel.cases import RESNET_CONFIG, _gathered_grads, resnet_case

KW = dict(factor_dtype=torch.float64, damping=1e-2, kl_clip=1e-2, factor_decay=0.6)


def train(model, x, y, kfac, steps: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        kfac.step()
        opt.step()


def reference(case, steps: int = 2) -> dict:
    """Gradients after ``steps`` of single-process K-FAC on the model of ``case()``."""
    model, x, y = case()
    train(model, x, y, distkfac.KFAC(model, comm=None, **KW), steps)
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def parallel_run(comm, steps: int, layout: str):
    model, x, y = resnet_case()
    pmodel = parallelize(copy.deepcopy(model), RESNET_CONFIG, comm=comm)
    kfac = distkfac.KFAC(pmodel, factor_sharding=layout, **KW)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    train(pmodel, x[rows], y[rows], kfac, steps)
    return _gathered_grads(pmodel), len(kfac.exact_layers), len(kfac.layers)


def test_exact_on_parallelized_resnet_equals_single_process():
    from distconv.testing.threads import run_threads

    want = reference(resnet_case)
    for grads, exact, plain in run_threads(parallel_run, 4, 2, "exact"):
        assert exact > 0 and plain > 0
        for k, g in want.items():
            torch.testing.assert_close(grads[k], g, rtol=1e-9, atol=1e-11, msg=k)



# ---------------------------------------------------------------- replicated layers inside
def _mlp_head():
    from torch import nn

    gen = torch.Generator().manual_seed(4)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 4 * 4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    x = torch.randn(6, 3, 4, 4, generator=gen, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (6,), generator=gen)


def _mlp_run(comm, data, conv_default=False):
    model, x, y = _mlp_head()
    conv = {"grid": {"C": 2} if comm.size == 2 else {"N": comm.size // 2, "C": 2},
            "algorithm": "stationary-x"}
    # with a channel-parallel default the Linear layers run on the data grid
    config = {"default": conv} if conv_default else {"layers": [dict(conv, match="0")]}
    if data:
        config["data"] = data
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    kfac = distkfac.KFAC(pmodel, **KW)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    train(pmodel, x[rows], y[rows], kfac)
    return _gathered_grads(pmodel), [ly.name for ly in kfac.layers]


@pytest.mark.parametrize("size, data, conv_default", [
    (2, None, False), (2, {"N": 1, "C": 2}, False), (2, {"N": 1, "C": 2}, True),
    (4, {"N": 2, "C": 2}, True), (4, None, True)])
def test_replicated_layers_inside_a_parallelized_model_equal_single_process(size, data,
                                                                            conv_default):
    """The Linear '3' feeds another layer, '5' is the head.  On a grid of N only (a sample
    default: {N: P}) each rank holds its samples and their complete output gradients; on the
    data grid with replicas ({N: 1, C: 2}: both ranks hold every sample) the output gradient
    is a pending sum over them, summed at factor steps, and one replica counts the samples."""
    from distconv.testing.threads import run_threads

    want = reference(_mlp_head)
    for grads, names in run_threads(_mlp_run, size, data, conv_default):
        assert names == ["3", "5"]
        for k, g in want.items():
            torch.testing.assert_close(grads[k], g, rtol=1e-9, atol=1e-11, msg=k)


class _LinearIntoConv(torch.nn.Module):
    """A replicated Linear whose output a channel-parallel convolution splits: on replicas its
    output gradient is a pending sum with every part nonzero."""

    def __init__(self) -> None:
        super().__init__()
        from torch import nn

        self.fc = nn.Linear(3 * 4 * 4, 4 * 4 * 4)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        h = torch.tanh(self.fc(x.flatten(1))).view(-1, 4, 4, 4)
        return self.head(torch.tanh(self.conv(h)).flatten(1))


def _into_conv():
    gen = torch.Generator().manual_seed(6)
    model = _LinearIntoConv().double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    x = torch.randn(6, 3, 4, 4, generator=gen, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (6,), generator=gen)


def _into_conv_run(comm):
    model, x, y = _into_conv()
    config = {"default": {"grid": {"C": 2}, "algorithm": "stationary-x"},
              "data": {"N": 1, "C": 2}}
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm, input_shape=x.shape)
    kfac = distkfac.KFAC(pmodel, **KW)
    train(pmodel, x, y, kfac)
    return _gathered_grads(pmodel)


def test_replicated_layer_whose_output_a_channel_parallel_layer_splits():
    """Both ranks hold every sample; the convolution takes its channel block of the Linear's
    replicated output, so each replica's output gradient is the part of its channels: their
    sum (one allreduce at factor steps) gives the single-process G."""
    from distconv.testing.threads import run_threads

    want = reference(_into_conv)
    for grads in run_threads(_into_conv_run, 2):
        for k, g in want.items():
            torch.testing.assert_close(grads[k], g, rtol=1e-9, atol=1e-11, msg=k)



# ---------------------------------------------------------------- 3-D networks
def _volume_case(in_channels: int = 2, base: int = 2):
    from distconv.models import cosmoflow_mini

    torch.manual_seed(2)
    model = cosmoflow_mini(in_channels=in_channels, base=base, size=4, depth=1, hidden=6,
                           batch_norm=False).double()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, in_channels, 4, 4, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (7,), generator=gen)
    return model, x, y


def _volume_run(comm, config, case):
    model, x, y = case  # made once, outside: thread ranks share torch's global generator
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    kfac = distkfac.KFAC(pmodel, **KW)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    train(pmodel, x[rows], y[rows], kfac)
    return _gathered_grads(pmodel), [type(ly.adapter).__name__ for ly in kfac.layers]


@pytest.mark.parametrize("size, config, kind", [
    (2, {"default": {"grid": {"N": 2}, "algorithm": "sample"}}, "ConvNdAdapter"),
    (4, {"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"}}, "ConvNdAdapter"),
    (2, {"default": {"grid": {"N": 1, "D": 2}, "algorithm": "spatial"},
         "data": {"N": 1, "D": 2}}, "SpatialShardAdapter"),
    (4, {"default": {"grid": {"N": 2, "D": 2}, "algorithm": "spatial"}}, "SpatialShardAdapter"),
    (4, {"default": {"grid": {"D": 2, "H": 2}, "algorithm": "spatial"},
         "data": {"N": 1, "D": 2, "H": 2}}, "SpatialShardAdapter"),
])
def test_conv3d_layers_of_a_parallelized_volume_network_equal_single_process(size, config,
                                                                             kind):
    """A CosmoFlow-style network's Conv3d layers sample-parallel inside the parallel model
    (replicated over C on 4 ranks), or split over depth and rows (their factors summed from
    each rank's output block over the ranks of a volume): their K-FAC factors are the global
    batch's, and two steps end with one process's gradients."""
    from distconv.testing.threads import run_threads

    want = reference(_volume_case)
    for grads, kinds in run_threads(_volume_run, size, config, _volume_case()):
        assert kind in kinds, kinds
        for k, g in want.items():
            torch.testing.assert_close(grads[k], g, rtol=1e-9, atol=1e-11, msg=k)


def _unet_case():
    from distconv.models import unet3d

    torch.manual_seed(5)
    model = unet3d(in_channels=1, num_classes=3, base=2, depth=1, norm="none").double()
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 1, 4, 4, 2, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (4, 4, 4, 2), generator=gen)
    return model, x, y


@pytest.mark.parametrize("size, config", [
    (2, {"default": {"grid": {"N": 2}, "algorithm": "sample"}}),
    (4, {"default": {"grid": {"D": 2, "H": 2}, "algorithm": "spatial"},
         "data": {"N": 1, "D": 2, "H": 2}, "layers": [
             {"match": "up.*", "grid": {"N": 4}, "algorithm": "sample"}]}),
])
def test_a_3d_unet_with_transposed_convolutions_equals_single_process(size, config):
    """K-FAC preconditions a U-Net's ConvTranspose3d (the direct convolution it equals) next to
    its Conv3d layers, sample-parallel or split over depth and rows: two steps end with one
    process's gradients."""
    from distconv.testing.threads import run_threads

    want = reference(_unet_case)
    for grads, kinds in run_threads(_volume_run, size, config, _unet_case()):
        assert "ConvTransposeAdapter" in kinds, kinds
        for k, g in want.items():
            torch.testing.assert_close(grads[k], g, rtol=1e-9, atol=1e-11, msg=k)


# ---------------------------------------------------------------- channels-last Linear layers
class _TokenMixer(torch.nn.Module):
    """A conv stem, then channels-last Linear layers: an MLP on ``[N, H, W, C]`` and one on
    ``[N, L, C]`` tokens; the stem's channel split reaches them as a split of their features."""

    def __init__(self) -> None:
        super().__init__()
        from torch import nn

        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 4)
        self.tok = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.stem(x).permute(0, 2, 3, 1)                      # [N, H, W, C]
        h = self.fc2(torch.tanh(self.fc1(h)))
        t = torch.tanh(self.tok(h.flatten(1, 2)))                 # [N, L, C]
        return self.head(t.mean(1))


def _token_mixer():
    gen = torch.Generator().manual_seed(8)
    model = _TokenMixer().double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.4)
    x = torch.randn(4, 3, 4, 4, generator=gen, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (4,), generator=gen)


_SAMPLE = {"grid": {"N": 4}, "algorithm": "sample"}
_STEM = {"match": "stem", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"}
_TOKEN_CONFIGS = {
    # the Linears meet the stem's channel split on their features: stationary-x in place
    "in-place": {"default": _SAMPLE, "layers": [_STEM]},
    # their own entries: features over F, and over C x F
    "stationary-y": {"default": _SAMPLE, "layers": [
        _STEM, {"match": "fc1", "grid": {"N": 2, "F": 2}, "algorithm": "stationary-y"}]},
    "stationary-w": {"default": _SAMPLE, "layers": [
        _STEM, {"match": "fc1", "grid": {"N": 1, "C": 2, "F": 2}, "algorithm": "stationary-w"},
        {"match": "fc2", "grid": {"N": 1, "C": 2, "F": 2}, "algorithm": "stationary-w"}]},
}


def _token_run(comm, config):
    model, x, y = _token_mixer()
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm, input_shape=x.shape)
    kfac = distkfac.KFAC(pmodel, **KW)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    train(pmodel, x[rows], y[rows], kfac)
    split = [n for n, m in pmodel.named_modules() if type(m).__name__ == "DistLinear"]
    return _gathered_grads(pmodel), split, sorted({ly.name for ly in kfac.layers})


@pytest.mark.parametrize("config", sorted(_TOKEN_CONFIGS))
def test_channels_last_linears_split_over_their_features_equal_single_process(config):
    """A Linear on ``[N, H, W, C]`` or ``[N, L, C]`` tokens whose features a channel-parallel
    layer split runs as a DistLinear: K-FAC takes its factors over every feature and every
    position of the global batch, and its preconditioned gradient is one process's."""
    from distconv.testing.threads import run_threads

    want = reference(_token_mixer)
    for grads, split, names in run_threads(_token_run, 4, _TOKEN_CONFIGS[config]):
        assert split, "no Linear runs split over its features: the test would test nothing"
        assert set(split) <= set(names)
        for k, g in want.items():
            torch.testing.assert_close(grads[k], g, rtol=1e-9, atol=1e-11, msg=k)


def _standalone_linear(comm):
    from torch import nn

    from distconv.distribution import Dist
    from distconv.grid import ProcessorGrid
    from distconv.nn.linear import DistLinear

    grid = ProcessorGrid({"N": 1, "C": 2}, comm=comm)
    layer = DistLinear.from_module(nn.Linear(4, 3).double(), grid=grid,
                                   input_dist=Dist(("N", None, "C")))
    model = nn.Sequential(layer)
    with pytest.raises(NotImplementedError, match=r"^build the model with distconv\.paral"):
        distkfac.KFAC(model, **KW)
    # skipped by name, nothing is registered and the model keeps no hook
    kfac = distkfac.KFAC(model, skip_layers=["0"], **KW)
    return len(kfac.layers), len(layer._forward_hooks)


def test_a_distlinear_outside_a_parallelized_model_is_refused_by_name():
    """Without a parallelized model's loss convention (the cotangent dl_i / N of the global
    batch) a DistLinear's G would be scaled by a guess: K-FAC refuses it before any step."""
    from distconv.testing.threads import run_threads

    for registered, hooks in run_threads(_standalone_linear, 2):
        assert (registered, hooks) == (0, 0)


# ---------------------------------------------------------------- windowed attention (Swin)
_WS = 4  # window side: an 8 x 8 map holds 4 windows per sample


class _Windows(torch.nn.Module):
    """Swin's window attention: the channels-last map ``[N, H, W, C]`` is cut into windows
    ``[N * windows, ws * ws, C]`` (the samples merged with the window count, as timm writes
    it), so the Linear layers inside see ``N * windows`` leading rows, not ``N``."""

    def __init__(self) -> None:
        super().__init__()
        from torch import nn

        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.qkv = nn.Linear(4, 12)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        b, c, h, w = x.shape
        t = self.stem(x).permute(0, 2, 3, 1)                              # [N, H, W, C]
        t = t.reshape(b, h // _WS, _WS, w // _WS, _WS, 4).permute(0, 1, 3, 2, 4, 5)
        win = t.reshape(-1, _WS * _WS, 4)                                 # [N * 4, 16, C]
        q, k, v = self.qkv(win).chunk(3, -1)
        o = self.proj(((q @ k.transpose(-2, -1)) * 0.5).softmax(-1) @ v)
        o = o.reshape(b, h // _WS, w // _WS, _WS, _WS, 4).permute(0, 1, 3, 2, 4, 5)
        return self.head(torch.tanh(o.reshape(b, h, w, 4)).mean((1, 2)))


def _windows(batch: int = 4):
    gen = torch.Generator().manual_seed(9)
    model = _Windows().double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    x = torch.randn(batch, 3, 8, 8, generator=gen, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (batch,), generator=gen)


def _windowed_g(model, x, y, name: str) -> torch.Tensor:
    """G of the windowed Linear ``name`` as the convention defines it, written out: the mean
    over every row (sample x window x token) of ``d d^T``, ``d`` the row's gradient of its own
    sample's loss (each sample run alone)."""
    module = dict(model.named_modules())[name]
    rows = []
    for i in range(x.shape[0]):
        out = {}
        handle = module.register_forward_hook(lambda m, inp, o: out.__setitem__("y", o))
        loss = F.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
        handle.remove()
        (gy,) = torch.autograd.grad(loss, [out["y"]])
        rows.append(gy.reshape(-1, gy.shape[-1]))
    d = torch.cat(rows)
    return d.T @ d / d.shape[0]


def _first_factors(model, kfac, x, y) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The factors of one step's batch (the running averages after their first update)."""
    F.cross_entropy(model(x), y).backward()
    kfac.step()
    return {ly.name: (ly.a.value[0].clone(), ly.g.value[0].clone()) for ly in kfac.layers}


def test_one_process_g_of_windowed_linears_is_per_sample_not_per_window():
    """On one process the Linear layers inside the windows see ``N * windows`` leading rows;
    ``d = n dL/dy`` takes ``n`` from the model's batch (the samples the loss averages), so G
    is the per-sample convention's, not ``windows^2`` times it."""
    model, x, y = _windows()
    want = {n: _windowed_g(copy.deepcopy(model), x, y, n) for n in ("qkv", "proj")}
    kfac = distkfac.KFAC(model, comm=None, **KW)
    got = _first_factors(model, kfac, x, y)
    for name, g in want.items():
        torch.testing.assert_close(got[name][1], g, rtol=1e-12, atol=1e-18, msg=name)


def _windows_run(comm, batch):
    model, x, y = _windows(batch)
    config = {"default": {"grid": {"N": comm.size}, "algorithm": "sample"}}
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm, input_shape=x.shape)
    kfac = distkfac.KFAC(pmodel, **KW)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    factors = _first_factors(pmodel, kfac, x[rows], y[rows])
    pmodel.zero_grad()
    train(pmodel, x[rows], y[rows], kfac)
    return factors, _gathered_grads(pmodel)


@pytest.mark.parametrize("batch", [4, 8])
def test_windowed_linears_of_a_sample_parallel_model_equal_single_process(batch):
    """Swin-style window attention sample-parallel on 4 ranks (1 or 2 samples each): the
    windowed Linear layers' factors of one step, and the preconditioned gradients after two
    steps more, are one process's (a one-process G that read ``n`` from the layer's own
    leading dim, samples x windows, was ``windows^2 = 16`` times the parallel one)."""
    from distconv.testing.threads import run_threads

    model, x, y = _windows(batch)
    kfac = distkfac.KFAC(model, comm=None, **KW)
    want = _first_factors(model, kfac, x, y)
    model.zero_grad()
    train(model, x, y, kfac)
    want_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    for factors, grads in run_threads(_windows_run, 4, batch):
        assert set(factors) == set(want) == {"stem", "qkv", "proj", "head"}, sorted(factors)
        for name, (a, g) in want.items():
            torch.testing.assert_close(factors[name][0], a, rtol=1e-12, atol=1e-16, msg=name)
            torch.testing.assert_close(factors[name][1], g, rtol=1e-12, atol=1e-16, msg=name)
        for k, g in want_grads.items():
            torch.testing.assert_close(grads[k], g, rtol=1e-9, atol=1e-11, msg=k)
