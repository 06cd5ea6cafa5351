"""``explain``: a parallelized model's plan on paper -- for any world size, with no communication.

Per layer: the grid and algorithm, its distributions in the paper's notation, every forward and
backward communication step with the bytes each rank receives (the communicators count the
same bytes), parameter, gradient and optimizer-state memory and activation memory per rank, and
with a ``machine`` the §4 predicted time. Totals per step are set against pure sample
parallelism on the same world.
"""

from __future__ import annotations

import copy
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

from torch import nn
from torch.fx.passes.shape_prop import TensorMetadata

from distconv import machines
from distconv.parallel.config import ParallelConfig
from distconv.ops import Unsupported
from distconv.ops.pricing import CommStep, LayerReport, Machine, Timeline, timeline
from distconv.parallel.cost import memory, price_analysis
from distconv.parallel.graph import analyse, check_shapes, trace
from distconv.parallel.placement import ALL_RANKS
from distconv.parallel.shapes import check_input_shape, propagate_shapes
from distconv.perfmodel import Machine as FlatMachine

__all__ = ["CommStep", "Explanation", "LayerReport", "explain"]



@dataclass
class Explanation:
    """The result of :func:`explain`: ``print`` it, or ``to_dict()`` / ``to_json()``."""

    world_size: int
    ranks: list[int]
    input_shape: tuple[int, ...]
    itemsize: int
    optimizer_states: int
    layers: list[LayerReport]
    machine: Machine | None
    baseline: Explanation | None = None
    #: ``strict=False``: the nodes parallelize cannot run, as (node, target, reason)
    unsupported: list[tuple[str, str, str]] = field(default_factory=list)

    def rank_bytes(self, rank: int) -> dict[str, int]:
        """Bytes ``rank`` receives per step: forward and backward (the communicators' count)."""
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} was not evaluated; explain evaluates every rank of "
                             f"worlds up to {ALL_RANKS} and these of larger ones: {self.ranks}")
        return {ph: sum(layer.bytes(ph, rank) for layer in self.layers)
                for ph in ("forward", "backward")}

    def memory(self) -> dict[str, int]:
        """Bytes per rank (the largest rank): parameters, gradients, optimizer state, and the
        activations kept for backward -- every layer's output block, except that the layers of a
        checkpointed segment hold theirs only while it is recomputed (the largest segment)."""
        return memory(self.layers, self.itemsize, self.optimizer_states)

    def timeline(self) -> Timeline | None:
        """The step on :attr:`machine` (None without one): forward, backward, and the gradient
        allreduces overlapped with backward as the buckets run (:func:`distconv.ops.pricing.
        timeline`, the planner's pricing too)."""
        return None if self.machine is None else timeline(self.layers, self.machine)

    def seconds(self) -> float | None:
        """Predicted seconds of one training step (:meth:`timeline`'s ``step``), or None."""
        t = self.timeline()
        return None if t is None else t.step

    def totals(self) -> dict[str, Any]:
        per_rank = [self.rank_bytes(r) for r in self.ranks]
        out: dict[str, Any] = {
            "max_bytes_forward": max(b["forward"] for b in per_rank),
            "max_bytes_backward": max(b["backward"] for b in per_rank),
            "memory_per_rank": self.memory(),
        }
        if self.machine is not None:
            out["predicted_seconds"] = self.seconds()
        return out

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "world_size": self.world_size, "input_shape": list(self.input_shape),
            "itemsize": self.itemsize, "totals": self.totals(),
            "layers": [{
                "name": lay.name, "kind": lay.kind, "grid": lay.grid, "note": lay.note,
                "algorithm": lay.algorithm, "dists": lay.dists,
                "param_elements_per_rank": lay.param_elements,
                "activation_elements_per_rank": lay.activation_elements,
                "steps": [{"phase": s.phase, "what": s.what, "op": s.op,
                           "bytes_per_rank": {str(r): b for r, b in s.bytes.items()}}
                          for s in lay.steps],
            } for lay in self.layers],
        }
        if self.baseline is not None:
            d["sample_parallel_totals"] = self.baseline.totals()
        if self.unsupported:
            d["unsupported"] = [{"node": n, "target": t, "reason": r}
                                for n, t, r in self.unsupported]
        return d

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    def __str__(self) -> str:
        rows = [f"explain: {self.world_size} ranks, global input {self.input_shape}, "
                f"{self.itemsize}-byte elements (bytes: the most any rank receives)"]
        head = f"{'layer':<22} {'grid':<18} {'algorithm':<13} {'distributions':<58} {'fwd B':>10} " \
               f"{'bwd B':>10} {'params':>9}"
        rows += [head, "-" * len(head)]
        for lay in self.layers:
            fwd = max(lay.bytes("forward", r) for r in self.ranks)
            bwd = max(lay.bytes("backward", r) for r in self.ranks)
            dists = "  ".join(f"{v}" for v in lay.dists.values())
            rows.append(f"{lay.name[:22]:<22} {lay.grid[:18]:<18} {lay.algorithm[:13]:<13} "
                        f"{dists[:58]:<58} {fwd:>10,} {bwd:>10,} {lay.param_elements:>9,}")
            if lay.note:
                rows.append(f"{'':<24}{lay.note}")
            for s in lay.steps:
                rows.append(f"{'':<24}{s.phase:<9} {s.what[:70]:<70} {max(s.bytes.values()):>12,}")
        if self.unsupported:
            rows.append(f"unsupported: {len(self.unsupported)} node(s) parallelize refuses "
                        "(priced at nothing above)")
            for node, target, reason in self.unsupported:
                why = reason.split("): ", 1)[-1]
                rows.append(f"  {node[:22]:<22} {target[:40]:<40} {why[:110]}")
        rows.append(_summary("this config", self))
        if self.baseline is not None:
            rows.append(_summary("sample parallel", self.baseline))
        return "\n".join(rows)


