"""Whole training steps: parallelize's sides against one process and torch DDP.

Two networks: a ResNet-18-style network (BasicBlocks with BN, widths 32-256, 32x32 inputs) and a
bottleneck wide ResNet. For gloo and MPI worlds (2 ranks for both; 4 ranks for the WRN; one
thread each) and 1, 2 (and, for ResNet-18, 8: a global batch of 16) samples per rank, it times
full training steps (forward, backward with every gradient complete, SGD with momentum) of:

* ``one-process``      -- the plain model on the whole global batch, on rank 0;
* ``ddp`` / ``ddp-frozen-bn`` (gloo) -- ``torch.nn.parallel.DistributedDataParallel`` with its
  defaults (per-rank BatchNorm statistics, buffers broadcast from rank 0 at each forward), and
  the same with every BatchNorm in eval mode;
* ``sample``           -- ``parallelize`` with pure sample parallelism and global-batch BN
  statistics (one process's semantics);
* ``sample-local-bn``  -- the same with ``statistics: local`` (DDP's per-rank BN semantics);
* ``sample-frozen-bn`` -- every BatchNorm in eval mode: the library's own cost, no statistics;
* ``hybrid``           -- ResNet-18: layer3-4 over channels (stationary-x); WRN: the paper's
  "+spatial + x/w" (rows split early, channels in the middle, channels x filters in the widest
  stage);
* ``hybrid-pipelined`` -- the hybrid with ``pipeline: 2`` on its stationary layers.

The sides are interleaved step by step in one world (their order reversed every other step); a
step's time is the slowest rank's, and the table reports medians and ratios of the same run,
next to the targets. Bytes per step are the communicators' counts next to
``distconv.explain``'s; memory of the model-parallel layers is ``explain``'s, against the full
layers.

Writes ``benchmarks/results/end_to_end.{json,md,png}`` (``--profile``: ``end_to_end_profile``,
``--stages``: ``end_to_end_stages``, ``--layouts``: ``end_to_end_layouts``, ``--ceiling``:
``end_to_end_ceiling``).

    .venv/bin/python benchmarks/end_to_end.py            # the full run (three to fifteen minutes)
    .venv/bin/python benchmarks/end_to_end.py --quick    # a smoke run (gloo, 2 ranks, 2 steps)
    .venv/bin/python benchmarks/end_to_end.py --profile  # where a step's time goes: vs DDP
                                                         # (gloo), and the hybrid vs sample (MPI)
    .venv/bin/python benchmarks/end_to_end.py --case resnet18:gloo:2:8  # one case of the run
    .venv/bin/python benchmarks/end_to_end.py --stages   # the hybrid's split stages alone
    .venv/bin/python benchmarks/end_to_end.py --layouts  # hybrid layouts vs sample (MPI, 2 ranks)
    .venv/bin/python benchmarks/end_to_end.py --ceiling  # the planner's plan vs sample, with and
                                                         # without their communication
    .venv/bin/python benchmarks/end_to_end.py --one-process --steps 30  # overhead on one rank
    python benchmarks/end_to_end.py --one-process --device cuda --steps 50  # the same on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from distconv import explain, parallelize  # noqa: E402
from distconv.data import sample_block  # noqa: E402
from distconv.models import resnet18_mini, wide_resnet_mini  # noqa: E402
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


def build_model(name: str = "wrn") -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "resnet18":
        return resnet18_mini()
    return wide_resnet_mini(in_channels=3, num_classes=10, base=16, widen=4)


#: the ResNet-18-style network's hybrid on 2 ranks: its widest stages over channels
HYBRID_RESNET18 = {"default": {"grid": {"N": 2}, "algorithm": "sample"}, "layers": [
    {"match": "layer3.*", "grid": {"C": 2}, "algorithm": "stationary-x"},
    {"match": "layer4.*", "grid": {"C": 2}, "algorithm": "stationary-x"}]}


def hybrid_config(model: str, p: int, pipeline: int | None = None) -> dict:
    config = copy.deepcopy(HYBRID_RESNET18 if model == "resnet18" else HYBRID[p])
    if pipeline:
        for entry in config["layers"]:
            if entry["algorithm"].startswith("stationary"):
                entry["pipeline"] = pipeline
    return config


def sample_config(p: int, statistics: str | None = None) -> dict:
    default: dict[str, Any] = {"grid": {"N": p}, "algorithm": "sample"}
    if statistics:
        default["statistics"] = statistics
    return {"default": default}


def _freeze_bn(model: torch.nn.Module) -> torch.nn.Module:
    for m in model.modules():
        if "BatchNorm" in type(m).__name__:
            m.eval()
    return model


#: every side of the table, in the order the steps interleave; DDP sides on gloo only
SIDES = ("one-process", "ddp", "ddp-frozen-bn", "sample", "sample-local-bn", "sample-frozen-bn",
         "hybrid", "hybrid-pipelined")


def _variants(comm: Any, model: torch.nn.Module, name: str, backend: str,
              per_rank: int) -> dict[str, torch.nn.Module]:
    p = comm.size
    out: dict[str, torch.nn.Module] = {"one-process": copy.deepcopy(model)}
    if backend == "gloo":
        from torch.nn.parallel import DistributedDataParallel

        # DDP as a user builds it: defaults (buffers broadcast from rank 0 at each forward, the
        # semantics of statistics: local)
        out["ddp"] = DistributedDataParallel(copy.deepcopy(model))
        out["ddp-frozen-bn"] = _freeze_bn(DistributedDataParallel(copy.deepcopy(model)))
    out["sample"] = parallelize(model, sample_config(p), comm=comm)
    out["sample-local-bn"] = parallelize(model, sample_config(p, "local"), comm=comm)
    out["sample-frozen-bn"] = _freeze_bn(parallelize(model, sample_config(p), comm=comm))
    out["hybrid"] = parallelize(model, hybrid_config(name, p), comm=comm)
    if per_rank * p >= 2 * p:  # two chunks of at least one sample per rank
        out["hybrid-pipelined"] = parallelize(model, hybrid_config(name, p, 2), comm=comm)
    return out


def _slowest(comm: Any, times: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per side, each step's time on the slowest rank (collective: every rank passes its own
    times, the same sides and steps)."""
    return {k: torch.stack(comm.allgather(torch.tensor(v, dtype=torch.float64))).amax(0).tolist()
            for k, v in times.items()}


