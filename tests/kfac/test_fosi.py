"""FOSI on one process against dense references: the ESE's eigenpairs against ``eigh`` of the
explicit Hessian, one update against the paper's formula written out here, the schedule, and
the configurations it refuses."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distconv.comm import SingleCommunicator
from distconv.grid import ProcessorGrid
from distkfac.hybrid import DHO2, FOSI, MRDHO2
from distkfac.hybrid.space import flatten


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def tiny_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(17, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (17,),
                                                                                 generator=g)


def dense_hessian(model: nn.Module, x, y) -> torch.Tensor:
    shapes = [(name, p.shape) for name, p in model.named_parameters()]

    def loss(flat):
        params, offset = {}, 0
        for name, shape in shapes:
            params[name] = flat[offset: offset + math.prod(shape)].view(shape)
            offset += math.prod(shape)
        return F.cross_entropy(torch.func.functional_call(model, params, (x,)), y)

    return torch.autograd.functional.hessian(loss, flatten(list(model.parameters())))


def softmax_regression_hessian(model: nn.Linear, x, y) -> torch.Tensor:
    """Written out: ``H = mean_i (diag(p_i) - p_i p_i^T) ⊗ x~_i x~_i^T`` with ``x~ = [x, 1]``,
    rows and columns in the flattened order (weight row-major, then bias)."""
    c, d = model.weight.shape
    with torch.no_grad():
        p = torch.softmax(model(x), 1)
    xt = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    a = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    h = torch.einsum("iab,ij,ik->ajbk", a, xt, xt) / len(x)        # (c, d+1, c, d+1)
    index = torch.tensor([[ci * d + j if j < d else c * d + ci for j in range(d + 1)]
                          for ci in range(c)]).reshape(-1)
    out = torch.empty(c * (d + 1), c * (d + 1), dtype=x.dtype)
    out[index[:, None], index[None, :]] = h.reshape(c * (d + 1), c * (d + 1))
    return out


def tiny_case(kind: str):
    x, y = tiny_data()
    if kind == "softmax regression":
        torch.manual_seed(2)
        model = nn.Linear(4, 3).double()
        return model, x, y, softmax_regression_hessian(model, x, y)
    model = tiny_model()
    return model, x, y, dense_hessian(model, x, y)


# (softmax regression has a null space of dimension 5, which a Krylov space sees once: l = 0)
@pytest.mark.parametrize("kind,k,l", [("tanh mlp", 2, 2), ("softmax regression", 3, 0)])
def test_ese_eigenpairs_equal_eigh_of_the_explicit_hessian(kind, k, l):
    model, x, y, hess = tiny_case(kind)
    lam, u = torch.linalg.eigh(hess)
    n = len(lam)
    opt = FOSI(model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1), k=k, l=l, order=n,
               ese_closure=lambda: F.cross_entropy(model(x), y))
    res = opt.estimate()
    sel = list(range(l)) + list(range(n - k, n))
    torch.testing.assert_close(res.eigenvalues, lam[sel], rtol=0, atol=1e-10)
    # eigenvectors up to sign: compare the projectors
    for i, j in enumerate(sel):
        e = res.eigenvectors[i]
        torch.testing.assert_close(torch.outer(e, e), torch.outer(u[:, j], u[:, j]), rtol=0,
                                   atol=1e-9)
    assert res.basis_bytes == 8 * res.steps * n


def orthonormal_rows(q: int, n: int, seed: int) -> torch.Tensor:
    a = torch.randn(n, q, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.linalg.qr(a)[0].T.contiguous()


def install(opt, e, lam, l):
    opt.set_eigenpairs(lam, e, l=l)


def test_sgd_momentum_update_equals_formula():
    """Two steps with fixed eigenpairs (l = 1, k = 2) against the formula, heavy-ball base."""
    n, lr, mu, alpha, clip = 9, 0.1, 0.9, 0.3, 3.0
    theta = nn.Parameter(torch.linspace(-1, 1, n, dtype=torch.float64))
    opt = FOSI([theta], lambda ps: torch.optim.SGD(ps, lr=lr, momentum=mu), k=2, l=1, order=3,
               alpha=alpha, lr_clip=clip, warmup=1000)
    e = orthonormal_rows(3, n, 0)
    lam = torch.tensor([-0.5, 2.0, 8.0], dtype=torch.float64)
    install(opt, e, lam, 1)
    eta = 1 / lam.abs()
    s = min(max((1 / 2.0) / (1 / 8.0), 1.0), clip)       # eta_l / eta_max = 4, clipped to 3
    assert opt.scaling == s
    gs = torch.randn(2, n, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    th, v, buf = theta.detach().clone(), torch.zeros(n, dtype=torch.float64), None
    for g in gs:
        g1 = e.T @ (e @ g)
        g2 = g - g1
        v = g1 + mu * v
        newton = e.T @ (eta * (e @ v))
        buf = g2.clone() if buf is None else mu * buf + g2
        delta = -lr * buf
        delta = delta - e.T @ (e @ delta)
        th = th + s * delta - alpha * newton
        theta.grad = g.clone()
        opt.step()
        torch.testing.assert_close(theta.detach(), th, rtol=0, atol=1e-12)


def test_adam_update_equals_formula():
    n, lr, b1, eps = 7, 0.01, 0.8, 1e-8
    theta = nn.Parameter(torch.linspace(0, 1, n, dtype=torch.float64))
    opt = FOSI([theta], lambda ps: torch.optim.Adam(ps, lr=lr, betas=(b1, 0.99), eps=eps), k=1,
               order=1, warmup=1000)
    assert opt.lr_clip == 1.0 and opt.alpha == 0.1     # the authors' Adam defaults
    e = orthonormal_rows(1, n, 1)
    install(opt, e, torch.tensor([4.0], dtype=torch.float64), 0)
    g = torch.randn(n, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    g1 = e.T @ (e @ g)
    g2 = g - g1
    newton = e.T @ ((e @ ((1 - b1) * g1)) / 4.0)
    delta = -lr * g2 / (g2.abs() + eps)                  # Adam's first step, bias-corrected
    delta = delta - e.T @ (e @ delta)
    expected = theta.detach() + delta - 0.1 * newton
    theta.grad = g
    opt.step()
    torch.testing.assert_close(theta.detach(), expected, rtol=0, atol=1e-12)


def test_before_warmup_fosi_is_its_base_optimizer_and_ese_follows_the_schedule():
    model, (x, y) = tiny_model(), tiny_data()
    twin = tiny_model()
    calls = []

    def closure():
        calls.append(opt.steps + 1)
        return F.cross_entropy(model(x), y)

    opt = FOSI(model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), k=2,
               ese_every=3, warmup=4, ese_closure=closure)
    sgd = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    for _ in range(9):
        for m, o in ((model, opt), (twin, sgd)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
        if opt.steps < 4:
            torch.testing.assert_close(flatten(list(model.parameters())),
                                       flatten(list(twin.parameters())), rtol=0, atol=1e-15)
    assert calls == [4, 7]
    assert "FOSI(n=43, k=2, l=0, order=8, ese_every=3, warmup=4" in repr(opt)


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.1)


@pytest.mark.parametrize("kw,match", [
    (dict(k=3, l=2, order=4), "order"),
    (dict(k=20), "order"),                               # default 4(k+l) = 80 > n = 43
    (dict(k=0, l=0), "k \\+ l"),
    (dict(k=-1), "k must"),
    (dict(alpha=float("nan")), "alpha"),
    (dict(lr_clip=0.5), "lr_clip"),
    (dict(ese_every=0), "ese_every"),
    (dict(base=lambda ps: torch.optim.SGD(ps, lr=float("inf"))), "lr"),
])
def test_bad_configurations_are_refused_naming_the_argument(kw, match):
    kw = {"base": _sgd, **kw}
    base = kw.pop("base")
    with pytest.raises(ValueError, match=match):
        FOSI(tiny_model().parameters(), base, **kw)


def test_bad_types_are_refused():
    with pytest.raises(TypeError, match="base"):
        FOSI(tiny_model().parameters(), "sgd")
    mixed = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    with pytest.raises(TypeError, match="dtype"):
        FOSI(mixed, _sgd, k=1, order=2)
    with pytest.raises(TypeError, match="comm"):
        DHO2(tiny_model().parameters(), _sgd, comm=None)
    with pytest.raises(TypeError, match="comm"):
        MRDHO2(tiny_model().parameters(), _sgd, comm=None)
    with pytest.raises(TypeError, match="exactly one"):
        DHO2(tiny_model().parameters(), _sgd, comm=SingleCommunicator(),
             grid=ProcessorGrid({"N": 1}, comm=SingleCommunicator()))


def test_parameters_cannot_be_added_after_flattening():
    opt = FOSI(tiny_model().parameters(), _sgd, k=1)
    with pytest.raises(NotImplementedError, match="constructor"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, dtype=torch.float64))]})


def test_estimate_without_a_closure_says_what_to_pass():
    opt = FOSI(tiny_model().parameters(), _sgd, k=1)
    with pytest.raises(ValueError, match="ese_closure"):
        opt.estimate()
