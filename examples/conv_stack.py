"""A DistConv2d stack on 4 local processes, layer by layer, checked against one process.

1. A tensor walks through the paper's redistributions on a 2×2 grid (allgather, discard,
   segmented allgather of a nested ``o_{C×F}`` block, reduce-scatter of a pending sum).
2. A small stack of DistConv2d layers, each with its own algorithm and grid -- channel parallel
   (stationary-x), spatial (halo exchange), channel×filter parallel (stationary-w) and filter
   parallel (stationary-y) -- runs forward and backward; the output, the input gradient and every
   weight gradient are compared with the same stack of ``nn.Conv2d`` on one process. Per layer
   it prints the distributions in the paper's notation, the bytes moved and the time.

Run: ``python examples/conv_stack.py [--backend gloo|mpi|threads]``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from redistribution_walk import SHAPE as WALK_SHAPE  # noqa: E402
from redistribution_walk import report, walk  # noqa: E402

from distconv import ProcessorGrid, gather, redistribute, repartition, scatter  # noqa: E402
from distconv.launch import launch  # noqa: E402
from distconv.nn import DistConv2d  # noqa: E402

INPUT = (4, 8, 12, 12)  # N, C, H, W
# (name, nn.Conv2d arguments, grid, algorithm, options)
LAYERS = [
    ("conv1", dict(in_channels=8, out_channels=16, kernel_size=3, padding=1),
     {"N": 2, "C": 2}, "stationary-x", {}),
    ("conv2", dict(in_channels=16, out_channels=16, kernel_size=3, padding="same", dilation=2),
     {"H": 2, "W": 2}, "stationary-x", {}),
    ("conv3", dict(in_channels=16, out_channels=12, kernel_size=3, stride=2, padding=1),
     {"F": 2, "C": 2}, "stationary-w", {}),
    ("conv4", dict(in_channels=12, out_channels=8, kernel_size=2),
     {"F": 4}, "stationary-y", {}),
]
FP32 = dict(rtol=1e-4, atol=1e-5)  # fp32: different summation orders across ranks


def reference_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Conv2d(**args) for _, args, _, _, _ in LAYERS])


def conv_stack(comm) -> dict:
    """Runs on every rank: the distributed stack against the single-process one."""
    ref = reference_model()
    x = torch.randn(INPUT, generator=torch.Generator().manual_seed(1))
    probe = torch.randn(ref(x).shape, generator=torch.Generator().manual_seed(2))
    x_ref = x.clone().requires_grad_(True)
    (ref(x_ref) * probe).sum().backward()

    layers, grids = [], []
    for (name, _, dims, algorithm, options), conv in zip(LAYERS, ref):
        grid = ProcessorGrid(dims, comm=comm)
        layers.append(DistConv2d.from_conv2d(conv, grid=grid, algorithm=algorithm, **options))
        grids.append(grid)

    rows = []
    shape = INPUT
    first = layers[0]
    h = scatter(x, first.input_dist, grids[0]).requires_grad_(True)
    x_local = h
    prev_grid, prev_dist = grids[0], first.input_dist
    for (name, _, dims, algorithm, _), layer, grid in zip(LAYERS, layers, grids):
        before = comm.stats.total_bytes()
        start = time.perf_counter()
        if grid.layout != prev_grid.layout:
            h = repartition(h, prev_grid, prev_dist, grid, layer.input_dist, shape)
        elif prev_dist != layer.input_dist:
            h = redistribute(h, grid, prev_dist, layer.input_dist, shape)
        moved_between = comm.stats.total_bytes() - before
        h = layer(h, global_shape=shape)
        elapsed = time.perf_counter() - start
        rows.append(dict(
            name=name, algorithm=algorithm, grid=dims,
            x=layer.input_dist.format("x"), w=layer.weight_dist.format("w"),
            y=layer.output_dist.format("y"), between=moved_between,
            forward_bytes=comm.stats.total_bytes() - before - moved_between,
            forward_ms=1e3 * elapsed,
        ))
        shape = layer.output_shape(shape)
        prev_grid, prev_dist = grid, layer.output_dist

    out = gather(h, prev_dist, prev_grid, shape)
    before = comm.stats.total_bytes()
    start = time.perf_counter()
    # the loss lives on rank 0: a pending sum whose other terms are zero
    (out * probe * (1.0 if comm.rank == 0 else 0.0)).sum().backward()
    backward_ms = 1e3 * (time.perf_counter() - start)
    backward_bytes = comm.stats.total_bytes() - before

    errors = {"y": float((out - ref(x)).abs().max())}
    errors["dL/dx"] = _error(_sum_pending(x_local.grad, first, grids[0]), x_ref.grad)
    for (name, *_), layer, conv, grid in zip(LAYERS, layers, ref, grids):
        dw = gather(layer.weight.grad, layer.weight_dist, grid, conv.weight.shape)
        errors[f"dL/dw {name}"] = _error(dw, conv.weight.grad)
        if conv.bias is not None:
            db = gather(layer.bias.grad, layer.bias_dist, grid, conv.bias.shape)
            errors[f"dL/db {name}"] = _error(db, conv.bias.grad)
    return dict(rows=rows, errors=errors, backward_ms=backward_ms, backward_bytes=backward_bytes)


def _sum_pending(grad, layer, grid):
    """The input gradient: a pending sum over the dims x is replicated on, gathered and summed."""
    dual = layer.input_dist.dual(grid)
    return gather(grad, dual, grid, INPUT)


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    torch.testing.assert_close(a, b, **FP32)
    return float((a - b).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "mpi", "threads"])
    args = parser.parse_args()

    print(f"== 1. redistributions: grid F=2 × C=2, 4 {args.backend} ranks, x {WALK_SHAPE} fp64\n")
    report(launch(walk, 4, backend=args.backend))

    print(f"\n== 2. a DistConv2d stack on 4 {args.backend} ranks, input {INPUT} fp32\n")
    results = launch(conv_stack, 4, backend=args.backend)
    for i, row in enumerate(results[0]["rows"]):
        grid = "×".join(f"{k}={v}" for k, v in row["grid"].items())
        fwd = [r["rows"][i]["forward_bytes"] for r in results]
        between = [r["rows"][i]["between"] for r in results]
        ms = max(r["rows"][i]["forward_ms"] for r in results)
        print(f"  {row['name']}: {row['algorithm']} on {grid}")
        print(f"      {row['x']}  *  {row['w']}  ->  {row['y']}")
        print(f"      bytes/rank: into the layer {between}, in the layer {fwd};  forward {ms:.1f} ms")
    back = [r["backward_bytes"] for r in results]
    print(f"  backward: bytes/rank {back}; {max(r['backward_ms'] for r in results):.1f} ms")
    print("\n  max |distributed - single process| (fp32, rtol 1e-4, atol 1e-5):")
    for key in results[0]["errors"]:
        print(f"      {key:12s} {max(r['errors'][key] for r in results):.1e}")
    print("\nevery result equals the single-process model")


if __name__ == "__main__":
    main()
