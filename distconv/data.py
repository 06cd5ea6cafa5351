"""Dealing samples to ranks the way a parallelized model expects them.

A :class:`~distconv.parallel.ParallelModel` takes, on every rank, that rank's block
``x[o_N,*,...]`` of the global batch on its data grid: ranks with the same N coordinate hold the
same samples, and block ``i`` of ``P_N`` holds ``N//P_N + (i < N%P_N)`` of a global batch of N.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DistributedSampler

from distconv.distribution import balanced_block
from distconv.grid import ProcessorGrid

__all__ = ["GridSampler", "sample_block"]


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

    def __repr__(self) -> str:
        return (f"GridSampler(blocks={self.num_replicas}, block={self.rank}, "
                f"shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last})")
