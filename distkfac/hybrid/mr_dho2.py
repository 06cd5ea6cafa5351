"""MR-DHO2: accelerators estimate the spectrum while workers train; one final update per period.

The ranks of ``comm`` split into accelerators ``A`` (the first ``round(f P)`` ranks, ``f`` the
accelerator fraction) and workers ``W`` (the rest), each group with its own sub-communicator, so
the two progress concurrently.  Time runs in periods of ``T`` steps.  In a period that starts at
``theta_0``:

* accelerators: ``theta_0`` arrives (a broadcast from the first worker); ESE on it with DHO2's
  distributed Lanczos over ``A`` (basis ``D[*, o_A]``, eigenvectors ``E[*, o_A]``), each
  accelerator on its own ESE samples;
* workers: T steps of the base optimizer alone on the gradients synchronized over ``W``
  (``g_t[o_W]`` by a weighted reduce-scatter, the step on slices, ``theta[*]`` by an allgather),
  accumulating ``G = (1/T) Σ_t g_t``;
* at the period's end the eigenvalues are broadcast and the eigenvector slices are moved from
  the accelerators' blocks to the workers' blocks (``E[*, o_W] <- E[*, o_A]``, one all-to-all
  in which every accelerator sends each worker the intersection of their blocks), then the
  workers make the final update on their slices::

      Delta = theta_T - theta_0
      theta <- theta_0 + s (Delta - E^T E Delta) - alpha E^T diag(eta) E G

  i.e. the base optimizer's displacement is kept on the complement of the new subspace and
  replaced on the subspace by one Newton step with the period's mean gradient (``eta``, ``s``,
  ``alpha``, ``lr_clip`` as in FOSI).  The next period starts from this ``theta``.

  ``lr_clip`` defaults to 1 here (``s = 1``): the workers stepped on the full gradient at the base
  learning rate, so their displacement is not a step that the removed top curvature limited, and
  scaling a whole period of it at once made the digits benchmark oscillate (accuracy swinging
  between 0.6 and 0.9 from epoch to epoch with ``lr_clip = 3``); pass ``lr_clip`` to scale.

Every rank calls ``step()`` once per iteration; only workers need gradients
(``opt.needs_gradient``).  An accelerator's step does its ESE at a period's first step and
waits for the exchange at its last; in between it returns at once.  The trained parameters live
on the workers (an accelerator's copy is the last period's ``theta_0``).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from distconv.distribution import balanced_block
from distkfac.hybrid.dho2 import ELEMENTWISE
from distkfac.hybrid.fosi import (
    BaseFactory,
    _finite,
    _positive_int,
    base_delta,
    build_base,
    check_spectrum,
    newton_rates,
    sample_count,
    world_of,
)
from distkfac.hybrid.lanczos import ESEResult, ese, make_hvp
from distkfac.hybrid.space import SlicedSpace, assign, flatten

__all__ = ["MRDHO2", "split_roles"]


def split_roles(size: int, accelerator_fraction: float) -> tuple[list[int], list[int]]:
    """``(accelerators, workers)``: the first ``round(f * size)`` ranks and the rest; at least
    one of each, else ValueError."""
    f = _finite(accelerator_fraction, "accelerator_fraction", minimum=0.0)
    n_acc = int(round(f * size))
    if not 1 <= n_acc <= size - 1:
        raise ValueError(f"accelerator_fraction={accelerator_fraction!r} gives {n_acc} "
                         f"accelerators of {size} ranks: need at least one accelerator and one "
                         f"worker (1 <= round(f * {size}) <= {size - 1})")
    return list(range(n_acc)), list(range(n_acc, size))


class MRDHO2:
    """Multi-role DHO2 over ``comm`` (see the module docstring for the algorithm).

    Args:
        params: the model's parameters (the same model on every rank).
        base: ``params -> torch.optim.Optimizer``, elementwise (see ``dho2.ELEMENTWISE``).
        comm: the world of both roles (a ``distconv.comm`` Communicator, size >= 2), or
        grid: a ``ProcessorGrid`` over that world (exactly one of the two).
        accelerator_fraction: share of ranks that run ESE (default 0.5), rounded.
        period: steps per period ``T`` (default 10).
        ese_closure: this accelerator's loss on its ESE samples (required on accelerators).
        ese_samples: samples behind that loss (default 1).
        k, l, order, alpha, seed: as in :class:`~distkfac.hybrid.fosi.FOSI`
            (defaults 5, 0, ``4 (k + l)``, 0.1, 0).
        lr_clip: upper clip of the scaling ``s`` of the complement (default 1.0: no scaling).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], base: BaseFactory, *,
                 comm=None, grid=None,
                 accelerator_fraction: float = 0.5, period: int = 10,
                 ese_closure: Callable[[], Tensor] | None = None, ese_samples: float = 1.0,
                 k: int = 5, l: int = 0, order: int | None = None, alpha: float = 0.1,
                 lr_clip: float = 1.0, seed: int = 0) -> None:
        comm = world_of(comm, grid)
        self.params = list(params)
        self.n = sum(p.numel() for p in self.params)
        self.accelerators, self.workers = split_roles(comm.size, accelerator_fraction)
        self.accelerator_fraction = accelerator_fraction
        self.k, self.l, self.order = check_spectrum(k, l, order, self.n)
        self.period = _positive_int(period, "period")
        self.alpha = _finite(alpha, "alpha", minimum=0.0)
        self.seed = _positive_int(seed, "seed", minimum=0)
        self.ese_samples = _finite(ese_samples, "ese_samples", minimum=0.0)
        self.ese_closure = ese_closure
        self.comm = comm
        self.role = "accelerator" if comm.rank in self.accelerators else "worker"
        if self.role == "accelerator" and not callable(ese_closure):
            raise ValueError(f"ese_closure must be a callable loss on accelerators, got "
                             f"{ese_closure!r}")
        self.group = comm.split([self.accelerators, self.workers])
        self.acc_space = SlicedSpace(self.n, self.group if self.role == "accelerator" else None)
        self.space = SlicedSpace(self.n, self.group if self.role == "worker" else None)
        self.flat = torch.nn.Parameter(self.space.slice(flatten(self.params)).clone())
        self.base = build_base(base, self.flat)
        if not isinstance(self.base, ELEMENTWISE):
            raise ValueError(f"base must be elementwise, one of {[c.__name__ for c in ELEMENTWISE]}"
                             f", got {type(self.base).__name__}")
        self.lr_clip = _finite(lr_clip, "lr_clip", minimum=1.0)
        self.steps = 0
        self.theta0 = self.flat.detach().clone()
        self.grad_sum = torch.zeros_like(self.theta0)
        self._ese: ESEResult | None = None
        self.last_ese: ESEResult | None = None
        self.eigenvalues = torch.zeros(0, dtype=torch.float64)
        self.scaling = 1.0
        self.timings: dict[str, list[float]] = {"ese": [], "exchange_wait": [], "step": []}

    @property
    def needs_gradient(self) -> bool:
        """Whether this rank's ``step()`` reads ``p.grad`` (workers only)."""
        return self.role == "worker"

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # ------------------------------------------------------------------ the period
    @torch.no_grad()
    def step(self, *, num_samples: float = 1.0) -> None:
        """One iteration; workers pass their local batch size ``num_samples`` (a finite number
        > 0, checked on every rank before the step: TypeError / ValueError otherwise)."""
        num_samples = sample_count(num_samples)
        t0 = time.perf_counter()
        i = self.steps % self.period
        if i == 0:
            self._start_period()
        if self.role == "worker":
            self._worker_step(num_samples)
        if i == self.period - 1:
            self._end_period()
        self.steps += 1
        self.timings["step"].append(time.perf_counter() - t0)

    def _start_period(self) -> None:
        full = self.comm.broadcast(flatten(self.params), root=self.workers[0],
                                   meta="mr-dho2 theta_0")
        if self.role == "accelerator":
            assign(self.params, full)
            hvp = make_hvp(self.params, self.ese_closure)
            self._ese = ese(hvp, self.acc_space, k=self.k, l=self.l, order=self.order,
                            seed=self.seed, weight=self.ese_samples)
            self.last_ese = self._ese
            self.timings["ese"].append(self._ese.seconds)
        else:
            self.theta0 = self.flat.detach().clone()
            self.grad_sum.zero_()

    def _worker_step(self, num_samples: float) -> None:
        self.flat.copy_(self.space.slice(flatten(self.params)))
        g = self.space.reduce_mean(flatten([p.grad if p.grad is not None else torch.zeros_like(p)
                                            for p in self.params]), num_samples)
        self.grad_sum += g
        self.flat.copy_(self.flat + base_delta(self.base, self.flat, g))
        assign(self.params, self.space.gather(self.flat.detach()))

    def _end_period(self) -> None:
        t0 = time.perf_counter()
        vals, l_, e = self._exchange()
        self.timings["exchange_wait"].append(time.perf_counter() - t0)
        self.eigenvalues = vals
        if self.role == "accelerator":
            return
        dtype = self.flat.dtype
        e = e.to(dtype)
        eta, scaling = newton_rates(vals, l=l_, lr_clip=self.lr_clip)
        delta = self.flat.detach() - self.theta0
        mean_g = self.grad_sum / self.period
        c = self.space.dots(e, torch.stack([delta, mean_g], 1), "mr-dho2 final update")
        newton = (eta.to(dtype) * c[:, 1]) @ e
        theta = self.theta0 + scaling * (delta - c[:, 0] @ e) - self.alpha * newton
        self.flat.copy_(theta)
        assign(self.params, self.space.gather(theta))
        self.scaling = scaling

    def _exchange(self) -> tuple[Tensor, int, Tensor]:
        """Eigenvalues (broadcast from the first accelerator, with ``q`` and ``l``) and
        ``E[*, o_W] <- E[*, o_A]`` by one all-to-all; returns this rank's worker slice of E
        (empty on accelerators)."""
        kl = self.k + self.l
        meta = torch.zeros(2 + kl, dtype=torch.float64,
                           device=getattr(self.comm, "device", None))
        if self._ese is not None and self.comm.rank == self.accelerators[0]:
            q = len(self._ese.eigenvalues)
            meta[0], meta[1] = q, self._ese.l
            meta[2: 2 + q] = self._ese.eigenvalues
        meta = self.comm.broadcast(meta, root=self.accelerators[0], meta="mr-dho2 eigenvalues")
        q, l_ = int(meta[0]), int(meta[1])
        acc_blocks = _blocks(self.n, len(self.accelerators))
        wrk_blocks = _blocks(self.n, len(self.workers))
        nacc = len(self.accelerators)
        chunks, shapes = [], []
        for r in range(self.comm.size):
            recv = 0
            if self.role == "accelerator" and r >= nacc:
                lo, hi = _overlap(acc_blocks[self.comm.rank], wrk_blocks[r - nacc])
                mine = acc_blocks[self.comm.rank][0]
                chunks.append(self._ese.eigenvectors[:, lo - mine: hi - mine].reshape(-1))
            else:
                chunks.append(torch.zeros(0, dtype=torch.float64))
            if self.role == "worker" and r < nacc:
                lo, hi = _overlap(acc_blocks[r], wrk_blocks[self.comm.rank - nacc])
                recv = hi - lo
            shapes.append((q * recv,))
        parts = self.comm.alltoall(chunks, recv_shapes=shapes, meta="mr-dho2 eigenvector slices")
        if self.role == "accelerator":
            return meta[2: 2 + q], l_, torch.zeros(0)
        e = torch.cat([p.view(q, -1) for p in parts[:nacc]], 1)
        return meta[2: 2 + q], l_, e

    def __repr__(self) -> str:
        return (f"MRDHO2(n={self.n}, accelerator_fraction={self.accelerator_fraction}, "
                f"accelerators={len(self.accelerators)}, "
                f"workers={len(self.workers)}, role={self.role!r}, period={self.period}, "
                f"k={self.k}, l={self.l}, order={self.order}, alpha={self.alpha}, "
                f"lr_clip={self.lr_clip}, seed={self.seed}, "
                f"base={type(self.base).__name__}({self.base.defaults.get('lr')!r}))")


def _blocks(n: int, parts: int) -> list[tuple[int, int]]:
    """``(start, end)`` of every balanced block."""
    return [(s, s + b) for s, b in (balanced_block(n, parts, r) for r in range(parts))]


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return lo, max(lo, hi)
