"""DHO2 on P ranks equals single-process FOSI on the concatenated batch (eigenpairs, parameter
trajectory, 1/P of the Lanczos basis per rank); MR-DHO2's final update equals a hand-computed
reference on a quadratic; configurations that leave a role empty are refused."""
from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distconv.comm import SingleCommunicator
from distconv.distribution import balanced_block
from distconv.grid import ProcessorGrid
from distconv.testing.threads import run_threads
from distkfac.hybrid import DHO2, FOSI, MRDHO2, split_roles
from distkfac.hybrid.space import flatten

STEPS = 6
N_SAMPLES = 23
# uneven local batches (one rank may hold a single sample)
SPLITS = {1: [23], 2: [9, 14], 3: [5, 13, 5], 4: [5, 8, 1, 9]}
BASES = {
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()  # n = 57


def dataset():
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, N_SAMPLES, 5, generator=g, dtype=torch.float64)
    ys = torch.randint(0, 3, (STEPS, N_SAMPLES), generator=g)
    x_ese = torch.randn(N_SAMPLES, 5, generator=g, dtype=torch.float64)
    y_ese = torch.randint(0, 3, (N_SAMPLES,), generator=g)
    return xs, ys, x_ese, y_ese


def train(comm, model: nn.Module, base: str, sizes=None, grid=None) -> dict:
    """DHO2 (``comm``) or FOSI (None) for STEPS steps on this rank's rows of every batch."""
    rank, size = (0, 1) if comm is None else (comm.rank, comm.size)
    sizes = SPLITS[size] if sizes is None else sizes
    lo = sum(sizes[:rank])
    rows = slice(lo, lo + sizes[rank])
    xs, ys, x_ese, y_ese = dataset()
    kw = dict(ese_closure=lambda: F.cross_entropy(model(x_ese[rows]), y_ese[rows]),
              ese_samples=sizes[rank], k=2, l=1, ese_every=3, warmup=2, seed=4)
    opt = (FOSI(model.parameters(), BASES[base], **kw) if comm is None else
           DHO2(model.parameters(), BASES[base], **kw,
                **({"grid": grid} if grid is not None else {"comm": comm})))
    trajectory = []
    for t in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(model(xs[t][rows]), ys[t][rows]).backward()
        opt.step(num_samples=sizes[rank])
        trajectory.append(flatten(list(model.parameters())))
    vecs = opt.eigenvectors if comm is None else torch.cat(
        comm.allgather(opt.eigenvectors.contiguous(),
                       shapes=[(3, balanced_block(57, size, r)[1]) for r in range(size)]), 1)
    return dict(theta=torch.stack(trajectory), eigenvalues=opt.eigenvalues, eigenvectors=vecs,
                basis_bytes=opt.last_ese.basis_bytes, local=opt.space.local,
                steps=opt.last_ese.steps)


@functools.cache
def fosi_reference(base: str) -> dict:
    return train(None, build(), base)


def assert_equal_to_fosi(results, base: str) -> None:
    ref = fosi_reference(base)
    for r in results:
        torch.testing.assert_close(r["eigenvalues"], ref["eigenvalues"], rtol=0, atol=1e-10)
        torch.testing.assert_close(r["eigenvectors"], ref["eigenvectors"], rtol=0, atol=1e-10)
        torch.testing.assert_close(r["theta"], ref["theta"], rtol=0, atol=1e-10)
        # D's slice: exactly the local columns of every Lanczos vector, ~1/P of FOSI's
        assert r["basis_bytes"] == 8 * ref["steps"] * r["local"]
    assert sum(r["basis_bytes"] for r in results) == ref["basis_bytes"]


@pytest.mark.parametrize("size,base", [(2, "adam"), (3, "momentum"), (4, "adam")])
def test_dho2_on_threads_equals_fosi_on_the_concatenated_batch(size, base):
    model = build()  # built here: thread-ranks must not race on the global RNG
    results = run_threads(lambda comm: train(comm, copy.deepcopy(model), base), size)
    assert_equal_to_fosi(results, base)


def test_dho2_takes_a_grid_and_equals_fosi():
    model = build()

    def on_grid(comm):
        opt_model = copy.deepcopy(model)
        grid = ProcessorGrid({"N": 2, "C": 1}, comm=comm)
        return train(comm, opt_model, "adam", grid=grid)

    assert_equal_to_fosi(run_threads(on_grid, 2), "adam")


def world_case(comm) -> dict:
    """Run by every rank of a real world: DHO2 with the momentum base."""
    torch.set_num_threads(1)
    return train(comm, build(), "momentum")


def test_dho2_on_gloo2_equals_fosi(gloo2):
    assert_equal_to_fosi(gloo2.run(world_case), "momentum")


def test_dho2_on_mpi4_equals_fosi(mpi4):
    assert_equal_to_fosi(mpi4.run(world_case), "momentum")


def test_dho2_refuses_a_base_that_is_not_elementwise():
    with pytest.raises(ValueError, match="elementwise"):
        DHO2(build().parameters(), lambda ps: torch.optim.LBFGS(ps), comm=SingleCommunicator(),
             k=1)


# ---------------------------------------------------------------------- MR-DHO2 on a quadratic
# f_r(theta) = 1/2 theta^T H theta - b_r^T theta, H = diag(10, 2 x 6, 0.5 x 6): three distinct
# eigenvalues, so Lanczos spans them exactly in three steps and stops (breakdown).
N = 13
H_DIAG = [10.0] + [2.0] * 6 + [0.5] * 6
T, LR, ALPHA, PERIODS, SEED = 4, 0.05, 0.1, 2, 3


