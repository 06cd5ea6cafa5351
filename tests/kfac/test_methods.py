"""Decomposition methods: damped inverses, their agreement, and fp32 failure handling."""
from __future__ import annotations

import pytest
import torch

from distkfac.methods import EigenMethod, InverseMethod, method_for


def spd(groups: int, d: int, dtype=torch.float64) -> torch.Tensor:
    m = torch.randn(groups, d, d + 2, dtype=dtype, generator=torch.Generator().manual_seed(d))
    return m @ m.transpose(1, 2) / d


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_damped_inverse_is_inverse_of_factor_plus_sqrt_damping(method, symmetric):
    m = method_for(method, symmetric=symmetric)
    f, lam = spd(2, 5), 4e-2
    payload = m.decompose(f, lam)
    assert payload.numel() == m.payload_numel(2, 5)
    inv = m.damped_inverse(payload, 2, 5, lam)
    torch.testing.assert_close(inv @ (f + lam ** 0.5 * torch.eye(5, dtype=f.dtype)),
                               torch.eye(5, dtype=f.dtype).expand(2, 5, 5))


def test_eigen_direct_and_inverse_forms_agree():
    a, g, lam = spd(1, 6), spd(1, 4), 1e-2
    grad = torch.randn(1, 4, 6, dtype=torch.float64)
    e, i = EigenMethod(), InverseMethod()
    pa, pg = e.decompose(a, lam), e.decompose(g, lam)
    direct = e.precondition(grad, pa, pg, 1, 6, 4, lam)
    formed = e.damped_inverse(pg, 1, 4, lam) @ grad @ e.damped_inverse(pa, 1, 6, lam)
    chol = i.precondition(grad, i.decompose(a, lam), i.decompose(g, lam), 1, 6, 4, lam)
    torch.testing.assert_close(direct, formed)
    torch.testing.assert_close(direct, chol)


def test_eigen_falls_back_to_fp64_when_fp32_eigh_returns_nan(monkeypatch):
    real = torch.linalg.eigh

    def flaky(x):
        evals, evecs = real(x)
        if x.dtype == torch.float32:
            evecs = evecs.clone()
            evecs[..., 0, 0] = float("nan")
        return evals, evecs

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    f = spd(1, 5, torch.float32)
    payload = EigenMethod().decompose(f, 1e-3)
    assert payload.dtype == torch.float32 and bool(torch.isfinite(payload).all())
    inv = EigenMethod().damped_inverse(payload, 1, 5, 1e-3)
    want = torch.linalg.inv(f.double() + 1e-3 ** 0.5 * torch.eye(5, dtype=torch.float64))
    torch.testing.assert_close(inv.double(), want, rtol=1e-4, atol=1e-5)


def test_non_finite_factor_raises_floating_point_error():
    f = spd(1, 3)
    f[0, 1, 1] = float("inf")
    with pytest.raises(FloatingPointError, match="NaN or Inf"):
        EigenMethod().decompose(f, 1e-3)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_rows_per_group_are_independent_of_packing_and_split_by_group(method):
    """by_group rows: the same for packed and unpacked payloads, each group's row formed
    from that group alone (so a block of rows is the payload of a block of groups)."""
    f, lam = spd(3, 4), 1e-2
    packed, plain = method_for(method, symmetric=True), method_for(method, symmetric=False)
    rows = packed.by_group(packed.decompose(f, lam), 3, 4)
    assert rows.shape == (3, packed.group_numel(4))
    torch.testing.assert_close(plain.by_group(plain.decompose(f, lam), 3, 4), rows)
    for m in (packed, plain):
        back = m.from_groups(rows, 3, 4)
        torch.testing.assert_close(m.damped_inverse(back, 3, 4, lam),
                                   torch.linalg.inv(f + lam ** 0.5 * torch.eye(4, dtype=f.dtype)))
        one = m.from_groups(rows[1:2], 1, 4)  # group 1 alone
        torch.testing.assert_close(m.damped_inverse(one, 1, 4, lam)[0],
                                   torch.linalg.inv(f[1] + lam ** 0.5 * torch.eye(4,
                                                                                dtype=f.dtype)))
