"""A training loop resumes where it stopped: the GridSampler's position (epoch, next sample),
the random generators and LR schedulers go through a checkpoint, and ``k`` steps, a save, fresh
objects, a load and ``m`` more steps end bit for bit where ``k + m`` uninterrupted steps end.
Resumed on another number of sample blocks, the global order is the same and the rest of the
epoch is re-split."""
from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distconv
from distconv.comm import SingleCommunicator
from distconv.data import GridSampler
from distconv.grid import ProcessorGrid
from distconv.testing.threads import run_threads

SAMPLES = 48
DATASET = TensorDataset(torch.arange(SAMPLES))


def _dealt(comm, blocks, global_batch, *, epochs, save_after=None, path=None, load=None,
           drop_last=False):
    """The global batches (sorted sample ids) every rank of ``{N: blocks}`` sees, epoch by
    epoch; ``save_after`` global batches in, the sampler is checkpointed."""
    grid = ProcessorGrid({"N": blocks}, comm=comm)
    sampler = GridSampler(DATASET, grid, seed=7, drop_last=drop_last)
    loader = DataLoader(DATASET, batch_size=global_batch // blocks, sampler=sampler)
    if load is not None:
        distconv.load(nn.Module(), load, states={"sampler": sampler})
    seen, count = [], 0
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        for (x,) in loader:
            batch = torch.cat(comm.allgather(x, shapes=None) if comm.size > 1 else [x])
            seen.append((epoch, sorted(batch.tolist())))
            count += 1
            if count == save_after:
                distconv.save(nn.Module(), path, states={"sampler": sampler}, comm=comm)
    return seen


@pytest.mark.parametrize("saved_on, loaded_on", [(4, 4), (4, 2), (2, 3)])
def test_sampler_resumes_mid_epoch_with_the_same_global_order(tmp_path, saved_on, loaded_on):
    """Saved after 5 global batches of 12 (epoch 1, sample 12), resumed on the same or another
    number of sample blocks: the global batches that follow are those of the uninterrupted
    run (48 samples, divisible by every block count: no padding)."""
    path = str(tmp_path / "ckpt")
    whole = run_threads(_dealt, saved_on, saved_on, 12, epochs=3, save_after=5, path=path)[0]
    resumed = run_threads(_dealt, loaded_on, loaded_on, 12, epochs=3, load=path)
    for seen in resumed:
        assert seen == whole[5:]
    assert [e for e, _ in whole[4:6]] == [1, 1]  # the save fell mid-epoch


def test_sampler_resumed_on_the_same_layout_pads_as_an_uninterrupted_epoch(tmp_path):
    """50 samples over 4 blocks: the epoch's last batch is padded with the epoch's first
    samples; resumed on 4 blocks it is padded the same, on 3 blocks the rest is re-split and
    every remaining sample is dealt (padding follows the new block count)."""
    data = TensorDataset(torch.arange(50))

    def run(comm, load=None, save=False, path=None):
        sampler = GridSampler(data, ProcessorGrid({"N": comm.size}, comm=comm), seed=3)
        if load:
            sampler.load_state_dict(load)
        out = []
        for i, index in enumerate(sampler):
            out.append(index)
            if save and i == 5:
                return sampler.state_dict()
        return out

    whole = run_threads(run, 4)
    state = run_threads(run, 4, save=True)
    assert all(s == state[0] for s in state) and state[0]["next"] == 24
    assert run_threads(run, 4, load=state[0]) == [w[6:] for w in whole]
    order = torch.randperm(50, generator=torch.Generator().manual_seed(3)).tolist()
    rest = run_threads(run, 3, load=state[0])
    assert sorted(i for r in rest for i in r) == sorted(order[24:] + order[:1])  # 26 + 1 pad
    assert [len(r) for r in rest] == [9, 9, 9]


def test_sampler_len_counts_what_the_next_iteration_deals():
    grid = ProcessorGrid({"N": 1}, comm=SingleCommunicator())
    sampler = GridSampler(DATASET, grid, seed=0)
    assert len(sampler) == SAMPLES
    sampler.load_state_dict({**sampler.state_dict(), "next": 40})
    assert len(sampler) == len(list(sampler)) == 8
    assert len(sampler) == SAMPLES  # the next pass deals the epoch whole


def test_sampler_state_of_another_order_is_refused():
    grid = ProcessorGrid({"N": 1}, comm=SingleCommunicator())
    sampler = GridSampler(DATASET, grid, seed=0)
    state = sampler.state_dict()
    with pytest.raises(ValueError, match="seed=1, this GridSampler has seed=0"):
        sampler.load_state_dict({**state, "seed": 1})
    with pytest.raises(ValueError, match="dataset_size=47, this GridSampler has dataset_size=48"):
        sampler.load_state_dict({**state, "dataset_size": 47})
    with pytest.raises(ValueError, match=r"next sample must be an int in \[0, 48\], got 49"):
        sampler.load_state_dict({**state, "next": 49})


def test_rng_state_restores_every_generator():
    state = distconv.rng_state()
    first = (torch.rand(3), random.random(), np.random.rand(2).tolist(), random.gauss(0, 1))
    distconv.set_rng_state(state)
    assert torch.equal(torch.rand(3), first[0])
    assert (random.random(), np.random.rand(2).tolist(), random.gauss(0, 1)) == first[1:]
    with pytest.raises(TypeError, match="distconv.rng_state"):
        distconv.set_rng_state({"python": 1})


# ------------------------------------------------------------------ a whole training loop
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1)).double()


