"""K-FAC of DistConv2d layers: ``'exact'`` equals single-process K-FAC on the gathered layer,
``'block'`` equals a dense block-diagonal reference, and the traffic equals the documented
formulas.

Loop under test (the contract of parallelized models): each rank's loss is the sum of its
samples' losses over the global batch N; DistConv2d completes the weight gradients itself.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import distkfac
from distconv.grid import ProcessorGrid
from distconv.nn import DistConv2d
from distconv.testing.threads import run_threads

from .reference import dense_precondition, reference_factors

SHAPE = (4, 5, 6, 5)  # global input (N, C, H, W): uneven channel blocks on 2 and 3 ranks


def global_data(step: int, y_shape, shape=SHAPE):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    return x, torch.randn(y_shape, generator=g, dtype=torch.float64)


def make_conv(conv_kw: dict, fo: int = 5, ci: int = SHAPE[1]) -> nn.Conv2d:
    """The same layer on every thread rank (a generator of its own, not torch's global one)."""
    conv = nn.Conv2d(ci, fo, **conv_kw).double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return conv


def loss_of(y: torch.Tensor, t: torch.Tensor, n: int) -> torch.Tensor:
    return (torch.tanh(y) * t).sum() / n


def sharded_run(comm, grid_dims, algorithm, conv_kw, kfac_kw, steps, shape=SHAPE, fo=5):
    grid = ProcessorGrid(grid_dims, comm=comm)
    conv = make_conv(conv_kw, fo, shape[1])
    layer = DistConv2d.from_conv2d(conv, grid=grid, algorithm=algorithm)
    kfac = distkfac.KFAC(layer, factor_dtype=torch.float64, **kfac_kw)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for step in range(steps):
        y_shape = layer.output_shape(shape)
        x, t = global_data(step, y_shape, shape)
        opt.zero_grad()
        y = layer(x[layer.input_dist.local_slices(shape, grid)], shape)
        loss_of(y, t[layer.output_dist.local_slices(y_shape, grid)], shape[0]).backward()
        comm.stats.reset()
        kfac.step()
        traffic = comm.stats.snapshot()
        if step < steps - 1:
            opt.step()
    w_idx = layer.weight_dist.local_slices(layer.weight_shape, grid)
    b_idx = layer.bias_dist.local_slices((layer.out_channels,), grid)
    return (w_idx, b_idx, layer.weight.grad.clone(),
            None if layer.bias is None else layer.bias.grad.clone(), traffic, kfac)


def single_run(conv_kw, kfac_kw, steps, shape=SHAPE, fo=5):
    conv = make_conv(conv_kw, fo, shape[1])
    kfac = distkfac.KFAC(conv, factor_dtype=torch.float64, comm=None, **kfac_kw)
    opt = torch.optim.SGD(conv.parameters(), lr=0.1)
    for step in range(steps):
        x, t = global_data(step, conv(torch.zeros(shape, dtype=torch.float64)).shape, shape)
        opt.zero_grad()
        loss_of(conv(x), t, shape[0]).backward()
        kfac.step()
        if step < steps - 1:
            opt.step()
    return conv


def assert_exact(results, ref):
    for w_idx, b_idx, wg, bg, *_ in results:
        torch.testing.assert_close(wg, ref.weight.grad[w_idx], rtol=1e-10, atol=1e-12)
        if bg is not None:
            torch.testing.assert_close(bg, ref.bias.grad[b_idx], rtol=1e-10, atol=1e-12)


EXACT_CASES = [
    ({"N": 2, "C": 2}, "stationary-x", dict(kernel_size=3, padding=1)),
    ({"C": 3}, "stationary-x", dict(kernel_size=(2, 3), stride=(1, 2), bias=False)),
    ({"F": 3}, "stationary-y", dict(kernel_size=3, padding=1)),
    ({"N": 2, "F": 2}, "stationary-y", dict(kernel_size=1)),
    ({"C": 2, "F": 2}, "stationary-w", dict(kernel_size=3, padding=1)),
    ({"H": 2, "C": 2}, "stationary-x", dict(kernel_size=3, padding=1, dilation=(1, 2))),
    ({"N": 2, "W": 2}, "stationary-x", dict(kernel_size=3, padding=1)),
    ({"N": 3}, "stationary-x", dict(kernel_size=3, padding=1, padding_mode="reflect")),
]


@pytest.mark.parametrize("grid_dims, algorithm, conv_kw", EXACT_CASES)
def test_exact_equals_single_process_kfac_on_gathered_layer(grid_dims, algorithm, conv_kw):
    kw = dict(kl_clip=1e-2, damping=1e-2, factor_decay=0.7)
    ref = single_run(conv_kw, kw, steps=2)
    size = 1
    for e in grid_dims.values():
        size *= e
    assert_exact(run_threads(sharded_run, size, grid_dims, algorithm, conv_kw, kw, 2), ref)


GROUPED_SHAPE = (4, 4, 5, 6)


@pytest.mark.parametrize("layout", ["exact", "block"])
@pytest.mark.parametrize("grid_dims, algorithm, groups", [
    ({"C": 2}, "stationary-x", 2), ({"N": 2, "C": 2}, "stationary-x", 4),
    ({"F": 2}, "stationary-y", 4), ({"H": 2, "C": 2}, "stationary-x", 2),
    ({"C": 2, "F": 2}, "stationary-w", 4),
])
def test_grouped_layers_split_over_groups_equal_single_process(grid_dims, algorithm, groups,
                                                              layout):
    """A grouped layer's K-FAC is block-diagonal by group; split over C or F each rank holds
    whole groups, so in either layout its factors are its groups' and the result is exact
    (depthwise included: groups = 4 channels; stationary-w: one group a rank)."""
    conv_kw = dict(kernel_size=3, padding=1, groups=groups)
    kw = dict(kl_clip=1e-2, damping=1e-2, factor_decay=0.7)
    ref = single_run(conv_kw, kw, 2, GROUPED_SHAPE, fo=8)
    results = run_threads(sharded_run, _size(grid_dims), grid_dims, algorithm, conv_kw,
                          dict(kw, factor_sharding=layout), 2, GROUPED_SHAPE, 8)
    assert_exact(results, ref)
    for *_, kfac in results:
        (layer,) = kfac.layers
        blocks = grid_dims.get("C", 1) * grid_dims.get("F", 1)
        assert layer.a.value.shape[0] == groups // blocks and not kfac.exact_layers


# ---------------------------------------------------------------- 'block'
def block_reference(conv_kw, grid_dims, algorithm, damping):
    """Per rank: the dense block-diagonal preconditioning of its shards, from explicit
    per-sample factors of the gathered layer (blocks per the layout's definition)."""
    conv = make_conv(conv_kw)
    x, t = global_data(0, conv(torch.zeros(SHAPE, dtype=torch.float64)).shape)
    A, G = reference_factors(conv, x, t, lambda out, tt: (torch.tanh(out) * tt).sum())[conv]
    A, G = A[0], G[0]
    conv.zero_grad()
    loss_of(conv(x), t, SHAPE[0]).backward()
    return conv, A, G


def block_shards(conv, A, G, w_idx, b_idx, c_blocks, damping):
    fo = conv.out_channels
    f_sl, c_sl = w_idx[0], w_idx[1]
    k2 = conv.kernel_size[0] * conv.kernel_size[1]
    cols = torch.arange(A.shape[0] - (conv.bias is not None)).reshape(-1, k2)[c_sl].reshape(-1)
    rows = torch.arange(fo)[f_sl]
    v = conv.weight.grad[w_idx].reshape(len(rows), -1)
    bias_in_a = conv.bias is not None and c_blocks == 1
    if bias_in_a:
        cols = torch.cat([cols, torch.tensor([A.shape[0] - 1])])
        v = torch.cat([v, conv.bias.grad[rows][:, None]], 1)
    vw = dense_precondition(A[cols][:, cols][None], G[rows][:, rows][None], v[None], damping)[0]
    out_b = None
    if bias_in_a:
        vw, out_b = vw[:, :-1], vw[:, -1]
    elif conv.bias is not None:
        s = torch.arange(fo)[b_idx[0]]
        gb = conv.bias.grad[s][None, :, None]
        out_b = dense_precondition(torch.ones(1, 1, 1, dtype=A.dtype), G[s][:, s][None], gb,
                                   damping)[0, :, 0]
    return vw.reshape(conv.weight.grad[w_idx].shape), out_b


@pytest.mark.parametrize("grid_dims, algorithm, conv_kw", [
    ({"N": 2, "C": 2}, "stationary-x", dict(kernel_size=3, padding=1)),
    ({"C": 2, "F": 2}, "stationary-w", dict(kernel_size=(2, 3), padding=1)),
    ({"F": 3}, "stationary-y", dict(kernel_size=3, padding=1)),
])
def test_block_equals_dense_block_diagonal_reference(grid_dims, algorithm, conv_kw):
    damping = 1e-2
    kw = dict(kl_clip=None, damping=damping, factor_sharding="block")
    conv, A, G = block_reference(conv_kw, grid_dims, algorithm, damping)
    size = 1
    for e in grid_dims.values():
        size *= e
    c_blocks = grid_dims.get("C", 1)
    results = run_threads(sharded_run, size, grid_dims, algorithm, conv_kw, kw, 1)
    for w_idx, b_idx, wg, bg, traffic, kfac in results:
        want_w, want_b = block_shards(conv, A, G, w_idx, b_idx, c_blocks, damping)
        torch.testing.assert_close(wg, want_w, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(bg, want_b, rtol=1e-10, atol=1e-12)
        if "N" not in grid_dims:  # nothing but the N/H/W reductions moves, and here none
            assert traffic["bytes"] == {} or sum(traffic["bytes"].values()) == 0


# ---------------------------------------------------------------- traffic and memory
def traffic_run(comm, grid_dims, algorithm, conv_kw, kfac_kw):
    """K-FAC's own bytes in one step: a step with K-FAC minus the same step without it."""
    grid = ProcessorGrid(grid_dims, comm=comm)
    conv = make_conv(conv_kw)
    plain = DistConv2d.from_conv2d(conv, grid=grid, algorithm=algorithm)
    layer = DistConv2d.from_conv2d(conv, grid=grid, algorithm=algorithm)
    kfac = distkfac.KFAC(layer, factor_dtype=torch.float64, placement="round-robin", **kfac_kw)
    y_shape = layer.output_shape(SHAPE)
    x, t = global_data(0, y_shape)
    out = []
    for m in (plain, layer):
        comm.stats.reset()
        y = m(x[m.input_dist.local_slices(SHAPE, grid)], SHAPE)
        loss_of(y, t[m.output_dist.local_slices(y_shape, grid)], SHAPE[0]).backward()
        if m is layer:
            kfac.step()
        out.append(comm.stats.snapshot()["bytes"])
    own = {op: out[1].get(op, 0) - out[0].get(op, 0) for op in out[1]}
    ex = kfac.exact_layers[0]
    memory = {k: (tuple(ex.factors[k].shape), tuple(ex.inverse_rows[k].shape)) for k in "AG"}
    return {op: b for op, b in own.items() if b}, kfac.last_exact_assignment, memory


def _coords(rank, dims):
    out = {}
    for name, e in reversed(list(dims.items())):
        rank, out[name] = divmod(rank, e)
    return out


def _block(n, p, i):
    return n // p + (i < n % p)


def expected_exact(rank, dims, algorithm, conv, owners, kl):
    """Bytes per step of 'exact', from the formulas of distkfac.sharded's docstring."""
    from distconv.comm.base import allreduce_bytes

    i = 8
    co = _coords(rank, dims)
    C = dims.get("C", 1) if algorithm != "stationary-y" else 1
    F = dims.get("F", 1) if algorithm != "stationary-x" else 1
    c, f = (co.get("C", 0) if C > 1 else 0), (co.get("F", 0) if F > 1 else 0)
    ci, fo, k2 = conv.in_channels, conv.out_channels, conv.kernel_size[0] * conv.kernel_size[1]
    bias = int(conv.bias is not None)
    K = ci * k2 + bias
    cn, fn = _block(ci, C, c), _block(fo, F, f)
    rows_a = [_block(K, C, b) for b in range(C)]  # balanced row blocks of A
    rows_g = [_block(fo, F, b) for b in range(F)]
    nn_ = dims.get("N", 1)
    n_loc = _block(SHAPE[0], nn_, co.get("N", 0))
    h, w = SHAPE[2], SHAPE[3]
    ho, wo = conv(torch.zeros(1, ci, h, w, dtype=torch.float64)).shape[2:]
    want = {}
    want["allgather"] = ((fo - fn) * n_loc * ho * wo if F > 1 else 0) * i
    ar = 0
    if nn_ > 1:
        ar += allreduce_bytes(rows_a[c] * K + fn * fo + 2, co["N"], nn_, i)
    if kl:
        ar += allreduce_bytes(1, rank, _size(dims), 8)
    want["allreduce"] = ar
    # x over C: every channel of this rank's 1/C of the local samples
    a2a = (_block(n_loc, C, c) * (ci - cn) * h * w if C > 1 else 0) * i
    # row blocks to the owners; the damped inverses' row blocks back, every A block with the
    # bias row
    inv_a = [_block(ci, C, b) * k2 + bias for b in range(C)]
    for key, blocks, inv, side, mine in (("A", rows_a, inv_a, K, c),
                                         ("G", rows_g, rows_g, fo, f)):
        owner = owners[f"layer/{key}"] if f"layer/{key}" in owners else owners[f"/{key}"]
        if owner == rank:
            a2a += sum(r for b, r in enumerate(blocks) if b != mine) * side * i
        else:
            a2a += inv[mine] * side * i
    want["alltoall"] = a2a
    # A's row blocks summed over C; then every step the two preconditioning reduce-scatters
    want["reduce_scatter"] = ((C - 1) * rows_a[c] * K
                              + ((C - 1) + (F - 1)) * fn * (cn * k2 + bias)) * i
    return {op: b for op, b in want.items() if b}


def _size(dims):
    s = 1
    for e in dims.values():
        s *= e
    return s


@pytest.mark.parametrize("grid_dims, algorithm", [
    ({"N": 2, "C": 2}, "stationary-x"), ({"C": 2, "F": 2}, "stationary-w"),
    ({"N": 2, "F": 2}, "stationary-y"),
])
def test_exact_bytes_and_memory_per_rank_equal_the_documented_formulas(grid_dims, algorithm):
    conv_kw = dict(kernel_size=3, padding=1)
    conv = make_conv(conv_kw)
    kw = dict(kl_clip=1e-2)
    size = _size(grid_dims)
    results = run_threads(traffic_run, size, grid_dims, algorithm, conv_kw, kw)
    K = conv.in_channels * 9 + 1
    a_rows = 0
    for rank, (own, owners, memory) in enumerate(results):
        assert own == expected_exact(rank, grid_dims, algorithm, conv, owners, kl=True), rank
        (a_f, a_inv), (g_f, g_inv) = memory["A"], memory["G"]
        c_dims = grid_dims.get("C", 1) if algorithm != "stationary-y" else 1
        c = _coords(rank, grid_dims).get("C", 0) if c_dims > 1 else 0
        assert a_f == (_block(K, c_dims, c), K)
        assert a_inv == (_block(conv.in_channels, c_dims, c) * 9 + 1, K)  # + the bias row
        assert g_f == g_inv and g_f[1] == conv.out_channels
        a_rows += a_f[0]
    # row blocks over C, replicated over the other dims: each rank holds 1/C of A
    c = grid_dims.get("C", 1) if algorithm != "stationary-y" else 1
    assert a_rows == K * size // c


# ---------------------------------------------------------------- real worlds
def real_run(comm, grid_dims, algorithm, conv_kw, kfac_kw, steps):
    return sharded_run(comm, grid_dims, algorithm, conv_kw, kfac_kw, steps)[:4]


REAL_CASES = [
    ({"N": 2, "C": 2}, "stationary-x", dict(kernel_size=3, padding=1), "exact"),
    ({"C": 2, "F": 2}, "stationary-w", dict(kernel_size=3, padding=1), "exact"),
    ({"H": 2, "F": 2}, "stationary-y", dict(kernel_size=(3, 2), padding=1), "exact"),
]


def _real(pool, cases):
    kw = dict(kl_clip=1e-2, damping=1e-2, factor_decay=0.7)
    for grid_dims, algorithm, conv_kw, layout in cases:
        ref = single_run(conv_kw, kw, steps=2)
        assert_exact(pool.run(real_run, grid_dims, algorithm, conv_kw,
                              dict(kw, factor_sharding=layout), 2), ref)


@pytest.mark.gloo
def test_gloo4_exact_equals_single_process(gloo4):
    _real(gloo4, REAL_CASES[:1])


@pytest.mark.mpi
def test_mpi4_exact_equals_single_process(mpi4):
    _real(mpi4, REAL_CASES[1:])


# ---------------------------------------------------------------- property
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def exact_cases(draw):
    algorithm = draw(st.sampled_from(["stationary-x", "stationary-y", "stationary-w"]))
    model = {"stationary-x": ["C"], "stationary-y": ["F"], "stationary-w": ["C", "F"]}[algorithm]
    dims = {d: draw(st.integers(2, 3 if len(model) == 1 else 2)) for d in model}
    for extra in draw(st.lists(st.sampled_from(["N", "H", "W"]), max_size=1, unique=True)):
        dims[extra] = 2
    size = _size(dims)
    if size > 8:
        dims.pop(model[0])
        dims[model[0]] = 2
    k = draw(st.sampled_from([1, 2, 3]))
    conv_kw = dict(kernel_size=k, padding=k // 2, bias=draw(st.booleans()))
    return dims, algorithm, conv_kw


@settings(max_examples=5)
@given(exact_cases())
def test_exact_equals_single_process_on_drawn_grids(case):
    grid_dims, algorithm, conv_kw = case
    kw = dict(kl_clip=1e-2, damping=1e-2, factor_decay=0.5, compute_method="inverse")
    ref = single_run(conv_kw, kw, steps=2)
    assert_exact(run_threads(sharded_run, _size(grid_dims), grid_dims, algorithm, conv_kw, kw,
                             2), ref)


# ---------------------------------------------------------------- weight sharing
class _Twice(nn.Module):
    def __init__(self, conv: nn.Module) -> None:
        super().__init__()
        self.conv = conv

    def forward(self, x, *shape):
        return self.conv(torch.tanh(self.conv(x, *shape)), *shape)


def twice_run(comm, grid_dims, kw):
    grid = ProcessorGrid(grid_dims, comm=comm)
    layer = DistConv2d.from_conv2d(make_conv(dict(kernel_size=3, padding=1)), grid=grid,
                                   algorithm="stationary-x")
    model = _Twice(layer)
    kfac = distkfac.KFAC(model, factor_dtype=torch.float64, **kw)
    x, t = global_data(0, (SHAPE[0], 5, SHAPE[2], SHAPE[3]))
    sl = layer.input_dist.local_slices(SHAPE, grid)
    loss_of(model(x[sl], SHAPE), t[sl], SHAPE[0]).backward()
    kfac.step()
    return (layer.weight_dist.local_slices(layer.weight_shape, grid),
            layer.bias_dist.local_slices((5,), grid), layer.weight.grad, layer.bias.grad)


def test_distconv_called_twice_sums_its_factors_like_one_process():
    kw = dict(kl_clip=1e-2, damping=1e-2)
    conv = make_conv(dict(kernel_size=3, padding=1))
    model = _Twice(conv)
    model.forward = lambda x: conv(torch.tanh(conv(x)))
    kfac = distkfac.KFAC(model, factor_dtype=torch.float64, comm=None, **kw)
    x, t = global_data(0, (SHAPE[0], 5, SHAPE[2], SHAPE[3]))
    loss_of(model(x), t, SHAPE[0]).backward()
    kfac.step()
    assert_exact(run_threads(twice_run, 2, {"C": 2}, kw), conv)


# ---------------------------------------------------------------- stale statistics
STALE_BATCHES = [0] * 8 + [1] * 5
STALE_KW = dict(stale_threshold=1e-3, stale_max_interval=4, factor_decay=0.0)


def _stale_sharded(comm, grid_dims, algorithm, conv_kw):
    grid = ProcessorGrid(grid_dims, comm=comm)
    layer = DistConv2d.from_conv2d(make_conv(conv_kw), grid=grid, algorithm=algorithm)
    kfac = distkfac.KFAC(layer, factor_dtype=torch.float64, **STALE_KW)
    ex = kfac.exact_layers[0]
    decomposed = []
    for step, batch in enumerate(STALE_BATCHES):
        y_shape = layer.output_shape(SHAPE)
        x, t = global_data(batch, y_shape)
        layer.zero_grad()
        y = layer(x[layer.input_dist.local_slices(SHAPE, grid)], SHAPE)
        loss_of(y, t[layer.output_dist.local_slices(y_shape, grid)], SHAPE[0]).backward()
        before = dict(ex.inverse_rows)
        kfac.step()
        decomposed += [(step, k) for k in "AG" if ex.inverse_rows[k] is not before[k]]
    w_idx = layer.weight_dist.local_slices(layer.weight_shape, grid)
    b_idx = layer.bias_dist.local_slices((layer.out_channels,), grid)
    return (w_idx, b_idx, layer.weight.grad.clone(), layer.bias.grad.clone(), decomposed,
            dict(kfac.stale_counts))


@pytest.mark.parametrize("grid_dims, algorithm", [
    ({"C": 2}, "stationary-x"), ({"C": 2, "F": 2}, "stationary-w")])
def test_exact_stale_statistics_follow_the_single_process_schedule(grid_dims, algorithm):
    """The batch is the same for steps 0-7 and another from 8 on, factor_decay 0: as for one
    process (tests/kfac/test_features.py), each factor is decomposed at steps 0 and 11 only
    (looks at scheduled events 1, 3, 7 see no change, the one at 11 does) -- 13 scheduled, 5
    looks per factor -- and the last gradient equals single-process K-FAC's."""
    conv_kw = dict(kernel_size=3, padding=1)
    conv = make_conv(conv_kw)
    kfac = distkfac.KFAC(conv, factor_dtype=torch.float64, comm=None, **STALE_KW)
    for batch in STALE_BATCHES:
        x, t = global_data(batch, conv(torch.zeros(SHAPE, dtype=torch.float64)).shape)
        conv.zero_grad()
        loss_of(conv(x), t, SHAPE[0]).backward()
        kfac.step()
    results = run_threads(_stale_sharded, _size(grid_dims), grid_dims, algorithm, conv_kw)
    assert_exact(results, conv)
    for *_, decomposed, counts in results:
        assert decomposed == [(0, "A"), (0, "G"), (11, "A"), (11, "G")]
        assert counts == {"scheduled": 26, "looked": 10, "skipped": 22}
