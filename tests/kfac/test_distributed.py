"""Data parallelism: P ranks x local batches equal one process on the concatenated batch.

Scaling under test: each rank's loss is the mean over its local batch; gradients are averaged
over ranks (weighted by local batch size when batches differ); factors are reduced as sums of
outer products with row counts.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distkfac
from distconv.comm.base import allreduce_bytes
from distconv.grid import ProcessorGrid
from distconv.testing.threads import run_threads
from distkfac.factors import packed_numel
from distkfac.placement import CostModel

# Small factors decompose everywhere, larger ones are placed: both paths run on 2+ ranks.
COST = CostModel(c0=0.0, c2=0.0, c3=1e-9, alpha=1e-6, beta=1e-9)


def build() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(4, 6, (2, 3), stride=2, padding="valid", groups=2),
                         nn.Tanh(), nn.Flatten(), nn.Linear(6 * 3 * 2, 5), nn.Tanh(),
                         nn.Linear(5, 3)).double()


def data(steps: int, n: int):
    g = torch.Generator().manual_seed(7)
    return ([torch.randn(n, 3, 7, 6, generator=g, dtype=torch.float64) for _ in range(steps)],
            [torch.randint(0, 3, (n,), generator=g) for _ in range(steps)])


def dp_train(comm, state, xs, ys, splits, kfac_kw, probe=False):
    """Train ``len(xs)`` steps on this rank's slice; return grads, factors and traffic."""
    rank = 0 if comm is None else comm.rank
    size = 1 if comm is None else comm.size
    model = build()
    model.load_state_dict(state)
    kw = dict(factor_dtype=torch.float64, cost_model=COST)
    kw.update(kfac_kw)
    grid_dims = kw.pop("grid", None)
    if grid_dims is not None and comm is not None:
        kw["grid"] = ProcessorGrid(grid_dims, comm=comm)
    else:
        kw["comm"] = comm
    kfac = distkfac.KFAC(model, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    lo, b, total = sum(splits[:rank]), splits[rank], sum(splits)
    info = {}
    for x, y in zip(xs, ys):
        opt.zero_grad()
        if comm is not None:
            comm.stats.reset()
        out = model(x[lo:lo + b])
        reducer = next(iter(kfac._reducers.values()))
        info["in_flight_after_forward"] = reducer.buckets_in_flight
        F.cross_entropy(out, y[lo:lo + b]).backward()
        if comm is not None:
            info["factor_allreduce"] = (comm.stats.calls.get("allreduce", 0),
                                        comm.stats.bytes.get("allreduce", 0))
        for p in model.parameters():
            p.grad.mul_(b * size / total)
        distkfac.allreduce_gradients(model.parameters(), comm)
        kfac.step()
        opt.step()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    factors = {ly.name: (ly.a.value, ly.g.value) for ly in kfac.layers}
    info["assignment"] = getattr(kfac, "last_assignment", None)
    return grads, factors, info


def reference(kfac_kw, steps=2, n=12):
    torch.manual_seed(0)
    state = build().state_dict()
    xs, ys = data(steps, n)
    return state, xs, ys, dp_train(None, state, xs, ys, [n], kfac_kw)


def assert_same(got, want):
    for name in want[0]:
        torch.testing.assert_close(got[0][name], want[0][name], rtol=1e-9, atol=1e-12)
    for name in want[1]:
        for a, b in zip(got[1][name], want[1][name]):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("size, kfac_kw", [
    (2, dict()),
    (3, dict(compute_method="inverse", placement="round-robin", bucket_bytes=0)),
    (4, dict(symmetric_comm=False, inv_update_steps=2, bucket_bytes=400)),
    (2, dict(cost_model=None)),  # LBP with a cost model fitted on this machine
    (4, dict(grid={"N": 2, "H": 2}, placement="round-robin")),
])
def test_threads_equal_concatenated_batch(size, kfac_kw):
    state, xs, ys, want = reference(kfac_kw)
    splits = [12 // size] * size
    results = run_threads(dp_train, size, state, xs, ys, splits, kfac_kw)
    for got in results:
        assert_same(got, want)
    owners = [r[2]["assignment"] for r in results]
    assert all(o == owners[0] for o in owners)
    placed = set(owners[0].values())
    if kfac_kw.get("placement") == "round-robin":
        assert placed == set(range(size))
    elif "cost_model" not in kfac_kw:
        assert {-1, 0, 1} <= placed  # LBP: the large factors placed, the small ones everywhere


def test_threads_unequal_local_batches_equal_concatenated_batch():
    state, xs, ys, want = reference({}, n=12)
    for got in run_threads(dp_train, 3, state, xs, ys, [5, 4, 3], {}):
        assert_same(got, want)


def test_factor_buckets_launch_from_hooks_before_step():
    state, xs, ys, _ = reference({}, steps=1)
    results = run_threads(dp_train, 2, state, xs, ys, [6, 6], dict(bucket_bytes=0))
    assert all(r[2]["in_flight_after_forward"] == 4 for r in results)  # one per A factor


@pytest.mark.parametrize("symmetric", [True, False])
def test_factor_traffic_is_packed_upper_triangles(symmetric):
    state, xs, ys, _ = reference({}, steps=1)
    kw = dict(bucket_bytes=1 << 30, symmetric_comm=symmetric)
    results = run_threads(dp_train, 2, state, xs, ys, [6, 6], kw)
    model = build()
    layers = distkfac.KFAC(model).layers
    n = sum(packed_numel(ly.adapter.groups, d, symmetric=symmetric) + 1
            for ly in layers for d in (ly.adapter.a_dim, ly.adapter.g_dim))
    for rank, r in enumerate(results):
        assert r[2]["factor_allreduce"] == (1, allreduce_bytes(n, rank, 2, 8))


# ---------------------------------------------------------------- real worlds
def _real_world(pool, kfac_kw):
    state, xs, ys, want = reference(kfac_kw)
    size = len(pool.run(_rank))
    results = pool.run(dp_train, state, xs, ys, [12 // size] * size, kfac_kw)
    for got in results:
        assert_same(got, want)


def _rank(comm):
    return comm.rank


@pytest.mark.gloo
def test_gloo2_equals_concatenated_batch(gloo2):
    _real_world(gloo2, dict(bucket_bytes=300))


@pytest.mark.gloo
def test_gloo4_equals_concatenated_batch(gloo4):
    _real_world(gloo4, dict(compute_method="inverse", placement="round-robin"))


@pytest.mark.mpi
def test_mpi4_equals_concatenated_batch(mpi4):
    _real_world(mpi4, dict(bucket_bytes=0, cost_model=None))  # LBP fitted on MPI


def test_ranks_agree_on_every_collective_in_debug_mode():
    from distconv.comm import get_debug, set_debug

    state, xs, ys, want = reference({}, steps=1)
    old = get_debug()
    set_debug(True)
    try:
        results = run_threads(dp_train, 2, state, xs, ys, [6, 6], dict(bucket_bytes=500))
    finally:
        set_debug(old)
    for got in results:
        assert_same(got, want)


def _volume_model() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(),
                         nn.Conv3d(4, 4, 2, stride=2, groups=2), nn.Tanh(), nn.Flatten(),
                         nn.Linear(4 * 2 * 2 * 1, 3)).double()


def _volume_run(comm, state, xs, ys, splits):
    rank = 0 if comm is None else comm.rank
    model = _volume_model()
    model.load_state_dict(state)
    kfac = distkfac.KFAC(model, comm=comm, factor_dtype=torch.float64, cost_model=COST)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    lo, b, total = sum(splits[:rank]), splits[rank], sum(splits)
    size = 1 if comm is None else comm.size
    for x, y in zip(xs, ys):
        opt.zero_grad()
        F.cross_entropy(model(x[lo:lo + b]), y[lo:lo + b]).backward()
        for p in model.parameters():
            p.grad.mul_(b * size / total)
        distkfac.allreduce_gradients(model.parameters(), comm)
        kfac.step()
        opt.step()
    return ({n: p.grad.clone() for n, p in model.named_parameters()},
            {ly.name: (ly.a.value, ly.g.value) for ly in kfac.layers})


def test_conv3d_threads_with_unequal_batches_equal_concatenated_batch():
    """Data-parallel K-FAC of a volume network (Conv3d, grouped and strided): 3 ranks with
    unequal local batches end two steps with the gradients and factors of one process."""
    state = _volume_model().state_dict()
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(9, 2, 4, 4, 2, generator=g, dtype=torch.float64) for _ in range(2)]
    ys = [torch.randint(0, 3, (9,), generator=g) for _ in range(2)]
    want = _volume_run(None, state, xs, ys, [9])
    assert any(name == "0" for name in want[1])  # the Conv3d layers are preconditioned
    for got in run_threads(_volume_run, 3, state, xs, ys, [2, 4, 3]):
        assert_same(got, want)
