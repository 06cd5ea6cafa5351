"""Planning a redistribution on one grid: a pure, cached function of ``(grid layout, source
Dist, target Dist, global shape)`` returning the :class:`Plan` of steps (greedy, shrinking before
growing; see :mod:`distconv.redistribute`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from distconv.distribution import Dist, as_shape
from distconv.grid import ProcessorGrid
from distconv.redistribute.steps import (
    AllGather, AllReduce, AllToAll, KeepRoot, Layout, Pad, ReduceScatter, Slice, Step, _Ctx,
    _extent,
)


@dataclass(frozen=True)
class Plan:
    """The steps that take a tensor from ``src`` to ``dst`` on one grid."""

    layout: Layout
    src: Dist
    dst: Dist
    global_shape: tuple[int, ...]
    steps: tuple[Step, ...]

    def describe(self) -> str:
        head = f"{self.src} -> {self.dst}"
        return head if not self.steps else head + ": " + "; ".join(map(str, self.steps))

    def received_bytes(self, grid: ProcessorGrid, itemsize: int) -> int:
        """Bytes this rank receives executing the plan (the communicators count the same)."""
        ctx = _Ctx(grid, self.global_shape, "")
        shape = self.src.local_shape(self.global_shape, grid)
        total = 0
        for step in self.steps:
            shape, got = step.received(shape, ctx)
            total += got
        return total * itemsize


def plan_redistribution(
    layout: Layout, src: Dist, dst: Dist, global_shape: Sequence[int]
) -> Plan:
    """Plan the redistribution of a tensor of ``global_shape`` from ``src`` to ``dst``.

    Pure and cached: every rank computes the same plan from shared information only.
    """
    if isinstance(layout, ProcessorGrid) or not isinstance(layout, (tuple, list)):
        raise TypeError(
            f"plan_redistribution: layout must be a grid layout ((name, extent), ...) such as "
            f"grid.layout, got {layout!r}"
        )
    for name, d in (("src", src), ("dst", dst)):
        if not isinstance(d, Dist):
            raise TypeError(f"plan_redistribution: {name} must be a distconv.Dist, got {d!r}")
    shape = as_shape(global_shape, "plan_redistribution: global_shape")
    return _plan(tuple(tuple(p) for p in layout), src, dst, shape)


@functools.lru_cache(maxsize=4096)
def _plan(layout: Layout, src: Dist, dst: Dist, global_shape: tuple[int, ...]) -> Plan:
    """The cheaper (total bytes over all ranks) of two greedy plans that differ in one choice:
    a pending sum the target distributes waits for its reduce-scatter, or -- when its tensor dim
    must first be gathered -- is allreduced at once, while the data is still small."""
    plans = [_greedy(layout, src, dst, global_shape, eager) for eager in (False, True)]
    if plans[0].steps == plans[1].steps:
        return plans[0]
    cost = [_total_bytes(p) for p in plans]
    return plans[1] if cost[1] < cost[0] else plans[0]


def _total_bytes(plan: Plan) -> int:
    from types import SimpleNamespace

    from distconv.grid import ProcessorGrid

    size = math.prod(e for _, e in plan.layout)
    return sum(
        plan.received_bytes(ProcessorGrid(dict(plan.layout), comm=SimpleNamespace(
            rank=r, size=size, backend="none")), itemsize=1)
        for r in range(size)
    )


def _greedy(
    layout: Layout, src: Dist, dst: Dist, global_shape: tuple[int, ...], eager: bool
) -> Plan:
    for d in (src, dst):
        if d.ndim != len(global_shape):
            raise ValueError(
                f"{d} has {d.ndim} entries but the global shape {global_shape} has "
                f"{len(global_shape)} dims"
            )
        for name in sorted(d.used() | d.pending):
            _extent(layout, name)
    live = {n for n, e in layout if e > 1}
    cur = [[g for g in src.grid_dims_of(i) if g in live] for i in range(src.ndim)]
    tgt = [tuple(g for g in dst.grid_dims_of(i) if g in live) for i in range(dst.ndim)]
    pending = {g for g in src.pending if g in live}
    want_pending = {g for g in dst.pending if g in live}
    steps: list[Step] = []

    def ready(i: int) -> bool:
        return tuple(cur[i]) == tgt[i][: len(cur[i])]

    def next_of(i: int) -> str | None:
        return tgt[i][len(cur[i])] if ready(i) and len(cur[i]) < len(tgt[i]) else None

    def used() -> set[str]:
        return {g for t in cur for g in t}

    for _ in range(4 * (len(live) + 1) * (len(cur) + 1)):
        if [tuple(t) for t in cur] == tgt and pending == want_pending:
            return Plan(layout, src, dst, global_shape, tuple(steps))
        steps.append(_next_step(cur, tgt, pending, want_pending, ready, next_of, used, eager))
    raise AssertionError(f"redistribution planner did not converge for {src} -> {dst}")


def _next_step(cur, tgt, pending, want_pending, ready, next_of, used, eager) -> Step:  # noqa: ANN001
    # 1. reduce-scatter a pending sum straight into the target's block
    for i in range(len(cur)):
        g = next_of(i)
        if g is not None and g in pending and g not in want_pending:
            pending.discard(g)
            step = ReduceScatter(i, g, tuple(cur[i]))
            cur[i].append(g)
            return step
    # 2. discard: slice a replicated dim into the target's block
    for i in range(len(cur)):
        g = next_of(i)
        if g is not None and g not in used() and g not in pending:
            step = Slice(i, g, tuple(cur[i]))
            cur[i].append(g)
            return step
    # 3. sum every pending dim the target neither keeps pending nor distributes, in one collective
    # (eager: also those the target distributes, whose reduce-scatter is not possible yet)
    target_used = set() if eager else {g for t in tgt for g in t}
    done = sorted(g for g in pending if g not in want_pending and g not in target_used)
    if done:
        pending.difference_update(done)
        return AllReduce(tuple(done))
    extras = [i for i in range(len(cur)) if not ready(i)]
    # 4. all-to-all: an extra minor grid dim that the target wants next on another tensor dim
    for i in extras:
        g = cur[i][-1]
        for j in range(len(cur)):
            if j != i and next_of(j) == g:
                step = AllToAll(i, j, g, tuple(cur[i][:-1]), tuple(cur[j]))
                cur[i].pop()
                cur[j].append(g)
                return step
    # 5. pad: an extra minor grid dim that the target holds as a pending sum
    for i in extras:
        g = cur[i][-1]
        if g in want_pending and g not in pending:
            cur[i].pop()
            pending.add(g)
            return Pad(i, g, tuple(cur[i]))
    # 6. allgather the minor extra grid dim
    if extras:
        i = extras[0]
        g = cur[i].pop()
        return AllGather(i, g, tuple(cur[i]))
    # 7. a pending sum the target introduces over a dim the tensor is replicated on
    for g in sorted(want_pending - pending):
        if g not in used():
            pending.add(g)
            return KeepRoot(g)
    raise AssertionError(f"redistribution planner is stuck at {cur} (pending {sorted(pending)})")
