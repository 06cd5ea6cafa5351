"""``nn.Linear`` on the last dim of an activation whose features are split: the paper's three
algorithms on a channels-last value (Dryden et al. §3, with the features as the channels).

An activation ``x[..., e]`` (any leading dims -- samples, rows, columns -- split any way; ``e``
the entry of its last dim, the in-features) meets a Linear as one of::

    stationary-x   x[..., o_C]  (e = C, one grid dim or a tuple)     w[*, o_C]
        forward    1. Σ_C y[..., *] = x[..., o_C] · w[*, o_C]^T         local
                   2. y[..., o_C]   <- Σ_C y[..., *]                     reduce-scatter over C
        backward   1. dL/dy[..., *] <- dL/dy[..., o_C]                   allgather over C
                   2. dL/dx[..., o_C] = dL/dy · w[*, o_C]                local

    stationary-y   x[..., o_F]  (e = F)                                w[o_F, *]
        forward    1. x[..., *]     <- x[..., o_F]                       allgather over F
                   2. y[..., o_F]   = x[..., *] · w[o_F, *]^T            local
        backward   1. Σ_F dL/dx[..., *] = dL/dy[..., o_F] · w[o_F, *]    local
                   2. dL/dx[..., o_F] <- Σ_F dL/dx[..., *]               reduce-scatter over F

    stationary-w   x[..., o_{C×F}]  (e = (C, F), major first)         w[o_F, o_C]
        forward    1. x[..., o_C]   <- x[..., o_{C×F}]                   allgather over F
                   2. Σ_C y[..., o_F] = x[..., o_C] · w[o_F, o_C]^T      local
                   3. y[..., o_{F×C}] <- Σ_C y[..., o_F]                 reduce-scatter over C

and in every one ``y += b`` with ``b`` distributed as y's last dim, ``dL/dw = Σ_rows dL/dy^T · x``
on the local blocks, completed over the grid dims the weight leaves redundant (a segmented
allreduce). The output's features are blocked like the input's (stationary-x, -y) or over
``F×C`` (stationary-w: a following stationary-w Linear takes it with C and F trading roles, as
the paper's next layer does), so the next Linear, LayerNorm or pointwise op meets them split. The
same collectives as :class:`~distconv.nn.conv.DistConv2d` for a 1×1 convolution.
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

__all__ = ["LINEAR_ALGORITHMS", "DistLinear", "linear_dists"]

#: the algorithms of :class:`DistLinear`
LINEAR_ALGORITHMS = ("stationary-x", "stationary-y", "stationary-w")


def linear_dists(algorithm: str, input_dist: Dist) -> dict[str, Dist]:
    """The distributions of a Linear under ``algorithm`` taking ``input_dist`` (module
    docstring): ``input``, ``work`` (x after the allgather over F), ``partial`` (the local
    matmul's y, pending over C), ``output``, ``weight`` (``[out, in]``) and ``bias``. The last
    entry of ``input_dist`` names the roles: C (stationary-x), F (stationary-y), ``(C, F)``
    (stationary-w).

    Raises:
        ValueError: an unknown algorithm, or a last entry that does not fit it.
    """
    if algorithm not in LINEAR_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {LINEAR_ALGORITHMS}, got {algorithm!r}")
    lead, e = input_dist.entries[:-1], input_dist.entries[-1]
    if algorithm == "stationary-w":
        if not (isinstance(e, tuple) and len(e) == 2):
            raise ValueError("stationary-w takes the in-features split over two grid dims, "
                             f"x[...,o_{{C×F}}] (C major); got {input_dist}")
        c, f = e
        work, partial, out, weight = c, f, (f, c), Dist((f, c))
        pending = frozenset({c})
    elif algorithm == "stationary-y":
        work, partial, out, weight, pending = None, e, e, Dist((e, None)), frozenset()
    else:
        names = e if isinstance(e, tuple) else (e,) if e is not None else ()
        work, partial, out, weight = e, None, e, Dist((None, e))
        pending = frozenset(names)
    return {"input": input_dist, "work": Dist(lead + (work,)),
            "partial": Dist(lead + (partial,), pending), "output": Dist(lead + (out,)),
            "weight": weight, "bias": Dist((out,))}


class DistLinear(nn.Module):
    """``nn.Linear`` over the last dim of an activation in ``input_dist`` whose last entry
    splits the in-features (module docstring), under ``algorithm`` (default
    ``"stationary-x"``); its output in :attr:`output_dist`. Weight and bias sharded as the
    algorithm places them (:attr:`weight_dist`, :attr:`bias_dist`), replicated over the other
    grid dims (their gradients completed there). Build it with :meth:`from_module`. Not an
    ``nn.Linear`` instance: code that handles every ``nn.Linear`` as whole (K-FAC's factors of
    its weight, say) must not take a shard for the layer.

    Raises:
        TypeError: ``grid`` or ``input_dist`` of the wrong type.
        ValueError: an unknown ``algorithm``, an ``input_dist`` with pending sums, with fewer
            than 2 entries, or whose last entry splits nothing (or, for stationary-w, is not a
            pair of split grid dims).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: Any = None, dtype: torch.dtype | None = None, *,
                 grid: ProcessorGrid, input_dist: Dist,
                 algorithm: str = "stationary-x") -> None:
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
        self.algorithm = algorithm
        d = linear_dists(algorithm, input_dist)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.input_dist, self.output_dist = input_dist, d["output"]
        #: x after forward step 1; the local matmul's output (pending over the C dims)
        self._work, self._partial = d["work"], d["partial"]
        self.weight_dist, self.bias_dist = d["weight"], d["bias"]
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self.weight_dist.local_shape(
            (self.out_features, self.in_features), grid), **kw))
        self.register_parameter("bias", nn.Parameter(torch.empty(self.bias_dist.local_shape(
            (self.out_features,), grid), **kw)) if bias else None)
        self.grad_sync = redundant_sync(grid, self.weight_dist, name, (self.weight, self.bias))
        register_parameter_specs(self, grid.comm)
        self._resolved: dict[Any, Any] = {}

    @classmethod
    def from_module(cls, module: nn.Linear, *, grid: ProcessorGrid, input_dist: Dist,
                    algorithm: str = "stationary-x") -> DistLinear:
        """The layer for an ``nn.Linear`` (the same on every rank) with its shards."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"module must be an nn.Linear, got {type(module).__name__}")
        w = module.weight
        out = cls(module.in_features, module.out_features, module.bias is not None, w.device,
                  w.dtype, grid=grid, input_dist=input_dist, algorithm=algorithm)
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
        ``global_shape`` (in :attr:`input_dist`), in :attr:`output_dist`."""
        shape = resolve_shape(type(self).__name__, self.grid, self.input_dist, x, global_shape,
                              self._resolved)
        if shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__}: the input {shape} does not end in "
                             f"in_features={self.in_features}")
        x = redistribute(x, self.grid, self.input_dist, self._work, tuple(shape))
        y = F.linear(x, self.weight)
        y = redistribute(y, self.grid, self._partial, self.output_dist,
                         tuple(shape[:-1]) + (self.out_features,))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, grid={dict(self.grid.layout)}, "
                f"algorithm={self.algorithm!r}, x={show(self.input_dist, 'x')}, "
                f"w={self.weight_dist.format('w')}, y={show(self.output_dist, 'y')}")
