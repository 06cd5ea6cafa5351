"""``KFAC``: the preconditioner a training loop calls between ``backward`` and the optimizer.

Per step (Pauloski et al. SC'20, Listing 1: ``loss.backward(); kfac.step(); optimizer.step()``):

1. Hooks (on factor-update steps): the forward hook forms ``sum a a^T`` from the layer input, the
   output-gradient hook ``sum d d^T``; each is packed (upper triangle) into the open bucket of
   its group's :class:`~distkfac.comm.FactorReducer`, launched asynchronously when full, so
   factor communication overlaps the rest of forward and backward.
2. ``step()`` waits for the buckets; factors become ``sum / rows`` of the concatenated batch and
   enter the running averages (fp32 by default, whatever the activation dtype).
3. On inverse-update steps the factors are decomposed where the placement policy says
   (``'lbp'`` or ``'round-robin'``) and the payloads broadcast, packed per owning rank.
4. Every step, each layer's gradient ``V`` becomes ``(G + sqrt(lam) I)^-1 V (A + sqrt(lam) I)^-1``
   (see :mod:`distkfac.methods`), scaled by the KL-clip factor
   ``nu = min(1, sqrt(kl_clip / |lr^2 sum_l <V~_l, V_l>|))`` (Pauloski et al. eq. 18).

Data parallelism: each rank's loss is a mean over its local batch and the gradients are averaged
over ranks before ``step()`` (e.g. :func:`distkfac.allreduce_gradients`).  Factors are reduced as
sums of per-row outer products with their row counts, so P ranks with local batches b equal one
process with the concatenated batch (also for unequal b); ``d = b dL/dy`` is each sample's own
loss gradient.
"""
from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from distkfac.comm import FactorReducer, PayloadBroadcaster
from distkfac.factors import RunningFactor
from distkfac.layers import LayerAdapter, adapter_for
from distkfac.methods import Method, method_for
from distkfac.placement import (
    EVERYWHERE,
    CostModel,
    FactorTask,
    LoadBalanced,
    Placement,
    placement_for,
)

__all__ = ["KFAC"]

Schedule = float | int | Callable[[int], float]
PHASES = ("factor_compute", "factor_comm", "inversion", "broadcast", "precondition")


class _Layer:
    """Runtime state of one preconditioned module."""

    def __init__(self, adapter: LayerAdapter, comm, dtype: torch.dtype) -> None:
        self.adapter = adapter
        self.comm = comm
        g = adapter.groups
        self.a = RunningFactor(g, adapter.a_dim, dtype=dtype)
        self.g = RunningFactor(g, adapter.g_dim, dtype=dtype)
        self.a_payload: Tensor | None = None
        self.g_payload: Tensor | None = None
        self.inverses: tuple[float, Tensor, Tensor] | None = None  # (damping, A^-1, G^-1)
        self.uses = 0  # steps preconditioned with the current payloads
        self.batch = 1
        self.handles: list = []

    @property
    def name(self) -> str:
        return self.adapter.name


def _check_schedule(name: str, value: Schedule, *, positive_int: bool = False,
                    unit: bool = False, allow_none: bool = False) -> None:
    if callable(value) or (allow_none and value is None):
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a callable of the step, got {value!r}")
    if positive_int and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be an int >= 1 or a callable of the step, got {value!r}")
    if unit and not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    if not unit and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


