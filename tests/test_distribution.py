"""Dist: the paper's notation, block math and validation."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from distconv.distribution import Dist, balanced_block, nested_block
from distconv.grid import ProcessorGrid


def layout_grid(dims: dict[str, int], rank: int = 0) -> ProcessorGrid:
    """A grid over a stand-in communicator: enough for block math, which never communicates."""
    size = 1
    for e in dims.values():
        size *= e
    return ProcessorGrid(dims, comm=SimpleNamespace(rank=rank, size=size, backend="none"))


@pytest.mark.parametrize(
    "spec, dims, entries, pending",
    [
        ("x[o,*,o,o]", "NCHW", ("N", None, "H", "W"), set()),
        ("y[o,o_C,o,o]", "NFHW", ("N", "C", "H", "W"), set()),
        ("x[o,o_{F×C},o,o]", "NCHW", ("N", ("F", "C"), "H", "W"), set()),
        ("x[o,o_{F,C},o,o]", "NCHW", ("N", ("F", "C"), "H", "W"), set()),
        ("x[o,o_(F,C),o,o]", "NCHW", ("N", ("F", "C"), "H", "W"), set()),
        ("Σ_C y[o,*,o,o]", "NFHW", ("N", None, "H", "W"), {"C"}),
        ("sum_{C,H} [o_N,*]", None, ("N", None), {"C", "H"}),
        ("w[o_F,o_C,*,*]", ("F", "C", "kh", "kw"), ("F", "C", None, None), set()),
    ],
)
def test_parse_reads_the_papers_notation(spec, dims, entries, pending):
    d = Dist.parse(spec, dims)
    assert d.entries == entries
    assert d.pending == frozenset(pending)


@pytest.mark.parametrize(
    "spec, dims",
    [("x[o,*,o,o]", "NCHW"), ("y[o,o_C,o,o]", "NFHW"), ("x[o,o_{F×C},o,o]", "NCHW"),
     ("Σ_C y[o,*,o,o]", "NFHW"), ("w[o_F,*]", "FC"), ("[*,*]", None)],
)
def test_format_writes_what_parse_reads(spec, dims):
    assert Dist.parse(spec, dims).format(spec.split("[")[0].split()[-1] if "[" in spec and
                                          not spec.startswith("[") else "") == spec


@st.composite
def dists(draw):
    ndim = draw(st.integers(1, 4))
    pool = draw(st.permutations(["N", "C", "F", "H", "W", "P", "Q"]))
    it = iter(pool)
    entries = []
    for _ in range(ndim):
        k = draw(st.integers(0, 2))
        group = tuple(n for n in (next(it, None) for _ in range(k)) if n is not None)
        k = len(group)
        entries.append(None if not group else group[0] if k == 1 else group)
    pending = frozenset(n for n in (next(it, None) for _ in range(draw(st.integers(0, 2))))
                        if n is not None)
    tensor_dims = draw(st.one_of(st.none(), st.just(tuple("NCHW"[:ndim]))))
    return Dist(tuple(entries), pending, tensor_dims)


@given(dists())
def test_parse_of_format_is_identity(d):
    again = Dist.parse(d.format("t"), d.tensor_dims)
    assert again == d
    assert again.format("t") == d.format("t")


def test_grid_dim_used_twice_is_rejected():
    with pytest.raises(ValueError, match="'C' is used twice"):
        Dist(("C", "C"))
    with pytest.raises(ValueError, match="'C' is used twice"):
        Dist.parse("Σ_C x[o_C,*]")
    with pytest.raises(ValueError, match="'F' is used twice"):
        Dist((("F", "C"), "F"))


def test_unknown_grid_dim_is_rejected():
    grid = layout_grid({"N": 2, "C": 2})
    with pytest.raises(ValueError, match="grid dim 'Q' is not in grid"):
        Dist(("Q", None)).validate(grid)
    # canonical dims the grid leaves out have extent 1 and are fine
    Dist(("N", "H")).validate(grid)


def test_wrong_number_of_entries_is_rejected():
    with pytest.raises(ValueError, match="has 3 entries but tensor_dims 'NCHW' has 4"):
        Dist.parse("x[o,*,o]", "NCHW")
    grid = layout_grid({"N": 2})
    with pytest.raises(ValueError, match="2 entries for global shape"):
        Dist(("N", None)).local_shape((4, 4, 4), grid)


def test_malformed_specs_name_the_problem():
    with pytest.raises(ValueError, match="plain 'o'.*tensor_dims"):
        Dist.parse("x[o,*]")
    with pytest.raises(ValueError, match="expected '\\*', 'o', 'o_C'"):
        Dist.parse("x[q,*]", "NC")
    with pytest.raises(ValueError, match="cannot read"):
        Dist.parse("x(o,*)", "NC")


@given(st.integers(0, 40), st.integers(1, 9))
def test_balanced_blocks_tile_and_differ_by_at_most_one(n, p):
    blocks = [balanced_block(n, p, i) for i in range(p)]
    assert sum(size for _, size in blocks) == n
    assert max(s for _, s in blocks) - min(s for _, s in blocks) <= 1
    for (s0, n0), (s1, _) in zip(blocks, blocks[1:]):
        assert s0 + n0 == s1


@given(st.integers(0, 40), st.lists(st.integers(1, 4), min_size=1, max_size=3))
def test_nested_blocks_tile_in_row_major_order(n, extents):
    import itertools

    pos = 0
    for coords in itertools.product(*[range(e) for e in extents]):
        start, size = nested_block(n, extents, coords)
        assert start == pos
        pos += size
    assert pos == n


def test_local_shapes_and_offsets():
    grid = layout_grid({"N": 2, "C": 3}, rank=5)  # N=1, C=2
    d = Dist.parse("x[o,o_C,o,o]", "NCHW")
    assert d.local_shape((5, 7, 4, 4), grid) == (2, 2, 4, 4)
    assert d.local_slices((5, 7, 4, 4), grid) == (slice(3, 5), slice(5, 7), slice(0, 4),
                                                  slice(0, 4))
    # o_{N×C}: N blocks of 10 -> [5, 5]; C sub-blocks of the N=1 block -> [2, 2, 1]
    w = Dist.parse("[o_{N×C}]")
    assert w.block(0, 10, grid) == (9, 1)


def test_more_parts_than_items_gives_empty_blocks():
    grid = layout_grid({"C": 4}, rank=3)
    assert Dist(("C",)).local_shape((2,), grid) == (0,)


def test_dual_swaps_pending_and_redundant():
    grid = layout_grid({"N": 2, "C": 2, "H": 2})
    d = Dist.parse("Σ_C y[o,*,*,*]", "NFHW")
    assert d.dual(grid) == Dist(("N", None, None, None), frozenset({"H"}))
    assert d.dual(grid).dual(grid) == d
