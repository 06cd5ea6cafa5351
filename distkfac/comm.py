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
from distkfac.lowprec import check_comm_dtype, collect, launch

__all__ = ["FactorReducer", "PayloadBroadcaster", "allreduce_gradients"]


class _Entry:
    """One factor's local contribution in a step: summed blocks, rows and number of adds."""

    __slots__ = ("blocks", "rows", "adds", "symmetric")

    def __init__(self, blocks: Tensor, rows: float, symmetric: bool) -> None:
        self.blocks, self.rows, self.adds, self.symmetric = blocks, rows, 1, symmetric

    def add(self, blocks: Tensor, rows: float) -> None:
        self.blocks = self.blocks + blocks
        self.rows += rows
        self.adds += 1


class _Bucket:
    def __init__(self) -> None:
        self.keys: list[str] = []
        self.entries: list[_Entry] = []
        self.nbytes = 0
        self.works: list = []


class FactorReducer:
    """Sum factor contributions ``(groups, d, d')`` and their row counts over ``comm``.

    ``add(key, blocks, rows)`` may be called from autograd hooks, several times per key (a module
    called more than once per step, or gradient accumulation): contributions and rows add up.
    A key enters the open bucket once it has been added as many times as in the previous step
    (its multiplicity, learned; 1 at first); a contribution arriving after its key's bucket was
    launched is reduced by one extra allreduce in :meth:`finish`.  ``finish()`` waits for all
    buckets and returns ``{key: (summed blocks, total rows)}``; :meth:`discard` drops a step.

    On the wire (``comm_dtype``, see :mod:`distkfac.lowprec`):

    * ``None`` (the blocks' dtype), ``float32`` or ``float64``: one allreduce per bucket of every
      factor's upper triangles (square blocks with ``symmetric=True``) or full blocks, then the
      row counts: ``allreduce_bytes(n + k)`` for n numbers and k factors.
    * ``bfloat16``: the same numbers as one bf16 allreduce, plus the k row counts as one float64
      allreduce (counts must stay exact).
    * ``float16`` and ``'float21'``: each rank's local *mean* (sum / rows: no fp16 overflow)
      encoded, with its rows as float64 bits, in one allgather of bytes; every rank then sums
      ``mean_r * rows_r`` in rank order in fp32 -- exact weighting for unequal batches.  Bytes
      received: ``(P - 1) * (encoded_bytes(n) + 8 k)``.
    """

    def __init__(self, comm=None, *, bucket_bytes: int = 1 << 20, symmetric: bool = True,
                 comm_dtype: torch.dtype | str | None = None) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be an int >= 0, got {bucket_bytes!r}")
        self.comm = comm
        self.bucket_bytes = bucket_bytes
        self.symmetric = symmetric
        self.comm_dtype = check_comm_dtype(comm_dtype)
        self._expected: set[str] = set()
        self._multiplicity: dict[str, int] = {}
        self._partial: dict[str, _Entry] = {}
        self._complete: set[str] = set()
        self._late: dict[str, _Entry] = {}
        self._open = _Bucket()
        self._launched: list[_Bucket] = []

    @property
    def distributed(self) -> bool:
        return self.comm is not None and self.comm.size > 1

    def expect(self, keys: Iterable[str]) -> None:
        """Start a step: the keys whose completion closes the last bucket."""
        self._expected = set(keys)

    def add(self, key: str, blocks: Tensor, rows: float, *, symmetric: bool = True) -> None:
        if key in self._complete:
            late = self._late.get(key)
            if late is None:
                self._late[key] = _Entry(blocks, float(rows), symmetric and self.symmetric)
            else:
                late.add(blocks, float(rows))
            return
        entry = self._partial.get(key)
        if entry is None:
            entry = self._partial[key] = _Entry(blocks, float(rows),
                                                symmetric and self.symmetric)
        else:
            entry.add(blocks, float(rows))
        if entry.adds >= self._multiplicity.get(key, 1):
            self._enqueue(key)

    def _enqueue(self, key: str) -> None:
        entry = self._partial.pop(key)
        self._complete.add(key)
        b = self._open
        b.keys.append(key)
        b.entries.append(entry)
        b.nbytes += _numel(entry) * entry.blocks.element_size()
        if b.nbytes >= self.bucket_bytes or self._expected <= self._complete:
            self._launch()

    def _launch(self) -> None:
        b = self._open
        if not b.keys:
            return
        if self.distributed:
            b.works = launch(self.comm, [_flat(e) for e in b.entries],
                             [e.rows for e in b.entries], self.comm_dtype,
                             meta=f"kfac factors {','.join(b.keys)}")
        self._launched.append(b)
        self._open = _Bucket()

    def finish(self) -> dict[str, tuple[Tensor, float]]:
        for key in sorted(self._partial):  # fewer adds than last step: reduce what came
            self._enqueue(key)
        self._launch()
        out: dict[str, tuple[Tensor, float]] = {}
        late = sorted(self._late)
        late_works = (launch(self.comm, [_flat(self._late[k]) for k in late],
                             [self._late[k].rows for k in late], self.comm_dtype,
                             meta=f"kfac late factors {','.join(late)}")
                      if late and self.distributed else None)
        for b in self._launched:
            self._collect(b.keys, b.entries, b.works, out)
        adds = {k: 0 for k in out}
        for b in self._launched:
            for k, e in zip(b.keys, b.entries):
                adds[k] = e.adds
        if late:
            extra: dict[str, tuple[Tensor, float]] = {}
            self._collect(late, [self._late[k] for k in late], late_works, extra)
            for k, (blocks, rows) in extra.items():
                out[k] = (out[k][0] + blocks, out[k][1] + rows)
                adds[k] += self._late[k].adds
        self._multiplicity.update(adds)
        self._reset()
        return out

    def _collect(self, keys, entries, works, out) -> None:
        if not works:
            out.update((k, (e.blocks, e.rows)) for k, e in zip(keys, entries))
            return
        flats, counts = collect(works, [_numel(e) for e in entries], self.comm_dtype,
                                entries[0].blocks.dtype)
        for key, e, flat, count in zip(keys, entries, flats, counts):
            out[key] = (_unflat(flat, e), count)

    def discard(self) -> None:
        """Drop this step's contributions (a step whose ``kfac.step()`` never came); buckets in
        flight are waited for, so every rank leaves the same collectives behind."""
        for b in self._launched:
            for w in b.works:
                w.wait()
        self._reset()

    def _reset(self) -> None:
        self._partial, self._late, self._complete = {}, {}, set()
        self._open, self._launched = _Bucket(), []

    @property
    def buckets_in_flight(self) -> int:
        return len(self._launched)

    def __repr__(self) -> str:
        return (f"FactorReducer(size={getattr(self.comm, 'size', 1)}, "
                f"bucket_bytes={self.bucket_bytes}, symmetric={self.symmetric}, "
                f"comm_dtype={self.comm_dtype!r})")


