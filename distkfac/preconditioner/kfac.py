"""The :class:`KFAC` class: its options, public methods and the order of a step's phases."""
from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

import distconv.comm
from distconv.nn.conv_nd import DistConvNd
from distconv.nn.conv import DistConv2d
from distkfac.comm import FactorReducer, PayloadBroadcaster
from distkfac.layers import LayerAdapter, adapter_for
from distkfac.lowprec import check_comm_dtype
from distkfac.methods import Method, method_for
from distkfac.preconditioner.layer import Layer, Stale, control_device
from distkfac.placement import (
    EVERYWHERE,
    CostModel,
    FactorTask,
    LoadBalanced,
    Placement,
    placement_for,
)
from distkfac.sharded import (
    LAYOUTS,
    BiasShardAdapter,
    BlockLayout,
    ExactLayer,
    ShardAdapter,
    SpatialShardAdapter,
    ShardGeometry,
    attach,
    exchange_exact,
    precondition_exact,
    redundant_comm,
)

__all__ = ["KFAC"]

Schedule = float | int | Callable[[int], float]
PHASES = ("factor_compute", "factor_comm", "inversion", "broadcast", "precondition")


def _relative_change(value: Tensor, ref: Tensor) -> float:
    """``||value - ref||_F / ||ref||_F``."""
    return float(torch.linalg.norm(value - ref) / torch.linalg.norm(ref).clamp_min(1e-300))


_RULES = {
    "factor_update_steps": "an int >= 1", "inv_update_steps": "an int >= 1",
    "damping": "a finite number > 0", "factor_decay": "a number in [0, 1)",
    "kl_clip": "a finite number > 0 (or None to disable clipping)", "lr": "a finite number > 0",
}


def _valid(name: str, value: Any) -> bool:
    if name == "kl_clip" and value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if name.endswith("_steps"):
        return isinstance(value, int) and value >= 1
    if not math.isfinite(value):
        return False
    return 0.0 <= value < 1.0 if name == "factor_decay" else value > 0


def _check_schedule(name: str, value: Schedule | None) -> None:
    if callable(value):
        return
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise TypeError(f"{name} must be {_RULES[name]} or a callable of the step, got {value!r}")
    if not _valid(name, value):
        raise ValueError(f"{name} must be {_RULES[name]} or a callable of the step, "
                         f"got {value!r}")


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


