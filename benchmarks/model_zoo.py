"""The model zoo's support matrix: every zoo model (``tests/zoo/catalogue.py``: MONAI, torchvision,
timm, segmentation-models-pytorch, made tiny) under every config (sample, spatial, the deepest
convolutions over channels or over filters, ``auto``, ``plan_network``'s plan), two SGD steps on 4
thread ranks in fp64 against one process: exact (with the largest relative error), refused (the
exception, the node and module it names, the reason), or an internal error. Then ``distkfac.KFAC``
on each model's channel config against one process's K-FAC (the layers it does not precondition, by
name), and the step time of each sample-parallel model against torch DDP on a real gloo world
(medians of interleaved steps, the slower rank).

Writes ``benchmarks/results/model_zoo.{md,json}`` (rewritten after every model, so a long run
that is stopped keeps what it did)::

    .venv/bin/python benchmarks/model_zoo.py                      # everything (long: see below)
    .venv/bin/python benchmarks/model_zoo.py --models 'timm.*,smp.*' --skip-configs auto,plan \\
        --no-kfac --no-timing                                     # a part of the matrix
    .venv/bin/python benchmarks/model_zoo.py --update --kfac-only --models timm.Swin
                                                                  # one model's K-FAC row

A package that does not import here (for any reason) skips its models, saying why; torchvision
loads beside the CPU torch through ``tests/vision_ops.py``. ``auto`` and ``plan`` search a
plan per model and can take minutes on branchy graphs (DenseNet, GoogLeNet): ``--skip-configs
auto,plan`` leaves them out, and the table says which configs ran.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import re
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.vision_ops import install as install_vision_ops  # noqa: E402

install_vision_ops()  # before anything imports torchvision (timm, MONAI and smp do)

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


def matrix(entries: list[Entry], configs: list[str],
           save: Callable[[dict[str, dict[str, Outcome]]], None] | None = None
           ) -> dict[str, dict[str, Outcome]]:
    """Every pair's outcome; ``save(rows so far)`` after each model."""
    from tqdm import tqdm

    out: dict[str, dict[str, Outcome]] = {}
    with tqdm(total=len(entries) * len(configs), desc="matrix", unit="pair") as bar:
        for entry in entries:
            out[entry.name] = {}
            for config in configs:
                bar.set_postfix_str(f"{entry.name} {config}")
                out[entry.name][config] = run_pair(entry, config)
                bar.update()
            if save is not None:
                save(out)
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
    for name, row in results.items():  # (a cell not run yet: "-", while a run goes on)
        lines.append(f"| {name} | " + " | ".join(_cell(row[c], refusals) if c in row else "-"
                                                  for c in configs) + " |")
    ran_of = {c: [row[c].kind for row in results.values()
                  if c in row and row[c].kind != "skipped"] for c in configs}
    lines.append("| exact of those that ran | " + " | ".join(
        f"{ran_of[c].count('exact')} of {len(ran_of[c])}" for c in configs) + " |")
    skipped = {name: row[configs[0]].message for name, row in results.items()
               if configs[0] in row and row[configs[0]].kind == "skipped"}
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()) + "."]
    lines += ["", "Configs: `sample` `{N: 4}`; `spatial` `{N: 2, H: 2}` (`D` for volumes), data "
              "on the same grid; `channels` / `filters` the convolutions that read the coarsest "
              "maps on `{N: 2, C: 2}` stationary-x / `{N: 2, F: 2}` stationary-y, the rest "
              "sample; `auto` the `auto` default priced on `lassen`; `plan` "
              "`distconv.planner.plan_network(..., machine='lassen').config()`.", ""]
    if refusals:
        lines += ["Refusals:", ""] + [f"{i}. {r}" for i, r in enumerate(refusals, 1)] + [""]
        lines += ["Refused pairs by construct (the refusal's first sentence, names left out):",
                  "", "| pairs | refusal | pairs refused |", "|---|---|---|"]
        lines += [f"| {len(v)} | {k} | {', '.join(v)} |" for k, v in by_construct(results)]
        lines.append("")
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


