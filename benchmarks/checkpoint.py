"""Checkpoint save and load against torch.distributed.checkpoint (DCP) and torch.save.

On a gloo world of 2 processes (one thread each) it times, interleaved repetition by
repetition, a stack of convolutions with at least 150 MB of fp32 weights laid out two ways:

* ``sample``  -- ``parallelize`` with pure sample parallelism: every weight is held whole by both
  ranks (DCP sees plain tensors, which it deduplicates over the ranks);
* ``sharded`` -- stationary-x on ``{C:2}``: every weight split by input channels,
  ``w[*,o_C,*,*]`` (DCP sees a ``DTensor`` with ``Shard`` on the same dim).

Sides, each timed from a barrier to a barrier (so the slowest rank counts):

* ``save``: ``distconv.save`` / ``dcp.save`` (``FileSystemWriter``, which ``fsync``'s like ours) /
  ``torch.save`` of the global state on rank 0 (``fsync``'d too);
* ``load``: ``distconv.load`` / ``dcp.load`` onto the layout that saved;
* ``reshard``: the sharded checkpoint loaded onto the sample-parallel model (each rank reads every
  tensor whole) by both libraries;
* ``stall``: how long an asynchronous ``distconv.save(..., async_save=True)`` blocks the caller
  (the slowest rank's call-to-return), against the synchronous save of the same model.

Every checkpoint directory is removed before it is written again. The table reports medians and
ratios; targets: save <= 1.0x DCP, load and reshard <= 0.8x DCP, stall <= 15% of a sync save.
Writes ``benchmarks/results/checkpoint.{json,md}``.

    .venv/bin/python benchmarks/checkpoint.py              # 7 repetitions (about a minute)
    .venv/bin/python benchmarks/checkpoint.py --reps 3     # a quicker run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import distconv  # noqa: E402
from distconv import parallelize  # noqa: E402
from distconv.nn import shard_specs  # noqa: E402
from distconv.testing import WorkerPool  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CONFIGS = {
    "sample": {"default": {"grid": {"N": 2}, "algorithm": "sample"}},
    "sharded": {"default": {"grid": {"C": 2}, "algorithm": "stationary-x"}},
}
TARGETS = {"save": 1.0, "load": 0.8, "reshard": 0.8, "stall": 0.15}


def build_model() -> nn.Sequential:
    """A widening stem, then sixteen 512 -> 512 3x3 convolutions: 157 MB of fp32 weights."""
    widths = [(3, 64), (64, 128), (128, 256), (256, 512)] + [(512, 512)] * 16
    model = nn.Sequential(*[nn.Conv2d(a, b, 3, padding=1) for a, b in widths])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _dtensor_state(model: nn.Module, mesh: Any) -> dict[str, Any]:
    """The sharded model's local blocks as DTensors, sharded on the dim its Dist splits."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    specs = shard_specs(model)
    out = {}
    for key, t in model.state_dict().items():
        spec = specs[key]
        dims = [d for d, e in enumerate(spec.dist.entries) if e is not None]
        placement = Shard(dims[0]) if dims and spec.grid is not None else Replicate()
        out[key] = DTensor.from_local(t, mesh, [placement], run_check=False,
                                      shape=torch.Size(spec.global_shape),
                                      stride=torch.empty(spec.global_shape, device="meta").stride())
    return out