def measure(comm: Any, name: str, backend: str, per_rank: int, steps: int,
            warmup: int) -> dict[str, Any]:
    """Runs on every rank: interleaved training steps of every side (``SIDES``). The one-process
    side runs the plain model on the whole global batch on rank 0 while the others wait."""
    torch.set_num_threads(1)
    model = build_model(name)
    variants = _variants(comm, model, name, backend, per_rank)
    times, counted = _interleaved(comm, variants, per_rank, steps, warmup)
    slowest = _slowest(comm, times)
    bytes_ = comm.allgather(torch.tensor([counted.get(k, 0) for k in ("sample", "hybrid")]))
    return {"times": slowest, "counted": [b.tolist() for b in bytes_]}


def _interleaved(comm: Any, variants: dict[str, torch.nn.Module], per_rank: int, steps: int,
                 warmup: int, x: torch.Tensor | None = None
                 ) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Training steps of every side, interleaved (the order reversed every other step), on
    ``per_rank`` samples per rank: this rank's seconds per side and step after ``warmup``, and
    the bytes each side's first step counted. The global batch is ``x`` with a sum as the loss,
    or (None) images of the networks here with labels and cross-entropy."""
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for k, m in variants.items()}
    gen = torch.Generator().manual_seed(1)
    batch = per_rank * comm.size
    y = None
    if x is None:
        x = torch.randn(batch, 3, SIZE, SIZE, generator=gen)
        y = torch.randint(0, 10, (batch,), generator=gen)
    times: dict[str, list[float]] = {k: [] for k in variants}
    counted: dict[str, int] = {}
    for step in range(warmup + steps):
        order = list(variants) if step % 2 else list(variants)[::-1]  # no order bias
        for side in order:
            m = variants[side]
            if side == "one-process":
                rows: Any = slice(None)
            elif side.startswith("ddp"):
                rows = slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)
            else:
                rows = sample_block(batch, m.data_grid)
            comm.barrier()
            b0 = comm.stats.total_bytes()
            t0 = time.perf_counter()
            if side != "one-process" or comm.rank == 0:
                out = m(x[rows])
                (out.sum() if y is None else F.cross_entropy(out, y[rows])).backward()
                opts[side].step()
                opts[side].zero_grad()
            dt = time.perf_counter() - t0
            if step == 0:
                counted[side] = comm.stats.total_bytes() - b0
            if step >= warmup:
                times[side].append(dt)
    return times, counted


# ---------------------------------------------------------------------------- --profile
#: where a sample-parallel step's time goes: (category, object, attribute) wrapped by a timer
def _probes() -> list[tuple[str, Any, str]]:
    from distconv.nn import batchnorm, batchnorm_statistics
    from distconv.nn.conv import DistConv2d
    from distconv.nn.grad_sync import BucketedGradSync
    from distconv.parallel import model as pm
    from distconv.parallel import program

    return [
        ("global-batch agreement", pm.ParallelModel, "_agree_batch"),
        ("conversions (redistribute)", program, "convert"),
        ("DistConv2d forward", DistConv2d, "forward"),
        ("DistBatchNorm forward (with its statistics)", batchnorm.DistBatchNorm, "forward"),
        ("BN statistics forward (moments + allgather)", batchnorm_statistics, "_moments"),
        ("BN backward (sums + allreduce)", batchnorm_statistics._BatchNorm, "backward"),
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


@contextlib.contextmanager
def _probed(probes: list[tuple[str, Any, str]]) -> Iterator[dict[str, float]]:
    """Each probe's ``(category, owner, attribute)`` wrapped by a timer that adds into the
    dict yielded; the originals put back after."""
    totals: dict[str, float] = {}
    saved = []
    for name, owner, attr in probes:
        raw = owner.__dict__[attr]
        saved.append((owner, attr, raw))
        setattr(owner, attr, _wrap(totals, name, raw))
    try:
        yield totals
    finally:
        for owner, attr, raw in saved:
            setattr(owner, attr, raw)


def _forward_backward(comm: Any, m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                      totals: dict[str, float]) -> tuple[float, float]:
    """After a barrier and with the probes' totals cleared: the seconds of ``m``'s forward on
    ``x`` and of the cross-entropy's backward."""
    comm.barrier()
    totals.clear()
    t0 = time.perf_counter()
    out = m(x)
    t1 = time.perf_counter()
    F.cross_entropy(out, y).backward()
    return t1 - t0, time.perf_counter() - t1


