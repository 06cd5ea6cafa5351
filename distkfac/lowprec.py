"""Low-precision factor traffic (Ueno et al., KDD'20, §3.3): the wire formats of factor sums.

Factors stay in their own dtype (fp32 by default); only what travels is narrowed:

* ``torch.bfloat16``: the sums themselves (bf16 has fp32's range), reduced by the backend; the
  row counts go beside them in float64 so they stay exact.
* ``torch.float16`` and ``'float21'``: each rank's local *mean* (sum / rows, within fp16's range)
  travels with its rows (float64 bits), and the means are summed weighted by the rows in fp32,
  in rank order (unequal batches exactly weighted; a narrower format cannot be summed by the
  backend: float21 is not a dtype).  On 2 ranks the means are allgathered and every rank sums
  them: ``enc(n) + 8 k`` bytes received for n numbers of k factors.  On P >= 3 that would cost
  more than an fp32 allreduce, so it is a reduce-scatter and an allgather by hand, each in the
  wire format: one all-to-all hands rank j block j of every rank's means (balanced blocks of
  the n numbers; ``(P - 1) (enc(n_j) + 8 k)`` bytes received), rank j sums its block and
  encodes the global mean, and one allgather gives every rank all blocks
  (``sum_{i != j} enc(n_i)``): ``2 (P - 1) / P`` of the numbers, as a ring allreduce moves, at
  2 (fp16) or 8/3 (float21) bytes each.  The result is rounded to the wire format once more.
* ``'float21'``: three truncated float32 (sign, 8 exponent bits, the 12 high mantissa bits) packed
  in one 64-bit word: 8/3 bytes per number.  Exact for every float32 whose 11 low mantissa bits
  are zero; otherwise truncated toward zero (relative error below ``2**-12``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from distconv.distribution import balanced_block

__all__ = ["COMM_DTYPES", "check_comm_dtype", "float21_pack", "float21_unpack", "encoded_bytes",
           "launch", "collect", "reduce_scatter"]

COMM_DTYPES = (None, torch.float64, torch.float32, torch.bfloat16, torch.float16, "float21")
_GATHERED = (torch.float16, "float21")
_MASK21 = (1 << 21) - 1


def check_comm_dtype(value: object) -> torch.dtype | str | None:
    if value not in COMM_DTYPES or isinstance(value, bool):
        raise ValueError(f"factor_comm_dtype must be one of None, torch.float64, torch.float32, "
                         f"torch.bfloat16, torch.float16 or 'float21', got {value!r}")
    return value  # type: ignore[return-value]


def float21_pack(x: Tensor) -> Tensor:
    """Float32 numbers -> int64 words, three 21-bit truncated floats each (low bits first)."""
    bits = x.detach().to(torch.float32).reshape(-1).contiguous().view(torch.int32)
    top = (bits.to(torch.int64) & 0xFFFFFFFF) >> 11
    top = torch.cat([top, top.new_zeros(-top.numel() % 3)]).reshape(-1, 3)
    return top[:, 0] | (top[:, 1] << 21) | (top[:, 2] << 42)


def float21_unpack(words: Tensor, n: int) -> Tensor:
    """Inverse of :func:`float21_pack`: the first ``n`` numbers as float32."""
    parts = torch.stack([(words >> s) & _MASK21 for s in (0, 21, 42)], 1).reshape(-1)[:n] << 11
    parts = torch.where(parts >= 1 << 31, parts - (1 << 32), parts)
    return parts.to(torch.int32).view(torch.float32)


def encoded_bytes(n: int, comm_dtype: torch.dtype | str) -> int:
    """Bytes of ``n`` numbers in a gathered wire format."""
    if comm_dtype == "float21":
        return 8 * -(-n // 3)
    return n * torch.empty((), dtype=comm_dtype).element_size()  # type: ignore[arg-type]


def _encode(values: Tensor, comm_dtype: torch.dtype | str) -> Tensor:
    if comm_dtype == "float21":
        return float21_pack(values).view(torch.uint8)
    return values.to(comm_dtype).view(torch.uint8)  # type: ignore[arg-type]


def _decode(raw: Tensor, n: int, comm_dtype: torch.dtype | str) -> Tensor:
    if comm_dtype == "float21":
        return float21_unpack(raw.view(torch.int64), n)
    return raw.view(comm_dtype).to(torch.float32)  # type: ignore[arg-type]


def launch(comm, flats: Sequence[Tensor], counts: Sequence[float],
           comm_dtype: torch.dtype | str | None, *, meta: str) -> list:
    """Start the reduction of ``flats`` (one per factor) and their row ``counts``."""
    values = torch.cat(list(flats))
    rows = values.new_tensor(list(counts), dtype=torch.float64)
    if comm_dtype in _GATHERED:
        # a replica that counts no rows contributes zeros (not 0 / 0)
        means = (torch.cat([f / c if c else f for f, c in zip(flats, counts)]) if flats
                 else values).to(torch.float32)
        tail = rows.view(torch.uint8)
        if comm.size < 3:
            buf = torch.cat([_encode(means, comm_dtype), tail])  # type: ignore[arg-type]
            return [comm.allgather(buf, async_op=True, meta=meta)]
        blocks = [balanced_block(means.numel(), comm.size, j) for j in range(comm.size)]
        work = _launch_scatter(comm, means, rows, blocks, comm_dtype, meta)  # type: ignore
        return [_TwoPhase(comm, work, blocks, meta)]
    if comm_dtype == torch.bfloat16:
        return [comm.allreduce(values.to(torch.bfloat16), async_op=True, meta=meta),
                comm.allreduce(rows, async_op=True, meta=meta + " rows")]
    wire = values.dtype if comm_dtype is None else comm_dtype
    return [comm.allreduce(torch.cat([values, rows.to(values.dtype)]).to(wire),
                           async_op=True, meta=meta)]


def collect(works: list, numels: Sequence[int], comm_dtype: torch.dtype | str | None,
            dtype: torch.dtype) -> tuple[list[Tensor], list[float]]:
    """Wait for :func:`launch`'s works: the summed flat factors (in ``dtype``) and rows."""
    n, k = sum(numels), len(numels)
    if isinstance(works[0], _TwoPhase):
        values, counts = works[0].finish(numels, comm_dtype)  # type: ignore[arg-type]
        values = values.to(dtype)
    elif comm_dtype in _GATHERED:
        parts = works[0].wait()  # every rank's means: the same sum everywhere
        total, rows = _weighted_sum(parts, n, _owners(numels, parts[0].device), k,
                                    comm_dtype)  # type: ignore[arg-type]
        values, counts = total.to(dtype), rows.tolist()
    elif comm_dtype == torch.bfloat16:
        values = works[0].wait().to(dtype)
        counts = works[1].wait().tolist()
    else:
        flat = works[0].wait().to(dtype)
        values, counts = flat[:n], flat[n:].tolist()
    return list(values.split(list(numels))), counts


