"""Segmented conversions between layouts: who talks to whom at scale, and what it costs here.

Two parts, written to ``benchmarks/results/segments.{json,md}``:

* ``--journal P`` (default 64, thread ranks): the ResNet-style chain spatial -> stationary-x ->
  stationary-y -> spatial (``tests/parallel/chain.py``, sample rows of 4 ranks: grids
  ``{N: P/4, H: 4}`` ...) trains two steps; every collective of the second is journaled with the
  size of the group it ran on. Reported: the largest group per kind of step, and what
  ``explain`` prices the same chain's steps on at 1024 ranks (the model: each collective's
  group, a conversion's its segment), with the whole-world ones' seconds on Lassen.
* ``--measure`` (4 gloo and 4 MPI ranks): the conversion ``{N: 2, H: 2} -> {N: 2, C: 2}`` of
  ``x[o,*,o,*] -> x[o,o_C,*,*]`` (forward and adjoint) and a whole training step of the chain on
  rows of 2 (a hybrid layout), each run segmented (the send graph's groups) and as before (one
  all-to-all over every rank), interleaved repeat by repeat in one run; medians of the slowest
  rank; the bytes each side moves, which must be equal.

Run: ``nice -n 10 python benchmarks/segments.py`` (both parts; ``--journal 0`` or
``--no-measure`` skips one).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distconv import Dist, ProcessorGrid, parallelize, repartition  # noqa: E402
from distconv.data import sample_block  # noqa: E402
from distconv.redistribute import between_grids  # noqa: E402
from distconv.testing import WorkerPool, run_threads  # noqa: E402
from tests.parallel.chain import Chain, chain_case, chain_config, journaled_step  # noqa: E402

KINDS = (  # (kind, how its journal entry starts or what it contains)
    ("entry: agreement on the global batch", "ParallelModel entry"),
    ("conversion between layouts (repartition)", "repartition"),
    ("conversion between layouts (adjoint)", "adjoint of repartition"),
    ("halo exchange / accumulate", "halo"),
    ("stationary-x/-y reduce-scatter, allgather", " over C in", " over F in"),
    ("pooling's pending sum (allreduce over H)", "allreduce over H"),
    ("BatchNorm statistics, forward and backward", "DistBatchNorm"),
    ("gradient allreduce", "gradient bucket"),
)


def kind_of(what: str) -> str:
    for kind, *keys in KINDS[::-1]:
        if any(k in what for k in keys):
            return kind
    return "other: " + what


def journal(world: int) -> dict[str, Any]:
    """The largest group per kind of step of the chain's second training step on ``world``
    thread ranks, and every whole-world collective with its description."""
    t0 = time.perf_counter()
    results = run_threads(journaled_step, world, timeout=600)
    largest: dict[str, int] = {}
    whole: Counter[str] = Counter()
    for got in results:
        for op, size, what in got["calls"]:
            k = kind_of(what)
            largest[k] = max(largest.get(k, 0), size)
            if size == world and got is results[0]:
                whole[f"{op}: {what}"] += 1
    return {"world": world, "largest": largest, "whole_world": dict(whole),
            "calls_per_step": len(results[0]["calls"]), "seconds": time.perf_counter() - t0}


def modelled(world: int) -> dict[str, Any]:
    """``explain``'s groups for the chain's steps at ``world`` ranks (sample rows of 4): the
    largest per kind, and the whole-world collectives' seconds on Lassen."""
    from distconv.machines import lassen
    from distconv.machines.base import group_of
    from distconv.parallel.explain import explain

    machine = lassen()
    model, x, _ = chain_case(world, dtype=torch.float32)
    e = explain(model, chain_config(world), tuple(x.shape), world_size=world, machine=machine)
    largest: dict[str, int] = {}
    whole: dict[str, float] = {}
    for lay in e.layers:
        for st in lay.steps:
            if st.groups is not None:
                size = max((len(g) for g in st.groups), default=1)
            elif st.layout is not None:
                size = len(group_of(st.layout, st.dims or tuple(d for d, _ in st.layout)))
            else:
                size = st.peers
            k = kind_of(_journal_words(st.what))
            largest[k] = max(largest.get(k, 0), size)
            if size == world:
                whole[f"{lay.name}: {st.what}"] = st.seconds(machine)
    return {"world": world, "largest": largest, "whole_world_seconds_lassen": whole,
            "step_ms_lassen": e.timeline().step * 1e3}


