"""``torch.compile`` of a parallelized model against the same model run eagerly, on CPU (inductor).

The wide ResNet of ``end_to_end.py`` (``distconv.models.wide_resnet_mini``), sample-parallel and
with a channel-parallel stage, on one rank and on 2 gloo ranks (one thread each): full training
steps (forward, backward with every gradient complete, SGD with momentum) of ``pmodel`` and of
``torch.compile(pmodel)``, interleaved step by step after a warm-up that compiles; the slowest
rank's step, medians, and the first (compiling) step's time. The collectives, conversions and
distributed layers are graph breaks; what compiles is the local computation between them.

Writes ``benchmarks/results/compile.{json,md}``.

    .venv/bin/python benchmarks/compile.py [--steps 20]
"""

from __future__ import annotations

import argparse
import copy
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

from distconv import parallelize  # noqa: E402
from distconv.data import sample_block  # noqa: E402
from distconv.models import wide_resnet_mini  # noqa: E402
from distconv.testing import WorkerPool  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
SHAPE = (8, 3, 32, 32)


def configs(P: int) -> dict[str, Any]:
    sample = {"grid": {"N": P}, "algorithm": "sample"}
    out = {"sample": {"default": sample}}
    if P > 1:
        out["hybrid"] = {"default": sample, "layers": [
            {"match": "layer3*", "grid": {"C": P}, "algorithm": "stationary-x"}]}
    return out


def bench(comm: Any, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = wide_resnet_mini()
    x, y = torch.randn(SHAPE), torch.randint(0, 10, (SHAPE[0],))
    res: dict[str, Any] = {}
    for name, config in configs(comm.size).items():
        sides = {}
        for side in ("eager", "compiled"):
            pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
            net = torch.compile(pmodel) if side == "compiled" else pmodel
            opt = torch.optim.SGD(pmodel.parameters(), lr=0.01, momentum=0.9)
            rows = sample_block(SHAPE[0], pmodel.data_grid)
            sides[side] = (net, opt, rows)

        def step(side: str) -> float:
            net, opt, rows = sides[side]
            comm.barrier()
            t = time.perf_counter()
            F.cross_entropy(net(x[rows]), y[rows]).backward()
            opt.step()
            opt.zero_grad()
            return time.perf_counter() - t

        first = {s: step(s) for s in sides}
        step("compiled")  # a recompile for the second call's guards, if any
        times: dict[str, list[float]] = {s: [] for s in sides}
        for _ in range(steps):
            for s in sides:
                times[s].append(step(s))
        res[name] = {"first": first, "times": times}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    rows, out = [], {}
    for P in (1, 2):
        with WorkerPool("gloo", P, timeout=600.0, task_timeout=3600.0) as pool:
            per_rank = pool.run(bench, args.steps)
        for name in per_rank[0]:
            slow = {s: [max(r[name]["times"][s][i] for r in per_rank)
                        for i in range(args.steps)] for s in ("eager", "compiled")}
            med = {s: statistics.median(v) for s, v in slow.items()}
            first = {s: max(r[name]["first"][s] for r in per_rank) for s in med}
            out[f"{P} rank(s), {name}"] = {"median_s": med, "first_step_s": first}
            rows.append(f"| {P} | {name} | {med['eager'] * 1e3:.1f} | "
                        f"{med['compiled'] * 1e3:.1f} | {med['compiled'] / med['eager']:.2f} | "
                        f"{first['compiled']:.1f} |")
    md = ["# torch.compile vs eager, training step of wide_resnet_mini, batch "
          f"{SHAPE[0]}, CPU, median of {args.steps}", "",
          "| ranks | config | eager ms | compiled ms | compiled / eager | first compiled "
          "step s |", "|---|---|---|---|---|---|", *rows]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "compile.json").write_text(json.dumps(out, indent=1))
    (OUT / "compile.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
