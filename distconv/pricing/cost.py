"""The §4 time of a distributed convolution: every collective costs ``alpha`` per message step
plus ``beta`` per byte received (ring allgather / reduce-scatter: ``(p-1) alpha + bytes beta``;
ring allreduce: ``2 (p-1) alpha + bytes beta``; halo exchange: ``alpha`` per neighbour plus
bytes), on the bytes of :func:`~distconv.pricing.traffic.conv_traffic`, and local convolutions
cost their FLOPs over a measured rate (or a measured time function). The layer time is that of
its slowest rank; :func:`choose_algorithm` picks the cheapest candidate. The flat
:class:`~distconv.pricing.machine.Machine` prices every collective alike; a hierarchical
:class:`distconv.machines.Machine` prices each on the level its segment crosses (the grid dims
a step runs over are in ``Traffic.dims``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from distconv.conv_geometry import pair
from distconv.grid import all_coords, corner_coords, grid_layout
from distconv.pricing.machine import Machine
from distconv.pricing.problem import ConvProblem
from distconv.pricing.traffic import Roles, Traffic, conv_traffic

__all__ = ["Cost", "choose_algorithm", "conv_cost"]


@dataclass(frozen=True)
class Cost:
    """Predicted seconds of one layer (slowest rank) and the per-step breakdown of that rank."""

    forward: float
    backward: float
    steps: dict[str, float]
    traffic: Traffic

    @property
    def total(self) -> float:
        return self.forward + self.backward


def _local_problem(problem: ConvProblem, grid: Mapping[str, int], algorithm: str,
                   roles: Roles) -> ConvProblem:
    """The largest local convolution any rank runs (balanced blocks: rank 0's)."""
    ext = lambda d: grid.get(d, 1)  # noqa: E731
    pc, pf = ext(roles.channel), ext(roles.filter)
    c_work = {"stationary-x": -(-problem.in_channels // pc), "stationary-y": problem.in_channels,
              "stationary-w": -(-problem.in_channels // pc)}[algorithm]
    f_work = {"stationary-x": problem.out_channels, "stationary-y": -(-problem.out_channels // pf),
              "stationary-w": -(-problem.out_channels // pf)}[algorithm]
    ho, wo = problem.output_hw
    kh, kw = pair(problem.kernel_size, "kernel_size")
    sh, sw = pair(problem.stride, "stride")
    dh, dw = pair(problem.dilation, "dilation")
    lho, lwo = -(-ho // ext(roles.h)), -(-wo // ext(roles.w))
    return ConvProblem(
        -(-problem.batch // ext(roles.sample)), c_work, f_work,
        (lho - 1) * sh + dh * (kh - 1) + 1, (lwo - 1) * sw + dw * (kw - 1) + 1,
        (kh, kw), (sh, sw), 0, (dh, dw), problem.groups, problem.bias,
    )


def conv_cost(
    problem: ConvProblem,
    grid: Mapping[str, int],
    algorithm: str,
    machine: Machine = Machine(),
    *,
    itemsize: int = 4,
    channel_dim: str = "C",
    filter_dim: str = "F",
    sample_dim: str = "N",
    spatial_dims: tuple[str, str] = ("H", "W"),
    ranks: str = "all",
    pipeline: int = 1,
) -> Cost:
    """Predicted forward and backward seconds of the layer (§4): local convs plus collectives.

    ``pipeline=k`` (:mod:`distconv.nn.pipeline`): the layer runs on k chunks of each rank's
    samples (at most as many as it has). The network carries the chunks' allgathers and
    reduce-scatters (each ``1/k`` of the bytes, each paying its latency), the processor their
    local convolutions, so a stage lasts ``max(conv/k, comm/k)``::

        forward   g + c + r + (k-1) both(c, g + r)               g, c, r: one chunk's allgather
        backward  g' + c + (k-1) both(c, g' + r') + both(w, r')  over F, conv, reduce-scatter
                                                                 over C; w: the weight gradient

    where ``both(a, b) = a + b - o min(a, b)`` with ``o`` the machine's ``comm_overlap``: ``max(a,
    b)`` where communication runs beside the compute (``o = 1``, a flat :class:`Machine`'s), the
    sum where it does not (``o = 0``: then pipelining only adds each chunk's latency).
    Halo exchanges run per chunk on the critical path; gradient allreduces are unchanged.

    ``machine`` is a flat :class:`Machine` or a hierarchical :class:`distconv.machines.Machine`
    (anything with ``local_conv`` and ``collective_time``). The layer time is its slowest rank's:
    among ``ranks="all"`` (default) or the grid's ``"corners"`` (:func:`corner_coords`; the same
    maximum with balanced blocks, and cheap for thousands of ranks).
    """
    if ranks not in ("all", "corners"):
        raise ValueError(f"ranks must be 'all' or 'corners', got {ranks!r}")
    roles = Roles(sample_dim, channel_dim, filter_dim, *spatial_dims)
    kw = dict(itemsize=itemsize, channel_dim=channel_dim, filter_dim=filter_dim,
              sample_dim=sample_dim, spatial_dims=spatial_dims)
    if isinstance(pipeline, bool) or not isinstance(pipeline, int) or pipeline < 1:
        raise ValueError(f"pipeline must be a positive int, got {pipeline!r}")
    local = machine.local_conv(_local_problem(problem, dict(grid), algorithm, roles))
    best: Cost | None = None
    layout = grid_layout(grid)
    ext = dict(layout)
    chunks = min(pipeline, -(-problem.batch // ext.get(sample_dim, 1)))
    # every step of a rank moves its local samples' bytes, or its share of a gradient allreduce
    # over (N, H, W), and both are largest at sample coordinate 0 (balanced blocks put the larger
    # first; the allreduce block of segment rank 0 is the largest): the slowest rank has the
    # first sample block, and only the other coordinates need to be tried
    for coords in [c for c in (all_coords if ranks == "all" else corner_coords)(grid)
                   if c.get(sample_dim, 0) == 0]:
        t = conv_traffic(problem, grid, algorithm, coords, **kw)  # type: ignore[arg-type]
        steps = {"local conv forward": local, "local conv backward (data + filter)": 2 * local}
        for phase in (t.forward, t.backward):
            for name, nbytes in phase.items():
                steps[name] = chunks * machine.collective_time(
                    t.ops[name], t.peers[name], nbytes / chunks, layout=layout, dims=t.dims[name]
                ) if not name.startswith("allreduce") else machine.collective_time(
                    t.ops[name], t.peers[name], nbytes, layout=layout, dims=t.dims[name])
        fwd = local + sum(steps[k] for k in t.forward)
        bwd = 2 * local + sum(steps[k] for k in t.backward)
        if chunks > 1:
            fwd, bwd = _pipelined(steps, t, local, chunks, getattr(machine, "comm_overlap", 1.0))
        cost = Cost(fwd, bwd, steps, t)
        if best is None or cost.total > best.total:
            best = cost
    assert best is not None
    return best


def _pipelined(steps: dict[str, float], t: Traffic, local: float, k: int, overlap: float
               ) -> tuple[float, float]:
    """Forward and backward seconds of a layer pipelined over ``k`` chunks (see
    :func:`conv_cost`); ``steps`` hold each collective's time over all k chunks; ``overlap``:
    the machine's ``comm_overlap``."""
    def both(a: float, b: float) -> float:  # a and b at once, b partly beside a
        return a + b - overlap * min(a, b)

    def part(phase: dict[str, int], op: str) -> float:
        return sum(steps[n] for n in phase if t.ops[n] == op and not n.startswith("allreduce"))

    def serial(phase: dict[str, int]) -> float:  # halos and gradient allreduces
        return sum(steps[n] for n in phase if t.ops[n] not in ("allgather", "reduce_scatter")
                   or n.startswith("allreduce"))

    c = local / k
    g, r = part(t.forward, "allgather") / k, part(t.forward, "reduce_scatter") / k
    fwd = serial(t.forward) + g + c + r + (k - 1) * both(c, g + r)
    g, r = part(t.backward, "allgather") / k, part(t.backward, "reduce_scatter") / k
    bwd = serial(t.backward) + g + c + (k - 1) * both(c, g + r) + both(local, r)
    return fwd, bwd


def choose_algorithm(
    problem: ConvProblem,
    candidates: Sequence[tuple[Mapping[str, int], str]],
    machine: Machine = Machine(),
    **options: Any,
) -> tuple[Mapping[str, int], str, Cost]:
    """The cheapest ``(grid, algorithm)`` among ``candidates`` by :func:`conv_cost`."""
    if not candidates:
        raise ValueError("choose_algorithm: candidates must not be empty")
    scored = [(conv_cost(problem, g, a, machine, **options), g, a) for g, a in candidates]
    cost, g, a = min(scored, key=lambda item: item[0].total)
    return g, a, cost
