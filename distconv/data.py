"""Dealing samples to ranks the way a parallelized model expects them.

A :class:`~distconv.parallel.ParallelModel` takes, on every rank, that rank's block
``x[o_N,*,...]`` of the global batch on its data grid: ranks with the same N coordinate hold the
same samples, and block ``i`` of ``P_N`` holds ``N//P_N + (i < N%P_N)`` of a global batch of N.

Resuming: a :class:`GridSampler`'s position (epoch and next sample) is part of a checkpoint
(``distconv.save(..., states={"sampler": sampler})``), and :func:`rng_state` /
:func:`set_rng_state` carry the random generators a data pipeline draws from.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from distconv.distribution import balanced_block
from distconv.grid import ProcessorGrid

__all__ = ["GridSampler", "rng_state", "sample_block", "set_rng_state"]


def sample_block(global_batch: int, grid: ProcessorGrid, *, sample_dim: str = "N") -> slice:
    """The slice of a global batch that this rank's N block holds (balanced blocks)."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 0:
        raise ValueError(f"global_batch must be an int >= 0, got {global_batch!r}")
    start, size = balanced_block(global_batch, grid.extent(sample_dim),
                                 grid.coords.get(sample_dim, 0))
    return slice(start, start + size)


class GridSampler(DistributedSampler):
    """``DistributedSampler`` keyed by the grid's N coordinate instead of the rank.

    The ``P_N`` sample blocks of ``grid`` are the sampler's replicas: every rank of one N block
    draws the same indices (same ``seed`` and epoch), so a ``DataLoader`` with batch size b gives
    each rank its block of a global batch of ``P_N * b`` samples -- equal blocks, which are
    balanced. Call :meth:`set_epoch` each epoch, as with ``DistributedSampler``.

    Its position resumes: an epoch deals one global order of the dataset (a permutation drawn
    from ``seed + epoch``, or the identity), position ``j`` of it to block ``j mod P_N``, and
    :meth:`state_dict` records the epoch and the global position of the next sample not yet
    dealt. After :meth:`load_state_dict`, the next iteration deals the rest of that epoch's
    order, padded (or cut, with ``drop_last``) to a multiple of ``P_N`` as
    ``DistributedSampler`` pads a whole epoch, so a job resumed on the same layout sees exactly
    the samples an uninterrupted one would, and one resumed on another number of sample blocks
    sees the same global order from the same position, the rest re-split over its blocks (only
    the padding at the epoch's end follows the new ``P_N``). The position counts the indices
    the iterator has handed out, which is the samples trained on when the ``DataLoader`` takes
    indices as it forms batches (``num_workers=0``); a loader with worker processes takes
    ``prefetch_factor * num_workers`` batches ahead, which the position then counts as seen.

    Args:
        dataset: the dataset (the same on every rank).
        grid: the model's data grid (``pmodel.data_grid``).
        sample_dim: the grid dim that splits samples. Default ``"N"``.
        shuffle, seed, drop_last: as ``DistributedSampler``. Defaults True, 0, False.
    """

    def __init__(self, dataset: Any, grid: ProcessorGrid, *, sample_dim: str = "N",
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if not isinstance(grid, ProcessorGrid):
            raise TypeError(f"grid must be a ProcessorGrid, got {type(grid).__name__}")
        self.grid, self.sample_dim = grid, sample_dim
        super().__init__(dataset, num_replicas=grid.extent(sample_dim),
                         rank=grid.coords.get(sample_dim, 0), shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self._start = self._next = 0

    def set_epoch(self, epoch: int) -> None:
        """Deal epoch ``epoch`` next, from its first sample; setting the epoch the sampler is
        already in keeps its position (so a loop that calls ``set_epoch`` after
        :meth:`load_state_dict` resumes mid-epoch)."""
        if epoch != self.epoch:
            self._start = self._next = 0
        super().set_epoch(epoch)

    def _order(self) -> list[int]:
        """This epoch's global order of the dataset (as ``DistributedSampler`` draws it)."""
        if not self.shuffle:
            return list(range(len(self.dataset)))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=g).tolist()

    def _rest(self, start: int) -> int:
        """Positions from ``start`` on the next iteration deals, padded or cut."""
        left, p = len(self.dataset) - start, self.num_replicas
        return left - left % p if self.drop_last else math.ceil(left / p) * p

    def __iter__(self) -> Iterator[int]:
        order, start, p = self._order(), self._start, self.num_replicas
        self._start = 0  # a further pass over the same epoch deals it whole, as torch's does
        rest = order[start:]
        pad = self._rest(start) - len(rest)
        rest = rest[: len(rest) + pad] if pad <= 0 else (
            rest + (order * math.ceil(pad / len(order)))[:pad])
        total = len(order)
        for j, index in enumerate(rest[self.rank::p]):
            self._next = min(start + (j + 1) * p, total)
            yield index

    def __len__(self) -> int:
        """Samples the next iteration deals to this block (fewer after a mid-epoch resume)."""
        return self._rest(self._start) // self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "next", "seed", "shuffle", "dataset_size"}``: ``next`` is the global
        position in the epoch's order of the first sample not yet dealt (the same on every
        rank of a job that steps together, as a checkpoint requires)."""
        return {"epoch": self.epoch, "next": self._next, "seed": self.seed,
                "shuffle": self.shuffle, "dataset_size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (saved with any number of sample blocks): the
        next iteration deals epoch ``state["epoch"]`` from position ``state["next"]``.

        Raises:
            ValueError: a state of another seed, shuffle or dataset size (its order would be
                another one), or a position outside the dataset.
        """
        mine = self.state_dict()
        for key in ("seed", "shuffle", "dataset_size"):
            if state[key] != mine[key]:
                raise ValueError(f"the sampler state has {key}={state[key]!r}, this "
                                 f"GridSampler has {key}={mine[key]!r}: its global order would "
                                 "differ")
        position = state["next"]
        if isinstance(position, bool) or not isinstance(position, int) or not (
                0 <= position <= len(self.dataset)):
            raise ValueError(f"the sampler state's next sample must be an int in "
                             f"[0, {len(self.dataset)}], got {position!r}")
        self.epoch = int(state["epoch"])
        self._start = self._next = position

    def __repr__(self) -> str:
        return (f"GridSampler(blocks={self.num_replicas}, block={self.rank}, "
                f"shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last}, "
                f"epoch={self.epoch}, next={self._next})")