class KFAC:
    """Distributed K-FAC preconditioner for the ``nn.Linear``, ``nn.Conv2d`` and ``DistConv2d``
    layers of a model.

    Args (keyword-only; the numbers marked (s) may also be callables ``f(step) -> value``,
    checked when evaluated):
        grid: a ``distconv.grid.ProcessorGrid``: factors of plain layers are reduced and their
            decompositions shared over all its ranks (data parallelism).  Default None.
        comm: a ``distconv.comm`` Communicator to use instead of ``grid``.  Default None: the
            grid of the model's ``DistConv2d`` layers if it has any, else the job's world
            (``distconv.comm.world()``: the launcher's ranks, as DDP uses the default group;
            one process without a launcher).  Every DistConv2d's grid must be over this comm.
        factor_update_steps (s): update factors every this many steps. Default 1.
        inv_update_steps (s): recompute decompositions every this many steps. Default 1.
        damping (s): Tikhonov damping lam (factored form, see :mod:`distkfac.methods`).
            Default 1e-3.
        factor_decay (s): running-average decay of the factors, in [0, 1). Default 0.95.
        kl_clip (s): KL-clip bound kappa; None disables clipping. Default 1e-3.
        lr (s): the optimizer's learning rate, used by the KL clip. Default 0.1.
        compute_method: ``'eigen'`` or ``'inverse'`` (Cholesky). Default ``'eigen'``.
        placement: ``'lbp'``, ``'round-robin'`` or a :class:`~distkfac.placement.Placement`.
            Default ``'lbp'``.
        symmetric_comm: send only upper triangles of symmetric matrices. Default True.
        bucket_bytes: fuse factors into allreduce buckets of at least this size. Default 1 MiB.
        factor_dtype: dtype of factors and decompositions. Default ``torch.float32``.
        factor_comm_dtype: wire format of factor reductions: None (``factor_dtype``),
            ``torch.float32``, ``torch.bfloat16``, ``torch.float16`` or ``'float21'`` (see
            :mod:`distkfac.lowprec`). Default None.
        factor_sharding: layout of DistConv2d factors, ``'exact'`` or ``'block'`` (see
            :mod:`distkfac.sharded`), or a mapping from module name to layout (others
            ``'exact'``); every key must name a layer K-FAC registers (ValueError otherwise,
            listing them); a module registered under several paths may be named by any of
            them. Default ``'exact'``.
        accumulation_steps: backward passes per ``step()`` (gradient accumulation, each
            micro-batch's loss divided by it): their factor contributions add up.  A further
            forward pass before ``step()`` starts the collection anew (a step that was
            skipped). Default 1.
        stale_threshold: skip a factor's decomposition when it moved less than this (relative
            Frobenius norm) since its last one, and look again after twice as many scheduled
            decompositions (up to ``stale_max_interval``). Default None (off).  For
            ``'exact'`` row-block factors the norms are summed over the grid (one allgather
            of two float64 per looked factor), so every rank skips the same.
        stale_max_interval: the longest stretch, in scheduled decompositions. Default 8.
        skip_layers: module names or class names left unpreconditioned; each must name some
            module of the model (a module registered under several paths, e.g. a U-Net's skip
            list holding the encoder's blocks, by any of them: it is one layer, registered and
            reported under its first path, as ``named_modules()`` lists it). Default ().
        cost_model: a :class:`~distkfac.placement.CostModel` for ``'lbp'``; default None fits
            one on this machine at the first decomposition (collectively).
    """

    def __init__(self, model: nn.Module, *, grid=None, comm=None,
                 factor_update_steps: Schedule = 1, inv_update_steps: Schedule = 1,
                 damping: Schedule = 1e-3, factor_decay: Schedule = 0.95,
                 kl_clip: Schedule | None = 1e-3, lr: Schedule = 0.1,
                 compute_method: str = "eigen", placement: str | Placement = "lbp",
                 symmetric_comm: bool = True, bucket_bytes: int = 1 << 20,
                 factor_dtype: torch.dtype = torch.float32,
                 factor_comm_dtype: torch.dtype | str | None = None,
                 factor_sharding: str | Mapping[str, str] = "exact",
                 accumulation_steps: int = 1, stale_threshold: float | None = None,
                 stale_max_interval: int = 8, skip_layers: Sequence[str] = (),
                 cost_model: CostModel | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if grid is not None and comm is not None:
            raise ValueError("pass grid or comm, not both")
        if grid is not None and not hasattr(grid, "comm"):
            raise TypeError(f"grid must be a distconv ProcessorGrid, got {type(grid).__name__}")
        if comm is not None and not isinstance(comm, distconv.comm.Communicator):
            raise TypeError(f"comm must be a distconv Communicator, got {type(comm).__name__}")
        for name, value in (("factor_update_steps", factor_update_steps),
                            ("inv_update_steps", inv_update_steps), ("damping", damping),
                            ("factor_decay", factor_decay), ("kl_clip", kl_clip), ("lr", lr)):
            _check_schedule(name, value)
        if factor_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"factor_dtype must be torch.float32 or torch.float64, "
                             f"got {factor_dtype}")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be an int >= 0, got {bucket_bytes!r}")
        if isinstance(skip_layers, str) or not isinstance(skip_layers, Sequence):
            raise TypeError(f"skip_layers must be a sequence of names, got {skip_layers!r}")
        if not all(isinstance(n, str) for n in skip_layers):
            raise TypeError(f"skip_layers must hold str names, got {skip_layers!r}")
        if stale_threshold is not None and (
                isinstance(stale_threshold, bool) or not isinstance(stale_threshold, (int, float))
                or not math.isfinite(stale_threshold) or stale_threshold <= 0):
            raise ValueError(f"stale_threshold must be None or a finite number > 0, "
                             f"got {stale_threshold!r}")
        self.model = model
        self._parallel = model if hasattr(model, "global_batch_size") and hasattr(
            model, "data_grid") else None
        self.grid = grid
        self.comm = self._resolve_comm(grid.comm if grid is not None else comm)
        self.factor_update_steps = factor_update_steps
        self.inv_update_steps = inv_update_steps
        self.damping = damping
        self.factor_decay = factor_decay
        self.kl_clip = kl_clip
        self.lr = lr
        self.compute_method = compute_method
        self.symmetric_comm = bool(symmetric_comm)
        self.method: Method = method_for(compute_method, symmetric=self._pack_payloads)
        self.placement = placement_for(placement)
        if isinstance(self.placement, LoadBalanced):
            self.placement.itemsize = torch.empty((), dtype=factor_dtype).element_size()
            if cost_model is not None:
                self.placement.cost_model = cost_model
        self.bucket_bytes = bucket_bytes
        self.factor_dtype = factor_dtype
        self.factor_comm_dtype = check_comm_dtype(factor_comm_dtype)
        self.factor_sharding = self._check_sharding(factor_sharding)
        self.accumulation_steps = _check_int("accumulation_steps", accumulation_steps, 1)
        self.stale_threshold = None if stale_threshold is None else float(stale_threshold)
        self.stale_max_interval = _check_int("stale_max_interval", stale_max_interval, 1)
        self.skip_layers = tuple(skip_layers)
        self.steps = 0
        self.timings = dict.fromkeys(PHASES, 0.0)
        self.stale_counts = {"scheduled": 0, "looked": 0, "skipped": 0}
        self.skipped: dict[str, str] = {}
        self.layers: list[Layer] = []
        self.exact_layers: list[ExactLayer] = []
        self._reducers: dict[int, FactorReducer] = {}
        self._broadcasters: dict[int, PayloadBroadcaster] = {}
        self._warned: set[str] = set()
        self._micro = 0
        self._register()
        self._exact_stale = {ly.name: (Stale(), Stale()) for ly in self.exact_layers}
        self._root_hook = model.register_forward_pre_hook(self._count_micro_batch)
        self._begin_step()

    @property
    def _pack_payloads(self) -> bool:
        """Pack symmetric payloads only when they travel (packing costs a gather each way)."""
        return self.symmetric_comm and self.comm is not None and self.comm.size > 1

    @staticmethod
    def _check_sharding(value: str | Mapping[str, str]) -> str | dict[str, str]:
        if isinstance(value, str):
            if value not in LAYOUTS:
                raise ValueError(f"factor_sharding must be one of {LAYOUTS} or a mapping of "
                                 f"module names to them, got {value!r}")
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"factor_sharding must be one of {LAYOUTS} or a mapping of module "
                            f"names to them, got {value!r}")
        bad = {k: v for k, v in value.items() if not isinstance(k, str) or v not in LAYOUTS}
        if bad:
            raise ValueError(f"factor_sharding maps module names to one of {LAYOUTS}; "
                             f"got {bad!r}")
        return dict(value)

    def _resolve_comm(self, comm):
        dist = [(n, m) for n, m in self.model.named_modules()
                if isinstance(m, (DistConv2d, DistConvNd))]
        if comm is None and self._parallel is not None:
            # a parallelized model's own communicator, also where no layer of it is a DistConv2d
            # (a 3-D network runs sample-parallel): its factors are reduced over its ranks
            comm = self._parallel.comm
        if comm is None:
            comm = dist[0][1].grid.comm if dist else distconv.comm.world()
        for name, m in dist:
            if m.grid.comm is not comm:
                raise ValueError(
                    f"{type(m).__name__} {name!r} lives on a grid over {m.grid.comm!r}, but "
                    f"K-FAC was given {comm!r}: pass the grid's communicator (or its grid), or "
                    "neither")
        return comm

    # ------------------------------------------------------------------ registration
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

    def remove_hooks(self) -> None:
        """Detach from the model (the preconditioner stops collecting factors)."""
        self._detach_layers()
        self._root_hook.remove()

    def _count_micro_batch(self, module: nn.Module, args: Any) -> None:
        if not (self._collecting and module.training and torch.is_grad_enabled()):
            return
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
                 else layer.adapter.batch_size(x))
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

    # ------------------------------------------------------------------ schedule
    def _value(self, name: str, step: int | None = None) -> Any:
        """A setting's value at ``step`` (default: now), a schedule's checked as it is read."""
        setting = getattr(self, name)
        s = self.steps if step is None else step
        if not callable(setting):
            return setting
        value = setting(s)
        if not _valid(name, value):
            raise ValueError(f"{name} schedule returned {value!r} at step {s}; it must return "
                             f"{_RULES[name]}")
        return value

    def _every(self, name: str, step: int) -> bool:
        return step % int(self._value(name, step)) == 0

    def _begin_step(self) -> None:
        self._micro = 0
        self._collecting = self._every("factor_update_steps", self.steps)
        if self._collecting:
            for key, reducer in self._reducers.items():
                names = [ly.name for ly in self.layers if id(ly.comm) == key]
                names += [ly.name for ly in self.exact_layers if id(ly.comm) == key]
                reducer.expect(f"{n}/{f}" for n in names for f in "AG")

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of the registered layers in place."""
        if self._collecting:
            self._update_factors()
        missing = any(ly.a_payload is None and ly.a.value is not None for ly in self.layers)
        missing = missing or any(ly.inverse_rows["A"] is None and ly.factors["A"] is not None
                             for ly in self.exact_layers)
        if self._every("inv_update_steps", self.steps) or missing:
            self._update_decompositions()
        self._precondition()
        self.steps += 1
        self._begin_step()

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

    def _ensure_cost_model(self) -> None:
        """Fit LBP's cost model once, over every rank: a placement must come from a model all
        ranks share, and the groups of sharded layers are segments of the grid (a model fitted
        per segment placed a data-parallel layer differently on different segments)."""
        if isinstance(self.placement, LoadBalanced) and self.placement.cost_model is None:
            damping = float(self._value("damping"))
            self.placement.cost_model = CostModel.fit(
                self.comm, lambda m: self.method.decompose(m, damping), dtype=self.factor_dtype)

    def _stale_due(self, entries: list[tuple[Stale, Tensor, bool]],
                   moved: Callable[[list[int]], list[bool]]) -> list[bool]:
        """The stale-statistics rule over ``(state, current value, must decompose)`` entries
        at a scheduled decomposition: a factor whose wait is over is looked at, ``moved(looks)``
        says (the same on every rank) which looked factors moved by ``stale_threshold`` or
        more; those are decomposed and their interval reset, the others' doubles (up to
        ``stale_max_interval``)."""
        due: list[bool | None] = []
        looks = []
        for i, (st, _, force) in enumerate(entries):
            self.stale_counts["scheduled"] += 1
            if force or st.ref is None:
                due.append(True)
            elif st.wait > 1:
                st.wait -= 1
                due.append(False)
            else:
                due.append(None)
                looks.append(i)
        it = iter(moved(looks) if looks else [])
        self.stale_counts["looked"] += len(looks)
        for i, (st, value, _) in enumerate(entries):
            if due[i] is None:
                if next(it):
                    due[i], st.interval = True, 1
                else:
                    due[i] = False
                    st.interval = min(2 * st.interval, self.stale_max_interval)
                    st.wait = st.interval
            if due[i]:
                st.ref, st.wait = value.clone(), st.interval
            else:
                self.stale_counts["skipped"] += 1
        return due  # type: ignore[return-value]

    def _due(self, layers: list[Layer], comm) -> list[bool]:
        """Which of the layers' factors (A, G of each) to decompose at this scheduled update;
        with ``stale_threshold``, rank 0 of ``comm`` (every rank of it holds the factors)
        decides the looks and broadcasts them, so every rank skips the same."""
        if self.stale_threshold is None:
            return [True] * (2 * len(layers))
        entries = [(st, f.value, ly.a_payload is None)
                   for ly in layers for f, st in zip((ly.a, ly.g), ly.stale)]

        def moved(looks: list[int]) -> list[bool]:
            flags = torch.tensor([_relative_change(entries[i][1], entries[i][0].ref)
                                  >= self.stale_threshold for i in looks], dtype=torch.float64,
                                 device=control_device(comm))
            if comm is not None and comm.size > 1:
                flags = comm.broadcast(flags, root=0, meta="kfac stale statistics")
            return [bool(v) for v in flags.tolist()]

        return self._stale_due(entries, moved)

    def _exact_due(self, layers: list[ExactLayer]) -> list[bool]:
        """The stale rule for row-block factors: the squared norms of each looked factor's
        change and reference are summed over the grid (each row block counted once: divided
        by the ranks that hold it) by one allgather, in rank order, so every rank decides
        alike."""
        if self.stale_threshold is None:
            return [True] * (2 * len(layers))
        entries = [(st, ly.factors[k], ly.inverse_rows[k] is None)
                   for ly in layers for k, st in zip("AG", self._exact_stale[ly.name])]
        holders = [ly.grid.size // (ly.grid.extent(d) if d else 1)
                   for ly in layers for d in (ly.geo.cdim, ly.geo.fdim)]

        def moved(looks: list[int]) -> list[bool]:
            local = torch.tensor([[float(torch.sum((entries[i][1] - entries[i][0].ref) ** 2)),
                                   float(torch.sum(entries[i][0].ref ** 2))]
                                  for i in looks], dtype=torch.float64,
                                 device=control_device(self.comm))
            local = local / torch.tensor([holders[i] for i in looks], dtype=torch.float64,
                                         device=local.device)[:, None]
            parts = ([local] if self.comm is None or self.comm.size == 1 else
                     self.comm.allgather(local, meta="kfac stale statistics"))
            total = torch.zeros_like(local)
            for part in parts:
                total += part
            return [math.sqrt(num / den) >= self.stale_threshold if den > 0 else True
                    for num, den in total.tolist()]

        return self._stale_due(entries, moved)

    def _update_decompositions(self) -> None:
        damping = float(self._value("damping"))
        for key, broadcaster in self._broadcasters.items():
            layers = [ly for ly in self.layers if id(ly.comm) == key and ly.a.value is not None]
            if not layers:
                continue
            comm = layers[0].comm
            size = 1 if comm is None else comm.size
            rank = 0 if comm is None else comm.rank
            if size > 1:
                self._ensure_cost_model()
            due = self._due(layers, comm)
            factors = [f for ly in layers for f in (ly.a, ly.g)]
            index = [i for i in range(len(factors)) if due[i]]
            if not index:
                continue
            names = [f"{ly.name}/{n}" for ly in layers for n in "AG"]
            numels = [self.method.payload_numel(factors[i].groups, factors[i].d) for i in index]
            tasks = [FactorTask(names[i], factors[i].groups, factors[i].d, n)
                     for i, n in zip(index, numels)]
            owners = self.placement.assign(tasks, size) if size > 1 else [EVERYWHERE] * len(tasks)
            t0 = time.perf_counter()
            mine = {j: self.method.decompose(factors[i].value, damping)
                    for j, i in enumerate(index) if owners[j] in (EVERYWHERE, rank)}
            t1 = time.perf_counter()
            payloads = broadcaster.exchange(owners, mine, numels, self.factor_dtype,
                                            factors[0].value.device)
            t2 = time.perf_counter()
            self.timings["inversion"] += t1 - t0
            self.timings["broadcast"] += t2 - t1
            for j, i in enumerate(index):
                layer = layers[i // 2]
                if i % 2 == 0:
                    layer.a_payload = payloads[j]
                else:
                    layer.g_payload = payloads[j]
                layer.inverses, layer.uses = None, 0
            self.last_assignment = dict(zip((t.key for t in tasks), owners))
        if self.exact_layers:
            self._update_exact(damping)

    def _update_exact(self, damping: float) -> None:
        layers = [ly for ly in self.exact_layers if ly.factors["A"] is not None]
        if not layers:
            return
        size = self.comm.size
        due = self._exact_due(layers)
        work = [(ly, k) for i, (ly, k) in enumerate((ly, k) for ly in layers for k in "AG")
                if due[i]]
        if not work:
            return
        tasks = [FactorTask(f"{ly.name}/{k}", 1, ly.side[k], ly.side[k] * ly.side[k])
                 for ly, k in work]
        owners = [o if o != EVERYWHERE else i % size
                  for i, o in enumerate(self.placement.assign(tasks, size))]
        t0 = time.perf_counter()

        def decompose(full: Tensor) -> Tensor:
            payload = self.method.decompose(full[None], damping)
            return self.method.damped_inverse(payload, 1, full.shape[0], damping)[0]

        exchange_exact(work, owners, self.comm, decompose, self.factor_dtype)
        self.timings["inversion"] += time.perf_counter() - t0
        self.last_exact_assignment = dict(zip((t.key for t in tasks), owners))

    def _precondition(self) -> None:
        t0 = time.perf_counter()
        damping = float(self._value("damping"))
        done: list[tuple[int, Tensor, Tensor, Callable[[Tensor], None]]] = []

        def others() -> None:
            for layer in self.layers:
                out = self._precondition_layer(layer, damping)
                if out is not None:
                    done.append(out)

        # the exact layers' reduce-scatters are in flight while the others are preconditioned
        done += precondition_exact(self.exact_layers, others)
        scale = 1.0
        kl_clip = self._value("kl_clip")
        if kl_clip is not None and done:
            lr = float(self._value("lr"))
            vg = self._vg(done) * lr * lr
            if vg != 0.0:
                scale = min(1.0, math.sqrt(float(kl_clip) / abs(vg)))
        for _, _, v, write in done:
            write(v * scale)
        self.last_kl_scale = scale
        self.timings["precondition"] += time.perf_counter() - t0

    def _precondition_layer(self, layer: Layer, damping: float,
                            ) -> tuple[int, Tensor, Tensor, Callable[[Tensor], None]] | None:
        """``(replication, V, V~, write)`` of a layer with whole (not row-block) factors."""
        if layer.a_payload is None:
            return None
        ad = layer.adapter
        grad = ad.grad_matrix(self.factor_dtype)
        if grad is None:
            return None
        # A decomposition used once (inverse updates every step) is applied directly; from
        # its second use on, the damped inverses are formed once and reused.
        fresh = layer.uses == 0
        layer.uses += 1
        if fresh:
            v = self.method.precondition(grad, layer.a_payload, layer.g_payload, ad.groups,
                                         ad.a_dim, ad.g_dim, damping)
        else:
            if layer.inverses is None or layer.inverses[0] != damping:
                layer.inverses = (
                    damping,
                    self.method.damped_inverse(layer.a_payload, ad.groups, ad.a_dim, damping),
                    self.method.damped_inverse(layer.g_payload, ad.groups, ad.g_dim, damping))
            _, a_inv, g_inv = layer.inverses
            v = g_inv @ grad @ a_inv
        return layer.replication, grad, v, ad.set_grad

    def _vg(self, done: list) -> float:
        """``sum_l <V~_l, V_l>`` over the global model: local sums, and when some layers are
        sharded one float64 allreduce over the grid with each gradient counted once."""
        sharded = self.exact_layers or any(ly.comm is not self.comm for ly in self.layers)
        if not sharded or self.comm is None or self.comm.size == 1:
            return sum(float((v * g).sum()) for _, g, v, _ in done)
        weights = [(self.comm.size if rep == 0 else rep) for rep, _, _, _ in done]
        local = sum(float((v * g).sum()) / w for w, (_, g, v, _) in zip(weights, done))
        total = self.comm.allreduce(torch.tensor([local], dtype=torch.float64,
                                                 device=control_device(self.comm)),
                                    meta="kfac KL clip")
        return float(total[0])

    # ------------------------------------------------------------------ state
    def reset_timings(self) -> None:
        self.timings = dict.fromkeys(PHASES, 0.0)

    def settings(self) -> dict[str, Any]:
        return {
            "factor_update_steps": self.factor_update_steps,
            "inv_update_steps": self.inv_update_steps,
            "damping": self.damping,
            "factor_decay": self.factor_decay,
            "kl_clip": self.kl_clip,
            "lr": self.lr,
            "compute_method": self.compute_method,
            "placement": self.placement.name,
            "symmetric_comm": self.symmetric_comm,
            "bucket_bytes": self.bucket_bytes,
            "factor_dtype": self.factor_dtype,
            "factor_comm_dtype": self.factor_comm_dtype,
            "factor_sharding": self.factor_sharding,
            "accumulation_steps": self.accumulation_steps,
            "stale_threshold": self.stale_threshold,
            "stale_max_interval": self.stale_max_interval,
            "skip_layers": self.skip_layers,
        }

    def shard_specs(self) -> dict[str, Any]:
        """Where the tensors of :meth:`state_dict` lie, for checkpoints that reshard
        (``distconv.save(..., states={"kfac": kfac})``).  Data-parallel layers and DistConv2d
        layers split only over samples and rows hold whole factors (replicated).  A
        channel/filter-parallel layer under ``'exact'`` holds its factors as blocks of the
        global ones, ``A[*, o_C, *]`` and ``G[*, o_F, *]`` (shape ``(1, d, d)``, as one
        process holds them), and the rows of the damped inverses its gradient meets; a
        grouped layer split over its groups holds ``[o, *, *]`` blocks of its factors and of
        its decompositions' rows per group.  So a checkpoint loads onto any grid, any
        algorithm, or one process with plain layers.  Under ``'block'`` each shard's blocks
        (:class:`~distkfac.sharded.BlockLayout`) are stacked over the shards, zero-padded to
        the largest: ``[o_F, o_C, *, *]`` of shape ``(F, C, d, d)``, keyed by the layout, so
        they load lazily onto the same C and F on any grid, and whole elsewhere (see
        :meth:`load_state_dict`).
        Where the layout changes the decompositions are recomputed at the next ``step()``
        from the loaded factors; where it does not, the run continues identically."""
        from distconv.distribution import Dist
        from distconv.nn.sharding import ShardSpec

        specs: dict[str, Any] = {}
        for ly in self.layers:
            ad = ly.adapter
            if (not isinstance(ad, (ShardAdapter, BiasShardAdapter)) or ad.geo.C * ad.geo.F == 1
                    or ad.module.groups == 1):
                continue
            # whole groups per rank: blocks of the global (groups, d, d) factors over the
            # grid dim that splits the filters, and of the decompositions' rows per group
            groups, grid, dim = ad.module.groups, ad.module.grid, ad.geo.fdim
            for key, d in (("A", ad.a_dim), ("G", ad.g_dim)):
                specs[f"factors/{ly.name}/{key}/value"] = ShardSpec(
                    grid, Dist((dim, None, None)), (groups, d, d))
                specs[f"decompositions/{ly.name}/{key}"] = ShardSpec(
                    grid, Dist((dim, None)), (groups, self.method.group_numel(d)))
        for name, parts in self._block_modules().items():
            geo = parts["weight"].adapter.geo
            layout, grid = BlockLayout.of(geo), parts["weight"].adapter.module.grid
            shards = (layout.F, layout.C)
            over = lambda *rest: Dist((geo.fdim, geo.cdim, *rest))  # noqa: E731
            for part in parts:
                base = f"block/{name}/{layout.key}/{part}"
                for key in "AG":
                    d = layout.side(part, key)
                    for field in (key, f"{key}_ref"):
                        specs[f"{base}/{field}"] = ShardSpec(grid, over(None, None),
                                                             (*shards, d, d))
                    specs[f"{base}/{key}_decomposition"] = ShardSpec(
                        grid, over(None), (*shards, self.method.group_numel(d)))
                specs[f"{base}/counters"] = ShardSpec(grid, over(None), (*shards, 5))
        for ly in self.exact_layers:
            geo, grid = ly.geo, ly.grid
            specs[f"factors/{ly.name}/A/value"] = ShardSpec(
                grid, Dist((None, geo.cdim, None)), (1, geo.K, geo.K))
            specs[f"factors/{ly.name}/G/value"] = ShardSpec(
                grid, Dist((None, geo.fdim, None)), (1, geo.fo, geo.fo))
            specs[f"exact_inverses/{ly.name}/A"] = ShardSpec(
                grid, Dist((geo.cdim, None, None)), (geo.ci, geo.k2, geo.K))
            specs[f"exact_inverses/{ly.name}/G"] = ShardSpec(
                grid, Dist((geo.fdim, None)), (geo.fo, geo.fo))
        # the stale-statistics references lie like the factors
        for key in [k for k in specs if k.startswith("factors/")]:
            specs["stale/" + key[len("factors/"): -len("/value")] + "/ref"] = specs[key]
        return specs

    def state_dict(self) -> dict[str, Any]:
        """Steps, settings (callables are not saved), every layer's running factors, its
        current decompositions and stale-statistics state (so a restored run continues
        identically).  Factors are
        ``{"factors": {layer: {"A": {"value", "updates"}, "G": ...}}}`` for every layer, the
        blocks of the global ``(groups, d, d)`` factors this rank holds (see
        :meth:`shard_specs`); decompositions are per layout, kept with how many steps they
        have preconditioned (``uses``: the damped inverses are formed again from them where the
        uninterrupted run reused its own).  ``'block'`` layers of channel/filter-parallel
        modules are under ``"block"``, keyed by module and layout (see
        :meth:`_block_state`), and the LBP cost model under ``"placement"``."""
        settings = {k: v for k, v in self.settings().items() if not callable(v)}
        blocks = self._block_modules()
        in_blocks = {id(ly) for parts in blocks.values() for ly in parts.values()}
        whole = [ly for ly in self.layers if id(ly) not in in_blocks]
        factors = {ly.name: {"A": ly.a.state_dict(), "G": ly.g.state_dict()}
                   for ly in whole}
        inverses: dict[str, Any] = {}
        for ly in self.exact_layers:
            factors[ly.name] = {k: {"value": None if ly.factors[k] is None
                                    else ly.factors[k].unsqueeze(0), "updates": ly.updates}
                                for k in "AG"}
            a_inv, g_inv = ly.inverse_rows["A"], ly.inverse_rows["G"]
            if a_inv is not None:
                cn = ly.geo.c_blocks[ly.geo.c][1]
                inverses[ly.name] = {
                    "A": a_inv[: cn * ly.geo.k2].reshape(cn, ly.geo.k2, -1).clone(), "G": g_inv}
                if ly.geo.bias:
                    inverses[ly.name]["A_bias"] = a_inv[-1].clone()
        stale = {ly.name: dict(zip("AG", ly.stale)) for ly in whole}
        stale.update({name: dict(zip("AG", pair)) for name, pair in self._exact_stale.items()})
        exact = {ly.name for ly in self.exact_layers}
        return {
            "steps": self.steps,
            "settings": settings,
            "factors": factors,
            "stale": {name: {k: {"ref": None if st.ref is None else
                                 st.ref.unsqueeze(0) if name in exact else st.ref,
                                 "interval": st.interval, "wait": st.wait}
                             for k, st in pair.items()} for name, pair in stale.items()},
            "decompositions": {ly.name: {k: self._by_group(ly, k) for k in "AG"}
                               for ly in whole},
            "uses": {ly.name: ly.uses for ly in whole},
            "exact_inverses": inverses,
            "block": {name: self._block_state(parts) for name, parts in blocks.items()},
            "placement": self.placement.state_dict(),
            "payload_format": self.method.name,  # rows per group: packing does not matter
        }

    def _block_modules(self) -> dict[str, dict[str, Layer]]:
        """The ``'block'`` layers of DistConv2d modules split over C or F by module name:
        ``{"weight": layer}``, plus ``"bias"`` where the bias is a block of its own."""
        out: dict[str, dict[str, Layer]] = {}
        for ly in self.layers:
            ad = ly.adapter
            if (isinstance(ad, (ShardAdapter, BiasShardAdapter)) and ad.geo.C * ad.geo.F > 1
                    and ad.module.groups == 1):
                bias = isinstance(ad, BiasShardAdapter)
                name = ly.name[: -len(".bias")] if bias else ly.name
                out.setdefault(name, {})["bias" if bias else "weight"] = ly
        return out

    def _block_state(self, parts: dict[str, Layer]) -> dict[str, Any]:
        """``{layout key: {part: fields}}`` of one module's shard: its factors, stale-statistics
        references and decompositions zero-padded to the layout's largest block, as this
        shard's ``(1, 1, ...)`` entry of the stack over the shards; the stale intervals and
        waits and the uses of the decompositions as ``counters``."""
        geo = parts["weight"].adapter.geo
        layout = BlockLayout.of(geo)
        out: dict[str, Any] = {}
        for part, ly in parts.items():
            fields: dict[str, Any] = {"updates": {"A": ly.a.updates, "G": ly.g.updates}}
            counters = []
            for key, factor, st in (("A", ly.a, ly.stale[0]), ("G", ly.g, ly.stale[1])):
                d = layout.side(part, key)
                fields[key] = _padded(factor.value, (d, d))
                fields[f"{key}_ref"] = _padded(st.ref, (d, d))
                rows = self._by_group(ly, key)
                fields[f"{key}_decomposition"] = _padded(
                    rows, (self.method.group_numel(d),))
                counters += [st.interval, st.wait]
            fields["counters"] = torch.tensor([[counters + [ly.uses]]], dtype=torch.int64)
            out[part] = fields
        return {layout.key: {"layout": {k: getattr(layout, k) for k in LAYOUT_FIELDS}, **out}}

    def _by_group(self, layer: Layer, key: str) -> Tensor | None:
        payload = layer.a_payload if key == "A" else layer.g_payload
        ad = layer.adapter
        return None if payload is None else self.method.by_group(
            payload, ad.groups, ad.a_dim if key == "A" else ad.g_dim)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore factors, decompositions, steps and non-callable settings.  Without saved
        decompositions (none yet, or saved under another layout) they are recomputed at the
        next ``step()``.

        ``'block'`` state (:class:`~distkfac.sharded.BlockLayout`): on the same C x F split (any
        grid, world size or algorithm) every shard takes its own blocks, decompositions and
        stale-statistics state, and the run continues identically; on a split whose blocks lie
        inside the saved ones (e.g. C = 2 saved, C = 4 loaded, where the channel blocks nest)
        or from whole factors saved under ``'exact'``, each block is cut from the saved one
        that holds it (bitwise the same values), decompositions are recomputed at the next
        ``step()`` and the stale-statistics schedule starts again.

        Raises:
            ValueError: another set of layers; ``'block'`` state loaded onto a layout whose
                blocks do not lie inside the saved ones, or onto whole factors (``'exact'``, or
                no channel or filter split), naming both layouts.
        """
        blocks = self._block_modules()
        in_blocks = {id(ly) for parts in blocks.values() for ly in parts.values()}
        whole = [ly for ly in self.layers if id(ly) not in in_blocks]
        saved_blocks = state.get("block", {})
        names = ({ly.name for ly in whole} | {ly.name for ly in self.exact_layers}
                 | set(blocks))
        saved_names = set(state["factors"]) | set(saved_blocks)
        if saved_names != names:
            raise ValueError(f"state holds layers {sorted(saved_names)}, this "
                             f"preconditioner has {sorted(names)}")
        for ly in [*whole, *self.exact_layers]:
            if ly.name in saved_blocks:
                saved, = (BlockLayout(**{k: v["layout"][k] for k in LAYOUT_FIELDS})
                          for v in saved_blocks[ly.name].values())
                geo = ly.geo if isinstance(ly, ExactLayer) else ly.adapter.geo
                raise ValueError(
                    f"K-FAC layer {ly.name!r}: the state holds its factors under {saved}; this "
                    f"preconditioner keeps {BlockLayout.of(geo, whole=True)}, which diagonal "
                    "blocks cannot give: load it with the saved layout (or one that splits "
                    "those blocks further), or let the factors re-accumulate")
        settings = dict(state.get("settings", {}))
        for key in ("factor_update_steps", "inv_update_steps", "damping", "factor_decay",
                    "kl_clip", "lr"):
            if key in settings and not callable(getattr(self, key)):
                setattr(self, key, settings[key])
        if "compute_method" in settings or "symmetric_comm" in settings:
            self.compute_method = settings.get("compute_method", self.compute_method)
            self.symmetric_comm = settings.get("symmetric_comm", self.symmetric_comm)
            self.method = method_for(self.compute_method, symmetric=self._pack_payloads)
        same_format = state.get("payload_format") == self.method.name
        for layer in whole:
            layer.a.load_state_dict(state["factors"][layer.name]["A"])
            layer.g.load_state_dict(state["factors"][layer.name]["G"])
            saved = state.get("decompositions", {}).get(layer.name, {}) if same_format else {}
            ad = layer.adapter
            layer.a_payload, layer.g_payload = (
                None if saved.get(k) is None else
                self.method.from_groups(saved[k], ad.groups, d).to(self.factor_dtype)
                for k, d in (("A", ad.a_dim), ("G", ad.g_dim)))
            layer.inverses = None
            layer.uses = int(state.get("uses", {}).get(layer.name, 0)) if same_format else 0
            if layer.a_payload is None or layer.g_payload is None:
                layer.a_payload = layer.g_payload = None
                layer.uses = 0
        for layer in self.exact_layers:
            saved = state["factors"][layer.name]
            for key in "AG":
                value = saved[key]["value"]
                want = (1, len(layer.rows[key]), layer.side[key])
                if value is not None and tuple(value.shape) != want:
                    raise ValueError(f"factor {key} of {layer.name!r} of shape "
                                     f"{tuple(value.shape)} does not fit this rank's block "
                                     f"{want}")
                layer.factors[key] = None if value is None else value[0].to(
                    self.factor_dtype).clone()
            layer.updates = int(saved["A"]["updates"])
            inv = state.get("exact_inverses", {}).get(layer.name)
            layer.inverse_rows = {"A": None, "G": None}
            if inv is not None:
                a_rows = [inv["A"].reshape(-1, layer.side["A"])]
                if layer.geo.bias:
                    a_rows.append(inv["A_bias"].reshape(1, -1))
                layer.inverse_rows = {"A": torch.cat(a_rows).to(self.factor_dtype),
                                      "G": inv["G"].to(self.factor_dtype).clone()}
        saved_stale = state.get("stale", {})
        pairs = [(ly.name, ly.stale, False) for ly in whole] + [
            (name, pair, True) for name, pair in self._exact_stale.items()]
        for name, pair, exact in pairs:
            for key, st in zip("AG", pair):
                got = saved_stale.get(name, {}).get(key)
                if got is None:
                    st.ref, st.interval, st.wait = None, 1, 1
                    continue
                ref = got["ref"]
                st.ref = None if ref is None else (ref[0] if exact else ref).to(
                    self.factor_dtype).clone()
                st.interval, st.wait = int(got["interval"]), int(got["wait"])
        if state["settings"].get("placement") == self.placement.name:
            self.placement.load_state_dict(state.get("placement", {}))
        for name, parts in blocks.items():
            if name in saved_blocks:
                self._load_blocks(name, parts, saved_blocks[name], same_format)
            else:
                self._load_blocks_from_whole(name, parts, state["factors"][name])
        self.steps = int(state["steps"])
        self._begin_step()

    def _load_blocks(self, name: str, parts: dict[str, Layer], saved: dict[str, Any],
                     same_format: bool) -> None:
        """One module's ``'block'`` state: on the saved layout each shard takes its own entry
        (decompositions, stale statistics and uses too: the run continues identically); on
        another, its blocks are cut from the saved blocks that hold them."""
        geo = parts["weight"].adapter.geo
        mine = BlockLayout.of(geo)
        entry, = saved.values()
        layout = BlockLayout(**{k: entry["layout"][k] for k in LAYOUT_FIELDS})
        if layout != mine:
            def source(part: str, f: int, c: int, field: str) -> Tensor | None:
                t = entry[part][field]
                return None if t is None else t[f, c]

            self._cut_blocks(name, parts, layout, source,
                             lambda part, k: entry[part]["updates"][k])
            return
        for part, ly in parts.items():
            fields = entry[part]
            ranges = mine.ranges(part, geo.f, geo.c)

            def own(field: str) -> Tensor | None:
                t = fields[field]
                return None if t is None else t[0, 0] if t.shape[:2] == (1, 1) else \
                    t[geo.f, geo.c]

            counters = own("counters").tolist()
            for i, (key, factor, st) in enumerate((("A", ly.a, ly.stale[0]),
                                                   ("G", ly.g, ly.stale[1]))):
                d = ranges[key][1] - ranges[key][0]
                value, ref = own(key), own(f"{key}_ref")
                factor.load_state_dict({"value": None if value is None else value[None, :d, :d],
                                        "updates": fields["updates"][key]})
                st.ref = None if ref is None else ref[None, :d, :d].to(self.factor_dtype).clone()
                st.interval, st.wait = int(counters[2 * i]), int(counters[2 * i + 1])
                rows = own(f"{key}_decomposition") if same_format else None
                payload = None if rows is None else self.method.from_groups(
                    rows[None, : self.method.group_numel(d)], 1, d).to(self.factor_dtype)
                if key == "A":
                    ly.a_payload = payload
                else:
                    ly.g_payload = payload
            ly.inverses, ly.uses = None, int(counters[4])
            if ly.a_payload is None or ly.g_payload is None:
                ly.a_payload = ly.g_payload = None
                ly.uses = 0

    def _load_blocks_from_whole(self, name: str, parts: dict[str, Layer],
                                saved: dict[str, Any]) -> None:
        """One module's ``'block'`` state from whole factors (saved under ``'exact'`` or on a
        layout without a channel or filter split): its diagonal blocks."""
        geo = parts["weight"].adapter.geo

        def source(part: str, f: int, c: int, field: str) -> Tensor | None:
            value = saved[field]["value"]
            return None if value is None else value[0]

        self._cut_blocks(name, parts, BlockLayout.of(geo, whole=True), source,
                         lambda part, k: saved[k]["updates"])

    def _cut_blocks(self, name: str, parts: dict[str, Layer], layout: BlockLayout,
                    source: Callable[[str, int, int, str], Tensor | None],
                    updates: Callable[[str, str], int]) -> None:
        """Each shard's factors cut from the blocks of ``layout`` that hold them
        (``source(part, f, c, "A" | "G")``: that block, padded); decompositions are recomputed
        at the next step and the stale-statistics schedule starts again.  A block that lies in
        no saved block is refused, naming both layouts."""
        geo = parts["weight"].adapter.geo
        mine = BlockLayout.of(geo)
        for part, ly in parts.items():
            for key, factor, st in (("A", ly.a, ly.stale[0]), ("G", ly.g, ly.stale[1])):
                lo, hi = mine.ranges(part, geo.f, geo.c)[key]
                found = layout.holder(key, lo, hi, prefer=part)
                if found is None:
                    raise ValueError(
                        f"K-FAC layer {name!r}: the state holds its factors under {layout}; "
                        f"this preconditioner keeps {mine}, and the {key} block [{lo}:{hi}) of "
                        f"shard (f={geo.f}, c={geo.c}) lies in no saved block: load it with the "
                        "saved layout (or one that splits those blocks further), or let the "
                        "factors re-accumulate")
                part0, f0, c0, start = found
                value = source(part0, f0, c0, key)
                factor.load_state_dict({
                    "value": None if value is None else
                    value[None, lo - start: hi - start, lo - start: hi - start],
                    "updates": updates(part0, key)})
                st.ref, st.interval, st.wait = None, 1, 1
            ly.a_payload = ly.g_payload = ly.inverses = None
            ly.uses = 0

    def __repr__(self) -> str:
        s = self.settings()
        s["placement"] = self.placement
        s["comm"] = None if self.comm is None else f"{self.comm.backend}:{self.comm.size}"
        s["layers"] = len(self.layers) + len(self.exact_layers)
        s["skipped"] = sorted(self.skipped)
        body = ",\n".join(f"  {k}={v!r}" for k, v in s.items())
        return f"KFAC(\n{body},\n)"


#: the fields of a BlockLayout a checkpoint holds, beside its key
LAYOUT_FIELDS = ("ci", "fo", "k2", "bias", "C", "F")


def _padded(t: Tensor | None, shape: tuple[int, ...]) -> Tensor | None:
    """``t[0]`` (a one-group factor or payload row) zero-padded to ``shape``, as a
    ``(1, 1, *shape)`` entry of a stack over shards."""
    if t is None:
        return None
    out = t.new_zeros(shape)
    out[tuple(slice(0, n) for n in t.shape[1:])] = t[0]
    return out[None, None]