def _launch_scatter(comm, means: Tensor, rows: Tensor, blocks: list[tuple[int, int]],
                    comm_dtype: torch.dtype | str, meta: str):
    """All-to-all: block j of this rank's means, encoded, with its rows (float64 bits) to
    rank j."""
    tail = rows.view(torch.uint8)
    chunks = [torch.cat([_encode(means[lo: lo + m], comm_dtype), tail]) for lo, m in blocks]
    mine = blocks[comm.rank][1]
    shape = (encoded_bytes(mine, comm_dtype) + tail.numel(),)
    return comm.alltoall(chunks, recv_shapes=[shape] * comm.size, async_op=True, meta=meta)


def _owners(numels: Sequence[int], device: torch.device) -> Tensor:
    """The factor of every number of the concatenated factors."""
    return torch.repeat_interleave(torch.arange(len(numels), device=device),
                                   torch.tensor(list(numels), device=device))


def _weighted_sum(received: list[Tensor], m: int, owner: Tensor, k: int,
                  comm_dtype: torch.dtype | str) -> tuple[Tensor, Tensor]:
    """``sum_r mean_r * rows_r`` over the received blocks, in rank order (the same on every
    rank), fp32; ``owner[i]`` the factor of number i.  Also the summed rows (float64)."""
    size = encoded_bytes(m, comm_dtype)
    device = received[0].device
    total = torch.zeros(m, dtype=torch.float32, device=device)
    rows = torch.zeros(k, dtype=torch.float64)
    for raw in received:
        r = raw[size: size + 8 * k].clone().view(torch.float64).cpu()
        total += _decode(raw[:size].clone(), m, comm_dtype) * r.to(device, torch.float32)[owner]
        rows += r
    return total, rows


