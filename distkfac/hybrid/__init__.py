"""Hybrid-order optimizers: FOSI (one process), DHO2 (its distributed Lanczos and update) and
MR-DHO2 (accelerators estimate the spectrum while workers train).

Modules: :mod:`~distkfac.hybrid.space` (balanced blocks of the flattened parameters),
:mod:`~distkfac.hybrid.lanczos` (sliced Lanczos, ESE), :mod:`~distkfac.hybrid.fosi`,
:mod:`~distkfac.hybrid.dho2`, :mod:`~distkfac.hybrid.mr_dho2`.
"""
from __future__ import annotations

from distkfac.hybrid.dho2 import DHO2
from distkfac.hybrid.fosi import FOSI
from distkfac.hybrid.lanczos import ESEResult, ese, extreme_pairs, lanczos, make_hvp
from distkfac.hybrid.mr_dho2 import MRDHO2, split_roles
from distkfac.hybrid.space import SlicedSpace

__all__ = ["FOSI", "DHO2", "MRDHO2", "split_roles", "SlicedSpace", "lanczos", "extreme_pairs",
           "ese", "ESEResult", "make_hvp"]
