"""Halo exchange overlapped with the interior rows (``overlap=True``) against the same spatially
split layer without it.

For every backend (gloo, MPI), on 2 ranks with one thread each, it interleaves the layer without
and with ``overlap`` (forward + backward, slowest rank per repeat, medians of the paired ratios)
and the local convolution with no communication (its rank's rows and halo): ``bound =
unoverlapped / (local only)`` is the largest speedup hiding the halo could show here. Bytes moved
are compared (they must be equal). Next to them, the §4 model's predicted speedup (the seconds
``explain`` says the overlap hides), calibrated in the same world and on ``lassen()``. Layers:
ResNet-50's early 3×3 convolutions split over H, and a CosmoFlow-style Conv3d split over D.

Writes ``benchmarks/results/halo_overlap.{json,md}`` and prints the table.

    .venv/bin/python benchmarks/halo_overlap.py              # ~2 min
    .venv/bin/python benchmarks/halo_overlap.py --quick      # a smoke run
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
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._paired import (  # noqa: E402
    command_line, layer_step, moved_per_step, slowest, write_results,
)
from distconv.grid import ProcessorGrid  # noqa: E402
from distconv.nn.conv_nd import DistConvNd  # noqa: E402

#: name -> (module builder, global input shape, grid)
LAYERS = {
    "conv2 3x3 56² over H": (lambda: nn.Conv2d(64, 64, 3, padding=1, bias=False),
                             (4, 64, 56, 56), {"H": 2}),
    "conv3 3x3 28² over H": (lambda: nn.Conv2d(128, 128, 3, padding=1, bias=False),
                             (4, 128, 28, 28), {"H": 2}),
    "conv3d 3³ 32³ over D": (lambda: nn.Conv3d(16, 16, 3, padding=1, bias=False),
                             (2, 16, 32, 32, 32), {"D": 2}),
}


def predicted(conv: nn.Conv2d, shape: tuple, dims: dict, machine: Any) -> float:
    """The §4 model's speedup of the overlapped layer: its step over the step less the seconds
    the overlap hides (distconv.ops.pricing.halo_hidden)."""
    from distconv.conv_geometry import HaloPlan, conv_dims, normalize_padding
    from distconv.nn.halo_conv import interior_share
    from distconv.ops.pricing import halo_hidden
    from distconv.perfmodel import ConvProblem, conv_cost

    k, s, d, p = conv.kernel_size, conv.stride, conv.dilation, conv.padding
    problem = ConvProblem(shape[0], conv.in_channels, conv.out_channels, shape[2], shape[3], k,
                          s, p, d, bias=conv.bias is not None)
    cost = conv_cost(problem, dims, "stationary-x", machine)
    i = 0 if "H" in dims else 1
    dim = conv_dims(shape[2:], k, s, d, normalize_padding(p, k, s, d))[i]
    parts = dims["H" if i == 0 else "W"]
    plan = HaloPlan(dim, parts, "zeros")
    share = min(interior_share(plan, r, k[i], s[i], d[i]) for r in range(parts))
    hidden = halo_hidden(cost.steps, share, machine)
    return cost.total / (cost.total - hidden["forward"] - hidden["backward"])


def bench(comm: Any, names: list[str], repeats: int) -> list[dict]:
    from distconv.machines import calibrate, lassen

    torch.set_num_threads(1)
    calibrated = calibrate(comm, overheads=False)
    out = []
    for name in names:
        build, shape, dims = LAYERS[name]
        torch.manual_seed(0)
        conv = build()
        grid = ProcessorGrid(dims, comm=comm)
        layers = {o: DistConvNd.from_module(conv, grid=grid, algorithm="stationary-x",
                                            overlap=o) for o in (False, True)}
        plain = layers[False]
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(plain.input_dist.local_shape(shape, grid), generator=gen
                        ).requires_grad_(True)
        y_shape = plain.output_shape(shape)
        g = torch.randn(plain.output_dist.local_shape(y_shape, grid), generator=gen)
        # the local convolution alone: this rank's rows and its halo, no exchange
        halo = (conv.kernel_size[0] - 1) // 2
        local_x = torch.randn((x.shape[0], x.shape[1], x.shape[2] + halo, *x.shape[3:]),
                              generator=gen).requires_grad_(True)
        pad = [0] * (2 * (x.dim() - 3)) + [0, 0]
        w = conv.weight.detach().clone().requires_grad_(True)
        conv_fn = F.conv2d if x.dim() == 4 else F.conv3d
        padding = (0,) + (1,) * (x.dim() - 3)

        def local_only() -> float:
            t0 = time.perf_counter()
            y = conv_fn(F.pad(local_x, pad), w, None, 1, padding)
            y.backward(torch.ones_like(y))
            local_x.grad = w.grad = None
            return time.perf_counter() - t0

        moved = {o: moved_per_step(comm, layer, x, g, shape) for o, layer in layers.items()}
        local_only()
        times: dict[Any, list[float]] = {False: [], True: [], "local": []}
        for rep in range(repeats):
            order = list(times) if rep % 2 else list(times)[::-1]
            for key in order:
                comm.barrier()
                times[key].append(local_only() if key == "local"
                                  else layer_step(layers[key], x, g, shape))
        slow = slowest(comm, times)
        row_model = {}
        if x.dim() == 4:  # the §4 model's prediction (2-D layers)
            for key, machine in (("model", calibrated), ("lassen", lassen())):
                row_model[key] = predicted(conv, shape, dims, machine)
        out.append({
            **row_model,
            "layer": name, "ranks": comm.size, "grid": dims, "shape": list(shape),
            "unoverlapped_ms": 1e3 * statistics.median(slow[False]),
            "overlapped_ms": 1e3 * statistics.median(slow[True]),
            "speedup": statistics.median(a / b for a, b in zip(slow[False], slow[True])),
            "bound": statistics.median(a / b for a, b in zip(slow[False], slow["local"])),
            "bytes_equal": moved[True] == moved[False],
        })
    return out


def _markdown(results: dict) -> str:
    lines = [f"`{results['command']}` ({results['host']}, 2 ranks, one thread each, "
             f"{results['repeats']} interleaved repeats, slowest rank, medians)", "",
             "| backend | layer | unoverlapped ms | overlapped ms | speedup | bound | "
             "model (calibrated) | model (lassen) | bytes equal |",
             "|---|---|---|---|---|---|---|---|---|"]
    for backend, rows in results["rows"].items():
        for r in rows:
            lines.append(f"| {backend} | {r['layer']} | {r['unoverlapped_ms']:.1f} | "
                         f"{r['overlapped_ms']:.1f} | {r['speedup']:.2f} | {r['bound']:.2f} | "
                         f"{r.get('model', float('nan')):.3f} | "
                         f"{r.get('lassen', float('nan')):.3f} | "
                         f"{'yes' if r['bytes_equal'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from distconv.testing import WorkerPool

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=["gloo", "mpi"], choices=["gloo", "mpi"])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="one layer, 2 repeats")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    names = list(LAYERS)[:1] if args.quick else list(LAYERS)
    repeats = 2 if args.quick else args.repeats
    results: dict[str, Any] = {"host": f"{os.cpu_count()} cores", "repeats": repeats,
                               "command": command_line("halo_overlap.py", argv), "rows": {}}
    for backend in args.backends:
        with WorkerPool(backend=backend, size=2, task_timeout=1800) as pool:
            results["rows"][backend] = pool.run(bench, names, repeats)[0]
    write_results(args.out, "halo_overlap", results, _markdown(results))
    return results


if __name__ == "__main__":
    main()
