"""How a module's parameters and buffers lie on the grid: the contract checkpoints and K-FAC read.

A distributed layer states, for each of its parameters and buffers, the grid it lives on, its
:class:`~distconv.distribution.Dist` and its global shape, by defining ``_shard_specs()``
(local names -> :class:`ShardSpec`). Every other tensor of a model is replicated on every rank
(``ShardSpec(None, Dist.replicated(ndim), shape)``). :func:`shard_specs` walks a model and returns
the spec of every state-dict entry by qualified name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from distconv.distribution import Dist

if TYPE_CHECKING:
    from distconv.grid import ProcessorGrid

__all__ = ["ShardSpec", "keep_requires_grad", "shard_specs"]


@dataclass(frozen=True)
class ShardSpec:
    """Where one tensor lives: ``grid`` (None: the same whole tensor on every rank), its ``dist``
    in the paper's notation and its ``global_shape``. The local tensor is ``dist``'s block of the
    global one on this rank (``dist.local_slices(global_shape, grid)``)."""

    grid: ProcessorGrid | None
    dist: Dist
    global_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dist.ndim != len(self.global_shape):
            raise ValueError(
                f"ShardSpec: {self.dist} has {self.dist.ndim} entries for global shape "
                f"{self.global_shape}"
            )
        if self.grid is None and (self.dist.used() or self.dist.pending):
            raise ValueError(f"ShardSpec: {self.dist} distributes a tensor but grid is None")

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.grid is None:
            return self.global_shape
        return self.dist.local_shape(self.global_shape, self.grid)

    @property
    def is_replicated(self) -> bool:
        return not self.dist.used() and not self.dist.pending


def shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """The :class:`ShardSpec` of every parameter and buffer of ``model`` by qualified name
    (the keys of ``model.state_dict()``, so a module registered under several paths is listed
    under each); tensors no layer describes are replicated."""
    specs: dict[str, ShardSpec] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        own = module._shard_specs() if hasattr(module, "_shard_specs") else {}
        tensors = dict(module.named_parameters(recurse=False))
        # a non-persistent buffer (timm's relative position index) is no key of the state dict
        tensors.update({n: b for n, b in module.named_buffers(recurse=False)
                        if n not in module._non_persistent_buffers_set})
        for name, t in tensors.items():
            if t is None:
                continue
            key = f"{prefix}.{name}" if prefix else name
            spec = own.get(name)
            if spec is None:
                spec = ShardSpec(None, Dist.replicated(t.dim()), tuple(t.shape))
            specs[key] = spec
    return specs


def keep_requires_grad(new: nn.Module, old: nn.Module, names: tuple[str, ...]) -> None:
    """Give ``new``'s shards of ``old``'s parameters ``old``'s ``requires_grad`` (a frozen layer
    stays frozen when it is sharded)."""
    for name in names:
        src, dst = getattr(old, name, None), getattr(new, name, None)
        if isinstance(src, nn.Parameter) and isinstance(dst, nn.Parameter):
            dst.requires_grad_(src.requires_grad)
