"""Steps 1 and 2 of :class:`~distkfac.preconditioner.KFAC`: which modules are preconditioned, and
their factors.

Registration walks the model once: plain ``nn.Linear`` / ``nn.Conv*d`` layers get an adapter
(:mod:`distkfac.layers`) and a forward hook, as does a ``DistLinear`` of a parallelized model
(the whole layer's factors from its rows gathered over the features,
:mod:`distkfac.sharded.linear`); ``DistConv2d`` / ``DistConvNd`` layers a work hook
whose factors follow the weight's distribution (:mod:`distkfac.sharded`, layouts ``'exact'`` and
``'block'``).  On factor-update steps the hooks form ``sum a a^T`` from the layer input and
``sum d d^T`` from its output's gradient; each is packed (upper triangle) into the open bucket of
its group's :class:`~distkfac.comm.FactorReducer`, launched asynchronously when full, so factor
communication overlaps the rest of forward and backward.  A module called several times per step
(weight sharing) or over several backward passes (``accumulation_steps``) adds its contributions
and rows.  At ``step()`` the buckets are waited for, and the factors become ``sum / rows`` of the
concatenated batch and enter the running averages."""
from __future__ import annotations

import math
import time
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from distconv.nn.conv import DistConv2d
from distconv.nn.conv_nd import DistConvNd
from distconv.nn.linear import DistLinear
from distkfac.comm import FactorReducer, PayloadBroadcaster
from distkfac.layers import LayerAdapter, adapter_for
from distkfac.preconditioner.layer import Layer
from distkfac.sharded import (
    BiasShardAdapter,
    ExactLayer,
    ShardAdapter,
    ShardGeometry,
    SpatialShardAdapter,
    attach,
    redundant_comm,
)
from distkfac.sharded.linear import DistLinearAdapter

__all__ = ["FactorHooks"]


def _input_batch(args: tuple, kwargs: dict | None) -> int | None:
    """The batch of a model's call: the leading dim of its first tensor argument (positional,
    else keyword) when that has one besides its features; None otherwise."""
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, Tensor):
            return int(value.shape[0]) if value.dim() >= 2 else None
    return None