def _summary(label: str, e: Explanation) -> str:
    t, m = e.totals(), e.memory()
    s = (f"{label}: per step forward {t['max_bytes_forward']:,} B, backward "
         f"{t['max_bytes_backward']:,} B; per rank parameters {m['parameters']:,} B, gradients "
         f"{m['gradients']:,} B, optimizer state {m['optimizer_state']:,} B, activations "
         f"{m['activations']:,} B")
    tl = e.timeline()
    if tl is not None:
        s += (f"; predicted step {tl.step * 1e3:.3f} ms (forward {tl.forward * 1e3:.3f}, "
              f"backward {tl.backward * 1e3:.3f}, gradient allreduces {tl.gradients * 1e3:.3f} "
              f"of which {tl.exposed * 1e3:.3f} not hidden by backward)")
    return s


def explain(model: nn.Module, config: Any, input_shape: Sequence[int], *,
            world_size: int | None = None, machine: Any = None,
            optimizer_states: int = 1, itemsize: int | None = None,
            bucket_bytes: int = 25 << 20, strict: bool = True) -> Explanation:
    """The plan :func:`distconv.parallelize` makes for ``model`` under ``config``, on paper.

    Pure: traces the model and propagates ``input_shape`` (the global input) on the meta device;
    no communicator is used, so any ``world_size`` (default: the config's default grid size)
    works on one process.

    Args:
        model, config: as for :func:`distconv.parallelize`.
        input_shape: the global input shape, samples first: a sequence of ints >= 1 that the
            model's first layer takes (its number of dims and channels).
        world_size: ranks to plan for, an int >= 1. Default: the product of the config's
            default grid.
        machine: for predicted times: a flat :class:`~distconv.perfmodel.Machine` (e.g. from
            ``perfmodel.calibrate``), a hierarchical :class:`distconv.machines.Machine` (each
            collective priced on the level its ranks span), a factory such as
            ``distconv.machines.lassen`` or a name such as ``"lassen"``
            (:func:`distconv.machines.resolve_machine`). Default None (bytes and memory only;
            ``auto`` layers then choose with the default flat ``Machine()``).
        optimizer_states: optimizer state tensors per parameter, an int >= 0 (SGD 0, SGD with
            momentum 1, Adam 2). Default 1.
        itemsize: bytes per element, an int >= 1. Default: the model's parameter dtype.
        bucket_bytes: gradient allreduce bucket size, an int >= 1 (as ``parallelize``).
            Default 25 MiB.
        strict: True (default): a node ``parallelize`` cannot run raises, naming it, as
            ``parallelize`` does. False: every such node is listed at once in
            :attr:`Explanation.unsupported` (a coverage table: ``print`` shows it) and the rest
            is explained around them (those nodes are priced at nothing).

    Raises:
        TypeError: a model that is not an ``nn.Module``, an option of the wrong type (naming
            it, the value and what is allowed), or a ``machine`` of none of the forms above.
        ValueError: an option out of range, an unknown machine name, a config that does not fit
            the model or ``world_size``, or an ``input_shape`` the model cannot take (naming it
            and what the first layer expects).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {model!r} of type "
                        f"{type(model).__name__}")
    input_shape = _check_shape(input_shape)
    if world_size is None:
        default = dict(config).get("default", {}) if isinstance(config, dict) else {}
        world_size = math.prod(dict(default.get("grid", {"N": 1})).values())
    else:
        _check_int("world_size", world_size, 1)
    optimizer_states = _check_int("optimizer_states", optimizer_states, 0)
    bucket_bytes = _check_int("bucket_bytes", bucket_bytes, 1)
    if machine is not None:
        machine = machines.resolve_machine(machine, hierarchical=True)  # one pricing
    cfg = ParallelConfig(config, world_size=world_size)
    if itemsize is None:
        p = next(model.parameters(), None)
        itemsize = p.element_size() if p is not None else 4
    else:
        itemsize = _check_int("itemsize", itemsize, 1)
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {strict!r}")
    return _explain(model, cfg, input_shape, machine, optimizer_states, itemsize, bucket_bytes,
                    baseline=True, strict=strict)


def _check_int(name: str, value: Any, low: int) -> int:
    """``value`` as an int >= ``low`` (numpy ints too; not bools, not floats)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {low}, got {value!r} of type "
                        f"{type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def _check_shape(shape: Any) -> tuple[int, ...]:
    """``input_shape`` as a tuple of ints >= 1 (a list, tuple or ``torch.Size``)."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) or not shape:
        raise TypeError(f"input_shape must be a non-empty sequence of ints (the global input "
                        f"shape, samples first), got {shape!r}")
    if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) for s in shape):
        raise TypeError(f"input_shape must hold ints, got {tuple(shape)!r}")
    if any(s < 1 for s in shape):
        raise ValueError(f"input_shape must hold sizes >= 1, got {tuple(shape)!r}")
    return tuple(int(s) for s in shape)


def _explain(model: nn.Module, cfg: ParallelConfig, shape: tuple[int, ...],
             machine: Machine | None, optimizer_states: int, itemsize: int,
             bucket_bytes: int, baseline: bool, strict: bool = True) -> Explanation:
    gm = trace(model)
    check_input_shape(gm, shape)
    decisions: dict[str, Any] = {}
    if cfg.has_auto():
        from distconv.parallel.auto import resolve_auto

        cfg, decisions = resolve_auto(gm, cfg, shape, machine or FlatMachine(),
                                      itemsize=itemsize)
    analysis = analyse(gm, cfg, input_ndim=len(shape), strict=strict)
    meta = copy.deepcopy(gm).to("meta")
    dtype = next((p.dtype for p in gm.parameters() if p.is_floating_point()), None)
    propagate_shapes(meta, shape, dtype=dtype)  # in the model's own dtype (a .double() model)
    shapes = {n.name: tuple(n.meta["tensor_meta"].shape) for n in meta.graph.nodes
              if isinstance(n.meta.get("tensor_meta"), TensorMetadata)}
    modules = dict(gm.named_modules())
    check_shapes(analysis, modules, shapes)
    P = cfg.world_size
    layers, ranks = price_analysis(gm, analysis, shape, shapes, P, itemsize, machine,
                                   bucket_bytes, decisions)
    result = Explanation(P, ranks, shape, itemsize, optimizer_states, layers, machine,
                         unsupported=list(analysis.unsupported))
    if baseline and P > 1:
        sample = ParallelConfig({"default": {"grid": {"N": P}, "algorithm": "sample"}},
                                world_size=P)
        try:
            result.baseline = _explain(model, sample, shape, machine, optimizer_states,
                                       itemsize, bucket_bytes, baseline=False, strict=strict)
        except Unsupported:  # the model cannot run purely sample-parallel: no comparison
            result.baseline = None
    return result