MODEL = _model()
G = torch.Generator().manual_seed(5)
FEATURES = torch.randn(SAMPLES, 4, generator=G, dtype=torch.float64)
TARGETS = torch.randn(SAMPLES, 1, generator=G, dtype=torch.float64)
TRAIN = TensorDataset(FEATURES, TARGETS)
SCHEDULERS = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    "one-cycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2,
                                                                 total_steps=20),
    "cosine-restarts": lambda opt: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
        opt, T_0=4),
}


def _loop(path, scheduler, *, steps, save_at=None, load=False, via="states"):
    """SGD with momentum, a scheduler stepped per batch, dropout and input noise (torch's
    generator), a shuffle of the batch's order (Python's) and a NumPy-drawn loss weight, over
    a GridSampler's batches of 5 on one process."""
    comm = SingleCommunicator()
    model = copy.deepcopy(MODEL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = SCHEDULERS[scheduler](opt)
    sampler = GridSampler(TRAIN, ProcessorGrid({"N": 1}, comm=comm), seed=1)
    # its own generator: a loader draws its workers' base seed at every iterator it starts
    loader = DataLoader(TRAIN, batch_size=5, sampler=sampler, generator=torch.Generator())
    states = {"sampler": sampler} | ({"scheduler": sched} if via == "states" else {})
    done = 0
    if load:
        extra = distconv.load(model, path, optimizer=opt, states=states)
        distconv.set_rng_state(extra["rng"])
        done = extra["done"]
        if via == "extra":
            sched.load_state_dict(extra["scheduler"])
    lrs = []
    while done < steps:
        sampler.set_epoch(sampler.epoch if load else done // len(loader))
        load = False
        for x, y in loader:
            order = list(range(len(x)))
            random.shuffle(order)
            x = x[order] + 0.01 * torch.randn_like(x)
            weight = float(np.random.uniform(0.5, 1.5))
            opt.zero_grad()
            (weight * ((model(x) - y[order]) ** 2).mean()).backward()
            opt.step()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
            done += 1
            if done == save_at:
                extra = {"rng": distconv.rng_state(), "done": done}
                if via == "extra":
                    extra["scheduler"] = sched.state_dict()
                distconv.save(model, path, optimizer=opt, states=states, extra=extra, comm=comm)
            if done == steps:
                break
        if done < steps:
            sampler.set_epoch(sampler.epoch + 1)
    return [p.detach().clone() for p in model.parameters()], lrs


@pytest.mark.parametrize("scheduler, via", [("step", "states"), ("one-cycle", "states"),
                                            ("cosine-restarts", "extra")])
def test_training_loop_resumes_bitwise(tmp_path, scheduler, via):
    """Saved after 7 steps (mid-epoch: 10 batches per epoch), resumed for 8 more: the
    parameters and every learning rate after it equal the uninterrupted 15 steps' bit for
    bit. The scheduler goes through ``states=`` (it has state_dict / load_state_dict) or
    through ``extra=`` (its state_dict is plain values)."""
    torch.manual_seed(11), random.seed(11), np.random.seed(11)
    path = str(tmp_path / "ckpt")
    whole, lrs = _loop(path, scheduler, steps=15, save_at=7, via=via)
    torch.manual_seed(99), random.seed(99), np.random.seed(99)  # the resumed job's own seeds
    resumed, lrs2 = _loop(path, scheduler, steps=15, load=True, via=via)
    assert lrs2 == lrs[7:]
    for p, q in zip(whole, resumed):
        assert torch.equal(p, q)