class FactorHooks:
    """Registration, factor hooks and the running averages' update of
    :class:`~distkfac.preconditioner.KFAC` (a base of it: these methods read and fill its model,
    layers, reducers, settings and timings)."""

    def _group_comm(self, adapter: LayerAdapter):
        """The ranks a plain layer's factors are reduced over: every rank (data parallelism)."""
        return self.comm

    def _layout(self, name: str) -> str:
        if isinstance(self.factor_sharding, str):
            return self.factor_sharding
        return self.factor_sharding.get(name, "exact")

    def _register(self) -> None:
        paths: dict[int, list[str]] = {}  # every path of each module; the first is its name
        for name, module in self.model.named_modules(remove_duplicate=False):
            paths.setdefault(id(module), []).append(name)
        if not isinstance(self.factor_sharding, str):
            first = {alias: group[0] for group in paths.values() for alias in group}
            self.factor_sharding = {first.get(k, k): v for k, v in self.factor_sharding.items()}
        matched: set[str] = set()
        for name, module in self.model.named_modules():
            hit = {*paths[id(module)], type(module).__name__} & set(self.skip_layers)
            if hit:
                matched |= hit
                continue
            if isinstance(module, DistConvNd) and not module.transposed and all(
                    module.grid.extent(module.roles[r]) == 1 for r in ("C", "F")):
                self._register_spatial(name, module)
                continue
            if isinstance(module, (DistConv2d, DistConvNd)):  # factors sharded like the weight
                self._register_dist(name, module)
                continue
            if isinstance(module, DistLinear):  # features split: the whole layer's factors
                self._register_linear(name, module)
                continue
            if not isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d,
                                       nn.modules.conv._ConvTransposeNd)):
                continue
            adapter = adapter_for(module, name)
            if isinstance(adapter, str):
                self.skipped[name] = adapter
                warnings.warn(f"distkfac: skipping module {name!r}: {adapter}", stacklevel=3)
                continue
            root, pending = (self._parallel_placement(name) if self._parallel is not None
                             else (True, None))
            layer = self._add_layer(adapter, self._group_comm(adapter))
            layer.handles.append(module.register_forward_hook(
                self._forward_hook(layer, root, pending)))
        unknown = [n for n in self.skip_layers if n not in matched]
        if unknown:
            self._detach_layers()
            names = [n for n, _ in self.model.named_modules() if n][:8]
            raise ValueError(f"skip_layers names {unknown}, which match no module name or class "
                             f"name of the model (module names: {names}...)")
        self._check_sharding_names()
        if not self.layers and not self.exact_layers:
            warnings.warn("distkfac: no layer of the model can be preconditioned", stacklevel=3)

    def _parallel_placement(self, name: str) -> tuple[bool, Any]:
        """A plain (Linear) layer of a ``distconv.parallelize`` model runs sample-parallel on
        its own grid, ``x[o_N, *]``, replicated over that grid's other dims R.  Returns whether
        this rank counts its samples (the root of R: its coordinates over R all 0) and the
        communicator over R, or None without replicas.  Over R the output's gradient is a
        pending sum (the adjoint of replication; at the model's output the cotangent is kept
        on one replica), so at factor-update steps one allreduce over R completes it before G
        is formed (``allreduce_bytes`` of the output's numbers)."""
        steps = [st.layer for st in self._parallel._analysis.steps
                 if st.layer is not None and st.layer.kind == "linear" and st.layer.name == name]
        if not steps:
            raise NotImplementedError(
                f"K-FAC of {name!r}: the parallelized model runs it outside its traced layers; "
                "skip it with skip_layers")
        spec = steps[0]
        grid = self._parallel.grid(spec.layout)
        samples = spec.input.dist.used()
        replicas = [d for d, e in grid.shape.items() if e > 1 and d not in samples]
        root = all(grid.coords[d] == 0 for d in replicas)
        return root, (grid.subcomm(replicas) if replicas else None)

    def _register_linear(self, name: str, module: DistLinear) -> None:
        """A DistLinear (a Linear whose features are split): factors of the whole layer from
        every rank's rows gathered over the features (:mod:`distkfac.sharded.linear`),
        reduced over every rank as a data-parallel layer's; over replicas (grid dims that split
        neither rows nor features) the output's gradient is a pending sum, completed before G
        is formed as for a replicated plain layer."""
        if self._parallel is None:
            self._detach_layers()
            raise NotImplementedError(
                f"build the model with distconv.parallelize (or skip {name!r} with skip_layers): "
                f"K-FAC of DistLinear {name!r} takes its loss convention (the cotangent dl_i / N "
                "of the global batch N) from a parallelized model, and this model is not one")
        if self._frozen(name, module):
            return
        adapter = DistLinearAdapter(module, name)
        pending = module.grid.subcomm(adapter.replicas) if adapter.replicas else None
        layer = self._add_layer(adapter, self._group_comm(adapter))
        layer.handles.append(module.register_forward_hook(
            self._forward_hook(layer, adapter.root, pending)))

    def _add_layer(self, adapter: LayerAdapter, comm) -> Layer:
        layer = Layer(adapter, comm, self.factor_dtype)
        self.layers.append(layer)
        self._reducer(comm)
        return layer

    def _reducer(self, comm) -> FactorReducer:
        key = id(comm)
        if key not in self._reducers:
            self._reducers[key] = FactorReducer(comm, bucket_bytes=self.bucket_bytes,
                                                symmetric=self.symmetric_comm,
                                                comm_dtype=self.factor_comm_dtype)
            self._broadcasters[key] = PayloadBroadcaster(comm)
        return self._reducers[key]

    def _register_spatial(self, name: str, module: DistConvNd) -> None:
        """A DistConvNd split over samples and spatial dims: one block, its rows summed over
        the ranks that hold the weight (the work hook's statistics)."""
        if self._frozen(name, module):
            return
        comm = redundant_comm(module)
        target = self._add_layer(SpatialShardAdapter(module, name), comm)
        attach(module, self._work_hook([(target.adapter, target.name)],
                                       self._reducers[id(comm)]))

    def _frozen(self, name: str, module: nn.Module) -> bool:
        """Whether a distributed layer's parameters are frozen (then skipped, with a warning)."""
        if module.weight.requires_grad and (module.bias is None or module.bias.requires_grad):
            return False
        self.skipped[name] = "its parameters are frozen"
        warnings.warn(f"distkfac: skipping module {name!r}: frozen", stacklevel=5)
        return True

    def _register_dist(self, name: str, module: DistConv2d | DistConvNd) -> None:
        if self._frozen(name, module):
            return
        geo = ShardGeometry(module)
        comm = redundant_comm(module)
        targets: list[Any]
        # A grouped layer's K-FAC is block-diagonal by group, and a grouped DistConv2d split
        # over C or F holds whole groups: its groups' factors are local and exact in any layout.
        if geo.C * geo.F == 1 or module.groups > 1 or self._layout(name) == "block":
            targets = [self._add_layer(ShardAdapter(module, name, geo), comm)]
            if geo.bias and geo.C > 1:
                targets.append(self._add_layer(BiasShardAdapter(module, name + ".bias", geo),
                                               comm))
            keys = [(t.adapter, t.name) for t in targets]
        else:
            exact = ExactLayer(module, name, self.factor_dtype, self.factor_comm_dtype)
            self.exact_layers.append(exact)
            self._reducer(comm)
            keys = [(exact, name)]
        attach(module, self._work_hook(keys, self._reducers[id(comm)]))

    def _check_sharding_names(self) -> None:
        """Every key of a ``factor_sharding`` mapping names a layer this preconditioner registered
        (its module name); an unknown key would be ignored silently."""
        if isinstance(self.factor_sharding, str):
            return
        known = list(dict.fromkeys(
            [ly.name for ly in self.layers if not isinstance(ly.adapter, BiasShardAdapter)]
            + [ly.name for ly in self.exact_layers]))
        unknown = [k for k in self.factor_sharding if k not in known]
        if unknown:
            self._detach_layers()
            shown = ", ".join(repr(n) for n in known[:8]) + (
                f", ... ({len(known)} in all)" if len(known) > 8 else "")
            raise ValueError(f"factor_sharding names {unknown}, which are not layers K-FAC "
                             f"preconditions; keys must be module names of registered layers: "
                             f"{shown or 'none'}")

    def _detach_layers(self) -> None:
        for layer in self.layers:
            for h in layer.handles:
                h.remove()
            layer.handles = []
        for m in self.model.modules():
            if isinstance(m, (DistConv2d, DistConvNd)):
                m.work_hook = None

    def _count_micro_batch(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not (self._collecting and module.training and torch.is_grad_enabled()):
            return
        self._model_batch = _input_batch(args, kwargs)
        self._micro += 1
        if self._micro > self.accumulation_steps:  # the last step's step() never came
            for reducer in self._reducers.values():
                reducer.discard()
            self._micro = 1

    def _forward_hook(self, layer: Layer, root: bool = True, pending=None):
        def hook(module: nn.Module, inputs: tuple, output: Any) -> None:
            if not (self._collecting and module.training and torch.is_grad_enabled()):
                return
            if not inputs or not isinstance(inputs[0], Tensor):
                return
            if not isinstance(output, Tensor) or not output.requires_grad:
                return
            t0 = time.perf_counter()
            x = inputs[0]
            # d = n dL/dy: n the local batch under data parallelism (each rank's loss a local
            # mean); the global batch in a parallelized model (the cotangent is dl_i / N)
            n = (self._parallel.global_batch_size if self._parallel is not None
                 else self._local_batch(layer.adapter, x))
            batch = n * self.accumulation_steps
            a, rows = layer.adapter.a_sum(x, self.factor_dtype)
            if not root:  # a replica of samples another rank counts
                a, rows = a.zero_(), 0
            reducer = self._reducers[id(layer.comm)]
            reducer.add(layer.name + "/A", a, rows)
            self.timings["factor_compute"] += time.perf_counter() - t0

            def grad_hook(gy: Tensor) -> None:
                t1 = time.perf_counter()
                if pending is not None:  # a pending sum over the replicas of the samples
                    gy = pending.allreduce(gy.detach(), meta=f"kfac dL/dy of {layer.name}")
                g, grows = layer.adapter.g_sum(gy, batch, self.factor_dtype)
                if not root:
                    g, grows = g.zero_(), 0
                reducer.add(layer.name + "/G", g, grows)
                self.timings["factor_compute"] += time.perf_counter() - t1

            output.register_hook(grad_hook)
        return hook

    def _local_batch(self, adapter: LayerAdapter, x: Tensor) -> int:
        """``n`` of a plain model's ``d = n dL/dy``: the samples its loss averages, read as the
        leading dim of the model's input -- not of the layer's, which may hold more rows than
        samples (Swin's window attention sees ``[N * windows, tokens, C]``: n = N * windows
        made its G ``windows^2`` times the per-sample one, and a parallelized model's, whose n
        is its global batch).  A layer called on an unbatched input (its adapter counts 1
        sample where the leading dim is not 1), or outside the model's own forward, counts
        what its adapter reads from its input."""
        own = adapter.batch_size(x)
        if self._model_batch is None or (own == 1 and x.shape[0] != 1):
            return own
        return self._model_batch

    def _work_hook(self, targets: list, reducer: FactorReducer):
        """DistConv2d work hook: A from the local convolution's input, G from its output's
        gradient, for each block (or the exact layer) of the module."""
        def hook(module: nn.Module, x: Tensor, padding: tuple, y: Tensor, y_shape) -> None:
            if not (self._collecting and module.training and torch.is_grad_enabled()
                    and y.requires_grad):
                return
            t0 = time.perf_counter()
            # d = N dL/dy with N the global batch: from the layer's global shape, else the
            # parallelized model's, else (sample parallelism only) from the reduced row count
            n = y_shape[0] if y_shape[0] > 0 else getattr(self._parallel, "global_batch_size",
                                                          None)
            scale = None if n is None else float(n * self.accumulation_steps) ** 2
            deferred = []
            for target, name in targets:
                target.positions = math.prod(y_shape[2:])
                target.y_shape = tuple(y_shape)
                target.prescaled = scale is not None
                a, rows = target.work_a(x, padding, y, self.factor_dtype)
                if callable(a):  # still being reduced: added when the gradient arrives
                    deferred.append((name, a, rows))
                else:
                    reducer.add(name + "/A", a, rows,
                                symmetric=not isinstance(target, ExactLayer))
            self.timings["factor_compute"] += time.perf_counter() - t0

            def grad_hook(gy: Tensor) -> None:
                t1 = time.perf_counter()
                for name, wait, rows in deferred:
                    reducer.add(name + "/A", wait(), rows, symmetric=False)
                for target, name in targets:
                    g, rows = target.work_g(gy, self.factor_dtype)
                    if scale is not None:
                        g = g * scale
                    reducer.add(name + "/G", g, rows,
                                symmetric=not isinstance(target, ExactLayer))
                self.timings["factor_compute"] += time.perf_counter() - t1

            y.register_hook(grad_hook)
        return hook

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, stacklevel=3)

    def _update_factors(self) -> None:
        t0 = time.perf_counter()
        results: dict[str, tuple[Tensor, float]] = {}
        for reducer in self._reducers.values():
            results.update(reducer.finish())
        self.timings["factor_comm"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        decay = float(self._value("factor_decay"))
        for layer in self.layers:
            a, g = results.get(layer.name + "/A"), results.get(layer.name + "/G")
            if a is None or g is None:
                self._no_factors(layer.name)
                continue
            layer.a.update(a[0] / a[1], decay)
            scale = layer.adapter.g_scale(g[1]) if hasattr(layer.adapter, "g_scale") else 1.0
            layer.g.update(g[0] / g[1] * scale, decay)
        for exact in self.exact_layers:
            if not exact.update(results, decay):
                self._no_factors(exact.name)
        self.timings["factor_compute"] += time.perf_counter() - t0

    def _no_factors(self, name: str) -> None:
        self._warn_once(name, f"distkfac: layer {name!r} produced no factors on a factor-update "
                        "step (not called, or no gradient reached it); its factors were not "
                        "updated")
