"""K-FAC cost against SGD on a ResNet-like CIFAR-sized model, on 1 and 2 processes.

Model: 9 convolutions (stem, three basic blocks of two 3x3 convs with BatchNorm, two 1x1
projection shortcuts), global average pooling and a Linear head; 32x32 inputs, batch 64 per rank
(synthetic data: timings do not depend on the values).  Data parallelism: gradients averaged
with ``distkfac.allreduce_gradients`` in every mode.

Modes, measured interleaved in one run: each round is 10 chunks, each chunk a few steps of every
mode in turn; per chunk position the fastest round counts (noise only adds time):
* ``sgd``: forward, backward, gradient allreduce, SGD step;
* ``kfac-1``: K-FAC updating factors and decompositions (eigen) every step; ``kfac-1 inverse``
  the same with Cholesky inverses;
* ``kfac-10/100``: factors every 10 steps, decompositions every 100, timed over whole
  100-step cycles (so the amortised figure includes one decomposition round and 10 factor
  updates per cycle);
* on more than one process, ``kfac-1`` again with one allreduce per factor (``bucket=0``) and
  with a single bucket launched when the last factor is ready (``one bucket``), to measure the
  fusion rule against its two extremes, and with the other placement policy.
The K-FAC phases (factor computation in the hooks, factor communication wait, decomposition,
broadcast, preconditioning) come from ``KFAC.timings``.

    python benchmarks/kfac.py                 # 1 and 2 processes, 2 rounds
    python benchmarks/kfac.py --procs 2 --rounds 3 --threads 1

Writes ``benchmarks/results/kfac.json`` and ``kfac.md``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

OUTPUT = Path(__file__).resolve().parent / "results"
CHUNKS = 10
PHASES = ("factor_compute", "factor_comm", "inversion", "broadcast", "precondition")


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (nn.Identity() if stride == 1 and cin == cout else
                      nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                    nn.BatchNorm2d(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


def resnet_like(num_classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))


def _run(comm, state: dict, steps: int, x, y) -> dict:
    """Seconds for ``steps`` iterations of one mode (and its K-FAC phases), all ranks synced."""
    import distkfac

    model, opt, kfac = state["model"], state["opt"], state["kfac"]
    if kfac is not None:
        kfac.reset_timings()
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        distkfac.allreduce_gradients(model.parameters(), comm)
        if kfac is not None:
            kfac.step()
        opt.step()
    comm.barrier()
    out = {"iter_s": time.perf_counter() - t0}
    if kfac is not None:
        out.update({p: kfac.timings[p] for p in PHASES})
    return out


def worker(comm, rounds: int, threads: int, batch: int, placement: str) -> dict:
    import distkfac

    torch.set_num_threads(threads)
    torch.manual_seed(comm.rank)
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    lr = 0.05
    costs: dict = {}
    states = {}
    mib = 1 << 20
    modes = {"sgd": (0, 0, None, "", placement), "kfac-1": (1, 1, mib, "eigen", placement),
             "kfac-10/100": (10, 100, mib, "eigen", placement),
             "kfac-1 inverse": (1, 1, mib, "inverse", placement)}
    if comm.size > 1:  # the fusion rule against its two extremes; the other placement
        other = "round-robin" if placement == "lbp" else "lbp"
        modes.update({"kfac-1 bucket=0": (1, 1, 0, "eigen", placement),
                      "kfac-1 one bucket": (1, 1, 1 << 40, "eigen", placement),
                      f"kfac-1 {other}": (1, 1, mib, "eigen", other)})
    for mode, (fsteps, isteps, bucket, method, place) in modes.items():
        torch.manual_seed(0)
        model = resnet_like()
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        kfac = None
        if fsteps:
            if method not in costs and comm.size > 1 and place == "lbp":
                decomposer = distkfac.methods.method_for(method)
                costs[method] = distkfac.CostModel.fit(
                    comm, lambda m, d=decomposer: d.decompose(m, 1e-3))
            kfac = distkfac.KFAC(model, comm=comm, lr=lr, factor_update_steps=fsteps,
                                 inv_update_steps=isteps, placement=place,
                                 cost_model=costs.get(method), bucket_bytes=bucket,
                                 compute_method=method)
        states[mode] = {"model": model, "opt": opt, "kfac": kfac}
    # A round is CHUNKS interleaved chunks of every mode; kfac-10/100 runs one 100-step cycle
    # per round.  Per chunk position the fastest round is kept (machine noise only adds time).
    per_chunk = {m: {"sgd": 10, "kfac-10/100": 100 // CHUNKS}.get(m, 2) for m in modes}
    for mode, n in per_chunk.items():  # warm-up (allocations, first decompositions)
        if mode != "kfac-10/100":
            _run(comm, states[mode], n, x, y)
    samples = {m: [[None] * CHUNKS for _ in range(rounds)] for m in modes}
    for r in range(rounds):
        for c in range(CHUNKS):
            for mode, n in per_chunk.items():
                samples[mode][r][c] = _run(comm, states[mode], n, x, y)
    result = {}
    for mode, runs in samples.items():
        best = [min((runs[r][c] for r in range(rounds)), key=lambda s: s["iter_s"])
                for c in range(CHUNKS)]
        keys = best[0].keys()
        total = {k: sum(b[k] for b in best) / (CHUNKS * per_chunk[mode]) for k in keys}
        vals = comm.allreduce(torch.tensor([total[k] for k in keys], dtype=torch.float64),
                              op="max")  # the slowest rank sets the pace
        result[mode] = dict(zip(keys, vals.tolist()))
    kfac = states["kfac-1"]["kfac"]
    result["layers"] = len(kfac.layers)
    result["assignment"] = getattr(kfac, "last_assignment", None)
    result["cost_models"] = {k: v.__dict__ for k, v in costs.items()}
    return result


def table(results: dict[int, dict]) -> str:
    lines = ["| procs | mode | ms/iter | ratio to SGD | factor compute | factor comm | "
             "inversion | broadcast | precondition |", "|---|---|---|---|---|---|---|---|---|"]
    for procs, res in results.items():
        base = res["sgd"]["iter_s"]
        for mode in [m for m in res if isinstance(res[m], dict) and "iter_s" in res[m]]:
            r = res[mode]
            phases = [f"{1e3 * r[p]:.1f}" if p in r else "-" for p in PHASES]
            lines.append(f"| {procs} | {mode} | {1e3 * r['iter_s']:.1f} | "
                         f"{r['iter_s'] / base:.2f} | " + " | ".join(phases) + " |")
    return "\n".join(lines)


def main() -> None:
    from distconv.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--batch", type=int, default=64, help="batch per rank")
    parser.add_argument("--placement", default="lbp", choices=["lbp", "round-robin"])
    args = parser.parse_args()
    results = {}
    for procs in args.procs:
        backend = "single" if procs == 1 else "gloo"
        results[procs] = launch(worker, procs, args.rounds, args.threads, args.batch,
                                args.placement, backend=backend, timeout=600.0)[0]
        print(f"{procs} process(es) done", flush=True)
    text = table(results)
    print(text)
    OUTPUT.mkdir(parents=True, exist_ok=True)
    (OUTPUT / "kfac.json").write_text(json.dumps({"args": vars(args), "results": results},
                                                 indent=1, default=str))
    (OUTPUT / "kfac.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
