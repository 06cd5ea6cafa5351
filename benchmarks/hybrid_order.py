"""Hybrid-order optimizers (FOSI, DHO2, MR-DHO2) against SGD/momentum, Adam and K-FAC.

Two problems:

* the digits CNN of the K-FAC example (``examples/kfac_digits.py``: its data split, model and
  accuracy are imported, not copied), global batch 64, data parallel over the ranks;
* a quadratic ``1/2 theta^T Q diag(lambda) Q^T theta`` with a known spectrum (n entries, ``lambda``
  log-spaced in [1e-3, 1] with the top ``k`` set apart), for ESE accuracy.

Measured, in one run:

1. on 1, 2 and 4 processes (gloo on loopback; 1 process without a communicator): bytes of this
   rank's slice of the Lanczos basis D, seconds per ESE and per DHO2 iteration (CNN), and the
   relative error of the k largest Ritz values of the quadratic;
2. on 2 processes: every optimizer, for each learning rate of its small sweep, trains for
   ``--epochs`` epochs; test accuracy after each epoch and training wall time (evaluation
   excluded; the slowest rank counts; MR-DHO2: its worker's own time, waits included).  SGD/momentum, Adam and K-FAC average gradients over both
   ranks; FOSI runs on one process (the reference), DHO2 on both ranks, MR-DHO2 with one
   accelerator and one worker.  The best learning rate of each is the one that reaches
   ``--target`` soonest among runs that end within 0.03 of it (else the best final accuracy);
3. the paper's claims as ratios: D per rank vs 1/P, DHO2's epochs to target vs FOSI's,
   MR-DHO2's time per iteration vs its base optimizer's (on 2 data-parallel ranks and on one
   process, the worker count), how much of the ESE the workers did not wait for (overlap), and
   wall time to target of DHO2 and MR-DHO2 vs K-FAC and the first-order optimizers.

    python benchmarks/hybrid_order.py                 # quick default (~2-3 min on 2 cores)
    python benchmarks/hybrid_order.py --epochs 20 --procs 1 2 4

Writes ``benchmarks/results/hybrid_order.json``, ``hybrid_order.md`` and ``hybrid_order.png``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.kfac_digits import accuracy, load_digits_split, make_model  # noqa: E402

OUTPUT = Path(__file__).resolve().parent / "results"
BATCH = 64
ESE_ROWS = 128  # the fixed ESE batch (the FOSI authors' static batch): the first training rows
SWEEPS = {"momentum": [0.01, 0.03, 0.1], "adam": [1e-3, 3e-3, 1e-2], "kfac": [0.01, 0.03, 0.1],
          "fosi": [0.01, 0.03, 0.1], "dho2": [0.01, 0.03, 0.1], "mr-dho2": [0.01, 0.03, 0.1]}
LABELS = {"momentum": "SGD/momentum", "adam": "Adam", "kfac": "K-FAC", "fosi": "FOSI (1 proc)",
          "dho2": "DHO2", "mr-dho2": "MR-DHO2"}


def momentum_base(lr: float):
    return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9)


def rows_of(comm, n: int, ranks: list[int] | None = None) -> slice:
    """This rank's balanced block of ``n`` rows among ``ranks`` (default: every rank)."""
    from distconv.distribution import balanced_block

    ranks = list(range(comm.size)) if ranks is None else ranks
    start, size = balanced_block(n, len(ranks), ranks.index(comm.rank))
    return slice(start, start + size)


