"""Whole training steps of a wide ResNet: sample parallelism against the paper's hybrids.

For gloo and MPI worlds of 2 and 4 ranks (one thread each) and 1 and 2 samples per rank, it
times full training steps (forward, backward with every gradient complete, SGD with momentum) of a
bottleneck wide ResNet under:

* ``sample``  -- ``parallelize`` with pure sample parallelism (every weight allreduced);
* ``hybrid``  -- the paper's "+spatial + x/w" idea: rows split early, channels (x) in the middle,
  channels × filters (w, or x on 2 ranks) in the widest stage;
* ``ddp``     -- ``torch.nn.parallel.DistributedDataParallel`` on gloo, for reference (plain
  per-rank BatchNorm: it does less than ours, which keeps global-batch statistics);
* ``sample, BN frozen`` / ``ddp, BN frozen`` (gloo) -- the same two with every BatchNorm in eval
  mode (a local affine map, no statistics to share), which isolates the library's own cost from
  the global-batch statistics DDP does not compute.

The variants are interleaved step by step in one world; a step's time is the slowest rank's, and
the table reports medians and ratios of the same run. Bytes per step are the communicators' counts
next to ``distconv.explain``'s; memory per rank (parameters + gradients + momentum, and
activations) is ``explain``'s, and for the model-parallel layers alone against the full layers.

Writes ``benchmarks/results/end_to_end.{json,md,png}``.

    .venv/bin/python benchmarks/end_to_end.py            # the full run (a few minutes)
    .venv/bin/python benchmarks/end_to_end.py --quick    # a smoke run
    .venv/bin/python benchmarks/end_to_end.py --profile  # where a step's time goes, vs DDP
    .venv/bin/python benchmarks/end_to_end.py --one-process --steps 30  # overhead on one rank
    python benchmarks/end_to_end.py --one-process --device cuda --steps 50  # the same on a GPU
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

from distconv import explain, parallelize  # noqa: E402
from distconv.data import sample_block  # noqa: E402
from distconv.models import wide_resnet_mini  # noqa: E402
from distconv.testing import WorkerPool  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SIZE = 32
HYBRID = {
    2: {"default": {"grid": {"N": 2}, "algorithm": "sample"}, "layers": [
        {"match": "conv1", "grid": {"H": 2}, "algorithm": "spatial"},
        {"match": "layer1.*", "grid": {"H": 2}, "algorithm": "spatial"},
        {"match": "layer2.*", "grid": {"C": 2}, "algorithm": "stationary-x"},
        {"match": "layer3.*", "grid": {"C": 2}, "algorithm": "stationary-x"}]},
    4: {"default": {"grid": {"N": 4}, "algorithm": "sample"}, "layers": [
        {"match": "conv1", "grid": {"N": 2, "H": 2}, "algorithm": "spatial"},
        {"match": "layer1.*", "grid": {"N": 2, "H": 2}, "algorithm": "spatial"},
        {"match": "layer2.*", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"},
        {"match": "layer3.*", "grid": {"C": 2, "F": 2}, "algorithm": "stationary-w"}]},
}


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return wide_resnet_mini(in_channels=3, num_classes=10, base=16, widen=4)


def sample_config(p: int) -> dict:
    return {"default": {"grid": {"N": p}, "algorithm": "sample"}}


def _variants(comm: Any, model: torch.nn.Module, backend: str) -> dict[str, torch.nn.Module]:
    p = comm.size
    out = {"sample": parallelize(model, sample_config(p), comm=comm),
           "hybrid": parallelize(model, HYBRID[p], comm=comm)}
    if backend == "gloo":
        from torch.nn.parallel import DistributedDataParallel

        out["ddp"] = DistributedDataParallel(copy.deepcopy(model), broadcast_buffers=False)
        local = dict(sample_config(p), default={**sample_config(p)["default"],
                                                "statistics": "local"})
        out["sample-local-bn"] = parallelize(model, local, comm=comm)
        out["sample-frozen-bn"] = parallelize(model, sample_config(p), comm=comm)
        out["ddp-frozen-bn"] = DistributedDataParallel(copy.deepcopy(model),
                                                       broadcast_buffers=False)
        for name in ("sample-frozen-bn", "ddp-frozen-bn"):
            for m in out[name].modules():
                if "BatchNorm" in type(m).__name__:
                    m.eval()
    return out


def measure(comm: Any, backend: str, per_rank: int, steps: int, warmup: int) -> dict[str, Any]:
    """Runs on every rank: interleaved training steps of every variant."""
    torch.set_num_threads(1)
    model = build_model()
    variants = _variants(comm, model, backend)
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for k, m in variants.items()}
    gen = torch.Generator().manual_seed(1)
    batch = per_rank * comm.size
    x = torch.randn(batch, 3, SIZE, SIZE, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    times: dict[str, list[float]] = {k: [] for k in variants}
    counted: dict[str, int] = {}
    for step in range(warmup + steps):
        for name, m in variants.items():
            rows = (slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)
                    if name.startswith("ddp") else sample_block(batch, m.data_grid))
            comm.barrier()
            b0 = comm.stats.total_bytes()
            t0 = time.perf_counter()
            F.cross_entropy(m(x[rows]), y[rows]).backward()
            opts[name].step()
            opts[name].zero_grad()
            dt = time.perf_counter() - t0
            if step == 0:
                counted[name] = comm.stats.total_bytes() - b0
            if step >= warmup:
                times[name].append(dt)
    slowest = {k: [max(float(t[i]) for t in comm.allgather(torch.tensor(v, dtype=torch.float64)))
                   for i in range(len(v))] for k, v in times.items()}
    bytes_ = comm.allgather(torch.tensor([counted.get(k, 0) for k in ("sample", "hybrid")]))
    return {"times": slowest, "counted": [b.tolist() for b in bytes_]}


# ---------------------------------------------------------------------------- --profile
#: where a sample-parallel step's time goes: (category, object, attribute) wrapped by a timer
def _probes() -> list[tuple[str, Any, str]]:
    from distconv.nn import batchnorm
    from distconv.nn.conv import DistConv2d
    from distconv.nn.grad_sync import BucketedGradSync
    from distconv.parallel import model as pm
    from distconv.parallel import program

    return [
        ("global-batch agreement", pm.ParallelModel, "_agree_batch"),
        ("conversions (redistribute)", program, "convert"),
        ("DistConv2d forward", DistConv2d, "forward"),
        ("DistBatchNorm forward (with its statistics)", batchnorm.DistBatchNorm, "forward"),
        ("BN statistics forward (moments + allgather)", batchnorm, "_moments"),
        ("BN backward (sums + allreduce)", batchnorm._BatchNorm, "backward"),
        ("gradient buckets: launch", BucketedGradSync, "_launch"),
        ("gradient buckets: wait and write", BucketedGradSync, "finish"),
        ("exit", pm.ParallelModel, "_exit"),
    ]


def _wrap(totals: dict[str, float], name: str, fn: Any) -> Any:
    def timed(*args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - t0

    return staticmethod(timed) if isinstance(fn, staticmethod) else timed


def profile(comm: Any, per_rank: int, steps: int) -> dict[str, Any]:
    """Runs on every rank: where one training step of the sample-parallel model spends its time
    (inclusive wall time per category; "ops" includes the BN statistics nested in it), next to
    DDP's forward and backward on the same model, medians over ``steps`` after one warm-up."""
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    model = build_model()
    ours = parallelize(model, sample_config(comm.size), comm=comm)
    ddp = DistributedDataParallel(copy.deepcopy(model), broadcast_buffers=False)
    gen = torch.Generator().manual_seed(1)
    batch = per_rank * comm.size
    x = torch.randn(batch, 3, SIZE, SIZE, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    totals: dict[str, float] = {}
    saved = []
    for name, owner, attr in _probes():
        raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        saved.append((owner, attr, raw))
        setattr(owner, attr, _wrap(totals, name, raw))
    rows: dict[str, list[float]] = {}
    try:
        for step in range(steps + 1):
            for side, m in (("ours", ours), ("ddp", ddp)):
                rows_ = (slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)
                         if side == "ddp" else sample_block(batch, ours.data_grid))
                comm.barrier()
                totals.clear()
                t0 = time.perf_counter()
                out = m(x[rows_])
                t1 = time.perf_counter()
                F.cross_entropy(out, y[rows_]).backward()
                t2 = time.perf_counter()
                m.zero_grad()
                if step == 0:
                    continue
                found = {f"{side}: forward": t1 - t0, f"{side}: backward": t2 - t1}
                if side == "ours":
                    found.update({f"ours: {k}": v for k, v in totals.items()})
                for k, v in found.items():
                    rows.setdefault(k, []).append(v)
    finally:
        for owner, attr, raw in saved:
            setattr(owner, attr, raw)
    return {k: statistics.median(v) * 1e3 for k, v in rows.items()}


