"""The main job: a wide ResNet trained model-parallel from a config file, exactly as one process.

A bottleneck wide ResNet (conv, BN, ReLU, residual adds, pooling, linear head) is parallelized on
4 local processes by ``examples/configs/wrn_spatial_w.yaml`` -- the paper's "+spatial + C×F w"
hybrid: rows split early (halo exchanges), channels in the middle (stationary-x), channels ×
filters in the widest stage (stationary-w) -- and trained on scikit-learn's digits with the
ordinary data-parallel loop (each rank a mean loss over its own samples). The same model trains
on one process on the global batches; the demo prints the plan (``distconv.explain``), both loss
curves and the largest difference of any parameter, saves a plot of the two curves, and exits
non-zero if the runs differ beyond fp64 rounding.

Run: ``python examples/demo.py [--backend gloo|mpi|threads] [--steps 20]``.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from distconv import explain, parallelize
from distconv.data import sample_block
from distconv.launch import launch
from distconv.models import wide_resnet_mini

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "configs" / "wrn_spatial_w.yaml"
OUTPUT = HERE / "output"
RANKS, BATCH, SIZE = 4, 16, 32
LR, MOMENTUM = 0.05, 0.9
TOLERANCE = 1e-9  # fp64: summation orders differ across ranks, nothing else


def digit_batches(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of digits, upsampled to 32×32 and standardised (fp64)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float64).unsqueeze(1)
    x = F.interpolate(x, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(digits.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    return [(x[order[i * BATCH:(i + 1) * BATCH]], y[order[i * BATCH:(i + 1) * BATCH]])
            for i in range(steps)]


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return wide_resnet_mini(in_channels=1, num_classes=10).double()


def train_single(model: torch.nn.Module, batches: list) -> tuple[list[float], dict]:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def train_parallel(comm, model: torch.nn.Module, batches: list) -> dict:
    """Runs on every rank: the user's ordinary loop on a parallelized model."""
    from tqdm import tqdm

    pmodel = parallelize(model, str(CONFIG), comm=comm)
    opt = torch.optim.SGD(pmodel.parameters(), lr=LR, momentum=MOMENTUM)
    rows = sample_block(BATCH, pmodel.data_grid)
    losses = []
    bar = tqdm(batches, desc=f"{comm.size} ranks", disable=comm.rank != 0, file=sys.stdout)
    t0 = time.perf_counter()
    for x, y in bar:
        loss = F.cross_entropy(pmodel(x[rows]), y[rows])  # a mean over this rank's samples
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((loss.item(), rows.stop - rows.start))
        bar.set_postfix(loss=f"{loss.item():.4f}")
    seconds = time.perf_counter() - t0
    state = pmodel.gather_state_dict()  # collective
    return {"losses": losses, "state": state if comm.rank == 0 else None,
            "n_block": pmodel.data_grid.coords.get("N", 0), "seconds": seconds,
            "replica": any(c for d, c in pmodel.data_grid.coords.items() if d != "N")}


def global_losses(results: list[dict]) -> list[float]:
    """The global-batch loss of every step from the ranks' local means (one replica per block)."""
    roots = [r for r in results if not r["replica"]]
    steps = len(roots[0]["losses"])
    return [sum(r["losses"][i][0] * r["losses"][i][1] for r in roots) / BATCH
            for i in range(steps)]


def plot(single: list[float], parallel: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), layout="constrained")
    ax.plot(single, label="1 process", linewidth=3, alpha=0.5)
    ax.plot(parallel, "--", label=f"{RANKS} ranks, {CONFIG.stem}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (global batch)")
    ax.set_title("Wide ResNet on digits: model-parallel = one process")
    ax.legend(loc="upper right")
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gloo", choices=("gloo", "mpi", "threads"))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    model, batches = build_model(), digit_batches(args.steps)

    print(explain(model, str(CONFIG), (BATCH, 1, SIZE, SIZE), world_size=RANKS))
    print()
    t0 = time.perf_counter()
    single, want = train_single(model, batches)
    t_single = time.perf_counter() - t0
    results = launch(train_parallel, RANKS, model, batches, backend=args.backend)
    parallel = global_losses(results)
    got = results[0]["state"]
    param_diff = max((got[k].double() - v.double()).abs().max().item() for k, v in want.items())
    loss_diff = max(abs(a - b) for a, b in zip(single, parallel))

    print(f"\n{'step':>4} {'1 process':>12} {f'{RANKS} ranks':>12}")
    for i, (a, b) in enumerate(zip(single, parallel)):
        print(f"{i:>4} {a:>12.6f} {b:>12.6f}")
    print(f"\nlargest loss difference over {args.steps} steps: {loss_diff:.2e}")
    print(f"largest difference of any parameter or buffer after training: {param_diff:.2e}")
    print(f"time: 1 process {t_single:.2f} s, {RANKS} ranks ({args.backend}) "
          f"{max(r['seconds'] for r in results):.2f} s")
    OUTPUT.mkdir(exist_ok=True)
    plot(single, parallel, OUTPUT / "demo_loss.png")
    print(f"plot: {OUTPUT / 'demo_loss.png'}")
    ok = param_diff < TOLERANCE and loss_diff < TOLERANCE
    print("OK: equal to one process" if ok else "MISMATCH: the runs differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
