"""Elastic training: checkpoint every k steps, and resume from the last complete checkpoint.

The script a user writes for a job that must survive losing a rank. Every rank runs it; on start
it looks in ``--dir`` for the newest checkpoint whose index is present (a save writes its index
last, so a directory without one is an interrupted save and is ignored) and continues from it:
parameters and SGD momentum (``optimizer=``), the LR scheduler and the ``GridSampler``'s position
(``states=``), the random generators and the loss history (``extra=``). A restarted world (the
launcher's job) therefore ends bit for bit where an uninterrupted run on the same layout ends; on
another number of ranks it continues from the same state with the config planned for that world.

A small bottleneck ResNet (``distconv.models.resnet_mini``) learns ten classes of 16×16 images
(a fixed random pattern per class under noise: synthetic, so nothing is read or downloaded), with
fresh input noise drawn from torch's generator each step. Each step draws the noise of the whole
global batch on every rank and keeps its own samples, so the same sample gets the same noise on
any layout and the generators stay equal on every rank.

    torchrun --standalone --nproc-per-node 4 --max-restarts 3 examples/elastic.py --dir /tmp/el
    mpiexec -n 4 python examples/elastic.py --dir /tmp/el       # rerun the same line to resume
    torchrun --standalone --nproc-per-node 2 examples/elastic.py --dir /tmp/el  # on 2 ranks

torchrun's agent shares one rendezvous store with the workers of every attempt;
``distconv.comm.init`` keys each attempt's process group apart in it, so a restarted world never
reads the addresses of the attempt before.

Fault injection (for ``benchmarks/soak.py``): ``--die-at-step K --die-rank R`` SIGKILLs rank R at
step K, once: a marker file in ``--dir`` records the death, so the restarted world runs through.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import distconv
from distconv.checkpoint import INDEX_NAME
from distconv.comm import init
from distconv.data import GridSampler
from distconv.models import resnet_mini

SIZE = 16  # input rows and columns: the ResNet's stem and stages divide them by 16


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="checkpoint directory (one step-NNNNNN per save)")
    ap.add_argument("--steps", type=int, default=24, help="optimizer steps in all (default 24)")
    ap.add_argument("--every", type=int, default=4, help="checkpoint every k steps (default 4)")
    ap.add_argument("--keep", type=int, default=2, help="complete checkpoints kept (default 2)")
    ap.add_argument("--config", default="hybrid",
                    help="'hybrid' (default: rows split in layer1, channels in layer2, samples "
                         "elsewhere, planned for the world size), 'sample', or a YAML/JSON file")
    ap.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    ap.add_argument("--samples", type=int, default=80,
                    help="dataset size (default 80: an epoch of 5 steps)")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--noise", type=float, default=0.05, help="input noise (default 0.05)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--async-save", action="store_true", help="write checkpoints in the "
                    "background (distconv.save(..., async_save=True))")
    ap.add_argument("--timeout", type=float, default=30.0,
                    help="communicator timeout in seconds (default 30)")
    ap.add_argument("--die-at-step", type=int, default=None, help="fault injection: the step")
    ap.add_argument("--die-rank", type=int, default=0, help="fault injection: the rank")
    ap.add_argument("--die-point", choices=("step", "save"), default="step",
                    help="'step': before the step's forward (default); 'save': while the step's "
                         "checkpoint is written (async: as save() returns; sync: from a timer "
                         "--die-delay s into it)")
    ap.add_argument("--die-delay", type=float, default=0.002)
    return ap.parse_args(argv)


def config_for(name: str, world: int) -> dict | str:
    """The parallel config for ``world`` ranks: re-planned when the world size changes."""
    if name == "sample" or (name == "hybrid" and (world < 2 or world % 2)):
        return {"default": {"grid": {"N": world}, "algorithm": "sample"}}
    if name == "hybrid":
        half = world // 2
        return {"default": {"grid": {"N": world}, "algorithm": "sample"},
                "layers": [
                    {"match": "layer1.*", "grid": {"N": half, "H": 2}, "algorithm": "spatial"},
                    {"match": "layer2.*", "grid": {"N": half, "C": 2},
                     "algorithm": "stationary-x"},
                ]}
    if name.endswith(".json"):
        return json.loads(Path(name).read_text())
    return name  # a YAML path: parallelize reads it


def patterns(samples: int) -> TensorDataset:
    """``samples`` images: the pattern of class ``i % 10`` plus noise (the same on every rank)."""
    g = torch.Generator().manual_seed(1234)
    classes = torch.randn(10, 1, SIZE, SIZE, generator=g)
    y = torch.arange(samples) % 10
    return TensorDataset(classes[y] + torch.randn(samples, 1, SIZE, SIZE, generator=g), y)


# ------------------------------------------------------------------------- checkpoints
def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def complete_steps(root: Path) -> list[int]:
    """Steps whose checkpoint is complete (its index, written last, is there), oldest first."""
    steps = []
    for d in root.glob("step-*"):
        if (d / INDEX_NAME).is_file() and d.name[5:].isdigit():
            steps.append(int(d.name[5:]))
    return sorted(steps)


def agree(comm, value: int) -> int:
    """``value``, checked to be the same on every rank (they read one shared directory)."""
    got = [int(t.item()) for t in comm.allgather(torch.tensor([value]))]
    if len(set(got)) > 1:
        raise RuntimeError(f"the ranks see different last checkpoints: {got}")
    return value


def prune(root: Path, keep: list[int], rank: int) -> None:
    """Rank 0: remove every checkpoint older than the ``keep`` newest complete ones (and any
    interrupted save older than them)."""
    if rank != 0 or not keep:
        return
    for d in root.glob("step-*"):
        if d.name[5:].isdigit() and int(d.name[5:]) < keep[0]:
            shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------- fault injection
def die_now(root: Path, args: argparse.Namespace, rank: int, step: int, point: str) -> bool:
    """Whether this rank is the one to kill at ``step`` and ``point`` (first attempt only)."""
    if args.die_at_step != step or args.die_rank != rank or args.die_point != point:
        return False
    marker = root / f".died-step{step}-rank{rank}"
    if marker.exists():
        return False
    marker.write_text(f"{time.time()}\n")
    print(f"rank {rank}: SIGKILL at step {step} ({point})", flush=True)
    return True


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------------- training
def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    root = Path(args.dir)
    comm = init(timeout=args.timeout)
    rank, world = comm.rank, comm.size
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    comm.barrier()

    torch.manual_seed(args.seed)  # the same model on every rank; a resume restores the state
    random.seed(args.seed)
    np.random.seed(args.seed)
    model = resnet_mini(in_channels=1, base=4)
    pmodel = distconv.parallelize(model, config_for(args.config, world), comm=comm,
                                  input_shape=(args.batch, 1, SIZE, SIZE))
    opt = torch.optim.SGD(pmodel.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps)
    data = patterns(args.samples)
    grid = pmodel.data_grid
    blocks, block = grid.extent("N"), grid.coords.get("N", 0)
    if args.batch % blocks:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {blocks} sample blocks")
    sampler = GridSampler(data, grid, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch // blocks, sampler=sampler,
                        generator=torch.Generator())
    states = {"sampler": sampler, "scheduler": sched}

    done, losses = 0, []
    saved = complete_steps(root)
    last = agree(comm, saved[-1] if saved else -1)
    if last >= 0:
        extra = distconv.load(pmodel, step_dir(root, last), optimizer=opt, states=states)
        distconv.set_rng_state(extra["rng"])
        done, losses = extra["step"], list(extra["losses"])
        if rank == 0:
            print(f"resumed from step {done} on {world} ranks (saved on {extra['world']})",
                  flush=True)
    if rank == 0:
        for d in sorted(root.glob("step-*")):
            if not (d / INDEX_NAME).is_file():
                print(f"ignored {d.name}: no index (an interrupted save)", flush=True)
    kept = [s for s in saved if s <= last][-args.keep:]

    handle, pending = None, None
    begin = time.monotonic()
    epoch = sampler.epoch
    while done < args.steps:
        sampler.set_epoch(epoch)  # the epoch it is in keeps its position (a resume mid-epoch)
        for x, y in loader:
            step = done + 1
            if die_now(root, args, rank, step, "step"):
                kill_self()
            noise = torch.randn(args.batch, *x.shape[1:])  # the global batch's, on every rank
            x = x + args.noise * noise[block::blocks]
            loss = F.cross_entropy(pmodel(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total = comm.allreduce(loss.detach().reshape(1) * len(y))  # for the record only
            losses.append(float(total.item()) / (args.batch * grid.size // blocks))
            done = step
            if done % args.every == 0 or done == args.steps:
                if handle is not None:  # the previous asynchronous save is complete once waited
                    handle.wait()
                    kept = (kept + [pending])[-args.keep:]
                    prune(root, kept, rank)
                extra = {"step": done, "losses": losses, "rng": distconv.rng_state(),
                         "world": world}
                dying = die_now(root, args, rank, done, "save")
                if dying and not args.async_save:
                    threading.Timer(args.die_delay, kill_self).start()
                handle = distconv.save(pmodel, step_dir(root, done), optimizer=opt,
                                       states=states, extra=extra, async_save=args.async_save)
                if dying:
                    kill_self()
                pending = done
                if handle is None:
                    kept = (kept + [done])[-args.keep:]
                    prune(root, kept, rank)
            if rank == 0 and (done % args.every == 0 or done == args.steps):
                print(f"step {done}/{args.steps} loss {losses[-1]:.4f} "
                      f"({time.monotonic() - begin:.1f} s)", flush=True)
            if done == args.steps:
                break
        else:
            epoch += 1
    if handle is not None:
        handle.wait()
        kept = (kept + [pending])[-args.keep:]
        prune(root, kept, rank)
    if rank == 0:
        print(f"finished {done} steps on {world} ranks: loss {losses[-1]:.6f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
