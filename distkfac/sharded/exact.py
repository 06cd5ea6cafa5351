"""``'exact'``: the global layer's K-FAC on row blocks of its factors (:class:`ExactLayer`), the
all-to-alls that decompose each factor on its owner (:func:`exchange_exact`) and the fused
reduce-scatters that apply the damped inverses (:func:`precondition_exact`); see
:mod:`distkfac.sharded` for the steps and their bytes."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from distconv.distribution import balanced_block
from distkfac.lowprec import reduce_scatter
from distkfac.sharded.geometry import ShardGeometry, redundant_comm
from distkfac.sharded.statistics import input_cov

__all__ = ["ExactLayer", "exchange_exact", "precondition_exact"]


class ExactLayer:
    """Runtime of one DistConv2d or DistConvNd (direct or transposed, :class:`ShardGeometry`)
    under ``'exact'``: row-block factors, their owners, and the two reduce-scatters that apply
    the damped inverses (see the module docstring)."""

    def __init__(self, module: nn.Module, name: str, dtype: torch.dtype,
                 comm_dtype: torch.dtype | str | None = None) -> None:
        geo = ShardGeometry(module)
        self.comm_dtype = comm_dtype
        if module.groups > 1:
            raise NotImplementedError(
                f"K-FAC of the grouped {type(module).__name__} {name!r} (groups={module.groups}) "
                "as one exact layer over channel or filter blocks is not implemented (its blocks "
                "hold whole groups: register it per shard, ShardAdapter); skip it with "
                "skip_layers or use sample/spatial parallelism for it")
        self.module, self.name, self.geo, self.dtype = module, name, geo, dtype
        grid = module.grid
        self.grid = grid
        self.c_comm = grid.subcomm([geo.cdim]) if geo.C > 1 else None
        self.f_comm = grid.subcomm([geo.fdim]) if geo.F > 1 else None
        self.comm = redundant_comm(module)
        self.rows = {"A": geo.a_rows(geo.c), "G": geo.g_rows(geo.f)}
        self.inv_rows = {"A": geo.a_inv_rows(geo.c), "G": self.rows["G"]}
        self.side = {"A": geo.K, "G": geo.fo}
        self.factors: dict[str, Tensor | None] = {"A": None, "G": None}
        self.updates = 0
        self.inverse_rows: dict[str, Tensor | None] = {"A": None, "G": None}
        self.positions, self.prescaled = 1, False
        self.y_shape: tuple[int, ...] = ()

    @property
    def replication(self) -> int:
        return 1 if self.comm is None else self.comm.size

    # ------------------------------------------------------------------ statistics
    def work_a(self, x: Tensor, padding: tuple[int, ...], y: Tensor,
               dtype: torch.dtype) -> tuple[Tensor | Callable[[], Tensor], int]:
        """``A[c, :]``'s contribution of this rank's samples, or (C > 1) a callable that waits
        for it: the C ranks of a segment hold the same samples, each its channels, so one
        all-to-all over C gives rank c every channel of its 1/C of the samples; it forms the
        whole A of those (by lags, :func:`~distkfac.layers.conv_input_cov`) and one
        asynchronous reduce-scatter over C sums the row blocks.  Each rank forms 1/C of the
        Gram matrix instead of its row block of all of it."""
        m, geo = self.module, self.geo
        x = x.detach()
        positions = math.prod(y.shape[2:])
        rows = x.shape[0] * positions

        def cov(xs: Tensor) -> Tensor:
            return input_cov(m, xs.to(dtype), padding, self.y_shape, 1, geo.bias)[0]

        if self.c_comm is None:
            return cov(x), rows
        samples = [balanced_block(x.shape[0], geo.C, i) for i in range(geo.C)]
        mine = samples[geo.c][1]
        parts = self.c_comm.alltoall(
            [x[lo: lo + n].contiguous() for lo, n in samples],
            recv_shapes=[(mine, n, *x.shape[2:]) for _, n in geo.c_blocks],
            meta=f"kfac x of {self.name}")
        if mine:
            full = cov(torch.cat(parts, 1))[0]
        else:
            full = torch.zeros(geo.K, geo.K, dtype=dtype, device=x.device)
        blocks = [(lo * geo.K, n * geo.K) for lo, n in
                  (balanced_block(geo.K, geo.C, i) for i in range(geo.C))]
        wait = reduce_scatter(self.c_comm, full.reshape(-1), mine * positions,
                              blocks, self.comm_dtype, meta=f"kfac A rows of {self.name}")
        return (lambda: wait().reshape(1, -1, geo.K)), rows

    def work_g(self, gy: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
        """``G[f, :]``'s contribution (sum of g g^T, unscaled; allgather over F)."""
        g = gy.detach().to(dtype)
        full = g
        if self.f_comm is not None:
            shapes = [(g.shape[0], n, *g.shape[2:]) for _, n in self.geo.f_blocks]
            full = torch.cat(self.f_comm.allgather(g.contiguous(), shapes=shapes,
                                                   meta=f"kfac dL/dy of {self.name}"), 1)
        mine = g.flatten(2)
        return ((mine @ full.flatten(2).transpose(1, 2)).sum(0).unsqueeze(0),
                g.shape[0] * mine.shape[2])

    def update(self, results: dict[str, tuple[Tensor, float]], decay: float) -> bool:
        a, g = results.get(self.name + "/A"), results.get(self.name + "/G")
        if a is None or g is None:
            return False
        scale = 1.0 if self.prescaled else (g[1] / self.positions) ** 2
        new = {"A": a[0][0] / a[1], "G": g[0][0] / g[1] * scale}
        for key, value in new.items():
            value = value.to(self.dtype)
            old = self.factors[key]
            self.factors[key] = value.clone() if old is None else old.mul_(decay).add_(
                value, alpha=1.0 - decay)
        self.updates += 1
        return True

    # ------------------------------------------------------------------ preconditioning
    def ready(self) -> bool:
        """Whether this step preconditions the layer: its weight has a gradient and the row
        blocks of the damped inverses have arrived."""
        return self.module.weight.grad is not None and self.inverse_rows["A"] is not None

    def a_side(self) -> tuple[list[Tensor], tuple[Tensor, Tensor | None]]:
        """``P = V[f, c] (A + rI)^-1[c, :] + e_c (A + rI)^-1[bias, :]``, a pending sum over C
        (``e_c``: this rank's bias shard at its filters' rows), as the C column blocks the
        reduce-scatter hands out, each with the bias column; and ``V`` (weight, bias)."""
        m, geo = self.module, self.geo
        vw = geo.matrix(m.weight.grad.detach())[0].to(self.dtype)
        fn, ck = vw.shape
        a_inv = self.inverse_rows["A"]
        p = vw @ a_inv[:ck]
        vb = None
        if geo.bias:
            vb = (m.bias.grad.detach().to(self.dtype) if m.bias.grad is not None
                  else vw.new_zeros(m.bias.shape))
            lo, n = self._bias_block()
            e = vw.new_zeros(fn)
            e[lo: lo + n] = vb
            p = p.addr(e, a_inv[ck])
        if self.c_comm is None:
            return [p], (vw, vb)
        chunks = []
        for lo, n in geo.c_blocks:
            part = p[:, lo * geo.k2: (lo + n) * geo.k2]
            chunks.append(torch.cat([part, p[:, -1:]], 1) if geo.bias else part.contiguous())
        return chunks, (vw, vb)

    def g_side(self, u: Tensor) -> list[Tensor]:
        """``(G + rI)^-1[f, :]^T U``, a pending sum over F, as the F row blocks."""
        g_inv = self.inverse_rows["G"]
        if self.f_comm is None:
            return [g_inv @ u]
        q = g_inv.T @ u
        return [q[lo: lo + n] for lo, n in self.geo.f_blocks]

    def result(self, v: Tensor, vw: Tensor, vb: Tensor | None,
               ) -> tuple[Tensor, Tensor, Callable[[Tensor], None]]:
        """``(V shard, V~ shard, write)`` flattened alike, from this rank's block of V~ and
        its gradient ``V`` (weight ``vw``, bias ``vb``)."""
        m = self.module
        fn, ck = vw.shape
        got, out = [vw.reshape(-1)], [v[:, :ck].reshape(-1)]
        if vb is not None:
            lo, n = self._bias_block()
            got.append(vb.reshape(-1))
            out.append(v[lo: lo + n, -1])

        def write(scaled: Tensor) -> None:
            m.weight.grad.copy_(self.geo.weight(scaled[: fn * ck], m.weight.shape))
            if vb is not None and m.bias.grad is not None:
                m.bias.grad.copy_(scaled[fn * ck:].reshape(m.bias.shape))

        return torch.cat(got), torch.cat(out), write

    def _bias_block(self) -> tuple[int, int]:
        """This rank's bias shard inside its filter block: ``b[o_{F x C}]``."""
        if self.c_comm is None:
            return 0, self.geo.f_blocks[self.geo.f][1]
        return self.geo.bias_subblocks()[self.geo.c]

    def __repr__(self) -> str:
        return (f"ExactLayer({self.name!r}, A rows {len(self.rows['A'])}/{self.side['A']}, "
                f"G rows {len(self.rows['G'])}/{self.side['G']})")


