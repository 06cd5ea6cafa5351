"""Decompositions of the factors and the damped preconditioning they give.

Damping form (both methods, so they agree exactly): factored Tikhonov,

    V~ = (G + sqrt(lam) I)^-1  V  (A + sqrt(lam) I)^-1

i.e. the gradient matrix ``V`` (``out x in``) is multiplied by the inverse of
``(A + sqrt(lam) I) (x) (G + sqrt(lam) I)``.

* ``'eigen'``: ``A = Q_A diag(a) Q_A^T``, ``G = Q_G diag(g) Q_G^T`` and
  ``V~ = Q_G [(Q_G^T V Q_A) / ((g + sqrt(lam)) (a + sqrt(lam))^T)] Q_A^T``.  The damped
  eigenvalues separate, so this is ``(G + sqrt(lam) I)^-1 V (A + sqrt(lam) I)^-1`` with each
  inverse ``Q diag(1/(e + sqrt(lam))) Q^T``: formed once per decomposition and damping value,
  then every step costs two products; a changing damping needs no new eigh.
* ``'inverse'``: ``(F + sqrt(lam) I)^-1`` by Cholesky, with the damping of the step that
  computed it.

A decomposition's payload is one flat tensor (what a broadcast carries); ``payload_numel``
tells every rank its size in advance.
"""
from __future__ import annotations

import abc
import math

import torch
from torch import Tensor

from distkfac.factors import pack, packed_numel, unpack

__all__ = ["Method", "EigenMethod", "InverseMethod", "method_for", "COMPUTE_METHODS"]

COMPUTE_METHODS = ("eigen", "inverse")


def _all_finite(t: Tensor) -> bool:
    """Whether every entry is finite.  NaN and Inf reach the sum, so a finite sum (one pass,
    no mask) settles it; only a non-finite sum, possibly an overflow, needs the entrywise
    test."""
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


def _check_finite(factor: Tensor) -> None:
    if not _all_finite(factor):
        raise FloatingPointError("K-FAC factor holds NaN or Inf (training diverged?)")


class Method(abc.ABC):
    """Decompose one factor (``(groups, d, d)``) and turn two decompositions into the damped
    inverses ``(A + sqrt(lam) I)^-1``, ``(G + sqrt(lam) I)^-1`` that precondition a gradient."""

    name: str

    def __init__(self, *, symmetric: bool = True) -> None:
        self.symmetric = symmetric

    @abc.abstractmethod
    def decompose(self, factor: Tensor, damping: float) -> Tensor:
        """Flat payload for ``factor``."""

    @abc.abstractmethod
    def payload_numel(self, groups: int, d: int) -> int: ...

    @abc.abstractmethod
    def damped_inverse(self, payload: Tensor, groups: int, d: int, damping: float) -> Tensor:
        """``(F + sqrt(lam) I)^-1`` as ``(groups, d, d)`` from ``F``'s payload."""

    @abc.abstractmethod
    def group_numel(self, d: int) -> int:
        """Numbers per group in :meth:`by_group`'s rows."""

    @abc.abstractmethod
    def by_group(self, payload: Tensor, groups: int, d: int) -> Tensor:
        """The payload as ``(groups, group_numel(d))``, one row per group, the same whatever
        ``symmetric`` (how checkpoints keep it: a layer whose groups are split over ranks
        holds a block of rows, and a run that packs payloads loads one that does not)."""

    @abc.abstractmethod
    def from_groups(self, rows: Tensor, groups: int, d: int) -> Tensor:
        """Inverse of :meth:`by_group`, in this method's payload format."""

    def precondition(self, grad: Tensor, a: Tensor, g: Tensor, groups: int, a_dim: int,
                     g_dim: int, damping: float) -> Tensor:
        """``V~`` for ``grad`` of shape ``(groups, g_dim, a_dim)`` from the payloads of A and G."""
        a_inv = self.damped_inverse(a, groups, a_dim, damping)
        g_inv = self.damped_inverse(g, groups, g_dim, damping)
        return g_inv @ grad.to(a_inv.dtype) @ a_inv

    def __repr__(self) -> str:
        return f"{type(self).__name__}(symmetric={self.symmetric})"


