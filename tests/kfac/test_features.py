"""Accumulation, weight sharing, skipped steps, low-precision factor traffic, stale statistics,
the world default and bad input."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distkfac
from distconv.comm import SingleCommunicator
from distconv.comm.base import allreduce_bytes
from distconv.grid import ProcessorGrid
from distconv.nn import DistConv2d
from distconv.testing.threads import run_threads
from distkfac.comm import FactorReducer
from distkfac.lowprec import float21_pack, float21_unpack

F64 = dict(factor_dtype=torch.float64, kl_clip=None, damping=1e-2)


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def data(seed=1, n=6):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 3, generator=g, dtype=torch.float64),
            torch.randint(0, 2, (n,), generator=g))


def factors(kfac):
    return [(ly.a.value.clone(), ly.g.value.clone()) for ly in kfac.layers]


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def assert_all_close(got, want):
    for a, b in zip(got, want):
        if isinstance(a, tuple):
            assert_all_close(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- several passes per step
def test_accumulation_steps_equal_one_batch():
    x, y = data()
    ref = mlp()
    kref = distkfac.KFAC(ref, **F64)
    F.cross_entropy(ref(x), y).backward()
    kref.step()
    model = mlp()
    kfac = distkfac.KFAC(model, accumulation_steps=3, **F64)
    for part in range(3):
        sl = slice(2 * part, 2 * part + 2)
        (F.cross_entropy(model(x[sl]), y[sl]) / 3).backward()
    kfac.step()
    assert_all_close(factors(kfac), factors(kref))
    assert_all_close(grads(model), grads(ref))


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 3).double()

    def forward(self, x):
        return self.layer(torch.tanh(self.layer(x)))


def test_module_called_twice_sums_its_factors():
    model = Twice()
    layer = model.layer
    kfac = distkfac.KFAC(model, **F64)
    x = data(n=4)[0]
    model(x).square().mean().backward()
    kfac.step()
    # explicit: both calls' rows; d = n dL/d(output of the call), n = 4 samples per call
    h = layer(x)
    out = layer(torch.tanh(h))
    gh, gout = torch.autograd.grad(out.square().mean(), [h, out])
    inputs = torch.cat([x, torch.tanh(h.detach())])
    a = torch.cat([inputs, torch.ones(8, 1, dtype=torch.float64)], 1)
    d = torch.cat([gh, gout]) * 4
    torch.testing.assert_close(kfac.layers[0].a.value[0], a.T @ a / 8, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(kfac.layers[0].g.value[0], d.T @ d / 8, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("skipped", ["backward", "forward only"])
def test_a_step_without_kfac_step_is_dropped(skipped):
    x1, y1 = data(1)
    x2, y2 = data(2)
    ref = mlp()
    kref = distkfac.KFAC(ref, **F64)
    F.cross_entropy(ref(x2), y2).backward()
    kref.step()
    model = mlp()
    kfac = distkfac.KFAC(model, **F64)
    out = model(x1)
    if skipped == "backward":
        F.cross_entropy(out, y1).backward()
    model.zero_grad()
    with torch.no_grad():  # evaluation in between
        model(x1)
    F.cross_entropy(model(x2), y2).backward()
    kfac.step()
    assert_all_close(factors(kfac), factors(kref))
    assert_all_close(grads(model), grads(ref))


# ---------------------------------------------------------------- low precision
def test_float21_packing_is_exact_for_representable_values_and_truncates_others():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.logspace(-30, 30, 1000)
    exact = (x.view(torch.int32) & ~0x7FF).view(torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 2.0 ** -130, -1.5])
    for v in (exact, special, exact[:7]):
        assert torch.equal(float21_unpack(float21_pack(v), v.numel()), v)
    assert float21_pack(exact).numel() == math.ceil(1000 / 3)
    back = float21_unpack(float21_pack(x), x.numel())
    assert bool(((back - x).abs() <= x.abs() * 2.0 ** -12).all())
    assert bool((back.abs() <= x.abs()).all())  # truncation toward zero


def _reduce(comm, comm_dtype, rows):
    r = comm.rank
    m = (torch.arange(12, dtype=torch.float32).reshape(1, 3, 4) - 5 + r) / 8  # fp16-exact
    sym = torch.tensor([[[1.0, 0.5], [0.5, 2.0 + r]]])
    red = FactorReducer(comm, comm_dtype=comm_dtype)
    red.expect(["a", "b"])
    comm.stats.reset()
    red.add("a", m * rows[r], rows[r], symmetric=False)
    red.add("b", sym * rows[r], rows[r])
    out = red.finish()
    return out, comm.stats.snapshot()["bytes"]


@pytest.mark.parametrize("comm_dtype", [None, torch.bfloat16, torch.float16, "float21"])
@pytest.mark.parametrize("rows", [[3, 5], [2, 4, 2], [1, 3, 0, 4]])
def test_low_precision_reduction_is_exact_for_representable_means_and_counted(comm_dtype, rows):
    """Means representable in every wire format (also the global means: P >= 3 rounds them
    once more), unequal batches, a rank with no rows; bytes from the formulas of
    distkfac.lowprec's docstring."""
    size = len(rows)
    results = run_threads(_reduce, size, comm_dtype, rows)
    want_a = sum(((torch.arange(12.0).reshape(1, 3, 4) - 5 + r) / 8) * rows[r]
                 for r in range(size))
    want_b = sum(torch.tensor([[[1.0, 0.5], [0.5, 2.0 + r]]]) * rows[r] for r in range(size))
    n, k = 12 + 3, 2  # numbers (b packed) and factors
    for rank, (out, nbytes) in enumerate(results):
        assert torch.equal(out["a"][0], want_a) and torch.equal(out["b"][0], want_b)
        assert out["a"][1] == out["b"][1] == sum(rows)
        if comm_dtype is None:
            want = {"allreduce": allreduce_bytes(n + k, rank, size, 4)}
        elif comm_dtype == torch.bfloat16:
            want = {"allreduce": allreduce_bytes(n, rank, size, 2)
                    + allreduce_bytes(k, rank, size, 8)}
        else:
            def enc(m):
                return 2 * m if comm_dtype == torch.float16 else 8 * math.ceil(m / 3)
            if size == 2:
                want = {"allgather": enc(n) + 8 * k}
            else:  # balanced blocks of the n numbers: reduce-scatter, then allgather
                blocks = [n // size + (j < n % size) for j in range(size)]
                want = {"alltoall": (size - 1) * (enc(blocks[rank]) + 8 * k),
                        "allgather": sum(enc(b) for j, b in enumerate(blocks) if j != rank)}
        assert nbytes == want


def _scatter(comm, comm_dtype, rows):
    from distkfac.lowprec import reduce_scatter

    r = comm.rank
    values = (torch.arange(10, dtype=torch.float32) - 4 + r) / 8 * rows[r]  # means fp16-exact
    blocks = [(0, 4), (4, 0), (4, 6)][: comm.size]
    comm.stats.reset()
    got = reduce_scatter(comm, values, rows[r], blocks, comm_dtype, meta="test")()
    return got, comm.stats.snapshot()["bytes"]


@pytest.mark.parametrize("comm_dtype", [None, torch.bfloat16, torch.float16, "float21"])
def test_low_precision_reduce_scatter_of_row_blocks_is_exact_and_counted(comm_dtype):
    """Uneven blocks (one empty), a rank with no rows; bytes from the docstring of
    distkfac.lowprec.reduce_scatter."""
    rows = [2, 0, 5]
    want = sum((torch.arange(10.0) - 4 + r) / 8 * rows[r] for r in range(3))
    blocks = [(0, 4), (4, 0), (4, 6)]
    for rank, (got, nbytes) in enumerate(run_threads(_scatter, 3, comm_dtype, rows)):
        lo, m = blocks[rank]
        assert torch.equal(got, want[lo: lo + m])
        nbytes = {op: b for op, b in nbytes.items() if b}
        if comm_dtype in (torch.float16, "float21"):
            enc = 2 * m if comm_dtype == torch.float16 else 8 * math.ceil(m / 3)
            assert nbytes == {"alltoall": 2 * (enc + 8)}
        else:
            size = 2 if comm_dtype == torch.bfloat16 else 4
            assert nbytes == ({"reduce_scatter": 2 * m * size} if m else {})


def _exact_factors(comm, comm_dtype):
    grid = ProcessorGrid({"C": 3}, comm=comm)
    gen = torch.Generator().manual_seed(5)
    layer = DistConv2d(6, 4, 3, padding=1, grid=grid, algorithm="stationary-x", init_seed=0)
    kfac = distkfac.KFAC(layer, factor_comm_dtype=comm_dtype)
    x = torch.randn(4, 6, 5, 5, generator=gen)
    comm.stats.reset()
    layer(x[layer.input_dist.local_slices(x.shape, grid)], x.shape).square().sum().backward()
    kfac.step()
    ex = kfac.exact_layers[0]
    return ex.factors["A"], comm.stats.snapshot()["bytes"]


def test_exact_channel_reduction_takes_the_low_precision_wire_format():
    """The reduce-scatter of A's row blocks over C (K = 6 * 9 + 1 = 55 columns, K_c = 19, 18,
    18 rows) travels in the wire format; everything else moves as with fp32."""
    fp32 = run_threads(_exact_factors, 3, None)
    for dtype, rtol in ((torch.bfloat16, 2 ** -7), (torch.float16, 2 ** -10),
                        ("float21", 2 ** -11)):
        for rank, ((a32, b32), (a, b)) in enumerate(zip(fp32, run_threads(_exact_factors, 3,
                                                                           dtype))):
            assert (a - a32).norm() <= rtol * a32.norm()
            n = (19, 18, 18)[rank] * 55
            rows32 = 2 * n * 4  # received: (C - 1) blocks of fp32
            if dtype == torch.bfloat16:
                assert b["reduce_scatter"] == b32["reduce_scatter"] - rows32 // 2
                assert b["alltoall"] == b32["alltoall"]
            else:
                enc = 2 * n if dtype == torch.float16 else 8 * math.ceil(n / 3)
                assert b["reduce_scatter"] == b32["reduce_scatter"] - rows32
                assert b["alltoall"] == b32["alltoall"] + 2 * (enc + 8)


def _check_low_precision_world(results, rows):
    size = len(rows)
    want_a = sum(((torch.arange(12.0).reshape(1, 3, 4) - 5 + r) / 8) * rows[r]
                 for r in range(size))
    for out, _ in results:
        assert torch.equal(out["a"][0], want_a) and out["a"][1] == sum(rows)


@pytest.mark.gloo
def test_gloo4_low_precision_reduction_is_exact(gloo4):
    for dtype in (torch.float16, "float21"):
        _check_low_precision_world(gloo4.run(_reduce, dtype, [1, 3, 0, 4]), [1, 3, 0, 4])


@pytest.mark.mpi
def test_mpi4_low_precision_reduction_is_exact(mpi4):
    for dtype in (torch.float16, "float21"):
        _check_low_precision_world(mpi4.run(_reduce, dtype, [1, 3, 0, 4]), [1, 3, 0, 4])


# ---------------------------------------------------------------- stale statistics
def test_stale_statistics_follow_the_hand_computed_schedule():
    """Same batch for steps 0-7, another from step 8 on; factor_decay 0 so a factor is its
    batch's.  Looks at events 1, 3, 7 find nothing moved (intervals 2, 4, 4 = the cap); the look
    at 11 sees the new batch and decomposes; 12 finds it unchanged: per factor 13 scheduled,
    5 looks, 2 decompositions."""
    model = nn.Linear(3, 2).double()
    kfac = distkfac.KFAC(model, stale_threshold=1e-3, stale_max_interval=4, factor_decay=0.0,
                         **F64)
    decomposed = []
    for step in range(13):
        x, y = data(1 if step < 8 else 2)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        before = kfac.layers[0].a_payload
        kfac.step()
        if kfac.layers[0].a_payload is not before:
            decomposed.append(step)
    assert decomposed == [0, 11]
    assert kfac.stale_counts == {"scheduled": 26, "looked": 10, "skipped": 22}


# ---------------------------------------------------------------- world, grid, bad input
def _default(comm):
    kfac = distkfac.KFAC(nn.Linear(2, 2))
    return kfac.comm is comm, repr(kfac)


@pytest.mark.gloo
def test_default_comm_is_the_launchers_world(gloo2):
    for same, text in gloo2.run(_default):
        assert same and "comm='torch-gloo:2'" in text


def _mismatch(comm):
    grid = ProcessorGrid({"C": 2}, comm=comm)
    layer = DistConv2d(4, 4, 3, grid=grid, algorithm="stationary-x", init_seed=0)
    with pytest.raises(ValueError, match="lives on a grid over"):
        distkfac.KFAC(layer, comm=SingleCommunicator())
    return distkfac.KFAC(layer).comm is comm


def test_grid_and_comm_mismatch_raises_and_default_is_the_grids():
    assert all(run_threads(_mismatch, 2))


@pytest.mark.parametrize("kw, match", [
    (dict(damping=float("nan")), "damping must be a finite number > 0"),
    (dict(damping=float("inf")), "damping must be a finite number > 0"),
    (dict(kl_clip=float("nan")), "kl_clip must be a finite number > 0"),
    (dict(lr=-0.1), "lr must be"),
    (dict(factor_sharding="rows"), "factor_sharding must be one of"),
    (dict(factor_comm_dtype=torch.int8), "factor_comm_dtype must be one of"),
    (dict(accumulation_steps=0), "accumulation_steps must be an int >= 1"),
    (dict(stale_threshold=float("nan")), "stale_threshold must be None or a finite"),
])
def test_bad_settings_raise_naming_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        distkfac.KFAC(mlp(), **kw)


def test_schedule_returning_a_bad_value_raises_at_the_step_that_reads_it():
    model = mlp()
    kfac = distkfac.KFAC(model, damping=lambda step: -1.0)
    x, y = data()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match=r"damping schedule returned -1.0 at step 0; it must"):
        kfac.step()
    with pytest.raises(ValueError, match="factor_update_steps schedule returned 0"):
        distkfac.KFAC(mlp(), factor_update_steps=lambda step: 0)


def test_allreduce_gradients_refuses_wrong_types():
    model = mlp()
    with pytest.raises(TypeError, match="comm must be a distconv Communicator"):
        distkfac.allreduce_gradients(model.parameters(), "world")
    with pytest.raises(TypeError, match="params must be an iterable"):
        distkfac.allreduce_gradients(torch.zeros(3), None)
    with pytest.raises(TypeError, match="params must hold tensors"):
        distkfac.allreduce_gradients([1.0], None)