def _fused_reduce_scatter(comms: list, parts: list[list[Tensor]],
                          meta: str) -> Callable[[], list[Tensor]]:
    """Launch one asynchronous reduce-scatter per communicator for all the layers on it
    (``parts[i][r]``: layer i's chunk for rank r; ``comms[i]`` None: nothing to reduce) and
    return the wait that hands back each layer's own chunk."""
    out: list[Tensor | None] = [p[0] if c is None else None for c, p in zip(comms, parts)]
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(comms):
        if c is not None:
            groups.setdefault(id(c), []).append(i)
    pending = []
    for idx in groups.values():
        comm = comms[idx[0]]
        chunks = [torch.cat([parts[i][r].reshape(-1) for i in idx]) for r in range(comm.size)]
        work = comm.reduce_scatter(chunks, async_op=True, meta=f"{meta} of {len(idx)} layers")
        pending.append((idx, [parts[i][comm.rank].shape for i in idx], work))

    def wait() -> list[Tensor]:
        for idx, shapes, work in pending:
            flat, offset = work.wait(), 0
            for i, shape in zip(idx, shapes):
                n = shape.numel()
                out[i] = flat[offset: offset + n].reshape(shape)
                offset += n
        return out

    return wait


def precondition_exact(layers: list[ExactLayer], meanwhile: Callable[[], None] = lambda: None,
                       ) -> list[tuple[int, Tensor, Tensor, Callable[[Tensor], None]]]:
    """Precondition every ready exact layer: one reduce-scatter over each C communicator for
    all of them (``meanwhile()`` runs while it is in flight), then one over each F
    communicator.  Returns ``(replication, V, V~, write)`` per layer."""
    ready = [ly for ly in layers if ly.ready()]
    sides = [ly.a_side() for ly in ready]
    wait = _fused_reduce_scatter([ly.c_comm for ly in ready], [p for p, _ in sides],
                                 "kfac A^-1")
    meanwhile()
    us = wait()
    vs = _fused_reduce_scatter([ly.f_comm for ly in ready],
                               [ly.g_side(u) for ly, u in zip(ready, us)], "kfac G^-1")()
    return [(ly.replication, *ly.result(v, *grads))
            for ly, v, (_, grads) in zip(ready, vs, sides)]