def _torch_save(comm: Any, state: dict[str, torch.Tensor], path: Path) -> None:
    if comm.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        with open(path / "model.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())


def measure(comm: Any, reps: int, root: str) -> dict[str, Any]:
    """Runs on every rank: every side once per repetition, interleaved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    base = build_model()
    models = {k: parallelize(base, c, comm=comm) for k, c in CONFIGS.items()}
    mesh = init_device_mesh("cpu", (comm.size,))
    dcp_state = {"sample": models["sample"].state_dict(),
                 "sharded": _dtensor_state(models["sharded"], mesh)}
    root_path = Path(root)

    def where(name: str) -> Path:
        return root_path / name

    def clear(name: str) -> None:
        if comm.rank == 0:
            shutil.rmtree(where(name), ignore_errors=True)
        comm.barrier()

    def timed(fn: Callable[[], Any]) -> float:
        comm.barrier()
        t0 = time.perf_counter()
        fn()
        comm.barrier()
        return time.perf_counter() - t0

    def stall(layout: str) -> float:
        clear(f"async-{layout}")
        comm.barrier()
        t0 = time.perf_counter()
        handle = distconv.save(models[layout], where(f"async-{layout}"), comm=comm,
                               async_save=True)
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        handle.wait()
        comm.barrier()
        return max(float(t) for t in comm.allgather(took))

    sides: dict[str, Callable[[], float]] = {}
    for layout in CONFIGS:
        m, sd = models[layout], dcp_state[layout]
        sides[f"save/{layout}/distconv"] = lambda m=m, n=f"ours-{layout}": (
            clear(n), timed(lambda: distconv.save(m, where(n), comm=comm)))[1]
        sides[f"save/{layout}/dcp"] = lambda sd=sd, n=f"dcp-{layout}": (
            clear(n), timed(lambda: dcp.save(sd, checkpoint_id=where(n))))[1]
        sides[f"load/{layout}/distconv"] = lambda m=m, n=f"ours-{layout}": timed(
            lambda: distconv.load(m, where(n)))
        sides[f"load/{layout}/dcp"] = lambda sd=sd, n=f"dcp-{layout}": timed(
            lambda: dcp.load(sd, checkpoint_id=where(n)))
        sides[f"stall/{layout}/distconv"] = lambda layout=layout: stall(layout)
    sides["save/sample/torch.save"] = lambda: (clear("torch"), timed(
        lambda: _torch_save(comm, base.state_dict(), where("torch"))))[1]
    sides["reshard/sharded->sample/distconv"] = lambda: timed(
        lambda: distconv.load(models["sample"], where("ours-sharded")))
    sides["reshard/sharded->sample/dcp"] = lambda: timed(
        lambda: dcp.load(dcp_state["sample"], checkpoint_id=where("dcp-sharded")))

    times: dict[str, list[float]] = {k: [] for k in sides}
    for rep in range(reps + 1):  # the first repetition warms up
        for name, fn in sides.items():
            t = fn()
            if rep:
                times[name].append(t)
    # the loads are bitwise: what the sample model reads back equals the model that was saved
    distconv.load(models["sample"], where("ours-sharded"))
    exact = all(torch.equal(a, b) for a, b in
                zip(base.state_dict().values(), models["sample"].state_dict().values()))
    nbytes = sum(t.numel() * t.element_size() for t in base.state_dict().values())
    return {"times": times, "bytes": nbytes, "bitwise": exact}


def summarize(res: dict[str, Any]) -> list[dict[str, Any]]:
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    rows = []
    for what, layout, ref in (("save", "sample", "dcp"), ("save", "sharded", "dcp"),
                              ("save", "sample", "torch.save"),
                              ("load", "sample", "dcp"), ("load", "sharded", "dcp"),
                              ("reshard", "sharded->sample", "dcp"),
                              ("stall", "sample", None), ("stall", "sharded", None)):
        ours = med[f"{what}/{layout}/distconv"]
        if what == "stall":
            ref, base = "sync distconv.save", med[f"save/{layout}/distconv"]
        else:
            base = med[f"{what}/{layout}/{ref}"]
        ratio = ours / base
        target = TARGETS[what] if ref != "torch.save" else None
        rows.append({"what": what, "layout": layout, "distconv_s": ours, "against": ref,
                     "against_s": base, "ratio": ratio, "target": target,
                     "met": None if target is None else ratio <= target})
    return rows


def table(rows: list[dict[str, Any]], res: dict[str, Any], reps: int) -> str:
    load = res.get("load_average")
    busy = "" if load is None else (
        f"; load average {load[0]:.1f} before, {load[1]:.1f} after on {os.cpu_count()} CPUs")
    lines = [f"{res['bytes'] / 1e6:.0f} MB of fp32 conv weights, gloo, 2 ranks, medians of "
             f"{reps} interleaved repetitions; loads bitwise: {res['bitwise']}{busy}", "",
             "| what | layout | distconv (s) | against | their (s) | ratio | target |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        target = "" if r["target"] is None else (
            f"<= {r['target']:.2f} {'met' if r['met'] else 'MISSED'}")
        lines.append(f"| {r['what']} | {r['layout']} | {r['distconv_s']:.3f} | {r['against']} | "
                     f"{r['against_s']:.3f} | {r['ratio']:.3f} | {target} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions (default 7)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="distconv-ckpt-bench-")
    before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    try:
        with WorkerPool("gloo", 2, timeout=300.0, task_timeout=3600.0) as pool:
            res = pool.run(measure, args.reps, root)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if before is not None:  # other work on the machine skews every ratio: say how much there was
        res["load_average"] = [before, os.getloadavg()[0]]
    rows = summarize(res)
    text = table(rows, res, args.reps)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "checkpoint.json").write_text(json.dumps(
        {"reps": args.reps, "bytes": res["bytes"], "bitwise": res["bitwise"], "rows": rows,
         "times": res["times"], "load_average": res.get("load_average")}, indent=1))
    (RESULTS / "checkpoint.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