def by_construct(results: dict[str, dict[str, Outcome]]) -> list[tuple[str, list[str]]]:
    """The refused pairs grouped by what refused them: the refusal's first sentence with the
    names of modules and nodes in backquotes or quotes left out, most pairs first."""
    import re

    groups: dict[str, list[str]] = {}
    for name, row in results.items():
        for config, o in row.items():
            if o.kind != "refused":
                continue
            text = re.sub(r"^(parallelize|explain): ", "", " ".join(o.message.split()))
            first = re.split(r"(?<=[.;])\s", text, maxsplit=1)[0]
            key = f"{o.raised}: " + re.sub(r"('[^']*'|`[^`]*`|\"[^\"]*\")", "…", first)[:160]
            groups.setdefault(key, []).append(f"{name} {config}")
    return sorted(groups.items(), key=lambda kv: -len(kv[1]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="*", help="fnmatch patterns of zoo names, comma-separated")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--skip-configs", default="", help="configs left out, comma-separated "
                    "(e.g. auto,plan: their searches are slow on branchy graphs)")
    ap.add_argument("--no-kfac", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--update", action="store_true", help="rerun only the --models and "
                    "--configs given and keep every other cell of the existing results (configs "
                    "not run before are added as columns)")
    ap.add_argument("--kfac-only", action="store_true", help="with --update: rerun only the "
                    "K-FAC rows of the --models given, keeping every matrix cell and step time "
                    "of the existing results")
    args = ap.parse_args(argv)
    if args.kfac_only and (not args.update or args.no_kfac):
        ap.error("--kfac-only reruns K-FAC rows into existing results: pass it with --update "
                 "and without --no-kfac")
    torch.set_num_threads(1)
    patterns = args.models.split(",")
    entries = [e for e in ZOO.values() if any(fnmatch.fnmatch(e.name, p) for p in patterns)]
    if not entries:
        ap.error(f"--models {args.models!r} matches none of {list(ZOO)}")
    skip = {c for c in args.skip_configs.split(",") if c}
    configs = [c for c in args.configs.split(",") if c and c not in skip]
    bad = [c for c in [*configs, *skip] if c not in CONFIGS]
    if bad:
        ap.error(f"--configs/--skip-configs: {bad} are not among {list(CONFIGS)}")
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = command_line("model_zoo.py", argv)
    header = f"Model zoo support matrix (`{cmd}`, {when}, torch {torch.__version__})"
    if skip:
        header += f"; configs not run: {', '.join(sorted(skip))}"

    def write(results: dict, kfac_rows: dict, times: dict, done: bool) -> None:
        doc = {"command": cmd, "date": when, "header": header, "finished": done,
               "configs": configs,
               "skipped_configs": sorted(skip), "counts": counts(results),
               "matrix": {m: {c: o.row() for c, o in row.items()} for m, row in results.items()},
               "refusals_by_construct": dict(by_construct(results)),
               "kfac": kfac_rows, "timing": times}
        text = table(results, configs, kfac_rows, times, header + ("" if done else
                                                                    " (unfinished)"))
        if done:
            write_results(args.out, "model_zoo", doc, text)
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "model_zoo.json").write_text(json.dumps(doc, indent=1))
            (args.out / "model_zoo.md").write_text(text + "\n")

    old: dict[str, Any] = {"matrix": {}, "kfac": {}, "timing": {}}
    ran = configs  # the configs this run measures; ``configs``: the results' columns
    if args.update:
        old = json.loads((args.out / "model_zoo.json").read_text())
        configs = [c for c in CONFIGS if c in old["configs"] or c in ran]
        skip = {c for c in CONFIGS if c not in configs}
        first = old.get("header") or (
            f"Model zoo support matrix (`{old['command']}`, {old['date']}, torch "
            f"{torch.__version__})" + (f"; configs not run: {', '.join(old['skipped_configs'])}"
                                      if old.get("skipped_configs") else ""))
        if not skip:  # every column has run now
            first = re.sub(r"; configs not run: [^;]*", "", first)
        what = "K-FAC" if args.kfac_only else ",".join(ran)
        header = f"{first}; {what} of {args.models} rerun by `{cmd}`, {when}"
        cmd, when = old["command"], old["date"]
    kept = {m: {c: Outcome(**o) for c, o in row.items()} for m, row in old["matrix"].items()}

    def merged(new: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
        """Every model of the zoo in zoo order: the new rows, else the kept ones."""
        return {m: new[m] if m in new else before[m] for m in ZOO if m in new or m in before}

    def cells(new: dict[str, dict[str, Outcome]]) -> dict[str, dict[str, Outcome]]:
        """Every model's row: the kept cells, with this run's in their place (configs order)."""
        rows = {m: {**kept.get(m, {}), **new.get(m, {})} for m in ZOO
                if m in new or m in kept}
        return {m: {c: row[c] for c in configs if c in row} for m, row in rows.items()}

    results = {} if args.kfac_only else matrix(
        entries, ran,
        save=lambda rows: write(cells(rows), old["kfac"], old["timing"], False))
    results = cells(results)
    runnable = [e for e in entries if e.missing() is None]
    kfac_rows = merged({} if args.no_kfac else kfac(runnable), old["kfac"])
    write(results, kfac_rows, old["timing"], False)
    exact = [e.name for e in runnable if results[e.name].get("sample", Outcome("")).kind
             == "exact"]
    times = merged({} if args.no_timing or args.kfac_only or not exact
                   else timing(exact, args.steps, args.warmup), old["timing"])
    write(results, kfac_rows, times, True)


if __name__ == "__main__":
    main()
