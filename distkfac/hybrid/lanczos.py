"""Lanczos with full reorthogonalization on a sliced basis, and extreme spectrum estimation (ESE).

The basis ``D = [v_0 ... v_{m-1}]`` (``m`` the Lanczos order) is held as ``D[*, o]``: rank r keeps
columns ``s_r : s_r + b_r`` of every Lanczos vector (DHO2's Algorithm 2), so D's memory per rank is
``8 m b_r`` bytes, about ``1/P`` of FOSI's.  Iteration i:

1. ``v = gather(D_i)``                      (``* <- o``, an allgather of n entries)
2. ``w = reduce_mean(H_r v)``               (each rank's Hessian-vector product on its own samples,
                                             weighted by its sample count; ``o <- Σ``)
3. ``c = Σ_r D[:i+1, o] w[o]``; ``alpha_i = c_i``; ``w -= c D``    (first Gram–Schmidt pass)
4. ``c' = Σ_r D[:i+1, o] w[o]``; ``w -= c' D``                     (second pass, for stability)
5. ``beta_i = ||w||``; ``D_{i+1} = w / beta_i``

Steps 3–5 exchange ``i + 1``, ``i + 1`` and 1 numbers per rank, summed in rank order on every
rank, so the tridiagonal ``T`` (alphas on the diagonal, betas beside it) is bitwise the same
everywhere and every rank takes the same breakdown decision.  Its eigenproblem
``T = S diag(theta) S^T`` is solved by each rank locally and the Ritz vectors are assembled as
slices: ``E[:, o] = S[:, sel]^T D[:, o]``.

Everything runs in float64 (as the FOSI authors do); Hessian-vector products run in the model's
dtype.  When ``beta_i`` falls to ``breakdown * max(|alpha|, beta)`` the Krylov space is invariant:
the iteration stops with ``j = i + 1`` vectors and the Ritz pairs are exact.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from distkfac.hybrid.space import SlicedSpace, flatten

__all__ = ["LanczosResult", "lanczos", "extreme_pairs", "ESEResult", "ese", "make_hvp"]

BREAKDOWN = 1e-10


@dataclass
class LanczosResult:
    """``alphas`` (j,), ``betas`` (j - 1,) and this rank's slice of the basis ``D`` (j, b_r)."""

    alphas: Tensor
    betas: Tensor
    basis: Tensor

    def tridiagonal(self) -> Tensor:
        t = torch.diag(self.alphas)
        if len(self.betas):
            t += torch.diag(self.betas, 1) + torch.diag(self.betas, -1)
        return t


def start_vector(space: SlicedSpace, seed: int) -> Tensor:
    """This rank's slice of the unit start vector: every rank draws the same n normals from
    ``seed``, so P ranks start where one process does."""
    v = torch.randn(space.n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return space.slice(v / torch.linalg.vector_norm(v)).clone()


def lanczos(hvp: Callable[[Tensor], Tensor], space: SlicedSpace, order: int, *, seed: int,
            weight: float = 1.0, breakdown: float = BREAKDOWN) -> LanczosResult:
    """``order`` Lanczos steps on the operator ``v -> mean_r H_r v`` (see the module docstring).

    ``hvp(v)`` takes the full vector ``v`` (float64) and returns this rank's full product, a mean
    over its ``weight`` samples.
    """
    basis = torch.zeros(order, space.local, dtype=torch.float64)
    basis[0] = start_vector(space, seed)
    alphas: list[Tensor] = []
    betas: list[Tensor] = []
    for i in range(order):
        w = space.reduce_mean(hvp(space.gather(basis[i])), weight)
        known = basis[: i + 1]
        c = space.dots(known, w, "lanczos alpha and first pass")
        alphas.append(c[i])
        if i + 1 == order:
            break
        w = w - c @ known
        w = w - space.dots(known, w, "lanczos second pass") @ known
        beta = space.norm(w)
        scale = max(max(abs(float(a)) for a in alphas), max((float(b) for b in betas), default=0))
        if float(beta) <= breakdown * scale:
            basis = basis[: i + 1]
            break
        betas.append(beta)
        basis[i + 1] = w / beta
    return LanczosResult(torch.stack(alphas), torch.stack(betas) if betas else
                         torch.zeros(0, dtype=torch.float64), basis)


def extreme_pairs(result: LanczosResult, k: int, l: int) -> tuple[Tensor, Tensor]:
    """The ``l`` smallest then the ``k`` largest Ritz pairs (ascending): eigenvalues ``(q,)`` and
    this rank's slices of the eigenvectors ``(q, b_r)``.  When the Krylov space has only
    ``j < k + l`` dimensions, ``min(k, j)`` largest and the rest smallest are returned."""
    theta, s = torch.linalg.eigh(result.tridiagonal())
    j = len(theta)
    k_ = min(k, j)
    l_ = min(l, j - k_)
    sel = torch.cat([torch.arange(l_), torch.arange(j - k_, j)])
    return theta[sel], s[:, sel].T @ result.basis


@dataclass
class ESEResult:
    """Eigenvalues ``(q,)`` ascending (l smallest, then k largest), this rank's eigenvector slices
    ``(q, b_r)`` in float64, how many of each were found, the Lanczos steps run, the bytes of
    this rank's slice of D and the seconds ESE took."""

    eigenvalues: Tensor
    eigenvectors: Tensor
    k: int
    l: int
    steps: int
    basis_bytes: int
    seconds: float


def ese(hvp: Callable[[Tensor], Tensor], space: SlicedSpace, *, k: int, l: int, order: int,
        seed: int, weight: float = 1.0) -> ESEResult:
    """Extreme spectrum estimation: Lanczos, then the k largest and l smallest Ritz pairs."""
    t0 = time.perf_counter()
    res = lanczos(hvp, space, order, seed=seed, weight=weight)
    vals, vecs = extreme_pairs(res, k, l)
    k_ = min(k, len(res.alphas))
    return ESEResult(vals, vecs, k_, len(vals) - k_, len(res.alphas),
                     res.basis.numel() * res.basis.element_size(), time.perf_counter() - t0)


def make_hvp(params: Sequence[Tensor], closure: Callable[[], Tensor]) -> Callable[[Tensor], Tensor]:
    """Hessian-vector products of ``closure()`` at the current ``params`` by double backward:
    one forward and first backward with ``create_graph``, reused for every product."""
    params = list(params)
    with torch.enable_grad():
        loss = closure()
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(f"ese_closure must return a scalar loss tensor, got {loss!r}")
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True,
                                    materialize_grads=True)
    dtype = params[0].dtype

    # a parameter the loss does not touch has a constant (zero) gradient: no second backward
    live = [i for i, g in enumerate(grads) if g.requires_grad]

    def hvp(v: Tensor) -> Tensor:
        if not live:
            return torch.zeros_like(v)
        parts, offset = [], 0
        for p in params:
            parts.append(v[offset: offset + p.numel()].view_as(p).to(dtype))
            offset += p.numel()
        hv = torch.autograd.grad([grads[i] for i in live], params,
                                 grad_outputs=[parts[i] for i in live], retain_graph=True,
                                 allow_unused=True, materialize_grads=True)
        return flatten(hv).to(torch.float64)

    return hvp
