"""FOSI: a base first-order optimizer on the complement of the Hessian's extreme eigen-subspace,
a Newton step with momentum on the subspace (Sivan et al., ICLR 2024).

Notation: ``g`` the global-batch mean gradient, flattened; ``E`` the ``q = k + l`` eigenvectors
(rows, orthonormal) of the ESE, ``lambda`` their eigenvalues (l smallest, then k largest),
``eta = 1 / |lambda|``.  One step:

1. ``g1 = E^T E g``, ``g2 = g - g1``            (split gradient)
2. ``v <- phi(g1, v)``                            (momentum of the base optimizer on g1)
3. ``newton = E^T diag(eta) E v``
4. ``delta = base(g2)``                           (the base optimizer's step, applied to g2)
5. ``delta <- delta - E^T E delta``               (kept on the complement)
6. ``theta <- theta + s delta - alpha newton``,  ``s = clip(eta_l / eta_{q-1}, 1, lr_clip)``

``phi`` follows the base optimizer: SGD ``g + mu v`` (Nesterov ``(1 + mu) g + mu^2 v``, no momentum
``g``), Adam-like ``(1 - beta1) g + beta1 v``, otherwise ``g``.  ESE runs at step ``warmup`` and
every ``ese_every`` steps after it (counting steps from 1); before the first ESE, ``E`` is empty
and FOSI is its base optimizer.

Every long vector is held as balanced blocks of the flattened parameters (:class:`SlicedSpace`):
with one rank this is FOSI, with P ranks it is DHO2 (:mod:`distkfac.hybrid.dho2`), the same
arithmetic entry by entry.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from distconv.nn.sharding import ShardSpec
from distkfac.hybrid.lanczos import ESEResult, ese, make_hvp
from distkfac.hybrid.space import SlicedSpace, assign, flatten

__all__ = ["FOSI", "BaseFactory", "base_delta", "build_base", "newton_momentum",
           "newton_rates", "check_spectrum", "sample_count",
           "world_of"]

BaseFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
# the per-entry state of the elementwise base optimizers (torch's names): sliced like the
# parameters in a checkpoint; any other state (e.g. Adam's ``step``) is replicated
ELEMENTWISE_STATE = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf",
                     "square_avg", "grad_avg", "sum")
ADAM_LIKE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
             torch.optim.RAdam)


def newton_momentum(base: torch.optim.Optimizer) -> Callable[[Tensor, Tensor], Tensor]:
    """``phi(g1, v)``: the momentum rule of ``base`` applied to the subspace gradient."""
    group = base.param_groups[0]
    if isinstance(base, ADAM_LIKE):
        b1 = float(group["betas"][0])
        return lambda g, v: (1 - b1) * g + b1 * v
    if isinstance(base, torch.optim.SGD) and group.get("momentum", 0):
        mu = float(group["momentum"])
        if group.get("nesterov", False):
            return lambda g, v: (1 + mu) * g + mu * mu * v
        return lambda g, v: g + mu * v
    return lambda g, v: g


def newton_rates(eigenvalues: Tensor, *, l: int, lr_clip: float) -> tuple[Tensor, float]:
    """``eta = 1/|lambda|`` and the scaling ``s = clip(eta_l / eta_{q-1}, 1, lr_clip)`` (1 when
    there is no largest pair) for eigenvalues ascending, the first ``l`` the smallest."""
    mag = eigenvalues.abs()
    # a zero eigenvalue would give an infinite Newton step: floor it far below the largest
    mag = mag.clamp_min(float(mag.max()) * 1e-12 if len(mag) else 0.0)
    eta = 1.0 / mag
    q = len(eta)
    scaling = min(max(float(eta[l] / eta[q - 1]), 1.0), lr_clip) if q > l else 1.0
    return eta, scaling


def build_base(base: BaseFactory, flat: torch.nn.Parameter) -> torch.optim.Optimizer:
    """The base optimizer on the one flat tensor ``flat``, its learning rates checked."""
    if not callable(base):
        raise TypeError(f"base must be a callable params -> torch.optim.Optimizer, got {base!r}")
    opt = base([flat])
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"base must return a torch.optim.Optimizer, got {opt!r}")
    for group in opt.param_groups:
        lr = group.get("lr")
        lr = float(lr) if isinstance(lr, Tensor) else lr
        if lr is not None and (not math.isfinite(lr) or lr < 0):
            raise ValueError(f"base optimizer lr must be finite and >= 0, got {lr!r}")
    return opt


@torch.no_grad()
def base_delta(opt: torch.optim.Optimizer, flat: torch.nn.Parameter, grad: Tensor) -> Tensor:
    """The change ``opt`` makes to ``flat`` for the gradient ``grad``; ``flat`` is left as it was
    (the caller applies the final update), the optimizer's state advances."""
    before = flat.detach().clone()
    flat.grad = grad
    opt.step()
    delta = flat.detach() - before
    flat.copy_(before)
    return delta


