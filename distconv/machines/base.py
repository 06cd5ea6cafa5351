"""A machine as data: a hierarchy of links with alpha-beta costs, local compute, memory per rank.

Ranks are numbered consecutively inside sockets and nodes (rank ``r`` sits in socket ``r // 2``,
node ``r // 4`` on Lassen), and a :class:`~distconv.grid.ProcessorGrid` lays its dims out
row-major, so the **last** grid dim varies fastest: placing the channel/filter dims last puts
channel groups inside a socket or node, as the paper does (§5).

A collective among the ranks that differ only in some grid dims is priced on the outermost link
its ring crosses (the bottleneck of a ring), with that link's bandwidth shared by every ring that
crosses it at the same time (all segments run at once)::

    time = steps(op, p) * alpha[L] + bytes * flows / bandwidth[L]

The bytes are the ring's (what the communicators count); ``schedule="tree"`` only shortens the
latency term to the depth of a tree, as NCCL's double binary trees do at scale.

``L`` is the smallest level whose unit holds the whole group; ``flows`` the number of concurrent
rings leaving one unit of the level below through a shared link (``ranks below / members of the
group inside it``; 1 for a dedicated link). Steps: ring allgather / reduce-scatter ``p - 1``,
ring allreduce ``2 (p - 1)``, halo exchange (``alltoall`` between neighbours) 2.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only named in annotations: the machines are data below pricing
    from distconv.pricing.problem import ConvProblem

__all__ = ["Level", "Machine", "ConvTable", "Roofline", "group_of", "latency_steps"]

Layout = Sequence[tuple[str, int]]


def latency_steps(op: str, peers: int, schedule: str = "ring") -> int:
    """Message steps of one collective among ``peers`` ranks: ring algorithms (``p - 1`` per
    allgather / reduce-scatter, twice that per allreduce) or, with ``schedule="tree"``, the
    logarithmic depth of tree / recursive-doubling schedules (``ceil(log2 p)``, twice per
    allreduce). A halo exchange (``alltoall`` between neighbours) is 2 steps either way."""
    if peers <= 1:
        return 0
    if op == "alltoall":
        return 2
    depth = peers - 1 if schedule == "ring" else math.ceil(math.log2(peers))
    return 2 * depth if op == "allreduce" else depth


def group_of(layout: Layout, dims: Sequence[str]) -> list[int]:
    """The ranks of rank 0's segment over ``dims`` of a row-major grid (all segments alike)."""
    return list(_group(tuple((str(n), int(e)) for n, e in layout), tuple(dims)))


@functools.lru_cache(maxsize=4096)
def _group(layout: tuple[tuple[str, int], ...], dims: tuple[str, ...]) -> tuple[int, ...]:
    """:func:`group_of`, cached: pricing asks for the same few segments of grids of thousands of
    ranks again and again."""
    strides, s = {}, 1
    for name, e in reversed(layout):
        strides[name] = s
        s *= e
    ranks = [0]
    for name, e in layout:
        if name in dims and e > 1:
            ranks = [r + k * strides[name] for r in ranks for k in range(e)]
    return tuple(sorted(ranks))