def _numel(e: _Entry) -> int:
    g, r, c = e.blocks.shape
    return packed_numel(g, r, symmetric=True) if e.symmetric and r == c else g * r * c


def _flat(e: _Entry) -> Tensor:
    r, c = e.blocks.shape[-2:]
    return pack(e.blocks, symmetric=e.symmetric and r == c)


def _unflat(flat: Tensor, e: _Entry) -> Tensor:
    g, r, c = e.blocks.shape
    if e.symmetric and r == c:
        return unpack(flat, g, r, symmetric=True)
    return flat.reshape(g, r, c)


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
    """Average ``.grad`` over ``comm`` in fused buckets (data parallelism of a plain model).

    Models from ``distconv.parallelize`` and ``DistConv2d`` layers complete their gradients
    themselves during ``backward()``; this is only for a plain model whose loss is a mean over
    each rank's own samples.

    Raises:
        TypeError: ``params`` is a tensor or not an iterable of tensors; ``comm`` is not a
            distconv Communicator (or None); ``bucket_bytes`` is not an int.
    """
    from distconv.comm import Communicator

    if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
        raise TypeError(f"allreduce_gradients: params must be an iterable of parameters (e.g. "
                        f"model.parameters()), got {type(params).__name__}")
    if comm is not None and not isinstance(comm, Communicator):
        raise TypeError(f"allreduce_gradients: comm must be a distconv Communicator or None, "
                        f"got {comm!r}")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise TypeError(f"allreduce_gradients: bucket_bytes must be an int >= 1, "
                        f"got {bucket_bytes!r}")
    params = list(params)
    bad = [p for p in params if not isinstance(p, torch.Tensor)]
    if bad:
        raise TypeError(f"allreduce_gradients: params must hold tensors, got {bad[0]!r}")
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