def _positive_int(value, name: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _finite(value, name: str, *, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < minimum:
        raise ValueError(f"{name} must be a finite number >= {minimum}, got {value!r}")
    return float(value)


def sample_count(value, name: str = "num_samples", *, allow_zero: bool = False) -> float:
    """``value`` as a float sample count: a real number (not a bool), finite and > 0
    (``>= 0`` with ``allow_zero``), else TypeError / ValueError naming ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of samples (an int or float, e.g. "
                        f"x.shape[0]), got {value!r} of type {type(value).__name__}")
    bound = ">= 0" if allow_zero else "> 0"
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number of samples {bound} (it weights this "
                         f"rank's mean gradient), got {value!r}")
    return float(value)


def world_of(comm, grid):
    """The communicator of ``comm=`` or ``grid=`` (a ``ProcessorGrid``: all its ranks); exactly
    one must be given."""
    if (comm is None) == (grid is None):
        raise TypeError(f"pass exactly one of comm= (a distconv.comm Communicator) or grid= "
                        f"(a ProcessorGrid), got comm={comm!r}, grid={grid!r}")
    if grid is not None:
        if not hasattr(grid, "comm"):
            raise TypeError(f"grid must be a distconv ProcessorGrid, got {grid!r}")
        comm = grid.comm
    if not hasattr(comm, "allgather"):
        raise TypeError(f"comm must be a distconv.comm Communicator, got {comm!r}")
    return comm


def check_spectrum(k, l, order, n: int) -> tuple[int, int, int]:
    """Validated ``(k, l, order)``: ``k, l >= 0``, ``k + l >= 1``, ``k + l <= order <= n``
    (``order`` None: ``4 (k + l)``, the FOSI authors' Lanczos order)."""
    k = _positive_int(k, "k", minimum=0)
    l = _positive_int(l, "l", minimum=0)
    if k + l < 1:
        raise ValueError(f"k + l must be >= 1 (eigenpairs to estimate), got k={k}, l={l}")
    order = 4 * (k + l) if order is None else _positive_int(order, "order")
    if order < k + l:
        raise ValueError(f"order (Lanczos steps) must be >= k + l = {k + l}: Lanczos of order "
                         f"{order} gives at most {order} eigenpairs, got order={order}")
    if order > n:
        raise ValueError(f"order (Lanczos steps, default 4(k+l)) must be <= the number of "
                         f"parameters n={n}, got {order}; lower k, l or pass order=")
    return k, l, order


class _HybridOrder(torch.optim.Optimizer):
    """The FOSI step on a :class:`SlicedSpace` (shared by FOSI and DHO2)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], base: BaseFactory, *,
                 ese_closure: Callable[[], Tensor] | None, k: int, l: int, order: int | None,
                 ese_every: int, warmup: int | None, alpha: float, lr_clip: float | None,
                 seed: int, ese_samples: float, comm) -> None:
        super().__init__(params, {})
        self.params = [p for g in self.param_groups for p in g["params"]]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise TypeError(f"params must share one floating dtype, got {sorted(map(str, dtypes))}")
        n = sum(p.numel() for p in self.params)
        self.k, self.l, self.order = check_spectrum(k, l, order, n)
        self.ese_every = _positive_int(ese_every, "ese_every")
        self.warmup = self.ese_every if warmup is None else _positive_int(warmup, "warmup")
        self.alpha = _finite(alpha, "alpha", minimum=0.0)
        self.seed = _positive_int(seed, "seed", minimum=0)
        self.ese_samples = _finite(ese_samples, "ese_samples", minimum=0.0)
        if ese_closure is not None and not callable(ese_closure):
            raise TypeError(f"ese_closure must be callable (returning the loss), got "
                            f"{ese_closure!r}")
        self.ese_closure = ese_closure
        self.space = SlicedSpace(n, comm)
        self._init_base(base)
        default_clip = 1.0 if isinstance(self.base, ADAM_LIKE) else 3.0
        self.lr_clip = default_clip if lr_clip is None else _finite(lr_clip, "lr_clip", minimum=1.0)
        self.steps = 0
        self.velocity = torch.zeros_like(self.flat)
        self.eigenvalues = torch.zeros(0, dtype=torch.float64)
        self.eigenvectors = self.flat.new_zeros(0, self.space.local)
        self.eta = self.flat.new_zeros(0)
        self.scaling = 1.0
        self.last_ese: ESEResult | None = None

    def _init_base(self, base: BaseFactory) -> None:
        self.flat = torch.nn.Parameter(self.space.slice(flatten(self.params)).clone())
        self.base = build_base(base, self.flat)
        self.phi = newton_momentum(self.base)

    # ------------------------------------------------------------------ ESE
    def ese_due(self) -> bool:
        """Whether the coming step (number ``steps + 1``) starts with an ESE."""
        t = self.steps + 1
        return t >= self.warmup and (t - self.warmup) % self.ese_every == 0

    def estimate(self, closure: Callable[[], Tensor] | None = None, *,
                 num_samples: float | None = None) -> ESEResult:
        """Run ESE now on ``closure`` (default: ``ese_closure``): the loss on this rank's ESE
        samples at the current parameters, a mean over ``num_samples`` (default ``ese_samples``;
        a finite number >= 0, else TypeError / ValueError)."""
        if num_samples is not None:
            num_samples = sample_count(num_samples, allow_zero=True)
        closure = self.ese_closure if closure is None else closure
        if closure is None:
            raise ValueError("ESE needs a loss closure: pass ese_closure= to the constructor or "
                             "to step()")
        weight = self.ese_samples if num_samples is None else num_samples
        res = ese(make_hvp(self.params, closure), self.space, k=self.k, l=self.l,
                  order=self.order, seed=self.seed, weight=weight)
        self.set_eigenpairs(res.eigenvalues, res.eigenvectors, l=res.l)
        self.last_ese = res
        return res

    def set_eigenpairs(self, eigenvalues: Tensor, eigenvectors: Tensor, *, l: int) -> None:
        """Install eigenpairs (ascending; the first ``l`` are the smallest) and this rank's
        eigenvector slices; sets ``eta = 1/|lambda|`` and the scaling factor ``s``."""
        self.eigenvalues = eigenvalues
        self.eigenvectors = eigenvectors.to(self.flat.dtype)
        eta, self.scaling = newton_rates(eigenvalues, l=l, lr_clip=self.lr_clip)
        self.eta = eta.to(self.flat.dtype)

    # ------------------------------------------------------------------ step
    def _gradient(self) -> Tensor:
        return flatten([p.grad if p.grad is not None else torch.zeros_like(p)
                        for p in self.params])

    @torch.no_grad()
    def step(self, closure=None, *, num_samples: float = 1.0,
             ese_closure: Callable[[], Tensor] | None = None):
        """One FOSI step from ``p.grad`` (this rank's mean over its ``num_samples`` samples).

        ``num_samples``: a finite number > 0 (default 1); anything else (0, negative, NaN, a
        bool, a non-number) raises TypeError / ValueError before the step, since it weights
        the rank's gradient in the global mean (0 samples on every rank would divide by 0).
        ``closure`` (optional) recomputes the loss and gradients, as in ``torch.optim``;
        ``ese_closure`` overrides the constructor's for an ESE due at this step."""
        num_samples = sample_count(num_samples)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.ese_due():
            self.estimate(ese_closure)
        self.flat.copy_(self.space.slice(flatten(self.params)))
        g = self.space.reduce_mean(self._gradient(), num_samples)
        self.flat.copy_(self.flat + self.update(g))
        assign(self.params, self.space.gather(self.flat.detach()))
        self.steps += 1
        return loss

    def update(self, g: Tensor) -> Tensor:
        """Steps 1–6 on this rank's slices; returns this rank's slice of the parameter change."""
        e = self.eigenvectors
        q = len(e)
        g1 = self.space.dots(e, g, "fosi split") @ e if q else torch.zeros_like(g)
        self.velocity = self.phi(g1, self.velocity)
        delta = self.base_step(g - g1)
        if not q:
            return delta
        c = self.space.dots(e, torch.stack([self.velocity, delta], 1), "fosi newton and orth")
        newton = (self.eta * c[:, 0]) @ e
        delta = delta - c[:, 1] @ e
        return self.scaling * delta - self.alpha * newton

    def base_step(self, g2: Tensor) -> Tensor:
        """The base optimizer's change of this rank's slice for the gradient ``g2``."""
        return base_delta(self.base, self.flat, g2)

    def add_param_group(self, param_group) -> None:
        if hasattr(self, "space"):  # torch.optim's own __init__ adds the first group
            raise NotImplementedError(f"{type(self).__name__} flattens its parameters once: "
                                      "pass every parameter to the constructor")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ state
    def shard_specs(self) -> dict[str, ShardSpec]:
        """Where the tensors of :meth:`state_dict` lie, for checkpoints that reshard
        (``distconv.save(model, path, states={"opt": opt})``): the velocity and the base
        optimizer's elementwise state are ``x[o_P]`` of global shape ``(n,)``, the eigenvectors
        ``E[*, o_P]`` of shape ``(k + l, n)`` (balanced blocks over the grid ``{P: size}``, see
        :meth:`SlicedSpace.spec`); everything else is replicated."""
        vector = self.space.spec()
        specs = {"velocity": vector, "eigenvectors": self.space.spec(self.k + self.l)}
        specs.update({f"base/state/0/{name}": vector for name in ELEMENTWISE_STATE})
        return specs

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bitwise as an uninterrupted one: the step
        count, the velocity, the eigenpairs with their rates ``eta`` and scaling ``s``, and the
        base optimizer's state (its ``state_dict()``, learning rates included).  The
        eigenpairs are padded to ``k + l`` rows (``q`` of them valid), so the shapes do not
        depend on what the last ESE found.  Tensors are this rank's blocks (see
        :meth:`shard_specs`): saved through ``distconv.save`` they reshard onto any number of
        ranks, where the global state is the same bit for bit (see :meth:`load_state_dict`)."""
        q, kl = len(self.eigenvectors), self.k + self.l
        vectors = self.eigenvectors.new_zeros(kl, self.space.local)
        vectors[:q] = self.eigenvectors
        values = torch.zeros(kl, dtype=torch.float64)
        values[:q] = self.eigenvalues
        eta = self.eta.new_zeros(kl)
        eta[:q] = self.eta
        return {"n": self.space.n, "steps": self.steps, "q": q, "scaling": self.scaling,
                "velocity": self.velocity.clone(), "eigenvalues": values, "eta": eta,
                "eigenvectors": vectors, "base": self.base.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, saved on any number of ranks: each tensor must be this
        rank's block (``distconv.load`` reads it so) or the whole global tensor (a state saved
        on one process, loaded here by hand), which is sliced.  On the same number of ranks the
        run continues bitwise as an uninterrupted one; on another, the global state is the
        saved one bit for bit and the steps differ from the saved run's only in the order of
        the floating-point sums of the reductions (as DHO2 differs from FOSI).

        Raises:
            ValueError: a state of another number of parameters or of another ``k + l``.
        """
        state = state_dict
        n, kl = self.space.n, self.k + self.l
        if state["n"] != n:
            raise ValueError(f"the state is of {state['n']} parameters, this "
                             f"{type(self).__name__} has {n}")
        if len(state["eigenvalues"]) != kl:
            raise ValueError(f"the state holds k + l = {len(state['eigenvalues'])} eigenpairs, "
                             f"this {type(self).__name__} has k + l = {kl} (k={self.k}, "
                             f"l={self.l})")
        q = int(state["q"])
        self.steps = int(state["steps"])
        self.scaling = float(state["scaling"])
        self.velocity = self._local(state["velocity"]).to(self.flat.dtype).clone()
        self.eigenvalues = state["eigenvalues"][:q].clone()
        self.eigenvectors = self._local(state["eigenvectors"])[:q].to(self.flat.dtype).clone()
        self.eta = state["eta"][:q].to(self.flat.dtype).clone()
        base = state["base"]
        self.base.load_state_dict({**base, "state": {
            i: {k: self._local(v) if isinstance(v, Tensor) and v.dim() == 1 else v
                for k, v in s.items()} for i, s in base["state"].items()}})
        self.last_ese = None

    def _local(self, t: Tensor) -> Tensor:
        """This rank's block of a sliced tensor given whole (``(n,)`` or ``(rows, n)``); a block
        is returned as it is."""
        if t.shape[-1] == self.space.n and self.space.local != self.space.n:
            return t[..., self.space.start: self.space.start + self.space.local]
        if t.shape[-1] != self.space.local:
            raise ValueError(f"a sliced tensor of shape {tuple(t.shape)} is neither this "
                             f"rank's block ({self.space.local} of {self.space.n}) nor whole")
        return t

    def _settings(self) -> str:
        return (f"k={self.k}, l={self.l}, order={self.order}, ese_every={self.ese_every}, "
                f"warmup={self.warmup}, alpha={self.alpha}, lr_clip={self.lr_clip}, "
                f"seed={self.seed}, base={type(self.base).__name__}"
                f"({self.base.defaults.get('lr')!r})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n={self.space.n}, {self._settings()})"


class FOSI(_HybridOrder):
    """FOSI on one process, as a ``torch.optim`` optimizer wrapping a base optimizer.

    Usage::

        opt = FOSI(model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                   ese_closure=lambda: loss_fn(model(x_ese), y_ese), k=5)
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

    Checkpoints: ``distconv.save(model, path, states={"opt": opt})`` and the same in
    ``distconv.load`` (``states=``, not ``optimizer=``: the state is more than a
    ``torch.optim`` state); the resumed run continues bitwise (see :meth:`state_dict`).

    Args:
        params: the parameters (one floating dtype); their flattened concatenation is theta.
        base: ``params -> torch.optim.Optimizer``, the base optimizer, built on one flat tensor
            (its learning rate is the base learning rate).
        ese_closure: the loss on the ESE batch at the current parameters (default None: pass one
            to :meth:`step` or :meth:`estimate`).
        k: largest eigenpairs (default 5).  l: smallest eigenpairs (default 0).
        order: Lanczos steps (default ``4 (k + l)``, as the FOSI authors); ``k + l <= order <= n``.
        ese_every: steps between ESEs, ``T`` (default 100).
        warmup: the step of the first ESE (default ``ese_every``).
        alpha: the Newton step's learning rate (default 0.1).
        lr_clip: the scaling factor's upper clip (default 3.0; 1.0 for Adam-like bases).
        seed: seed of the Lanczos start vector (default 0).
        ese_samples: samples behind ``ese_closure``'s mean (default 1; only weights ranks in DHO2).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], base: BaseFactory, *,
                 ese_closure: Callable[[], Tensor] | None = None, k: int = 5, l: int = 0,
                 order: int | None = None, ese_every: int = 100, warmup: int | None = None,
                 alpha: float = 0.1, lr_clip: float | None = None, seed: int = 0,
                 ese_samples: float = 1.0) -> None:
        super().__init__(params, base, ese_closure=ese_closure, k=k, l=l, order=order,
                         ese_every=ese_every, warmup=warmup, alpha=alpha, lr_clip=lr_clip,
                         seed=seed, ese_samples=ese_samples, comm=None)
