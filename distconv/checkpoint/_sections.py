"""What each part of a checkpoint is read from and restored into.

A *section* is a named piece of state with a layout: the model (its ``state_dict`` and
:func:`~distconv.nn.sharding.shard_specs`), an optimizer (its state keyed by parameter name, each
state tensor shaped like its parameter taking the parameter's :class:`ShardSpec`), any object
with ``state_dict()`` / ``load_state_dict()`` and optionally ``shard_specs()`` (e.g. a K-FAC
preconditioner), and ``extra`` (plain values, returned by ``load``). Each rank's own values
(``rank_extra``) are not a section of this kind: they are kept out of the state the ranks agree
on, and stored by rank (:data:`RANK_EXTRA`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from distconv.checkpoint._index import CheckpointError
from distconv.checkpoint._tree import flatten
from distconv.distribution import Dist
from distconv.nn.sharding import ShardSpec, shard_specs

__all__ = ["RANK_EXTRA", "Section", "Shardable", "sections_for"]

#: the section of the values each rank saved for itself (``save(..., rank_extra=)``): a list by
#: rank, each rank's tensors in its own file
RANK_EXTRA = "rank_extra"
RESERVED = ("model", "optimizer", "extra", RANK_EXTRA)


@runtime_checkable
class Shardable(Protocol):
    """Any state that reshards: ``state_dict()`` returns nested dicts / lists / tuples of tensors
    and plain values; ``load_state_dict(state)`` takes the same structure back; an optional
    ``shard_specs()`` maps the flat key of each distributed tensor (its path of keys joined by
    ``/``, e.g. ``"factors/conv1/A"``) to its :class:`ShardSpec`. Tensors it does not list are
    replicated: the same whole tensor on every rank. On load, ``shard_specs()`` of the *loading*
    object says which block each rank receives, so it must list every distributed tensor that
    ``load_state_dict`` will accept, before any tensor of it exists."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


def _replicated(shape: tuple[int, ...]) -> ShardSpec:
    return ShardSpec(None, Dist.replicated(len(shape)), shape)


class Section:
    """A generic :class:`Shardable` (also the base of the model and optimizer sections)."""

    def __init__(self, name: str, obj: Any) -> None:
        self.name, self.obj = name, obj

    def state(self) -> Any:
        return self.obj.state_dict()

    def specs(self) -> Mapping[str, ShardSpec]:
        get = getattr(self.obj, "shard_specs", None)
        return dict(get()) if get is not None else {}

    def target(self, key: str, shape: tuple[int, ...], specs: Mapping[str, ShardSpec]) -> ShardSpec:
        """The spec a tensor saved under ``key`` with global ``shape`` takes when loaded."""
        spec = specs.get(key)
        return spec if spec is not None else _replicated(shape)

    def current(self) -> dict[str, torch.Tensor]:
        """The tensors the loading object holds now (to check dtype and keys against)."""
        return flatten(self.state(), where=self.name)[1]

    def strict_keys(self) -> bool:
        return False

    def restore(self, state: Any, *, strict: bool) -> None:
        self.obj.load_state_dict(state)


class ModuleSection(Section):
    def specs(self) -> Mapping[str, ShardSpec]:
        return shard_specs(self.obj)

    def strict_keys(self) -> bool:
        return True

    def restore(self, state: Any, *, strict: bool) -> None:
        # this rank's blocks, as torch loads them (a ParallelModel's own load_state_dict reads an
        # untagged dict as global tensors)
        nn.Module.load_state_dict(self.obj, state, strict=strict)


