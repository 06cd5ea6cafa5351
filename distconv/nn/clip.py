"""Gradient clipping by the norm of the *global* gradient of a model whose parameters are shards.

A rank holds only its shards of a parallel model's gradient; clipping them by their own local
norm would scale channel-split weights differently on different ranks and let replicas drift.
:func:`clip_grad_norm_` counts every shard of the global gradient once (a block replicated over
some grid dims is counted on one of its holders only), sums the per-rank parts in rank order so
every rank computes bitwise the same total, and scales every shard by the same factor -- torch's
result on one process.

torch's own ``torch.nn.utils.clip_grad_norm_`` and ``get_total_norm`` compute the same global norm:
as DTensor gradients do, the gradient of a sharded parameter knows it is a shard
(:class:`ShardGrad`). Its norm is a per-rank part (:class:`_PartialNorm`), and the norm of the
stacked parts -- the last step of torch's total -- gathers the parts of every rank.

Where a parameter lies is read from :func:`distconv.nn.shard_specs` (a model) or from the
registry the distributed layers and :func:`distconv.parallelize` fill (loose parameters).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils import _foreach_utils
from torch.utils.weak import WeakIdKeyDictionary

from distconv.distribution import Dist
from distconv.nn.sharding import ShardSpec, shard_specs

__all__ = ["ShardGrad", "clip_grad_norm_", "mark_shard_grad", "register_parameter_specs"]

# parameter -> (ShardSpec, communicator of every rank)
_SPECS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_parameter_specs(model: nn.Module, comm: Any) -> None:
    """Record where every parameter of ``model`` lies (its :class:`ShardSpec`) and the
    communicator of all ranks, so :func:`clip_grad_norm_` can take ``model.parameters()``, and
    make the gradients of sharded parameters :class:`ShardGrad`s, so torch's clipping is exact."""
    specs = shard_specs(model)
    for name, p in model.named_parameters():
        if p not in _SPECS and p.requires_grad:
            p.register_post_accumulate_grad_hook(mark_shard_grad)
        _SPECS[p] = (specs[name], comm)


class _Part:
    """What a shard's norm needs to know: whether this rank counts the block, and the
    communicator of every rank. Shared, never copied (a gradient's deepcopy keeps it)."""

    __slots__ = ("counted", "comm")

    def __init__(self, counted: bool, comm: Any) -> None:
        self.counted, self.comm = counted, comm

    def __deepcopy__(self, memo: dict) -> _Part:
        return self


_COPIES = (torch.Tensor.__deepcopy__, torch.Tensor.__reduce_ex__)


class ShardGrad(torch.Tensor):
    """The gradient of a sharded parameter: this rank's block of the global gradient.

    To every op it is the plain local tensor (results are plain tensors, in-place ops act on the
    block), except its norm (``torch.linalg.vector_norm`` of the whole tensor,
    ``torch._foreach_norm``): that is a :class:`_PartialNorm`, so ``torch.nn.utils``'s
    ``clip_grad_norm_`` and ``get_total_norm`` -- which stack the per-tensor norms and take the
    norm of the stack -- get the norm of the global gradient (a collective of every rank).
    """

    _distconv_part: _Part

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _COPIES:  # a copy or a pickle is the plain local block
            return func(_plain(args[0]), *args[1:])
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func is torch._foreach_norm:
            order = _order(args[1:2], kwargs)
            return [_PartialNorm.of(n, t._distconv_part, order) if isinstance(t, ShardGrad) else n
                    for t, n in zip(args[0], out)]
        if func is torch.linalg.vector_norm and isinstance(args[0], ShardGrad) and \
                _whole(args[2:], kwargs):
            return _PartialNorm.of(out, args[0]._distconv_part, _order(args[1:2], kwargs))
        return out


# ShardGrads take torch's foreach paths, as DTensor gradients do (torch/distributed/tensor)
if ShardGrad not in _foreach_utils._foreach_supported_types:
    _foreach_utils._foreach_supported_types.append(ShardGrad)


