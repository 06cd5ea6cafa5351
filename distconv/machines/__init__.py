"""Machines as data: hierarchies of alpha-beta links, local compute, memory per rank.

``LASSEN`` is the paper's machine (published figures, each with its source);
``calibrate(comm)`` profiles the machine this runs on.
"""

from distconv.machines.base import ConvTable, Level, Machine, Roofline, group_of, latency_steps
from distconv.machines.calibrate import calibrate
from distconv.machines.lassen import LASSEN, LASSEN_SOURCES, lassen

__all__ = ["ConvTable", "LASSEN", "LASSEN_SOURCES", "Level", "Machine", "Roofline", "calibrate",
           "group_of", "lassen", "latency_steps"]
