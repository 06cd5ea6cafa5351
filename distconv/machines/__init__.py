"""Machines as data: hierarchies of alpha-beta links, local compute, memory per rank.

``LASSEN`` is the paper's machine (published figures, each with its source);
``calibrate(comm)`` profiles the machine this runs on. :func:`resolve_machine` turns every form
a ``machine=`` argument takes (a machine, a factory such as :func:`lassen`, a name such as
``"lassen"``) into a machine, and refuses anything else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distconv import perfmodel
from distconv.machines.base import ConvTable, Level, Machine, Roofline, group_of, latency_steps
from distconv.machines.calibrate import calibrate
from distconv.machines.lassen import LASSEN, LASSEN_SOURCES, lassen

__all__ = ["ConvTable", "LASSEN", "LASSEN_SOURCES", "Level", "MACHINES", "Machine", "Roofline",
           "calibrate", "group_of", "lassen", "latency_steps", "resolve_machine"]

#: The machines known by name: ``machine="lassen"`` is ``lassen()``.
MACHINES: dict[str, Callable[[], Machine]] = {"lassen": lassen}

_FORMS = ("a distconv.machines.Machine (e.g. distconv.machines.lassen()), a flat "
          "distconv.perfmodel.Machine, a factory called with no arguments (e.g. "
          "distconv.machines.lassen) or a known name")


def resolve_machine(machine: Any, *, argument: str = "machine",
                    hierarchical: bool = False) -> Machine | perfmodel.Machine:
    """The machine that ``machine`` stands for.

    Args:
        machine: a hierarchical :class:`Machine` or a flat :class:`distconv.perfmodel.Machine`
            (returned as given), a factory called with no arguments (``lassen``), or a name of
            :data:`MACHINES` (``"lassen"``, any case).
        argument: the caller's argument name, for the messages. Default ``"machine"``.
        hierarchical: return a hierarchical :class:`Machine`, converting a flat one into the
            one-level machine that prices alike (:meth:`Machine.flat`: the same ``alpha``,
            bandwidth ``1 / beta``, ``flop_rate`` and ``conv_time``). Default False.

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
    elif callable(machine) and not isinstance(machine, (Machine, perfmodel.Machine)):
        made = _call_factory(machine, argument)
        if not isinstance(made, (Machine, perfmodel.Machine)):
            raise TypeError(f"{argument}={machine!r} is a callable that returned {made!r}, not "
                            f"a machine; pass {_FORMS}")
        machine = made
    if not isinstance(machine, (Machine, perfmodel.Machine)):
        raise TypeError(f"{argument} must be {_FORMS} ({sorted(MACHINES)}), got {machine!r} "
                        f"of type {type(machine).__name__}")
    if hierarchical and isinstance(machine, perfmodel.Machine):
        return Machine.flat(machine.alpha, machine.beta, machine.flop_rate,
                            conv_time=machine.conv_time)
    return machine


def _call_factory(factory: Callable[[], Any], argument: str) -> Any:
    try:
        return factory()
    except TypeError as exc:
        raise TypeError(f"{argument}={factory!r} is called as a machine factory with no "
                        f"arguments, which failed ({exc}); pass {_FORMS}") from None