class OptimizerSection(Section):
    """A ``torch.optim.Optimizer``'s state keyed by the model's parameter names, not by position,
    so it loads into the same model laid out on any grid."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        super().__init__("optimizer", optimizer)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if not isinstance(model, nn.Module):
            raise TypeError("optimizer state is keyed by parameter name: save and load it with "
                            f"an nn.Module as the model, got {type(model).__name__}")
        sd = optimizer.state_dict()
        if not (isinstance(sd, Mapping) and {"state", "param_groups"} <= set(sd)):
            raise TypeError(
                f"optimizer: {type(optimizer).__name__}.state_dict() is not laid out as "
                "torch.optim.Optimizer's (state by parameter position, param_groups), so it "
                "cannot be keyed by parameter name; save it through states=, e.g. states="
                f"{{'{type(optimizer).__name__.lower()}': optimizer}}, which stores its own "
                "state_dict")
        names = {id(p): n for n, p in model.named_parameters()}
        self.groups: list[list[str]] = []
        for g, group in enumerate(optimizer.param_groups):
            missing = [i for i, p in enumerate(group["params"]) if id(p) not in names]
            if missing:
                raise ValueError(
                    f"optimizer param group {g} holds parameters at positions {missing} that are "
                    "not parameters of the model being checkpointed"
                )
            self.groups.append([names[id(p)] for p in group["params"]])
        self.params = dict(model.named_parameters())
        self.param_specs = {n: s for n, s in shard_specs(model).items() if n in self.params}

    def state(self) -> Any:
        sd = self.obj.state_dict()
        order = [n for names in self.groups for n in names]
        return {
            "state": {order[i]: dict(s) for i, s in sd["state"].items()},
            "param_groups": [
                {**{k: v for k, v in g.items() if k != "params"}, "params": list(names)}
                for g, names in zip(sd["param_groups"], self.groups)
            ],
        }

    def specs(self) -> Mapping[str, ShardSpec]:
        specs = {}
        for name, fields in self.state()["state"].items():
            for field, value in fields.items():
                if isinstance(value, torch.Tensor) and value.shape == self.params[name].shape:
                    specs[_state_key(name, field)] = self.param_specs[name]
        return specs

    def target(self, key: str, shape: tuple[int, ...], specs: Mapping[str, ShardSpec]) -> ShardSpec:
        parts = key.split("/")
        spec = self.param_specs.get(parts[1]) if len(parts) == 3 and parts[0] == "state" else None
        return spec if spec is not None and spec.global_shape == shape else _replicated(shape)

    def current(self) -> dict[str, torch.Tensor]:
        return {}

    def restore(self, state: Any, *, strict: bool) -> None:
        groups = state.get("param_groups") if isinstance(state, dict) else None
        if not isinstance(groups, list) or len(groups) != len(self.groups):
            raise CheckpointError(
                f"optimizer: the checkpoint has {len(groups or [])} param groups, the optimizer "
                f"being loaded has {len(self.groups)}"
            )
        ids: dict[str, int] = {}
        for g, (saved, names) in enumerate(zip(groups, self.groups)):
            if sorted(saved["params"]) != sorted(names):
                raise CheckpointError(
                    f"optimizer param group {g}: the checkpoint holds {sorted(saved['params'])}, "
                    f"the optimizer being loaded holds {sorted(names)}"
                )
            for n in names:  # torch numbers parameters in group order
                ids[n] = len(ids)
        unknown = sorted(set(state["state"]) - set(ids))
        if unknown:
            raise CheckpointError(f"optimizer: state for unknown parameters {unknown}")
        self.obj.load_state_dict({
            "state": {ids[n]: s for n, s in state["state"].items()},
            "param_groups": [
                {**{k: v for k, v in saved.items() if k != "params"},
                 "params": [ids[n] for n in names]}
                for saved, names in zip(groups, self.groups)
            ],
        })


class ExtraSection(Section):
    """Plain values saved beside the state and handed back by ``load``."""

    def __init__(self, extra: Any) -> None:
        super().__init__("extra", None)
        self.extra, self.loaded = extra, None

    def state(self) -> Any:
        return self.extra

    def specs(self) -> Mapping[str, ShardSpec]:
        return {}

    def current(self) -> dict[str, torch.Tensor]:
        return {}

    def restore(self, state: Any, *, strict: bool) -> None:
        self.loaded = state


def _state_key(name: str, field: str) -> str:
    from distconv.checkpoint._tree import flat_key

    return flat_key(("state", name, field))


def sections_for(
    model: Any, optimizer: Any, states: Mapping[str, Any] | None, extra: Any = None
) -> list[Section]:
    """The sections of one checkpoint, validated (``extra`` last)."""
    if isinstance(model, nn.Module):
        sections: list[Section] = [ModuleSection("model", model)]
    elif isinstance(model, Shardable):
        sections = [Section("model", model)]
    else:
        raise TypeError(
            "model must be an nn.Module or an object with state_dict() and load_state_dict(), "
            f"got {type(model).__name__}"
        )
    if optimizer is not None:
        sections.append(OptimizerSection(optimizer, model))
    if states is not None:
        if not isinstance(states, Mapping):
            raise TypeError(
                f"states must be a mapping of name -> object, got {type(states).__name__}"
            )
        for name, obj in states.items():
            if not isinstance(name, str) or not name or "/" in name or name in RESERVED:
                raise ValueError(
                    f"states: name {name!r} must be a non-empty str without '/', other than "
                    f"{RESERVED}"
                )
            if not isinstance(obj, Shardable):
                raise TypeError(
                    f"states[{name!r}] must have state_dict() and load_state_dict(), got "
                    f"{type(obj).__name__}"
                )
            sections.append(Section(name, obj))
    sections.append(ExtraSection(extra))
    return sections
