"""Time to accuracy: SGD against K-FAC (1 and 2 processes, stale statistics, low-precision
factor traffic) on scikit-learn's digits, upsampled to 16x16, with a small ResNet.

Criterion.  The test accuracy (540 held-out images) is evaluated ``--evals`` times per epoch, at
evenly spaced steps; the evaluation is not counted in the time.  The time to ``--target`` is the
training time at the first evaluation from which *every* later one, to the end of the
``--epochs``, is at or above the target: after it, training can be stopped anywhere and meet the
target.  A run that ends below the target (or diverges) has no time (``-``) and counts as the
slowest in a median over seeds (``-`` when half or more of them have none).  Beside it, the
first evaluation that reaches the target (the looser rule, which credits a curve that touches
the target and falls back; the settled rule charges for falling back, which SGD at a constant
learning rate does for several epochs after it first reaches the target).  One rule for every
optimizer.  The time is wall clock: the machine's other load shows in it, so the table also
gives the training milliseconds per step.

Learning rate.  Every optimizer takes its learning rate from the same sweep ``--lrs`` on the
first seed: the lowest time to the target, ties (or no time) broken by the higher final
accuracy; the other ``--seeds`` are then run with it, and the table gives medians over all
seeds.  Every optimizer is SGD with momentum 0.9 and weight decay 5e-4 on a global batch of 64,
constant learning rate (the SGD row is just that); K-FAC preconditions the gradient before the
SGD step.  (K-FAC with the settings below at lr 0.001, outside the sweep: 4.5 and 4.25 epochs to
the target on seeds 0 and 1, against 3.0 and 2.5 at 0.003.)

K-FAC settings (``KFAC_SETTINGS``, every K-FAC row): factors every 10 steps, decompositions
every 50 (an epoch is 19 steps), damping 1e-2, KL clip 1e-3; round-robin placement.  Chosen by
``--kfac-sweep`` (1 process, seed 0, the same epochs, target, evaluations and learning rates):
from the earlier settings (factors every 2 steps, decompositions every 10, damping 3e-3, KL clip
1e-3) the update intervals, then the damping, then the KL clip, each stage keeping the lowest
time to the target (``SWEEP_STAGES``; written to
``benchmarks/results/kfac_time_to_accuracy.sweep.md``).  On one seed the settings' times
(1.2-1.7 s) differ no more than the seeds' do (1.4-2.2 s for the K-FAC row of the recorded
table): the sweep mainly bought the step cost, 32 ms a step with factors every 2 steps against
21-23 ms with every 10 (SGD in the recorded table: 18-22 ms).  Stale statistics skip a
decomposition whose factor moved less than 5% (relative) since its last one.

Reported per optimizer: the learning rate; median seconds and epochs to the target (settled, and
first reached); median training milliseconds per step; final accuracy; K-FAC's factor bytes per
step (what the factor reductions move, per rank); for stale statistics, the fraction of
scheduled decompositions skipped; for the low-precision rows, the relative error of the reduced
factors against the same reduction in fp32.

    nice -n 5 python benchmarks/kfac_time_to_accuracy.py     # the recorded table (~10 min)
    nice -n 5 python benchmarks/kfac_time_to_accuracy.py --kfac-sweep   # the settings (~13 min)
    python benchmarks/kfac_time_to_accuracy.py --epochs 6 --seeds 0 --lrs 0.01 --optimizers sgd kfac

Writes ``benchmarks/results/kfac_time_to_accuracy.json`` and ``.md`` (the sweep:
``.sweep.json`` and ``.sweep.md``).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

OUTPUT = Path(__file__).resolve().parent / "results"
SIZE = 16

#: K-FAC's settings for every K-FAC row (chosen by ``--kfac-sweep``; see the module docstring).
KFAC_SETTINGS = {"factor_update_steps": 10, "inv_update_steps": 50, "damping": 1e-2,
                 "kl_clip": 1e-3}

#: ``--kfac-sweep``: from ``SWEEP_BASE`` (the settings before the sweep), one stage after the
#: other; each stage tries its changes on the best settings so far (the starting point included,
#: not run again) and keeps the one with the lowest time to the target.
SWEEP_BASE = {"factor_update_steps": 2, "inv_update_steps": 10, "damping": 3e-3,
              "kl_clip": 1e-3}
SWEEP_STAGES = [
    [{"factor_update_steps": f, "inv_update_steps": i}
     for f, i in ((5, 20), (5, 50), (10, 20), (10, 50), (20, 100))],
    [{"damping": d} for d in (1e-3, 1e-2, 3e-2)],
    [{"kl_clip": k} for k in (1e-4, 1e-2, None)],
]


@functools.lru_cache(maxsize=1)
def load():
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    test, train = perm[:540], perm[540:]
    return x[train], y[train], x[test], y[test]


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (nn.Identity() if stride == 1 and cin == cout else
                      nn.Conv2d(cin, cout, 1, stride=stride, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


def small_resnet(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
                         nn.ReLU(), Block(16, 16, 1), Block(16, 32, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


OPTIMIZERS = {
    "sgd": {},
    "kfac": {"kfac": {}},
    "kfac stale": {"kfac": {"stale_threshold": 0.05}},
    "kfac x2": {"procs": 2, "kfac": {}},
    "kfac x2 bf16": {"procs": 2, "kfac": {"factor_comm_dtype": torch.bfloat16}},
    "kfac x2 fp16": {"procs": 2, "kfac": {"factor_comm_dtype": torch.float16}},
    "kfac x2 float21": {"procs": 2, "kfac": {"factor_comm_dtype": "float21"}},
}


def settled(accs: list[float], target: float) -> int | None:
    """Index of the first evaluation from which every later one is >= ``target``."""
    hit = None
    for i, a in enumerate(accs):
        if a < target:
            hit = None
        elif hit is None:
            hit = i
    return hit


def first_reached(accs: list[float], target: float) -> int | None:
    return next((i for i, a in enumerate(accs) if a >= target), None)


def train(comm, name: str, lr: float, seed: int, epochs: int, target: float, batch: int,
          evals: int, settings: dict) -> dict:
    import distkfac

    torch.set_num_threads(1)
    spec = OPTIMIZERS[name]
    x_tr, y_tr, x_te, y_te = load()
    model = small_resnet(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    kfac = None
    if "kfac" in spec:
        kfac = distkfac.KFAC(model, comm=comm, lr=lr, placement="round-robin",
                             **settings, **spec["kfac"])
    order = torch.Generator().manual_seed(seed + 1)
    p, r = comm.size, comm.rank
    per_epoch = len(y_tr) // batch
    marks = {round((k + 1) * per_epoch / evals) for k in range(evals)}
    seconds, accs, times, at, factor_bytes, steps, diverged = 0.0, [], [], [], 0, 0, False
    for _ in range(epochs):
        perm = torch.randperm(len(y_tr), generator=order)
        comm.barrier()
        t0 = time.perf_counter()
        for j in range(per_epoch):
            idx = perm[j * batch:(j + 1) * batch][r * batch // p:(r + 1) * batch // p]
            opt.zero_grad()
            b0 = comm.stats.total_bytes()
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            # the weights are the same on every rank: a non-finite loss stops all of them
            diverged = not math.isfinite(loss.item())
            if diverged:
                break
            loss.backward()  # factor buckets launch
            b1 = comm.stats.total_bytes()
            distkfac.allreduce_gradients(model.parameters(), comm)
            b2 = comm.stats.total_bytes()
            if kfac is not None:
                kfac.step()
            factor_bytes += b1 - b0 + comm.stats.total_bytes() - b2
            opt.step()
            steps += 1
            if j + 1 in marks:  # evaluation (rank 0's model, two threads): not timed
                comm.barrier()
                seconds += time.perf_counter() - t0
                if r == 0:
                    torch.set_num_threads(2)
                    model.eval()
                    with torch.no_grad():
                        accs.append((model(x_te).argmax(1) == y_te).float().mean().item())
                    model.train()
                    torch.set_num_threads(1)
                times.append(seconds)
                at.append(steps / per_epoch)
                comm.barrier()
                t0 = time.perf_counter()
        if diverged:  # counts as accuracy 0 from here on
            accs.append(0.0)
            times.append(seconds + time.perf_counter() - t0)
            at.append(steps / per_epoch)
            break
    if r != 0:
        return {}
    out = {"accs": accs, "times": times, "epochs": at, "steps": steps, "diverged": diverged,
           "ms_per_step": 1e3 * seconds / max(steps, 1),
           "factor_bytes_per_step": factor_bytes / max(steps, 1)}
    for key, rule in (("", settled), ("first_", first_reached)):
        hit = rule(accs, target)
        out[f"{key}seconds_to"] = None if hit is None else times[hit]
        out[f"{key}epochs_to"] = None if hit is None else at[hit]
    if kfac is not None and kfac.stale_threshold is not None:
        c = kfac.stale_counts
        out["skipped_fraction"] = c["skipped"] / max(c["scheduled"], 1)
    return out


def factor_error(comm, dtype) -> float:
    """Relative Frobenius error of the reduced factors of one batch (a trained-ish model's
    first step) in ``dtype`` against fp32 traffic."""
    import distkfac

    x_tr, y_tr, _, _ = load()
    vals = []
    for wire in (None, dtype):
        model = small_resnet(0)
        kfac = distkfac.KFAC(model, comm=comm, factor_comm_dtype=wire)
        idx = torch.arange(comm.rank * 32, comm.rank * 32 + 32)
        F.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
        kfac.step()
        vals.append(torch.cat([torch.cat([ly.a.value.reshape(-1), ly.g.value.reshape(-1)])
                               for ly in kfac.layers]))
    return float((vals[1] - vals[0]).norm() / vals[0].norm())


class Runner:
    """Runs ``train`` in this process (1 rank) or on a pool of 2 gloo workers kept for all
    2-process runs (its start-up is not in any measured time)."""

    def __init__(self, args) -> None:
        self.args, self.pool = args, None

    def __call__(self, name: str, lr: float, seed: int, settings: dict) -> dict:
        a = self.args
        job = (name, lr, seed, a.epochs, a.target, a.batch, a.evals, settings)
        if OPTIMIZERS[name].get("procs", 1) == 1:
            from distconv.comm.single import SingleCommunicator

            out = train(SingleCommunicator(timeout=900.0), *job)
        else:
            out = self._pool().run(train, *job)[0]
        show = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()
                if k not in ("accs", "times", "epochs")}
        print(f"  {name} lr={lr} seed={seed}: {show}", flush=True)
        return out

    def _pool(self):
        if self.pool is None:
            from distconv.testing import WorkerPool

            self.pool = WorkerPool("gloo", 2, timeout=900.0, task_timeout=None, echo=True)
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def pick_lr(sweep: dict) -> float:
    inf = float("inf")
    return min(sweep, key=lambda v: (sweep[v]["seconds_to"] or inf, -sweep[v]["accs"][-1]))


def median_or_none(values: list) -> float | None:
    """The median, or None when half or more are None (sorted with None as infinity)."""
    inf = float("inf")
    m = statistics.median(sorted(inf if v is None else v for v in values))
    return None if m == inf else m


def fmt(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def kfac_sweep(args, runner: Runner) -> None:
    inf = float("inf")
    rows, results = [], []

    def trial(settings: dict, stage: int) -> dict:
        sweep = {lr: runner("kfac", lr, args.seeds[0], settings) for lr in args.lrs}
        lr = pick_lr(sweep)
        best = sweep[lr]
        per_lr = "; ".join(f"{v}: {fmt(s['seconds_to'])} ({fmt(s['first_seconds_to'])})"
                           for v, s in sweep.items())
        rows.append(f"| {stage} | {settings['factor_update_steps']} | "
                    f"{settings['inv_update_steps']} | {settings['damping']:g} | "
                    f"{settings['kl_clip']} | {lr} | {fmt(best['seconds_to'])} | "
                    f"{fmt(best['epochs_to'], 2)} | {best['ms_per_step']:.0f} | "
                    f"{best['accs'][-1]:.3f} | {per_lr} |")
        print(rows[-1], flush=True)
        out = {"stage": stage, "settings": settings, "lr": lr, "seconds_to": best["seconds_to"],
               "accs": best["accs"][-1], "runs": sweep}
        results.append(out)
        return out

    best = trial(dict(SWEEP_BASE), 0)
    for stage, changes in enumerate(SWEEP_STAGES, 1):
        tried = [best] + [trial({**best["settings"], **c}, stage) for c in changes]
        best = min(tried, key=lambda t: (t["seconds_to"] or inf, -t["accs"]))
    text = "\n".join([
        f"K-FAC settings sweep: 1 process, seed {args.seeds[0]}, {args.epochs} epochs, target "
        f"{args.target} settled (first reached in brackets), {args.evals} evaluations/epoch, "
        f"lr from {' '.join(map(str, args.lrs))}.  Chosen: {best['settings']} (lr "
        f"{best['lr']}).",
        "",
        "| stage | factors every | decompositions every | damping | kl_clip | lr | "
        "s to target | epochs | ms/step | final acc | per lr: s (first) |",
        "|---|---|---|---|---|---|---|---|---|---|---|", *rows])
    print(text)
    OUTPUT.mkdir(parents=True, exist_ok=True)
    (OUTPUT / "kfac_time_to_accuracy.sweep.json").write_text(
        json.dumps({"args": vars(args), "chosen": best["settings"], "results": results},
                   indent=1, default=str))
    (OUTPUT / "kfac_time_to_accuracy.sweep.md").write_text(text + "\n")


def main() -> None:
    from distconv.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--target", type=float, default=0.96)
    parser.add_argument("--evals", type=int, default=4, help="test evaluations per epoch")
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.003, 0.01, 0.03, 0.1, 0.3])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    parser.add_argument("--kfac-sweep", action="store_true",
                        help="sweep K-FAC's settings (1 process, first seed) instead")
    args = parser.parse_args()
    t_start = time.perf_counter()
    runner = Runner(args)
    try:
        if args.kfac_sweep:
            kfac_sweep(args, runner)
            return
        results: dict = {}
        for name in args.optimizers:
            sweep = {lr: runner(name, lr, args.seeds[0], KFAC_SETTINGS) for lr in args.lrs}
            lr = pick_lr(sweep)
            runs = [sweep[lr]] + [runner(name, lr, s, KFAC_SETTINGS) for s in args.seeds[1:]]
            res = {"lr": lr, "sweep": {v: {k: s[k] for k in ("seconds_to", "first_seconds_to")}
                                       for v, s in sweep.items()},
                   "runs": runs, "final_acc": statistics.median(r["accs"][-1] for r in runs),
                   "ms_per_step": statistics.median(r["ms_per_step"] for r in runs),
                   "factor_bytes_per_step": runs[0]["factor_bytes_per_step"]}
            for key in ("seconds_to", "epochs_to", "first_seconds_to", "first_epochs_to"):
                res[f"median_{key}"] = median_or_none([r[key] for r in runs])
            if "skipped_fraction" in runs[0]:
                res["skipped_fraction"] = statistics.median(r["skipped_fraction"] for r in runs)
            wire = OPTIMIZERS[name].get("kfac", {}).get("factor_comm_dtype")
            if wire is not None:
                res["factor_rel_error"] = launch(factor_error, 2, wire, backend="gloo")[0]
            results[name] = res
            print(name, {k: v for k, v in res.items() if k != "runs"}, flush=True)
    finally:
        runner.close()
    base = results.get("sgd", {}).get("median_seconds_to")
    lines = ["| optimizer | lr | s to target | epochs to target | time / SGD's | "
             "first reached: s (epochs) | ms/step | final acc | factor bytes/step | other |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        s = r["median_seconds_to"]
        ratio = f"{s / base:.2f}" if s and base else "-"
        other = []
        missed = [(seed, run["accs"][-1]) for seed, run in zip(args.seeds, r["runs"])
                  if run["seconds_to"] is None]
        if missed:
            other.append("no time on " + ", ".join(f"seed {seed} (final acc. {acc:.3f})"
                                                   for seed, acc in missed))
        if "skipped_fraction" in r:
            other.append(f"decompositions skipped {r['skipped_fraction']:.0%}")
        if "factor_rel_error" in r:
            other.append(f"factor rel. error {r['factor_rel_error']:.1e}")
        lines.append(f"| {name} | {r['lr']} | {fmt(s)} | {fmt(r['median_epochs_to'], 2)} | "
                     f"{ratio} | {fmt(r['median_first_seconds_to'])} "
                     f"({fmt(r['median_first_epochs_to'], 2)}) | {r['ms_per_step']:.0f} | "
                     f"{r['final_acc']:.3f} | {r['factor_bytes_per_step']:,.0f} | "
                     f"{'; '.join(other)} |")
    elapsed = time.perf_counter() - t_start
    header = (f"Target {args.target} test accuracy, settled (reached and held to the end of "
              f"{args.epochs} epochs, {args.evals} evaluations/epoch); medians over seeds "
              f"{' '.join(map(str, args.seeds))}; lr from {' '.join(map(str, args.lrs))} on "
              f"seed {args.seeds[0]}; every optimizer SGD (momentum 0.9, weight decay 5e-4, "
              f"batch {args.batch}, constant lr), K-FAC {KFAC_SETTINGS}.  Whole run "
              f"{elapsed / 60:.1f} min.")
    text = header + "\n\n" + "\n".join(lines)
    print(text)
    OUTPUT.mkdir(parents=True, exist_ok=True)
    (OUTPUT / "kfac_time_to_accuracy.json").write_text(
        json.dumps({"args": vars(args), "kfac_settings": KFAC_SETTINGS, "seconds": elapsed,
                    "results": results}, indent=1, default=str))
    (OUTPUT / "kfac_time_to_accuracy.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
