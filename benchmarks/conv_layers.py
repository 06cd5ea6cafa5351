"""DistConv2d on representative ResNet-50 layers and a wide layer, after Dryden et al. Fig. 5.

For every layer, batch size, backend (gloo, MPI) and world size (1, 2, 4 ranks, one thread each)
it measures the forward and backward time of every algorithm and grid (slowest rank, median of
the repeats) next to the §4 model's time (alpha, beta and FLOP rate calibrated in the same world),
the bytes each rank receives next to the model's exact prediction, and the parameter memory per
rank. On one rank it interleaves ``nn.Conv2d``, ``DistConv2d`` and ``nn.Conv2d`` with two intra-op
threads (1-rank overhead; what threading alone gives). On two ranks, for the wide layer, every
repeat also runs the whole layer on one rank (one and two threads) and each rank's share with no
communication (the speedup the machine's cores can deliver), so speedups are paired ratios of one
run.

Writes ``benchmarks/results/conv_layers.{json,md,png}`` and prints the markdown table.

    .venv/bin/python benchmarks/conv_layers.py                      # the full run (~3 min)
    .venv/bin/python benchmarks/conv_layers.py --quick              # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from distconv.grid import ProcessorGrid  # noqa: E402
from distconv.nn import DistConv2d  # noqa: E402
from distconv.perfmodel import ConvProblem, calibrate, conv_cost, conv_traffic  # noqa: E402

#: name -> (channels, height/width, kernel). conv_3 and conv_5 are ResNet-50's 3x3 layers of
#: stages 3 and 5; "wide" is a WRN-50-4-like stage-4 3x3 layer scaled to 512 channels.
LAYERS = {"conv_3": (128, 28, 3), "conv_5": (512, 7, 3), "wide": (512, 14, 3)}

#: world size -> [(label, grid, algorithm)]
CONFIGS = {
    1: [("1 rank", {"N": 1}, "stationary-x")],
    2: [
        ("sample N=2", {"N": 2}, "stationary-x"),
        ("stationary-x C=2", {"C": 2}, "stationary-x"),
        ("stationary-y F=2", {"F": 2}, "stationary-y"),
    ],
    4: [
        ("sample N=4", {"N": 4}, "stationary-x"),
        ("stationary-x C=4", {"C": 4}, "stationary-x"),
        ("stationary-y F=4", {"F": 4}, "stationary-y"),
        ("stationary-w C=2 F=2", {"C": 2, "F": 2}, "stationary-w"),
        ("hybrid N=2 C=2", {"N": 2, "C": 2}, "stationary-x"),
        ("spatial H=2 W=2", {"H": 2, "W": 2}, "stationary-x"),
    ],
}


def _problem(layer: str, batch: int) -> ConvProblem:
    ch, hw, k = LAYERS[layer]
    return ConvProblem(batch, ch, ch, hw, hw, k, padding=k // 2, bias=False)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


# --------------------------------------------------------------------------- run on every rank
def _fwd_bwd(
    module: nn.Module, x: torch.Tensor, g: torch.Tensor, *args: Any
) -> tuple[float, float]:
    t0 = time.perf_counter()
    y = module(x, *args)
    t1 = time.perf_counter()
    y.backward(g)
    t2 = time.perf_counter()
    x.grad = None
    module.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1


def _baseline(comm: Any, pb: ConvProblem, estimate: float, threads: int) -> float:
    """Rank 0 runs the whole layer as ``nn.Conv2d`` with ``threads`` threads; the other ranks
    sleep meanwhile (so an MPI rank does not busy-poll a core) and wait at a barrier."""
    elapsed = math.nan
    if comm.rank == 0:
        torch.set_num_threads(threads)
        elapsed = sum(_fwd_bwd(*_baseline_tensors(pb)))
        torch.set_num_threads(1)
    else:
        time.sleep(1.3 * estimate)
    comm.barrier()
    return elapsed


def _profile(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, shape: tuple) -> str:
    """The operator profile of one forward + backward on this rank (self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _fwd_bwd(layer, x, g, shape)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def _ideal(comm: Any, pb: ConvProblem) -> float:
    """Every rank at once runs its 1/P share of the layer's work (a local conv on
    ``ceil(C / P)`` input channels, no communication): the time an ideal P-rank run would take
    on this machine, so ``baseline / ideal`` is the speedup the cores actually deliver."""
    share = ConvProblem(pb.batch, -(-pb.in_channels // comm.size), pb.out_channels, pb.height,
                        pb.width, pb.kernel_size, padding=pb.padding, bias=False)
    comm.barrier()
    elapsed = sum(_fwd_bwd(*_baseline_tensors(share)))
    comm.barrier()
    return elapsed


_BASELINE: dict[tuple, tuple] = {}


def _baseline_tensors(pb: ConvProblem) -> tuple:
    key = (pb.batch, pb.in_channels, pb.out_channels, pb.height)
    if key not in _BASELINE:
        if len(_BASELINE) > 2:
            _BASELINE.clear()
        torch.manual_seed(0)
        conv = nn.Conv2d(pb.in_channels, pb.out_channels, pb.kernel_size, padding=pb.padding,
                         bias=False)
        x = torch.randn(pb.batch, pb.in_channels, pb.height, pb.width).requires_grad_(True)
        g = torch.randn(pb.batch, pb.out_channels, pb.height, pb.width)
        _BASELINE[key] = (conv, x, g)
    return _BASELINE[key]


def bench_world(
    comm: Any, jobs: list[tuple[str, int, str, dict, str]], repeats: int,
    baseline_layers: list[str],
) -> list[dict]:
    """Time each (layer, batch, label, grid, algorithm) job on this world; rank results.

    For the layers in ``baseline_layers``, every repeat also runs the whole layer on rank 0 alone
    with one and with two threads, interleaved with the distributed run, so each speedup is a
    median of paired ratios from one run.
    """
    torch.set_num_threads(1)
    machine = calibrate(comm)
    out = []
    for layer_name, batch, label, grid_dims, algorithm in jobs:
        pb = _problem(layer_name, batch)
        baseline = layer_name in baseline_layers
        if batch < grid_dims.get("N", 1):
            out.append({"layer": layer_name, "batch": batch, "config": label, "skipped":
                        f"batch {batch} < N={grid_dims['N']}"})
            continue
        grid = ProcessorGrid(grid_dims, comm=comm)
        layer = DistConv2d(pb.in_channels, pb.out_channels, pb.kernel_size, padding=pb.padding,
                           bias=False, grid=grid, algorithm=algorithm, init_seed=0)
        shape = (batch, pb.in_channels, pb.height, pb.width)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(layer.local_input_shape(shape), generator=gen).requires_grad_(True)
        y_shape = layer.output_shape(shape)
        g = torch.randn(layer.output_dist.local_shape(y_shape, grid), generator=gen)
        _fwd_bwd(layer, x, g, shape)  # warm-up
        comm.stats.reset()
        _fwd_bwd(layer, x, g, shape)
        counted = comm.stats.total_bytes()
        model = conv_traffic(pb, grid.layout, algorithm, grid.coords)
        estimate = 0.0
        if baseline:
            first = torch.tensor([_baseline(comm, pb, 1.0, 1)], dtype=torch.float64)
            estimate = float(comm.allreduce(first.nan_to_num(0.0), op="max"))
        fwd, bwd, base1, base2, ideal = [], [], [], [], []
        for _ in range(repeats):
            if baseline:
                base1.append(_baseline(comm, pb, estimate, 1))
                base2.append(_baseline(comm, pb, estimate, 2))
                ideal.append(_ideal(comm, pb))
            comm.barrier()
            f, b = _fwd_bwd(layer, x, g, shape)
            fwd.append(f)
            bwd.append(b)
        if baseline and batch == min(b for _, b, *_ in jobs) and label.startswith("stationary-x"):
            row_profile = _profile(layer, x, g, shape)
        else:
            row_profile = None
        # slowest rank per repeat, then medians (and median of the paired speedups)
        per = torch.tensor([fwd, bwd], dtype=torch.float64)
        if comm.size > 1:
            per = comm.allreduce(per, op="max")
        total = (per[0] + per[1]).tolist()
        row = {
            "layer": layer_name, "batch": batch, "config": label, "grid": grid_dims,
            "algorithm": algorithm, "ranks": comm.size, "forward_s": _median(per[0].tolist()),
            "backward_s": _median(per[1].tolist()), "bytes_counted": counted,
            "bytes_model": model.forward_bytes + model.backward_bytes,
            "bytes_forward_model": model.forward_bytes,
            "bytes_backward_model": model.backward_bytes,
            "param_bytes": sum(p.numel() * p.element_size() for p in layer.parameters()),
            "model_s": conv_cost(pb, grid_dims, algorithm, machine).total,
        }
        if row_profile is not None and comm.rank == 0:
            row["profile_rank0"] = row_profile
        if baseline:
            b1 = torch.tensor(base1 if comm.rank == 0 else [0.0] * repeats, dtype=torch.float64)
            b2 = torch.tensor(base2 if comm.rank == 0 else [0.0] * repeats, dtype=torch.float64)
            b1, b2 = (comm.allreduce(b, op="max").tolist() for b in (b1, b2))
            row["baseline_1thread_s"] = _median(b1)
            row["baseline_2threads_s"] = _median(b2)
            ideal_max = comm.allreduce(torch.tensor(ideal, dtype=torch.float64), op="max").tolist()
            row["ideal_s"] = _median(ideal_max)
            row["speedup"] = _median([a / t for a, t in zip(b1, total)])
            row["speedup_2threads"] = _median([a / t for a, t in zip(b1, b2)])
            row["speedup_ideal"] = _median([a / t for a, t in zip(b1, ideal_max)])
        out.append(row)
    return out


def bench_one_rank(comm: Any, jobs: list[tuple[str, int]], repeats: int) -> list[dict]:
    """Interleave nn.Conv2d (1 thread), DistConv2d (1 thread), nn.Conv2d (2 threads)."""
    grid = ProcessorGrid({"N": 1}, comm=comm)
    out = []
    for layer_name, batch in jobs:
        pb = _problem(layer_name, batch)
        torch.manual_seed(0)
        conv = nn.Conv2d(pb.in_channels, pb.out_channels, pb.kernel_size, padding=pb.padding,
                         bias=False)
        dist = DistConv2d.from_conv2d(conv, grid=grid, algorithm="stationary-x")
        x = torch.randn(batch, pb.in_channels, pb.height, pb.width).requires_grad_(True)
        g = torch.randn(batch, pb.out_channels, pb.height, pb.width)
        variants = [("nn.Conv2d 1 thread", conv, 1), ("DistConv2d 1 rank", dist, 1),
                    ("nn.Conv2d 2 threads", conv, 2)]
        times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
        for rep in range(repeats + 1):
            # rotate the order so that no variant always follows the 2-thread run
            for name, module, threads in variants[rep % 3:] + variants[:rep % 3]:
                torch.set_num_threads(threads)
                t0 = time.perf_counter()
                module(x).backward(g)
                elapsed = time.perf_counter() - t0
                if rep:
                    times[name].append(elapsed)
                x.grad = None
                module.zero_grad(set_to_none=True)
        torch.set_num_threads(1)
        base = times["nn.Conv2d 1 thread"]
        for name, _, _ in variants:
            out.append({"layer": layer_name, "batch": batch, "config": name,
                        "fwd_bwd_s": _median(times[name]),
                        "ratio_to_nn": _median([t / b for t, b in zip(times[name], base)])})
    return out


# --------------------------------------------------------------------------- driver
def _markdown(results: dict) -> str:
    lines = [
        f"DistConv2d benchmark — {results['host']}, torch {torch.__version__}, one thread per "
        "rank; times are the slowest rank's median; bytes received per rank (max over ranks), "
        "counted by the communicators and predicted by `distconv.perfmodel`.", "",
        "| backend | layer | N | config | ranks | fwd ms | bwd ms | fwd+bwd ms | model ms | "
        "bytes/rank (counted) | bytes/rank (model) | params/rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for backend, rows in results["multi"].items():
        for r in rows:
            if "skipped" in r:
                lines.append(f"| {backend} | {r['layer']} | {r['batch']} | {r['config']} | | "
                             f"{r['skipped']} | | | | | | |")
                continue
            lines.append(
                f"| {backend} | {r['layer']} | {r['batch']} | {r['config']} | {r['ranks']} | "
                f"{1e3 * r['forward_s']:.2f} | {1e3 * r['backward_s']:.2f} | "
                f"{1e3 * (r['forward_s'] + r['backward_s']):.2f} | {1e3 * r['model_s']:.2f} | "
                f"{r['bytes_counted']:,} | "
                f"{r['bytes_model']:,} | {r['param_bytes']:,} |")
    lines += ["", "One rank, interleaved (forward + backward, ms):", "",
              "| backend | layer | N | nn.Conv2d 1 thread | DistConv2d 1 rank | "
              "overhead (paired) | "
              "nn.Conv2d 2 threads |", "|---|---|---|---|---|---|---|"]
    for backend, rows in results["one_rank"].items():
        by, ratios = {}, {}
        for r in rows:
            by.setdefault((r["layer"], r["batch"]), {})[r["config"]] = r["fwd_bwd_s"]
            if r["config"] == "DistConv2d 1 rank":
                ratios[(r["layer"], r["batch"])] = r["ratio_to_nn"]
        for (layer, batch), t in by.items():
            base, dist, two = (t["nn.Conv2d 1 thread"], t["DistConv2d 1 rank"],
                               t["nn.Conv2d 2 threads"])
            lines.append(f"| {backend} | {layer} | {batch} | {1e3 * base:.2f} | {1e3 * dist:.2f} | "
                         f"{100 * (ratios[(layer, batch)] - 1):+.1f}% | {1e3 * two:.2f} |")
    lines += ["", "Targets (ratios from this run):", ""]
    for item in results["targets"]:
        lines.append(f"- {item}")
    return "\n".join(lines)


def _targets(results: dict, wide: str) -> list[str]:
    out = []
    for backend in results["one_rank"]:
        for r in results["one_rank"][backend]:
            if r["config"] == "DistConv2d 1 rank":
                out.append(f"{backend} {r['layer']} N={r['batch']}: 1-rank DistConv2d / nn.Conv2d "
                           f"= {r['ratio_to_nn']:.3f} (median of paired ratios; target <= 1.03)")
        goal = 1.8 if backend == "mpi" else 1.6
        rows = {(r["layer"], r["batch"], r["config"]): r for r in results["multi"][backend]}
        for batch in results["batches"]:
            sx = rows.get((wide, batch, "stationary-x C=2"))
            if sx is None or "speedup" not in sx:
                continue
            line = (f"{backend} {wide} N={batch}: speedup over 1 rank x 1 thread: 2 ranks x 1 "
                    f"thread stationary-x {sx['speedup']:.2f}x (target >= {goal}x; the machine's "
                    f"ceiling, both ranks computing their share with no communication: "
                    f"{sx['speedup_ideal']:.2f}x), 1 rank x 2 threads "
                    f"{sx['speedup_2threads']:.2f}x")
            sy = rows.get((wide, batch, "stationary-y F=2"))
            if sy is not None and "speedup" in sy:
                line += f", stationary-y {sy['speedup']:.2f}x"
            sn = rows.get((wide, batch, "sample N=2"))
            if sn is not None and "speedup" in sn:
                best = max(sx["speedup"], sy["speedup"] if sy else 0.0)
                line += (f", sample N=2 {sn['speedup']:.2f}x -> channel/filter "
                         f"{'faster' if best > sn['speedup'] else 'NOT faster'} than sample")
            else:
                line += ", sample parallelism cannot split a batch of 1 over 2 ranks (1.00x)"
            out.append(line)
    return out


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(results["layers"])
    batches = results["batches"]
    fig, axes = plt.subplots(len(batches), len(layers), figsize=(5 * len(layers),
                                                                 3.6 * len(batches)),
                             squeeze=False)
    families = {"sample": "sample", "stationary-x": "stationary-x", "stationary-y": "stationary-y",
                "stationary-w": "stationary-w", "hybrid": "hybrid N×C", "spatial": "spatial H×W"}
    colors = dict(zip(families, ["tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:purple",
                                 "tab:red"]))
    for i, batch in enumerate(batches):
        for j, layer in enumerate(layers):
            ax = axes[i][j]
            for backend, rows in results["multi"].items():
                style = "-" if backend == "mpi" else "--"
                ones = [r for r in results["one_rank"][backend]
                        if r["layer"] == layer and r["batch"] == batch
                        and r["config"] == "nn.Conv2d 1 thread"]
                base = ones[0]["fwd_bwd_s"] if ones else math.nan
                for key, label in families.items():
                    pts = sorted((r["ranks"], 1e3 * (r["forward_s"] + r["backward_s"]))
                                 for r in rows if "skipped" not in r and r["layer"] == layer
                                 and r["batch"] == batch and r["config"].startswith(key))
                    if pts:
                        pts = [(1, 1e3 * base)] + pts if key != "hybrid" else pts
                        ax.plot(*zip(*pts), style, marker="o", color=colors[key],
                                label=f"{label} ({backend})")
            ax.set_title(f"{layer}, N={batch}")
            ax.set_xlabel("ranks")
            ax.set_ylabel("fwd+bwd ms")
            ax.set_xticks([1, 2, 4])
            ax.set_yscale("log")
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines()}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=6, fontsize=7)
    fig.suptitle("DistConv2d forward + backward (solid: MPI, dashed: gloo; 1 rank = nn.Conv2d)")
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    from distconv.testing import WorkerPool

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=["gloo", "mpi"], choices=["gloo", "mpi"])
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4], choices=[2, 4])
    p.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="one layer, batch 2, 2 repeats")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--replot", action="store_true",
                   help="rewrite the table and plot from the JSON of the last run")
    args = p.parse_args(argv)
    if args.replot:
        results = json.loads((args.out / "conv_layers.json").read_text())
        _write(results, args.out)
        return results
    if args.quick:
        args.layers, args.batches, args.repeats = ["conv_5"], [2], 2
    wide = "wide"
    results: dict[str, Any] = {
        "host": f"{os.cpu_count()} cores", "layers": args.layers, "batches": args.batches,
        "repeats": args.repeats, "multi": {}, "one_rank": {}, "command": " ".join(sys.argv),
    }
    one_jobs = [(layer, b) for layer in args.layers for b in args.batches]
    for backend in args.backends:
        results["multi"][backend] = []
        with WorkerPool(backend=backend, size=1, task_timeout=1800) as pool:
            # paired ratios of a few percent need more repeats than the multi-rank timings
            results["one_rank"][backend] = pool.run(bench_one_rank, one_jobs,
                                                    3 * args.repeats)[0]
        for size in args.ranks:
            jobs = [(layer, b, label, g, alg) for layer in args.layers for b in args.batches
                    for label, g, alg in CONFIGS[size]]
            with WorkerPool(backend=backend, size=size, task_timeout=1800) as pool:
                per_rank = pool.run(bench_world, jobs, args.repeats,
                                    [wide] if size == 2 else [])
            for j, row in enumerate(per_rank[0]):
                if "skipped" not in row:
                    row["bytes_counted"] = max(r[j]["bytes_counted"] for r in per_rank)
                    row["bytes_model"] = max(r[j]["bytes_model"] for r in per_rank)
                    row["param_bytes"] = max(r[j]["param_bytes"] for r in per_rank)
                results["multi"][backend].append(row)
        print(f"{backend} done", file=sys.stderr, flush=True)
    results["targets"] = _targets(results, wide) if wide in args.layers else []
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "conv_layers.json").write_text(json.dumps(results, indent=1))
    _write(results, args.out)
    return results


def _write(results: dict, out: Path) -> None:
    table = _markdown(results)
    (out / "conv_layers.md").write_text(table + "\n")
    _plot(results, out / "conv_layers.png")
    print(table)


if __name__ == "__main__":
    main()
