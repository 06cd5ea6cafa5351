"""K-FAC state in checkpoints: 'exact' factors of channel/filter-parallel layers are blocks of
the global factors, so a run saved on one grid resumes on another grid or on one process.

Reference: single-process K-FAC on the plain model, same data, same schedule (decompositions
every 3 steps: the step after loading uses the saved decomposition)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distconv
import distkfac
from distconv.parallel import parallelize
from distconv.testing.threads import run_threads

N, CI, HW = 6, 5, 4
KW = dict(factor_dtype=torch.float64, factor_update_steps=1, inv_update_steps=3, damping=1e-2)


def _build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(CI, 6, 3, padding=1), nn.Tanh(), nn.Flatten(),
                         nn.Linear(6 * HW * HW, 3)).double()


MODEL = _build()  # built once: thread ranks share torch's global generator


def plain_model() -> nn.Module:
    return copy.deepcopy(MODEL)


def batch(step: int):
    g = torch.Generator().manual_seed(50 + step)
    return (torch.randn(N, CI, HW, HW, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (N,), generator=g))


def config(grid: dict, algorithm: str) -> dict:
    return {"layers": [{"match": "0", "grid": grid, "algorithm": algorithm}]}


def train(model, kfac, steps, data_block=lambda t: t, *, first=0, data=None):
    """Steps ``first, ...`` of SGD with K-FAC on ``data(step)`` (default :func:`batch`); the
    gradients of the last step of a continuation are left for the caller to read."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(first, first + steps):
        x, y = (data or batch)(step)
        opt.zero_grad()
        F.cross_entropy(model(data_block(x)), data_block(y)).backward()
        kfac.step()
        if step < first + steps - 1 or first == 0:
            opt.step()


def reference():
    """Factors of layer 0 after steps 0-1, and its preconditioned gradient at step 2."""
    model = plain_model()
    kfac = distkfac.KFAC(model, comm=None, **KW)
    train(model, kfac, 2)
    saved = {k: getattr(kfac.layers[0], k.lower()).value[0].clone() for k in "AG"}
    train(model, kfac, 1, first=2)
    return saved, model[0].weight.grad.clone(), model[0].bias.grad.clone()


def _block(pm, t):
    """This rank's samples of a global batch tensor."""
    from distconv.data import sample_block

    return t[sample_block(t.shape[0], pm.data_grid)]


def save_run(comm, path, grid, algorithm):
    pm = parallelize(plain_model(), config(grid, algorithm), comm=comm)
    kfac = distkfac.KFAC(pm, factor_sharding="exact", **KW)
    train(pm, kfac, 2, lambda t: _block(pm, t))
    distconv.save(pm, path, states={"kfac": kfac}, comm=comm)


def load_run(comm, path, grid, algorithm):
    pm = parallelize(plain_model(), config(grid, algorithm), comm=comm)
    kfac = distkfac.KFAC(pm, factor_sharding="exact", **KW)
    distconv.load(pm, path, states={"kfac": kfac})
    ex = kfac.exact_layers[0]
    loaded = {k: (ex.rows[k], ex.factors[k].clone()) for k in "AG"}
    steps = kfac.steps
    train(pm, kfac, 1, lambda t: _block(pm, t), first=2)
    m = ex.module
    return (steps, loaded, m.weight_dist.local_slices(m.weight_shape, m.grid),
            m.bias_dist.local_slices((m.out_channels,), m.grid), m.weight.grad.clone(),
            m.bias.grad.clone())