def _plain(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


def _order(positional: Any, kwargs: dict) -> float:
    return float(positional[0] if positional else kwargs.get("ord", 2.0))


def _whole(rest: Any, kwargs: dict) -> bool:
    """Whether a vector_norm call reduces the whole tensor (no ``dim``)."""
    dim = rest[0] if rest else kwargs.get("dim")
    return dim is None


class _PartialNorm(torch.Tensor):
    """The p-norm of this rank's block of one sharded gradient, and whether this rank counts it.

    A plain 0-d tensor (the local value) to every op but ``.to`` (keeps it a part) and
    ``torch.stack`` (stacks parts, a plain tensor beside them counts as replicated on every
    rank: rank 0 counts it); ``torch.linalg.vector_norm`` of stacked parts is the global norm."""

    _distconv_part: _Part
    _distconv_order: float
    _distconv_counted: list[bool]  # per stacked entry

    @staticmethod
    def of(value: torch.Tensor, part: _Part, order: float, counted: Any = None) -> _PartialNorm:
        out = value.as_subclass(_PartialNorm)
        out._distconv_part, out._distconv_order = part, order
        out._distconv_counted = [part.counted] if counted is None else counted
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _COPIES:
            return func(_plain(args[0]), *args[1:])
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        first = args[0] if args else None
        if func is torch.Tensor.to and isinstance(first, _PartialNorm) and first.dim() == 0:
            return _PartialNorm.of(out, first._distconv_part, first._distconv_order,
                                   first._distconv_counted)
        if func is torch.stack and (args[1] if args[1:] else kwargs.get("dim", 0)) == 0:
            return _stack_parts(list(first), out)
        if func is torch.linalg.vector_norm and isinstance(first, _PartialNorm) and \
                first.dim() == 1 and _whole(args[2:], kwargs):
            return _global_norm(first, _order(args[1:2], kwargs))
        return out


def _stack_parts(norms: list[torch.Tensor], stacked: torch.Tensor) -> torch.Tensor:
    parts = [n for n in norms if isinstance(n, _PartialNorm) and n.dim() == 0]
    if not parts:
        return stacked
    first = parts[0]
    if any(n._distconv_part.comm is not first._distconv_part.comm or
           n._distconv_order != first._distconv_order for n in parts):
        raise ValueError("torch.nn.utils.clip_grad_norm_: these gradients are shards of models "
                         "on different communicators (or normed with different orders); clip "
                         "each model with distconv.clip_grad_norm_(model.parameters(), ...)")
    rank0 = first._distconv_part.comm.rank == 0
    counted = [n._distconv_counted[0] if isinstance(n, _PartialNorm) else rank0 for n in norms]
    return _PartialNorm.of(stacked, first._distconv_part, first._distconv_order, counted)


def _global_norm(stacked: _PartialNorm, order: float) -> torch.Tensor:
    """The norm of the stacked per-tensor norms over every rank: each rank's counted entries
    combined in float64, the per-rank parts gathered and combined in rank order (the same bits
    on every rank)."""
    if order != stacked._distconv_order or not (order > 0 or order == math.inf):
        raise ValueError(
            f"torch.nn.utils.clip_grad_norm_ on sharded gradients takes norm_type > 0 or inf, "
            f"got {order!r}; distconv.clip_grad_norm_ states what it supports")
    comm = stacked._distconv_part.comm
    values = _plain(stacked).detach().to(torch.float64).abs()
    mask = torch.tensor(stacked._distconv_counted, device=values.device)
    values = torch.where(mask, values, torch.zeros_like(values))
    local = values.max() if math.isinf(order) else values.pow(order).sum()
    total = _combine(local, comm, order)
    return total.to(dtype=stacked.dtype, device=stacked.device)


def _combine(local: torch.Tensor, comm: Any, order: float) -> torch.Tensor:
    """Combine every rank's float64 part (a max or a sum of p-th powers) into the global norm."""
    local = local.reshape(1)
    gathered = [local] if comm.size == 1 else comm.allgather(
        local, meta="clip_grad_norm_: per-rank parts of the gradient norm")
    values = torch.cat([v.reshape(1).cpu() for v in gathered])  # rank order: the same everywhere
    return values.max() if math.isinf(order) else values.sum().pow(1.0 / order)


def mark_shard_grad(param: torch.Tensor) -> None:
    """Make ``param.grad`` a :class:`ShardGrad` when ``param`` is a registered shard (a
    gradient hook; also called where a gradient is written whole, after its allreduce)."""
    grad = param.grad
    if grad is None or isinstance(grad, ShardGrad):
        return
    spec, comm = _SPECS.get(param, (None, None))
    if spec is None or spec.grid is None or spec.is_replicated:
        return
    marked = grad.as_subclass(ShardGrad)
    marked._distconv_part = _Part(_counted_here(spec, comm), comm)
    param.grad = marked


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
    total = _combine(local.to(device), comm, p).to(dtype=dtype, device=device)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
            "so it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g, _ in grads:
        g.detach().mul_(coef.to(device=g.device, dtype=g.dtype))
    return total
