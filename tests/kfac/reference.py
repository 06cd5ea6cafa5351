"""Dense references for K-FAC: explicit per-sample sums and an explicit Kronecker solve."""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from distkfac.layers import Conv2dAdapter


def conv_patches(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """(N, groups, rows per group [+1], L) im2col of one conv, checked against its output."""
    xp = Conv2dAdapter(conv, "ref").pad(x)
    u = F.unfold(xp, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    n, g, L = x.shape[0], conv.groups, u.shape[-1]
    u = u.reshape(n, g, -1, L)
    w = conv.weight.reshape(g, conv.out_channels // g, -1)
    y = torch.einsum("gfk,ngkl->ngfl", w, u).reshape(n, conv.out_channels, L)
    if conv.bias is not None:
        y = y + conv.bias[None, :, None]
        u = torch.cat([u, u.new_ones(n, g, 1, L)], 2)
    out = conv(x)
    assert torch.allclose(out.reshape(n, conv.out_channels, -1), y, atol=1e-10), "bad im2col"
    return u


def conv_patches_nd(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(N, groups, rows per group [+1], L) patches of an ``nn.Conv1d``/``nn.Conv3d``, gathered
    one output position and one kernel offset at a time with explicit indices (no unfold), and
    checked against the layer's own output."""
    nd = len(conv.kernel_size)
    pads = [p for i in reversed(range(nd)) for p in (
        (conv.padding[i],) * 2 if not isinstance(conv.padding, str) else (
            (0, 0) if conv.padding == "valid" else (
                conv.dilation[i] * (conv.kernel_size[i] - 1) // 2,
                conv.dilation[i] * (conv.kernel_size[i] - 1)
                - conv.dilation[i] * (conv.kernel_size[i] - 1) // 2)))]
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    xp = F.pad(x, pads, mode=mode)
    out_sizes = [(xp.shape[2 + i] - conv.dilation[i] * (conv.kernel_size[i] - 1) - 1)
                 // conv.stride[i] + 1 for i in range(nd)]
    cols = []
    for o in itertools.product(*[range(s) for s in out_sizes]):
        patch = []
        for k in itertools.product(*[range(s) for s in conv.kernel_size]):
            idx = [o[i] * conv.stride[i] + k[i] * conv.dilation[i] for i in range(nd)]
            patch.append(xp[(slice(None), slice(None), *idx)])  # (N, C)
        cols.append(torch.stack(patch, -1))  # (N, C, K): channel major, then kernel offsets
    n, g, L = x.shape[0], conv.groups, len(cols)
    u = torch.stack(cols, -1).reshape(n, g, -1, L)
    w = conv.weight.reshape(g, conv.out_channels // g, -1)
    y = torch.einsum("gfk,ngkl->ngfl", w, u).reshape(n, conv.out_channels, L)
    if conv.bias is not None:
        y = y + conv.bias[None, :, None]
        u = torch.cat([u, u.new_ones(n, g, 1, L)], 2)
    assert torch.allclose(conv(x).reshape(n, conv.out_channels, -1), y, atol=1e-10), "patches"
    return u


def per_sample_output_grads(model: nn.Module, modules: list[nn.Module], x, y, loss_fn):
    """For each sample i: d loss_i / d (output of each module), loss_i the sample's own loss."""
    grads = {m: [] for m in modules}
    for i in range(x.shape[0]):
        outs = {}
        hs = [m.register_forward_hook(lambda mod, inp, out: outs.__setitem__(mod, out))
              for m in modules]
        loss = loss_fn(model(x[i:i + 1]), y[i:i + 1])
        for h in hs:
            h.remove()
        gs = torch.autograd.grad(loss, [outs[m] for m in modules])
        for m, g in zip(modules, gs):
            grads[m].append(g[0])
    return {m: torch.stack(v) for m, v in grads.items()}


def per_sample_inputs(model, modules, x):
    ins = {}
    hs = [m.register_forward_hook(lambda mod, inp, out: ins.__setitem__(mod, inp[0].detach()))
          for m in modules]
    with torch.no_grad():
        model(x)
    for h in hs:
        h.remove()
    return ins


def reference_factors(model, x, y, loss_fn):
    """{module: (A, G)} as explicit means over samples (and positions) of outer products."""
    modules = [m for m in model.modules()
               if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))]
    gys = per_sample_output_grads(model, modules, x, y, loss_fn)
    ins = per_sample_inputs(model, modules, x)
    out = {}
    for m in modules:
        if isinstance(m, nn.Linear):
            a = ins[m].reshape(-1, m.in_features)
            if m.bias is not None:
                a = torch.cat([a, a.new_ones(a.shape[0], 1)], 1)
            A = sum(torch.outer(r, r) for r in a) / a.shape[0]
            d = gys[m].reshape(-1, m.out_features)
            G = sum(torch.outer(r, r) for r in d) / d.shape[0]
            out[m] = (A[None], G[None])
        else:
            u = (conv_patches(m, ins[m]) if isinstance(m, nn.Conv2d)
                 else conv_patches_nd(m, ins[m]))  # N, g, k, L
            n, g, k, L = u.shape
            A = torch.stack([sum(torch.outer(u[i, j, :, pos], u[i, j, :, pos])
                                 for i in range(n) for pos in range(L)) / (n * L)
                             for j in range(g)])
            d = gys[m].reshape(n, g, m.out_channels // g, -1)
            G = torch.stack([sum(torch.outer(d[i, j, :, pos], d[i, j, :, pos])
                                 for i in range(n) for pos in range(L)) / (n * L)
                             for j in range(g)])
            out[m] = (A, G)
    return out


def grad_matrix(m: nn.Module) -> torch.Tensor:
    g = getattr(m, "groups", 1)
    v = m.weight.grad.reshape(g, m.weight.shape[0] // g, -1)
    if m.bias is not None:
        v = torch.cat([v, m.bias.grad.reshape(g, -1, 1)], 2)
    return v


def dense_precondition(A, G, V, damping: float) -> torch.Tensor:
    """Solve ((G + sqrt(lam) I) (x) (A + sqrt(lam) I)) vec(X) = vec(V) per group, densely."""
    root = damping ** 0.5
    out = []
    for a, g, v in zip(A, G, V):
        k = torch.kron(g + root * torch.eye(g.shape[0], dtype=g.dtype),
                       a + root * torch.eye(a.shape[0], dtype=a.dtype))
        out.append(torch.linalg.solve(k, v.reshape(-1)).reshape(v.shape))
    return torch.stack(out)