def _journal_words(what: str) -> str:
    """explain's description in the journal's words (for :func:`kind_of`)."""
    for said, journal_word in (("agree on the global batch", "ParallelModel entry"),
                               ("adjoint of redistribute", "adjoint of repartition"),
                               ("redistribute", "repartition"),
                               ("statistics allgather", "DistBatchNorm"),
                               ("Σdy", "DistBatchNorm"), ("halo", "halo"),
                               ("reduce-scatter y over C", " over C in"),
                               ("allgather dL/dy over C", " over C in"),
                               ("allgather x over F", " over F in"),
                               ("reduce-scatter dL/dx over F", " over F in")):
        if said in what:
            return journal_word
    return what


# ----------------------------------------------------------------------------- measured
SHAPE = (16, 64, 32, 32)  # N C H W, fp32: 4 MiB in all, 1 MiB per rank
SPATIAL, CHANNELS = {"N": 2, "H": 2}, {"N": 2, "C": 2}
X_SPATIAL = Dist(("N", None, "H", None), tensor_dims="NCHW")
X_CHANNELS = Dist(("N", "C", None, None), tensor_dims="NCHW")


def _sides(comm: Any, run: Any, repeats: int) -> dict[str, Any]:
    """``run()`` timed with segments and as one whole-world exchange, interleaved (a warm-up of
    each first); the slowest rank's medians and each side's bytes per run."""
    times: dict[str, list[float]] = {"segmented": [], "whole world": []}
    moved: dict[str, int] = {}
    for side in times:  # warm-up: plans, segment communicators
        between_grids._WHOLE_WORLD = side == "whole world"
        run()
        comm.stats.reset()
        run()
        moved[side] = comm.stats.total_bytes()
    for i in range(repeats):
        for side in (("segmented", "whole world") if i % 2 == 0 else
                     ("whole world", "segmented")):
            between_grids._WHOLE_WORLD = side == "whole world"
            comm.barrier()
            t0 = time.perf_counter()
            run()
            times[side].append(time.perf_counter() - t0)
    between_grids._WHOLE_WORLD = False
    keys = list(times)
    per = comm.allreduce(torch.tensor([times[k] for k in keys], dtype=torch.float64), op="max")
    out: dict[str, Any] = {}
    for i, k in enumerate(keys):
        out[k] = {"median_ms": statistics.median(per[i].tolist()) * 1e3, "bytes": moved[k]}
    return out


def measure_world(comm: Any, repeats: int) -> dict[str, Any]:
    """Runs on every rank of a 4-rank world: the conversion alone and a whole training step."""
    torch.set_num_threads(1)
    a, b = ProcessorGrid(SPATIAL, comm=comm), ProcessorGrid(CHANNELS, comm=comm)
    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(X_SPATIAL.local_shape(SHAPE, a), generator=gen).requires_grad_(True)
    g = torch.randn(X_CHANNELS.local_shape(SHAPE, b), generator=gen)

    def convert() -> None:
        repartition(x, a, X_SPATIAL, b, X_CHANNELS, SHAPE).backward(g)
        x.grad = None

    model, data, labels = chain_case(comm.size, row=2, width=32, batch=16, pixels=(32, 32),
                                     dtype=torch.float32)
    pmodel = parallelize(copy.deepcopy(model), chain_config(comm.size, row=2), comm=comm)
    rows = sample_block(data.shape[0], pmodel.data_grid)

    def step() -> None:
        F.cross_entropy(pmodel(data[rows]), labels[rows]).backward()
        pmodel.zero_grad(set_to_none=True)

    return {"conversion {N: 2, H: 2} -> {N: 2, C: 2}, forward + adjoint": _sides(comm, convert,
                                                                                 repeats),
            "training step of the chain (rows of 2)": _sides(comm, step, repeats)}


