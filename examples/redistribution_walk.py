"""Walk a tensor through the paper's redistributions on a 2×2 grid of 4 local processes.

Every step is checked against the single-process tensor; each line shows the step in the paper's
notation and the bytes each rank received. Run: ``python examples/redistribution_walk.py``.
"""
from __future__ import annotations

import argparse

import torch

from distconv import Dist, ProcessorGrid, gather, plan_redistribution, redistribute, scatter
from distconv.launch import launch

SHAPE = (4, 6, 5, 5)  # N, C, H, W
NCHW = "NCHW"


def walk(comm) -> list[tuple[str, str, int, float]]:
    """Runs on every rank; returns (step, collectives, bytes received, max error) per step."""
    grid = ProcessorGrid({"F": 2, "C": 2}, comm=comm)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rows = []

    def step(t, src, dst, reference, name="x"):
        before = comm.stats.total_bytes()
        out = redistribute(t, grid, src, dst, reference.shape)
        moved = comm.stats.total_bytes() - before
        plan = plan_redistribution(grid.layout, src, dst, reference.shape)
        error = float((gather(out, dst, grid, reference.shape) - reference).abs().max())
        ops = "; ".join(map(str, plan.steps)) or "no communication"
        rows.append((f"{src.format(name)} → {dst.format(name)}", ops, moved, error))
        return out

    a = Dist.parse("x[o,o_{C×F},o,o]", NCHW)  # the paper writes this layout x[o,o_{F×C},o,o]
    b = Dist.parse("x[o,o_C,o,o]", NCHW)
    c = Dist.parse("x[o,*,o,o]", NCHW)
    d = Dist.parse("x[o,o_F,o,o]", NCHW)
    t = scatter(x, a, grid)
    t = step(t, a, b, x)  # segmented allgather over F: o_{C×F} -> o_C
    t_c = t
    t = step(t, b, c, x)  # allgather over C
    step(t, c, d, x)  # discard: keep the own F block

    # a pending sum: a 1×1 convolution with the channels split over C (stationary-x by hand)
    w = torch.randn(4, SHAPE[1], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lo = b.local_slices(SHAPE, grid)[1]
    partial = torch.einsum("fc,nchw->nfhw", w[:, lo], t_c)
    y_ref = torch.einsum("fc,nchw->nfhw", w, x)
    pending = Dist.parse("Σ_C y[o,*,o,o]", "NFHW")
    target = Dist.parse("y[o,o_C,o,o]", "NFHW")
    step(partial, pending, target, y_ref, "y")  # reduce-scatter over C
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "mpi", "threads"])
    args = parser.parse_args()
    print(f"grid F=2 × C=2 on 4 {args.backend} ranks, x of global shape {SHAPE} (fp64)\n")
    report(launch(walk, 4, backend=args.backend))
    print("\nevery step equals the single-process result")


def report(results: list[list[tuple[str, str, int, float]]]) -> None:
    """Print each step with every rank's bytes; stop if any rank's result differs."""
    for i, (name, ops, _, _) in enumerate(results[0]):
        moved = [r[i][2] for r in results]
        error = max(r[i][3] for r in results)
        print(f"  {name:32s} {ops:30s} bytes/rank {moved}  max|err| {error:.1e}")
        if error > 1e-12:
            raise SystemExit(f"step {name} differs from the single-process tensor")


if __name__ == "__main__":
    main()
