"""Blind spots of K-FAC: 'block' factors cut from whole ones on a split over filters, and the
low-precision wire formats on three ranks with factors of different row counts. Expectations are
written from the layouts' definitions by hand, or computed in float64 on one process."""

from __future__ import annotations


import pytest
import torch
from torch import nn

import distconv
from distconv.testing import run_threads

N, CI, FO, HW = 6, 5, 6, 4  # the model of tests.kfac.test_resume: Conv2d(5, 6, 3), 4x4 images


def _kfac_run(comm, grid, algorithm, **kw):
    """The resume test's K-FAC run (tests.kfac.test_resume.kfac_run): its preconditioner."""
    from tests.kfac.test_resume import kfac_run

    return kfac_run(comm, grid, algorithm, **kw)[1]


# Conv2d(5, 6, 3) with a bias on {C: 2, F: 2} (rank = 2 c + f): A is 5·9 + 1 = 46 square, G 6.
# Channel blocks (0..3, 3..5) give A rows [0, 27) and [27, 45), the bias row 45 its own block;
# filter blocks [0, 3) and [3, 6); the bias shards split each filter block over C: 2 + 1 rows.
WEIGHT_A = {0: (0, 27), 1: (27, 45)}
WEIGHT_G = {0: (0, 3), 1: (3, 6)}
BIAS_G = {(0, 0): (0, 2), (0, 1): (2, 3), (1, 0): (3, 5), (1, 1): (5, 6)}


def _loaded_blocks(comm, path):
    kfac = _kfac_run(comm, {"C": 2, "F": 2}, "stationary-w", until=3, load=path)
    c, f = divmod(comm.rank, 2)
    out = {}
    for ly in kfac.layers:
        if ly.name.endswith(".bias"):
            out["bias"] = ((45, 46), BIAS_G[(f, c)], ly.a.value[0], ly.g.value[0])
        elif ly.name.startswith("0"):
            out["weight"] = (WEIGHT_A[c], WEIGHT_G[f], ly.a.value[0], ly.g.value[0])
    return out


def test_whole_factors_load_as_the_block_diagonals_of_a_filter_split(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    run_threads(_kfac_run, 2, {"C": 2}, "stationary-x", until=3, save_at=3, path=path,
                factor_sharding="exact")
    whole = distconv.consolidate(path, section="kfac")["factors"]["0"]
    a, g = whole["A"]["value"][0], whole["G"]["value"][0]
    for blocks in run_threads(_loaded_blocks, 4, path):
        assert set(blocks) == {"weight", "bias"}
        for part, ((alo, ahi), (glo, ghi), got_a, got_g) in blocks.items():
            assert torch.equal(got_a, a[alo:ahi, alo:ahi]), part
            assert torch.equal(got_g, g[glo:ghi, glo:ghi]), part


# ---------------------------------------------------------------------- low-precision sums
NUMELS = (7, 5)  # two factors; on 3 ranks the 12 numbers fall in blocks 0-3, 4-7 and 8-11


def _contribution(rank: int) -> tuple[list[torch.Tensor], list[float]]:
    """Rank r's two factor sums, of 10 + r and 2 + r rows: the factors' row counts differ."""
    g = torch.Generator().manual_seed(7 + rank)
    counts = [10.0 + rank, 2.0 + rank]
    flats = [c * (0.5 + torch.rand(n, generator=g, dtype=torch.float64))
             for n, c in zip(NUMELS, counts)]
    return flats, counts


def _lowprec_sum(comm, comm_dtype):
    from distkfac.lowprec import collect, launch

    flats, counts = _contribution(comm.rank)
    works = launch(comm, [f.float() for f in flats], counts, comm_dtype, meta="test")
    return collect(works, NUMELS, comm_dtype, torch.float64)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("comm_dtype", [torch.float16, "float21"])
def test_low_precision_factor_sums_weigh_each_factor_by_its_own_rows(size, comm_dtype) -> None:
    parts = [_contribution(r) for r in range(size)]
    want = [sum(p[0][i] for p in parts) for i in range(len(NUMELS))]
    rows = [sum(p[1][i] for p in parts) for i in range(len(NUMELS))]
    for values, counts in run_threads(_lowprec_sum, size, comm_dtype):
        assert counts == rows
        for got, w in zip(values, want):  # fp16 keeps 11 bits, float21 13
            torch.testing.assert_close(got, w, rtol=4e-3, atol=0)


# ---------------------------------------------------------------------- FOSI / DHO2
def _fosi_params() -> list[nn.Parameter]:
    torch.manual_seed(3)
    return list(nn.Linear(3, 2).double().parameters())  # n = 6 + 2 = 8


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _one_process_state() -> dict:
    from distkfac.hybrid import FOSI

    params = _fosi_params()
    g = torch.Generator().manual_seed(4)
    x, t = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g,
                                                                             dtype=torch.float64)

    def loss() -> torch.Tensor:
        return ((x @ params[0].T + params[1] - t) ** 2).mean()

    opt = FOSI(params, _sgd, ese_closure=loss, k=1, order=2, ese_every=1, warmup=1)
    for _ in range(2):
        opt.zero_grad()
        loss().backward()
        opt.step()
    return opt.state_dict()


def _dho2_loads(comm, state):
    from distkfac.hybrid import DHO2

    opt = DHO2(_fosi_params(), _sgd, comm=comm, k=1, order=2)
    opt.load_state_dict(state)
    return opt.velocity, opt.eigenvectors


def test_a_one_process_state_loaded_by_hand_gives_each_rank_its_block() -> None:
    state = _one_process_state()
    assert state["q"] == 1
    for rank, (velocity, vectors) in enumerate(run_threads(_dho2_loads, 2, state)):
        block = slice(4 * rank, 4 * rank + 4)  # 8 entries over 2 ranks
        assert torch.equal(velocity, state["velocity"][block])
        assert torch.equal(vectors, state["eigenvectors"][:1, block])


def test_the_scaling_compares_the_first_largest_pair_with_the_last() -> None:
    from distkfac.hybrid.fosi import newton_rates

    # l = 1 smallest (-0.5), then k = 2 largest (2, 4): eta = 1/|lambda| = (2, 0.5, 0.25) and
    # s = clip(eta_l / eta_{q-1}, 1, lr_clip) = clip(0.5 / 0.25, 1, 3) = 2
    eta, s = newton_rates(torch.tensor([-0.5, 2.0, 4.0], dtype=torch.float64), l=1, lr_clip=3.0)
    assert eta.tolist() == [2.0, 0.5, 0.25]
    assert s == 2.0
