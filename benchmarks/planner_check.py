"""The planner's config against hand-written configs, measured on this machine.

For a WRN-style model (``distconv.models.wide_resnet_mini``), each backend (gloo, MPI) and world
size (2, 4 ranks, one thread each): calibrate the machine (:func:`distconv.machines.calibrate`),
plan with :func:`distconv.planner.plan_network`, and time one training step (forward, loss,
backward, SGD step; slowest rank, median of interleaved repeats) of the planner's config and of
every hand-written config, next to the planner's predicted step time (:func:`predict`).

Writes ``benchmarks/results/planner_check.{json,md}``.

    .venv/bin/python benchmarks/planner_check.py [--repeats 5] [--backends gloo mpi]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
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

OUT = ROOT / "benchmarks" / "results"
SHAPE = (16, 3, 32, 32)


def hand_configs(P: int) -> dict[str, dict[str, Any]]:
    sample = {"grid": {"N": P}, "algorithm": "sample"}
    half = {"N": P // 2}
    out = {
        "sample": {"default": sample, "layers": []},
        f"x C{P}": {"default": sample, "layers": [
            {"match": "layer*", "grid": {"C": P}, "algorithm": "stationary-x"}]},
        "spatial": {"default": {"grid": {**half, "H": 2}, "algorithm": "spatial"}, "layers": []},
        "x N×C2": {"default": sample, "layers": [
            {"match": "layer*", "grid": {**half, "C": 2}, "algorithm": "stationary-x"}]},
    }
    if P == 4:
        out["w C2×F2"] = {"default": sample, "layers": [
            {"match": "layer*", "grid": {"C": 2, "F": 2}, "algorithm": "stationary-w"}]}
    return out


def bench(comm: Any, repeats: int) -> dict[str, Any]:
    from distconv.data import sample_block
    from distconv.grid import ProcessorGrid
    from distconv.machines import calibrate
    from distconv.models import wide_resnet_mini
    from distconv.parallel import parallelize
    from distconv.planner import plan_network, predict

    torch.set_num_threads(1)
    P = comm.size
    machine = calibrate(comm, sizes=(1, 1 << 16), repeats=3)
    torch.manual_seed(0)
    model = wide_resnet_mini(num_classes=10, base=8, widen=2)
    plan = plan_network(model, SHAPE, world_size=P, machine=machine, max_model=P)
    configs = {"planner": plan.config(), **hand_configs(P)}
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(SHAPE, generator=g), torch.randint(0, 10, (SHAPE[0],), generator=g)
    block = sample_block(SHAPE[0], ProcessorGrid({"N": P}, comm=comm))
    xl, yl = x[block], y[block]
    runs, rows = {}, {}
    same = [k for k in hand_configs(P) if configs[k] == configs["planner"]]
    if same:  # the planner's config is a hand config: one model, timed once, reported for both
        configs.pop("planner")
    for label, cfg in configs.items():
        try:
            pm = parallelize(copy.deepcopy(model), cfg, comm=comm)
        except (ValueError, NotImplementedError) as exc:
            rows[label] = {"error": str(exc).splitlines()[0]}
            continue
        runs[label] = (pm, torch.optim.SGD(pm.parameters(), lr=0.01, momentum=0.9))
        rows[label] = {"predicted": predict(model, cfg, SHAPE, world_size=P,
                                            machine=machine).step_time, "times": []}
    order = list(runs)
    for rep in range(repeats + 1):  # the first round warms up; the order rotates each round
        for label in order[rep % len(order):] + order[:rep % len(order)]:
            pm, opt = runs[label]
            comm.barrier()
            t0 = time.perf_counter()
            F.cross_entropy(pm(xl), yl).backward()
            opt.step()
            opt.zero_grad()
            comm.barrier()
            if rep:
                rows[label]["times"].append(time.perf_counter() - t0)
    for row in rows.values():
        if "times" in row:
            row["measured"] = statistics.median(row.pop("times"))
    if same:
        rows = {"planner": {**rows[same[0]], "same_as": same[0]}, **rows}
        configs["planner"] = configs[same[0]]
    return {"rows": rows, "plan": plan.explain(), "config": plan.config(),
            "configs": configs, "machine": repr(machine)}



def main() -> None:
    from distconv.testing import WorkerPool

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backends", nargs="+", default=["gloo", "mpi"], choices=["gloo", "mpi"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    results = []
    for backend in args.backends:
        if backend == "mpi" and importlib.util.find_spec("mpi4py") is None:
            print("mpi skipped: mpi4py is not installed", file=sys.stderr)
            continue
        for size in args.ranks:
            with WorkerPool(backend=backend, size=size, task_timeout=1800) as pool:
                res = pool.run(bench, args.repeats)[0]
            res.update(backend=backend, size=size)
            results.append(res)
            print(f"{backend} {size} done", file=sys.stderr, flush=True)
    md = ["# Planner vs hand-written configs, measured here (one training step, ms)", "",
          f"Model `wide_resnet_mini(base=8, widen=2)`, input {SHAPE}; "
          f"command: `{' '.join(sys.argv)}`", "",
          "| backend | ranks | config | predicted | measured | vs fastest measured |",
          "|---|---|---|---|---|---|"]
    for res in results:
        ok = {k: r for k, r in res["rows"].items() if "measured" in r}
        fastest = min(r["measured"] for r in ok.values())
        for label, r in res["rows"].items():
            if label == "planner" and "same_as" in r:
                label = f"planner (= {r['same_as']}, the same run)"
            if "error" in r:
                md.append(f"| {res['backend']} | {res['size']} | {label} | - | - | {r['error']} |")
                continue
            md.append(f"| {res['backend']} | {res['size']} | {label} | "
                      f"{r['predicted'] * 1e3:.1f} | {r['measured'] * 1e3:.1f} | "
                      f"{r['measured'] / fastest:.2f}x |")
        pl = ok.get("planner")
        verdict = ("within 5% of the fastest" if pl and pl["measured"] <= 1.05 * fastest
                   else "NOT within 5% of the fastest")
        md.append(f"| {res['backend']} | {res['size']} | **planner: {verdict}** | | | |")
    md += [""] + [f"### {r['backend']}, {r['size']} ranks: the plan\n\n```\n{r['plan']}\n```\n"
                  for r in results]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "planner_check.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "planner_check.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
