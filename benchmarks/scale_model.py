"""The paper's results at Lassen scale, on paper: the calibrated §4 model and the planner.

With the Lassen profile (:mod:`distconv.machines.lassen`: 4 V100 per node, NVLink2 in a socket,
X-bus between sockets, dual-rail EDR between nodes) and ResNet-50, WRN-50-2 and WRN-50-4:

* **Fig. 4** -- gradient allreduce of conv_3 (ResNet-50's stage-3 3x3 conv, 128 channels at
  28x28): the global allreduce of sample parallelism against the segmented allreduces of 2-, 4-
  and 8-way channel parallelism (stationary-x; channel groups inside a socket / node).
* **Fig. 6** -- conv_5 (stage-5 3x3 conv, 512 channels at 7x7) weak scaling at 32 samples per N
  row: forward + backward + allreduce of sample, stationary-x/-y/-w.
* **Figs. 7-8** -- end to end, ResNet-50 at 32, WRN-50-2 at 16 and WRN-50-4 at 8 samples per N
  row: R rows (global batch s·R) on P = k·R GPUs, k = 1 (sample parallelism), 2, 4, 8; hand
  configs (stationary-x everywhere; stationary-y where y > x; spatial early blocks) and the
  planner's; which wins, the speedup over sample parallelism at the same batch, and the
  planner's choices against the paper's.

* **U-Net 3-D** -- ``unet3d`` on 256³ and 128³ volumes, one per N row: spatial (D, D×H, D×H×W) and
  hybrid hand configs against the planner's plan at 8 to 256 GPUs, and whether any hand config
  is priced below the plan.

Writes ``benchmarks/results/scale_model.{json,md}`` and ``scale_model_fig{4,6,7}.png``.

    .venv/bin/python benchmarks/scale_model.py --jobs 14  # full (~4 min on 16 cores)
    .venv/bin/python benchmarks/scale_model.py --quick    # fewer scales
    .venv/bin/python benchmarks/scale_model.py --unet3d   # the U-Net 3-D rows only (~2 min)
    .venv/bin/python benchmarks/scale_model.py --paper-scale  # scale_model_paper.{json,md} (~4 min)
    .venv/bin/python benchmarks/scale_model.py --fig78-speedups  # predicted speedups (~2 min)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from distconv.comm.base import allreduce_bytes  # noqa: E402
from distconv.machines import lassen  # noqa: E402
from distconv.models import ResNet, unet3d  # noqa: E402
from distconv.perfmodel import ConvProblem, conv_cost  # noqa: E402
from distconv.planner import plan_network, predict, trace_network  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
CONV_3 = ConvProblem(32, 128, 128, 28, 28, 3, padding=1, bias=False)
CONV_5 = ConvProblem(32, 512, 512, 7, 7, 3, padding=1, bias=False)


def wrn50(k: int) -> ResNet:
    """ResNet-50 (k=1) or WRN-50-k: bottleneck widths times k, outer channels unchanged
    (torchvision's definition). The stem is distconv.models' 3x3 conv, not a 7x7 one."""
    with torch.device("meta"):
        return ResNet([3, 4, 6, 3], [64 * k, 128 * k, 256 * k, 512 * k], expansion=4 // k,
                      stem=64, num_classes=1000)


# --------------------------------------------------------------------------- Fig. 4
def fig4(machine: Any, worlds: list[int]) -> list[dict[str, Any]]:
    m = CONV_3.in_channels * CONV_3.out_channels * 9
    rows = []
    for P in worlds:
        row: dict[str, Any] = {"P": P}
        for k in (1, 2, 4, 8):
            if P % k or P // k < 2:
                continue
            layout = (("N", P // k), ("C", k)) if k > 1 else (("N", P),)
            shard = m // k
            nbytes = allreduce_bytes(shard, 0, P // k, 4)
            row[f"seg{k}"] = machine.collective_time("allreduce", P // k, nbytes, layout=layout,
                                                     dims=("N",))
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- Fig. 6
FIG6 = [("sample", 1, "stationary-x", {}), ("x 2", 2, "stationary-x", {"C": 2}),
        ("x 4", 4, "stationary-x", {"C": 4}), ("x 8", 8, "stationary-x", {"C": 8}),
        ("y 4", 4, "stationary-y", {"F": 4}), ("w 2x2", 4, "stationary-w", {"C": 2, "F": 2}),
        ("w 4x2", 8, "stationary-w", {"C": 4, "F": 2})]


def fig6(machine: Any, worlds: list[int], per_row: int = 32) -> list[dict[str, Any]]:
    rows = []
    for P in worlds:
        row: dict[str, Any] = {"P": P}
        for label, k, alg, model_dims in FIG6:
            if P % k or P < k:
                continue
            pb = ConvProblem(per_row * P // k, 512, 512, 7, 7, 3, padding=1, bias=False)
            grid = {"N": P // k, **model_dims}
            c = conv_cost(pb, grid, alg, machine, ranks="corners")
            row[label] = c.total
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- Figs. 7-8
def _stage(name: str) -> str:
    return name.split(".")[0] if name.startswith("layer") else "stem"


def hand_configs(net: Any, R: int, k: int) -> dict[str, dict[str, Any]]:
    P = R * k
    sample = {"grid": {"N": P}, "algorithm": "sample"}
    if k == 1:
        return {"sample": {"default": sample, "layers": []}}
    x = {"grid": {"N": R, "C": k}, "algorithm": "stationary-x"}
    y = {"grid": {"N": R, "F": k}, "algorithm": "stationary-y"}
    sp = {"grid": {"N": R, "H": k}, "algorithm": "spatial"}
    bigger_y = [c.name for c in net.convs if _elems(c.out_shape) > _elems(c.in_shape)]
    layers_x = [{"match": "layer*", **x}]
    return {
        f"x {k}": {"default": sample, "layers": layers_x},
        f"x/y {k}": {"default": sample, "layers": [{"match": n, **y} for n in bigger_y
                                                   if n != "conv1"] + layers_x},
        f"+spatial {k}": {"default": sample, "layers": [{"match": "conv1", **sp},
                                                       {"match": "layer1.*", **sp}] + layers_x},
    }


def _elems(shape: tuple[int, ...]) -> int:
    return shape[1] * shape[2] * shape[3]


def fig78(machine: Any, rows_list: list[int], nets: list[tuple[str, int, int]], *,
          jobs: int = 1) -> list[dict[str, Any]]:
    """Every (net, rows, k): the hand configs and the planner (in ``jobs`` processes)."""
    tasks = [(machine, net, R, k) for net in nets for R in rows_list for k in (1, 2, 4, 8)]
    if jobs <= 1:
        return [r for t in tasks for r in _fig78_one(*t)]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(jobs) as pool:
        return [r for rows in pool.map(_fig78_one, *zip(*tasks)) for r in rows]


def _fig78_one(machine: Any, spec: tuple[str, int, int], R: int, k: int) -> list[dict[str, Any]]:
    name, widen, per_row = spec
    B, P = per_row * R, R * k
    net = trace_network(wrn50(widen), (B, 3, 224, 224))
    out = []
    for label, cfg in hand_configs(net, R, k).items():
        p = predict(net, cfg, world_size=P, machine=machine)
        out.append({"net": name, "R": R, "k": k, "P": P, "B": B, "config": label,
                    "step": p.step_time, "memory": p.memory})
    t0 = time.perf_counter()
    try:
        plan = plan_network(net, world_size=P, machine=machine, max_model=8, max_sample=R)
    except ValueError as exc:  # nothing fits in the GPU's memory
        print(f"{name} R={R} k={k}: {exc}", flush=True)
        return out
    choices = Counter((_stage(lp.conv.name), lp.choice.algorithm) for lp in plan.layers)
    grids = Counter(str(lp.choice) for lp in plan.layers)
    out.append({"net": name, "R": R, "k": k, "P": P, "B": B, "config": "planner",
                "step": plan.step_time, "memory": plan.memory,
                "plan_seconds": time.perf_counter() - t0,
                "choices": {f"{s} {a}": n for (s, a), n in sorted(choices.items())},
                "grids": dict(grids.most_common(4)),
                "y_layers": [lp.conv.name for lp in plan.layers
                             if lp.choice.algorithm == "stationary-y"],
                "explain": plan.explain()})
    print(f"{name} R={R} k={k} P={P}: planner {plan.step_time * 1e3:.1f} ms "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return out


def paper_config(net: Any, R: int, k: int) -> dict[str, Any]:
    """The paper's kind of layout (§6): spatial in the early blocks (the stem, layer1, layer2),
    channel/filter parallelism late -- stationary-y where y is larger than x, stationary-x
    elsewhere -- on k GPUs per N row."""
    sp = {"grid": {"N": R, "H": k}, "algorithm": "spatial"}
    x = {"grid": {"N": R, "C": k}, "algorithm": "stationary-x"}
    y = {"grid": {"N": R, "F": k}, "algorithm": "stationary-y"}
    late = [c.name for c in net.convs if _stage(c.name) in ("layer3", "layer4")]
    bigger_y = {c.name for c in net.convs if _elems(c.out_shape) > _elems(c.in_shape)}
    return {"default": {"grid": {"N": R * k}, "algorithm": "sample"},
            "layers": [{"match": n, **(y if n in bigger_y else x)} for n in late]
            + [{"match": "conv1", **sp}, {"match": "layer1.*", **sp}, {"match": "layer2.*", **sp}]}


def _stage_prices(reports: list[Any], modules: set[str], machine: Any) -> dict[str, float]:
    """Seconds of each stage's modules (forward and backward on the critical path, conversions
    into them included; residual adds, the fused gradient buckets and the running statistics
    are the whole step's)."""
    from distconv.ops.pricing import timeline

    stages: dict[str, list[Any]] = {}
    for lay in reports:
        if lay.name in modules:
            stages.setdefault(_stage(lay.name), []).append(lay)
    out = {}
    for st, lays in stages.items():
        t = timeline(lays, machine)
        out[st] = t.forward + t.backward
    return out


def paper_scale(machine: Any, cases: list[tuple[str, int, int, int, int]]
                ) -> list[dict[str, Any]]:
    """Per (net, widen, samples per row, rows R, GPUs per row k): the planner's time to plan,
    its price next to every hand config's and the paper's layout's, its picks per stage next to
    the paper's with each stage's price under both, and the speedup over sample parallelism on
    R GPUs at the same global batch (the paper's Figs. 7-8 measure it)."""
    out = []
    for name, widen, per_row, R, k in cases:
        B, P = per_row * R, R * k
        net = trace_network(wrn50(widen), (B, 3, 224, 224))
        t0, c0 = time.perf_counter(), time.process_time()
        plan = plan_network(net, world_size=P, machine=machine, max_model=8, max_sample=R)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        paper = paper_config(net, R, k)
        hands = {**hand_configs(net, R, k), "paper": paper}
        priced = {label: predict(net, cfg, world_size=P, machine=machine)
                  for label, cfg in hands.items()}
        sample = predict(net, {"default": {"grid": {"N": R}, "algorithm": "sample"}},
                         world_size=R, machine=machine)
        mine = {lp.conv.name: str(lp.choice) for lp in plan.layers}
        theirs = {lp.conv.name: str(lp.choice) for lp in priced["paper"].layers}
        stages: dict[str, dict[str, Any]] = {}
        for c in net.convs:
            st = stages.setdefault(_stage(c.name), {"planner": Counter(), "paper": Counter()})
            st["planner"][mine[c.name]] += 1
            st["paper"][theirs[c.name]] += 1
        modules = {n for n, _ in net.gm.named_modules() if n}
        p_stage = _stage_prices(plan.reports, modules, machine)
        q_stage = _stage_prices(priced["paper"].reports, modules, machine)
        for st, row in stages.items():
            row["planner"], row["paper"] = dict(row["planner"]), dict(row["paper"])
            row["planner_seconds"], row["paper_seconds"] = p_stage.get(st), q_stage.get(st)
        row = {"net": name, "R": R, "k": k, "P": P, "B": B, "plan_seconds": seconds,
               "plan_cpu_seconds": cpu, "planner": plan.step_time, "priced": plan.priced,
               "configs": {label: p.step_time for label, p in priced.items()},
               "sample_on_R": sample.step_time,
               "speedup_planner": sample.step_time / plan.step_time,
               "speedup_paper_layout": sample.step_time / priced["paper"].step_time,
               "stages": stages, "plan": plan.config()}
        row["behind"] = [label for label, t in row["configs"].items() if t < plan.step_time]
        hand = {label: t for label, t in row["configs"].items() if label != "paper"}
        row["best_hand"] = min(hand, key=hand.__getitem__)
        out.append(row)
        print(f"{name} R={R} k={k} P={P}: planned in {seconds:.1f} s, {plan.step_time * 1e3:.2f} "
              f"ms; " + ", ".join(f"{label} {t * 1e3:.2f}" for label, t in
                                  row["configs"].items())
              + f"; speedup over sample on {R} GPUs {row['speedup_planner']:.2f}x (paper's "
              f"layout {row['speedup_paper_layout']:.2f}x)", flush=True)
        for st, r in stages.items():
            print(f"  {st}: planner {r['planner']} {_ms(r['planner_seconds'])} ms | paper "
                  f"{r['paper']} {_ms(r['paper_seconds'])} ms", flush=True)
    return out


def paper_scale_report(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: per paper-scale row the time to plan, the plan's price against the best hand
    config's and the paper's layout's, and the picks per stage next to the paper's."""
    md = ["## Paper scale: time to plan and the plan against the hand configs (ms per step)", "",
          "Wall seconds depend on the machine's other load; CPU seconds are the planner's own.",
          ""]
    md += _table(
        ["net", "GPUs (R × k)", "batch", "planned in (s: wall, CPU)", "plans priced", "plan",
         "best hand config", "paper's layout", "hand configs below the plan"],
        [[r["net"], f"{r['P']} ({r['R']} × {r['k']})", r["B"],
          f"{r['plan_seconds']:.1f}, {r['plan_cpu_seconds']:.1f}", r["priced"], _ms(r["planner"]),
          f"{_ms(r['configs'][r['best_hand']])} ({r['best_hand']})",
          _ms(r["configs"]["paper"]), ", ".join(r["behind"]) or "none"] for r in rows])
    for r in rows:
        md += [f"### {r['net']}, {r['P']} GPUs: picks per stage (ms of the stage's layers)", ""]
        md += _table(["stage", "planner", "ms", "paper's layout", "ms"], [
            [st, ", ".join(f"{c} ({n})" for c, n in v["planner"].items()),
             _ms(v["planner_seconds"]), ", ".join(f"{c} ({n})" for c, n in v["paper"].items()),
             _ms(v["paper_seconds"])] for st, v in r["stages"].items()])
    return md


# --------------------------------------------------------------------------- Figs. 7-8 speedups
#: what the paper states of Figs. 7-8's end-to-end results, with its source. Its per-point
#: values (step times and speedups per network, rows and GPUs per row) are in its figures only,
#: which are not available here; nothing below is read off them or estimated.
PAPER_STATED = {
    "up to 4.1x reductions in training time for residual networks": (
        "the paper's abstract (Dryden et al., SC'19, doi:10.1145/3295500.3356207), as printed at "
        "https://sc19.supercomputing.org/proceedings/tech_paper/tech_paper_pages/pap446.html"),
    "4x reductions in allreduce overhead": ("the same abstract"),
}
SPEEDUP_ROWS, SPEEDUP_KS = [32, 256], [2, 4, 8]
NETS = [("ResNet-50", 1, 32), ("WRN-50-2", 2, 16), ("WRN-50-4", 4, 8)]


def _anatomy(reports: list[Any], machine: Any) -> dict[str, float]:
    """A priced step taken apart: local compute, and on the critical path halo exchanges, the
    norms' statistics collectives and every other collective (channel/filter parallelism's
    reduce-scatters and allgathers, conversions between layouts); the gradient allreduces (all,
    and the part not hidden behind backward); and the step with one term changed -- no overlap
    of the gradient allreduces with backward, or one kind of collective free."""
    from dataclasses import replace

    from distconv.ops.pricing import timeline

    def kind(st: Any) -> str | None:
        if st.after is not None:
            return None
        if "halo" in st.what:
            return "halo"
        return "norms" if "statistics" in st.what or "Σ" in st.what else "collectives"

    def without(drop: str) -> float:
        return timeline([replace(lay, steps=[st for st in lay.steps if kind(st) != drop])
                         for lay in reports], machine).step

    t = timeline(reports, machine)
    out = {"step": t.step, "gradients": t.gradients,
           "compute": sum(lay.forward_seconds + lay.backward_seconds - sum(lay.overlap.values())
                          for lay in reports),
           "exposed": t.step - t.forward - t.backward,
           "no_overlap": t.forward + t.backward + machine.comm_overlap * t.gradients}
    for part in ("halo", "norms", "collectives"):
        out[part] = sum(st.seconds(machine) for lay in reports for st in lay.steps
                        if kind(st) == part)
        out[f"{part}_free"] = without(part)
    return out


def fig78_speedups(machine: Any, nets: list[tuple[str, int, int]] = NETS,
                   rows_list: list[int] = SPEEDUP_ROWS, ks: list[int] = SPEEDUP_KS,
                   plan_at: tuple[int, int] | None = (32, 4)) -> list[dict[str, Any]]:
    """The §4 model's speedup of every hand config and the paper's layout on k GPUs per N row
    over sample parallelism on the R rows alone (same global batch), as priced and with one
    term changed at a time: no gradient-allreduce overlap, free halos, the V100's plain FLOP
    rate for every local convolution (no occupancy term), and free activation collectives (the
    ceiling), or free statistics collectives of the norms; the planner's plan at ``plan_at``
    (rows, k)."""
    flat = lassen(occupancy=False)
    out = []
    for name, widen, per_row in nets:
        for R in rows_list:
            net = trace_network(wrn50(widen), (per_row * R, 3, 224, 224))
            sample = {"default": {"grid": {"N": R}, "algorithm": "sample"}}
            base = predict(net, sample, world_size=R, machine=machine)
            base_flat = predict(net, sample, world_size=R, machine=flat)
            b = _anatomy(base.reports, machine)
            for k in ks:
                configs = {**hand_configs(net, R, k), "paper": paper_config(net, R, k)}
                if plan_at == (R, k):
                    plan = plan_network(net, world_size=R * k, machine=machine, max_model=8,
                                        max_sample=R)
                    configs["planner"] = plan.config()
                for label, cfg in configs.items():
                    p = predict(net, cfg, world_size=R * k, machine=machine)
                    a = _anatomy(p.reports, machine)
                    q = predict(net, cfg, world_size=R * k, machine=flat)
                    out.append({
                        "net": name, "R": R, "k": k, "P": R * k, "B": per_row * R,
                        "config": label.replace(f" {k}", ""), "anatomy": a, "base": b,
                        "speedup": b["step"] / a["step"],
                        "no_overlap": b["no_overlap"] / a["no_overlap"],
                        **{f"{part}_free": b[f"{part}_free"] / a[f"{part}_free"]
                           for part in ("halo", "norms", "collectives")},
                        "flat_rate": base_flat.step_time / q.step_time})
                print(f"{name} R={R} k={k}: " + ", ".join(
                    f"{r['config']} {r['speedup']:.2f}x" for r in out[-len(configs):]), flush=True)
    return out


#: the terms :func:`fig78_speedups` changes, as the report names them
ASSUMPTIONS = {"no_overlap": "no allreduce overlap",
               "halo_free": "halos free",
               "flat_rate": "no occupancy term",
               "norms_free": "norm statistics free",
               "collectives_free": "other collectives free"}
#: the parts of a step the report shows, in its order
PARTS = ("compute", "halo", "norms", "collectives", "exposed")


def fig78_report(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: the predicted speedups per configuration, what each term of the model does to
    them, and the paper's stated figures beside them."""
    md = ["## Figs. 7-8: predicted speedups over sample parallelism on the R rows' GPUs", "",
          ("The speedup of each configuration on P = k·R GPUs over sample parallelism on R GPUs "
           "at the same global batch (R rows of 32 samples for ResNet-50, 16 for WRN-50-2, 8 "
           "for WRN-50-4), as the §4 model with the op handlers prices it on `lassen()`, and "
           "with one term of the model changed at a time: gradient allreduces not overlapped "
           "with backward; halo exchanges free; every local convolution at the V100's plain "
           "FLOP rate (`lassen(occupancy=False)`); the batch norms' statistics collectives "
           "free (exact batch norm sums its statistics over every sample of the global batch, "
           "on the critical path); every other collective on the critical path free -- the "
           "reduce-scatters and allgathers of stationary-x/-y/-w and the conversions between "
           "layouts (a ceiling, not an assumption)."), "",
          ("**The paper's per-point measured speedups are not available here**: its text is "
           "not in this repository and no public source found states the values of Figs. 7-8; "
           "the only stated figures are the abstract's:"), ""]
    md += [f"- \"{text}\" ({src})" for text, src in PAPER_STATED.items()] + [""]
    best = max(rows, key=lambda r: r["speedup"])
    md += [(f"The model's largest speedup in this table is {best['speedup']:.2f}x "
            f"({best['net']}, R = {best['R']}, k = {best['k']}, {best['config']}) against the "
            "paper's \"up to 4.1x\", whose baseline and scale the abstract does not state."), ""]
    head = ["net", "R", "k", "GPUs", "config", "speedup", *ASSUMPTIONS.values(),
            ("step: compute / halo / norm statistics / other collectives / exposed allreduce "
             "(ms)")]
    table = [[r["net"], r["R"], r["k"], r["P"], r["config"], f"{r['speedup']:.2f}x",
              *(f"{r[key]:.2f}x" for key in ASSUMPTIONS),
              " / ".join(_ms(r["anatomy"][key]) for key in PARTS)]
             for r in rows]
    md += _table(head, table)
    bases = {(r["net"], r["R"]): r["base"] for r in rows}
    md += ["Sample parallelism on R GPUs (the base), ms: " + "; ".join(
        f"{net} R = {R}: step {_ms(b['step'])} = " + " / ".join(_ms(b[key]) for key in PARTS)
        for (net, R), b in bases.items()), ""]
    md += [(f"What each term does to the speedups (relative change over the {len(rows)} "
            "configurations, median of the absolute change and the largest):"), ""]
    size = {}
    for key, label in ASSUMPTIONS.items():
        change = [(r[key] - r["speedup"]) / r["speedup"] for r in rows]
        size[key] = sorted(abs(c) for c in change)[len(change) // 2]
        top = max(rows, key=lambda r: abs(r[key] - r["speedup"]))
        md.append(f"- {label}: median {size[key]:.1%}, largest "
                  f"{(top[key] - top['speedup']) / top['speedup']:+.1%} ({top['net']}, R = "
                  f"{top['R']}, k = {top['k']}, {top['config']})")
    order = sorted(ASSUMPTIONS, key=size.__getitem__, reverse=True)
    md += ["", ("Ordered by their median effect: " + ", ".join(
        f"{ASSUMPTIONS[k]} ({size[k]:.1%})" for k in order) + ". Where the paper's measured "
        "values are set beside these predictions, the terms at the head of this order are "
        "the first to examine for a difference."), ""]
    return md


# --------------------------------------------------------------------------- U-Net 3-D
#: the 3-D U-Net row: distconv.models.unet3d at the widths of Cicek et al.'s 3-D U-Net (32 to
#: 256 channels over four levels) on one-channel cubic volumes, one volume per N row -- the
#: large-volume regime LBANN's spatial parallelism is for (one 256³ volume's activations do not
#: fit a 16 GiB V100; a 128³ one does)
UNET_BASE, UNET_DEPTH = 32, 3
UNET_CASES = [(256, 2, 4), (256, 8, 4), (256, 8, 8), (256, 32, 8), (128, 8, 4)]  # side, R, k


def unet3d_net(R: int, side: int) -> Any:
    with torch.device("meta"):
        model = unet3d(in_channels=1, num_classes=3, base=UNET_BASE, depth=UNET_DEPTH)
    return trace_network(model, (R, 1, side, side, side))


def unet3d_configs(R: int, k: int) -> dict[str, tuple[dict[str, Any], bool]]:
    """Hand configs on P = k·R GPUs, each with whether the planner's space holds it (one grid
    and algorithm per convolution, the batch read on the sample grid or on the first layer's
    spatial grid; mixed grids such as C×D are outside it): spatial over D, D×H (and D×H×W), a
    hybrid of spatial levels with a channel-parallel bottom and a filter-parallel first
    up-convolution, and two as ``docs/volumes.md`` writes them (the batch read onto the
    spatial grid; a C×D bottom)."""
    def spatial(grid: dict[str, int]) -> dict[str, Any]:
        return {"grid": {"N": R, **grid}, "algorithm": "spatial"}

    out = {f"D {k}": ({"default": spatial({"D": k})}, True)}
    if k >= 4:
        out[f"D2×H{k // 2}"] = ({"default": spatial({"D": 2, "H": k // 2})}, True)
    if k == 8:
        out["D2×H2×W2"] = ({"default": spatial({"D": 2, "H": 2, "W": 2})}, True)
    deep = [{"match": "bottom.*", "grid": {"N": R, "C": k}, "algorithm": "stationary-x"},
            {"match": "up.0", "grid": {"N": R, "F": k}, "algorithm": "stationary-y"}]
    out[f"hybrid D {k} + C/F bottom"] = ({"default": spatial({"D": k}), "layers": deep}, True)
    out[f"D {k}, batch read on D"] = (
        {"default": spatial({"D": k}), "data": {"N": R, "D": k}}, True)
    mixed = [{"match": "bottom.*", "grid": {"N": R, "C": 2, "D": k // 2},
              "algorithm": "stationary-x"},
             {"match": "up.*", "grid": {"N": R, "F": 2, "D": k // 2}, "algorithm": "stationary-y"}]
    out[f"hybrid C2×D{k // 2} bottom"] = ({"default": spatial({"D": k}), "layers": mixed}, False)
    return out


def unet3d_rows(machine: Any, cases: list[tuple[int, int, int]] = UNET_CASES
                ) -> list[dict[str, Any]]:
    """Per (volume side, rows R, GPUs per row k): every hand config's price and memory, the
    planner's plan
    (its price, memory, picks per level and time to plan), sample parallelism on R GPUs (the
    speedup's base; its memory says whether it could run at all), and the hand configs priced
    below the plan -- whether the planner's space holds them, and whether they fit the GPU."""
    rows = []
    for side, R, k in cases:
        P = R * k
        net = unet3d_net(R, side)
        hands = {}
        for label, (cfg, in_space) in unet3d_configs(R, k).items():
            p = predict(net, cfg, world_size=P, machine=machine)
            hands[label] = {"step": p.step_time, "memory": p.memory, "in_space": in_space,
                            "fits": p.memory <= machine.memory}
        sample = predict(net, {"default": {"grid": {"N": R}, "algorithm": "sample"}},
                         world_size=R, machine=machine)
        t0 = time.perf_counter()
        plan = plan_network(net, world_size=P, machine=machine, max_model=8, max_sample=R)
        seconds = time.perf_counter() - t0
        levels: dict[str, Counter] = {}
        for lp in plan.layers:
            levels.setdefault(_level(lp.conv.name), Counter())[str(lp.choice)] += 1
        behind = [label for label, h in hands.items() if h["step"] < plan.step_time]
        row = {"R": R, "k": k, "P": P, "B": R, "side": side, "plan_seconds": seconds,
               "planner": plan.step_time, "planner_memory": plan.memory, "priced": plan.priced,
               "configs": hands, "sample_on_R": sample.step_time,
               "sample_on_R_memory": sample.memory,
               "sample_on_R_fits": sample.memory <= machine.memory,
               "speedup_planner": sample.step_time / plan.step_time,
               "levels": {lv: dict(c) for lv, c in levels.items()}, "plan": plan.config(),
               "behind": behind,
               "behind_in_space": [b for b in behind if hands[b]["in_space"] and hands[b]["fits"]]}
        rows.append(row)
        print(f"U-Net 3-D {side}³ R={R} k={k} P={P}: planned in {seconds:.1f} s, "
              f"{plan.step_time * 1e3:.2f} ms; " + ", ".join(
                  f"{label} {h['step'] * 1e3:.2f}" for label, h in hands.items())
              + f"; behind: {behind or 'none'}", flush=True)
    return rows


def _level(name: str) -> str:
    """A U-Net convolution's level: ``down.1.3`` -> ``down.1``, ``bottom.0`` -> ``bottom``."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] in ("down", "dec", "up") else parts[0]


def unet3d_report(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: per world size the plan against every hand config, and the check that no hand
    config in the planner's space that fits the GPU is priced below the plan."""
    md = [(f"## U-Net 3-D: one-channel cubic volumes, one per N row, "
           f"`unet3d(base={UNET_BASE}, depth={UNET_DEPTH})` (ms per step; GiB per rank)"), ""]
    for r in rows:
        md += [f"### {_case(r)}", ""]
        table = [["planner", _ms(r["planner"]), f"{r['planner_memory'] / 2**30:.2f}", "yes",
                  "-", f"{r['speedup_planner']:.2f}x"]]
        for label, h in r["configs"].items():
            mark = "**below the plan**" if label in r["behind"] else ""
            table.append([label, _ms(h["step"]), f"{h['memory'] / 2**30:.2f}",
                          "yes" if h["in_space"] else "no", mark,
                          f"{r['sample_on_R'] / h['step']:.2f}x"])
        table.append([f"sample on {r['R']} GPUs (the base)", _ms(r["sample_on_R"]),
                      f"{r['sample_on_R_memory'] / 2**30:.2f}", "-", "", "1.00x"])
        md += _table(["config", "step", "GiB/rank", "in the planner's space", "",
                      "speedup vs sample on R"], table)
        if not r["sample_on_R_fits"]:
            md += [(f"Sample parallelism on {r['R']} GPUs needs "
                    f"{r['sample_on_R_memory'] / 2**30:.1f} GiB per rank, over the V100's 16 "
                    "GiB: the speedups are against a step that could not run."), ""]
        data = r["plan"].get("data", {"N": r["P"]})
        md += [f"Planned in {r['plan_seconds']:.1f} s ({r['priced']} plans priced); data grid "
               f"{'×'.join(f'{d}{e}' for d, e in data.items())}; picks per level: "
               + "; ".join(f"{lv} " + ", ".join(f"{c} ({n})" for c, n in ch.items())
                           for lv, ch in r["levels"].items()), ""]
    bad = [(r, b) for r in rows for b in r["behind_in_space"]]
    out_space = [(r, b) for r in rows for b in r["behind"] if b not in r["behind_in_space"]]
    md.append("**No hand config priced below the planner's plan** (in its space, fitting 16 GiB): "
              + ("holds in every case." if not bad else "**fails**: " + "; ".join(
                  _below(r, b) for r, b in bad) + "."))
    md.append("\n\n**Priced below the plan but outside the planner's space** (a mixed grid) "
              "**or over the GPU's memory**: " + ("; ".join(_below(r, b) for r, b in out_space)
                                                   + "." if out_space else "none."))
    return md + [""]


def _case(r: dict[str, Any]) -> str:
    return f"{r['side']}³, R = {r['R']} rows, k = {r['k']} GPUs per row, P = {r['P']}"


def _below(r: dict[str, Any], label: str) -> str:
    h = r["configs"][label]
    return (f"{_case(r)}: {label} {_ms(h['step'])} ms against the plan's {_ms(r['planner'])} "
            f"({h['step'] / r['planner'] - 1:+.2%})")


def crossover(machine: Any, batch: int, worlds: list[int], *, jobs: int = 1
              ) -> list[dict[str, Any]]:
    """ResNet-50 at a fixed global batch on growing P, the planner free to split samples down
    to one per GPU: where channel/filter parallelism overtakes sample parallelism."""
    tasks = [(machine, batch, P) for P in worlds if P <= 8 * batch]
    if jobs <= 1:
        return [_free_plan(*t) for t in tasks]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_free_plan, *zip(*tasks)))


def _free_plan(machine: Any, batch: int, P: int) -> dict[str, Any]:
    net = trace_network(wrn50(1), (batch, 3, 224, 224))
    plan = plan_network(net, world_size=P, machine=machine, max_model=8)
    sample = sum(lp.choice.algorithm == "sample" for lp in plan.layers)
    by_stage: dict[str, Counter] = {}
    for lp in plan.layers:
        by_stage.setdefault(_stage(lp.conv.name), Counter())[lp.choice.algorithm] += 1
    return {"P": P, "B": batch, "per_gpu": batch / P, "step": plan.step_time,
            "model_parallel_share": 1 - sample / len(plan.layers),
            "stages": {st: c.most_common(1)[0][0] for st, c in by_stage.items()}}


def y_bigger(widen: int) -> list[str]:
    net = trace_network(wrn50(widen), (32, 3, 224, 224))
    return [c.name for c in net.convs if _elems(c.out_shape) > _elems(c.in_shape)]


def y_share(widen: int) -> tuple[int, int]:
    net = trace_network(wrn50(widen), (32, 3, 224, 224))
    convs = net.convs
    return sum(_elems(c.out_shape) > _elems(c.in_shape) for c in convs), len(convs)


# --------------------------------------------------------------------------- output
def plots(res: dict[str, Any], prefix: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("seg1", "global (sample)"), ("seg2", "segmented, 2-way"),
                       ("seg4", "segmented, 4-way"), ("seg8", "segmented, 8-way")):
        pts = [(r["P"], r[key] * 1e3) for r in res["fig4"] if key in r]
        ax.plot(*zip(*pts), marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="allreduce time (ms)",
           title="Fig. 4 on paper: conv_3 gradient allreduce, Lassen model")
    ax.legend()
    files.append(_save(fig, prefix, "fig4"))
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, *_ in FIG6:
        pts = [(r["P"], r[label] * 1e3) for r in res["fig6"] if label in r]
        ax.plot(*zip(*pts), marker="o", label=label)
    ax.set(xscale="log", xlabel="GPUs", ylabel="fwd + bwd + allreduce (ms)",
           title="Fig. 6 on paper: conv_5 weak scaling, 32 samples per N row")
    ax.legend(ncol=2)
    files.append(_save(fig, prefix, "fig6"))
    nets = sorted({r["net"] for r in res["fig78"]}, key=lambda n: n[-1])
    fig, axes = plt.subplots(1, len(nets), figsize=(5 * len(nets), 4), squeeze=False)
    for ax, net in zip(axes[0], nets):
        rows = [r for r in res["fig78"] if r["net"] == net]
        for k in (1, 2, 4, 8):
            for cfg in ("sample", "planner", f"x {k}"):
                pts = sorted((r["B"], r["step"] * 1e3) for r in rows
                             if r["k"] == k and r["config"] == cfg)
                if pts and not (cfg == "planner" and k == 1):
                    ax.plot(*zip(*pts), marker="o", linestyle="-" if cfg == "planner" else ":",
                            label=f"{cfg} (k={k})" if cfg != f"x {k}" else f"x, k={k}")
        ax.set(xscale="log", yscale="log", xlabel="global batch (N rows x samples per row)",
               ylabel="step time (ms)", title=f"{net}: P = k x rows")
        ax.legend(fontsize=7)
    fig.suptitle("Figs. 7-8 on paper: end to end, Lassen model")
    files.append(_save(fig, prefix, "fig7"))
    return files


def _save(fig: Any, prefix: Path, name: str) -> str:
    fig.tight_layout()
    path = f"{prefix}_{name}.png"
    fig.savefig(path, dpi=110)
    return path


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out + [""]


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.3f}"


def report(res: dict[str, Any]) -> str:
    """Markdown: the tables behind every figure and the point-by-point comparison."""
    md = ["# The paper at Lassen scale, on paper (distconv.perfmodel + distconv.planner)", "",
          "Machine: `distconv.machines.lassen()`; every number's source is listed at the end.",
          ""]
    f4, f4r = res["fig4"], {r["P"]: r for r in res["fig4_ring"]}
    md += ["## Fig. 4: conv_3 gradient allreduce, global vs segmented (ms)", ""]
    md += _table(["GPUs", "global", "2-way", "4-way", "8-way", "8-way reduction (tree)",
                  "8-way reduction (ring)"],
                 [[r["P"], _ms(r.get("seg1")), _ms(r.get("seg2")), _ms(r.get("seg4")),
                   _ms(r.get("seg8")),
                   f"{r['seg1'] / r['seg8']:.2f}x" if "seg8" in r else "-",
                   f"{f4r[r['P']]['seg1'] / f4r[r['P']]['seg8']:.2f}x" if "seg8" in r else "-"]
                  for r in f4])
    md += ["## Fig. 6: conv_5 weak scaling at 32 samples per N row (fwd + bwd + allreduce, ms)",
           ""]
    labels = [f[0] for f in FIG6]
    md += _table(["GPUs"] + labels, [[r["P"]] + [_ms(r.get(k)) for k in labels]
                                     for r in res["fig6"]])
    md += ["## Figs. 7-8: end to end (step time, ms; P = k x rows; same global batch per row "
           "block)", ""]
    rows = res["fig78"]
    keyed: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        keyed.setdefault((r["net"], r["R"], r["k"]), {})[r["config"]] = r
    table = []
    for (net, R, k), cfgs in sorted(keyed.items(), key=lambda t: (t[0][0][-1], t[0][1:])):
        base = keyed[(net, R, 1)]["sample"]["step"]
        hand = {c: r for c, r in cfgs.items() if c != "planner"}
        best = min(hand, key=lambda c: hand[c]["step"])
        pl = cfgs.get("planner", {"step": math.inf, "memory": math.inf, "grids": {}})
        table.append([net, R, cfgs[best]["B"], k, cfgs[best]["P"], best,
                      _ms(hand[best]["step"]), f"{hand[best]['memory'] / 2**30:.1f}",
                      _ms(pl["step"]), f"{base / pl['step']:.2f}x", f"{pl['memory'] / 2**30:.1f}",
                      ", ".join(f"{g} ({n})" for g, n in pl["grids"].items()) or
                      "no plan fits 16 GiB"])
    md += _table(["net", "rows", "batch", "k", "GPUs", "best hand config", "its step",
                  "its GiB/rank", "planner step", "planner speedup vs sample on `rows` GPUs",
                  "planner GiB/rank", "planner's most used layouts (layers)"], table)
    md += ["## Crossover: ResNet-50 at a global batch of 512, the planner free to split "
           "samples", ""]
    md += _table(["GPUs", "samples per GPU", "planner step (ms)", "layers not sample-parallel",
                  "per stage"],
                 [[r["P"], f"{r['per_gpu']:g}", _ms(r["step"]),
                   f"{r['model_parallel_share']:.0%}",
                   ", ".join(f"{k} {v}" for k, v in r["stages"].items())]
                  for r in res["crossover"]])
    md += unet3d_report(res["unet3d"])
    md += comparison(res) + ["## Sources of the machine's numbers", ""]
    md += [f"- {k}: {v}" for k, v in res["sources"].items()] + [""]
    md += [f"Plots: {', '.join(Path(p).name for p in res['plots'])}", ""]
    return "\n".join(md)


def comparison(res: dict[str, Any]) -> list[str]:
    """Point by point: what the paper reports, what the model predicts, agree or not."""
    f4 = [r for r in res["fig4"] if "seg8" in r]
    red = [r["seg1"] / r["seg8"] for r in f4]
    red_ring = [r["seg1"] / r["seg8"] for r in res["fig4_ring"] if "seg8" in r]
    f6 = res["fig6"]
    grow = {k: f6[-1][k] / f6[0][k] for k in ("sample", "x 8") if k in f6[0] and k in f6[-1]}
    y_big, n_convs = res["y_share"]["ResNet-50"]
    plans = [r for r in res["fig78"] if r["config"] == "planner"]
    speedups = {}
    for r in plans:
        base = next(b for b in res["fig78"] if b["net"] == r["net"] and b["R"] == r["R"]
                    and b["k"] == 1 and b["config"] == "sample")
        speedups[(r["net"], r["R"], r["k"])] = base["step"] / r["step"]
    best = max(speedups.items(), key=lambda t: t[1])
    hybrid = [r for r in plans if r["k"] > 1]
    by_stage: dict[str, Counter] = {}
    for r in hybrid:
        for key, n in r["choices"].items():
            stage, alg = key.split(" ", 1)
            by_stage.setdefault(stage, Counter())[alg] += n
    total = sum(sum(c.values()) for c in by_stage.values())
    algos = sum(by_stage.values(), Counter())
    first = by_stage.get("stem", Counter()) + by_stage.get("layer1", Counter())
    early = first["spatial"] / max(sum(first.values()), 1)
    bigger = set(res["y_bigger"]["ResNet-50"])
    y_rn = [n for r in hybrid if r["net"] == "ResNet-50" for n in r["y_layers"]]
    w8 = sorted({g for r in hybrid if r["net"] == "WRN-50-4" for g in r["grids"]
                 if g.startswith("stationary-w") and ("C4×F2" in g or "C2×F4" in g)})
    md = ["## Where the model agrees with the paper, and where not", ""]
    md.append(
        f"1. **Segmented allreduce (Fig. 4).** The paper measures about 4x less allreduce time "
        f"at 8-way segmentation ('only 4x', not 8x) and at least 4x at large scale. The model "
        f"gives {red[0]:.2f}x at {f4[0]['P']} GPUs falling to {red[-1]:.2f}x at {f4[-1]['P']} "
        f"with tree-latency collectives (the profile's default), and "
        f"{min(red_ring):.2f}-{max(red_ring):.2f}x with ring latency. 'Only 4x' at 8-way: "
        "**agrees in kind** -- 8-way segmentation cannot give 8x in bandwidth, because the 8 "
        "concurrent segments of a node share its two EDR rails (one member per node: 4 rings "
        "through one adapter), so the bandwidth term shrinks only 2x and the latency term "
        "decides; the paper's 4x lies between the tree and ring bounds. '>= 4x at large "
        "scale': **disagrees** with the tree model, whose reduction falls with P (the "
        "latency ratio log P / log(P/8) tends to 1), **agrees** with the ring model (8x). "
        "The measurement says the allreduces of this 0.6 MB gradient were latency-bound "
        "with a latency that grows faster than log P; which schedule NCCL/Aluminum used per "
        "message size is not in the model.")
    md.append(
        f"2. **conv_5 weak scaling (Fig. 6).** From {f6[0]['P']} to {f6[-1]['P']} GPUs the "
        f"model's layer time grows {grow.get('sample', float('nan')):.2f}x for sample "
        f"parallelism and {grow.get('x 8', float('nan')):.2f}x for 8-way stationary-x: compute "
        "per GPU is constant, and only the allreduce grows (logarithmically). Channel/filter "
        "parallelism is faster per layer at every scale because each GPU holds 1/k of the "
        "row's samples' work; stationary-x, -y and 2x2 -w are within a few percent of each "
        "other for this square layer (x = y), as the paper finds.")
    md.append(
        f"3. **Layers with y larger than x.** In the traced ResNet-50, {y_big} of {n_convs} "
        f"convolutions ({y_big / n_convs:.0%}) have more output than input elements (every "
        "block's expanding 1x1 conv3, the stem, layer1's projection), against the paper's "
        "'about 1/10'. The count is by element: the paper may count differently (e.g. by "
        "bytes moved by stationary-x vs -y including halos, or only 3x3 layers); this is a "
        "disagreement in the statement, not in the model.")
    md.append(
        f"4. **End to end (Figs. 7-8).** The planner's best speedup over sample parallelism at "
        f"the same global batch is {best[1]:.2f}x ({best[0][0]}, {best[0][1]} rows, k = "
        f"{best[0][2]}), against the paper's up to 4.1x reduction in training time. Adding GPUs "
        "per N row always helps in the model; how much depends on the roofline's occupancy "
        "term (small late layers leave a V100 idle) -- without it the model splits samples "
        "down to one per GPU at almost perfect efficiency, which real GPUs do not deliver.")
    stages = "; ".join(
        f"{st}: " + ", ".join(f"{a} {n / sum(c.values()):.0%}" for a, n in c.most_common(3))
        for st, c in sorted(by_stage.items(), key=lambda t: (t[0] != "stem", t[0])))
    md.append(
        "5. **The planner's choices** (plans with k > 1; N limited to the rows, as in the "
        "paper's configs). Overall: " + ", ".join(f"{a} {n / total:.0%}"
                                                   for a, n in algos.most_common())
        + f". Per stage -- {stages}. Paper: '+spatial' in the early blocks -- "
        + ("**agrees**" if early >= 0.5 else "**disagrees**")
        + f" ({early:.0%} of the stem's and layer1's choices are spatial); stationary-x mostly -- "
        + ("**agrees**" if algos.most_common(1)[0][0] == "stationary-x" else "**disagrees**")
        + ": the model prefers spatial parallelism well past the early blocks "
        "(a halo of one row costs far less than the reduce-scatter of y or the allgather of "
        "x whenever an image has more rows than the grid has parts), and turns to channel/"
        "filter parallelism only in the last stages where 7x7 or 14x14 images leave "
        "too few rows; stationary-y where y > x -- "
        + (f"**agrees**: {sum(n in bigger for n in y_rn)} of {len(y_rn)} stationary-y choices "
           "in ResNet-50 plans are layers whose y is larger than x"
           if y_rn else "no stationary-y choice in the ResNet-50 plans")
        + "; 4x2 stationary-w for WRN-50-4 -- "
        + (f"**agrees**: the WRN-50-4 plans use {', '.join(w8)}" if w8 else
           "**disagrees**: no 8-way stationary-w in the WRN-50-4 plans")
        + ". The model has no cost for the halo exchange's latency inside cuDNN or for "
        "spatially split batch norm's statistics allreduce beyond its bytes, which is where "
        "real spatial parallelism loses to what the paper measured.")
    cross = res.get("crossover", [])
    over = next((r for r in cross if r["model_parallel_share"] > 0.5), None)
    first = next((r for r in cross if r["model_parallel_share"] > 0), None)
    md.append(
        "6. **Crossover.** With the global batch fixed at 512 and the planner free to split "
        "samples, channel/filter/spatial parallelism first appears at "
        + (f"{first['P']} GPUs ({first['per_gpu']:g} samples per GPU)" if first else
           "no scale in the sweep")
        + " and takes over most layers at "
        + (f"{over['P']} GPUs ({over['per_gpu']:g} samples per GPU)" if over else
           "no scale in the sweep")
        + ". The paper's crossover, where channel parallelism beats sample parallelism, is "
        "likewise at a few samples per GPU; in the model it is set by the occupancy term "
        "(late 7x7 layers with few samples leave the V100 idle) and by the gradient allreduce "
        "of the late, weight-heavy layers.")
    return md + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer scales and networks")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--jobs", type=int, default=1, help="processes for the planner runs")
    ap.add_argument("--paper-scale", action="store_true",
                    help="only the paper-scale rows: ResNet-50 on 1024 GPUs, WRN-50-2 on 256 "
                         "and WRN-50-4 on 256, planned, timed and set against the paper's layout")
    ap.add_argument("--unet3d", action="store_true",
                    help="only the U-Net 3-D rows: hand configs and the planner's plan at "
                         f"{len(UNET_CASES)} world sizes (writes scale_model_unet3d.{{json,md}})")
    ap.add_argument("--fig78-speedups", action="store_true",
                    help="only Figs. 7-8's predicted speedups per configuration, with what "
                         "drives them (writes scale_model_fig78.{json,md}; about 2 min)")
    args = ap.parse_args()
    machine = lassen()
    if args.fig78_speedups:
        rows = fig78_speedups(machine)
        args.out.mkdir(parents=True, exist_ok=True)
        Path(args.out / "scale_model_fig78.json").write_text(
            json.dumps(rows, indent=1, default=str))
        md = "\n".join([f"# {Path(__file__).name} --fig78-speedups", ""] + fig78_report(rows))
        Path(args.out / "scale_model_fig78.md").write_text(md)
        print(md)
        return
    if args.unet3d:
        rows = unet3d_rows(machine)
        args.out.mkdir(parents=True, exist_ok=True)
        Path(args.out / "scale_model_unet3d.json").write_text(
            json.dumps(rows, indent=1, default=str))
        md = "\n".join([f"# {Path(__file__).name} --unet3d", "",
                        "Machine: `distconv.machines.lassen()`; prices are `explain`'s.", ""]
                       + unet3d_report(rows))
        Path(args.out / "scale_model_unet3d.md").write_text(md)
        print(md)
        return
    if args.paper_scale:
        rows = paper_scale(machine, [("ResNet-50", 1, 32, 256, 4), ("WRN-50-2", 2, 16, 64, 4),
                                     ("WRN-50-4", 4, 8, 32, 8)])
        args.out.mkdir(parents=True, exist_ok=True)
        Path(args.out / "scale_model_paper.json").write_text(
            json.dumps(rows, indent=1, default=str))
        md = "\n".join([f"# {Path(__file__).name} --paper-scale", "",
                        ("Machine: `distconv.machines.lassen()`; prices are `explain`'s; planned "
                         "with `max_model=8`, `max_sample=R`."), ""] + paper_scale_report(rows))
        Path(args.out / "scale_model_paper.md").write_text(md)
        print(md)
        return
    worlds = [8, 32, 128, 512, 2048] if args.quick else [8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    rows_list = [4, 64] if args.quick else [4, 32, 256]
    nets = [("ResNet-50", 1, 32), ("WRN-50-2", 2, 16), ("WRN-50-4", 4, 8)]
    res: dict[str, Any] = {"machine": repr(machine), "sources": dict(machine.sources)}
    res["fig4"] = fig4(machine, worlds)
    res["fig4_ring"] = fig4(lassen(schedule="ring"), worlds)
    res["fig6"] = fig6(machine, worlds)
    res["y_share"] = {n: y_share(w) for n, w, _ in nets}
    res["y_bigger"] = {n: y_bigger(w) for n, w, _ in nets}
    res["fig78"] = fig78(machine, rows_list, nets[:2] if args.quick else nets, jobs=args.jobs)
    res["crossover"] = crossover(machine, 512, [64, 128, 256, 512, 1024, 2048], jobs=args.jobs)
    res["unet3d"] = unet3d_rows(machine, UNET_CASES[:2] if args.quick else UNET_CASES)
    args.out.mkdir(parents=True, exist_ok=True)
    prefix = args.out / "scale_model"
    res["plots"] = plots(res, prefix)
    Path(f"{prefix}.json").write_text(json.dumps(res, indent=1, default=str))
    md = report(res)
    Path(f"{prefix}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