@functools.lru_cache(maxsize=4096)
def _span(units: tuple[int, ...], ranks: tuple[int, ...]) -> tuple[int, int]:
    """:meth:`Machine.level_of` of the sorted distinct ``ranks`` on levels of ``units`` ranks
    per unit (0: unbounded), cached."""
    for i, size in enumerate(units):
        if size == 0 or len({r // size for r in ranks}) == 1:
            below = units[i - 1] if i else 1
            return i, sum(1 for r in ranks if r // below == ranks[0] // below)
    raise AssertionError("unreachable: the last level is unbounded")


@dataclass(frozen=True)
class Level:
    """One level of the hierarchy: the link that joins the units of the level below.

    Args:
        name: e.g. ``"socket"`` (links inside a socket), ``"node"``, ``"network"``.
        ranks: ranks in one unit of this level (2 per socket, 4 per node); ``0`` for the outermost
            level (the whole machine).
        alpha: seconds per message step over this link.
        bandwidth: bytes per second one direction of this link carries.
        shared: whether every rank of a unit of the level below sends through the same link
            (a node's network adapters, a socket's inter-socket bus) rather than a dedicated one.
        source: where ``alpha`` and ``bandwidth`` come from.
    """

    name: str
    ranks: int
    alpha: float
    bandwidth: float
    shared: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        if self.ranks < 0:
            raise ValueError(f"Level {self.name!r}: ranks must be >= 0, got {self.ranks}")
        if self.alpha < 0 or self.bandwidth <= 0:
            raise ValueError(
                f"Level {self.name!r}: need alpha >= 0 and bandwidth > 0, got alpha={self.alpha}, "
                f"bandwidth={self.bandwidth}"
            )


@dataclass(frozen=True)
class ConvTable:
    """Measured local forward-convolution seconds by layer shape, with a rate for the rest.

    ``times`` maps :func:`ConvTable.key` of a local :class:`ConvProblem` to seconds; shapes not in
    the table cost ``flops / flop_rate``; ``overhead`` is added to every call.
    """

    times: Mapping[tuple, float]
    flop_rate: float
    overhead: float = 0.0  # seconds of software around every local convolution call

    @staticmethod
    def key(pb: ConvProblem) -> tuple:
        return (pb.batch, pb.in_channels, pb.out_channels, pb.height, pb.width,
                pb.kernel_size, pb.stride, pb.groups)

    def __call__(self, pb: ConvProblem) -> float:
        t = self.times.get(self.key(pb))
        return (t if t is not None else pb.flops() / self.flop_rate) + self.overhead


@dataclass(frozen=True)
class Roofline:
    """Local convolution time on an accelerator from its published figures::

        time = max(flops / flop_rate, bytes / memory_bandwidth) / occupancy + overhead
        occupancy = min(1, output elements / parallelism)

    ``bytes`` are x, w and y once each (``itemsize`` bytes per element); ``parallelism`` is how
    many outputs the device computes at once (resident threads), so a convolution with few
    outputs -- few samples of a small late layer -- leaves the device partly idle; ``overhead``
    is the launch cost of one kernel.
    """

    flop_rate: float
    memory_bandwidth: float
    parallelism: int
    overhead: float = 0.0
    itemsize: int = 4

    def __call__(self, pb: ConvProblem) -> float:
        ho, wo = pb.output_hw
        kh, kw = (pb.kernel_size, pb.kernel_size) if isinstance(pb.kernel_size, int) else (
            pb.kernel_size)
        outputs = pb.batch * pb.out_channels * ho * wo
        elems = (pb.batch * pb.in_channels * pb.height * pb.width + outputs
                 + pb.out_channels * pb.in_channels // pb.groups * kh * kw)
        busy = max(pb.flops() / self.flop_rate, elems * self.itemsize / self.memory_bandwidth)
        return busy / min(1.0, outputs / self.parallelism) + self.overhead


@dataclass(frozen=True)
class Machine:
    """A hierarchical machine (innermost level first) with local compute and memory per rank.

    Args:
        name: printed name.
        levels: the hierarchy, innermost first; the last level has ``ranks=0`` (unbounded).
        flop_rate: sustained local convolution FLOP/s (forward; backward-data and -filter each
            take as long).
        memory: bytes of accelerator memory per rank.
        conv_time: optional measured ``(local ConvProblem) -> seconds`` (e.g. a :class:`ConvTable`)
            replacing ``flop_rate``.
        sources: where each number comes from (``field -> citation``).
        schedule: ``"ring"`` (default) or ``"tree"``: the latency term of collectives
            (:func:`latency_steps`).
        call_overhead: seconds of software around every collective call (the library's
            planning and bookkeeping, beyond the wire's ``alpha``). Default 0.
        comm_overlap: the share, in ``[0, 1]``, of a collective's time that runs while its rank
            computes: 1 (default) where communication progresses beside the compute (a GPU's
            copy engines and communication streams, a NIC's offload); 0 where it progresses only
            while the rank waits for it, taking the processor it would compute on (CPU ranks of
            one thread whose messages move inside their communication calls, as MPI's do
            without a progress thread). The pipelined layers' and overlapped halos' hidden time
            and the gradient allreduces' overlap with backward scale by it.
    """

    name: str
    levels: tuple[Level, ...]
    flop_rate: float
    memory: float = math.inf
    conv_time: Callable[[ConvProblem], float] | None = None
    sources: Mapping[str, str] = field(default_factory=dict)
    schedule: str = "ring"
    call_overhead: float = 0.0
    comm_overlap: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.comm_overlap, bool) or not isinstance(self.comm_overlap, (int, float)):
            raise TypeError(f"Machine: comm_overlap must be a number in [0, 1], got "
                            f"{self.comm_overlap!r}")
        if not 0.0 <= self.comm_overlap <= 1.0:
            raise ValueError(f"Machine: comm_overlap must be in [0, 1], got {self.comm_overlap!r}")
        if self.schedule not in ("ring", "tree"):
            raise ValueError(f"Machine: schedule must be 'ring' or 'tree', got {self.schedule!r}")
        if not self.levels:
            raise ValueError("Machine: levels must not be empty")
        sizes = [lv.ranks for lv in self.levels[:-1]]
        if self.levels[-1].ranks != 0 or any(s < 1 for s in sizes) or any(
                b % a for a, b in zip(sizes, sizes[1:])):
            raise ValueError(
                "Machine: inner levels need ranks >= 1, each dividing the next, and the last "
                f"level ranks=0 (unbounded); got {[lv.ranks for lv in self.levels]}"
            )
        if self.flop_rate <= 0 or self.memory <= 0:
            raise ValueError(
                f"Machine: flop_rate and memory must be > 0, got {self.flop_rate}, {self.memory}"
            )

    # ------------------------------------------------------------------ compute
    def local_conv(self, problem: ConvProblem) -> float:
        if self.conv_time is not None:
            return self.conv_time(problem)
        return problem.flops() / self.flop_rate

    # ------------------------------------------------------------------ communication
    def level_of(self, ranks: Sequence[int]) -> tuple[int, int]:
        """``(L, k)``: the innermost level whose unit holds all ``ranks``, and how many of them
        share one unit of the level below (1 when L is the innermost level)."""
        return _span(tuple(lv.ranks for lv in self.levels), tuple(ranks))

    def link_time(self, ranks: Sequence[int], nbytes: float, steps: int) -> float:
        """Seconds to receive ``nbytes`` in ``steps`` message steps inside the group ``ranks``."""
        group = tuple(sorted(set(ranks)))
        return self._link(group, nbytes, steps) if len(group) > 1 else 0.0

    def _link(self, group: tuple[int, ...], nbytes: float, steps: int) -> float:
        """:meth:`link_time` in the sorted distinct ranks ``group`` (two or more)."""
        i, k = self.level_of(group)
        lv = self.levels[i]
        below = self.levels[i - 1].ranks if i else 1
        flows = max(below // max(k, 1), 1) if lv.shared else 1
        return self.call_overhead + steps * lv.alpha + nbytes * flows / lv.bandwidth

    def collective_time(self, op: str, peers: int, nbytes: float, *,
                        layout: Layout | None = None, dims: Sequence[str] = ()) -> float:
        """Seconds of one collective ``op`` over the grid ``dims`` of ``layout`` in which a rank
        receives ``nbytes``. Without a layout the group is taken as ``peers`` consecutive ranks."""
        group = (_group(tuple((str(n), int(e)) for n, e in layout), tuple(dims))
                 if layout is not None else tuple(range(peers)))
        if len(group) <= 1:
            return 0.0
        return self._link(group, nbytes, latency_steps(op, peers, self.schedule))

    def describe(self) -> str:
        """One line per level: ranks per unit, alpha, bandwidth, source."""
        rows = [f"{self.name}: {self.flop_rate / 1e12:.2f} TFLOP/s, "
                f"{self.memory / 2**30:.0f} GiB per rank, communication "
                f"{self.comm_overlap:.0%} overlapped with compute"]
        for lv in self.levels:
            unit = f"{lv.ranks} ranks" if lv.ranks else "all ranks"
            rows.append(f"  {lv.name:8s} ({unit}): alpha {lv.alpha * 1e6:.1f} us, "
                        f"{lv.bandwidth / 1e9:.1f} GB/s{' shared' if lv.shared else ''}"
                        f" -- {lv.source}")
        return "\n".join(rows)

    def __repr__(self) -> str:
        levels = ", ".join(f"{lv.name}(ranks={lv.ranks}, alpha={lv.alpha:.3g}, "
                           f"bandwidth={lv.bandwidth:.3g}, shared={lv.shared})"
                           for lv in self.levels)
        return (f"Machine(name={self.name!r}, levels=[{levels}], flop_rate={self.flop_rate:.3g}, "
                f"memory={self.memory:.3g}, conv_time={self.conv_time!r}, "
                f"schedule={self.schedule!r}, call_overhead={self.call_overhead:.3g}, "
                f"comm_overlap={self.comm_overlap:.3g})")

    @classmethod
    def flat(cls, alpha: float, beta: float, flop_rate: float, *, memory: float = math.inf,
             name: str = "flat", conv_time: Any = None, comm_overlap: float = 1.0) -> Machine:
        """One level: every collective costs ``alpha`` per step and ``beta`` per byte."""
        return cls(name, (Level("all", 0, alpha, 1.0 / beta, source="given"),), flop_rate,
                   memory, conv_time, {"alpha": "given", "beta": "given", "flop_rate": "given"},
                   comm_overlap=comm_overlap)
