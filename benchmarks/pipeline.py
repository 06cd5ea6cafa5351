"""Pipelined stationary-x and -y (``DistConv2d(pipeline=k)``) against the unpipelined layer.

For every backend (gloo, MPI), layer and batch, on 2 ranks with one thread each, it interleaves
the unpipelined layer and the layer with ``pipeline`` 2 and 4 (forward + backward, slowest rank
per repeat, medians of the paired ratios) and a run of the same local convolutions with no
communication at all. The difference between the unpipelined layer and that run is the time the
collectives cost; no overlap can gain more, so ``bound = unpipelined / (local only)`` is the
largest speedup pipelining could show on this machine. Next to them: the §4 model's predicted
speedup with alpha, beta, the FLOP rate and how much communication overlaps compute
(``comm_overlap``) calibrated in the same world, and on ``lassen()``.

Writes ``benchmarks/results/pipeline.{json,md}`` and prints the table.

    .venv/bin/python benchmarks/pipeline.py                 # ~4 min
    .venv/bin/python benchmarks/pipeline.py --quick         # a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._paired import (  # noqa: E402
    command_line, layer_step, moved_per_step, slowest, write_results,
)
from distconv.grid import ProcessorGrid  # noqa: E402
from distconv.machines import calibrate, lassen  # noqa: E402
from distconv.nn import DistConv2d  # noqa: E402
from distconv.perfmodel import ConvProblem, conv_cost  # noqa: E402

#: name -> (in channels, out channels, height/width, kernel): the wide layer of
#: ``conv_layers.py`` and a 1x1 layer whose reduce-scatter weighs more against its compute.
LAYERS = {"wide 3x3": (512, 512, 14, 3), "wide 1x1": (1024, 1024, 14, 1)}
CONFIGS = [("stationary-x C=2", {"C": 2}, "stationary-x"),
           ("stationary-y F=2", {"F": 2}, "stationary-y")]
PIPELINES = (2, 4)


def _local_only(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, padding: int) -> float:
    """The local convolution's forward and backward on this rank's working shapes, no
    collective: what the layer costs once its communication is hidden completely."""
    t0 = time.perf_counter()
    F.conv2d(x, w, None, 1, padding).backward(g)
    elapsed = time.perf_counter() - t0
    x.grad = w.grad = None
    return elapsed


def bench(comm: Any, jobs: list[tuple[str, int, str, dict, str]], repeats: int) -> list[dict]:
    torch.set_num_threads(1)
    machine = calibrate(comm, overheads=False)
    out = []
    for name, batch, label, grid_dims, algorithm in jobs:
        cin, cout, hw, k = LAYERS[name]
        grid = ProcessorGrid(grid_dims, comm=comm)
        shape = (batch, cin, hw, hw)
        layers = {p: DistConv2d(cin, cout, k, padding=k // 2, bias=False, grid=grid,
                                algorithm=algorithm, init_seed=0, pipeline=p)
                  for p in (1, *PIPELINES)}
        plain = layers[1]
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(plain.local_input_shape(shape), generator=gen).requires_grad_(True)
        g = torch.randn(plain.output_dist.local_shape(plain.output_shape(shape), grid),
                        generator=gen)
        # the local convolution's own shapes: x after the allgather over F, y before the
        # reduce-scatter over C
        xw = torch.randn(plain.work_dist.local_shape(shape, grid), generator=gen
                         ).requires_grad_(True)
        w = plain.weight.detach().clone().requires_grad_(True)
        gw = torch.randn(plain.partial_dist.local_shape(plain.output_shape(shape), grid),
                         generator=gen)
        bytes_moved = {p: moved_per_step(comm, layer, x, g, shape) for p, layer in layers.items()}
        _local_only(xw, w, gw, k // 2)
        times: dict[Any, list[float]] = {key: [] for key in (*layers, "local")}
        for _ in range(repeats):
            for key in times:
                comm.barrier()
                t = (_local_only(xw, w, gw, k // 2) if key == "local"
                     else layer_step(layers[key], x, g, shape))
                times[key].append(t)
        slow = slowest(comm, times)
        pb = ConvProblem(batch, cin, cout, hw, hw, k, 1, k // 2, bias=False)

        def model(m: Any, p: int) -> float:
            return (conv_cost(pb, grid_dims, algorithm, m).total
                    / conv_cost(pb, grid_dims, algorithm, m, pipeline=p).total)

        row = {
            "layer": name, "batch": batch, "config": label, "ranks": comm.size,
            "unpipelined_s": statistics.median(slow[1]),
            "local_only_s": statistics.median(slow["local"]),
            "bound": statistics.median(a / b for a, b in zip(slow[1], slow["local"])),
            "bytes_equal": all(b == bytes_moved[1] for b in bytes_moved.values()),
        }
        for p in PIPELINES:
            row[f"speedup_{p}"] = statistics.median(a / b for a, b in zip(slow[1], slow[p]))
            row[f"model_{p}"] = model(machine, p)
            row[f"lassen_{p}"] = model(lassen(), p)
        out.append(row)
    return out


def _markdown(results: dict) -> str:
    head = ("| backend | layer | batch | config | unpipelined ms | bound | "
            + " | ".join(f"k={p}: measured / model / lassen" for p in PIPELINES)
            + " | bytes equal |")
    lines = [f"`{results['command']}` ({results['host']}, 2 ranks, 1 thread each, medians of "
             f"{results['repeats']} interleaved repeats; ratios are unpipelined / pipelined)",
             "", head, "|" + "---|" * (6 + len(PIPELINES) + 1)]
    for backend, rows in results["rows"].items():
        for r in rows:
            cells = " | ".join(f"{r[f'speedup_{p}']:.3f} / {r[f'model_{p}']:.3f} / "
                               f"{r[f'lassen_{p}']:.3f}" for p in PIPELINES)
            lines.append(f"| {backend} | {r['layer']} | {r['batch']} | {r['config']} | "
                         f"{1e3 * r['unpipelined_s']:.1f} | {r['bound']:.3f} | {cells} | "
                         f"{r['bytes_equal']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from distconv.testing import WorkerPool

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=["gloo", "mpi"], choices=["gloo", "mpi"])
    p.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    p.add_argument("--batches", nargs="+", type=int, default=[4, 8])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="one layer, batch 4, 2 repeats")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.batches, args.repeats = args.layers[:1], [4], 2
    jobs = [(layer, b, label, g, alg) for layer in args.layers for b in args.batches
            for label, g, alg in CONFIGS]
    results: dict[str, Any] = {"host": f"{os.cpu_count()} cores", "repeats": args.repeats,
                               "command": command_line("pipeline.py", argv), "rows": {}}
    for backend in args.backends:
        with WorkerPool(backend=backend, size=2, task_timeout=1800) as pool:
            results["rows"][backend] = pool.run(bench, jobs, args.repeats)[0]
        print(f"{backend} done", file=sys.stderr, flush=True)
    write_results(args.out, "pipeline", results, _markdown(results))
    return results


if __name__ == "__main__":
    main()