@pytest.mark.parametrize("saved_on, loaded_on", [
    (({"C": 2}, "stationary-x"), ({"C": 3}, "stationary-x")),
    (({"C": 3}, "stationary-x"), ({"C": 2, "F": 2}, "stationary-w")),
    (({"C": 2, "F": 2}, "stationary-w"), ({"N": 2, "F": 2}, "stationary-y")),
])
def test_exact_state_resumes_on_another_grid_identically(tmp_path, saved_on, loaded_on):
    """Saved on one grid, loaded on another: every rank holds its block of the reference
    factors, and the next step (which reuses the saved decomposition) gives the reference's
    preconditioned gradient."""
    (ref_a, ref_g), ref_w, ref_b = reference()[0].values(), *reference()[1:]
    path = str(tmp_path / "ckpt")
    size = lambda grid: int(torch.tensor(list(grid.values())).prod())  # noqa: E731
    run_threads(save_run, size(saved_on[0]), path, *saved_on)
    for steps, loaded, w_idx, b_idx, wg, bg in run_threads(
            load_run, size(loaded_on[0]), path, *loaded_on):
        assert steps == 2
        for (rows, got), ref in zip(loaded.values(), (ref_a, ref_g)):
            torch.testing.assert_close(got, ref[rows], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(wg, ref_w[w_idx], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(bg, ref_b[b_idx], rtol=1e-10, atol=1e-12)


def test_exact_state_loads_onto_one_process_and_back(tmp_path):
    """Channel-parallel state loads into single-process K-FAC on the plain model (factors
    bitwise the reference's up to round-off; decompositions recomputed), and a single-process
    checkpoint loads onto a channel-parallel run (each rank its blocks)."""
    (ref_a, ref_g), *_ = reference()[0].values(), None
    path = str(tmp_path / "parallel")
    run_threads(save_run, 2, path, {"C": 2}, "stationary-x")
    model = plain_model()
    kfac = distkfac.KFAC(model, comm=None, **KW)
    distconv.load(model, path, states={"kfac": kfac})
    torch.testing.assert_close(kfac.layers[0].a.value[0], ref_a, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(kfac.layers[0].g.value[0], ref_g, rtol=1e-12, atol=1e-14)
    assert kfac.steps == 2 and kfac.layers[0].a_payload is None  # recomputed at the next step
    single = str(tmp_path / "single")
    distconv.save(model, single, states={"kfac": kfac}, comm=distconv.comm.SingleCommunicator())

    def back(comm):
        pm = parallelize(plain_model(), config({"C": 2}, "stationary-x"), comm=comm)
        k = distkfac.KFAC(pm, factor_sharding="exact", **KW)
        distconv.load(pm, single, states={"kfac": k})
        ex = k.exact_layers[0]
        return ex.rows["A"], ex.factors["A"], ex.inverse_rows["A"]

    for rows, a, inv in run_threads(back, 2):
        torch.testing.assert_close(a, ref_a[rows], rtol=1e-12, atol=1e-14)
        assert inv is None


def test_block_state_loads_back_on_its_layout(tmp_path):
    """'block' factors are saved stacked over the shards and each rank of the same layout gets
    its own blocks back (resharding and refusals: tests/kfac/test_resume.py)."""
    def run(comm, load):
        pm = parallelize(plain_model(), config({"C": 2}, "stationary-x"), comm=comm)
        kfac = distkfac.KFAC(pm, factor_sharding="block", **KW)
        if load:
            distconv.load(pm, str(tmp_path / "block"), states={"kfac": kfac})
        else:
            train(pm, kfac, 2, lambda t: _block(pm, t))
            distconv.save(pm, str(tmp_path / "block"), states={"kfac": kfac}, comm=comm)
        return [(ly.name, ly.a.value, ly.g.value) for ly in kfac.layers]

    for saved, loaded in zip(run_threads(run, 2, False), run_threads(run, 2, True)):
        for (name, a, g), (name2, a2, g2) in zip(saved, loaded):
            assert name == name2 and torch.equal(a, a2) and torch.equal(g, g2)


def _grouped() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, groups=4), nn.Tanh(), nn.Flatten(),
                         nn.Linear(8 * HW * HW, 3)).double()


GROUPED = _grouped()


def grouped_batch(step: int):
    g = torch.Generator().manual_seed(70 + step)
    return (torch.randn(N, 4, HW, HW, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (N,), generator=g))


def test_grouped_state_split_over_groups_resumes_on_one_process_identically(tmp_path):
    """A depthwise layer on {C: 2} holds half the groups' factors and decompositions; saved,
    loaded on one process, the next step (reusing the saved decompositions) equals the
    single-process run's."""
    ref = copy.deepcopy(GROUPED)
    kref = distkfac.KFAC(ref, comm=None, **KW)
    train(ref, kref, 2, data=grouped_batch)
    path = str(tmp_path / "grouped")

    def save(comm):
        pm = parallelize(copy.deepcopy(GROUPED), config({"C": 2}, "stationary-x"), comm=comm)
        kfac = distkfac.KFAC(pm, **KW)
        train(pm, kfac, 2, lambda t: _block(pm, t), data=grouped_batch)
        distconv.save(pm, path, states={"kfac": kfac}, comm=comm)

    run_threads(save, 2)
    model = copy.deepcopy(GROUPED)
    kfac = distkfac.KFAC(model, comm=None, **KW)
    distconv.load(model, path, states={"kfac": kfac})
    for got, want in zip(kfac.layers, kref.layers):
        torch.testing.assert_close(got.a.value, want.a.value, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got.g.value, want.g.value, rtol=1e-12, atol=1e-14)
        ad, damping = got.adapter, KW["damping"]
        for k, d in (("a_payload", ad.a_dim), ("g_payload", ad.g_dim)):  # eigenvector signs
            inverse = [kfac.method.damped_inverse(getattr(ly, k), ad.groups, d, damping)
                       for ly in (got, want)]
            torch.testing.assert_close(*inverse, rtol=1e-9, atol=1e-11)
    train(model, kfac, 1, first=2, data=grouped_batch)
    train(ref, kref, 1, first=2, data=grouped_batch)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- stale statistics
CONV = plain_model()[0]


def _stale_part(comm, path, grid_dims, steps, load):
    from distconv.grid import ProcessorGrid
    from distconv.nn import DistConv2d

    grid = ProcessorGrid(grid_dims, comm=comm)
    layer = DistConv2d.from_conv2d(copy.deepcopy(CONV), grid=grid, algorithm="stationary-x")
    kfac = distkfac.KFAC(layer, factor_dtype=torch.float64, stale_threshold=1e-3,
                         stale_max_interval=4, factor_decay=0.0)
    if load:
        distconv.load(layer, path, states={"kfac": kfac})
    ex, shape, decomposed = kfac.exact_layers[0], (N, CI, HW, HW), []
    for step in steps:
        x = batch(0 if step < 8 else 1)[0]
        layer.zero_grad()
        y = layer(x[layer.input_dist.local_slices(shape, grid)], shape)
        (y.square().sum() / N).backward()
        before = dict(ex.inverse_rows)
        kfac.step()
        decomposed += [step for k in "AG" if ex.inverse_rows[k] is not before[k]]
    if not load:
        distconv.save(layer, path, states={"kfac": kfac}, comm=comm)
    return decomposed


def test_stale_statistics_schedule_survives_a_checkpoint_onto_another_grid(tmp_path):
    """The batch changes at step 8, factor_decay 0: uninterrupted, each factor is decomposed at
    steps 0 and 11 only (tests/kfac/test_sharded.py).  Saved after step 5 on {C: 2} and loaded
    on {C: 3}, the references, intervals and waits carry over: step 11 alone decomposes."""
    path = str(tmp_path / "stale")
    first = run_threads(_stale_part, 2, path, {"C": 2}, range(6), False)
    second = run_threads(_stale_part, 3, path, {"C": 3}, range(6, 13), True)
    assert all(d == [0, 0] for d in first) and all(d == [11, 11] for d in second)
