"""Training steps of 3-D networks split over samples, space and channels: a 3-D U-Net and a
CosmoFlow-style CNN on 2 and 4 ranks (gloo, MPI).

Sides, interleaved step by step (forward, loss, backward; slowest rank; medians):

* ``one process``: rank 0 trains the global batch alone, the others wait;
* ``sample``: ``{N: P}``, ``--per-rank`` samples per rank (default 2: torch's CPU convolutions
  of a single 3-D sample take longer than of two, so one sample per rank would measure that);
* ``spatial``: every layer over depth (``{D: P}``; 4 ranks ``{D: 2, H: 2}``), the batch whole;
* ``hybrid``: spatial, the deepest convolutions over channels and depth (``{C: 2, D: P/2}``).

Per side: the step time against one process and against sample parallelism; the activation
memory per rank -- the bytes of the tensors autograd keeps for backward (distinct storages,
parameters left out), the most any rank keeps -- against one process's (target for spatial: at
most 1/P + 10%); and whether the bytes each rank's communicator counted equal ``explain``'s.

Writes ``benchmarks/results/volumes.{json,md,png}`` (the plot: activation memory per rank
against one process, with the target) and prints the table.

    .venv/bin/python benchmarks/volumes.py                  # ~6 min
    .venv/bin/python benchmarks/volumes.py --quick          # a smoke run
"""

from __future__ import annotations

import argparse
import copy
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

from benchmarks._paired import command_line, slowest, write_results  # noqa: E402
from distconv import explain, models, parallelize  # noqa: E402
from distconv.data import sample_block  # noqa: E402

#: name -> (builder, input shape after the batch, target kind, the layers the hybrid splits)
NETWORKS = {
    "unet3d": (lambda: models.unet3d(in_channels=1, base=8, depth=2), (1, 32, 32, 32),
               "voxels", ("bottom.0", "bottom.3")),
    "cosmoflow": (lambda: models.cosmoflow_mini(in_channels=4, base=8, depth=3, size=32,
                                                hidden=32), (4, 32, 32, 32), "values",
                  ("features.8",)),
}


