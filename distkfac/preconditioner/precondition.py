"""Step 4 of :class:`~distkfac.preconditioner.KFAC`: every step, each layer's gradient ``V``
becomes ``V~ = (G + sqrt(lam) I)^-1 V (A + sqrt(lam) I)^-1`` from its current decompositions (see
:mod:`distkfac.methods`; row-block ``'exact'`` layers through
:func:`distkfac.sharded.precondition_exact`), all scaled by the KL-clip factor
``nu = min(1, sqrt(kl_clip / |lr^2 sum_l <V~_l, V_l>|))`` (Pauloski et al. eq. 18) and written
back in place."""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import Tensor

from distkfac.preconditioner.layer import Layer, control_device
from distkfac.sharded import precondition_exact

__all__ = ["Preconditioning"]


class Preconditioning:
    """The preconditioning of :class:`~distkfac.preconditioner.KFAC` (a base of it: these
    methods read its layers, method, settings and communicator)."""

    def _precondition(self) -> None:
        t0 = time.perf_counter()
        damping = float(self._value("damping"))
        done: list[tuple[int, Tensor, Tensor, Callable[[Tensor], None]]] = []

        def others() -> None:
            for layer in self.layers:
                out = self._precondition_layer(layer, damping)
                if out is not None:
                    done.append(out)

        # the exact layers' reduce-scatters are in flight while the others are preconditioned
        done += precondition_exact(self.exact_layers, others)
        scale = 1.0
        kl_clip = self._value("kl_clip")
        if kl_clip is not None and done:
            lr = float(self._value("lr"))
            vg = self._vg(done) * lr * lr
            if vg != 0.0:
                scale = min(1.0, math.sqrt(float(kl_clip) / abs(vg)))
        for _, _, v, write in done:
            write(v * scale)
        self.last_kl_scale = scale
        self.timings["precondition"] += time.perf_counter() - t0

    def _precondition_layer(self, layer: Layer, damping: float,
                            ) -> tuple[int, Tensor, Tensor, Callable[[Tensor], None]] | None:
        """``(replication, V, V~, write)`` of a layer with whole (not row-block) factors."""
        if layer.a_payload is None:
            return None
        ad = layer.adapter
        grad = ad.grad_matrix(self.factor_dtype)
        if grad is None:
            return None
        # A decomposition used once (inverse updates every step) is applied directly; from
        # its second use on, the damped inverses are formed once and reused.
        fresh = layer.uses == 0
        layer.uses += 1
        if fresh:
            v = self.method.precondition(grad, layer.a_payload, layer.g_payload, ad.groups,
                                         ad.a_dim, ad.g_dim, damping)
        else:
            if layer.inverses is None or layer.inverses[0] != damping:
                layer.inverses = (
                    damping,
                    self.method.damped_inverse(layer.a_payload, ad.groups, ad.a_dim, damping),
                    self.method.damped_inverse(layer.g_payload, ad.groups, ad.g_dim, damping))
            _, a_inv, g_inv = layer.inverses
            v = g_inv @ grad @ a_inv
        return layer.replication, grad, v, ad.set_grad

    def _vg(self, done: list) -> float:
        """``sum_l <V~_l, V_l>`` over the global model: local sums, and when some layers are
        sharded one float64 allreduce over the grid with each gradient counted once."""
        sharded = self.exact_layers or any(ly.comm is not self.comm for ly in self.layers)
        if not sharded or self.comm is None or self.comm.size == 1:
            return sum(float((v * g).sum()) for _, g, v, _ in done)
        weights = [(self.comm.size if rep == 0 else rep) for rep, _, _, _ in done]
        local = sum(float((v * g).sum()) / w for w, (_, g, v, _) in zip(weights, done))
        total = self.comm.allreduce(torch.tensor([local], dtype=torch.float64,
                                                 device=control_device(self.comm)),
                                    meta="kfac KL clip")
        return float(total[0])
