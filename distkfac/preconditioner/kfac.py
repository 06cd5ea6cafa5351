"""The :class:`KFAC` class: its options, public methods and the order of a step's phases."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

import distconv.comm
from distconv.nn.conv import DistConv2d
from distconv.nn.conv_nd import DistConvNd
from distconv.nn.linear import DistLinear
from distkfac.comm import FactorReducer, PayloadBroadcaster
from distkfac.lowprec import check_comm_dtype
from distkfac.methods import Method, method_for
from distkfac.placement import CostModel, LoadBalanced, Placement, placement_for
from distkfac.preconditioner import checkpoint
from distkfac.preconditioner.decompositions import Decompositions
from distkfac.preconditioner.hooks import FactorHooks
from distkfac.preconditioner.layer import Layer, Stale
from distkfac.preconditioner.precondition import Preconditioning
from distkfac.sharded import LAYOUTS, ExactLayer

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
    layers of a model (and ``DistLinear``: a Linear whose features are split gets the whole
    layer's factors, see :mod:`distkfac.sharded.linear`).

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
        self._model_batch: int | None = None  # the leading dim of the model's input
        self._register()
        self._exact_stale = {ly.name: (Stale(), Stale()) for ly in self.exact_layers}
        self._root_hook = model.register_forward_pre_hook(self._count_micro_batch,
                                                          with_kwargs=True)
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
                if isinstance(m, (DistConv2d, DistConvNd, DistLinear))]
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
        self._model_batch = None
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
        return checkpoint.shard_specs(self)

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
        :mod:`~distkfac.preconditioner.checkpoint`), and the LBP cost model under
        ``"placement"``."""
        return checkpoint.state_dict(self)

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
        checkpoint.check_layers(self, state)
        settings = dict(state.get("settings", {}))
        for key in ("factor_update_steps", "inv_update_steps", "damping", "factor_decay",
                    "kl_clip", "lr"):
            if key in settings and not callable(getattr(self, key)):
                setattr(self, key, settings[key])
        if "compute_method" in settings or "symmetric_comm" in settings:
            self.compute_method = settings.get("compute_method", self.compute_method)
            self.symmetric_comm = settings.get("symmetric_comm", self.symmetric_comm)
            self.method = method_for(self.compute_method, symmetric=self._pack_payloads)
        checkpoint.load_layers(self, state)
        self.steps = int(state["steps"])
        self._begin_step()

    def __repr__(self) -> str:
        s = self.settings()
        s["placement"] = self.placement
        s["comm"] = None if self.comm is None else f"{self.comm.backend}:{self.comm.size}"
        s["layers"] = len(self.layers) + len(self.exact_layers)
        s["skipped"] = sorted(self.skipped)
        body = ",\n".join(f"  {k}={v!r}" for k, v in s.items())
        return f"KFAC(\n{body},\n)"
