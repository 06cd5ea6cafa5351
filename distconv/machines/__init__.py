"""Machines as data: hierarchies of alpha-beta links, local compute, memory per rank.

``LASSEN`` is the paper's machine (published figures, each with its source);
``calibrate(comm)`` profiles the machine this runs on. :func:`resolve_machine` turns every form
a ``machine=`` argument takes (a machine, a factory such as :func:`lassen`, a name such as
``"lassen"``) into a machine, and refuses anything else (it lives with the pricing that uses it,
:mod:`distconv.pricing.machine`).
"""

from __future__ import annotations

from distconv.machines.base import ConvTable, Level, Machine, Roofline, group_of, latency_steps
from distconv.machines.calibrate import calibrate
from distconv.machines.lassen import LASSEN, LASSEN_SOURCES, lassen
from distconv.pricing.machine import MACHINES, resolve_machine

__all__ = ["ConvTable", "LASSEN", "LASSEN_SOURCES", "Level", "MACHINES", "Machine", "Roofline",
           "calibrate", "group_of", "lassen", "latency_steps", "resolve_machine"]
