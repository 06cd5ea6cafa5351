"""Gradient clipping by the norm of the *global* gradient of a model whose parameters are shards.

``torch.nn.utils.clip_grad_norm_`` on a parallel model sees only this rank's shards: each rank
would clip by its own local norm, channel-split weights would be scaled differently on different
ranks and replicas would drift apart. :func:`clip_grad_norm_` counts every shard of the global
gradient once (a block replicated over some grid dims is counted on one of its holders only), sums
the per-rank parts in rank order so every rank computes bitwise the same total, and scales every
shard by the same factor -- torch's result on one process.

Where a parameter lies is read from :func:`distconv.nn.shard_specs` (a model) or from the
registry the distributed layers and :func:`distconv.parallelize` fill (loose parameters).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from distconv.distribution import Dist
from distconv.nn.sharding import ShardSpec, shard_specs

__all__ = ["clip_grad_norm_", "register_parameter_specs"]

# parameter -> (ShardSpec, communicator of every rank)
_SPECS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_parameter_specs(model: nn.Module, comm: Any) -> None:
    """Record where every parameter of ``model`` lies (its :class:`ShardSpec`) and the
    communicator of all ranks, so :func:`clip_grad_norm_` can take ``model.parameters()``."""
    specs = shard_specs(model)
    for name, p in model.named_parameters():
        _SPECS[p] = (specs[name], comm)


def _counted_here(spec: ShardSpec, comm: Any) -> bool:
    """Whether this rank counts its block: blocks replicated over grid dims (or, for tensors
    every rank holds whole, over every rank) are counted by the holder at coordinate 0."""
    if spec.grid is None:
        return comm.rank == 0
    coords = spec.grid.coords
    return all(coords[d] == 0 for d in spec.dist.redundant(spec.grid))


def _entries(parameters: Any, comm: Any) -> tuple[list[tuple[torch.Tensor, ShardSpec]], Any]:
    if isinstance(parameters, nn.Module):
        specs = shard_specs(parameters)
        model_comm = getattr(parameters, "comm", None)
        named = list(parameters.named_parameters())
        comm = comm if comm is not None else model_comm
        found = [(p, specs[n], None) for n, p in named]
    else:
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        if not isinstance(parameters, Iterable):
            raise TypeError("parameters must be an nn.Module, a tensor or an iterable of tensors, "
                            f"got {type(parameters).__name__}")
        found = []
        seen: set[int] = set()
        for i, p in enumerate(parameters):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameters[{i}] must be a tensor, got {type(p).__name__}")
            if id(p) in seen:
                continue
            seen.add(id(p))
            spec, owner = _SPECS.get(p, (None, None))
            if spec is None:
                spec = ShardSpec(None, Dist.replicated(p.dim()), tuple(p.shape))
            found.append((p, spec, owner))
        owners = [o for _, _, o in found if o is not None]
        if comm is None and owners:
            comm = owners[0]
    if comm is None:
        from distconv.comm import world

        comm = world()
    return [(p, s) for p, s, _ in found], comm


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None, *,
                    comm: Any = None) -> torch.Tensor:
    """Clip the gradients of (sharded) parameters by the norm of the global gradient (collective).

    The drop-in for ``torch.nn.utils.clip_grad_norm_`` on a parallel model: the same signature,
    the same result as torch on one process with the global gradient. Call it on every rank,
    after ``loss.backward()``::

        loss.backward()
        distconv.clip_grad_norm_(pmodel.parameters(), 1.0)   # or pmodel.clip_grad_norm_(1.0)
        opt.step()

    Args:
        parameters: a model (its :func:`~distconv.nn.shard_specs` say where each parameter lies),
            a tensor or an iterable of tensors (parameters of :func:`distconv.parallelize` models
            and of distributed layers are known; any other tensor is taken as replicated on every
            rank, as a plain layer's parameter is). Tensors without a ``.grad`` are skipped.
        max_norm: the largest norm the global gradient keeps (a non-negative number).
        norm_type: the p of the p-norm: a positive number or ``inf``. Default 2.
        error_if_nonfinite: raise ``RuntimeError`` when the total norm is nan or inf (on every
            rank: all ranks hold the same total). Default False.
        foreach: accepted for torch's signature; the scaling is one multiply per shard.
        comm: the communicator of all ranks. Default: the one the parameters were made on, else
            ``distconv.comm.world()``.

    Returns:
        The total norm of the global gradient (a 0-d tensor, the same on every rank).

    Distribution: each gradient is a block of its parameter's Dist (``w[o_F,o_C,*,*]``, ...);
    every block of the global gradient enters the norm exactly once, whichever ranks hold it.
    """
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not max_norm >= 0:
        raise ValueError(f"max_norm must be a non-negative number, got {max_norm!r}")
    if not norm_type > 0:
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    if not isinstance(error_if_nonfinite, bool):
        raise TypeError(f"error_if_nonfinite must be a bool, got {error_if_nonfinite!r}")
    entries, comm = _entries(parameters, comm)
    p = float(norm_type)
    grads = [(t.grad, spec) for t, spec in entries if t.grad is not None]
    device = grads[0][0].device if grads else torch.device("cpu")
    dtype = grads[0][0].dtype if grads else torch.get_default_dtype()
    parts = [torch.linalg.vector_norm(g.detach(), p).to(torch.float64)
             for g, spec in grads if _counted_here(spec, comm) and g.numel()]
    if math.isinf(p):
        local = torch.stack(parts).max() if parts else torch.zeros((), dtype=torch.float64)
    else:
        local = torch.stack(parts).pow(p).sum() if parts else torch.zeros((), dtype=torch.float64)
    local = local.reshape(1).to(device)
    gathered = [local] if comm.size == 1 else comm.allgather(
        local, meta="clip_grad_norm_: per-rank parts of the gradient norm")
    values = torch.cat([v.reshape(1).cpu() for v in gathered])  # rank order: the same everywhere
    total64 = values.max() if math.isinf(p) else values.sum().pow(1.0 / p)
    total = total64.to(dtype=dtype, device=device)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
            "so it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g, _ in grads:
        g.detach().mul_(coef.to(device=g.device, dtype=g.dtype))
    return total
