"""A profile of the machine this runs on, fitted by a short calibration run (collective)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from distconv.machines.base import ConvTable, Level, Machine
from distconv.perfmodel import ConvProblem, calibrate as _fit, measure_flop_rate

__all__ = ["calibrate"]


def calibrate(comm: Any, *, problems: Sequence[ConvProblem] = (), memory: float = math.inf,
              sizes: Sequence[int] = (1, 1 << 18), repeats: int = 5) -> Machine:
    """Fit alpha and beta on ``comm`` (every rank gets rank 0's fit) and the local FLOP rate,
    and time the local forward convolutions in ``problems`` into a :class:`ConvTable`.

    All ranks of this machine share one level (one host, loopback or shared memory).
    Collective: every rank of ``comm`` must call it with the same arguments.
    """
    flat = _fit(comm, sizes=sizes, repeats=repeats)
    times = {ConvTable.key(pb): pb.flops() / measure_flop_rate(pb, repeats=repeats)
             for pb in problems}
    if comm.size > 1 and times:
        import torch

        keys = list(times)
        t = comm.broadcast(torch.tensor([times[k] for k in keys], dtype=torch.float64), root=0)
        times = {k: float(v) for k, v in zip(keys, t)}
    table = ConvTable(times, flat.flop_rate) if times else None
    source = f"calibrated on {comm.size} ranks ({getattr(comm, 'backend', '?')})"
    level = Level("host", 0, flat.alpha, 1.0 / flat.beta, source=source)
    return Machine("this machine", (level,), flat.flop_rate, memory, table,
                   {"alpha": source, "beta": source, "flop_rate": "measure_flop_rate()"})
