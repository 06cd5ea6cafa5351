"""Redistributions on real engines: time, bytes per rank, the alpha-beta model, and overhead.

For each backend (gloo, MPI) and world size (2, 4) one world is started; in it, a short
calibration fits the alpha-beta model ``T = messages * alpha + bytes_received * beta`` to the raw
backend's ring allgather, then every redistribution of the paper is timed through ``redistribute``
and, interleaved with it, as the raw backend collective on the same buffers and the same
sub-communicator. Times are the slowest rank's, medians over repetitions.

Run: ``python benchmarks/collectives.py`` (writes benchmarks/results/collectives.{json,md}).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from distconv import Dist, ProcessorGrid, plan_redistribution, redistribute
from distconv.redistribute import AllGather, AllReduce, ReduceScatter, Slice
from distconv.testing import WorkerPool

SHAPE = (16, 32, 28, 28)  # N, C, H, W: divisible by every extent used, so raw buffers are equal
NCHW = "NCHW"
CASES = {
    2: [({"C": 2}, "x[o,o_C,o,o]", "x[o,*,o,o]"),
        ({"C": 2}, "x[o,*,o,o]", "x[o,o_C,o,o]"),
        ({"C": 2}, "Σ_C x[o,*,o,o]", "x[o,o_C,o,o]"),
        ({"C": 2}, "Σ_C x[o,*,o,o]", "x[o,*,o,o]"),
        ({"C": 2}, "x[o_C,*,o,o]", "x[*,o_C,o,o]")],
    4: [({"F": 2, "C": 2}, "x[o,o_C,o,o]", "x[o,*,o,o]"),
        ({"F": 2, "C": 2}, "x[o,o_{C×F},o,o]", "x[o,o_C,o,o]"),
        ({"F": 2, "C": 2}, "x[o,*,o,o]", "x[o,o_F,o,o]"),
        ({"F": 2, "C": 2}, "Σ_C x[o,o_F,o,o]", "x[o,o_{F×C},o,o]"),
        ({"F": 2, "C": 2}, "Σ_{F,C} x[o,*,o,o]", "x[o,*,o,o]"),
        ({"C": 4}, "x[o,o_C,o,o]", "x[o,*,o,o]"),
        ({"C": 4}, "x[o_C,*,o,o]", "x[*,o_C,o,o]")],
}


def _raw(comm, step, x: torch.Tensor):
    """The same collective straight on the backend library (equal sizes), on the same group."""
    if comm.backend == "mpi":
        c = comm._comm  # noqa: SLF001 - the benchmark measures our layer against the library
        a = x.reshape(-1).numpy()
        if isinstance(step, AllGather):
            out = torch.empty(a.size * comm.size, dtype=x.dtype)
            c.Allgather(a, out.numpy())
        elif isinstance(step, ReduceScatter):
            out = torch.empty(a.size // comm.size, dtype=x.dtype)
            c.Reduce_scatter_block(a, out.numpy())
        elif isinstance(step, AllReduce):
            out = torch.empty_like(x)
            c.Allreduce(a, out.reshape(-1).numpy())
        else:
            out = torch.empty_like(x)
            c.Alltoall(a, out.reshape(-1).numpy())
        return out
    pg = comm._pg  # noqa: SLF001
    flat = x.reshape(-1)
    if isinstance(step, AllGather):
        out = [torch.empty_like(flat) for _ in range(comm.size)]
        pg.allgather([out], [flat]).wait()
    elif isinstance(step, ReduceScatter):
        out = torch.empty(flat.numel() // comm.size, dtype=x.dtype)
        pg.reduce_scatter([out], [list(flat.chunk(comm.size))]).wait()
    elif isinstance(step, AllReduce):
        out = flat.clone()
        pg.allreduce([out]).wait()
    else:
        out = torch.empty_like(flat)
        pg.alltoall_base(out, flat, [], []).wait()
    return out


def _timed(comm, fn) -> float:
    comm.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def calibrate(comm, repeats: int) -> tuple[float, float]:
    """Alpha (s per message) and beta (s per byte) fitted to the raw ring allgather."""
    rows = []
    for n in (1, 16, 256, 4096, 65536, 262144, 1048576):  # small sizes pin alpha
        x = torch.randn(n)
        step = AllGather(0, "W", ())
        times = [_timed(comm, lambda: _raw(comm, step, x)) for _ in range(repeats)]
        rows.append(((comm.size - 1), (comm.size - 1) * n * 4, statistics.median(times)))
    # T = m * alpha + b * beta, fitted in relative error (each row divided by its time) so the
    # microsecond-sized messages pin alpha as firmly as the megabyte ones pin beta
    rows = [(m / t, b / t, 1.0) for m, b, t in rows]
    smm = sum(m * m for m, _, _ in rows)
    smb = sum(m * b for m, b, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    smt = sum(m * t for m, _, t in rows)
    sbt = sum(b * t for _, b, t in rows)
    det = smm * sbb - smb * smb
    alpha = (smt * sbb - sbt * smb) / det
    beta = (smm * sbt - smb * smt) / det
    return max(alpha, 0.0), max(beta, 0.0)


def _messages(step, extent: int) -> int:
    if isinstance(step, Slice):
        return 0
    return 2 * (extent - 1) if isinstance(step, AllReduce) else extent - 1


def bench_world(comm, repeats: int) -> dict:
    torch.manual_seed(0)
    alpha, beta = calibrate(comm, repeats)
    rows = []
    for dims, s, d in CASES[comm.size]:
        grid = ProcessorGrid(dims, comm=comm)
        src, dst = Dist.parse(s, NCHW), Dist.parse(d, NCHW)
        plan = plan_redistribution(grid.layout, src, dst, SHAPE)
        x = torch.randn(src.local_shape(SHAPE, grid))
        redistribute(x, grid, src, dst, SHAPE)  # warm-up: creates the sub-communicators
        ours, raw = [], []
        for _ in range(repeats):  # interleaved, so drift hits both alike
            ours.append(_timed(comm, lambda: redistribute(x, grid, src, dst, SHAPE)))
            if len(plan.steps) == 1 and not isinstance(plan.steps[0], Slice):
                step = plan.steps[0]
                dims_of = step.dims if isinstance(step, AllReduce) else [step.g]
                sub = grid.subcomm(dims_of)
                raw.append(_timed(comm, lambda: _raw(sub, step, x)))
        nbytes = plan.received_bytes(grid, 4)
        messages = 0
        for step in plan.steps:
            dims_of = step.dims if isinstance(step, AllReduce) else [getattr(step, "g", None)]
            extent = math.prod(grid.extent(g) for g in dims_of if g is not None)
            messages += _messages(step, extent)
        rows.append({
            "grid": dims, "src": str(src), "dst": str(dst),
            "steps": "; ".join(map(str, plan.steps)) or "none",
            "bytes": nbytes, "model_s": messages * alpha + nbytes * beta,
            "ours_s": ours, "raw_s": raw,
        })
    return {"alpha": alpha, "beta": beta, "rows": rows}


def merge(per_rank: list[dict]) -> dict:
    """Slowest rank per repetition, then the median; bytes per rank as a list."""
    first = per_rank[0]
    rows = []
    for i, row in enumerate(first["rows"]):
        ours = statistics.median(max(r["rows"][i]["ours_s"][k] for r in per_rank)
                                 for k in range(len(row["ours_s"])))
        raw = (statistics.median(max(r["rows"][i]["raw_s"][k] for r in per_rank)
                                 for k in range(len(row["raw_s"]))) if row["raw_s"] else None)
        rows.append({**{k: row[k] for k in ("grid", "src", "dst", "steps")},
                     "bytes_per_rank": [r["rows"][i]["bytes"] for r in per_rank],
                     "model_ms": 1e3 * max(r["rows"][i]["model_s"] for r in per_rank),
                     "ours_ms": 1e3 * ours, "raw_ms": None if raw is None else 1e3 * raw,
                     "overhead": None if not raw else ours / raw})
    return {"alpha_us": 1e6 * first["alpha"], "beta_ns_per_byte": 1e9 * first["beta"],
            "rows": rows}


def markdown(results: dict) -> str:
    lines = []
    for key, res in results.items():
        lines.append(f"\n### {key}: alpha = {res['alpha_us']:.1f} µs, "
                     f"beta = {res['beta_ns_per_byte']:.3f} ns/B (fitted)\n")
        lines.append("| grid | src → dst | steps | bytes/rank | model ms | ours ms | raw ms | ours/raw |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in res["rows"]:
            raw = "–" if r["raw_ms"] is None else f"{r['raw_ms']:.2f}"
            ratio = "–" if r["overhead"] is None else f"{r['overhead']:.2f}"
            grid = "×".join(f"{k}={v}" for k, v in r["grid"].items())
            lines.append(f"| {grid} | `{r['src']}` → `{r['dst']}` | {r['steps']} | "
                         f"{r['bytes_per_rank']} | {r['model_ms']:.2f} | {r['ours_ms']:.2f} | "
                         f"{raw} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--backends", nargs="+", default=["gloo", "mpi"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    results = {}
    for backend in args.backends:
        for size in args.sizes:
            with WorkerPool(backend, size, timeout=120.0, task_timeout=None) as pool:
                results[f"{backend} × {size}"] = merge(pool.run(bench_world, args.repeats))
            print(markdown({f"{backend} × {size}": results[f"{backend} × {size}"]}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "collectives.json").write_text(json.dumps(results, indent=2))
    (out / "collectives.md").write_text(
        f"# Redistributions, global x {SHAPE} fp32\n" + markdown(results) + "\n")
    print(f"\nwrote {out / 'collectives.json'} and {out / 'collectives.md'}")


if __name__ == "__main__":
    main()
