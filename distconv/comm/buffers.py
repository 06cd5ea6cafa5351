"""What the communicators share about buffers and bytes: the bytes a ring allreduce delivers,
reductions in rank order, packing tensors into one buffer and splitting it back, and the byte
buffers of an all-to-all."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Shape = tuple[int, ...]

__all__ = ["AlltoallBuffers", "allreduce_bytes", "concat_parts", "flat_concat", "flat_span",
           "packed", "reduce_in_order", "split_chunks"]


def allreduce_bytes(n: int, rank: int, size: int, itemsize: int) -> int:
    """Logical bytes rank ``rank`` receives in a ring allreduce of ``n`` elements.

    A ring reduce-scatter delivers ``(size - 1) * b_r`` elements and the ring allgather the other
    ``n - b_r``, where ``b_r = n // size + (rank < n % size)`` is the rank's balanced block.
    """
    b = n // size + (rank < n % size)
    return ((size - 1) * b + (n - b)) * itemsize


_REDUCERS = {
    "sum": torch.add,
    "avg": torch.add,
    "prod": torch.mul,
    "max": torch.maximum,
    "min": torch.minimum,
}


def reduce_in_order(parts: Sequence[torch.Tensor], op: str, size: int) -> torch.Tensor:
    """Reduce rank-ordered parts locally (a new tensor); bf16/fp16 in fp32, rounded once."""
    dtype = parts[0].dtype
    if dtype in (torch.bfloat16, torch.float16):
        parts = [p.float() for p in parts]
    out = parts[0].clone()
    for p in parts[1:]:
        out = _REDUCERS[op](out, p)
    if op == "avg":
        out = out / size
    return out.to(dtype)


def flat_span(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A 1-D view of the storage region holding ``tensors`` back to back, or None.

    Not None when every non-empty tensor is contiguous, they share one storage and dtype, and
    each starts where the previous one ends: then the region is their concatenation, flattened,
    with no copy (only empty tensors give an empty one).
    """
    full = [t for t in tensors if t.numel() > 0]
    if not full:
        return tensors[0].new_empty(0) if tensors else None
    first = full[0]
    start = end = first.storage_offset()
    storage = first.untyped_storage().data_ptr()
    for t in full:
        if (
            t.dtype != first.dtype
            or not t.is_contiguous()
            or t.storage_offset() != end
            or t.untyped_storage().data_ptr() != storage
        ):
            return None
        end += t.numel()
    return first.as_strided((end - start,), (1,), start)


class AlltoallBuffers:
    """The byte buffers of an all-to-all(v): the send bytes (packed without a copy where the
    chunks already lie back to back), per-peer byte counts both ways, and the receive buffer."""

    def __init__(self, chunks: Sequence[torch.Tensor], recv_shapes: Sequence[Shape]) -> None:
        self.dtype = chunks[0].dtype
        isz = chunks[0].element_size()
        self.send = flat_concat(chunks).view(torch.uint8)
        self.send_counts = [c.numel() * isz for c in chunks]
        self.recv_counts = [math.prod(s) * isz for s in recv_shapes]
        self.recv = torch.empty(sum(self.recv_counts), dtype=torch.uint8, device=self.send.device)
        self._shapes = list(recv_shapes)

    def received(self) -> list[torch.Tensor]:
        """The received tensors, views of the receive buffer."""
        parts = self.recv.split(self.recv_counts)
        return [p.view(self.dtype).view(s) for p, s in zip(parts, self._shapes)]


def flat_concat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The flattened concatenation of ``tensors``: :func:`flat_span` when they lie back to back
    (no copy), else one new buffer (one copy)."""
    span = flat_span(tensors)
    return span if span is not None else torch.cat([t.reshape(-1) for t in tensors])


def packed(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` laid out back to back in one storage, so :func:`flat_concat` needs no copy.

    The tensors themselves when they already are (no copy); else views of consecutive slices of
    one new buffer, each a copy of its tensor (one copy in all).
    """
    if flat_span(tensors) is not None:
        return list(tensors)
    t0 = tensors[0]
    buf = torch.empty(sum(t.numel() for t in tensors), dtype=t0.dtype, device=t0.device)
    out = [b.view(t.shape) for b, t in zip(buf.split([t.numel() for t in tensors]), tensors)]
    for o, t in zip(out, tensors):
        o.copy_(t)
    return out


def split_chunks(x: torch.Tensor, sizes: Sequence[int], dim: int) -> list[torch.Tensor]:
    """``x`` split along ``dim`` into chunks of ``sizes``, the consecutive slices of one buffer
    (one copy, none when they already are), so a communicator sends them without packing them
    again."""
    pre = math.prod(x.shape[:dim])
    if (pre > 1 and len(sizes) > 1 and x.numel() and x.is_contiguous()
            and all(s == sizes[0] for s in sizes)):
        # equal chunks of a contiguous block: one transposing copy of its (pre, chunk, rest)
        # view, where a copy per strided chunk costs four times as much
        buf = x.view(pre, len(sizes), -1).transpose(0, 1).contiguous()
        shape = list(x.shape)
        shape[dim] = sizes[0]
        return [b.view(shape) for b in buf.unbind(0)]
    return packed(torch.split(x, list(sizes), dim=dim))


def concat_parts(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(parts, dim)``; no copy when the parts lie back to back in one receive buffer
    and every dim before ``dim`` has size 1 (then the concatenation is that buffer's layout)."""
    if math.prod(parts[0].shape[:dim]) == 1:
        span = flat_span(parts)
        if span is not None:
            shape = list(parts[0].shape)
            shape[dim] = sum(p.shape[dim] for p in parts)
            # detached: autograd forbids in-place updates of a custom Function's output that is
            # a view, and nothing else holds the receive buffer
            return span.view(shape).detach()
    return torch.cat(list(parts), dim=dim)
