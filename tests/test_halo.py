"""Halo plans (pure index math), halo exchange and its adjoint (halo accumulate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from distconv.conv_geometry import (
    PADDING_MODES, ConvDim, HaloPlan, block_range, check_padding_mode, normalize_padding,
)
from distconv.distribution import balanced_block
from distconv.grid import ProcessorGrid
from distconv.halo import halo_accumulate, halo_exchange
from distconv.testing import run_threads

RELAXED = [HealthCheck.too_slow, HealthCheck.filter_too_much]  # assume() on padding modes


@st.composite
def split_dims(draw: st.DrawFn) -> tuple[ConvDim, int]:
    kernel = draw(st.integers(1, 5))
    dilation = draw(st.integers(1, 3))
    stride = draw(st.integers(1, 3))
    span = dilation * (kernel - 1) + 1
    pad_before, pad_after = draw(st.integers(0, span)), draw(st.integers(0, span))
    length = draw(st.integers(max(1, span - pad_before - pad_after), 14))
    dim = ConvDim(length, kernel, stride, dilation, pad_before, pad_after)
    parts = draw(st.integers(1, max(1, min(length, dim.out_length, 5))))
    return dim, parts


@settings(max_examples=150, deadline=None, suppress_health_check=RELAXED)
@given(split_dims(), st.sampled_from(PADDING_MODES))
def test_local_conv_of_halo_block_is_block_of_global_conv(case: tuple[ConvDim, int],
                                                          mode: str) -> None:
    dim, parts = case
    assume(_mode_fits(dim, mode))
    plan = HaloPlan(dim, parts, mode)
    plan.check("H")
    x = torch.randn(1, 1, dim.length, dtype=torch.float64)
    k = torch.randn(1, 1, dim.kernel, dtype=torch.float64)
    full = F.conv1d(F.pad(x, (dim.pad_before, dim.pad_after),
                          mode="constant" if mode == "zeros" else mode),
                    k, stride=dim.stride, dilation=dim.dilation)
    assert full.shape[-1] == dim.out_length
    for r in range(parts):
        lo, hi = plan.needed[r]
        src = torch.tensor(plan.sources[r])
        local = torch.where(src >= 0, x[..., src.clamp(min=0)], 0.0)
        assert local.shape[-1] == plan.local_length[r]
        if mode == "zeros":
            pieces = [plan.transfer(q, r) for q in range(parts)]
            assert sum(b - a for a, b in pieces) == hi - lo
            assert all(plan.rows_from(q, r) == tuple(range(*pieces[q])) for q in range(parts))
        y = F.conv1d(local, k, stride=dim.stride, dilation=dim.dilation)
        o0, o1 = plan.out[r]
        torch.testing.assert_close(y, full[..., o0:o1], rtol=0, atol=1e-12)


@given(st.integers(0, 40), st.integers(1, 9))
def test_block_range_matches_distribution_blocks(n: int, parts: int) -> None:
    for i in range(parts):
        start, stop = block_range(n, parts, i)
        assert (start, stop - start) == balanced_block(n, parts, i)


def test_same_padding_puts_the_odd_row_at_the_end() -> None:
    assert normalize_padding("same", (4, 3), (1, 1), (1, 2)) == ((1, 2), (2, 2))
    assert normalize_padding("valid", (4, 3), (2, 2), (1, 1)) == ((0, 0), (0, 0))


def test_too_many_parts_raises_saying_what_works() -> None:
    plan = HaloPlan(ConvDim(7, 3, stride=2), 4)
    try:
        plan.check("H")
    except ValueError as e:
        assert "use H <= 3" in str(e)
    else:
        raise AssertionError("expected ValueError")



@st.composite
def halo_cases(draw: st.DrawFn) -> tuple[ConvDim, ConvDim, int, int, str]:
    dims = []
    for _ in range(2):
        kernel, dilation, stride = draw(st.integers(1, 4)), draw(st.integers(1, 2)), draw(
            st.integers(1, 3))
        span = dilation * (kernel - 1) + 1
        p0, p1 = draw(st.integers(0, span)), draw(st.integers(0, span))
        length = draw(st.integers(max(1, span - p0 - p1), 11))
        dims.append(ConvDim(length, kernel, stride, dilation, p0, p1))
    ph = draw(st.integers(1, max(1, min(4, dims[0].length, dims[0].out_length))))
    pw = draw(st.integers(1, max(1, min(8 // ph, dims[1].length, dims[1].out_length))))
    mode = draw(st.sampled_from(PADDING_MODES))
    for d in dims:
        assume(_mode_fits(d, mode))
    return dims[0], dims[1], ph, pw, mode


def _mode_fits(d: ConvDim, mode: str) -> bool:
    try:
        check_padding_mode(d, mode, "H")
    except ValueError:
        return False
    return True


def _halo_rank(comm, dh: ConvDim, dw: ConvDim, ph: int, pw: int, mode: str):  # noqa: ANN001, ANN202
    grid = ProcessorGrid({"H": ph, "W": pw}, comm=comm)
    plans = HaloPlan(dh, ph, mode), HaloPlan(dw, pw, mode)
    gen = torch.Generator().manual_seed(7)
    X = torch.randn(2, 3, dh.length, dw.length, generator=gen, dtype=torch.float64)
    G = torch.randn(2, 3, sum(plans[0].local_length), sum(plans[1].local_length), generator=gen,
                    dtype=torch.float64)
    h, w = grid.coords["H"], grid.coords["W"]
    (h0, h1), (w0, w1) = plans[0].owned[h], plans[1].owned[w]
    x = X[:, :, h0:h1, w0:w1].clone().requires_grad_(True)
    y = halo_exchange(x, grid.subcomm(["H"]), plans[0], 2)
    y = halo_exchange(y, grid.subcomm(["W"]), plans[1], 3)
    padded = F.pad(X, (dw.pad_before, dw.pad_after, dh.pad_before, dh.pad_after),
                   mode="constant" if mode == "zeros" else mode)
    (a, b), (c, d) = (dim.input_range(*plan.out[i]) for dim, plan, i in
                      ((dh, plans[0], h), (dw, plans[1], w)))
    hb, wb = dh.pad_before, dw.pad_before
    expected = padded[:, :, a + hb:b + hb, c + wb:d + wb]
    r0, c0 = sum(plans[0].local_length[:h]), sum(plans[1].local_length[:w])
    g = G[:, :, r0:r0 + y.shape[2], c0:c0 + y.shape[3]]
    y.backward(g)
    return torch.equal(y.detach(), expected), float((y.detach() * g).sum()), float(
        (x.detach() * x.grad).sum())


@settings(max_examples=40, deadline=None, suppress_health_check=RELAXED)
@given(halo_cases())
def test_halo_exchange_gathers_the_rows_each_output_block_reads(case) -> None:  # noqa: ANN001
    results = run_threads(_halo_rank, case[2] * case[3], *case)
    assert all(ok for ok, _, _ in results)


@settings(max_examples=40, deadline=None, suppress_health_check=RELAXED)
@given(halo_cases())
def test_halo_accumulate_is_adjoint_of_halo_exchange(case) -> None:  # noqa: ANN001
    results = run_threads(_halo_rank, case[2] * case[3], *case)
    lhs = sum(r[1] for r in results)
    rhs = sum(r[2] for r in results)
    assert abs(lhs - rhs) <= 1e-10 * max(1.0, abs(lhs))


def _accumulate_rank(comm):  # noqa: ANN001, ANN202
    plan = HaloPlan(ConvDim(5, 3, 1, 1, 1, 1), comm.size)
    g = torch.ones(1, plan.local_length[comm.rank])
    return halo_accumulate(g, comm, plan, 1)


def test_halo_accumulate_adds_halo_gradients_into_owner_rows() -> None:
    # 5 rows over 2 ranks (3 + 2), kernel 3, padding 1: each rank reads one row of the other.
    out = run_threads(_accumulate_rank, 2)
    assert out[0].tolist() == [[1.0, 1.0, 2.0]]
    assert out[1].tolist() == [[2.0, 1.0]]