def exchange_exact(work: list[tuple[ExactLayer, str]], owners: list[int], comm,
                   decompose: Callable[[Tensor], Tensor], dtype: torch.dtype) -> None:
    """Assemble each exact factor on its owner, decompose it there and hand every rank its
    row block of the damped inverse: two all-to-alls over ``comm`` (all ranks of the grid).

    ``work[i] = (layer, 'A' or 'G')`` is owned by rank ``owners[i]``; ``decompose(full)``
    returns the damped inverse of a full ``(d, d)`` factor."""
    size, me = comm.size, comm.rank
    tasks = [(ly, key, owner) for (ly, key), owner in zip(work, owners)]
    # where the factors lie (every rank holds its row blocks of every task's factor)
    device = next((ly.factors[key].device for ly, key, _ in tasks
                   if ly.factors[key] is not None), torch.device("cpu"))

    def row_dim(ly: ExactLayer, key: str) -> str | None:
        return ly.geo.cdim if key == "A" else ly.geo.fdim

    def block_of(ly: ExactLayer, key: str, rank: int) -> int:
        d = row_dim(ly, key)
        return ly.grid.coords_of(rank).get(d, 0) if d else 0

    def rows_of(ly: ExactLayer, key: str, block: int) -> Tensor:
        return ly.geo.a_rows(block) if key == "A" else ly.geo.g_rows(block)

    def inv_rows_of(ly: ExactLayer, key: str, block: int) -> Tensor:
        return ly.geo.a_inv_rows(block) if key == "A" else ly.geo.g_rows(block)

    def sources(ly: ExactLayer, key: str, owner: int) -> dict[int, int]:
        """{block: rank that sends it} for the owner: the ranks that share all its coordinates
        but the row dim's."""
        d = row_dim(ly, key)
        if d is None:
            return {0: owner}
        coords = ly.grid.coords_of(owner)
        return {b: ly.grid.rank_of({**coords, d: b}) for b in range(ly.grid.extent(d))}

    # 1. row blocks to owners
    send: list[list[Tensor]] = [[] for _ in range(size)]
    recv_numel = [0] * size
    for ly, key, owner in tasks:
        for block, src in sources(ly, key, owner).items():
            n = len(rows_of(ly, key, block)) * ly.side[key]
            if src == me and owner != me:
                send[owner].append(ly.factors[key].reshape(-1))
            if owner == me and src != me:
                recv_numel[src] += n
    empty = torch.empty(0, dtype=dtype, device=device)
    got = comm.alltoall([torch.cat(s) if s else empty for s in send],
                        recv_shapes=[(n,) for n in recv_numel], meta="kfac exact factors")
    offsets = [0] * size
    mine: dict[tuple[int, str], Tensor] = {}
    for ly, key, owner in tasks:
        if owner != me:
            continue
        full = torch.empty(ly.side[key], ly.side[key], dtype=dtype, device=device)
        for block, src in sources(ly, key, owner).items():
            rows = rows_of(ly, key, block)
            n = len(rows) * ly.side[key]
            part = (ly.factors[key] if src == me
                    else got[src][offsets[src]: offsets[src] + n].reshape(len(rows), -1))
            if src != me:
                offsets[src] += n
            full[rows] = part
        mine[(id(ly), key)] = decompose((full + full.T) / 2)
    # 2. row blocks of the damped inverses from owners
    send = [[] for _ in range(size)]
    recv_numel = [0] * size
    for ly, key, owner in tasks:
        for r in range(size):
            if r == owner:
                continue
            if owner == me:
                send[r].append(mine[(id(ly), key)][inv_rows_of(ly, key, block_of(ly, key, r))]
                               .reshape(-1))
            if r == me:
                recv_numel[owner] += len(ly.inv_rows[key]) * ly.side[key]
    got = comm.alltoall([torch.cat(s) if s else empty for s in send],
                        recv_shapes=[(n,) for n in recv_numel], meta="kfac exact inverses")
    offsets = [0] * size
    for ly, key, owner in tasks:
        if owner == me:
            ly.inverse_rows[key] = mine[(id(ly), key)][ly.inv_rows[key]].clone()
        else:
            n = len(ly.inv_rows[key]) * ly.side[key]
            ly.inverse_rows[key] = got[owner][offsets[owner]: offsets[owner] + n].reshape(
                len(ly.inv_rows[key]), -1)
            offsets[owner] += n
