"""What the interleaved benchmarks share (``halo_overlap.py``, ``pipeline.py``, ``volumes.py``,
``latency.py``): one timed training step of a distributed layer, the bytes a step moves, the
slowest rank's times, the command line a result names, and the results written out."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["command_line", "layer_step", "moved_per_step", "slowest", "write_results"]


def layer_step(layer: Any, x: torch.Tensor, g: torch.Tensor, shape: tuple) -> float:
    """Seconds of one forward of ``layer`` on this rank's block ``x`` of the global ``shape``
    and its backward from ``g``; the gradients are cleared afterwards."""
    t0 = time.perf_counter()
    layer(x, shape).backward(g)
    elapsed = time.perf_counter() - t0
    x.grad = None
    layer.zero_grad(set_to_none=True)
    return elapsed


def moved_per_step(comm: Any, layer: Any, x: torch.Tensor, g: torch.Tensor,
                   shape: tuple) -> int:
    """Bytes this rank receives in one step of ``layer`` (after a warm-up step)."""
    layer_step(layer, x, g, shape)
    comm.stats.reset()
    layer_step(layer, x, g, shape)
    return comm.stats.total_bytes()


def slowest(comm: Any, times: dict[Any, list[float]]) -> dict[Any, list[float]]:
    """Each side's times, repeat by repeat, of the slowest rank (one allreduce)."""
    keys = list(times)
    per = comm.allreduce(torch.tensor([times[k] for k in keys], dtype=torch.float64), op="max")
    return {k: per[i].tolist() for i, k in enumerate(keys)}


def command_line(script: str, argv: list[str] | None) -> str:
    """``python benchmarks/<script> <arguments>``: how the results were made (``argv`` None:
    this process's own arguments)."""
    return " ".join(["python", f"benchmarks/{script}", *(argv if argv is not None
                                                         else sys.argv[1:])])


def write_results(out: Path, stem: str, results: dict, table: str) -> None:
    """``<out>/<stem>.json`` (the results) and ``<out>/<stem>.md`` (the table), and the table
    printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    (out / f"{stem}.md").write_text(table + "\n")
    print(table)