def rng_state() -> dict[str, Any]:
    """This process's random generators, as values a checkpoint holds: torch's CPU generator
    (``"torch"``), every CUDA device's where CUDA is available (``"cuda"``), Python's
    ``random`` (``"python"``) and NumPy's global generator where NumPy is installed
    (``"numpy"``). :func:`set_rng_state` puts them back, so the draws that follow (data
    augmentation, dropout, a ``DataLoader``'s worker seeds) are those of an uninterrupted run.

    In a checkpoint: ``distconv.save(..., extra={"rng": distconv.rng_state()})`` and
    ``distconv.set_rng_state(distconv.load(...)["rng"])`` when every rank holds the same
    states (seeded alike; ``extra`` keeps one copy for all ranks); ranks whose states differ
    save each their own with ``rank_extra=distconv.rng_state()`` and take it back with
    ``extra, mine = distconv.load(..., rank_extra=True)`` (on the world size that saved).
    A :class:`GridSampler`
    draws its order from its own generator (``seed + epoch``) and needs none of them. A
    ``DataLoader`` draws its workers' base seed from torch's generator each time an iterator
    starts, and a job resumed mid-epoch starts one where the uninterrupted job did not: give
    the loader its own ``generator=`` so the draws after the resume stay the same.
    """
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss},
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"bit_generator": name, "state": torch.from_numpy(keys.astype(np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": cached}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the generators of a :func:`rng_state` (those it holds: CUDA's where CUDA is
    available, one per device present; NumPy's where NumPy is installed).

    Raises:
        TypeError: ``state`` is not a mapping with a ``"torch"`` state.
    """
    if not isinstance(state, dict) or not isinstance(state.get("torch"), torch.Tensor):
        raise TypeError(f"state must be a dict from distconv.rng_state(), got {state!r:.80}")
    torch.set_rng_state(state["torch"])
    py = state.get("python")
    if py is not None:
        random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()),
                         py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        for device, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, device)
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        s = state["numpy"]
        np.random.set_state((s["bit_generator"], s["state"].numpy().astype(np.uint32),
                             s["pos"], s["has_gauss"], s["cached_gaussian"]))