class _TwoPhase:
    """The reduce-scatter (an all-to-all in flight) and allgather of low-precision means on
    P >= 3 ranks (see the module docstring)."""

    def __init__(self, comm, work, blocks: list[tuple[int, int]], meta: str) -> None:
        self.comm, self.work, self.blocks, self.meta = comm, work, blocks, meta

    def wait(self) -> None:
        self.work.wait()

    def finish(self, numels: Sequence[int], comm_dtype: torch.dtype | str,
               ) -> tuple[Tensor, list[float]]:
        k = len(numels)
        lo, m = self.blocks[self.comm.rank]
        received = self.work.wait()
        device = received[0].device
        owner = _owners(numels, device)
        mine = owner[lo: lo + m]
        total, rows = _weighted_sum(received, m, mine, k, comm_dtype)
        weight = rows.to(device, torch.float32)
        mean = torch.where(weight[mine] > 0, total / weight[mine].clamp_min(1), total)
        parts = self.comm.allgather(
            _encode(mean, comm_dtype), shapes=[(encoded_bytes(b, comm_dtype),)
                                              for _, b in self.blocks],
            meta=self.meta + " means")
        means = torch.cat([_decode(raw.clone(), b, comm_dtype)
                           for raw, (_, b) in zip(parts, self.blocks)])
        return means * weight[owner], rows.tolist()


def reduce_scatter(comm, values: Tensor, rows: float, blocks: list[tuple[int, int]],
                   comm_dtype: torch.dtype | str | None, *, meta: str) -> Callable[[], Tensor]:
    """Start summing ``values`` (one factor's contribution, flat, of ``rows`` rows) over
    ``comm``, each rank receiving its block ``blocks[rank] = (start, length)``; returns the
    wait that gives that block of the sum in ``values``' dtype.  On the wire: ``values`` in
    ``comm_dtype`` (None: their own dtype) for a backend reduce-scatter, ``(P - 1) m`` numbers
    received for a block of m; with ``torch.float16`` or ``'float21'`` the local means with
    their rows, weighted and summed in fp32 by the receiver (``(P - 1) (enc(m) + 8)``
    bytes)."""
    dtype = values.dtype
    if comm_dtype in _GATHERED:
        means = (values / rows if rows else values).to(torch.float32)
        work = _launch_scatter(comm, means, values.new_tensor([float(rows)], dtype=torch.float64),
                               blocks, comm_dtype, meta)  # type: ignore[arg-type]
        m = blocks[comm.rank][1]

        def wait_means() -> Tensor:
            received = work.wait()
            owner = torch.zeros(m, dtype=torch.int64, device=received[0].device)
            return _weighted_sum(received, m, owner, 1, comm_dtype)[0].to(dtype)  # type: ignore

        return wait_means
    wire = dtype if comm_dtype is None else comm_dtype
    work = comm.reduce_scatter([values[lo: lo + m].to(wire) for lo, m in blocks],
                               async_op=True, meta=meta)
    return lambda: work.wait().to(dtype)
