"""Channel and filter parallelism for Conv1d, Conv3d and the transposed convolutions
(:class:`distconv.nn.channel_conv.DistChannelConv`): every algorithm equals the module on one
process (fp64), moves exactly what ``explain`` says inside a network, and what is not implemented
is refused naming the layer."""

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
from distconv.grid import ProcessorGrid
from distconv.nn.channel_conv import DistChannelConv
from distconv.parallel import parallelize
from distconv.parallel.explain import explain
from distconv.redistribute import gather
from distconv.testing import run_threads
from tests.parallel.cases import TOL

KINDS = {(1, False): nn.Conv1d, (2, False): nn.Conv2d, (3, False): nn.Conv3d,
         (1, True): nn.ConvTranspose1d, (2, True): nn.ConvTranspose2d,
         (3, True): nn.ConvTranspose3d}


@st.composite
def layers(draw: st.DrawFn) -> tuple:
    dims, transposed = draw(st.sampled_from(sorted(KINDS)))
    algorithm = draw(st.sampled_from(["stationary-x", "stationary-y", "stationary-w"]))
    pc = draw(st.integers(1, 3)) if algorithm != "stationary-y" else 1
    pf = draw(st.integers(1, 4 // pc if algorithm == "stationary-w" else 3)) if (
        algorithm != "stationary-x") else 1
    pn = draw(st.integers(1, max(1, 8 // (pc * pf))))
    grid = draw(st.permutations([("N", pn), ("C", pc), ("F", pf)]))
    cin = draw(st.integers(pc * pf, pc * pf + 3))
    cout = draw(st.integers(pc * pf, pc * pf + 3))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    stride = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    padding = tuple(draw(st.integers(0, 1)) for _ in range(dims))
    kw: dict[str, Any] = {"stride": stride, "padding": padding, "dilation": dilation,
                          "bias": draw(st.booleans())}
    sizes = tuple(draw(st.integers(3, 5)) for _ in range(dims))
    if transposed:  # output_padding < stride or dilation
        kw["output_padding"] = tuple(
            draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation))
    else:
        kw["padding_mode"] = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
        sizes = tuple(max(n, dl * (k - 1) + 1) for n, k, dl in zip(sizes, kernel, dilation))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    module = KINDS[(dims, transposed)](cin, cout, kernel, **kw).double()
    batch = draw(st.integers(pn, pn + 2))
    return module, (batch, cin, *sizes), tuple(grid), algorithm, draw(st.integers(0, 2**16))


def _one_layer(comm: Any, module: nn.Module, shape: tuple, grid: tuple, algorithm: str,
               x: torch.Tensor, g: torch.Tensor) -> dict:
    G = ProcessorGrid(dict(grid), comm=comm)
    layer = DistChannelConv.from_module(module, grid=G, algorithm=algorithm)
    xl = x[layer.input_dist.local_slices(shape, G)].clone().requires_grad_(True)
    y_shape = layer.output_shape(shape)
    y = layer(xl, shape)
    y.backward(g[layer.output_dist.local_slices(y_shape, G)])
    layer.finish_grad_sync()
    out = {"y": gather(y.detach(), layer.output_dist, G, y_shape),
           "dx": gather(xl.grad, layer.input_dist, G, shape),
           "dw": gather(layer.weight.grad, layer.weight_dist, G, layer.weight_shape)}
    if layer.bias is not None:
        out["db"] = gather(layer.bias.grad, layer.bias_dist, G, (layer.out_channels,))
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers())
def test_every_convolution_split_over_channels_and_filters_equals_one_process(case) -> None:  # noqa: ANN001
    module, shape, grid, algorithm, seed = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_(True)
    y = module(x)
    g = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    y.backward(g)
    want = {"y": y.detach(), "dx": x.grad, "dw": module.weight.grad}
    if module.bias is not None:
        want["db"] = module.bias.grad
    size = 1
    for _, e in grid:
        size *= e
    for got in run_threads(_one_layer, size, module, shape, grid, algorithm, x.detach(), g):
        for key, ref in want.items():
            torch.testing.assert_close(got[key], ref, rtol=TOL, atol=TOL)


# ------------------------------------------------------------------ inside a network
#: a 3-D U-Net trained with its encoder sample-parallel, its bottleneck split over channels and
#: filters and its transposed up-convolutions over filters and channels
UNET_CONFIG = {"default": {"grid": {"N": 4}, "algorithm": "sample"}, "layers": [
    {"match": "bottom.0", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"},
    {"match": "bottom.3", "grid": {"C": 2, "F": 2}, "algorithm": "stationary-w"},
    {"match": "up.*", "grid": {"N": 2, "F": 2}, "algorithm": "stationary-y"},
    {"match": "dec.0.0", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"},
]}
UNET_SHAPE = (5, 1, 4, 4, 4)


def _unet() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    model = models.unet3d(in_channels=1, base=2, depth=1).double()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(UNET_SHAPE, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (UNET_SHAPE[0], *UNET_SHAPE[2:]), generator=gen)
    return model, x, y


def unet_run(comm: Any, explained: list | None = None, case: tuple | None = None) -> dict:
    """Thread ranks pass ``case`` (and ``explained``) from outside: they share torch's generator
    and its tracer, so they must not draw a model or trace one at once."""
    from tests.parallel.cases import counted_step

    model, x, y = case if case is not None else _unet()
    ref = copy.deepcopy(model)
    out_ref = ref(x)
    F.cross_entropy(out_ref, y).backward()
    got = counted_step(comm, model, UNET_CONFIG, x, y)
    if explained is None:
        plan = explain(model, UNET_CONFIG, UNET_SHAPE, world_size=comm.size)
        explained = [tuple(plan.rank_bytes(r).values()) for r in range(comm.size)]
    return {"out": (got["out"] - out_ref.detach()[got["rows"]]).abs().max().item(),
            "grads": max((got["grads"][k] - p.grad).abs().max().item()
                         for k, p in ref.named_parameters()),
            "counted": got["counted"], "explained": tuple(explained[comm.rank])}


def _check_unet(results: list[dict]) -> None:
    for r in results:
        assert r["out"] < TOL and r["grads"] < TOL, r
        assert r["counted"] == r["explained"], r


def test_a_3d_unet_split_over_channels_trains_as_one_process_moving_what_explain_says() -> None:
    model = _unet()[0]
    plan = explain(model, UNET_CONFIG, UNET_SHAPE, world_size=4)
    text = str(plan)
    assert "reduce-scatter y over C" in text and "allgather x over F" in text, text
    kinds = {lay.name: lay.algorithm for lay in plan.layers}
    assert kinds["bottom.3"] == "stationary-w" and kinds["up.0"] == "stationary-y", kinds
    _check_unet(run_threads(unet_run, 4, [tuple(plan.rank_bytes(r).values())
                                          for r in range(4)], _unet()))


@pytest.mark.gloo
def test_a_3d_unet_split_over_channels_on_gloo(gloo4) -> None:  # noqa: ANN001
    _check_unet(gloo4.run(unet_run))


@pytest.mark.mpi
def test_a_3d_unet_split_over_channels_on_mpi(mpi4) -> None:  # noqa: ANN001
    _check_unet(mpi4.run(unet_run))


@pytest.mark.parametrize("entry, message", [
    ({"match": "bottom.0", "grid": {"N": 2, "H": 2}, "algorithm": "spatial"},
     r"'bottom.0'.*spatial.*implemented for Conv2d"),
    ({"match": "bottom.0", "grid": {"C": 2, "H": 2}, "algorithm": "stationary-x"},
     r"'bottom.0'.*splits its spatial dims over \['H'\]"),
    ({"match": "bottom.0", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x",
      "pipeline": 2}, r"'bottom.0'.*pipeline: 2.*implemented for Conv2d"),
])
def test_what_is_not_implemented_is_refused_naming_the_layer(entry, message) -> None:  # noqa: ANN001
    config = {"default": {"grid": {"N": 4}, "algorithm": "sample"}, "layers": [entry]}
    with pytest.raises(ValueError, match=message):
        explain(_unet()[0], config, UNET_SHAPE, world_size=4)


def test_a_grouped_3d_convolution_split_over_channels_is_refused() -> None:
    model = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1, groups=2))
    config = {"layers": [{"match": "0", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"}]}
    with pytest.raises(ValueError, match=r"'0'.*grouped \(groups=2\)"):
        explain(model, config, (4, 4, 3, 3, 3), world_size=4)


def _kfac_refusal(comm: Any, case: tuple) -> str:
    import distkfac

    pmodel = parallelize(copy.deepcopy(case[0]), UNET_CONFIG, comm=comm)
    with pytest.raises(NotImplementedError, match=r"'bottom.0'.*skip_layers") as info:
        distkfac.KFAC(pmodel)
    distkfac.KFAC(pmodel, skip_layers=[n for n, m in pmodel.named_modules()
                                       if isinstance(m, DistChannelConv)])
    return str(info.value)


def test_kfac_refuses_a_layer_split_over_channels_it_has_no_factors_for() -> None:
    """Never silently unpreconditioned: K-FAC names the layer and what works."""
    run_threads(_kfac_refusal, 4, _unet())


def _frozen_step(comm: Any, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    from distconv.data import sample_block

    pmodel = parallelize(copy.deepcopy(model), UNET_CONFIG, comm=comm)
    opt = torch.optim.SGD([p for p in pmodel.parameters() if p.requires_grad], lr=0.1)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
    opt.step()
    return {"no grad": [n for n, p in pmodel.named_parameters() if p.grad is None],
            "state": pmodel.gather_state_dict()}


def test_frozen_channel_split_layers_stay_frozen_and_the_rest_trains_as_one_process() -> None:
    """The freeze idiom: ``requires_grad_(False)`` before ``parallelize`` on a layer split over
    channels and one over filters; the step equals one process's, the frozen ones untouched."""
    model, x, y = _unet()
    names = ("bottom.0", "up.0")
    for name in names:
        model.get_submodule(name).requires_grad_(False)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    F.cross_entropy(ref(x), y).backward()
    opt.step()
    frozen = sorted(n for n, p in ref.named_parameters() if p.grad is None)
    assert frozen == sorted(f"{m}.{n}" for m in names
                            for n, _ in model.get_submodule(m).named_parameters())
    for got in run_threads(_frozen_step, 4, model, x, y):
        assert sorted(got["no grad"]) == frozen
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got["state"][k], v, rtol=TOL, atol=TOL, msg=k)
        for k in frozen:
            assert torch.equal(got["state"][k], model.state_dict()[k]), k


def test_bf16_autocast_of_a_channel_split_3d_unet_is_as_one_process() -> None:
    """Under autocast as one process under it (``tests/test_amp.py``'s tolerance: at most 3x one
    process's error against float64, plus one bf16 ulp)."""
    from tests.test_amp import _check, _step, parallel_step

    model, x, y = _unet()
    model, x = model.float(), x.float()
    one = _step(copy.deepcopy(model), x, y, torch.bfloat16)
    exact = _step(copy.deepcopy(model).double(), x.double(), y, None)
    for got in run_threads(parallel_step, 4, model, UNET_CONFIG, x, y, torch.bfloat16):
        _check(got, one, exact, torch.bfloat16)


def test_the_compute_of_a_channel_split_layer_is_priced_by_hand() -> None:
    """Each weight element of the rank's block meets each output position of its samples once,
    two FLOPs each (a transposed layer: each input position); backward twice that."""
    from distconv.perfmodel import Machine

    m = Machine(flop_rate=1e9)
    for module, shape, positions in (
            (nn.Conv3d(4, 6, 3), (4, 4, 5, 5, 5), 3 * 3 * 3),
            (nn.ConvTranspose3d(4, 6, 2, stride=2), (4, 4, 5, 5, 5), 5 * 5 * 5)):
        config = {"layers": [{"match": "0", "grid": {"N": 2, "C": 2},
                              "algorithm": "stationary-x"}]}
        lay = next(la for la in explain(nn.Sequential(module), config, shape, world_size=4,
                                        machine=m).layers if la.name == "0")
        block = module.weight.numel() // 2  # its input channels over C=2
        assert lay.forward_seconds == pytest.approx(2 * 2 * positions * block / 1e9)
        assert lay.backward_seconds == pytest.approx(2 * lay.forward_seconds)