def run_profile(per_rank: int, steps: int) -> dict[str, Any]:
    with WorkerPool("gloo", 2, timeout=120.0, task_timeout=1800.0) as pool:
        per_rank_ms = pool.run(profile, per_rank, steps)
    keys = list(per_rank_ms[0])
    worst = {k: max(r.get(k, 0.0) for r in per_rank_ms) for k in keys}
    lines = [f"profile: one training step, gloo, 2 ranks, {per_rank} sample(s) per rank, "
             f"median of {steps} steps, the slower rank (ms; categories are inclusive, so a "
             "BatchNorm's forward contains its statistics; the forward not in a category is "
             "the executor's own code and the local ops)", "", "| where | ms |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in worst.items()]
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "end_to_end_profile.json").write_text(json.dumps(worst, indent=1))
    (RESULTS / "end_to_end_profile.md").write_text(text + "\n")
    return worst


def one_process(steps: int, batch: int = 16, device: str = "cpu") -> dict[str, Any]:
    """A parallelized model on one process against the plain module: interleaved training steps
    (forward and backward; which side goes first alternates), medians, the ratio. On CUDA each
    step ends with a synchronize, so a step's time is the host's overhead and the kernels
    together."""
    from distconv.comm import SingleCommunicator

    torch.set_num_threads(1)
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model = build_model().to(dev)
    ours = parallelize(copy.deepcopy(model), sample_config(1), comm=SingleCommunicator())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, SIZE, SIZE, generator=gen).to(dev)
    y = torch.randint(0, 10, (batch,), generator=gen).to(dev)
    times: dict[str, list[float]] = {"plain": [], "parallel": []}
    sides = [("plain", model), ("parallel", ours)]
    for step in range(steps + 5):
        for name, m in (sides if step % 2 else sides[::-1]):  # alternating: no order bias
            sync()
            t0 = time.perf_counter()
            F.cross_entropy(m(x), y).backward()
            m.zero_grad()
            sync()
            if step >= 5:
                times[name].append(time.perf_counter() - t0)
    med: dict[str, Any] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    med["ratio"] = med["parallel"] / med["plain"]
    med.update(device=str(dev), batch=batch, steps=steps,
               name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
    print(f"one process on {med['name']}, batch {batch}: plain {med['plain']:.2f} ms, parallel "
          f"{med['parallel']:.2f} ms, ratio {med['ratio']:.3f} (target <= 1.03)")
    return med


def memory(config: dict, p: int, batch: int) -> dict[str, Any]:
    model = build_model()
    plan = explain(model, config, (batch, 3, SIZE, SIZE), world_size=p)
    mem = plan.memory()
    split = [lay for lay in plan.layers if lay.kind == "conv" and lay.algorithm in (
        "stationary-x", "stationary-y", "stationary-w")]
    full = {n: sum(q.numel() for q in m.parameters()) for n, m in model.named_modules()}
    parts = {lay.name: _model_parts(lay.grid) for lay in split}
    ideal = sum(full[lay.name] / parts[lay.name] for lay in split)
    mp_rank = sum(lay.param_elements for lay in split)
    return {"memory": mem, "explained": [tuple(plan.rank_bytes(r).values()) for r in range(p)],
            "model_parallel_share": mp_rank / ideal if ideal else None}


def _model_parts(grid: str) -> int:
    """C×F of a layer's grid as explain prints it (``{N: 2, C: 2}``)."""
    ext = dict(item.split(": ") for item in grid.strip("{}").split(", "))
    return int(ext.get("C", 1)) * int(ext.get("F", 1))


def run(backends: list[str], sizes: list[int], per_rank: list[int], steps: int,
        warmup: int) -> list[dict[str, Any]]:
    rows = []
    for backend in backends:
        for p in sizes:
            with WorkerPool(backend, p, timeout=120.0, task_timeout=1800.0) as pool:
                for b in per_rank:
                    res = pool.run(measure, backend, b, steps, warmup)[0]
                    med = {k: statistics.median(v) for k, v in res["times"].items()}
                    info = {k: memory(c, p, b * p) for k, c in
                            (("sample", sample_config(p)), ("hybrid", HYBRID[p]))}
                    explained = {k: [sum(e) for e in info[k]["explained"]]
                                 for k in ("sample", "hybrid")}
                    counted = {k: [r[i] for r in res["counted"]]
                               for i, k in enumerate(("sample", "hybrid"))}
                    row = {"backend": backend, "ranks": p, "per_rank": b,
                           "median_ms": {k: v * 1e3 for k, v in med.items()},
                           "speedup_hybrid": med["sample"] / med["hybrid"],
                           "sample_over_ddp": med["sample"] / med["ddp"] if "ddp" in med else None,
                           "local_bn_sample_over_ddp": (
                               med["sample-local-bn"] / med["ddp"] if "ddp" in med else None),
                           "frozen_bn_sample_over_ddp": (
                               med["sample-frozen-bn"] / med["ddp-frozen-bn"]
                               if "ddp" in med else None),
                           "bytes_counted": counted, "bytes_explained": explained,
                           "bytes_match": counted == explained,
                           "memory": {k: info[k]["memory"] for k in info},
                           "model_parallel_share": info["hybrid"]["model_parallel_share"]}
                    rows.append(row)
                    print(_line(row), flush=True)
    return rows


def _line(r: dict[str, Any]) -> str:
    ms = r["median_ms"]
    ddp = f"{ms['ddp']:.1f}" if "ddp" in ms else "-"
    ratio = f"{r['sample_over_ddp']:.2f}" if r["sample_over_ddp"] else "-"
    frozen = (f"{ms['sample-frozen-bn']:.1f} / {ms['ddp-frozen-bn']:.1f} = "
              f"{r['frozen_bn_sample_over_ddp']:.2f}" if r["frozen_bn_sample_over_ddp"] else "-")
    mem = r["memory"]
    pgo = lambda k: (mem[k]["parameters"] + mem[k]["gradients"]  # noqa: E731
                     + mem[k]["optimizer_state"]) / 2**20
    local = (f"{ms['sample-local-bn']:.1f} / {ms['ddp']:.1f} = "
             f"{r['local_bn_sample_over_ddp']:.2f}" if r["local_bn_sample_over_ddp"] else "-")
    return (f"| {r['backend']} | {r['ranks']} | {r['per_rank']} | {ms['sample']:.1f} | "
            f"{ms['hybrid']:.1f} | {ddp} | {r['speedup_hybrid']:.2f} | {ratio} | {local} | "
            f"{frozen} | "
            f"{pgo('sample'):.2f} | {pgo('hybrid'):.2f} | {r['model_parallel_share']:.3f} | "
            f"{'yes' if r['bytes_match'] else 'NO'} |")


HEADER = ("| backend | ranks | samples/rank | sample ms | hybrid ms | DDP ms | sample/hybrid | "
          "sample/DDP | local BN: sample / DDP ms | BN frozen: sample / DDP ms | sample MiB | "
          "hybrid MiB | mp-layer memory vs 1/(C×F) | bytes = explain |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['backend']} P={r['ranks']} b={r['per_rank']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6.4, 1.1 * len(rows)), 4.2), layout="constrained")
    width = 0.27
    for i, (key, name) in enumerate((("sample", "sample parallel"), ("hybrid", "hybrid"),
                                     ("ddp", "DDP (gloo)"))):
        vals = [r["median_ms"].get(key, 0.0) for r in rows]
        ax.bar([x + (i - 1) * width for x in xs], vals, width, label=name)
    ax.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("training step, ms (slowest rank, median)")
    ax.set_title("Wide ResNet step time: sample parallelism vs hybrid")
    ax.legend(loc="upper left", fontsize=8)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gloo, 2 ranks, 2 steps")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", action="store_true",
                        help="where a sample-parallel step's time goes, next to DDP (gloo, 2 ranks)")
    parser.add_argument("--one-process", action="store_true",
                        help="a parallelized model on one process against the plain module")
    parser.add_argument("--device", default="cpu", help="--one-process on this device (cuda)")
    parser.add_argument("--batch", type=int, default=16, help="--one-process batch")
    args = parser.parse_args()
    if args.one_process:
        med = one_process(args.steps, args.batch, args.device)
        RESULTS.mkdir(parents=True, exist_ok=True)
        name = "one_process.json" if args.device == "cpu" else f"one_process_{args.device}.json"
        (RESULTS / name).write_text(json.dumps(med, indent=1))
        return
    if args.profile:
        run_profile(1, args.steps)
        return
    if args.quick:
        rows = run(["gloo"], [2], [1], 2, 1)
    else:
        print(HEADER)
        rows = run(["mpi", "gloo"], [2, 4], [1, 2], args.steps, args.warmup)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "end_to_end.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / "end_to_end.md").write_text(HEADER + "\n" + "\n".join(map(_line, rows)) + "\n")
    plot(rows, RESULTS / "end_to_end.png")
    print(f"wrote {RESULTS / 'end_to_end.md'}")


if __name__ == "__main__":
    main()
