"""The model zoo's support matrix: every zoo model (``tests/zoo/catalogue.py``: MONAI, torchvision,
timm, made tiny) under every config (sample, spatial, the deepest convolutions over channels or
over filters, ``auto``, ``plan_network``'s plan), two SGD steps on 4 thread ranks in fp64 against
one process: exact (with the largest relative error), refused (the exception, the node and module
it names, the reason), or an internal error. Then ``distkfac.KFAC`` on each model's channel
config against one process's K-FAC (the layers it does not precondition, by name), and the step
time of each sample-parallel model against torch DDP on a real gloo world (medians of interleaved
steps, the slower rank).

Writes ``benchmarks/results/model_zoo.{md,json}``::

    .venv/bin/python benchmarks/model_zoo.py                      # everything (a few minutes)
    .venv/bin/python benchmarks/model_zoo.py --models 'monai.*' --configs sample,spatial \\
        --no-kfac --no-timing                                     # a part of the matrix
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._paired import command_line, write_results  # noqa: E402
from tests.zoo.catalogue import (  # noqa: E402
    CONFIGS, REL_TOL, WORLD, ZOO, Entry, Outcome, case, run_kfac, run_pair,
)

RESULTS = ROOT / "benchmarks" / "results"
#: the config K-FAC is checked under (the deepest convolutions channel-parallel)
KFAC_CONFIG = "channels"
#: K-FAC runs on models up to this many parameters (FlexibleUNet's ResNet encoder, 5 M at its
#: fixed widths, has factors of thousands of rows: minutes of fp64 eigendecompositions)
KFAC_MAX_PARAMETERS = 200_000
#: samples per rank of the timed steps (the exactness runs take the catalogue's batch of 4)
PER_RANK = 4


def matrix(entries: list[Entry], configs: list[str]) -> dict[str, dict[str, Outcome]]:
    from tqdm import tqdm

    out: dict[str, dict[str, Outcome]] = {e.name: {} for e in entries}
    pairs = [(e, c) for e in entries for c in configs]
    for entry, config in tqdm(pairs, desc="matrix", unit="pair"):
        out[entry.name][config] = run_pair(entry, config)
    return out


def kfac(entries: list[Entry]) -> dict[str, dict[str, Any]]:
    from tqdm import tqdm

    out = {}
    for entry in tqdm(entries, desc="k-fac", unit="model"):
        size = sum(p.numel() for p in entry.build().parameters())
        if size > KFAC_MAX_PARAMETERS:
            out[entry.name] = {"kind": "skipped", "message": f"{size:,} parameters",
                               "not_preconditioned": {}}
            continue
        outcome, skipped = run_kfac(entry, KFAC_CONFIG)
        out[entry.name] = {**outcome.row(), "not_preconditioned": skipped}
    return out


# ---------------------------------------------------------------------------- step time vs DDP
def measure(comm: Any, name: str, steps: int, warmup: int) -> dict[str, list[float]]:
    """Runs on every rank of a gloo world: interleaved fp32 training steps of DDP and of the
    sample-parallel model (``statistics: local``, DDP's batch-norm semantics) on ``PER_RANK``
    samples per rank; each side's seconds per step on the slower rank."""
    from torch.nn.parallel import DistributedDataParallel

    from distconv.parallel import parallelize

    torch.set_num_threads(1)
    entry = ZOO[name]
    model, x, y = case(entry)
    model = model.float()
    reps = PER_RANK * WORLD // x.shape[0]
    x, y = x.float().repeat(reps, *[1] * (x.dim() - 1)), y.repeat(reps, *[1] * (y.dim() - 1))
    # DDP as its user would run it: told about parameters the forward never uses (UNETR's
    # cross-attention norm), which it otherwise refuses; the others keep its fast default
    F.cross_entropy(model(x[:PER_RANK]), y[:PER_RANK]).backward()
    unused = any(p.grad is None for p in model.parameters() if p.requires_grad)
    model.zero_grad(set_to_none=True)
    sides = {
        "ddp": DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=unused),
        "sample": parallelize(copy.deepcopy(model), {"default": {
            "grid": {"N": comm.size}, "algorithm": "sample", "statistics": "local"}},
            comm=comm, input_shape=tuple(x.shape)),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for k, m in sides.items()}
    rows = slice(comm.rank * PER_RANK, (comm.rank + 1) * PER_RANK)
    times: dict[str, list[float]] = {k: [] for k in sides}
    for step in range(warmup + steps):
        for side in (list(sides) if step % 2 else list(sides)[::-1]):  # no order bias
            comm.barrier()
            t0 = time.perf_counter()
            F.cross_entropy(sides[side](x[rows]), y[rows]).backward()
            opts[side].step()
            opts[side].zero_grad()
            if step >= warmup:
                times[side].append(time.perf_counter() - t0)
    return {k: torch.stack(comm.allgather(torch.tensor(v, dtype=torch.float64))).amax(0).tolist()
            for k, v in times.items()}


def timing(names: list[str], steps: int, warmup: int) -> dict[str, dict[str, float]]:
    from tqdm import tqdm

    from distconv.testing import WorkerPool

    out = {}
    with WorkerPool("gloo", WORLD, timeout=120.0, task_timeout=1800.0) as pool:
        for name in tqdm(names, desc="vs DDP", unit="model"):
            times = pool.run(measure, name, steps, warmup)[0]
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            out[name] = {"ddp_ms": med["ddp"], "sample_ms": med["sample"],
                         "ratio": med["sample"] / med["ddp"]}
    return out