# --------------------------------------------------------------------------- part 1: scaling
def quadratic(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lam = torch.logspace(-3, 0, n, dtype=torch.float64)
    lam[-k:] = torch.linspace(5, 10, k, dtype=torch.float64)  # the top k, well separated
    q = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    return q, lam


def scaling_worker(comm, args) -> dict:
    from distkfac.hybrid import DHO2, FOSI

    torch.set_num_threads(1)
    x, y, _, _ = load_digits_split(0)
    size = 1 if comm is None else comm.size
    out: dict = {"procs": size}
    # the quadratic: every rank applies Q diag(lambda) Q^T (no samples to split)
    q, lam = quadratic(args.quad_n, args.k)
    h = (q * lam) @ q.T
    theta = torch.nn.Parameter(torch.randn(args.quad_n, dtype=torch.float64))
    kw = dict(k=args.k, ese_every=10 ** 9)

    def make(params, base, closure, samples):
        if comm is None:
            return FOSI(params, base, ese_closure=closure, ese_samples=samples, **kw)
        return DHO2(params, base, comm=comm, ese_closure=closure, ese_samples=samples, **kw)

    opt = make([theta], momentum_base(0.1), lambda: 0.5 * theta @ (h @ theta), 1)
    res = opt.estimate()
    top = lam.sort().values[-args.k:]
    out["quad_rel_err"] = float(((res.eigenvalues - top).abs() / top).max())
    out["quad_basis_bytes"] = res.basis_bytes
    out["quad_ese_s"] = res.seconds
    # the CNN: ESE and iterations of DHO2 on this rank's rows
    model = make_model(0)
    ese_rows = rows_of(comm, ESE_ROWS) if comm is not None else slice(0, ESE_ROWS)
    xe, ye = x[:ESE_ROWS][ese_rows], y[:ESE_ROWS][ese_rows]
    opt = make(list(model.parameters()), momentum_base(0.03),
               lambda: F.cross_entropy(model(xe), ye), len(ye))
    opt.estimate()  # warm-up
    ese_times = [opt.estimate().seconds for _ in range(args.repeats)]
    out["cnn_n"] = opt.space.n
    out["cnn_basis_bytes"] = opt.last_ese.basis_bytes
    out["cnn_ese_s"] = min(ese_times)
    rows = rows_of(comm, BATCH) if comm is not None else slice(0, BATCH)
    xb, yb = x[:BATCH][rows], y[:BATCH][rows]
    times = []
    for _ in range(args.repeats * 10):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step(num_samples=len(yb))
        times.append(time.perf_counter() - t0)
    out["cnn_iter_s"] = sorted(times)[len(times) // 2]
    if comm is not None:  # the slowest rank sets the pace
        vals = comm.allreduce(torch.tensor([out["cnn_ese_s"], out["cnn_iter_s"]],
                                           dtype=torch.float64), op="max")
        out["cnn_ese_s"], out["cnn_iter_s"] = vals.tolist()
        out["cnn_basis_bytes_all"] = [int(b) for b in comm.allgather(
            torch.tensor([out["cnn_basis_bytes"]]))]
    return out


# --------------------------------------------------------------------------- part 2: training
class Trainer:
    """One optimizer at one learning rate on this rank's share of every global batch."""

    def __init__(self, comm, name: str, lr: float, args, data) -> None:
        import distkfac
        from distkfac.hybrid import DHO2, FOSI, MRDHO2

        self.comm, self.name, self.args = comm, name, args
        self.x, self.y, self.xt, self.yt = data
        self.model = make_model(args.seed)
        params = list(self.model.parameters())
        self.kfac = None
        self.role = "worker"
        self.ranks = list(range(comm.size)) if comm is not None else [0]
        xe, ye = self.x[:ESE_ROWS], self.y[:ESE_ROWS]
        fosi_kw = dict(k=args.k, ese_every=args.ese_every, warmup=args.ese_every)
        if name == "momentum":
            self.opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
        elif name == "adam":
            self.opt = torch.optim.Adam(params, lr=lr)
        elif name == "kfac":
            self.opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
            self.kfac = distkfac.KFAC(self.model, comm=comm, lr=lr, damping=3e-3, kl_clip=1e-3,
                                      factor_update_steps=1, inv_update_steps=5,
                                      placement="round-robin")
        elif name == "fosi":
            self.opt = FOSI(params, momentum_base(lr), ese_closure=self._loss(xe, ye),
                            ese_samples=len(ye), **fosi_kw)
        elif name == "dho2":
            r = rows_of(comm, ESE_ROWS)
            self.opt = DHO2(params, momentum_base(lr), comm=comm,
                            ese_closure=self._loss(xe[r], ye[r]), ese_samples=len(ye[r]),
                            **fosi_kw)
        elif name == "mr-dho2":
            from distkfac.hybrid import split_roles

            acc, self.ranks = split_roles(comm.size, args.accelerator_fraction)
            r = rows_of(comm, ESE_ROWS, acc) if comm.rank in acc else slice(0, 0)
            self.opt = MRDHO2(params, momentum_base(lr), comm=comm,
                              accelerator_fraction=args.accelerator_fraction,
                              period=args.period, ese_closure=self._loss(xe[r], ye[r]),
                              ese_samples=max(1, len(ye[r])), k=args.k)
            self.role = self.opt.role
        self.steps = 0

    def _loss(self, x, y):
        return lambda: F.cross_entropy(self.model(x), y)

    def epoch(self, perm: torch.Tensor) -> float:
        """Train one epoch; returns this rank's seconds."""
        t0 = time.perf_counter()
        for i in range(0, len(perm), BATCH):
            idx = perm[i:i + BATCH]
            if self.role == "worker":
                if self.comm is not None:
                    idx = idx[rows_of(self.comm, len(idx), self.ranks)]
                self.step(self.x[idx], self.y[idx])
            else:
                self.opt.step()
            self.steps += 1
        return time.perf_counter() - t0

    def step(self, xb, yb) -> None:
        import distkfac

        self.opt.zero_grad()
        F.cross_entropy(self.model(xb), yb).backward()
        if self.name in ("dho2", "fosi", "mr-dho2"):
            self.opt.step(num_samples=len(yb))
            return
        # plain data parallelism: every rank holds the same number of rows here (64 / 2)
        distkfac.allreduce_gradients(self.model.parameters(), self.comm)
        if self.kfac is not None:
            self.kfac.step()
        self.opt.step()


def train_worker(comm, name: str, lr: float, args) -> dict:
    torch.set_num_threads(1)
    data = load_digits_split(args.seed)
    trainer = Trainer(comm, name, lr, args, data)
    order = torch.Generator().manual_seed(args.seed + 1)
    curve, seconds = [], []
    for _ in range(args.epochs):
        perm = torch.randperm(len(data[1]), generator=order)
        # MR-DHO2's roles meet only at period ends: an epoch barrier would stop the overlap;
        # its worker's own time (waits at period ends included) is its wall time
        sync = comm is not None and name != "mr-dho2"
        if sync:
            comm.barrier()
        s = trainer.epoch(perm)
        if sync:
            s = float(comm.allreduce(torch.tensor([s], dtype=torch.float64), op="max")[0])
        seconds.append(s)
        if trainer.role == "worker" or comm is None:
            curve.append(accuracy(trainer.model, data[2], data[3]))
        else:
            curve.append(float("nan"))
    out = {"curve": curve, "seconds": seconds, "steps": trainer.steps, "role": trainer.role}
    opt = trainer.opt
    if name == "mr-dho2":
        out["timings"] = {k: sum(v) for k, v in opt.timings.items()}
        out["periods"] = len(opt.timings["exchange_wait"])
    if name in ("fosi", "dho2") and opt.last_ese is not None:
        out["ese_s"] = opt.last_ese.seconds
    return out


def sweep_worker(comm, names: list[str], args) -> dict:
    """Every (optimizer, lr) of the sweep in turn on this world (one launch for all)."""
    out: dict = {}
    for name in names:
        out[name] = {lr: train_worker(comm, name, lr, args) for lr in SWEEPS[name]}
        comm.barrier()
    return out


def merge_roles(per_rank: list[dict]) -> dict:
    """One record per (optimizer, lr): the first worker's, with the accelerator's timings."""
    merged: dict = {}
    for name, runs in per_rank[0].items():
        merged[name] = {}
        for lr in runs:
            records = [r[name][lr] for r in per_rank]
            res = dict(next(r for r in records if r["role"] == "worker"))
            acc = [r for r in records if r["role"] == "accelerator"]
            if acc:
                res["accelerator_timings"] = acc[0]["timings"]
            merged[name][lr] = res
    return merged


def time_to(res: dict, target: float) -> tuple[int | None, float | None]:
    for i, acc in enumerate(res["curve"]):
        if acc >= target:
            return i + 1, sum(res["seconds"][: i + 1])
    return None, None


STABLE = 0.03  # a run counts as reaching the target only if it ends within this of it


def best_of(runs: dict[float, dict], target: float) -> float:
    """The lr reaching ``target`` soonest among runs that end within STABLE of it (a lucky
    spike of an oscillating run does not count), else the best final accuracy."""
    def key(lr):
        secs = time_to(runs[lr], target)[1]
        if secs is not None and runs[lr]["curve"][-1] >= target - STABLE:
            return (0, secs, 0.0)
        return (1, math.inf, -runs[lr]["curve"][-1])
    return min(runs, key=key)


# --------------------------------------------------------------------------- report
def report(scaling: dict, training: dict, args, momentum_1proc: dict) -> tuple[str, dict]:
    lines = ["## Scaling (DHO2 on the digits CNN; Lanczos order 4k; quadratic n = "
             f"{args.quad_n})", "",
             "| procs | D bytes/rank (CNN) | ratio to 1 proc | ESE s (CNN) | ms/iter (CNN) | "
             "ESE s (quadratic) | top-k rel. error (quadratic) |", "|---|---|---|---|---|---|---|"]
    one = scaling[1]["cnn_basis_bytes"] if 1 in scaling else None
    for p, s in sorted(scaling.items()):
        ratio = f"{max(s.get('cnn_basis_bytes_all', [s['cnn_basis_bytes']])) / one:.3f}" \
            if one else "-"
        lines.append(f"| {p} | {s['cnn_basis_bytes']} | {ratio} | {s['cnn_ese_s']:.3f} | "
                     f"{1e3 * s['cnn_iter_s']:.2f} | {s['quad_ese_s']:.3f} | "
                     f"{s['quad_rel_err']:.1e} |")
    lines += ["", f"## Training on 2 processes: digits CNN, target test accuracy {args.target}",
              "", "| optimizer | best lr | epochs to target | wall s to target | ms/iter | "
              "final acc |", "|---|---|---|---|---|---|"]
    best = {}
    for name, runs in training.items():
        lr = best_of(runs, args.target)
        res = runs[lr]
        best[name] = (lr, res)
        epochs, secs = time_to(res, args.target)
        ms = 1e3 * sum(res["seconds"]) / res["steps"]
        lines.append(f"| {LABELS[name]} | {lr:g} | {epochs if epochs else '-'} | "
                     f"{f'{secs:.2f}' if secs else '-'} | {ms:.2f} | {res['curve'][-1]:.3f} |")
    ratios = claims(scaling, best, {**training, "_momentum_1proc": momentum_1proc}, args)
    lines += ["", "## The paper's claims, measured", "", "| claim | measured | holds here |",
              "|---|---|---|"]
    lines += [f"| {c} | {m} | {h} |" for c, m, h in ratios["rows"]]
    return "\n".join(lines), ratios


def claims(scaling, best, training, args) -> dict:
    rows = []
    if 1 in scaling:
        for p in sorted(scaling):
            if p == 1:
                continue
            r = max(scaling[p].get("cnn_basis_bytes_all", [0])) / scaling[1]["cnn_basis_bytes"]
            rows.append((f"D bytes per rank ~ 1/{p}", f"{r:.3f} (1/{p} = {1 / p:.3f})",
                         "yes" if abs(r - 1 / p) < 0.01 else "no"))
    for lr in SWEEPS["fosi"]:
        f, d = training["fosi"][lr], training["dho2"][lr]
        e_f, e_d = time_to(f, args.target)[0], time_to(d, args.target)[0]
        gap = max(abs(a - b) for a, b in zip(f["curve"], d["curve"]))
        rows.append((f"DHO2 (2 procs) epochs to target = FOSI's (1 proc), lr {lr:g}",
                     f"{e_d} vs {e_f}; accuracy curves differ by <= {gap:.4f}",
                     "yes" if e_d == e_f else "no"))
    ms = {n: 1e3 * sum(r["seconds"]) / r["steps"] for n, (_, r) in best.items()}
    close = 1.2  # "close to the base optimizer's": within 20 %
    rows.append(("MR-DHO2 ms/iter within 20% of base (momentum, same 2 ranks)",
                 f"{ms['mr-dho2']:.2f} / {ms['momentum']:.2f} = "
                 f"{ms['mr-dho2'] / ms['momentum']:.2f}x",
                 "yes" if ms["mr-dho2"] / ms["momentum"] <= close else "no"))
    one = training.get("_momentum_1proc")
    if one is not None:
        ms1 = 1e3 * sum(one["seconds"]) / one["steps"]
        rows.append(("MR-DHO2 ms/iter within 20% of base (momentum on 1 process = its worker "
                     "count)", f"{ms['mr-dho2']:.2f} / {ms1:.2f} = {ms['mr-dho2'] / ms1:.2f}x",
                     "yes" if ms["mr-dho2"] / ms1 <= close else "no"))
    mr = best["mr-dho2"][1]
    if "accelerator_timings" in mr:
        ese_s = mr["accelerator_timings"]["ese"]
        wait = mr["timings"]["exchange_wait"]
        hidden = 1 - wait / ese_s if ese_s else float("nan")
        rows.append(("MR-DHO2 overlap: share of the accelerators' ESE time the worker did not "
                     "wait for", f"{hidden:.0%} (ESE {ese_s:.2f} s, worker waited {wait:.2f} s)",
                     "yes" if hidden > 0.5 else "no"))
    secs = {n: time_to(r, args.target)[1] for n, (_, r) in best.items()}
    for hybrid in ("dho2", "mr-dho2"):
        for other in ("kfac", "momentum", "adam"):
            a, b = secs[hybrid], secs[other]
            if a is None:
                rows.append((f"{LABELS[hybrid]} reaches target before {LABELS[other]}",
                             "did not reach the target", "no"))
            elif b is None:
                rows.append((f"{LABELS[hybrid]} reaches target before {LABELS[other]}",
                             f"{a:.2f} s vs never", "yes"))
            else:
                rows.append((f"{LABELS[hybrid]} reaches target before {LABELS[other]}",
                             f"{a:.2f} s vs {b:.2f} s ({b / a:.2f}x)", "yes" if a < b else "no"))
    return {"rows": rows, "ms_per_iter": ms, "seconds_to_target": secs}


def plot(best: dict, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, (lr, res) in best.items():
        t = [sum(res["seconds"][: i + 1]) for i in range(len(res["seconds"]))]
        label = f"{LABELS[name]} (lr {lr:g})"
        axes[0].plot(range(1, len(t) + 1), res["curve"], marker="o", ms=3, label=label)
        axes[1].plot(t, res["curve"], marker="o", ms=3, label=label)
    for ax, xl in zip(axes, ("epoch", "training wall time (s)")):
        ax.axhline(target, color="gray", ls="--", lw=1)
        ax.set_xlabel(xl)
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0.5, 1.0)
    axes[0].legend(fontsize=7)
    fig.suptitle("digits CNN, 2 processes (FOSI: 1 process)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    from distconv.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4],
                        help="world sizes for the memory/ESE scaling part (default 1 2 4)")
    parser.add_argument("--epochs", type=int, default=10, help="epochs per training run")
    parser.add_argument("--target", type=float, default=0.93, help="test accuracy to reach")
    parser.add_argument("--k", type=int, default=4, help="largest eigenpairs (l = 0)")
    parser.add_argument("--ese-every", type=int, default=40,
                        help="FOSI/DHO2 steps between ESEs (also the warm-up)")
    parser.add_argument("--period", type=int, default=40, help="MR-DHO2 period T")
    parser.add_argument("--accelerator-fraction", type=float, default=0.5,
                        help="MR-DHO2's share of accelerators among the 2 ranks")
    parser.add_argument("--quad-n", type=int, default=1000, help="quadratic's dimension")
    parser.add_argument("--repeats", type=int, default=2, help="timing repeats (best kept)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    t_start = time.perf_counter()
    scaling = {}
    for p in args.procs:
        scaling[p] = (scaling_worker(None, args) if p == 1 else
                      launch(scaling_worker, p, args, backend="gloo", timeout=600.0)[0])
        print(f"scaling on {p} process(es) done", flush=True)
    distributed = [n for n in SWEEPS if n != "fosi"]
    training: dict = merge_roles(launch(sweep_worker, 2, distributed, args, backend="gloo",
                                        timeout=1200.0))
    print(f"2-process sweeps done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    training["fosi"] = {lr: train_worker(None, "fosi", lr, args) for lr in SWEEPS["fosi"]}
    lr = best_of(training["momentum"], args.target)
    extra = train_worker(None, "momentum", lr, args)
    text, ratios = report(scaling, training, args, extra)
    print(text)
    OUTPUT.mkdir(parents=True, exist_ok=True)
    best = {n: (best_of(r, args.target), r[best_of(r, args.target)]) for n, r in training.items()}
    plot(best, args.target, OUTPUT / "hybrid_order.png")
    (OUTPUT / "hybrid_order.json").write_text(json.dumps(
        {"args": vars(args), "scaling": scaling, "momentum_1proc": extra,
         "training": {n: {str(lr): r for lr, r in runs.items()} for n, runs in training.items()},
         "claims": ratios, "total_s": time.perf_counter() - t_start}, indent=1, default=str))
    (OUTPUT / "hybrid_order.md").write_text(text + "\n")
    print(f"total {time.perf_counter() - t_start:.0f} s; results in {OUTPUT}")


if __name__ == "__main__":
    main()
