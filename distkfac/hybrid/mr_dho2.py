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

import json
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

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

    Checkpoints: ``distconv.save(..., states={"opt": opt})`` at any step (mid-period too);
    :meth:`state_dict` is collective and its state whole, so it loads onto any world size and
    fraction and, on the same ones, continues bitwise.
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

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs, whole and the same on every rank.  **Collective**:
        every rank calls it (``distconv.save`` does).

        The two roles hold different things, in blocks over their own groups, so the state is
        assembled whole: the workers allgather their blocks and the first worker broadcasts
        the parameters ``theta`` (the trained ones live on the workers), the period's
        ``theta_0`` and gradient sum ``G``, the base optimizer's state (elementwise entries of
        length n) and the scaling ``s``; mid-period the accelerators allgather the eigenvector
        blocks of the period's ESE and the first accelerator broadcasts them with their
        eigenvalues.  Every tensor is replicated (n numbers each, as the parameters are), so it
        loads onto any world size and accelerator fraction.  Eigenpairs are padded to
        ``k + l`` rows, ``q`` of them valid."""
        kl = self.k + self.l
        worker_state: dict[str, Tensor] = {}
        plain: dict[str, Any] = {}
        if self.role == "worker":
            worker_state = {"theta": flatten(self.params),
                            "theta0": self.space.gather(self.theta0),
                            "grad_sum": self.space.gather(self.grad_sum)}
            for key, value in self.base.state_dict()["state"].get(0, {}).items():
                if isinstance(value, Tensor):
                    local = value.dim() == 1 and len(value) == self.space.local
                    worker_state[f"base/{key}"] = self.space.gather(value) if local else value
                else:
                    plain[key] = value
            plain = {"base": plain, "scaling": self.scaling}
        tensors, plain = _share(self.comm, self.workers[0], worker_state, plain,
                                "mr-dho2 state of the workers")
        ese, info = None, None
        if self.steps % self.period:  # mid-period: the accelerators' ESE is still to be used
            found: dict[str, Tensor] = {}
            if self.role == "accelerator":
                res = self._ese
                vecs = res.eigenvectors
                if self.acc_space.distributed:
                    vecs = torch.cat(self.acc_space.comm.allgather(
                        vecs.contiguous(), shapes=[(len(vecs), b) for _, b in
                                                   self.acc_space.blocks],
                        meta="mr-dho2 state: eigenvectors"), 1)
                found = {"eigenvalues": res.eigenvalues, "eigenvectors": vecs}
                info = {"k": res.k, "l": res.l, "steps": res.steps}
            got, info = _share(self.comm, self.accelerators[0], found, info,
                               "mr-dho2 state of the accelerators")
            q = len(got["eigenvalues"])
            ese = {**info, "q": q, "eigenvalues": _pad(got["eigenvalues"], kl),
                   "eigenvectors": _pad(got["eigenvectors"], kl)}
        base_state = {key[len("base/"):]: t for key, t in tensors.items()
                      if key.startswith("base/")}
        base_state.update(plain["base"])
        return {"n": self.n, "steps": self.steps, "period": self.period,
                "q": len(self.eigenvalues), "eigenvalues": _pad(self.eigenvalues, kl),
                "scaling": plain["scaling"], "theta": tensors["theta"],
                "theta0": tensors["theta0"], "grad_sum": tensors["grad_sum"],
                "base": {"state": {0: base_state} if base_state else {},
                         "param_groups": self.base.state_dict()["param_groups"]},
                "ese": ese}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` saved on any world size and accelerator fraction (not
        collective): workers take their blocks of ``theta_0``, ``G`` and the base state and set
        the parameters to the saved ``theta``; accelerators set them to ``theta_0`` (what they
        hold during a period) and take their blocks of a pending ESE.  With the same world
        size and fraction the run continues bitwise as an uninterrupted one; otherwise it
        continues from the same global state, its reductions summed in another order.

        Raises:
            ValueError: a state of another number of parameters, period or ``k + l``.
        """
        state = state_dict
        kl = self.k + self.l
        for what, saved, mine in (("parameters", state["n"], self.n),
                                  ("period", state["period"], self.period),
                                  ("k + l", len(state["eigenvalues"]), kl)):
            if saved != mine:
                raise ValueError(f"the state has {what} {saved}, this MRDHO2 has {mine}")
        self.steps = int(state["steps"])
        self.scaling = float(state["scaling"])
        self.eigenvalues = state["eigenvalues"][: int(state["q"])].clone()
        dtype = self.flat.dtype
        theta, theta0 = state["theta"].to(dtype), state["theta0"].to(dtype)
        self._ese, self.last_ese = None, None
        if self.role == "worker":
            assign(self.params, theta)
            self.flat.copy_(self.space.slice(theta))
            self.theta0 = self.space.slice(theta0).clone()
            self.grad_sum = self.space.slice(state["grad_sum"].to(dtype)).clone()
            base = state["base"]
            n, mine = self.n, lambda v: self.space.slice(v).clone()
            self.base.load_state_dict({**base, "state": {
                i: {k: mine(v) if isinstance(v, Tensor) and v.dim() == 1 and len(v) == n else v
                    for k, v in st.items()} for i, st in base["state"].items()}})
            return
        assign(self.params, theta0)
        ese = state["ese"]
        if ese is not None:
            q, sp = int(ese["q"]), self.acc_space
            vecs = ese["eigenvectors"][:q, sp.start: sp.start + sp.local].clone()
            self._ese = ESEResult(ese["eigenvalues"][:q].clone(), vecs, int(ese["k"]),
                                  int(ese["l"]), int(ese["steps"]),
                                  vecs.numel() * vecs.element_size(), 0.0)

    def __repr__(self) -> str:
        return (f"MRDHO2(n={self.n}, accelerator_fraction={self.accelerator_fraction}, "
                f"accelerators={len(self.accelerators)}, "
                f"workers={len(self.workers)}, role={self.role!r}, period={self.period}, "
                f"k={self.k}, l={self.l}, order={self.order}, alpha={self.alpha}, "
                f"lr_clip={self.lr_clip}, seed={self.seed}, "
                f"base={type(self.base).__name__}({self.base.defaults.get('lr')!r}))")


