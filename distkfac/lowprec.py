"""Low-precision factor traffic (Ueno et al., KDD'20, §3.3): the wire formats of factor sums.

Factors stay in their own dtype (fp32 by default); only what travels is narrowed:

* ``torch.bfloat16``: the sums themselves (bf16 has fp32's range), reduced by the backend; the
  row counts go beside them in float64 so they stay exact.
* ``torch.float16`` and ``'float21'``: each rank's local *mean* (sum / rows, within fp16's range)
  and its rows (float64 bits), gathered; every rank sums ``mean_r * rows_r`` in rank order in
  fp32.  A narrower format cannot be summed by the backend (float21 is not a dtype), and
  gathering keeps unequal batches exactly weighted.
* ``'float21'``: three truncated float32 (sign, 8 exponent bits, the 12 high mantissa bits) packed
  in one 64-bit word: 8/3 bytes per number.  Exact for every float32 whose 11 low mantissa bits
  are zero; otherwise truncated toward zero (relative error below ``2**-12``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["COMM_DTYPES", "check_comm_dtype", "float21_pack", "float21_unpack", "encoded_bytes",
           "launch", "collect"]

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
        means = torch.cat([f / c for f, c in zip(flats, counts)]) if flats else values
        buf = torch.cat([_encode(means, comm_dtype), rows.view(torch.uint8)])  # type: ignore
        return [comm.allgather(buf, async_op=True, meta=meta)]
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
    if comm_dtype in _GATHERED:
        parts = works[0].wait()
        size = encoded_bytes(n, comm_dtype)  # type: ignore[arg-type]
        total = torch.zeros(n, dtype=torch.float32, device=parts[0].device)
        rows = torch.zeros(k, dtype=torch.float64)
        for raw in parts:  # rank order on every rank: the same sum everywhere
            r = raw[size: size + 8 * k].clone().view(torch.float64).cpu()
            means = _decode(raw[:size].clone(), n, comm_dtype).split(list(numels))
            total += torch.cat([m * float(c) for m, c in zip(means, r.tolist())])
            rows += r
        values, counts = total.to(dtype), rows.tolist()
    elif comm_dtype == torch.bfloat16:
        values = works[0].wait().to(dtype)
        counts = works[1].wait().tolist()
    else:
        flat = works[0].wait().to(dtype)
        values, counts = flat[:n], flat[n:].tolist()
    return list(values.split(list(numels))), counts