def profile(comm: Any, per_rank: int, steps: int) -> dict[str, Any]:
    """Runs on every rank: where one training step of the sample-parallel model spends its time
    (inclusive wall time per category; "ops" includes the BN statistics nested in it), next to
    DDP's forward and backward on the same model, medians over ``steps`` after one warm-up."""
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    model = build_model()
    ours = parallelize(model, sample_config(comm.size), comm=comm)
    ddp = DistributedDataParallel(copy.deepcopy(model))
    gen = torch.Generator().manual_seed(1)
    batch = per_rank * comm.size
    x = torch.randn(batch, 3, SIZE, SIZE, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    rows: dict[str, list[float]] = {}
    with _probed(_probes()) as totals:
        for step in range(steps + 1):
            for side, m in (("ours", ours), ("ddp", ddp)):
                rows_ = (slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)
                         if side == "ddp" else sample_block(batch, ours.data_grid))
                forward, backward = _forward_backward(comm, m, x[rows_], y[rows_], totals)
                m.zero_grad()
                if step == 0:
                    continue
                found = {f"{side}: forward": forward, f"{side}: backward": backward}
                if side == "ours":
                    found.update({f"ours: {k}": v for k, v in totals.items()})
                for k, v in found.items():
                    rows.setdefault(k, []).append(v)
    return {k: statistics.median(v) * 1e3 for k, v in rows.items()}


def _layout_probes() -> list[tuple[str, Any, str]]:
    """A model-parallel step's own work: its redistribution steps (the reduce-scatters and
    allgathers of stationary layers), the transitions between layers' grids, and the
    communicator's calls by kind (the call, and for an asynchronous one its wait)."""
    import importlib

    from distconv.comm import base
    from distconv.parallel import placement

    rd = importlib.import_module("distconv.redistribute")  # (the package exports its function)

    return [("redistribution steps, forward", rd._StepFunction, "forward"),
            ("redistribution steps, backward", rd._StepFunction, "backward"),
            ("transitions between grids, forward", placement, "repartition"),
            ("transitions between grids, backward", rd._Repartition, "backward")] + [
        (f"collectives: {op}", base.Communicator, op)
        for op in ("allreduce", "allgather", "reduce_scatter", "alltoall")] + [
        ("collectives: waits for asynchronous ones", base.Work, "wait")]


