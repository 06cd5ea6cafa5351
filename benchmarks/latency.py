"""Small collectives, as global-batch BatchNorm runs them (one allgather of a channel's
statistics per layer forward, one allreduce of two sums per layer backward), on gloo and MPI,
2 ranks: distconv's communicator next to the raw backend call on the same buffer; on gloo also
the communicator with its shared-memory channel turned off (``DISTCONV_HOST_CHANNEL=0``), i.e.
every call on gloo itself.

On a machine where a small gloo collective costs a millisecond, a network with 20 BatchNorms
spends 40 of them per step waiting on statistics whatever the library does; this says which it
is here. Next to them, a spatially split layer's halo exchange (an all-to-all of one row block
each way, called with its bound, as the halo exchange calls it), and the allreduce of a 1 MiB
and a 16 MiB gradient bucket (on gloo through the bulk channel; ten times fewer calls per batch).

Writes ``benchmarks/results/latency.{json,md}``.

    .venv/bin/python benchmarks/latency.py          # ~20 s
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._paired import command_line, write_results  # noqa: E402
from distconv.testing import WorkerPool  # noqa: E402

#: (what, op, elements): a 64- and a 256-channel BatchNorm's statistics and sums
CASES = [("BN statistics, 64 channels", "allgather", 1 + 2 * 64),
         ("BN statistics, 256 channels", "allgather", 1 + 2 * 256),
         ("BN backward sums, 64 channels", "allreduce", 2 * 64),
         ("BN backward sums, 256 channels", "allreduce", 2 * 256),
         ("halo rows, 2 x 64 x 1 x 32 (16 KiB)", "alltoall", 2 * 64 * 32),
         ("gradient bucket, 1 MiB", "allreduce", 1 << 18),
         ("gradient bucket, 16 MiB", "allreduce", 1 << 22)]
#: elements above which a batch times fewer calls (a 16 MiB allreduce takes milliseconds)
_LARGE = 1 << 16


def _raw(comm: Any, op: str, t: torch.Tensor) -> Any:
    """The backend's own call on the same buffer (torch.distributed's process group, or the
    mpi4py communicator)."""
    pg = getattr(comm, "_pg", None)
    if op == "alltoall":  # the halo pattern: t to the other rank, nothing to itself
        n, r = t.numel(), comm.rank
        splits = [0 if d == r else n for d in range(comm.size)]
        out = torch.empty_like(t)
        if pg is not None:
            return lambda: pg.alltoall_base(out, t, splits, splits).wait()
        displs = [sum(splits[:d]) for d in range(comm.size)]
        return lambda: comm._comm.Alltoallv([t.numpy(), splits, displs, None],
                                            [out.numpy(), splits, displs, None])
    if pg is not None:
        if op == "allreduce":
            return lambda: pg.allreduce([t]).wait()
        out = [torch.empty_like(t) for _ in range(comm.size)]
        return lambda: pg.allgather([out], [t]).wait()
    mpi = comm._comm  # mpi4py
    arr = t.numpy()
    if op == "allreduce":
        res = arr.copy()
        return lambda: mpi.Allreduce(arr, res)
    res = torch.empty(comm.size * t.numel(), dtype=t.dtype).numpy()
    return lambda: mpi.Allgather(arr, res)


def _without_channel(comm: Any) -> Any:
    """A communicator of the same ranks that carries everything on its backend."""
    import os

    old = os.environ.get("DISTCONV_HOST_CHANNEL")
    os.environ["DISTCONV_HOST_CHANNEL"] = "0"
    try:
        return comm.split([list(range(comm.size))], timeout=comm.timeout + 1)
    finally:
        if old is None:
            del os.environ["DISTCONV_HOST_CHANNEL"]
        else:
            os.environ["DISTCONV_HOST_CHANNEL"] = old


def _call(comm: Any, op: str, t: torch.Tensor) -> Any:
    if op == "alltoall":  # as a halo exchange calls it: with the bound on every rank's bytes
        r = comm.rank
        chunks = [t[:0] if d == r else t for d in range(comm.size)]
        shapes = [(0 if s == r else t.numel(),) for s in range(comm.size)]
        return lambda: comm.alltoall(chunks, recv_shapes=shapes,
                                     max_bytes=t.numel() * t.element_size())
    return (lambda: comm.allreduce(t)) if op == "allreduce" else (lambda: comm.allgather(t))


def bench(comm: Any, repeats: int, inner: int) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    plain = _without_channel(comm) if comm.backend == "torch-gloo" else None
    for what, op, n in CASES:
        t = torch.randn(n)
        sides = {"distconv": _call(comm, op, t), "raw": _raw(comm, op, t)}
        if plain is not None:
            sides["distconv_no_channel"] = _call(plain, op, t)
        times: dict[str, list[float]] = {k: [] for k in sides}
        for fn in sides.values():
            for _ in range(10):
                fn()
        calls = inner if n <= _LARGE else max(2, inner // 10)
        for rep in range(repeats):
            for name in (list(sides) if rep % 2 else list(sides)[::-1]):
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    sides[name]()
                times[name].append((time.perf_counter() - t0) / calls)
        rows.append({"what": what, "op": op, "elements": n,
                     **{f"{k}_us": 1e6 * statistics.median(v) for k, v in times.items()}})
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--inner", type=int, default=50)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    results: dict[str, Any] = {"command": command_line("latency.py", argv), "rows": {}}
    for backend in ("gloo", "mpi"):
        with WorkerPool(backend=backend, size=2, task_timeout=600) as pool:
            results["rows"][backend] = pool.run(bench, args.repeats, args.inner)[0]
    lines = [f"`{results['command']}` (2 ranks, medians of {args.repeats} interleaved batches of "
             f"{args.inner} calls, rank 0)", "",
             "| backend | what | op | elements | distconv µs | distconv, channel off µs | "
             "raw backend µs |",
             "|---|---|---|---|---|---|---|"]
    for backend, rows in results["rows"].items():
        for r in rows:
            off = r.get("distconv_no_channel_us")
            lines.append(f"| {backend} | {r['what']} | {r['op']} | {r['elements']} | "
                         f"{r['distconv_us']:.0f} | {'-' if off is None else f'{off:.0f}'} | "
                         f"{r['raw_us']:.0f} |")
    write_results(args.out, "latency", results, "\n".join(lines))
    return results


if __name__ == "__main__":
    main()
