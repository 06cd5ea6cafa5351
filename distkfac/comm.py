"""How K-FAC data moves: fused, packed, asynchronous reductions and broadcasts.

Everything goes through a ``distconv.comm`` Communicator; ``comm=None`` (or a group of one rank)
moves nothing.  The communicator given to each object is the set of ranks it works over: the
whole world for data parallelism, a segment of the grid for sharded layers.

Fusion rule (documented, measured in ``benchmarks/kfac.py``): factors are appended to the open
bucket in the order their hooks produce them; the bucket is launched as one asynchronous
allreduce as soon as it holds ``bucket_bytes`` or more, or when the last expected factor of the
step has arrived.  Every rank sees the same hook order, so buckets match across ranks.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from distkfac.factors import pack, packed_numel, unpack

__all__ = ["FactorReducer", "PayloadBroadcaster", "allreduce_gradients"]


class _Bucket:
    def __init__(self) -> None:
        self.keys: list[str] = []
        self.blocks: list[Tensor] = []
        self.counts: list[float] = []
        self.nbytes = 0
        self.work = None
        self.flat: Tensor | None = None


class FactorReducer:
    """Sum factor contributions ``(groups, d, d)`` and their row counts over ``comm``.

    ``add(key, blocks, rows)`` may be called from autograd hooks; ``finish()`` waits for all
    buckets and returns ``{key: (summed blocks, total rows)}``.  On the wire each bucket is one
    flat tensor: every factor's upper triangles (``symmetric=True``) or full blocks, then the
    row counts, so the reduction needs no other collective.  Without peers nothing is packed.
    """

    def __init__(self, comm=None, *, bucket_bytes: int = 1 << 20, symmetric: bool = True) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be an int >= 0, got {bucket_bytes!r}")
        self.comm = comm
        self.bucket_bytes = bucket_bytes
        self.symmetric = symmetric
        self._expected: set[str] = set()
        self._seen: set[str] = set()
        self._open = _Bucket()
        self._launched: list[_Bucket] = []

    @property
    def distributed(self) -> bool:
        return self.comm is not None and self.comm.size > 1

    def expect(self, keys: Iterable[str]) -> None:
        """Start a step: the keys whose arrival closes the last bucket."""
        self._expected = set(keys)
        self._seen = set()

    def add(self, key: str, blocks: Tensor, rows: int) -> None:
        if key in self._seen:
            raise NotImplementedError(
                f"factor {key!r} was produced twice in one step: a module called more than once "
                "per step (module reuse or gradient accumulation) is not supported yet; run "
                "extra forwards under torch.no_grad() or skip the module with skip_layers")
        self._seen.add(key)
        b = self._open
        b.keys.append(key)
        b.blocks.append(blocks)
        b.counts.append(float(rows))
        g, d = blocks.shape[0], blocks.shape[-1]
        b.nbytes += packed_numel(g, d, symmetric=self.symmetric) * blocks.element_size()
        if b.nbytes >= self.bucket_bytes or self._expected <= self._seen:
            self._launch()

    def _launch(self) -> None:
        b = self._open
        if not b.keys:
            return
        if self.distributed:
            parts = [pack(x, symmetric=self.symmetric) for x in b.blocks]
            flat = torch.cat(parts + [parts[0].new_tensor(b.counts)])
            b.work = self.comm.allreduce(flat, async_op=True,
                                         meta=f"kfac factors {','.join(b.keys)}")
        self._launched.append(b)
        self._open = _Bucket()

    def finish(self) -> dict[str, tuple[Tensor, float]]:
        self._launch()
        out: dict[str, tuple[Tensor, float]] = {}
        for b in self._launched:
            if b.work is None:
                out.update(zip(b.keys, zip(b.blocks, b.counts)))
                continue
            flat = b.work.wait()
            offset = 0
            counts = flat[-len(b.keys):].tolist()
            for key, x, count in zip(b.keys, b.blocks, counts):
                g, d = x.shape[0], x.shape[-1]
                n = packed_numel(g, d, symmetric=self.symmetric)
                out[key] = (unpack(flat[offset: offset + n], g, d, symmetric=self.symmetric),
                            count)
                offset += n
        self._launched = []
        self._seen = set()
        return out

    @property
    def buckets_in_flight(self) -> int:
        return len(self._launched)

    def __repr__(self) -> str:
        return (f"FactorReducer(size={getattr(self.comm, 'size', 1)}, "
                f"bucket_bytes={self.bucket_bytes}, symmetric={self.symmetric})")


class PayloadBroadcaster:
    """Move decomposition payloads from their owners to every rank: one packed broadcast per
    owning rank (all launched asynchronously, then waited)."""

    def __init__(self, comm=None) -> None:
        self.comm = comm

    def exchange(self, owners: Sequence[int], payloads: dict[int, Tensor],
                 numels: Sequence[int], dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> dict[int, Tensor]:
        """``payloads[i]`` holds task ``i``'s payload where this rank owns it (or everyone does,
        owner < 0); returns every task's payload."""
        result = dict(payloads)
        if self.comm is None or self.comm.size == 1:
            return result
        by_root: dict[int, list[int]] = {}
        for i, owner in enumerate(owners):
            if owner >= 0:
                by_root.setdefault(owner, []).append(i)
        works = []
        for root in sorted(by_root):
            tasks = by_root[root]
            if root == self.comm.rank:
                buf = torch.cat([payloads[i].reshape(-1) for i in tasks])
            else:
                buf = torch.empty(sum(numels[i] for i in tasks), dtype=dtype, device=device)
            works.append((tasks, self.comm.broadcast(buf, root=root, async_op=True,
                                                     meta=f"kfac payloads of rank {root}")))
        for tasks, work in works:
            flat = work.wait()
            offset = 0
            for i in tasks:
                result[i] = flat[offset: offset + numels[i]]
                offset += numels[i]
        return result

    def __repr__(self) -> str:
        return f"PayloadBroadcaster(size={getattr(self.comm, 'size', 1)})"


def allreduce_gradients(params: Iterable[torch.nn.Parameter], comm, *,
                        bucket_bytes: int = 1 << 22) -> None:
    """Average ``.grad`` over ``comm`` in fused buckets (data parallelism without a wrapper)."""
    if comm is None or comm.size == 1:
        return
    buckets: list[list[Tensor]] = []
    open_bucket: dict[torch.dtype, tuple[list[Tensor], int]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        bucket, size = open_bucket.get(g.dtype, (None, 0))
        if bucket is None or size + g.numel() * g.element_size() > bucket_bytes:
            bucket, size = [], 0
            buckets.append(bucket)
        bucket.append(g)
        open_bucket[g.dtype] = (bucket, size + g.numel() * g.element_size())
    works = [(b, comm.allreduce(torch.cat([g.reshape(-1) for g in b]), async_op=True,
                                meta="gradients"))
             for b in buckets if b]
    for b, work in works:
        flat = work.wait() / comm.size
        offset = 0
        for g in b:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()