def mr_run(comm, fraction: float, counts: list[int]):
    h = torch.tensor(H_DIAG, dtype=torch.float64)
    theta = nn.Parameter(torch.linspace(-1, 1, N, dtype=torch.float64))
    b = torch.randn(comm.size, N, generator=torch.Generator().manual_seed(11),
                    dtype=torch.float64)[comm.rank]

    def f():
        return 0.5 * (h * theta * theta).sum() - b @ theta

    opt = MRDHO2([theta], lambda ps: torch.optim.SGD(ps, lr=LR), comm=comm,
                 accelerator_fraction=fraction, period=T, ese_closure=f, k=2, l=1, alpha=ALPHA,
                 lr_clip=3.0, seed=SEED)
    for _ in range(T * PERIODS):
        if opt.needs_gradient:
            opt.zero_grad()
            f().backward()
        opt.step(num_samples=counts[comm.rank])
    return opt.role, theta.detach().clone(), opt.eigenvalues, opt.last_ese


def mr_reference(size: int, workers: list[int], counts: list[int]) -> np.ndarray:
    """The final update written out: Ritz vectors of the exact Krylov space are the start
    vector's normalised projections on H's three eigenspaces; s = clip((1/2)/(1/10), 1, 3)."""
    h = np.array(H_DIAG)
    b = torch.randn(size, N, generator=torch.Generator().manual_seed(11),
                    dtype=torch.float64).numpy()
    w = np.array([counts[r] for r in workers], dtype=float)
    b_mean = (w[:, None] * b[workers]).sum(0) / w.sum()
    v0 = torch.randn(N, generator=torch.Generator().manual_seed(SEED), dtype=torch.float64).numpy()
    e = np.zeros((3, N))
    for row, idx in enumerate([slice(7, 13), slice(1, 7), slice(0, 1)]):  # 0.5, 2, 10
        e[row, idx] = v0[idx] / np.linalg.norm(v0[idx])
    eta, s = 1 / np.array([0.5, 2.0, 10.0]), 3.0
    theta = np.linspace(-1, 1, N)
    for _ in range(PERIODS):
        theta0, g_sum = theta.copy(), np.zeros(N)
        for _ in range(T):
            g = h * theta - b_mean
            g_sum += g
            theta = theta - LR * g
        d = theta - theta0
        theta = theta0 + s * (d - e.T @ (e @ d)) - ALPHA * e.T @ (eta * (e @ (g_sum / T)))
    return theta


@pytest.mark.parametrize("size,fraction", [(3, 1 / 3), (4, 0.5), (5, 0.4)])
def test_mr_dho2_final_update_equals_hand_computed_reference(size, fraction):
    counts = [2, 3, 7, 1, 4][:size]
    out = run_threads(mr_run, size, fraction, counts)
    accelerators, workers = split_roles(size, fraction)
    expected = mr_reference(size, workers, counts)
    for r, (role, theta, vals, last_ese) in enumerate(out):
        assert role == ("accelerator" if r in accelerators else "worker")
        torch.testing.assert_close(vals, torch.tensor([0.5, 2.0, 10.0], dtype=torch.float64),
                                   rtol=0, atol=1e-12)
        if role == "worker":
            np.testing.assert_allclose(theta.numpy(), expected, rtol=0, atol=1e-12)
        else:  # D split over the accelerators: 3 Lanczos vectors, the local columns
            local = balanced_block(N, len(accelerators), r)[1]
            assert last_ese.steps == 3 and last_ese.basis_bytes == 8 * 3 * local


def test_mr_dho2_on_gloo4_equals_hand_computed_reference(gloo4):
    counts = [2, 3, 7, 1]
    expected = mr_reference(4, [2, 3], counts)
    out = gloo4.run(mr_run, 0.5, counts)
    for role, theta, _, _ in out:
        if role == "worker":
            np.testing.assert_allclose(theta.numpy(), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("size,fraction", [(2, 1.0), (2, 0.0), (4, 0.9), (4, 0.1), (1, 0.5),
                                           (3, float("nan"))])
def test_fractions_that_leave_a_role_empty_are_refused(size, fraction):
    with pytest.raises(ValueError, match="accelerator_fraction"):
        split_roles(size, fraction)


def test_mr_dho2_refuses_at_construction_on_every_rank():
    def make(comm):
        theta = nn.Parameter(torch.zeros(4, dtype=torch.float64))
        MRDHO2([theta], lambda ps: torch.optim.SGD(ps, lr=0.1), comm=comm,
               accelerator_fraction=1.0, k=1, ese_closure=lambda: theta.sum())

    with pytest.raises(ValueError, match="accelerator_fraction=1.0 gives 2 accelerators"):
        run_threads(make, 2)


def test_dho2_with_more_ranks_than_parameters_equals_fosi():
    """n = 3 over 4 ranks: one rank holds an empty slice of every vector."""
    h = torch.tensor([3.0, 1.0, 0.2], dtype=torch.float64)

    def run(comm):
        theta = nn.Parameter(torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64))

        def f():
            return 0.5 * (h * theta * theta).sum()

        kw = dict(k=1, order=2, warmup=1, ese_every=2, ese_closure=f)
        base = BASES["momentum"]
        opt = (FOSI([theta], base, **kw) if comm is None else
               DHO2([theta], base, comm=comm, **kw))
        for _ in range(4):
            opt.zero_grad()
            f().backward()
            opt.step()
        return theta.detach().clone(), opt.eigenvalues

    ref = run(None)
    for theta, vals in run_threads(run, 4):
        torch.testing.assert_close(theta, ref[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(vals, ref[1], rtol=0, atol=1e-12)
