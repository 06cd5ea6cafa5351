"""The machine a price is made on: the flat alpha-beta :class:`Machine` of the §4 model, and
:func:`resolve_machine`, which turns every form a ``machine=`` argument takes (a flat machine, a
hierarchical :class:`distconv.machines.Machine`, a factory such as
:func:`distconv.machines.lassen`, a name such as ``"lassen"``) into a machine, and refuses
anything else. The hierarchical machines themselves are data, in :mod:`distconv.machines`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from distconv.machines.base import Machine as HierarchicalMachine
from distconv.machines.lassen import lassen
from distconv.pricing.problem import ConvProblem

__all__ = ["MACHINES", "AnyMachine", "Machine", "resolve_machine"]


@dataclass(frozen=True)
class Machine:
    """Alpha-beta communication parameters and a local convolution rate.

    Args:
        alpha: seconds per message step. Default 20 µs (loopback TCP).
        beta: seconds per byte received. Default 1 ns (1 GB/s).
        flop_rate: local convolution FLOP/s (forward; backward-data and -filter each take as
            long). Default 20 GFLOP/s.
        conv_time: optional measured time function ``(local ConvProblem) -> seconds`` of one
            local forward convolution; replaces ``flop_rate``.
    """

    alpha: float = 20e-6
    beta: float = 1e-9
    flop_rate: float = 20e9
    conv_time: Callable[[ConvProblem], float] | None = None

    def local_conv(self, problem: ConvProblem) -> float:
        if self.conv_time is not None:
            return self.conv_time(problem)
        return problem.flops() / self.flop_rate

    def collective_time(self, op: str, peers: int, nbytes: float, *,
                        layout: Any = None, dims: Sequence[str] = ()) -> float:
        """``steps * alpha + nbytes * beta`` (ring steps; one level, so ``layout`` and ``dims``
        do not matter). :class:`distconv.machines.Machine` prices by the level crossed."""
        latency = 2 * (peers - 1) if op == "allreduce" else (2 if op == "alltoall" else peers - 1)
        return latency * self.alpha + nbytes * self.beta


#: A flat :class:`Machine` or a hierarchical :class:`distconv.machines.Machine`.
AnyMachine = Machine | HierarchicalMachine

#: The machines known by name: ``machine="lassen"`` is ``lassen()``.
MACHINES: dict[str, Callable[[], HierarchicalMachine]] = {"lassen": lassen}

_FORMS = ("a distconv.machines.Machine (e.g. distconv.machines.lassen()), a flat "
          "distconv.perfmodel.Machine, a factory called with no arguments (e.g. "
          "distconv.machines.lassen) or a known name")


def resolve_machine(machine: Any, *, argument: str = "machine",
                    hierarchical: bool = False) -> HierarchicalMachine | Machine:
    """The machine that ``machine`` stands for.

    Args:
        machine: a hierarchical :class:`distconv.machines.Machine` or a flat :class:`Machine`
            (returned as given), a factory called with no arguments (``lassen``), or a name of
            :data:`MACHINES` (``"lassen"``, any case).
        argument: the caller's argument name, for the messages. Default ``"machine"``.
        hierarchical: return a hierarchical machine, converting a flat one into the
            one-level machine that prices alike (:meth:`distconv.machines.Machine.flat`: the
            same ``alpha``, bandwidth ``1 / beta``, ``flop_rate`` and ``conv_time``).
            Default False.

    Raises:
        TypeError: anything else (naming the value and the allowed forms), or a factory that
            needs arguments or returns something else.
        ValueError: an unknown name (listing the known ones).
    """
    if isinstance(machine, str):
        factory = MACHINES.get(machine.lower())
        if factory is None:
            raise ValueError(f"{argument}={machine!r} is not a known machine name; known: "
                             f"{sorted(MACHINES)} (or pass a Machine object)")
        machine = factory()
    elif callable(machine) and not isinstance(machine, (HierarchicalMachine, Machine)):
        made = _call_factory(machine, argument)
        if not isinstance(made, (HierarchicalMachine, Machine)):
            raise TypeError(f"{argument}={machine!r} is a callable that returned {made!r}, not "
                            f"a machine; pass {_FORMS}")
        machine = made
    if not isinstance(machine, (HierarchicalMachine, Machine)):
        raise TypeError(f"{argument} must be {_FORMS} ({sorted(MACHINES)}), got {machine!r} "
                        f"of type {type(machine).__name__}")
    if hierarchical and isinstance(machine, Machine):
        return HierarchicalMachine.flat(machine.alpha, machine.beta, machine.flop_rate,
                                        conv_time=machine.conv_time)
    return machine


def _call_factory(factory: Callable[[], Any], argument: str) -> Any:
    try:
        return factory()
    except TypeError as exc:
        raise TypeError(f"{argument}={factory!r} is called as a machine factory with no "
                        f"arguments, which failed ({exc}); pass {_FORMS}") from None
