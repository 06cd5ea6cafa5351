"""What the shared-memory ring carries and how a rank reads it, apart from the ring itself
(:class:`~distconv.comm.host_channel.HostChannel`): the buffer that passes the shared file's
name at opening, an all-to-all's payload layout, the signature in a slot's header that names one
collective, and the reduction of the ranks' rows in rank order."""

from __future__ import annotations

import functools
import zlib
from typing import Any

import torch

from distconv.comm.base import _REDUCERS

__all__ = ["NAME_BYTES", "alltoall_bytes", "name_buffer", "name_of"]


#: bytes of the buffer that carries the shared file's path from rank 0 at opening
NAME_BYTES = 512


def name_buffer(name: str, rank: int) -> torch.Tensor:
    """The byte buffer a backend broadcasts from rank 0 to open a channel: rank 0's ``name``
    (empty where it is too long to be worth a channel), zeros on the others."""
    buf = torch.zeros(NAME_BYTES, dtype=torch.uint8)
    data = name.encode() if rank == 0 else b""
    if data and len(data) <= NAME_BYTES:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def name_of(buf: torch.Tensor) -> str:
    """The name a broadcast :func:`name_buffer` carries."""
    return bytes(buf.numpy()).rstrip(b"\0").decode()


def alltoall_bytes(size: int, sent: int) -> int:
    """A rank's payload for an all-to-all over ``size`` ranks in which it sends ``sent`` bytes
    in all: its byte offsets per destination (one int64 each), then its chunks."""
    return 8 * size + sent


@functools.lru_cache(maxsize=4096)
def _signature(*what: Any) -> int:
    """A number naming one kind of collective (op, dtype, shapes): equal on every rank that
    calls the same thing (a CRC of its text: Python's own hash differs between processes)."""
    return zlib.crc32("|".join(map(str, what)).encode())


def _reduce_rows(rows: torch.Tensor, op: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rank 0's row reduced with rank 1's, then rank 2's, ... (into ``out``, or a new tensor):
    the order every rank of a communicator uses, so all get the same bits; bf16 and fp16 in
    fp32, rounded once (as :func:`~distconv.comm.base.reduce_in_order`)."""
    dtype = rows.dtype
    wide = dtype in (torch.bfloat16, torch.float16)
    if wide:
        rows = rows.float()
    fn = _REDUCERS[op]
    into = out if out is not None and not wide else None
    if rows.shape[0] == 1:
        acc = rows[0].clone() if into is None else into.copy_(rows[0])
    else:
        acc = fn(rows[0], rows[1]) if into is None else fn(rows[0], rows[1], out=into)
    for r in range(2, rows.shape[0]):
        acc = fn(acc, rows[r], out=acc)
    if op == "avg":
        acc = acc.div_(rows.shape[0])
    if out is None:
        return acc.to(dtype)
    return acc if acc is out else out.copy_(acc)
