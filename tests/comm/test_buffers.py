"""The send-buffer helpers: chunks already back to back are used in place, others packed once."""

from __future__ import annotations

import torch

from distconv.comm.base import flat_concat, flat_span, packed


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_flat_span_of_back_to_back_chunks_is_a_view():
    x = torch.arange(30.0).view(5, 6)
    chunks = x.split([1, 0, 3, 1], 0)
    span = flat_span(chunks)
    assert span is not None and _shares_storage(span, x)
    assert torch.equal(span, x.reshape(-1))
    tail = flat_span(x.split([2, 3], 0)[1:])
    assert tail is not None and torch.equal(tail, x[2:].reshape(-1))


def test_flat_span_is_none_unless_contiguous_in_order_in_one_storage():
    x = torch.arange(30.0).view(5, 6)
    a, b, c = x.split([1, 2, 2], 0)
    assert flat_span(x.split([2, 4], 1)) is None  # strided chunks
    assert flat_span([b, a]) is None  # out of order
    assert flat_span([a, c]) is None  # a gap
    assert flat_span([a, b.clone()]) is None  # another storage
    assert flat_span([a, b.view(torch.int32)]) is None  # another dtype


def test_flat_span_of_empty_chunks_is_empty():
    x = torch.arange(6.0)
    assert flat_span([x[:0], x[3:3]]).numel() == 0


def test_flat_concat_equals_cat_of_flattened_chunks():
    x = torch.arange(30.0).view(5, 6)
    for dim in (0, 1):
        chunks = x.split([2, 1, 3] if dim else [1, 4], dim)
        want = torch.cat([c.reshape(-1) for c in chunks])
        assert torch.equal(flat_concat(chunks), want)


def test_packed_chunks_lie_back_to_back_in_one_new_buffer():
    x = torch.arange(30.0).view(5, 6)
    chunks = x.split([2, 1, 3], 1)
    out = packed(chunks)
    assert all(torch.equal(o, c) for o, c in zip(out, chunks))
    span = flat_span(out)
    assert span is not None and not _shares_storage(span, x)
    rows = x.split([2, 3], 0)
    assert all(o is r for o, r in zip(packed(rows), rows))
