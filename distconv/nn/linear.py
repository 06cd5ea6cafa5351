"""``nn.Linear`` on the last dim of an activation whose features are split: stationary-x on a
channels-last value.

A channels-last activation ``x[..., o_C]`` (any leading dims -- samples, rows, columns -- split
any way, the in-features blocked over the grid dims ``C``, one or a tuple) meets a Linear with
``w[*, o_C]``, the columns of its in-features block, on each rank::

    forward   1. y_r = x_r · w[:, C_r]^T                      local (Σ_C y_r = x · w^T)
              2. y[..., o_C] <- Σ_C y_r                        reduce-scatter over C
              3. y += b[o_C]                                   local
    backward  1. dL/dy <- dL/dy[..., o_C]                      allgather over C
              2. dL/dx_r = dL/dy · w[:, C_r]                   local
              3. dL/dw[:, C_r] = Σ_rows dL/dy^T · x_r          local, completed over the other
                                                               grid dims (allreduce)

so the output's features are blocked over the same grid dims as the input's (the next Linear,
LayerNorm or pointwise op meets them split alike), and the gradient of ``x`` is exact: the
adjoint of the reduce-scatter is the allgather. Each rank holds ``out × in / P_C`` weights.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from distconv.distribution import Dist
from distconv.grid import ProcessorGrid
from distconv.nn._activation import check_grid, resolve_shape, show
from distconv.nn.clip import register_parameter_specs
from distconv.nn.grad_sync import redundant_sync
from distconv.nn.sharding import ShardSpec
from distconv.redistribute import redistribute

__all__ = ["DistLinear"]


class DistLinear(nn.Module):
    """``nn.Linear`` over the last dim of an activation in ``input_dist`` whose last entry
    splits the in-features (module docstring); the output in ``input_dist`` too, its
    out-features blocked over the same grid dims. ``w[*,o_C]``, ``b[o_C]`` sharded, replicated
    over the other grid dims (their gradients completed there). Build it with
    :meth:`from_module`. Not an ``nn.Linear`` instance: code that handles every ``nn.Linear``
    as whole (K-FAC's factors of its weight, say) must not take a shard for the layer.

    Raises:
        TypeError: ``grid`` or ``input_dist`` of the wrong type.
        ValueError: an ``input_dist`` with pending sums, with fewer than 2 entries, or whose last
            entry splits nothing.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: Any = None, dtype: torch.dtype | None = None, *,
                 grid: ProcessorGrid, input_dist: Dist) -> None:
        super().__init__()
        name = type(self).__name__
        self.grid = check_grid(name, grid)
        if not isinstance(input_dist, Dist):
            raise TypeError(f"{name}: input_dist must be a distconv.Dist, got "
                            f"{type(input_dist).__name__}")
        input_dist.validate(grid)
        split = tuple(g for g in input_dist.grid_dims_of(input_dist.ndim - 1)
                      if grid.extent(g) > 1)
        if input_dist.ndim < 2 or input_dist.pending or not split:
            raise ValueError(f"{name}: input_dist must split the last dim (the in-features) and "
                             f"hold no pending sum, got {input_dist}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.input_dist = self.output_dist = input_dist
        entry = input_dist.entries[-1]
        #: the working output (a pending sum over the in-features' grid dims)
        self._partial = Dist(input_dist.entries[:-1] + (None,), frozenset(split))
        self.weight_dist, self.bias_dist = Dist((None, entry)), Dist((entry,))
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self.weight_dist.local_shape(
            (self.out_features, self.in_features), grid), **kw))
        self.register_parameter("bias", nn.Parameter(torch.empty(self.bias_dist.local_shape(
            (self.out_features,), grid), **kw)) if bias else None)
        self.grad_sync = redundant_sync(grid, self.weight_dist, name, (self.weight, self.bias))
        register_parameter_specs(self, grid.comm)
        self._resolved: dict[Any, Any] = {}

    @classmethod
    def from_module(cls, module: nn.Linear, *, grid: ProcessorGrid,
                    input_dist: Dist) -> DistLinear:
        """The layer for an ``nn.Linear`` (the same on every rank) with its shards."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"module must be an nn.Linear, got {type(module).__name__}")
        w = module.weight
        out = cls(module.in_features, module.out_features, module.bias is not None, w.device,
                  w.dtype, grid=grid, input_dist=input_dist)
        with torch.no_grad():
            out.weight.copy_(w[out.weight_dist.local_slices(tuple(w.shape), grid)])
            out.weight.requires_grad_(w.requires_grad)
            if out.bias is not None:
                out.bias.copy_(module.bias[out.bias_dist.local_slices((out.out_features,),
                                                                      grid)])
                out.bias.requires_grad_(module.bias.requires_grad)
        return out.train(module.training)

    def _shard_specs(self) -> dict[str, ShardSpec]:
        specs = {"weight": ShardSpec(self.grid, self.weight_dist,
                                     (self.out_features, self.in_features))}
        if self.bias is not None:
            specs["bias"] = ShardSpec(self.grid, self.bias_dist, (self.out_features,))
        return specs

    def finish_grad_sync(self) -> None:
        """Finish pending gradient allreduces (``loss.backward()`` does this itself)."""
        if self.grad_sync is not None:
            self.grad_sync.finish()

    def forward(self, x: torch.Tensor, global_shape: Sequence[int] | None = None) -> torch.Tensor:
        """This rank's block of ``x · w^T + b`` from its block ``x`` of the global input of
        ``global_shape`` (in :attr:`input_dist`)."""
        shape = resolve_shape(type(self).__name__, self.grid, self.input_dist, x, global_shape,
                              self._resolved)
        if shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__}: the input {shape} does not end in "
                             f"in_features={self.in_features}")
        y = F.linear(x, self.weight)
        y = redistribute(y, self.grid, self._partial, self.output_dist,
                         tuple(shape[:-1]) + (self.out_features,))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, grid={dict(self.grid.layout)}, "
                f"x={show(self.input_dist, 'x')}, w={self.weight_dist.format('w')}")