# ---------------------------------------------------------------------------- the tables
def _cell(o: Outcome, refusals: list[str]) -> str:
    if o.kind == "exact":
        return f"exact ({o.error:.0e})"
    if o.kind == "refused":
        text = f"{o.raised}: {_short(o.message)}"
        if text not in refusals:
            refusals.append(text)
        return f"refused [{refusals.index(text) + 1}]"
    if o.kind == "skipped":
        return f"skipped ({o.message})" if o.message[:1].isdigit() else "skipped"
    if o.kind == "inexact":
        return f"**inexact ({o.error:.1e})**"
    return f"**error** {o.raised} at {o.where}"


def _short(message: str, limit: int = 480) -> str:
    """A refusal for the table: lists of what is supported cut short (the JSON keeps it all)."""
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit].rsplit(" ", 1)[0] + " …"


def counts(results: dict[str, dict[str, Outcome]]) -> dict[str, int]:
    kinds = [o.kind for row in results.values() for o in row.values()]
    return {k: kinds.count(k) for k in ("exact", "refused", "error", "inexact", "skipped")}


def table(results: dict[str, dict[str, Outcome]], configs: list[str], kfac_rows: dict,
          times: dict, header: str) -> str:
    refusals: list[str] = []
    n = counts(results)
    ran = n["exact"] + n["refused"] + n["error"] + n["inexact"]
    lines = [header, "",
             f"{n['exact']} of {ran} pairs that ran are exact (fp64, relative error ≤ "
             f"{REL_TOL:g}), {n['refused']} refused, {n['error']} internal errors, "
             f"{n['inexact']} inexact; {n['skipped']} skipped (the package does not import "
             "here).", "",
             "| model | " + " | ".join(configs) + " |", "|---|" + "---|" * len(configs)]
    for name, row in results.items():
        lines.append(f"| {name} | " + " | ".join(_cell(row[c], refusals) for c in configs)
                     + " |")
    ran_of = {c: [row[c].kind for row in results.values() if row[c].kind != "skipped"]
              for c in configs}
    lines.append("| exact of those that ran | " + " | ".join(
        f"{ran_of[c].count('exact')} of {len(ran_of[c])}" for c in configs) + " |")
    skipped = {name: row[configs[0]].message for name, row in results.items()
               if row[configs[0]].kind == "skipped"}
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()) + "."]
    lines += ["", "Configs: `sample` `{N: 4}`; `spatial` `{N: 2, H: 2}` (`D` for volumes), data "
              "on the same grid; `channels` / `filters` the convolutions that read the coarsest "
              "maps on `{N: 2, C: 2}` stationary-x / `{N: 2, F: 2}` stationary-y, the rest "
              "sample; `auto` the `auto` default priced on `lassen`; `plan` "
              "`distconv.planner.plan_network(..., machine='lassen').config()`.", ""]
    if refusals:
        lines += ["Refusals:", ""] + [f"{i}. {r}" for i, r in enumerate(refusals, 1)] + [""]
    if kfac_rows:
        lines += [f"K-FAC (`distkfac.KFAC`, the `{KFAC_CONFIG}` config, two steps) against one "
                  "process's K-FAC:", "", "| model | outcome | not preconditioned |",
                  "|---|---|---|"]
        for name, r in kfac_rows.items():
            o = Outcome(**{k: v for k, v in r.items() if k != "not_preconditioned"})
            skipped_layers = ", ".join(f"`{k}` ({v})" for k, v in r["not_preconditioned"].items())
            lines.append(f"| {name} | {_cell(o, refusals)} | {skipped_layers or '-'} |")
        lines.append("")
    if times:
        lines += [f"Step time, fp32, gloo, {WORLD} ranks, {PER_RANK} samples per rank, medians "
                  "of interleaved steps, the slower rank:", "",
                  "| model | DDP ms | sample ms | sample/DDP |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['ddp_ms']:.2f} | {v['sample_ms']:.2f} | {v['ratio']:.2f} |"
                  for k, v in times.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="*", help="fnmatch patterns of zoo names, comma-separated")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--no-kfac", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    patterns = args.models.split(",")
    entries = [e for e in ZOO.values() if any(fnmatch.fnmatch(e.name, p) for p in patterns)]
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        ap.error(f"--configs: {bad} are not among {list(CONFIGS)}")
    results = matrix(entries, configs)
    runnable = [e for e in entries if e.missing() is None]
    kfac_rows = {} if args.no_kfac else kfac(runnable)
    exact = [e.name for e in runnable if results[e.name].get("sample", Outcome("")).kind
             == "exact"]
    times = {} if args.no_timing or not exact else timing(exact, args.steps, args.warmup)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = command_line("model_zoo.py", argv)
    header = f"Model zoo support matrix (`{cmd}`, {when}, torch {torch.__version__})"
    doc = {"command": cmd, "date": when, "counts": counts(results),
           "matrix": {m: {c: o.row() for c, o in row.items()} for m, row in results.items()},
           "kfac": kfac_rows, "timing": times}
    write_results(args.out, "model_zoo", doc, table(results, configs, kfac_rows, times, header))


if __name__ == "__main__":
    main()
