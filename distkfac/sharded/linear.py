"""K-FAC of a :class:`~distconv.nn.linear.DistLinear`: a Linear on a channels-last value
(``[N, L, C]`` tokens, ``[N, H, W, C]`` positions) whose features are split.

Notation as in :mod:`distconv.nn.linear`: the input is ``x[lead, e]`` (``lead`` the leading
dims' entries -- samples over N, rows and columns over H, W -- and ``e`` the in-features' entry:
C for stationary-x, F for stationary-y, ``(C, F)`` for stationary-w), the output
``y[lead, e']``, the weight ``w[o_F, o_C]`` (``w[*, o_C]``, ``w[o_F, *]``) replicated over the
other grid dims. The global layer's K-FAC has ``A = (1/R) Σ a a^T`` over every feature of every
position of the global batch (``R`` positions) and ``G`` likewise over the output's features:
no rank holds a whole row of either, and a factor of a feature block alone would be a diagonal
block, not the layer's factor.

So this adapter forms the whole layer's factors, replicated like a data-parallel layer's:

* Factor steps: the ranks of one block of rows (those differing only in the feature dims) gather
  their rows' features, ``x[lead, e] -> x[lead, *]`` (an allgather over ``e``'s dims:
  ``(in - in_e)`` numbers per local row) and ``dL/dy[lead, e'] -> dL/dy[lead, *]`` (``(out -
  out_e')`` per local row). Each block of rows is counted once (by its rank at coordinate 0 of
  every grid dim ``lead`` leaves out), and the sums are reduced over the whole grid with the
  data-parallel layers' factors, so ``R`` is the global number of positions.
* Every step: the weight's (and bias's) gradient is gathered whole, ``w[o_F, o_C] ->
  w[*, *]`` (``out in - |w block|`` numbers), preconditioned as one process's, and this rank's
  block written back.

Exact for every split the layer takes; the price is the layer's whole factors on every rank
(``in^2 + out^2`` numbers), as for a replicated Linear.
"""
from __future__ import annotations

import torch
from torch import Tensor

from distconv.distribution import Dist
from distconv.nn.linear import DistLinear
from distconv.redistribute import redistribute
from distkfac.layers import LinearAdapter

__all__ = ["DistLinearAdapter"]


class DistLinearAdapter(LinearAdapter):
    """Whole-layer factors and gradient matrix of a :class:`DistLinear` (module docstring)."""

    def __init__(self, module: DistLinear, name: str) -> None:
        super().__init__(module, name)
        grid = module.grid
        lead = Dist(module.input_dist.entries[:-1]).used()
        #: grid dims (extent > 1) that split neither the rows nor the features: replicas
        self.replicas = tuple(d for d, n in grid.shape.items()
                              if n > 1 and d not in module.input_dist.used())
        #: whether this rank counts its block of rows (coordinate 0 off the rows' dims)
        self.root = all(grid.coords[d] == 0 for d, n in grid.shape.items()
                        if n > 1 and d not in lead)

    def _whole_rows(self, t: Tensor, entry, features: int) -> Tensor:
        """This rank's rows of ``t`` (last dim in ``entry``) with every feature: the ranks that
        hold the same rows gather over ``entry``'s grid dims."""
        rows = t.detach().reshape(-1, t.shape[-1])
        with torch.no_grad():
            return redistribute(rows, self.module.grid, Dist((None, entry)),
                                Dist((None, None)), (rows.shape[0], features))

    def a_sum(self, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
        m = self.module
        return super().a_sum(self._whole_rows(x, m.input_dist.entries[-1], m.in_features),
                             dtype)

    def g_sum(self, gy: Tensor, batch: int, dtype: torch.dtype) -> tuple[Tensor, int]:
        m = self.module
        return super().g_sum(self._whole_rows(gy, m.output_dist.entries[-1], m.out_features),
                             batch, dtype)

    def grad_matrix(self, dtype: torch.dtype) -> Tensor | None:
        """The whole layer's ``(1, out, in [+1])`` gradient, gathered from the shards."""
        m = self.module
        if m.weight.grad is None:
            return None
        with torch.no_grad():
            w = redistribute(m.weight.grad.detach(), m.grid, m.weight_dist, Dist((None, None)),
                             (m.out_features, m.in_features)).to(dtype)
            if self.has_bias:
                b = m.bias.grad
                b = (torch.zeros(m.bias.shape, dtype=dtype, device=w.device)
                     if b is None else b.detach())
                b = redistribute(b, m.grid, m.bias_dist, Dist((None,)),
                                 (m.out_features,)).to(dtype)
                w = torch.cat([w, b.reshape(-1, 1)], dim=1)
        return w.unsqueeze(0)

    def set_grad(self, mat: Tensor) -> None:
        """Write this rank's blocks of the whole ``(1, out, in [+1])`` matrix into ``.grad``."""
        m = self.module
        w = mat[0, :, :m.in_features]
        block = m.weight_dist.local_slices((m.out_features, m.in_features), m.grid)
        m.weight.grad.copy_(w[block].to(m.weight.grad.dtype))
        if self.has_bias and m.bias.grad is not None:
            b = mat[0, :, m.in_features]
            block = m.bias_dist.local_slices((m.out_features,), m.grid)
            m.bias.grad.copy_(b[block].to(m.bias.grad.dtype))