def measure(repeats: int) -> dict[str, Any]:
    out = {}
    for backend in ("gloo", "mpi"):
        with WorkerPool(backend, 4, timeout=120.0, task_timeout=None) as pool:
            per_rank = pool.run(measure_world, repeats)
        out[f"{backend} × 4"] = {
            case: {side: {"median_ms": r["median_ms"],
                          "bytes_per_rank": [p[case][side]["bytes"] for p in per_rank]}
                   for side, r in sides.items()}
            for case, sides in per_rank[0].items()}
        print(json.dumps(out[f"{backend} × 4"], indent=1), flush=True)
    return out


# ----------------------------------------------------------------------------- report
def markdown(results: dict[str, Any]) -> str:
    rows = ["# Segmented conversions", "", f"`{results['command']}`", ""]
    if "journal" in results:
        j, m = results["journal"], results["model"]
        rows += [f"## Largest group per kind of step: {j['world']} thread ranks (journaled) and "
                 f"{m['world']} ranks (explain's model)", "",
                 "| kind of step | largest group, P = " + str(j["world"])
                 + " | largest group, P = " + str(m["world"]) + " |", "|---|---:|---:|"]
        for kind, _ in [(k, None) for k, *_ in KINDS]:
            if kind in j["largest"] or kind in m["largest"]:
                rows.append(f"| {kind} | {j['largest'].get(kind, '-')} | "
                            f"{m['largest'].get(kind, '-')} |")
        rows += ["", f"Whole-world collectives of one step at P = {j['world']} (journaled):", ""]
        rows += [f"- {w} (×{n})" for w, n in j["whole_world"].items()]
        rows += ["", f"Whole-world collectives at P = {m['world']}, priced on Lassen:", ""]
        rows += [f"- {w}: {s * 1e3:.3f} ms" for w, s in m["whole_world_seconds_lassen"].items()]
        rows += ["", f"The chain's step at P = {m['world']} on Lassen: "
                 f"{m['step_ms_lassen']:.3f} ms (explain)."]
    if "measured" in results:
        rows += ["", "## Measured: segmented vs one all-to-all over every rank "
                 f"({results['repeats']} interleaved repeats, medians of the slowest rank)", "",
                 "| world | case | segmented ms | whole world ms | ratio | bytes equal |",
                 "|---|---|---:|---:|---:|---|"]
        for world, cases in results["measured"].items():
            for case, sides in cases.items():
                s, w = sides["segmented"], sides["whole world"]
                rows.append(f"| {world} | {case} | {s['median_ms']:.3f} | {w['median_ms']:.3f} "
                            f"| {w['median_ms'] / s['median_ms']:.2f}× | "
                            f"{s['bytes_per_rank'] == w['bytes_per_rank']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--journal", type=int, default=64,
                        help="thread ranks of the journaled step (0: skip); default 64")
    parser.add_argument("--model", type=int, default=1024,
                        help="ranks explain prices the chain at; default 1024")
    parser.add_argument("--no-measure", action="store_true")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"command": " ".join(["python", "benchmarks/segments.py",
                                                    *(argv if argv is not None
                                                      else sys.argv[1:])]),
                               "repeats": args.repeats}
    if args.journal:
        results["journal"] = journal(args.journal)
        results["model"] = modelled(args.model)
        print(json.dumps({k: results[k] for k in ("journal", "model")}, indent=1), flush=True)
    if not args.no_measure:
        results["measured"] = measure(args.repeats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "segments.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    (out / "segments.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
