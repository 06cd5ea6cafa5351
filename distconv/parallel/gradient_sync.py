"""The parallel model's gradient completion, fused: one set of bucketed asynchronous allreduces
per group of parameters that reduce over the same ranks (:func:`fuse_gradient_syncs`), rebuilt
when the parameters a model trains change (:class:`Trainable` tells, cheaply, every forward)."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

from torch import nn

from distconv.nn.grad_sync import BucketedGradSync, GradSync, GradSyncGroup, gradient_groups
from distconv.nn.sharding import shard_specs
from distconv.parallel.placement import layout_str

if TYPE_CHECKING:
    from distconv.parallel.model import ParallelModel

__all__ = ["Trainable", "fuse_gradient_syncs"]


def fuse_gradient_syncs(model: ParallelModel, bucket_bytes: int) -> GradSyncGroup | None:
    """Every parameter's gradient completion, fused: the layers' own per-parameter
    allreduces are detached, and the parameters that reduce over the same ranks share
    bucketed asynchronous allreduces (:func:`gradient_groups` says which)."""
    for m in model.modules():
        if isinstance(getattr(m, "grad_sync", None), GradSync):
            m.grad_sync.detach()
            m.grad_sync = None
    groups = gradient_groups(shard_specs(model), dict(model.named_parameters()))
    syncs = []
    for (layout, dims), names in groups.items():
        if layout is None and model.comm.size == 1:
            continue
        comm = model.comm if layout is None else model.grid(layout).subcomm(dims)
        members = set(names)
        params = [p for n, p in model.named_parameters() if n in members]
        where = "over every rank" if layout is None else (
            f"over {'×'.join(dims)} of {layout_str(layout)}")
        syncs.append(BucketedGradSync(comm, params, bucket_bytes=bucket_bytes, where=where))
    return GradSyncGroup(syncs) if syncs else None


#: bumped whenever any module anywhere registers a parameter or a submodule (assignment,
#: ``register_parameter``, ``load_state_dict(assign=True)``): a model whose tree is unchanged
#: since it last looked need only read its parameters' ``requires_grad``
_TREE_VERSION = [0]


def _tree_changed(*_: Any) -> None:
    _TREE_VERSION[0] += 1


nn.modules.module.register_module_parameter_registration_hook(_tree_changed)
nn.modules.module.register_module_module_registration_hook(_tree_changed)


class Trainable:
    """Which parameter objects a model holds and which of them train, compared cheaply every
    forward: the tree is walked again only after some module registered a parameter or module;
    otherwise only the flags of the parameters it holds are read."""

    def __init__(self, model: nn.Module) -> None:
        self.version = _TREE_VERSION[0]
        params: list[nn.Parameter] = []
        stack = [model]
        while stack:
            m = stack.pop()
            params.extend(p for p in m._parameters.values() if p is not None)
            stack.extend(c for c in m._modules.values() if c is not None)
        self.params = params
        self.ids = tuple(map(id, params))
        self.flags = tuple(map(_REQUIRES_GRAD, params))

    def changed(self, model: nn.Module) -> bool:
        if self.version != _TREE_VERSION[0]:
            now = Trainable(model)
            if now.ids != self.ids:
                return True
            self.version = now.version
        return tuple(map(_REQUIRES_GRAD, self.params)) != self.flags


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