def configs(ranks: int, deep: tuple[str, ...]) -> dict[str, dict]:
    space = {"D": ranks} if ranks == 2 else {"D": 2, "H": ranks // 2}
    spatial = {"default": {"grid": space, "algorithm": "spatial"}, "data": {"N": 1, **space}}
    hybrid = copy.deepcopy(spatial)
    hybrid["layers"] = [{"match": n, "grid": {"C": 2, "D": ranks // 2},
                         "algorithm": "stationary-x"} for n in deep]
    return {"sample": {"default": {"grid": {"N": ranks}, "algorithm": "sample"}},
            "spatial": spatial, "hybrid": hybrid}


def _loss(out: torch.Tensor, y: torch.Tensor, kind: str) -> torch.Tensor:
    return F.mse_loss(out, y) if kind == "values" else F.cross_entropy(out, y)


class _Kept:
    """The bytes of the tensors autograd saves for backward during a forward: distinct
    storages, the model's parameters left out."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in self.params:
            self.seen[s.data_ptr()] = s.nbytes()
        return t

    def total(self) -> int:
        return sum(self.seen.values())


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, kind: str,
          kept: _Kept | None = None) -> float:
    t0 = time.perf_counter()
    if kept is None:
        loss = _loss(model(x), y, kind)
    else:
        with torch.autograd.graph.saved_tensors_hooks(kept.pack, lambda t: t):
            loss = _loss(model(x), y, kind)
    loss.backward()
    elapsed = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return elapsed


def bench(comm: Any, jobs: list[tuple[str, int]], repeats: int,
          explained: dict[str, Any]) -> list[dict]:
    torch.set_num_threads(1)
    out = []
    for name, batch in jobs:
        make, shape, kind, deep = NETWORKS[name]
        torch.manual_seed(0)
        model = make()
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(batch, *shape, generator=gen)
        with torch.no_grad():
            out_shape = tuple(copy.deepcopy(model).eval()(x).shape)
        y = (torch.randn(out_shape, generator=gen) if kind == "values" else
             torch.randint(0, out_shape[1], (batch, *out_shape[2:]), generator=gen))
        sides: dict[str, Any] = {}
        rows: dict[str, Any] = {}
        for side, config in configs(comm.size, deep).items():
            pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
            rows[side] = sample_block(batch, pmodel.data_grid)
            sides[side] = pmodel
        one = copy.deepcopy(model)
        kept, counted = {}, {}
        for side, pmodel in sides.items():  # warm-up, memory and bytes
            r = rows[side]
            _step(pmodel, x[r], y[r], kind)
            k = _Kept(pmodel)
            comm.stats.reset()
            _step(pmodel, x[r], y[r], kind, k)
            counted[side] = comm.stats.total_bytes()
            kept[side] = k.total()
        k = _Kept(one)
        _step(one, x, y, kind, k)
        kept["one process"] = k.total()
        times: dict[str, list[float]] = {s: [] for s in ("one process", *sides)}
        for _ in range(repeats):
            for side in times:
                comm.barrier()
                if side == "one process":
                    t = _step(one, x, y, kind) if comm.rank == 0 else 0.0
                else:
                    t = _step(sides[side], x[rows[side]], y[rows[side]], kind)
                times[side].append(t)
        keys = list(times)
        per = slowest(comm, times)
        most = comm.allreduce(torch.tensor([kept[s] for s in keys], dtype=torch.float64),
                              op="max")
        equal = comm.allreduce(torch.tensor(
            [float(counted[s] == explained[f"{name}/{batch}/{s}"][comm.rank]) for s in sides]),
            op="min")
        row: dict[str, Any] = {"network": name, "ranks": comm.size, "batch": batch,
                               "input": list(shape)}
        for i, s in enumerate(keys):
            row[s] = {"step_s": statistics.median(per[s]),
                      "vs_one": statistics.median(a / b for a, b in zip(per[s],
                                                                         per["one process"])),
                      "activations_B": int(most[i]),
                      "activation_share": float(most[i] / most[0])}
            if s != "one process":
                row[s]["vs_sample"] = statistics.median(
                    a / b for a, b in zip(per[s], per["sample"]))
                row[s]["bytes_equal_explain"] = bool(equal[list(sides).index(s)])
        out.append(row)
    return out


def _explained(jobs: list[tuple[str, int]], ranks: int) -> dict[str, list[int]]:
    """Per network, batch and side: each rank's bytes (forward + backward) by ``explain``."""
    out = {}
    for name, batch in jobs:
        make, shape, _, deep = NETWORKS[name]
        torch.manual_seed(0)
        model = make()
        for side, config in configs(ranks, deep).items():
            plan = explain(model, config, (batch, *shape), world_size=ranks, itemsize=4)
            out[f"{name}/{batch}/{side}"] = [sum(plan.rank_bytes(r).values())
                                             for r in range(ranks)]
    return out


def _markdown(results: dict) -> str:
    lines = [f"`{results['command']}` ({results['host']}, 1 thread per rank, medians of "
             f"{results['repeats']} interleaved steps; times are ratios against one process and "
             "sample parallelism; activations: the most any rank keeps for backward, as a share "
             "of one process's; target for spatial: <= 1/P + 0.10)", "",
             "| backend | network | ranks | batch | side | step ms | vs one process | vs sample "
             "| activations MB | share | bytes = explain |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for backend, rows in results["rows"].items():
        for r in rows:
            for side in ("one process", "sample", "spatial", "hybrid"):
                c = r[side]
                lines.append(
                    f"| {backend} | {r['network']} {tuple(r['input'])} | {r['ranks']} | "
                    f"{r['batch']} | {side} | {1e3 * c['step_s']:.0f} | {c['vs_one']:.2f} | "
                    f"{c.get('vs_sample', float('nan')):.2f} | "
                    f"{c['activations_B'] / 2**20:.1f} | {c['activation_share']:.3f} | "
                    f"{c.get('bytes_equal_explain', '-')} |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """Activation memory per rank against one process, per network, world and side, with the
    target line 1/P + 0.10 of the spatial side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(b, r) for b, rs in results["rows"].items() for r in rs]
    fig, ax = plt.subplots(figsize=(max(6.4, 0.9 * len(rows)), 4.2), layout="constrained")
    sides, width = ("sample", "spatial", "hybrid"), 0.27
    for i, side in enumerate(sides):
        ax.bar([x + (i - 1) * width for x in range(len(rows))],
               [r[side]["activation_share"] for _, r in rows], width, label=side)
    for x, (_, r) in enumerate(rows):
        target = 1 / r["ranks"] + 0.10
        ax.plot([x - 1.5 * width, x + 1.5 * width], [target, target], "k--", lw=1,
                label="target 1/P + 0.10" if x == 0 else None)
    ax.set_xticks(range(len(rows)), [f"{b} {r['network']} P={r['ranks']}" for b, r in rows],
                  rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("activations kept per rank / one process's")
    ax.set_title("3-D networks: activation memory per rank")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    from tqdm import tqdm

    from distconv.testing import WorkerPool

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=["gloo", "mpi"], choices=["gloo", "mpi"])
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4], choices=[2, 4])
    p.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--per-rank", type=int, default=2, help="samples per rank (global batch: P×)")
    p.add_argument("--quick", action="store_true", help="the U-Net, 2 ranks, gloo, 2 repeats")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.backends, args.ranks, args.networks, args.repeats = ["gloo"], [2], ["unet3d"], 2
    results: dict[str, Any] = {"host": f"{os.cpu_count()} cores", "repeats": args.repeats,
                               "command": command_line("volumes.py", argv), "rows": {}}
    worlds = [(b, r) for b in args.backends for r in args.ranks]
    for backend, ranks in tqdm(worlds, desc="worlds"):
        jobs = [(n, ranks * args.per_rank) for n in args.networks]
        explained = _explained(jobs, ranks)
        with WorkerPool(backend=backend, size=ranks, task_timeout=3600) as pool:
            rows = pool.run(bench, jobs, args.repeats, explained)[0]
        results["rows"].setdefault(backend, []).extend(rows)
    write_results(args.out, "volumes", results, _markdown(results))
    plot(results, args.out / "volumes.png")
    return results


if __name__ == "__main__":
    main()