def profile_hybrid(comm: Any, per_rank: int, steps: int) -> dict[str, Any]:
    """Runs on every rank: one training step (forward, backward, SGD) of the ResNet-18-style
    network, sample parallelism and the hybrid side by side, with the profile's categories and
    the time inside each kind of collective (inclusive, so a blocking call holds its own wait,
    and the BatchNorm and layer categories hold the collectives they make); medians."""
    torch.set_num_threads(1)
    model = build_model("resnet18")
    sides = {"sample": parallelize(model, sample_config(comm.size), comm=comm),
             "hybrid": parallelize(model, hybrid_config("resnet18", comm.size), comm=comm)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for k, m in sides.items()}
    gen = torch.Generator().manual_seed(1)
    batch = per_rank * comm.size
    x = torch.randn(batch, 3, SIZE, SIZE, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    rows: dict[str, list[float]] = {}
    with _probed(_probes() + _layout_probes()) as totals:
        for step in range(steps + 1):
            for side, m in (sides.items() if step % 2 else list(sides.items())[::-1]):
                rb = sample_block(batch, m.data_grid)
                forward, backward = _forward_backward(comm, m, x[rb], y[rb], totals)
                t0 = time.perf_counter()
                opts[side].step()
                opts[side].zero_grad()
                optimizer = time.perf_counter() - t0
                if step == 0:
                    continue
                found = {"step": forward + backward + optimizer, "forward": forward,
                         "backward": backward, "optimizer": optimizer, **totals}
                for k, v in found.items():
                    rows.setdefault(f"{side}: {k}", []).append(v)
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
    with WorkerPool("mpi", 2, timeout=120.0, task_timeout=1800.0) as pool:
        hybrid_ms = pool.run(profile_hybrid, per_rank, steps)
    sides = ("sample", "hybrid")
    names = list(dict.fromkeys(k.split(": ", 1)[1] for k in hybrid_ms[0]))
    both = {n: [max(r.get(f"{s}: {n}", 0.0) for r in hybrid_ms) for s in sides] for n in names}
    lines = ["", f"profile: one training step of the ResNet-18-style network, MPI, 2 ranks, "
             f"{per_rank} sample(s) per rank, sample parallelism and the hybrid (layer3-4 over "
             f"channels), median of {steps} interleaved steps, the slower rank (ms; inclusive "
             "categories)", "", "| where | sample | hybrid |", "|---|---|---|"]
    lines += [f"| {n} | {a:.2f} | {b:.2f} |" for n, (a, b) in both.items()]
    print("\n".join(lines))
    text += "\n" + "\n".join(lines)
    worst["resnet18 mpi"] = {n: dict(zip(sides, v)) for n, v in both.items()}
    (RESULTS / "end_to_end_profile.json").write_text(json.dumps(worst, indent=1))
    (RESULTS / "end_to_end_profile.md").write_text(text + "\n")
    return worst


def stages(comm: Any, per_rank: int, steps: int) -> dict[str, Any]:
    """Runs on every rank: the ResNet-18-style network's stages that the hybrid splits
    (layer3-4, its input 64 x 16 x 16) as a network of their own, sample parallelism against
    the hybrid's layout of them ({C: 2}, stationary-x), training steps interleaved as in
    :func:`measure` (a sum as the loss); medians of the slowest rank, ms. Without the stem and
    layer1-2 that both sides run alike, this is the hybrid's own gain (Amdahl's law bounds the
    whole network's by it)."""
    torch.set_num_threads(1)
    full = build_model("resnet18")
    part = torch.nn.Sequential(full.layer3, full.layer4)
    sides = {"sample": parallelize(part, sample_config(comm.size), comm=comm),
             "hybrid": parallelize(part, {"default": {"grid": {"C": comm.size},
                                                      "algorithm": "stationary-x"}}, comm=comm)}
    x = torch.randn(per_rank * comm.size, 64, SIZE // 2, SIZE // 2,
                    generator=torch.Generator().manual_seed(1))
    times = _interleaved(comm, sides, per_rank, steps, 2, x)[0]
    return {k: statistics.median(v) * 1e3 for k, v in _slowest(comm, times).items()}


def run_stages(steps: int) -> list[dict[str, Any]]:
    rows = []
    with WorkerPool("mpi", 2, timeout=120.0, task_timeout=1800.0) as pool:
        for per_rank in (1, 2):
            med = pool.run(stages, per_rank, steps)[0]
            rows.append({"per_rank": per_rank, **med, "sample/hybrid": med["sample"] / med["hybrid"]})
            print(f"ResNet-18 layer3-4 alone, 2 MPI ranks, {per_rank} sample(s) per rank: sample "
                  f"{med['sample']:.1f} ms, hybrid {med['hybrid']:.1f} ms, sample/hybrid "
                  f"{med['sample'] / med['hybrid']:.2f}", flush=True)
    return rows


def _over_channels(*stages: str) -> dict[str, Any]:
    """A 2-rank config: ``stages`` (module name patterns) over channels, stationary-x; the rest
    sample-parallel."""
    return {"default": {"grid": {"N": 2}, "algorithm": "sample"},
            "layers": [{"match": f"{s}.*", "grid": {"C": 2}, "algorithm": "stationary-x"}
                       for s in stages]}


def _over_filters(*stages: str) -> dict[str, Any]:
    """A 2-rank config: ``stages`` (module name patterns) over filters, stationary-y; the rest
    sample-parallel."""
    return {"default": {"grid": {"N": 2}, "algorithm": "sample"},
            "layers": [{"match": f"{s}.*", "grid": {"F": 2}, "algorithm": "stationary-y"}
                       for s in stages]}


def _pairs(*stages: str) -> dict[str, Any]:
    """A 2-rank config: in each BasicBlock of ``stages``, the first convolution (and the
    shortcut's) over filters (stationary-y), the second over channels (stationary-x), whose
    input channels are the first one's output filters as they lie; the rest sample-parallel."""
    layers = []
    for s in stages:
        layers += [{"match": f"{s}.*.conv1", "grid": {"F": 2}, "algorithm": "stationary-y"},
                   {"match": f"{s}.*.shortcut.0", "grid": {"F": 2}, "algorithm": "stationary-y"},
                   {"match": f"{s}.*.conv2", "grid": {"C": 2}, "algorithm": "stationary-x"}]
    return {"default": {"grid": {"N": 2}, "algorithm": "sample"}, "layers": layers}


#: hybrid layouts on 2 ranks, per model; the first is the main run's hybrid
LAYOUTS = {
    "resnet18": {"layer3-4 over channels (the hybrid)": HYBRID_RESNET18,
                 "layer3-4 over filters": _over_filters("layer3", "layer4"),
                 "layer2-4 over filters": _over_filters("layer2", "layer3", "layer4"),
                 "layer3-4 filters, then channels": _pairs("layer3", "layer4"),
                 "layer2-4 filters, then channels": _pairs("layer2", "layer3", "layer4"),
                 "layer2-4 over channels": _over_channels("layer2", "layer3", "layer4"),
                 "layer1-4 over channels": _over_channels("layer1", "layer2", "layer3",
                                                          "layer4")},
    "wrn": {"the paper's: rows, then channels (the hybrid)": HYBRID[2],
            "layer2-3 over channels": _over_channels("layer2", "layer3"),
            "layer1-3 over channels": _over_channels("layer1", "layer2", "layer3")},
}


def layouts(comm: Any, name: str, per_rank: int, steps: int, warmup: int,
            runs: int) -> dict[str, Any]:
    """Runs on every rank: sample parallelism against each hybrid layout of ``LAYOUTS[name]``
    and the planner's own plan for this machine (calibrated here first), training steps
    interleaved as in :func:`measure`; per run, the slowest rank's median per side (ms)."""
    from distconv.machines import calibrate
    from distconv.planner import plan_network, predict

    torch.set_num_threads(1)
    model = build_model(name)
    machine = calibrate(comm, sizes=(1, 1 << 16), repeats=3)
    shape = (per_rank * comm.size, 3, SIZE, SIZE)
    planned = plan_network(model, shape, world_size=comm.size, machine=machine,
                           max_model=comm.size).config()
    configs = {"sample": sample_config(comm.size), **LAYOUTS[name], "the planner's": planned}
    predicted = {k: predict(model, c, shape, world_size=comm.size, machine=machine).step_time
                 * 1e3 for k, c in configs.items()}
    variants = {k: parallelize(model, c, comm=comm) for k, c in configs.items()}
    medians = []
    for _ in range(runs):
        times = _slowest(comm, _interleaved(comm, variants, per_rank, steps, warmup)[0])
        medians.append({k: statistics.median(v) * 1e3 for k, v in times.items()})
    return {"medians": medians, "predicted": predicted, "planner": planned}


def run_layouts(steps: int, warmup: int, runs: int) -> list[dict[str, Any]]:
    """:func:`layouts` for both models at 1 and 2 samples per rank on 2 MPI ranks; prints a
    table of step times and ``sample/layout`` ratios (range over the runs; target >= 1.3)."""
    rows = []
    lines = [f"hybrid layouts against sample parallelism, 2 MPI ranks, {runs} runs of {steps} "
             "interleaved steps (medians of the slower rank; the range over runs)", "",
             "| model | samples/rank | layout | step ms | sample/layout (≥1.3) | predicted ms (the "
             "planner's model of this machine) |", "|---|---|---|---|---|---|"]
    with WorkerPool("mpi", 2, timeout=120.0, task_timeout=1800.0) as pool:
        for name in LAYOUTS:
            for per_rank in (1, 2):
                res = pool.run(layouts, name, per_rank, steps, warmup, runs)[0]
                rows.append({"model": name, "per_rank": per_rank, **res})
                for side in res["medians"][0]:
                    ms = [m[side] for m in res["medians"]]
                    ratio = [m["sample"] / m[side] for m in res["medians"]]
                    cells = [name, str(per_rank), side, f"{min(ms):.1f}–{max(ms):.1f}",
                             "-" if side == "sample" else f"{min(ratio):.2f}–{max(ratio):.2f}",
                             f"{res['predicted'][side]:.1f}"]
                    lines.append("| " + " | ".join(cells) + " |")
                print("\n".join(lines[-len(res["medians"][0]):]), flush=True)
    text = "\n".join(lines) + "\n\nthe planner's configs: " + "; ".join(
        f"{r['model']} {r['per_rank']}/rank: {json.dumps(r['planner'])}" for r in rows) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "end_to_end_layouts.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / "end_to_end_layouts.md").write_text(text)
    return rows


# ---------------------------------------------------------------------------- --ceiling
#: the MPI communicator's methods that move a collective's data (through MPI or a ring)
_DATA_HOOKS = ("_allreduce", "_allreduce_consuming", "_allgather", "_allgather_cat",
               "_reduce_scatter", "_reduce_scatter_dim", "_alltoall")


def _copied(a: Any) -> Any:
    """A recorded argument copied (a tensor, or a list of them), so a replay neither sees nor
    changes what the step's collective consumed or wrote."""
    if isinstance(a, torch.Tensor):
        return a.clone()
    if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
        return [c.clone() for c in a]
    return a


@contextlib.contextmanager
def _recording(calls: list[tuple[Any, str, tuple]]) -> Iterator[None]:
    """Every outermost call of :data:`_DATA_HOOKS` appended to ``calls`` as (communicator,
    method, a copy of its arguments), to be replayed by :func:`_replay`."""
    from distconv.comm.mpi_backend import MPICommunicator as M

    saved = {k: M.__dict__[k] for k in _DATA_HOOKS}
    depth = [0]

    def recorder(name: str, fn: Any) -> Any:
        def hook(self: Any, *args: Any, **kw: Any) -> Any:
            if depth[0] == 0:
                calls.append((self, name, tuple(_copied(a) for a in (*args, *kw.values()))))
            depth[0] += 1
            try:
                return fn(self, *args, **kw)
            finally:
                depth[0] -= 1
        return hook

    for k, fn in saved.items():
        setattr(M, k, recorder(k, fn))
    try:
        yield
    finally:
        for k, fn in saved.items():
            setattr(M, k, fn)


def _replay(comm: Any, calls: list[tuple[Any, str, tuple]], repeats: int) -> float:
    """Seconds (median over ``repeats``, after a barrier each) that ``calls`` take back to
    back, each waited for before the next: a step's collectives with no compute between."""
    from distconv.comm.base import Work

    took = []
    for _ in range(repeats + 1):
        args = [_copied(a) for _, _, a in calls]
        comm.barrier()
        t0 = time.perf_counter()
        for (c, name, _), a in zip(calls, args):
            out = getattr(c, name)(*a)
            if isinstance(out, Work):
                out.wait()
        took.append(time.perf_counter() - t0)
    return statistics.median(took[1:])


@contextlib.contextmanager
def _without_communication() -> Iterator[None]:
    """Every MPI collective that moves data (allreduce, allgather, reduce-scatter, all-to-all,
    through MPI or a shared-memory ring) replaced by a local stand-in that returns the result's
    shapes: this rank's own block where every rank's has its shape, zeros elsewhere. The values
    are wrong and the local work is the same: for timing only. Barriers stay real."""
    from distconv.comm.base import Work, concat_parts
    from distconv.comm.mpi_backend import MPICommunicator as M

    def blocks(t: torch.Tensor, shapes: list[Any]) -> list[torch.Tensor]:
        return [t if tuple(s) == tuple(t.shape) else t.new_zeros(s) for s in shapes]

    stand_ins = {
        "_allreduce": lambda self, t, op, consume=False: Work.completed(t if consume
                                                                        else t.clone()),
        "_allreduce_consuming": lambda self, t, op: Work.completed(t),
        "_allgather": lambda self, t, shapes, opname: Work.completed(blocks(t, shapes)),
        "_allgather_cat": lambda self, t, shapes, dim: concat_parts(blocks(t, shapes), dim),
        "_reduce_scatter": lambda self, chunks, op: Work.completed(chunks[self.rank].clone()),
        "_reduce_scatter_dim": lambda self, x, sizes, dim: x.split(sizes, dim)[self.rank].clone(),
        "_alltoall": lambda self, chunks, shapes: Work.completed(
            [torch.zeros(s, dtype=chunks[0].dtype) for s in shapes]),
    }
    assert set(stand_ins) == set(_DATA_HOOKS)
    saved = {k: M.__dict__[k] for k in stand_ins}
    for k, fn in stand_ins.items():
        setattr(M, k, fn)
    try:
        yield
    finally:
        for k, fn in saved.items():
            setattr(M, k, fn)


def ceiling(comm: Any, name: str, per_rank: int, steps: int, warmup: int,
            config: dict) -> dict[str, Any]:
    """Runs on every rank: sample parallelism and the hybrid ``config``, each as it runs and
    with its communication replaced by local stand-ins (:func:`_without_communication`), and
    the plain model on one process at the per-rank batch; training steps interleaved as in
    :func:`measure` (the stand-in sides between their own barriers), the slowest rank's
    medians (ms), the bytes each side's step moves per rank, and (``alone``) the time of each
    side's collectives of one step replayed back to back (:func:`_replay`)."""
    torch.set_num_threads(1)
    model = build_model(name)
    nets = {"sample": parallelize(model, sample_config(comm.size), comm=comm),
            "hybrid": parallelize(model, config, comm=comm)}
    plain = copy.deepcopy(model)
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
            for k, m in (*nets.items(), ("one process", plain))}
    gen = torch.Generator().manual_seed(1)
    batch = per_rank * comm.size
    x = torch.randn(batch, 3, SIZE, SIZE, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    sides = [(k, False) for k in nets] + [(k, True) for k in nets] + [("one process", False)]
    times: dict[str, list[float]] = {}
    moved: dict[str, int] = {}
    recorded: dict[str, list[tuple[Any, str, tuple]]] = {}
    for step in range(warmup + steps):
        for net, stand_in in (sides if step % 2 else sides[::-1]):
            m = plain if net == "one process" else nets[net]
            rows: Any = slice(0, per_rank) if m is plain else sample_block(batch, m.data_grid)
            comm.barrier()
            b0 = comm.stats.total_bytes()
            calls: list[tuple[Any, str, tuple]] = []
            with (_without_communication() if stand_in else
                  _recording(calls) if step == 0 and net in nets else contextlib.nullcontext()):
                t0 = time.perf_counter()
                F.cross_entropy(m(x[rows]), y[rows]).backward()
                opts[net].step()
                opts[net].zero_grad()
                dt = time.perf_counter() - t0
            side = f"{net} without communication" if stand_in else net
            if calls:
                moved[side] = comm.stats.total_bytes() - b0
                recorded[side] = calls
            if step >= warmup:
                times.setdefault(side, []).append(dt)
    med = {k: statistics.median(v) * 1e3 for k, v in _slowest(comm, times).items()}
    alone = {k: _replay(comm, c, steps) for k, c in recorded.items()}
    alone = {k: max(t.item() for t in comm.allgather(torch.tensor([v], dtype=torch.float64)))
             * 1e3 for k, v in alone.items()}
    return {"ms": med, "bytes": moved, "alone": alone,
            "calls": {k: len(c) for k, c in recorded.items()}}


def run_ceiling(steps: int, warmup: int, runs: int) -> list[dict[str, Any]]:
    """:func:`ceiling` for both models at 1 and 2 samples per rank on 2 MPI ranks, the hybrid
    being the planner's plan of ``--layouts`` (its results file), or, where that is missing,
    the planner's plan for this machine calibrated here first; prints what the hybrid's
    communication costs against its ratio to sample parallelism."""
    layouts_file = RESULTS / "end_to_end_layouts.json"
    planned = {(r["model"], r["per_rank"]): r["planner"]
               for r in (json.loads(layouts_file.read_text()) if layouts_file.exists() else [])}
    rows = []
    lines = [f"the hybrid's ceiling: the planner's plan and sample parallelism as they run and "
             f"with their communication replaced by local stand-ins (same local work, no data "
             f"moved), 2 MPI ranks, {runs} runs of {steps} interleaved steps (medians of the "
             "slower rank; the range over runs)", "",
             "| model | samples/rank | sample ms | hybrid ms | sample/hybrid (≥1.3) | hybrid "
             "without communication ms | one process at the per-rank batch ms | sample/hybrid "
             "without communication | the hybrid's communication ms | its collectives alone, "
             "back to back ms | its collectives, bytes per rank | sample without communication "
             "ms | sample's collectives alone ms |", "|---|---|---|---|---|---|---|---|---|---|"
             "---|---|---|"]
    with WorkerPool("mpi", 2, timeout=120.0, task_timeout=1800.0) as pool:
        for name in LAYOUTS:
            for per_rank in (1, 2):
                config = planned.get((name, per_rank))
                if config is None:
                    config = pool.run(_planned, name, per_rank)[0]
                res = [pool.run(ceiling, name, per_rank, steps, warmup, config)[0]
                       for _ in range(runs)]
                ms = [r["ms"] for r in res]

                def span(f: Any, fmt: str = "{:.1f}") -> str:
                    v = [f(m) for m in ms]
                    return f"{fmt.format(min(v))}–{fmt.format(max(v))}"

                alone = [r["alone"] for r in res]
                rows.append({"model": name, "per_rank": per_rank, "planner": config,
                             "ms": ms, "bytes": res[0]["bytes"], "alone": alone,
                             "calls": res[0]["calls"]})
                cells = [name, str(per_rank), span(lambda m: m["sample"]),
                         span(lambda m: m["hybrid"]),
                         span(lambda m: m["sample"] / m["hybrid"], "{:.2f}"),
                         span(lambda m: m["hybrid without communication"]),
                         span(lambda m: m["one process"]),
                         span(lambda m: m["sample"] / m["hybrid without communication"],
                              "{:.2f}"),
                         span(lambda m: m["hybrid"] - m["hybrid without communication"]),
                         f"{min(a['hybrid'] for a in alone):.1f}–"
                         f"{max(a['hybrid'] for a in alone):.1f}",
                         f"{res[0]['calls']['hybrid']}, {res[0]['bytes']['hybrid'] / 2**20:.2f} "
                         "MiB",
                         span(lambda m: m["sample without communication"]),
                         f"{min(a['sample'] for a in alone):.1f}–"
                         f"{max(a['sample'] for a in alone):.1f}"]
                lines.append("| " + " | ".join(cells) + " |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "end_to_end_ceiling.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / "end_to_end_ceiling.md").write_text(text)
    print(f"wrote {RESULTS / 'end_to_end_ceiling.md'}")
    return rows


def _planned(comm: Any, name: str, per_rank: int) -> dict:
    """Runs on every rank: the planner's plan for ``name`` at ``per_rank`` samples per rank
    on this machine, calibrated here first (as :func:`layouts`)."""
    from distconv.machines import calibrate
    from distconv.planner import plan_network

    torch.set_num_threads(1)
    machine = calibrate(comm, sizes=(1, 1 << 16), repeats=3)
    return plan_network(build_model(name), (per_rank * comm.size, 3, SIZE, SIZE),
                        world_size=comm.size, machine=machine, max_model=comm.size).config()


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


def memory(name: str, config: dict, p: int, batch: int) -> dict[str, Any]:
    model = build_model(name)
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


#: (model, backend, ranks, samples per rank) of the full run: both models on 2 ranks at 1, 2 and
#: (ResNet-18, the global batch of 16) 8 samples per rank; the WRN on 4 ranks as well
FULL = ([("resnet18", b, 2, n) for b in ("mpi", "gloo") for n in (1, 2, 8)]
        + [("wrn", b, p, n) for b in ("mpi", "gloo") for p in (2, 4) for n in (1, 2)])


def _ratio(med: dict[str, float], a: str, b: str) -> float | None:
    return med[a] / med[b] if a in med and b in med else None


def run(cases: list[tuple[str, str, int, int]], steps: int, warmup: int) -> list[dict[str, Any]]:
    rows = []
    pools: dict[tuple[str, int], Any] = {}
    try:
        for name, backend, p, b in cases:
            if (backend, p) not in pools:
                for key in list(pools):  # one world at a time on this machine
                    pools.pop(key).close()
                pools[(backend, p)] = WorkerPool(backend, p, timeout=120.0, task_timeout=1800.0)
            res = pools[(backend, p)].run(measure, name, backend, b, steps, warmup)[0]
            med = {k: statistics.median(v) * 1e3 for k, v in res["times"].items()}
            info = {k: memory(name, c, p, b * p) for k, c in
                    (("sample", sample_config(p)), ("hybrid", hybrid_config(name, p)))}
            explained = {k: [sum(e) for e in info[k]["explained"]] for k in ("sample", "hybrid")}
            counted = {k: [r[i] for r in res["counted"]]
                       for i, k in enumerate(("sample", "hybrid"))}
            row = {"model": name, "backend": backend, "ranks": p, "per_rank": b,
                   "median_ms": med,
                   "ratios": {
                       "sample/ddp": _ratio(med, "sample", "ddp"),
                       "sample-local-bn/ddp": _ratio(med, "sample-local-bn", "ddp"),
                       "sample-frozen-bn/ddp-frozen-bn": _ratio(med, "sample-frozen-bn",
                                                                "ddp-frozen-bn"),
                       "sample/one-process": _ratio(med, "sample", "one-process"),
                       "ddp/one-process": _ratio(med, "ddp", "one-process"),
                       "sample/hybrid": _ratio(med, "sample", "hybrid"),
                       "hybrid/hybrid-pipelined": _ratio(med, "hybrid", "hybrid-pipelined")},
                   "bytes_counted": counted, "bytes_explained": explained,
                   "bytes_match": counted == explained,
                   "memory": {k: info[k]["memory"] for k in info},
                   "model_parallel_share": info["hybrid"]["model_parallel_share"]}
            rows.append(row)
            print(_line(row), flush=True)
    finally:
        for pool in pools.values():
            pool.close()
    return rows


def _line(r: dict[str, Any]) -> str:
    ms, q = r["median_ms"], r["ratios"]

    def f(v: float | None, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    cells = [r["model"], r["backend"], str(r["ranks"]), str(r["per_rank"])]
    cells += [f(ms.get(k), ".1f") for k in SIDES]
    cells += [f(q[k]) for k in ("sample/ddp", "sample-local-bn/ddp",
                                "sample-frozen-bn/ddp-frozen-bn", "sample/one-process",
                                "ddp/one-process", "sample/hybrid", "hybrid/hybrid-pipelined")]
    cells += [f(r["model_parallel_share"], ".3f"), "yes" if r["bytes_match"] else "NO"]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| model | backend | ranks | samples/rank | one process ms | DDP ms | DDP BN frozen ms | "
          "sample ms | sample local BN ms | sample BN frozen ms | hybrid ms | hybrid pipelined ms | "
          "sample/DDP (≤1.3) | local/DDP (≤1.05) | frozen/DDP frozen (≤1.05) | "
          "sample/one process (≤0.75) | DDP/one process | sample/hybrid (≥1.3) | "
          "hybrid/pipelined | mp-layer memory vs 1/(C×F) | bytes = explain |\n"
          "|" + "---|" * 21)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']} {r['backend']} P={r['ranks']} b={r['per_rank']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(rows)), 4.6), layout="constrained")
    sides = [k for k in SIDES if any(k in r["median_ms"] for r in rows)]
    width = 0.85 / len(sides)
    for i, key in enumerate(sides):
        vals = [r["median_ms"].get(key, 0.0) for r in rows]
        ax.bar([x + (i - len(sides) / 2 + 0.5) * width for x in xs], vals, width, label=key)
    ax.set_xticks(list(xs), labels, rotation=25, ha="right", fontsize=7)
    ax.set_ylabel("training step, ms (slowest rank, median)")
    ax.set_yscale("log")
    ax.set_title("Training step: one process, DDP and parallelize's sides")
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gloo, 2 ranks, 2 steps")
    parser.add_argument("--case", action="append", default=[], metavar="MODEL:BACKEND:P:B",
                        help="run only this case of the full run (repeatable), e.g. "
                             "resnet18:gloo:2:8; the results files are not written")
    # 30 timed steps per side: on a machine whose step times swing by 10-20% from one minute to
    # the next, medians of 10 moved ratios by 0.1 between runs
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", action="store_true",
                        help="where a sample-parallel step's time goes, next to DDP (gloo, 2 ranks)")
    parser.add_argument("--one-process", action="store_true",
                        help="a parallelized model on one process against the plain module")
    parser.add_argument("--stages", action="store_true",
                        help="the hybrid's split stages alone (ResNet-18 layer3-4), sample vs "
                             "hybrid on 2 MPI ranks")
    parser.add_argument("--layouts", action="store_true",
                        help="hybrid layouts (and the planner's) against sample parallelism on 2 "
                             "MPI ranks, both models, 1-2 samples per rank")
    parser.add_argument("--ceiling", action="store_true",
                        help="what the hybrid's communication costs: the planner's plan and "
                             "sample parallelism with and without it (MPI, 2 ranks)")
    parser.add_argument("--runs", type=int, default=3,
                        help="--layouts, --ceiling: interleaved runs")
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
    if args.layouts:
        run_layouts(args.steps, args.warmup, args.runs)
        return
    if args.ceiling:
        run_ceiling(args.steps, args.warmup, args.runs)
        return
    if args.stages:
        rows = run_stages(args.steps)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "end_to_end_stages.json").write_text(json.dumps(rows, indent=1))
        return
    print(HEADER)
    if args.case:
        cases = []
        for text in args.case:
            parts = text.split(":")
            if len(parts) != 4 or parts[0] not in ("resnet18", "wrn") or parts[1] not in (
                    "gloo", "mpi") or not (parts[2].isdigit() and parts[3].isdigit()):
                parser.error(f"--case {text!r}: expected MODEL:BACKEND:P:B with MODEL resnet18 "
                             "or wrn, BACKEND gloo or mpi, P and B positive ints")
            cases.append((parts[0], parts[1], int(parts[2]), int(parts[3])))
        run(cases, args.steps, args.warmup)
        return
    if args.quick:
        rows = run([("resnet18", "gloo", 2, 2), ("wrn", "gloo", 2, 1)], 2, 1)
    else:
        rows = run(FULL, args.steps, args.warmup)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "end_to_end.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / "end_to_end.md").write_text(HEADER + "\n" + "\n".join(map(_line, rows)) + "\n")
    plot(rows, RESULTS / "end_to_end.png")
    print(f"wrote {RESULTS / 'end_to_end.md'}")


if __name__ == "__main__":
    main()