class EigenMethod(Method):
    """Payload: eigenvectors then eigenvalues (clamped at 0).  Damping enters when the inverse
    ``Q diag(1 / (e + sqrt(lam))) Q^T`` is formed, so a new damping needs no new eigh."""

    name = "eigen"

    def decompose(self, factor: Tensor, damping: float) -> Tensor:
        _check_finite(factor)
        try:
            evals, evecs = torch.linalg.eigh(factor)
            ok = _all_finite(evecs)
        except torch.linalg.LinAlgError:
            ok = False
        if not ok:
            # LAPACK's fp32 solver can fail, or silently return NaN, on many repeated
            # eigenvalues (dead units, constant-zero pixels); fp64 is robust there.
            evals, evecs = (t.to(factor.dtype) for t in torch.linalg.eigh(factor.double()))
        return torch.cat([evecs.reshape(-1), evals.clamp_min(0.0).reshape(-1)])

    def payload_numel(self, groups: int, d: int) -> int:
        return groups * d * (d + 1)

    @staticmethod
    def _split(payload: Tensor, groups: int, d: int) -> tuple[Tensor, Tensor]:
        q = payload[: groups * d * d].reshape(groups, d, d)
        return q, payload[groups * d * d:].reshape(groups, 1, d)

    def group_numel(self, d: int) -> int:
        return d * (d + 1)

    def by_group(self, payload: Tensor, groups: int, d: int) -> Tensor:
        q, e = self._split(payload, groups, d)
        return torch.cat([q.reshape(groups, -1), e.reshape(groups, -1)], 1)

    def from_groups(self, rows: Tensor, groups: int, d: int) -> Tensor:
        return torch.cat([rows[:, : d * d].reshape(-1), rows[:, d * d:].reshape(-1)])

    def damped_inverse(self, payload: Tensor, groups: int, d: int, damping: float) -> Tensor:
        q, e = self._split(payload, groups, d)
        return (q / (e + math.sqrt(damping))) @ q.transpose(1, 2)

    def precondition(self, grad: Tensor, a: Tensor, g: Tensor, groups: int, a_dim: int,
                     g_dim: int, damping: float) -> Tensor:
        """In the eigenbases, without forming inverses (cheaper for a single use)."""
        qa, ea = self._split(a, groups, a_dim)
        qg, eg = self._split(g, groups, g_dim)
        root = math.sqrt(damping)
        v = qg.transpose(1, 2) @ grad.to(qa.dtype) @ qa
        v = v / ((eg.transpose(1, 2) + root) * (ea + root))
        return qg @ v @ qa.transpose(1, 2)


class InverseMethod(Method):
    """Payload: ``(F + sqrt(lam) I)^-1`` by Cholesky, with the damping of the step that formed
    it (upper triangle when ``symmetric``)."""

    name = "inverse"

    def decompose(self, factor: Tensor, damping: float) -> Tensor:
        _check_finite(factor)
        d = factor.shape[-1]
        eye = torch.eye(d, dtype=factor.dtype, device=factor.device)
        damped = factor + math.sqrt(damping) * eye
        chol, info = torch.linalg.cholesky_ex(damped)
        if bool((info != 0).any()):  # fp32 round-off on a nearly singular factor
            chol = torch.linalg.cholesky(damped.double()).to(factor.dtype)
        return pack(torch.cholesky_inverse(chol), symmetric=self.symmetric)

    def payload_numel(self, groups: int, d: int) -> int:
        return packed_numel(groups, d, symmetric=self.symmetric)

    def damped_inverse(self, payload: Tensor, groups: int, d: int, damping: float) -> Tensor:
        return unpack(payload, groups, d, symmetric=self.symmetric)

    def group_numel(self, d: int) -> int:
        return d * (d + 1) // 2

    def by_group(self, payload: Tensor, groups: int, d: int) -> Tensor:
        """Upper triangles."""
        if not self.symmetric:
            payload = pack(payload.reshape(groups, d, d))
        return payload.reshape(groups, -1)

    def from_groups(self, rows: Tensor, groups: int, d: int) -> Tensor:
        flat = rows.reshape(-1)
        return flat if self.symmetric else unpack(flat, groups, d).reshape(-1)


def method_for(name: str, *, symmetric: bool = True) -> Method:
    if name == "eigen":
        return EigenMethod(symmetric=symmetric)
    if name == "inverse":
        return InverseMethod(symmetric=symmetric)
    raise ValueError(f"compute_method must be one of {COMPUTE_METHODS}, got {name!r}")
