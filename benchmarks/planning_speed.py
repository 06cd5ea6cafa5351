"""How long ``auto`` and ``plan_network`` take to plan: the branchy torchvision models of the zoo
at world 4 (the zoo's input, float64 as the zoo trains them), and ResNet-50 on 1024 Lassen GPUs
as ``scale_model.py --paper-scale`` plans it (``max_model=8``, ``max_sample=R``).

CPU seconds are this process's own (``time.process_time``: what the search costs, whatever
else the machine runs); wall seconds depend on the machine's load. The plans' prices are
listed too (explain's price of the resolved config, ms per step on Lassen).

Writes ``benchmarks/results/planning_speed.{json,md}``.

    .venv/bin/python benchmarks/planning_speed.py            # every model
    .venv/bin/python benchmarks/planning_speed.py --models densenet121 --no-paper
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tests.vision_ops  # noqa: E402

tests.vision_ops.install()  # torchvision's models import beside the CPU torch

import torch  # noqa: E402

from distconv.machines import lassen  # noqa: E402
from distconv.parallel.auto import resolve_auto  # noqa: E402
from distconv.parallel.capture import trace  # noqa: E402
from distconv.parallel.config import ParallelConfig  # noqa: E402
from distconv.planner import plan_network, trace_network  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
WORLD = 4
SHAPE = (4, 3, 32, 32)
#: the models timed, by torchvision name (keyword arguments to build them)
MODELS: dict[str, dict[str, Any]] = {
    "googlenet": {"aux_logits": False, "init_weights": False}, "efficientnet_b0": {},
    "regnet_x_400mf": {}, "densenet121": {}, "regnet_y_400mf": {}, "resnet50": {},
    "mobilenet_v3_small": {}, "mobilenet_v3_large": {},
}
#: CPU seconds before this change, as issue 43 reports them (4 ranks, lassen)
BEFORE = {("densenet121", "plan_network"): 459.0, ("efficientnet_b0", "auto"): "51-74",
          ("regnet_x_400mf", "auto"): "51-74", ("googlenet", "plan_network"): 46.0,
          ("ResNet-50 @ 1024", "plan_network"): 10.5}


def _timed(fn: Any) -> tuple[Any, float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def _write(rows: list[dict[str, Any]]) -> None:
    """The results so far (each row as it is measured: a long run leaves what it measured)."""
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "planning_speed.json").write_text(json.dumps(rows, indent=1))
    (OUT / "planning_speed.md").write_text(report(rows))


def zoo_rows(names: list[str], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import torchvision

    for name in names:
        model = getattr(torchvision.models, name)(weights=None, num_classes=3,
                                                  **MODELS.get(name, {})).double()
        plan, wall, cpu = _timed(lambda: plan_network(copy.deepcopy(model), SHAPE,
                                                      world_size=WORLD, machine="lassen"))
        rows.append({"model": name, "how": "plan_network", "wall_s": wall, "cpu_s": cpu,
                     "plans_priced": plan.priced, "step_ms": plan.step_time * 1e3})
        print(rows[-1], flush=True)
        _write(rows)
        gm = trace(copy.deepcopy(model), SHAPE)
        cfg = ParallelConfig({"default": {"algorithm": "auto"}}, world_size=WORLD)
        (resolved, decisions), wall, cpu = _timed(
            lambda: resolve_auto(gm, cfg, SHAPE, "lassen"))
        rows.append({"model": name, "how": "auto", "wall_s": wall, "cpu_s": cpu,
                     "plans_priced": None, "decisions": len(decisions)})
        print(rows[-1], flush=True)
        _write(rows)
    return rows


def paper_row() -> dict[str, Any]:
    from benchmarks.scale_model import wrn50

    R, k = 256, 4
    net = trace_network(wrn50(1), (32 * R, 3, 224, 224))
    plan, wall, cpu = _timed(lambda: plan_network(net, world_size=R * k, machine=lassen(),
                                                  max_model=8, max_sample=R))
    row = {"model": "ResNet-50 @ 1024", "how": "plan_network", "wall_s": wall, "cpu_s": cpu,
           "plans_priced": plan.priced, "step_ms": plan.step_time * 1e3}
    print(row, flush=True)
    return row


def report(rows: list[dict[str, Any]]) -> str:
    md = ["# planning_speed.py", "",
          f"`plan_network` and `auto` (`resolve_auto`, default `auto`) on torchvision models at "
          f"world {WORLD}, input {SHAPE}, float64, machine `lassen`; ResNet-50 on 1024 Lassen "
          "GPUs (256 × 4, batch 8192) as `scale_model.py --paper-scale` plans it. CPU seconds are "
          "the planner's own; wall seconds depend on the machine's load (2 shared cores here). "
          "Before: issue 43's figures.", "",
          "| model | how | CPU s | wall s | before (CPU s) | plans priced | plan's step (ms) |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        before = BEFORE.get((r["model"], r["how"]), "")
        step = f"{r['step_ms']:.3f}" if r.get("step_ms") is not None else ""
        md.append(f"| {r['model']} | {r['how']} | {r['cpu_s']:.1f} | {r['wall_s']:.1f} | "
                  f"{before} | {r.get('plans_priced') or ''} | {step} |")
    return "\n".join(md) + "\n"


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--no-paper", action="store_true", help="leave out ResNet-50 at 1024 GPUs")
    ap.add_argument("--out", type=Path, default=OUT, help="where the results go (default "
                    "benchmarks/results)")
    ap.add_argument("--paper-first", action="store_true",
                    help="time ResNet-50 at 1024 GPUs before the zoo models")
    args = ap.parse_args()
    OUT = args.out
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    if args.paper_first and not args.no_paper:
        rows.append(paper_row())
        _write(rows)
    zoo_rows(args.models, rows)
    if not args.no_paper and not args.paper_first:
        rows.append(paper_row())
    _write(rows)
    print(report(rows))


if __name__ == "__main__":
    main()
