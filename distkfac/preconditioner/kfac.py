"""The :class:`KFAC` class: its options, public methods and the order of a step's phases."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

import distconv.comm
from distconv.nn.conv import DistConv2d
from distconv.nn.conv_nd import DistConvNd
from distkfac.comm import FactorReducer, PayloadBroadcaster
from distkfac.lowprec import check_comm_dtype
from distkfac.methods import Method, method_for
from distkfac.placement import (
    CostModel,
    LoadBalanced,
    Placement,
    placement_for,
)
from distkfac.preconditioner.decompositions import Decompositions
from distkfac.preconditioner.hooks import FactorHooks
from distkfac.preconditioner.layer import Layer, Stale
from distkfac.preconditioner.precondition import Preconditioning
from distkfac.sharded import (
    LAYOUTS,
    BiasShardAdapter,
    BlockLayout,
    ExactLayer,
    ShardAdapter,
)

__all__ = ["KFAC"]

Schedule = float | int | Callable[[int], float]
PHASES = ("factor_compute", "factor_comm", "inversion", "broadcast", "precondition")


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


class KFAC(FactorHooks, Decompositions, Preconditioning):
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
    def remove_hooks(self) -> None:
        """Detach from the model (the preconditioner stops collecting factors)."""
        self._detach_layers()
        self._root_hook.remove()

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


