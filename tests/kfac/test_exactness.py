"""Single-process exactness in fp64 against dense references."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distkfac
from distkfac import layers
from distkfac.layers import Conv2dAdapter, conv_input_cov

from .reference import dense_precondition, grad_matrix, reference_factors


@pytest.fixture(autouse=True)
def float64_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


CONVS = [
    dict(kernel_size=3, stride=1, padding=1),
    dict(kernel_size=(4, 2), padding="same", dilation=(1, 2)),
    dict(kernel_size=2, stride=2, padding="valid", bias=False),
    dict(kernel_size=3, stride=(2, 1), padding=2, dilation=2),
    dict(kernel_size=(3, 2), padding=1, groups=2, padding_mode="reflect"),
    dict(kernel_size=3, padding="same", groups=4),  # depthwise
    dict(kernel_size=1, stride=2),
]


def tiny_model(conv_kw: dict, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(4, 4, **conv_kw), nn.Tanh(), nn.Flatten(),
                         nn.LazyLinear(3)).double()


def batch(seed: int = 1, n: int = 5, hw: tuple[int, int] = (7, 6)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, *hw, generator=g), torch.randint(0, 3, (n,), generator=g)


def run_kfac(model, x, y, **kw):
    kw.setdefault("factor_dtype", torch.float64)
    kfac = distkfac.KFAC(model, **kw)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    raw = {m: grad_matrix(m).clone() for m in model.modules()
           if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))}
    kfac.step()
    return kfac, raw


@pytest.mark.parametrize("conv_kw", CONVS)
def test_conv_input_cov_equals_unfold_gram(conv_kw):
    conv = nn.Conv2d(4, 6 if conv_kw.get("groups", 1) != 4 else 4, **conv_kw)
    x = torch.randn(3, 4, 9, 8)
    xp = Conv2dAdapter(conv, "c").pad(x)
    got, rows = conv_input_cov(xp, conv.kernel_size, stride=conv.stride,
                               dilation=conv.dilation, groups=conv.groups,
                               bias=conv.bias is not None)
    u = F.unfold(xp, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    u = u.reshape(3, conv.groups, -1, u.shape[-1])
    if conv.bias is not None:
        u = torch.cat([u, u.new_ones(3, conv.groups, 1, u.shape[-1])], 2)
    assert rows == 3 * u.shape[-1]
    torch.testing.assert_close(got, torch.einsum("ngil,ngjl->gij", u, u), rtol=1e-12, atol=1e-12)


def unfold_gram(conv: nn.Conv2d, xp: torch.Tensor) -> torch.Tensor:
    """Gram matrix of the explicit im2col of an already padded input, per group."""
    u = F.unfold(xp, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    u = u.reshape(xp.shape[0], conv.groups, -1, u.shape[-1])
    return torch.einsum("ngil,ngjl->gij", u, u)


@pytest.mark.parametrize("conv_kw", [kw for kw in CONVS if kw.get("stride", 1) in (1, (2, 1))])
@pytest.mark.parametrize("hw", [(9, 8), (6, 13)])
def test_2d_lag_cov_equals_unfold_gram(conv_kw, hw):
    """The column-stride-1 path on its own, also where it is not the faster one: zero padding
    applied on the fly, other padding modes beforehand."""
    conv = nn.Conv2d(4, 4, **conv_kw)
    x = torch.randn(3, 4, *hw)
    xp = Conv2dAdapter(conv, "c").pad(x)
    if conv.padding_mode == "zeros":
        inp, padding = x, layers._conv_padding(conv)
    else:
        inp, padding = xp, (0, 0, 0, 0)
    (kh, kw), (sh, _), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
    ho, wo = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1, xp.shape[3] - dw * (kw - 1)
    rows = [slice(dh * p, dh * p + sh * (ho - 1) + 1, sh) for p in range(kh)]
    got = layers._cov_by_2d_lags(inp, padding, conv.kernel_size, wo, rows, conv.dilation,
                                 conv.groups)
    torch.testing.assert_close(got, unfold_gram(conv, xp), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("conv_kw", [dict(kernel_size=3, padding=1),
                                     dict(kernel_size=3, padding=1, groups=2, bias=False),
                                     dict(kernel_size=(3, 5), padding=(1, 4), dilation=(1, 2))])
def test_conv_input_cov_on_wide_inputs_takes_2d_lags(conv_kw):
    conv = nn.Conv2d(32, 32, **conv_kw)
    x = torch.randn(2, 32, 12, 40)
    adapter = Conv2dAdapter(conv, "c")
    xp = adapter.pad(x)
    wo = xp.shape[3] - conv.dilation[1] * (conv.kernel_size[1] - 1)
    rows = [slice(conv.dilation[0] * p, conv.dilation[0] * p + x.shape[2])
            for p in range(conv.kernel_size[0])]
    padding = layers._conv_padding(conv)
    live = layers._live_rows(rows, xp.shape[2], padding[2:])
    assert layers._prefer_2d_lags(conv.kernel_size, conv.dilation, live, x.shape[3], wo,
                                  padding[0], 32 // conv.groups)
    got, _ = adapter.a_sum(x, torch.float64)
    want = unfold_gram(conv, xp)
    if conv.bias is not None:
        got = got[:, :-1, :-1]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("stride", [1, 2])
def test_conv_input_cov_is_exactly_symmetric(stride, dtype):
    """Lower blocks are mirrors of upper ones and diagonal blocks are symmetrised, so eigh and
    upper-triangle packing see the same matrix."""
    conv = nn.Conv2d(16, 16, 3, stride=stride, padding=1)
    x = torch.randn(4, 16, 20, 24, dtype=dtype)
    got, _ = Conv2dAdapter(conv, "c").a_sum(x, dtype)
    assert torch.equal(got, got.mT)


@pytest.mark.parametrize("conv_kw", [dict(kernel_size=3, padding=1),
                                     dict(kernel_size=3, stride=2, padding=1),
                                     dict(kernel_size=3, padding=1, padding_mode="reflect")])
def test_conv_input_cov_of_channels_last_input(conv_kw):
    conv = nn.Conv2d(16, 16, **conv_kw)
    x = torch.randn(3, 16, 20, 24).to(memory_format=torch.channels_last)
    adapter = Conv2dAdapter(conv, "c")
    got, _ = adapter.a_sum(x, torch.float64)
    torch.testing.assert_close(got[:, :-1, :-1], unfold_gram(conv, adapter.pad(x)),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("conv_kw", CONVS)
def test_factors_equal_per_sample_sums(conv_kw):
    model = tiny_model(conv_kw)
    x, y = batch()
    model(x)
    ref = reference_factors(model, x, y, F.cross_entropy)
    kfac, _ = run_kfac(model, x, y)
    for layer in kfac.layers:
        A, G = ref[layer.adapter.module]
        torch.testing.assert_close(layer.a.value, A, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(layer.g.value, G, rtol=1e-10, atol=1e-12)


ND_CONVS = [
    (nn.Conv1d, dict(kernel_size=3, padding=1)),
    (nn.Conv1d, dict(kernel_size=4, stride=2, dilation=2, padding="valid", groups=2)),
    (nn.Conv1d, dict(kernel_size=2, padding="same", padding_mode="reflect", bias=False)),
    (nn.Conv3d, dict(kernel_size=3, padding=1)),
    (nn.Conv3d, dict(kernel_size=(2, 3, 1), stride=(1, 2, 1), padding=(1, 0, 1), groups=4)),
    (nn.Conv3d, dict(kernel_size=2, padding="same", dilation=(1, 2, 1),
                     padding_mode="circular")),
]


@pytest.mark.parametrize("cls, conv_kw", ND_CONVS)
def test_conv1d_and_conv3d_factors_equal_per_sample_sums(cls, conv_kw):
    """Conv1d and Conv3d: A and G are the means of the outer products of each sample's patches
    (gathered with explicit indices) and of its own output gradients; the preconditioned
    gradient is the dense Kronecker solve."""
    torch.manual_seed(0)
    model = nn.Sequential(cls(4, 4, **conv_kw), nn.Tanh(), nn.Flatten(), nn.LazyLinear(3))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4, *((7,) if cls is nn.Conv1d else (4, 5, 3)), generator=g)
    y = torch.randint(0, 3, (5,), generator=g)
    model(x)
    ref = reference_factors(model, x, y, F.cross_entropy)
    damping = 3e-2
    kfac, raw = run_kfac(model, x, y, damping=damping, kl_clip=None)
    assert isinstance(kfac.layers[0].adapter, layers.ConvNdAdapter)
    for layer in kfac.layers:
        m = layer.adapter.module
        A, G = ref[m]
        torch.testing.assert_close(layer.a.value, A, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(layer.g.value, G, rtol=1e-10, atol=1e-12)
        want = dense_precondition(A, G, raw[m], damping)
        torch.testing.assert_close(grad_matrix(m), want, rtol=1e-8, atol=1e-10)


def test_linear_factors_with_sequence_dims():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(4, 5, 3), torch.randint(0, 2, (4, 5))
    ref = reference_factors(model, x, y, lambda o, t: F.cross_entropy(o.transpose(1, 2), t))
    kfac = distkfac.KFAC(model, factor_dtype=torch.float64)
    F.cross_entropy(model(x).transpose(1, 2), y).backward()
    kfac.step()
    for layer in kfac.layers:
        A, G = ref[layer.adapter.module]
        torch.testing.assert_close(layer.a.value, A)
        torch.testing.assert_close(layer.g.value, G)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("conv_kw", CONVS[:1] + CONVS[4:6])
def test_preconditioned_grad_equals_dense_solve(conv_kw, method):
    model = tiny_model(conv_kw)
    x, y = batch()
    model(x)
    ref = reference_factors(model, x, y, F.cross_entropy)
    damping = 3e-2
    kfac, raw = run_kfac(model, x, y, damping=damping, kl_clip=None, compute_method=method)
    for layer in kfac.layers:
        m = layer.adapter.module
        A, G = ref[m]
        want = dense_precondition(A, G, raw[m], damping)
        torch.testing.assert_close(grad_matrix(m), want, rtol=1e-8, atol=1e-10)


def test_eigen_equals_inverse_over_steps():
    grads = []
    for method in ("eigen", "inverse"):
        model = tiny_model(CONVS[1])
        x, y = batch()
        model(x)
        kfac = distkfac.KFAC(model, compute_method=method, factor_dtype=torch.float64,
                             damping=1e-2, inv_update_steps=2, factor_update_steps=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            xb, yb = batch(seed=step)
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            kfac.step()
            opt.step()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)


def test_kl_clip_scales_by_eq18():
    lr, kappa = 0.5, 1e-4
    model = tiny_model(CONVS[0])
    x, y = batch()
    model(x)
    kfac, raw = run_kfac(model, x, y, kl_clip=None, lr=lr)
    unclipped = {layer.adapter.module: grad_matrix(layer.adapter.module).clone()
                 for layer in kfac.layers}
    vg = lr * lr * sum(float((unclipped[m] * raw[m]).sum()) for m in raw)
    nu = min(1.0, math.sqrt(kappa / abs(vg)))
    assert nu < 1.0
    model2 = tiny_model(CONVS[0])
    model2(x)
    kfac2, _ = run_kfac(model2, x, y, kl_clip=kappa, lr=lr)
    assert kfac2.last_kl_scale == pytest.approx(nu, rel=1e-12)
    for layer in kfac2.layers:
        m1 = next(mm for mm in unclipped if mm.weight.shape == layer.adapter.module.weight.shape)
        torch.testing.assert_close(grad_matrix(layer.adapter.module), nu * unclipped[m1])


def test_factor_ema_and_schedules():
    model = tiny_model(CONVS[0])
    x, y = batch()
    model(x)
    decay = 0.7
    kfac = distkfac.KFAC(model, factor_dtype=torch.float64, factor_decay=decay,
                         factor_update_steps=lambda s: 2, inv_update_steps=4)
    twin = tiny_model(CONVS[0])
    twin(x)
    seen = [reference_factors(twin, *batch(seed=10 + step), F.cross_entropy) for step in (0, 2)]
    seen = [dict(zip((model[0], model[3]), s.values())) for s in seen]
    for step in range(4):
        xb, yb = batch(seed=10 + step)
        model.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        kfac.step()
    for layer in kfac.layers:
        m = layer.adapter.module
        want = decay * seen[0][m][0] + (1 - decay) * seen[1][m][0]
        torch.testing.assert_close(layer.a.value, want)
        assert layer.a.updates == 2


def test_factors_are_fp32_for_low_precision_activations():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).to(torch.bfloat16)
    kfac = distkfac.KFAC(model)
    model(torch.randn(6, 4, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    kfac.step()
    assert kfac.layers[0].a.value.dtype == torch.float32
    assert kfac.layers[0].a_payload.dtype == torch.float32
    assert model[0].weight.grad.dtype == torch.bfloat16


def test_state_dict_roundtrip_continues_identically():
    def train(kfac, model, steps, start):
        for step in range(start, start + steps):
            xb, yb = batch(seed=step)
            model.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            kfac.step()

    model = tiny_model(CONVS[0])
    model(batch()[0])
    kfac = distkfac.KFAC(model, factor_dtype=torch.float64, inv_update_steps=3)
    train(kfac, model, 2, 0)
    state = kfac.state_dict()
    assert state["steps"] == 2 and state["settings"]["inv_update_steps"] == 3
    model2 = tiny_model(CONVS[0])
    model2(batch()[0])
    model2.load_state_dict(model.state_dict())
    kfac2 = distkfac.KFAC(model2, factor_dtype=torch.float64)
    kfac2.load_state_dict(state)
    assert kfac2.inv_update_steps == 3 and kfac2.steps == 2
    train(kfac, model, 1, 2)
    train(kfac2, model2, 1, 2)
    for p, q in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_repr_shows_every_setting():
    model = tiny_model(CONVS[0])
    model(batch()[0])
    text = repr(distkfac.KFAC(model, damping=0.02))
    for key in ("factor_update_steps", "inv_update_steps", "damping=0.02", "factor_decay",
                "kl_clip", "lr", "compute_method", "placement", "symmetric_comm",
                "bucket_bytes", "factor_dtype", "skip_layers"):
        assert key in text


@pytest.mark.parametrize("kw, exc", [
    (dict(compute_method="svd"), ValueError), (dict(placement="random"), ValueError),
    (dict(damping=0.0), ValueError), (dict(factor_decay=1.0), ValueError),
    (dict(factor_update_steps=0), ValueError), (dict(lr="fast"), TypeError),
    (dict(factor_dtype=torch.float16), ValueError), (dict(bucket_bytes=-1), ValueError),
    (dict(grid=object()), TypeError), (dict(comm="world"), TypeError),
])
def test_bad_settings_raise(kw, exc):
    with pytest.raises(exc, match=next(iter(kw))):
        distkfac.KFAC(nn.Linear(2, 2), **kw)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_stale_decompositions_and_changing_damping(method):
    """Between inverse updates the step-0 decompositions are used; eigen applies the current
    damping, inverse the damping it was formed with."""
    model = tiny_model(CONVS[0])
    x0, y0 = batch(seed=3)
    x1, y1 = batch(seed=4)
    model(x0)
    twin = tiny_model(CONVS[0])
    twin(x0)
    ref = list(reference_factors(twin, x0, y0, F.cross_entropy).values())
    damping = {0: 1e-2, 1: 5e-2}
    kfac = distkfac.KFAC(model, compute_method=method, factor_dtype=torch.float64, kl_clip=None,
                         damping=lambda s: damping[s], inv_update_steps=10)
    F.cross_entropy(model(x0), y0).backward()
    kfac.step()
    model.zero_grad()
    F.cross_entropy(model(x1), y1).backward()
    raw = [grad_matrix(m).clone() for m in (model[0], model[3])]
    kfac.step()
    lam = damping[1] if method == "eigen" else damping[0]
    for m, (A, G), v in zip((model[0], model[3]), ref, raw):
        torch.testing.assert_close(grad_matrix(m), dense_precondition(A, G, v, lam))


TRANSPOSED = [
    (nn.ConvTranspose1d, dict(kernel_size=3, stride=2, padding=1, output_padding=1)),
    (nn.ConvTranspose1d, dict(kernel_size=2, stride=3, padding=2, dilation=2, groups=2,
                              bias=False)),
    (nn.ConvTranspose2d, dict(kernel_size=(3, 2), stride=(2, 1), padding=(0, 1))),
    (nn.ConvTranspose3d, dict(kernel_size=2, stride=2, groups=4)),
]


def _transposed_case(cls: type, conv_kw: dict) -> tuple:
    torch.manual_seed(0)
    conv = cls(4, 4, **conv_kw).double()
    g = torch.Generator().manual_seed(1)
    dims = {nn.ConvTranspose1d: (5,), nn.ConvTranspose2d: (4, 3),
            nn.ConvTranspose3d: (3, 2, 3)}[cls]
    x = torch.randn(3, 4, *dims, generator=g, dtype=torch.float64)
    y = conv(x)
    t = torch.randn(y.shape, generator=g, dtype=torch.float64)
    (y * t).sum().backward()
    return conv, x, t


@pytest.mark.parametrize("cls, conv_kw", TRANSPOSED)
def test_transposed_patches_and_output_gradients_give_the_weight_gradient(cls, conv_kw):
    """K-FAC's premise for a transposed convolution: the weight gradient autograd computes is
    the sum over output positions of the output gradient times that position's patch (the
    im2col row of the equivalent direct convolution); and the weight maps to the factors'
    matrix and back unchanged."""
    conv, x, t = _transposed_case(cls, conv_kw)
    adapter = layers.adapter_for(conv, "up")
    assert isinstance(adapter, layers.ConvTransposeAdapter)
    rows = adapter.patches(x)  # (groups, rows, in/g * prod(k))
    if adapter.has_bias:
        rows = torch.cat([rows, rows.new_ones(*rows.shape[:2], 1)], dim=2)
    g = adapter.groups
    d = t.reshape(t.shape[0], g, -1, math.prod(t.shape[2:])).permute(1, 0, 3, 2).reshape(
        g, rows.shape[1], -1)  # (groups, rows, out/g) in the rows' order
    want = adapter.grad_matrix(torch.float64)
    torch.testing.assert_close(d.transpose(1, 2) @ rows, want, rtol=1e-10, atol=1e-12)
    before = conv.weight.grad.clone()
    adapter.set_grad(want)
    assert torch.equal(conv.weight.grad, before)


def test_transposed_patches_of_a_signal_by_their_definition():
    """ConvTranspose1d: row q of the patches holds x[i, p] at kernel offset k where the input
    row p scatters through offset K-1-k of the flipped kernel into q (p·s - padding + (K-1-k)·d
    = q), zero elsewhere -- written out index by index."""
    conv, x, _ = _transposed_case(*TRANSPOSED[0])
    adapter = layers.adapter_for(conv, "up")
    K, s, pad, dil = conv.kernel_size[0], conv.stride[0], conv.padding[0], conv.dilation[0]
    out_len = conv(x).shape[2]
    want = torch.zeros(x.shape[0] * out_len, 4 * K, dtype=torch.float64)
    for n in range(x.shape[0]):
        for q in range(out_len):
            for i in range(4):
                for k in range(K):
                    for p in range(x.shape[2]):
                        if p * s - pad + (K - 1 - k) * dil == q:
                            want[n * out_len + q, i * K + k] = x[n, i, p]
    torch.testing.assert_close(adapter.patches(x)[0], want, rtol=0, atol=0)


@pytest.mark.parametrize("cls, conv_kw", TRANSPOSED[:3])
def test_kfac_preconditions_a_transposed_convolution_by_the_dense_solve(cls, conv_kw):
    """One step of K-FAC on a network with a transposed convolution: A is the mean outer
    product of its patches, G of ``N dL/dy`` over the output positions, and its preconditioned
    gradient is the dense Kronecker solve of them."""
    conv, x, _ = _transposed_case(cls, conv_kw)
    conv.zero_grad()
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.LazyLinear(3)).double()
    y = torch.randint(0, 3, (x.shape[0],), generator=torch.Generator().manual_seed(2))
    model(x)
    damping = 3e-2
    kfac = distkfac.KFAC(model, factor_dtype=torch.float64, damping=damping, kl_clip=None)
    out = conv(x)
    out.retain_grad()
    F.cross_entropy(model[1:](out), y).backward()
    adapter = next(ly.adapter for ly in kfac.layers if ly.adapter.module is conv)
    raw = adapter.grad_matrix(torch.float64).clone()
    kfac.step()
    layer = next(ly for ly in kfac.layers if ly.adapter.module is conv)
    rows = adapter.patches(x)
    if adapter.has_bias:
        rows = torch.cat([rows, rows.new_ones(*rows.shape[:2], 1)], dim=2)
    torch.testing.assert_close(layer.a.value, rows.transpose(1, 2) @ rows / rows.shape[1],
                               rtol=1e-10, atol=1e-12)
    g = adapter.groups
    d = (x.shape[0] * out.grad).reshape(x.shape[0], g, -1, math.prod(out.shape[2:]))
    G = torch.einsum("ngip,ngjp->gij", d, d) / (x.shape[0] * d.shape[-1])
    torch.testing.assert_close(layer.g.value, G, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(adapter.grad_matrix(torch.float64),
                               dense_precondition(layer.a.value, G, raw, damping),
                               rtol=1e-8, atol=1e-10)
