"""DHO2: FOSI with the Lanczos basis, the eigenvectors, the velocity, the base optimizer's state and
the update all split over the ranks in balanced blocks of the flattened parameters.

Distributions (``o`` = balanced blocks of the n parameters over the P ranks, ``*`` replicated):

* parameters ``theta[*]`` (every rank runs the full model on its own samples);
* Lanczos basis ``D[*, o]`` (Algorithm 2, :mod:`distkfac.hybrid.lanczos`), eigenvectors ``E[*, o]``,
  velocity ``v[o]``, base-optimizer state ``[o]``;
* gradient: each rank's local mean ``g_r[*]`` over its ``b_r`` samples becomes
  ``g[o] = (Σ_r b_r g_r) / Σ_r b_r`` by one reduce-scatter (weights ride in the chunks).

The model update (Algorithm 3) is FOSI's steps 1–6 on the slices, with two reductions of ``q``
and ``2 q`` numbers (``E g`` and ``E [v, delta]``), then ``theta[*] <- theta[o]`` by an allgather:
a reduce-scatter plus an allgather per step, the bytes of one allreduce.  Since every entry is
computed as one process computes it, DHO2 on P ranks equals FOSI on the concatenated batch (same
seed) up to the order of floating-point sums.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from distkfac.hybrid.fosi import BaseFactory, _HybridOrder, world_of

__all__ = ["DHO2", "ELEMENTWISE"]

# optimizers whose step on a slice equals the slice of their step on the whole vector
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
               torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad)


class DHO2(_HybridOrder):
    """Distributed FOSI over ``comm`` (data parallel; see the module docstring).

    Every rank calls it with its own gradients: ``loss.backward(); opt.step(num_samples=b_r)``,
    its loss a mean over its ``b_r`` samples (no gradient allreduce before: the step reduces).
    ``ese_closure`` is this rank's loss on its ESE samples, ``ese_samples`` their number.
    Arguments as :class:`~distkfac.hybrid.fosi.FOSI`, plus ``comm`` (a ``distconv.comm``
    Communicator) or ``grid`` (a ``ProcessorGrid``: all its ranks), exactly one.  The base optimizer must be elementwise (one of ``ELEMENTWISE``).

    Memory: ``last_ese.basis_bytes`` is this rank's slice of D, ``8 * steps * b_r`` bytes.

    Checkpoints (``distconv.save(..., states={"opt": opt})``): the slices are written as blocks
    ``[o_P]`` of the global vectors and reshard onto any number of ranks (see
    :meth:`~distkfac.hybrid.fosi.FOSI.state_dict`); on the same number the run continues
    bitwise, on another from the same global state, its sums in another order.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], base: BaseFactory, *,
                 comm=None, grid=None,
                 ese_closure: Callable[[], Tensor] | None = None, k: int = 5, l: int = 0,
                 order: int | None = None, ese_every: int = 100, warmup: int | None = None,
                 alpha: float = 0.1, lr_clip: float | None = None, seed: int = 0,
                 ese_samples: float = 1.0) -> None:
        comm = world_of(comm, grid)
        super().__init__(params, base, ese_closure=ese_closure, k=k, l=l, order=order,
                         ese_every=ese_every, warmup=warmup, alpha=alpha, lr_clip=lr_clip,
                         seed=seed, ese_samples=ese_samples, comm=comm)
        if not isinstance(self.base, ELEMENTWISE):
            raise ValueError(f"base must be an elementwise optimizer for DHO2 (its step on a "
                             f"slice must be the slice of its step): one of "
                             f"{[c.__name__ for c in ELEMENTWISE]}, got {type(self.base).__name__}")

    def __repr__(self) -> str:
        return (f"DHO2(n={self.space.n}, size={self.space.size}, local={self.space.local}, "
                f"{self._settings()})")