def _pad(t: Tensor, rows: int) -> Tensor:
    """``t`` with its first dim zero-padded to ``rows``."""
    out = t.new_zeros(rows, *t.shape[1:])
    out[: len(t)] = t
    return out


def _share(comm, root: int, tensors: dict[str, Tensor], plain: Any,
           meta: str) -> tuple[dict[str, Tensor], Any]:
    """Rank ``root``'s named ``tensors`` and ``plain`` values (JSON) on every rank, bit for bit:
    one broadcast of two sizes, one of a JSON header (the values, each tensor's name, dtype and
    shape) followed by the tensors' bytes.  Other ranks pass anything for both."""
    device = getattr(comm, "device", None)
    sizes = torch.zeros(2, dtype=torch.int64, device=device)
    if comm.rank == root:
        items = [(k, t.detach().cpu().contiguous()) for k, t in tensors.items()]
        header = json.dumps({"plain": plain, "tensors": [
            [k, str(t.dtype).removeprefix("torch."), list(t.shape)] for k, t in items]}).encode()
        data = header + b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes()
                                 for _, t in items)
        sizes[0], sizes[1] = len(header), len(data)
    sizes = comm.broadcast(sizes, root=root, meta=f"{meta}: sizes")
    head, total = int(sizes[0]), int(sizes[1])
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if comm.rank == root
           else torch.empty(total, dtype=torch.uint8, device=device))
    raw = comm.broadcast(buf, root=root, meta=meta).cpu().numpy().tobytes()
    header = json.loads(raw[:head])
    out, offset = {}, head
    for name, dtype_name, shape in header["tensors"]:
        dtype = getattr(torch, dtype_name)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out[name] = (torch.frombuffer(bytearray(raw[offset: offset + nbytes]), dtype=dtype)
                     .reshape(shape).clone() if nbytes else torch.empty(shape, dtype=dtype))
        offset += nbytes
    return out, header["plain"]


def _blocks(n: int, parts: int) -> list[tuple[int, int]]:
    """``(start, end)`` of every balanced block."""
    return [(s, s + b) for s, b in (balanced_block(n, parts, r) for r in range(parts))]


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return lo, max(lo, hi)
