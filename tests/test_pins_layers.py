"""Behaviours of the layers' collectives that hold today and that the other tests leave open:
clipping below the threshold, a gradient bucket a rank leaves partly unreached, BatchNorm groups
of uneven sample blocks and a standalone DistLayerNorm. Each expectation is the single-process
computation written out here (or a number worked out by hand), on thread ranks and once on a
real gloo world (:func:`test_layer_pins_on_gloo`)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distconv
from distconv.data import sample_block
from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.nn import DistBatchNorm2d
from distconv.nn.grad_sync import BucketedGradSync
from distconv.nn.groupnorm import DistLayerNorm
from distconv.parallel import parallelize
from distconv.testing import run_threads
from tests.parallel.cases import TOL, _gathered_grads, seeded


# ----------------------------------------------------------------------------- clipping
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


CLIP_CONFIG = {"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"}}


def _clip_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    model = seeded(_Net().double(), gen)
    x = torch.randn(4, 3, 6, 6, generator=gen, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (4,), generator=gen)


def clip_above_the_norm(comm: Any) -> dict[str, Any]:
    """The gathered gradients before and after a clip whose max_norm is far above their norm."""
    model, x, y = _clip_case()
    pmodel = parallelize(copy.deepcopy(model), CLIP_CONFIG, comm=comm)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
    before = _gathered_grads(pmodel)
    total = distconv.clip_grad_norm_(pmodel.parameters(), 1e6)
    return {"total": total.item(), "before": before, "after": _gathered_grads(pmodel)}


def check_clip_above_the_norm(results: list[dict[str, Any]]) -> None:
    model, x, y = _clip_case()
    F.cross_entropy(model(x), y).backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters()}
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in want.values()])).item()
    assert 1e-3 < norm < 1e6  # the threshold is above the norm: nothing to clip
    for got in results:
        assert abs(got["total"] - norm) <= 1e-12 * norm
        for k, g in want.items():
            assert torch.equal(got["after"][k], got["before"][k]), k  # a factor of exactly 1
            assert (got["after"][k] - g).abs().max() < TOL, k


def test_clip_with_max_norm_above_the_total_norm_leaves_the_gradients_as_they_are() -> None:
    check_clip_above_the_norm(run_threads(clip_above_the_norm, 4))


# ----------------------------------------------------------------------------- gradient buckets
#: four parameters of two elements in one bucket: the bucket holds them in reverse order, so
#: parameter i sits at offset 2 * (3 - i) of the flat buffer
BUCKET_PARAMS = 4


def bucket_with_an_unreached_parameter(comm: Any, missing: int) -> list[torch.Tensor | None]:
    """Rank 0's backward never reaches parameter ``missing``; every other rank's reaches all.
    The loss of rank r is Σ_i (i + 1)(r + 1) Σ p_i."""
    params = [nn.Parameter(torch.zeros(2, dtype=torch.float64)) for _ in range(BUCKET_PARAMS)]
    sync = BucketedGradSync(comm, params, bucket_bytes=1 << 20, where="pins")
    assert len(sync.buckets) == 1
    loss = sum((i + 1) * (comm.rank + 1) * p.sum() for i, p in enumerate(params)
               if comm.rank or i != missing)
    loss.backward()
    return [None if p.grad is None else p.grad.clone() for p in params]


def check_bucket(results: list[list[torch.Tensor | None]], missing: int) -> None:
    size = len(results)
    for grads in results:
        for i, g in enumerate(grads):
            # Σ over the ranks that reach p_i of (i + 1)(r + 1)
            ranks = range(1, size) if i == missing else range(size)
            want = torch.full((2,), float(sum((i + 1) * (r + 1) for r in ranks)),
                              dtype=torch.float64)
            assert g is not None and torch.equal(g, want), (missing, i, g, want)


@pytest.mark.parametrize("missing", range(BUCKET_PARAMS), ids=["last", "third", "second", "first"])
def test_a_parameter_one_rank_never_reaches_anywhere_in_its_bucket(missing: int) -> None:
    check_bucket(run_threads(bucket_with_an_unreached_parameter, 3, missing), missing)


# ----------------------------------------------------------------------------- BatchNorm groups
#: 7 samples over 4 sample blocks (2, 2, 2, 1), groups of 2 blocks: samples 0-3 and 4-6
GROUP_ROWS = (slice(0, 4), slice(4, 7))


def _bn_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(7, 3, 4, 5, generator=gen, dtype=torch.float64) * 2 + 1
    cot = torch.randn(7, 3, 4, 5, generator=gen, dtype=torch.float64)
    w = torch.rand(3, generator=gen, dtype=torch.float64) + 0.5
    b = torch.randn(3, generator=gen, dtype=torch.float64)
    return x, cot, w, b


def bn_groups_uneven(comm: Any) -> dict[str, Any]:
    x, cot, w, b = _bn_case()
    grid = ProcessorGrid({"N": 4}, comm=comm)
    bn = DistBatchNorm2d(3, grid=grid, input_dist=Dist.parse("x[o_N,*,*,*]"), statistics=2,
                         dtype=torch.float64)
    bn.load_global_state(weight=w, bias=b)
    rows = sample_block(7, grid)
    xb = x[rows].clone().requires_grad_()
    y = bn(xb, tuple(x.shape))
    (y * cot[rows]).sum().backward()
    state = bn.state_dict()  # settles the running statistics (sample block 0's group's)
    return {"rows": rows, "y": y.detach(), "dx": xb.grad, "dw": bn.weight.grad.clone(),
            "db": bn.bias.grad.clone(), "mean": state["running_mean"],
            "var": state["running_var"]}


def check_bn_groups(results: list[dict[str, Any]]) -> None:
    x, cot, w, b = _bn_case()
    x = x.clone().requires_grad_()
    ws, bs = w.clone().requires_grad_(), b.clone().requires_grad_()
    # batch norm of each group's samples on its own, one process
    y = torch.cat([F.batch_norm(x[g], None, None, ws, bs, True, 0.0, 1e-5) for g in GROUP_ROWS])
    (y * cot).sum().backward()
    first = x.detach()[GROUP_ROWS[0]]
    mean = 0.1 * first.mean((0, 2, 3))
    var = 0.9 + 0.1 * first.var((0, 2, 3), unbiased=True)
    for got in results:
        rows = got["rows"]
        assert (got["y"] - y.detach()[rows]).abs().max() < 1e-12
        assert (got["dx"] - x.grad[rows]).abs().max() < 1e-12
        assert (got["dw"] - ws.grad).abs().max() < 1e-12
        assert (got["db"] - bs.grad).abs().max() < 1e-12
        assert (got["mean"] - mean).abs().max() < 1e-14
        assert (got["var"] - var).abs().max() < 1e-14


def test_batchnorm_groups_of_uneven_sample_blocks_are_per_group_batch_norm() -> None:
    check_bn_groups(run_threads(bn_groups_uneven, 4))


# ----------------------------------------------------------------------------- DistLayerNorm
def _ln_case() -> tuple[nn.LayerNorm, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(12)
    ln = nn.LayerNorm((3, 4, 5)).double()
    with torch.no_grad():
        ln.weight.copy_(torch.randn(3, 4, 5, generator=gen, dtype=torch.float64))
        ln.bias.copy_(torch.randn(3, 4, 5, generator=gen, dtype=torch.float64))
    x = torch.randn(3, 3, 4, 5, generator=gen, dtype=torch.float64)
    return ln, x, torch.randn(3, 3, 4, 5, generator=gen, dtype=torch.float64)


def standalone_layernorm(comm: Any) -> dict[str, Any]:
    """x[o_N,*,o_H,*] on {N: 2, H: 2}: 3 samples over 2 blocks, the 4 rows over 2."""
    ln, x, cot = _ln_case()
    grid = ProcessorGrid({"N": 2, "H": 2}, comm=comm)
    layer = DistLayerNorm.from_module(ln, grid=grid, input_dist=Dist.parse("x[o_N,*,o_H,*]"))
    n, h = grid.coords["N"], grid.coords["H"]
    rows, hs = (slice(0, 2), slice(2, 3))[n], slice(2 * h, 2 * h + 2)
    xb = x[rows, :, hs].clone().requires_grad_()
    y = layer(xb, tuple(x.shape))
    (y * cot[rows, :, hs]).sum().backward()
    return {"rows": rows, "h": hs, "y": y.detach(), "dx": xb.grad,
            "dw": layer.weight.grad.clone(), "db": layer.bias.grad.clone()}


def check_layernorm(results: list[dict[str, Any]]) -> None:
    ln, x, cot = _ln_case()
    x = x.clone().requires_grad_()
    y = ln(x)
    (y * cot).sum().backward()
    for got in results:
        rows, hs = got["rows"], got["h"]
        assert (got["y"] - y.detach()[rows, :, hs]).abs().max() < 1e-12
        assert (got["dx"] - x.grad[rows, :, hs]).abs().max() < 1e-12
        assert (got["dw"] - ln.weight.grad[:, hs]).abs().max() < 1e-12
        assert (got["db"] - ln.bias.grad[:, hs]).abs().max() < 1e-12


def test_standalone_layernorm_weight_and_bias_grads_equal_torch_s() -> None:
    check_layernorm(run_threads(standalone_layernorm, 4))


# ----------------------------------------------------------------------------- a real world
@pytest.mark.gloo
def test_layer_pins_on_gloo(gloo4) -> None:  # noqa: ANN001
    check_clip_above_the_norm(gloo4.run(clip_above_the_norm))
    check_bucket(gloo4.run(bucket_with_an_unreached_parameter, 1), 1)
    check_bn_groups(gloo4.run(bn_groups_uneven))
    check_layernorm(gloo4.run(standalone_layernorm))


# ----------------------------------------------------------------------------- resampling price
def upsample_phases(comm: Any) -> dict[str, Any]:
    """A bilinear upsampling of 7 rows to 12 over {H: 2}: the bytes counted in forward and in
    backward, and the pricing's (forward, backward) of this rank's halo."""
    from distconv.nn.resample import DistUpsample, upsample_halo_bytes

    grid = ProcessorGrid({"H": 2}, comm=comm)
    dist = Dist((None, None, "H", None))
    layer = DistUpsample(grid=grid, input_dist=dist, size=(12, 3), mode="bilinear",
                         align_corners=False)
    x = torch.arange(1 * 2 * 7 * 3, dtype=torch.float64).reshape(1, 2, 7, 3)
    xl = x[dist.local_slices(tuple(x.shape), grid)].clone().requires_grad_()
    before = comm.stats.total_bytes()
    y = layer(xl, tuple(x.shape))
    mid = comm.stats.total_bytes()
    y.backward(torch.ones_like(y))
    after = comm.stats.total_bytes()
    plans = layer.plans(tuple(x.shape))
    assert plans is not None  # in place: a halo exchange
    priced = upsample_halo_bytes(layer._dims, plans[1], xl.shape, grid.coords, 8)
    return {"counted": (mid - before, after - mid),
            "priced": (sum(f for _, f, _ in priced), sum(b for _, _, b in priced))}


def test_an_interpolation_s_halo_is_priced_per_phase_as_counted() -> None:
    results = run_threads(upsample_phases, 2)
    for got in results:
        assert got["priced"] == got["counted"], got
    assert any(f != b for f, b in (got["counted"] for got in results))  # the phases differ