class KFAC:
    """Distributed K-FAC preconditioner for the ``nn.Linear`` and ``nn.Conv2d`` layers of a model.

    Args (keyword-only; numbers may also be callables ``f(step) -> value``):
        grid: a ``distconv.grid.ProcessorGrid``; factors are reduced and decompositions
            shared over all its ranks (data parallelism).  Default None: ``comm`` or one process.
        comm: a ``distconv.comm`` Communicator to use instead of ``grid``.  Default None.
        factor_update_steps: update factors every this many steps. Default 1.
        inv_update_steps: recompute decompositions every this many steps. Default 1.
        damping: Tikhonov damping lam (factored form, see :mod:`distkfac.methods`). Default 1e-3.
        factor_decay: running-average decay of the factors, in [0, 1). Default 0.95.
        kl_clip: KL-clip bound kappa; None disables clipping. Default 1e-3.
        lr: the optimizer's learning rate, used by the KL clip. Default 0.1.
        compute_method: ``'eigen'`` or ``'inverse'`` (Cholesky). Default ``'eigen'``.
        placement: ``'lbp'``, ``'round-robin'`` or a :class:`~distkfac.placement.Placement`.
            Default ``'lbp'``.
        symmetric_comm: send only upper triangles of symmetric matrices. Default True.
        bucket_bytes: fuse factors into allreduce buckets of at least this size. Default 1 MiB.
        factor_dtype: dtype of factors and decompositions. Default ``torch.float32``.
        skip_layers: module names or class names left unpreconditioned. Default ().
        cost_model: a :class:`~distkfac.placement.CostModel` for ``'lbp'``; default None fits
            one on this machine at the first decomposition (collectively).
    """

    def __init__(self, model: nn.Module, *, grid=None, comm=None,
                 factor_update_steps: Schedule = 1, inv_update_steps: Schedule = 1,
                 damping: Schedule = 1e-3, factor_decay: Schedule = 0.95,
                 kl_clip: Schedule | None = 1e-3, lr: Schedule = 0.1,
                 compute_method: str = "eigen", placement: str | Placement = "lbp",
                 symmetric_comm: bool = True, bucket_bytes: int = 1 << 20,
                 factor_dtype: torch.dtype = torch.float32, skip_layers: Sequence[str] = (),
                 cost_model: CostModel | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if grid is not None and comm is not None:
            raise ValueError("pass grid or comm, not both")
        if grid is not None and not hasattr(grid, "comm"):
            raise TypeError(f"grid must be a distconv ProcessorGrid, got {type(grid).__name__}")
        if comm is not None and not all(hasattr(comm, a) for a in ("allreduce", "broadcast",
                                                                   "rank", "size")):
            raise TypeError(f"comm must be a distconv Communicator, got {type(comm).__name__}")
        _check_schedule("factor_update_steps", factor_update_steps, positive_int=True)
        _check_schedule("inv_update_steps", inv_update_steps, positive_int=True)
        _check_schedule("damping", damping)
        _check_schedule("factor_decay", factor_decay, unit=True)
        _check_schedule("kl_clip", kl_clip, allow_none=True)
        _check_schedule("lr", lr)
        if factor_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"factor_dtype must be torch.float32 or torch.float64, "
                             f"got {factor_dtype}")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be an int >= 0, got {bucket_bytes!r}")
        if isinstance(skip_layers, str):
            raise TypeError("skip_layers must be a sequence of names, not a string")
        self.model = model
        self.grid = grid
        self.comm = grid.comm if grid is not None else comm
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
        self.skip_layers = tuple(skip_layers)
        self.steps = 0
        self.timings = dict.fromkeys(PHASES, 0.0)
        self.skipped: dict[str, str] = {}
        self.layers: list[_Layer] = []
        self._reducers: dict[int, FactorReducer] = {}
        self._broadcasters: dict[int, PayloadBroadcaster] = {}
        self._warned: set[str] = set()
        self._register()
        self._begin_step()

    @property
    def _pack_payloads(self) -> bool:
        """Pack symmetric payloads only when they travel (packing costs a gather each way)."""
        return self.symmetric_comm and self.comm is not None and self.comm.size > 1

    # ------------------------------------------------------------------ registration
    def _group_comm(self, adapter: LayerAdapter):
        """The ranks a layer's factors are reduced over: today every rank (data parallelism)."""
        return self.comm

    def _register(self) -> None:
        for name, module in self.model.named_modules():
            if name in self.skip_layers or type(module).__name__ in self.skip_layers:
                continue
            if type(module).__name__ == "DistConv2d":
                raise NotImplementedError(
                    f"module {name!r} is a DistConv2d: K-FAC factors sharded over the grid "
                    "are not implemented yet; pass skip_layers=['DistConv2d'] to precondition "
                    "the other layers")
            if not isinstance(module, (nn.Linear, nn.Conv2d)):
                continue
            adapter = adapter_for(module, name)
            if isinstance(adapter, str):
                self.skipped[name] = adapter
                warnings.warn(f"distkfac: skipping module {name!r}: {adapter}", stacklevel=3)
                continue
            comm = self._group_comm(adapter)
            layer = _Layer(adapter, comm, self.factor_dtype)
            layer.handles.append(module.register_forward_hook(self._forward_hook(layer)))
            self.layers.append(layer)
            key = id(comm)
            if key not in self._reducers:
                self._reducers[key] = FactorReducer(comm, bucket_bytes=self.bucket_bytes,
                                                    symmetric=self.symmetric_comm)
                self._broadcasters[key] = PayloadBroadcaster(comm)
        if not self.layers:
            warnings.warn("distkfac: no layer of the model can be preconditioned", stacklevel=3)

    def remove_hooks(self) -> None:
        """Detach from the model (the preconditioner stops collecting factors)."""
        for layer in self.layers:
            for h in layer.handles:
                h.remove()
            layer.handles = []

    def _forward_hook(self, layer: _Layer):
        def hook(module: nn.Module, inputs: tuple, output: Any) -> None:
            if not (self._collecting and module.training and torch.is_grad_enabled()):
                return
            if not inputs or not isinstance(inputs[0], Tensor):
                return
            if not isinstance(output, Tensor) or not output.requires_grad:
                return
            t0 = time.perf_counter()
            x = inputs[0]
            batch = layer.adapter.batch_size(x)
            a, rows = layer.adapter.a_sum(x, self.factor_dtype)
            reducer = self._reducers[id(layer.comm)]
            reducer.add(layer.name + "/A", a, rows)
            self.timings["factor_compute"] += time.perf_counter() - t0

            def grad_hook(gy: Tensor) -> None:
                t1 = time.perf_counter()
                g, grows = layer.adapter.g_sum(gy, batch, self.factor_dtype)
                reducer.add(layer.name + "/G", g, grows)
                self.timings["factor_compute"] += time.perf_counter() - t1

            output.register_hook(grad_hook)
        return hook

    # ------------------------------------------------------------------ schedule
    def _value(self, setting: Schedule | None, step: int | None = None) -> Any:
        s = self.steps if step is None else step
        return setting(s) if callable(setting) else setting

    def _every(self, setting: Schedule, step: int) -> bool:
        n = int(self._value(setting, step))
        if n < 1:
            raise ValueError(f"update frequency must be >= 1, got {n} at step {step}")
        return step % n == 0

    def _begin_step(self) -> None:
        self._collecting = self._every(self.factor_update_steps, self.steps)
        if self._collecting:
            for key, reducer in self._reducers.items():
                reducer.expect(f"{ly.name}/{f}" for ly in self.layers if id(ly.comm) == key
                               for f in "AG")

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of the registered layers in place."""
        if self._collecting:
            self._update_factors()
        stale = any(ly.a_payload is None and ly.a.value is not None for ly in self.layers)
        if self._every(self.inv_update_steps, self.steps) or stale:
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
        decay = float(self._value(self.factor_decay))
        for layer in self.layers:
            a, g = results.get(layer.name + "/A"), results.get(layer.name + "/G")
            if a is None or g is None:
                self._warn_once(layer.name, f"distkfac: layer {layer.name!r} produced no "
                                "factors on a factor-update step (not called, or no gradient "
                                "reached it); its factors were not updated")
                continue
            layer.a.update(a[0] / a[1], decay)
            layer.g.update(g[0] / g[1], decay)
        self.timings["factor_compute"] += time.perf_counter() - t0

    def _ensure_cost_model(self, comm) -> None:
        if isinstance(self.placement, LoadBalanced) and self.placement.cost_model is None:
            damping = float(self._value(self.damping))
            self.placement.cost_model = CostModel.fit(
                comm, lambda m: self.method.decompose(m, damping), dtype=self.factor_dtype)

    def _update_decompositions(self) -> None:
        damping = float(self._value(self.damping))
        for key, broadcaster in self._broadcasters.items():
            layers = [ly for ly in self.layers if id(ly.comm) == key and ly.a.value is not None]
            if not layers:
                continue
            comm = layers[0].comm
            size = 1 if comm is None else comm.size
            rank = 0 if comm is None else comm.rank
            if size > 1:
                self._ensure_cost_model(comm)
            factors = [f for ly in layers for f in (ly.a, ly.g)]
            numels = [self.method.payload_numel(f.groups, f.d) for f in factors]
            tasks = [FactorTask(f"{ly.name}/{n}", f.groups, f.d, numels[2 * i + j])
                     for i, ly in enumerate(layers) for j, (n, f) in enumerate(
                         (("A", ly.a), ("G", ly.g)))]
            owners = self.placement.assign(tasks, size) if size > 1 else [EVERYWHERE] * len(tasks)
            t0 = time.perf_counter()
            mine = {i: self.method.decompose(f.value, damping) for i, f in enumerate(factors)
                    if owners[i] in (EVERYWHERE, rank)}
            t1 = time.perf_counter()
            payloads = broadcaster.exchange(owners, mine, numels, self.factor_dtype,
                                            factors[0].value.device)
            t2 = time.perf_counter()
            self.timings["inversion"] += t1 - t0
            self.timings["broadcast"] += t2 - t1
            for i, layer in enumerate(layers):
                layer.a_payload, layer.g_payload = payloads[2 * i], payloads[2 * i + 1]
                layer.inverses, layer.uses = None, 0
            self.last_assignment = dict(zip((t.key for t in tasks), owners))

    def _precondition(self) -> None:
        t0 = time.perf_counter()
        damping = float(self._value(self.damping))
        done: list[tuple[_Layer, Tensor, Tensor]] = []
        for layer in self.layers:
            if layer.a_payload is None:
                continue
            ad = layer.adapter
            grad = ad.grad_matrix(self.factor_dtype)
            if grad is None:
                continue
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
            done.append((layer, grad, v))
        scale = 1.0
        kl_clip = self._value(self.kl_clip)
        if kl_clip is not None and done:
            lr = float(self._value(self.lr))
            vg = sum(float((v * g).sum()) for _, g, v in done) * lr * lr
            if vg != 0.0:
                scale = min(1.0, math.sqrt(float(kl_clip) / abs(vg)))
        for layer, _, v in done:
            layer.adapter.set_grad(v * scale)
        self.last_kl_scale = scale
        self.timings["precondition"] += time.perf_counter() - t0

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
            "skip_layers": self.skip_layers,
        }

    def state_dict(self) -> dict[str, Any]:
        """Steps, settings (callables are not saved), every layer's running factors and its
        current decompositions (so a restored run continues identically)."""
        settings = {k: v for k, v in self.settings().items() if not callable(v)}
        return {
            "steps": self.steps,
            "settings": settings,
            "factors": {ly.name: {"A": ly.a.state_dict(), "G": ly.g.state_dict()}
                        for ly in self.layers},
            "decompositions": {ly.name: {"A": ly.a_payload, "G": ly.g_payload}
                               for ly in self.layers},
            "payload_format": (self.method.name, self.method.symmetric),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore factors, decompositions, steps and non-callable settings.  Without saved
        decompositions they are recomputed at the next ``step()``."""
        names = {ly.name for ly in self.layers}
        if set(state["factors"]) != names:
            raise ValueError(f"state holds layers {sorted(state['factors'])}, this "
                             f"preconditioner has {sorted(names)}")
        settings = dict(state.get("settings", {}))
        for key in ("factor_update_steps", "inv_update_steps", "damping", "factor_decay",
                    "kl_clip", "lr"):
            if key in settings and not callable(getattr(self, key)):
                setattr(self, key, settings[key])
        if "compute_method" in settings or "symmetric_comm" in settings:
            self.compute_method = settings.get("compute_method", self.compute_method)
            self.symmetric_comm = settings.get("symmetric_comm", self.symmetric_comm)
            self.method = method_for(self.compute_method, symmetric=self._pack_payloads)
        same_format = tuple(state.get("payload_format", ())) == (self.method.name,
                                                                 self.method.symmetric)
        for layer in self.layers:
            layer.a.load_state_dict(state["factors"][layer.name]["A"])
            layer.g.load_state_dict(state["factors"][layer.name]["G"])
            saved = state.get("decompositions", {}).get(layer.name, {}) if same_format else {}
            layer.a_payload, layer.g_payload = saved.get("A"), saved.get("G")
            layer.inverses, layer.uses = None, 0
            if layer.a_payload is None or layer.g_payload is None:
                layer.a_payload = layer.g_payload = None
        self.steps = int(state["steps"])
        self._begin_step()

    def __repr__(self) -> str:
        s = self.settings()
        s["placement"] = self.placement
        s["comm"] = None if self.comm is None else f"{self.comm.backend}:{self.comm.size}"
        s["layers"] = len(self.layers)
        s["skipped"] = sorted(self.skipped)
        body = ",\n".join(f"  {k}={v!r}" for k, v in s.items())
        return f"KFAC(\n{body},\n)"
