"""Channel and filter parallelism for Conv1d, Conv3d and the transposed convolutions
(:class:`distconv.nn.conv_nd.DistConvNd`): every algorithm equals the module on one
process (fp64), moves exactly what ``explain`` says inside a network, and what is not implemented
is refused naming the layer."""

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

from distconv import models
from distconv.grid import ProcessorGrid
from distconv.nn.conv_nd import DistConvNd, spatial_roles
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
    rows = spatial_roles(dims)
    # mostly one or two spatial dims split (sometimes none), at most 8 ranks in all
    split = draw(st.lists(st.sampled_from(rows), unique=True, max_size=min(2, dims),
                          min_size=0 if draw(st.integers(0, 4)) == 0 else 1))
    ps = {r: draw(st.integers(2, 3 if len(split) == 1 else 2)) for r in split}
    room = 8 // math.prod(ps.values())
    pc = draw(st.integers(1, min(3, room))) if algorithm != "stationary-y" else 1
    pf = draw(st.integers(1, min(3, room // pc))) if algorithm != "stationary-x" else 1
    pn = draw(st.integers(1, max(1, room // (pc * pf))))
    grid = draw(st.permutations([("N", pn), ("C", pc), ("F", pf), *ps.items()]))
    cin = draw(st.integers(pc * pf, pc * pf + 3))
    cout = draw(st.integers(pc * pf, pc * pf + 3))
    groups = 1
    if draw(st.integers(0, 2)) == 0:  # grouped: the channel blocks hold whole groups
        groups = pc * pf * draw(st.integers(1, 2))
        cin, cout = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    kw: dict[str, Any] = {"stride": stride, "dilation": dilation, "bias": draw(st.booleans()),
                          "groups": groups}
    sizes = tuple(draw(st.integers(3, 7)) for _ in range(dims))
    if transposed:  # output_padding < stride or dilation
        kw["padding"] = tuple(  # the output at least one row
            min(draw(st.integers(0, 2)), ((n - 1) * s + dl * (k - 1)) // 2)
            for n, s, k, dl in zip(sizes, stride, kernel, dilation))
        kw["output_padding"] = tuple(
            draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation))
    else:
        kw["padding_mode"] = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
        same = kw["padding_mode"] == "zeros" and set(stride) == {1} and draw(st.booleans())
        kw["padding"] = "same" if same else tuple(draw(st.integers(0, 2)) for _ in range(dims))
        sizes = tuple(max(n, dl * (k - 1) + 1, 3) for n, k, dl in zip(sizes, kernel, dilation))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    module = KINDS[(dims, transposed)](cin, cout, kernel, **kw).double()
    # every rank at least one input and one output row on each split dim
    out = module(torch.zeros(1, cin, *sizes, dtype=torch.float64)).shape[2:]
    for i, r in enumerate(rows):
        if r in ps and min(sizes[i], out[i]) < ps[r]:
            grid = [(n, e if n != r else 1) for n, e in grid]
    batch = draw(st.integers(pn, pn + 2))
    return module, (batch, cin, *sizes), tuple(grid), algorithm, draw(st.integers(0, 2**16))


def _one_layer(comm: Any, module: nn.Module, shape: tuple, grid: tuple, algorithm: str,
               x: torch.Tensor, g: torch.Tensor) -> dict:
    G = ProcessorGrid(dict(grid), comm=comm)
    layer = DistConvNd.from_module(module, grid=G, algorithm=algorithm)
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
def test_every_convolution_split_over_channels_filters_and_space_equals_one_process(case) -> None:  # noqa: ANN001
    _equals_one_process(case)


def test_a_transposed_block_no_input_row_reaches_is_zeros_and_bias() -> None:
    """Stride 3 > kernel 1 with padding 2: rank 1's output row 2 receives from no input row (its
    local convolution's rows all lie past it); it is the bias alone, as on one process."""
    torch.manual_seed(0)
    module = nn.ConvTranspose2d(1, 2, 1, stride=(3, 1), padding=(2, 0)).double()
    _equals_one_process((module, (1, 1, 3, 3), (("N", 1), ("H", 2)), "stationary-x", 0))


def _equals_one_process(case: tuple) -> None:
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


def unet_run(comm: Any, explained: list | None = None, case: tuple | None = None,
             config: dict | None = None) -> dict:
    """One step of the U-Net of ``case`` under ``config`` (default: ``UNET_CONFIG``) against one
    process, and the bytes counted and explained. Thread ranks pass ``case`` (and
    ``explained``) from outside: they share torch's generator and its tracer, so they must not
    draw a model or trace one at once."""
    from tests.parallel.cases import counted_step

    model, x, y = case if case is not None else _unet()
    config = config or UNET_CONFIG
    ref = copy.deepcopy(model)
    out_ref = ref(x)
    F.cross_entropy(out_ref, y).backward()
    got = counted_step(comm, model, config, x, y)
    if explained is None:
        plan = explain(model, config, tuple(x.shape), world_size=comm.size)
        explained = [tuple(plan.rank_bytes(r).values()) for r in range(comm.size)]
    return {"out": (got["out"] - out_ref.detach()[got["rows"]]).abs().max().item(),
            "grads": max((got["grads"][k] - p.grad).abs().max().item()
                         for k, p in ref.named_parameters()),
            "counted": got["counted"], "explained": tuple(explained[comm.rank])}


def _check_unet(results: list[dict]) -> None:
    for r in results:
        assert r["out"] < TOL and r["grads"] < TOL, r
        assert r["counted"] == r["explained"], r


#: the 3-D U-Net spatially parallel over D×H (each rank a quarter of every volume), its
#: bottleneck over channels and depth, its up-convolution over filters and depth
SPATIAL_CONFIG = {"default": {"grid": {"D": 2, "H": 2}, "algorithm": "spatial"},
                  "data": {"N": 1, "D": 2, "H": 2}, "layers": [
                      {"match": "bottom.0", "grid": {"C": 2, "D": 2}, "algorithm": "stationary-x"},
                      {"match": "up.0", "grid": {"F": 2, "D": 2}, "algorithm": "stationary-y"}]}
SPATIAL_SHAPE = (3, 1, 8, 6, 4)


def _spatial_unet() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(5)
    model = models.unet3d(in_channels=1, base=2, depth=1, norm="batch").double()
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(SPATIAL_SHAPE, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (SPATIAL_SHAPE[0], *SPATIAL_SHAPE[2:]), generator=gen)
    return model, x, y


def spatial_unet_run(comm: Any, explained: list | None = None, case: tuple | None = None
                     ) -> dict:
    return unet_run(comm, explained, case if case is not None else _spatial_unet(),
                    SPATIAL_CONFIG)


def both_unets(comm: Any) -> list[dict]:
    return [unet_run(comm), spatial_unet_run(comm)]


def test_a_3d_unet_split_over_channels_trains_as_one_process_moving_what_explain_says() -> None:
    model = _unet()[0]
    plan = explain(model, UNET_CONFIG, UNET_SHAPE, world_size=4)
    text = str(plan)
    assert "reduce-scatter y over C" in text and "allgather x over F" in text, text
    kinds = {lay.name: lay.algorithm for lay in plan.layers}
    assert kinds["bottom.3"] == "stationary-w" and kinds["up.0"] == "stationary-y", kinds
    _check_unet(run_threads(unet_run, 4, [tuple(plan.rank_bytes(r).values())
                                          for r in range(4)], _unet()))


def test_a_3d_unet_split_over_depth_and_rows_trains_as_one_process_moving_what_explain_says(
        ) -> None:
    """Halos over D and H (6 rows over 2: 3 pooled rows, blocks of 2 and 1), the
    bottleneck over channels and depth, the up-convolution over filters and depth."""
    model = _spatial_unet()[0]
    plan = explain(model, SPATIAL_CONFIG, SPATIAL_SHAPE, world_size=4)
    text = str(plan)
    for what in ("halo exchange D", "halo exchange H", "halo accumulate D",
                 "reduce-scatter y over C", "allgather x over F"):
        assert what in text, what
    dists = {lay.name: lay.dists.get("x") for lay in plan.layers}
    assert dists["down.0.0"] == "x[*,*,o_D,o_H,*]", dists
    _check_unet(run_threads(spatial_unet_run, 4, [tuple(plan.rank_bytes(r).values())
                                                  for r in range(4)], _spatial_unet()))


@pytest.mark.gloo
def test_3d_unets_split_over_channels_and_space_on_gloo(gloo4) -> None:  # noqa: ANN001
    for results in zip(*gloo4.run(both_unets)):
        _check_unet(list(results))


@pytest.mark.mpi
def test_3d_unets_split_over_channels_and_space_on_mpi(mpi4) -> None:  # noqa: ANN001
    for results in zip(*mpi4.run(both_unets)):
        _check_unet(list(results))


@pytest.mark.parametrize("model, shape, entry, message", [
    (nn.Sequential(nn.Conv3d(2, 2, 3)), (2, 2, 5, 5, 5),
     {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x", "pipeline": 2},
     r"'0'.*pipeline: 2.*implemented for Conv2d"),
    (nn.Sequential(nn.Conv2d(2, 2, 3)), (2, 2, 5, 5), {"grid": {"N": 2, "D": 2},
                                                       "algorithm": "spatial"},
     r"'0'.*splits D.*Conv2d's spatial dims are H and W"),
    (nn.Sequential(nn.Conv1d(2, 2, 3)), (2, 2, 9), {"grid": {"N": 2, "H": 2},
                                                    "algorithm": "spatial"},
     r"'0'.*splits \['H'\].*1 spatial dim\(s\), split over grid dims \['W'\]"),
    (nn.Sequential(nn.ConvTranspose3d(2, 2, 2, stride=2)), (2, 2, 2, 3, 3),
     {"grid": {"D": 4}, "algorithm": "spatial"}, r"D=4 exceeds what this layer can split"),
    (nn.Sequential(nn.Conv3d(2, 2, 3)), (2, 2, 3, 5, 5),
     {"grid": {"D": 2, "N": 2}, "algorithm": "spatial"}, r"D=2 exceeds.*use D <= 1"),
])
def test_what_is_not_implemented_is_refused_naming_the_layer(model, shape, entry,  # noqa: ANN001
                                                              message) -> None:  # noqa: ANN001
    config = {"layers": [{"match": "0", **entry}]}
    with pytest.raises(ValueError, match=message):
        explain(model, config, shape, world_size=4)


def test_a_grouped_3d_convolution_whose_blocks_split_groups_is_refused() -> None:
    model = nn.Sequential(nn.Conv3d(6, 6, 3, padding=1, groups=3))
    config = {"layers": [{"match": "0", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"}]}
    with pytest.raises(ValueError, match=r"'0'.*grouped \(groups=3\).*not hold whole groups"):
        explain(model, config, (4, 6, 3, 3, 3), world_size=4)


def _kfac_layers(comm: Any, case: tuple) -> tuple[list[str], list[str], dict]:
    import distkfac

    pmodel = parallelize(copy.deepcopy(case[0]), UNET_CONFIG, comm=comm)
    kfac = distkfac.KFAC(pmodel)
    return ([ly.name for ly in kfac.exact_layers], [ly.name for ly in kfac.layers],
            kfac.skipped)


def test_kfac_preconditions_every_layer_split_over_channels_and_filters() -> None:
    """Never silently unpreconditioned: the layers split over C, F or C×F (the transposed
    up-convolution's over F included) get K-FAC factors sharded like their weights
    (``'exact'``; exactness in tests/kfac/test_conv_nd.py), the others the whole layer's."""
    for exact, plain, skipped in run_threads(_kfac_layers, 4, _unet()):
        assert exact == ["bottom.0", "bottom.3", "up.0", "dec.0.0"], exact
        assert plain == ["down.0.0", "down.0.3", "dec.0.3", "head"] and not skipped, plain


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


def test_bf16_autocast_of_a_spatially_split_3d_unet_is_as_one_process() -> None:
    """GroupNorm and the halo convolutions of a U-Net over D×H under bf16 autocast, as one
    process under it (``tests/test_amp.py``'s tolerance)."""
    from tests.test_amp import _check, _step, parallel_step

    torch.manual_seed(7)
    model = models.unet3d(in_channels=1, base=2, depth=1).float()  # GroupNorm
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(SPATIAL_SHAPE, generator=gen)
    y = torch.randint(0, 2, (SPATIAL_SHAPE[0], *SPATIAL_SHAPE[2:]), generator=gen)
    one = _step(copy.deepcopy(model), x, y, torch.bfloat16)
    exact = _step(copy.deepcopy(model).double(), x.double(), y, None)
    for got in run_threads(parallel_step, 4, model, SPATIAL_CONFIG, x, y, torch.bfloat16):
        _check(got, one, exact, torch.bfloat16)


def _kept_for_backward(comm: Any, conv: nn.Module, shape: tuple, grid: dict) -> dict:
    """The bytes autograd keeps for backward on this rank in one forward of the layer split over
    ``grid`` (a Conv2d: :class:`DistConv2d`): in the input block's own storage, and in every
    other storage (parameters aside)."""
    from distconv.nn import DistConv2d

    G = ProcessorGrid(grid, comm=comm)
    layer = (DistConv2d.from_conv2d(conv, grid=G, algorithm="stationary-x")
             if type(conv) is nn.Conv2d else
             DistConvNd.from_module(conv, grid=G, algorithm="stationary-x"))
    block = torch.randn(layer.input_dist.local_shape(shape, G), dtype=torch.float64,
                        requires_grad=True)
    kept: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            kept[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(block, shape)
    y.sum().backward()
    own = kept.pop(block.untyped_storage().data_ptr(), 0)
    return {"own": own, "other": sum(kept.values()), "block": block.numel() * 8,
            "row": block[:, :, :1].numel() * 8}


@pytest.mark.parametrize("conv, shape, grid, rows", [
    (nn.Conv3d(2, 3, 3, padding=1), (2, 2, 8, 5, 4), {"D": 2}, (2, 2)),
    (nn.Conv2d(2, 3, 3, padding=1), (2, 2, 8, 5), {"H": 2}, (2, 2)),
    # output rows 0-7 of 15 read input rows 0-4, rows 8-14 read rows 4-7
    (nn.ConvTranspose1d(2, 3, 3, stride=2, padding=1), (2, 2, 8), {"W": 2}, (1, 0)),
], ids=["Conv3d-D", "Conv2d-H", "ConvTranspose1d-W"])
def test_a_spatially_split_convolution_keeps_its_block_and_its_halo_rows_not_a_copy(
        conv: nn.Module, shape: tuple, grid: dict, rows: tuple) -> None:
    """One process's convolution keeps its input for backward, which the layer before keeps
    anyway; split over a spatial dim, a rank keeps its input block (the same storage) and the
    rows around it (a 3-wide kernel: a halo row received and a padding row) -- not a haloed copy
    of its block."""
    conv = conv.double()
    for rank, got in enumerate(run_threads(_kept_for_backward, 2, conv, shape, grid)):
        assert got["own"] == got["block"] and got["other"] == rows[rank] * got["row"], got


def _trained_then_saved(comm: Any, case: tuple, config: dict, path: str) -> None:
    import distconv
    from distconv.data import sample_block

    model, x, y = case
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
    opt.step()
    distconv.save(pmodel, path, optimizer=opt, comm=comm)


def _resumed(comm: Any, model: nn.Module, config: dict, path: str) -> dict:
    import distconv

    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    distconv.load(pmodel, path, optimizer=opt)
    return pmodel.gather_state_dict()


def test_a_spatially_split_3d_unet_checkpoint_resumes_on_another_layout(tmp_path) -> None:  # noqa: ANN001
    """Saved after a step over D×H on 4 ranks (its bottleneck over channels), loaded on 2
    ranks split over channels only, and consolidated on one process: the state is one
    process's after the same step."""
    import distconv

    case = _spatial_unet()
    model, x, y = case
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    F.cross_entropy(ref(x), y).backward()
    opt.step()
    path = str(tmp_path / "unet")
    run_threads(_trained_then_saved, 4, case, SPATIAL_CONFIG, path)
    other = {"default": {"grid": {"N": 2}, "algorithm": "sample"}, "layers": [
        {"match": "dec.*", "grid": {"C": 2}, "algorithm": "stationary-x"}]}
    for got in run_threads(_resumed, 2, model, other, path):
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=TOL, atol=TOL, msg=k)
    plain = distconv.consolidate(path)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(plain[k], v, rtol=TOL, atol=TOL, msg=k)


def test_an_auto_entry_for_a_3d_convolution_is_planned_and_trains_as_one_process() -> None:
    """``auto`` for a Conv3d and a ConvTranspose3d, resolved by the planner into exact entries
    (the rest of the config kept), trains one step as one process moving what explain says
    (two samples on four ranks: the layers split more than samples; two ranks hold none)."""
    from distconv.planner import plan_network
    from tests.parallel.cases import counted_step

    torch.manual_seed(9)
    model = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(),
                          nn.ConvTranspose3d(4, 2, 2, stride=2)).double()
    shape = (2, 2, 8, 8, 8)
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (2, 16, 16, 16), generator=gen)
    config = {"layers": [{"match": "*", "algorithm": "auto"}]}
    planned = plan_network(model, shape, world_size=4, machine="lassen", config=config).config()
    assert [e["match"] for e in planned["layers"]] == ["0", "2", "*"], planned
    assert all(e["algorithm"] != "auto" for e in planned["layers"]), planned
    assert any(set(e["grid"]) - {"N"} for e in planned["layers"]), planned
    ex = explain(model, planned, shape, world_size=4)
    ref = copy.deepcopy(model)
    out_ref = ref(x)
    F.cross_entropy(out_ref, y).backward()

    def step(comm: Any) -> dict:
        got = counted_step(comm, model, planned, x, y)
        assert got["counted"] == tuple(ex.rank_bytes(comm.rank).values())
        return {"out": got["out"] - out_ref.detach()[got["rows"]], "grads": got["grads"]}

    for r in run_threads(step, 4):
        assert r["out"].numel() == 0 or r["out"].abs().max().item() < TOL
        for k, p in ref.named_parameters():
            assert (r["grads"][k] - p.grad).abs().max().item() < TOL, k


def _no_decay_names(comm: Any, model: nn.Module, config: dict) -> list[str]:
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    norms = [(name, m) for name, m in pmodel.named_modules()
             if isinstance(m, (nn.GroupNorm, nn.InstanceNorm3d, nn.LayerNorm))]
    assert any(type(m).__name__.startswith("Dist") for _, m in norms), norms
    return sorted(n for name, m in norms for n, _ in m.named_parameters(prefix=name))


@pytest.mark.parametrize("norm", ["group", "instance"])
def test_the_norm_idioms_find_the_split_norms(norm: str) -> None:
    """``isinstance(m, (nn.GroupNorm, nn.InstanceNorm3d, nn.LayerNorm))`` (the tutorial's
    parameter group without weight decay) finds the same parameters in the model split over
    D×H as in the plain model: each distributed norm is an instance of its torch class."""
    torch.manual_seed(9)
    model = models.unet3d(in_channels=1, base=2, depth=1, norm=norm).double()
    want = sorted(n for name, m in model.named_modules()
                  if isinstance(m, (nn.GroupNorm, nn.InstanceNorm3d, nn.LayerNorm))
                  for n, _ in m.named_parameters(prefix=name))
    assert want
    for got in run_threads(_no_decay_names, 4, model, SPATIAL_CONFIG):
        assert got == want


#: two channels over C×F = 4 parts: half the ranks hold no channel of the pooled values
EMPTY_BLOCK_CONFIG = {"default": {"grid": {"N": 4}, "algorithm": "sample"}, "layers": [
    {"match": "features.0", "grid": {"C": 2, "F": 2}, "algorithm": "stationary-w"}]}


def test_pooling_a_rank_s_empty_channel_block_trains_as_one_process() -> None:
    """torch's max and average pooling refuse an input without channels; a rank whose channel
    block is empty pools nothing and the step equals one process."""
    torch.manual_seed(7)
    model = models.cosmoflow_mini(in_channels=2, base=2).double()
    gen = torch.Generator().manual_seed(8)
    x = torch.randn((4, 2, 8, 8, 8), generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (4,), generator=gen)
    plan = explain(model, EMPTY_BLOCK_CONFIG, tuple(x.shape), world_size=4)
    explained = [tuple(plan.rank_bytes(r).values()) for r in range(4)]
    _check_unet(run_threads(unet_run, 4, explained, (model, x, y), EMPTY_BLOCK_CONFIG))
