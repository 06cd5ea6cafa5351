"""K-FAC against SGD on scikit-learn's digits (the data ships with scikit-learn: no network).

Both runs share the model, initialisation, batch order, learning rate, momentum and weight decay;
the K-FAC run preconditions each gradient with ``distkfac.KFAC`` before the SGD step
(``loss.backward(); kfac.step(); optimizer.step()``).  The script prints the epoch and the
training wall-clock time (the test pass after each epoch not counted) at which each reaches the
target test accuracy, and saves both curves against time to ``examples/output/kfac_digits.png``.

    python examples/kfac_digits.py [--epochs 12] [--target 0.93] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import distkfac

OUTPUT = Path(__file__).resolve().parent / "output"


def load_digits_split(seed: int = 0, test_fraction: float = 0.3):
    """``(x_train, y_train, x_test, y_test)`` as (N, 1, 8, 8) float32 in [0, 1] and labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10))


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc


def train(use_kfac: bool, *, epochs: int = 12, seed: int = 0, lr: float = 0.02,
          momentum: float = 0.9, weight_decay: float = 5e-4, batch_size: int = 64,
          progress: bool = True, data=None, times: list[float] | None = None) -> list[float]:
    """Test accuracy after each epoch; ``times``, if given, receives the cumulative training
    seconds at the end of each epoch."""
    from tqdm import tqdm

    x_train, y_train, x_test, y_test = data if data is not None else load_digits_split(seed)
    model = make_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                          weight_decay=weight_decay)
    kfac = (distkfac.KFAC(model, lr=lr, damping=3e-3, kl_clip=1e-3, factor_update_steps=1,
                          inv_update_steps=5) if use_kfac else None)
    order = torch.Generator().manual_seed(seed + 1)
    curve = []
    seconds = 0.0
    bar = tqdm(range(epochs), desc="K-FAC" if use_kfac else "SGD  ", disable=not progress)
    for _ in bar:
        perm = torch.randperm(len(y_train), generator=order)
        t0 = time.perf_counter()
        for i in range(0, len(perm), batch_size):
            idx = perm[i:i + batch_size]
            opt.zero_grad()
            F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            if kfac is not None:
                kfac.step()
            opt.step()
        seconds += time.perf_counter() - t0
        if times is not None:
            times.append(seconds)
        curve.append(accuracy(model, x_test, y_test))
        bar.set_postfix(test_acc=f"{curve[-1]:.3f}")
    return curve


def epochs_to(curve: list[float], target: float) -> int | None:
    """First epoch (1-based) whose test accuracy reaches ``target``."""
    return next((i + 1 for i, acc in enumerate(curve) if acc >= target), None)


def plot(curves: dict[str, list[float]], times: dict[str, list[float]], target: float,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, curve in curves.items():
        ax.plot(times[name], curve, marker="o", label=name)
    ax.axhline(target, color="gray", ls="--", lw=1, label=f"target {target:.0%}")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_title("digits: K-FAC vs SGD (same base settings)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--target", type=float, default=0.93)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    data = load_digits_split(args.seed)
    times: dict[str, list[float]] = {"SGD": [], "K-FAC": []}
    curves = {name: train(name == "K-FAC", epochs=args.epochs, seed=args.seed, data=data,
                          times=times[name])
              for name in ("SGD", "K-FAC")}
    for name, curve in curves.items():
        hit = epochs_to(curve, args.target)
        when = "-" if hit is None else f"{times[name][hit - 1]:.2f} s"
        print(f"{name:6s} to {args.target:.0%}: epoch {hit}, {when} of training   "
              f"final test accuracy {curve[-1]:.3f}")
    path = OUTPUT / "kfac_digits.png"
    plot(curves, times, args.target, path)
    print(f"plot saved to {path}")


if __name__ == "__main__":
    main()
