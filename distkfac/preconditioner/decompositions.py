"""Step 3 of :class:`~distkfac.preconditioner.KFAC`: on inverse-update steps each factor is
decomposed (:mod:`distkfac.methods`) on the rank the placement policy names (``'lbp'`` or
``'round-robin'``, :mod:`distkfac.placement`) and the payloads are broadcast, packed per owning
rank (:class:`~distkfac.comm.PayloadBroadcaster`); row-block ``'exact'`` layers exchange theirs
through :func:`distkfac.sharded.exchange_exact`.  With ``stale_threshold`` a factor that moved
less than that since its last decomposition keeps it, and is looked at again after twice as many
scheduled updates (Osawa et al.'s stale statistics), back to every update once it moves."""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import Tensor

from distkfac.placement import EVERYWHERE, CostModel, FactorTask, LoadBalanced
from distkfac.preconditioner.layer import Layer, Stale, control_device
from distkfac.sharded import ExactLayer, exchange_exact

__all__ = ["Decompositions"]


def _relative_change(value: Tensor, ref: Tensor) -> float:
    """``||value - ref||_F / ||ref||_F``."""
    return float(torch.linalg.norm(value - ref) / torch.linalg.norm(ref).clamp_min(1e-300))


class Decompositions:
    """The decompositions of :class:`~distkfac.preconditioner.KFAC` (a base of it: these methods
    read its layers, method, placement, settings and communicator)."""

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
