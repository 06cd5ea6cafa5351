"""Time to accuracy: SGD against K-FAC (1 and 2 processes, stale statistics, low-precision
factor traffic) on scikit-learn's digits, upsampled to 16x16, with a small ResNet.

Every optimizer takes its learning rate from the same sweep (``--lrs``, best median time to the
target on the sweep seed); then ``--seeds`` seeds are repeated with it.  Reported per optimizer:
median wall-clock seconds and epochs to ``--target`` test accuracy (training time only; the
test pass after each epoch is not counted), final accuracy, K-FAC's factor bytes per step and,
for stale statistics, the fraction of scheduled decompositions skipped.  The low-precision rows
also give the relative error of the reduced factors against the same reduction in fp32.

    python benchmarks/kfac_time_to_accuracy.py                       # default sweep
    python benchmarks/kfac_time_to_accuracy.py --epochs 10 --seeds 0 1 --lrs 0.05 0.1

Writes ``benchmarks/results/kfac_time_to_accuracy.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

OUTPUT = Path(__file__).resolve().parent / "results"
SIZE = 16


def load(seed: int = 0):
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


def train(comm, name: str, lr: float, seed: int, epochs: int, target: float,
          batch: int) -> dict:
    import distkfac

    torch.set_num_threads(1)
    spec = OPTIMIZERS[name]
    x_tr, y_tr, x_te, y_te = load()
    model = small_resnet(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    kfac = None
    if "kfac" in spec:
        kfac = distkfac.KFAC(model, comm=comm, lr=lr, damping=3e-3, kl_clip=1e-3,
                             factor_update_steps=2, inv_update_steps=10,
                             placement="round-robin", **spec["kfac"])
    order = torch.Generator().manual_seed(seed + 1)
    p, r = comm.size, comm.rank
    seconds, curve, times, factor_bytes, steps = 0.0, [], [], 0, 0
    for _ in range(epochs):
        perm = torch.randperm(len(y_tr), generator=order)
        comm.barrier()
        t0 = time.perf_counter()
        for i in range(0, len(perm) - batch + 1, batch):
            idx = perm[i:i + batch][r * batch // p:(r + 1) * batch // p]
            opt.zero_grad()
            b0 = comm.stats.total_bytes()
            F.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()  # factor buckets launch
            b1 = comm.stats.total_bytes()
            distkfac.allreduce_gradients(model.parameters(), comm)
            b2 = comm.stats.total_bytes()
            if kfac is not None:
                kfac.step()
            factor_bytes += b1 - b0 + comm.stats.total_bytes() - b2
            opt.step()
            steps += 1
        comm.barrier()
        seconds += time.perf_counter() - t0
        model.eval()
        with torch.no_grad():
            curve.append((model(x_te).argmax(1) == y_te).float().mean().item())
        model.train()
        times.append(seconds)
    hit = next((i for i, a in enumerate(curve) if a >= target), None)
    out = {"curve": curve, "times": times, "epochs_to": None if hit is None else hit + 1,
           "seconds_to": None if hit is None else times[hit],
           "factor_bytes_per_step": factor_bytes / max(steps, 1)}
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


def run(name: str, lr: float, seed: int, args) -> dict:
    from distconv.launch import launch

    procs = OPTIMIZERS[name].get("procs", 1)
    return launch(train, procs, name, lr, seed, args.epochs, args.target, args.batch,
                  backend="single" if procs == 1 else "gloo", timeout=900.0)[0]


def main() -> None:
    from distconv.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--target", type=float, default=0.96)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.03, 0.1])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    args = parser.parse_args()
    results: dict = {}
    inf = float("inf")
    for name in args.optimizers:
        sweep = {lr: run(name, lr, args.seeds[0], args) for lr in args.lrs}
        lr = min(sweep, key=lambda v: (sweep[v]["seconds_to"] or inf, -sweep[v]["curve"][-1]))
        runs = [sweep[lr]] + [run(name, lr, s, args) for s in args.seeds[1:]]
        secs = [r["seconds_to"] for r in runs]
        res = {"lr": lr, "runs": runs,
               "median_seconds_to": (statistics.median(secs) if None not in secs else None),
               "median_epochs_to": (statistics.median(r["epochs_to"] for r in runs)
                                    if None not in secs else None),
               "final_acc": statistics.median(r["curve"][-1] for r in runs),
               "factor_bytes_per_step": runs[0]["factor_bytes_per_step"]}
        if "skipped_fraction" in runs[0]:
            res["skipped_fraction"] = statistics.median(r["skipped_fraction"] for r in runs)
        wire = OPTIMIZERS[name].get("kfac", {}).get("factor_comm_dtype")
        if wire is not None:
            res["factor_rel_error"] = launch(factor_error, 2, wire, backend="gloo")[0]
        results[name] = res
        print(name, {k: v for k, v in res.items() if k != "runs"}, flush=True)
    base = results.get("sgd", {}).get("median_seconds_to")
    lines = ["| optimizer | lr | s to target | epochs to target | time / SGD's | final acc | "
             "factor bytes/step | other |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        s = r["median_seconds_to"]
        ratio = f"{s / base:.2f}" if s and base else "-"
        other = []
        if "skipped_fraction" in r:
            other.append(f"decompositions skipped {r['skipped_fraction']:.0%}")
        if "factor_rel_error" in r:
            other.append(f"factor rel. error {r['factor_rel_error']:.1e}")
        lines.append(f"| {name} | {r['lr']} | {s if s is None else round(s, 1)} | "
                     f"{r['median_epochs_to']} | {ratio} | {r['final_acc']:.3f} | "
                     f"{r['factor_bytes_per_step']:,.0f} | {'; '.join(other)} |")
    text = "\n".join(lines)
    print(text)
    OUTPUT.mkdir(parents=True, exist_ok=True)
    (OUTPUT / "kfac_time_to_accuracy.json").write_text(
        json.dumps({"args": vars(args), "results": results}, indent=1, default=str))
    (OUTPUT / "kfac_time_to_accuracy.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
