"""``expand`` / ``expand_as`` / ``repeat`` / ``tile``, class tokens, positional embeddings and
partial slices, on thread ranks against one process (fp64, outputs and every gradient); the
placements they take written down from the rule (a grown dim split like the dim its size is read
from, whole otherwise; a partially sliced split dim gathered first); what cannot be exact refused
by name before a step runs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from distconv import ops
from distconv.parallel.explain import explain
from distconv.testing import run_threads
from tests.parallel.cases import (
    OPTIONS, check_rows, seeded, square_mean_reference, square_mean_step,
)
from tests.test_ops_attention import _placed

SHAPE = (5, 3, 7, 4)  # 5 samples; 7 rows (uneven over H: 4 + 3), 4 columns


class Tokens(nn.Module):
    """A map's rows as tokens (``[N, H, W*C]``: split over H under a spatial config), a
    positional embedding added to them (sliced to each rank's rows), then partial slices of the
    split tokens (``1:``, ``::3``, ``-2``), a slice of the whole features (``..., :5``), and a
    class token expanded to the batch and joined in front (the tokens gathered: ``cat`` joins
    along a whole dim), its pooled token (``[:, 0]``) and the others (``[:, 1:]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.pos_embed = nn.Parameter(torch.zeros(1, 7, 16))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 16))
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.stem(x).permute(0, 2, 3, 1).flatten(2) + self.pos_embed  # [N, H, 16]
        parts = t[:, 1:].mean(1) + t[:, ::3].sum(1) * t[:, -2] + t[..., :5].mean((1, 2))[:, None]
        B = x.shape[0]
        t = torch.cat((self.cls_token.expand(B, -1, -1), self.proj(t)), dim=1)
        return self.head(t[:, 0] * parts + t[:, 1:].mean(1))


@pytest.mark.parametrize("name", ["sample", "spatial", "stationary-x", "stationary-y"])
def test_tokens_class_token_and_slices_equal_one_process(name: str) -> None:
    gen = torch.Generator().manual_seed(4)
    model = seeded(Tokens().double(), gen)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    check_rows(square_mean_reference(model, x),
               run_threads(square_mean_step, 4, model, OPTIONS[name], x))


def test_split_tokens_are_sliced_where_they_are_whole_and_gathered_where_split() -> None:
    """Rows split over H as the tokens: the positional embedding is sliced to them, a slice of
    the whole features runs on each rank's rows, a partial slice of the split tokens gathers
    them first, an integer is taken by its owner; the class token is expanded to each rank's
    own samples."""
    got = _placed(Tokens(), OPTIONS["spatial"], 4, SHAPE)
    assert got["add"][0] == "[o_N,o_H,*]"
    # (the embedding's dim of size 1 is made whole on the global shapes: broadcast_need)
    assert got["add"][2] == {"flatten": "[o_N,o_H,*]", "pos_embed": "[o_N,o_H,*]"}
    for name in ("getitem", "getitem_1"):  # t[:, 1:], t[:, ::3]
        assert got[name][0] == "[o_N,*,*]" and got[name][2] == {"add": "[o_N,*,*]"}
    # t[:, -2]: its owner's row, a pending sum over H (an allreduce of one row, not an
    # allgather of all)
    assert got["getitem_2"][:3] == ("Σ_H [o_N,*]", 0, {"add": "[o_N,o_H,*]"})
    assert got["getitem_3"][0] == "[o_N,o_H,*]"  # t[..., :5]: the rows stay split
    assert got["getitem_3"][2] == {"add": "[o_N,o_H,*]"}
    assert got["expand"][:3] == ("[o_N,*,*]", 0, {"cls_token": "[*,*,*]"})
    assert got["cat"][2] == {"expand": "[o_N,*,*]", "proj": "[o_N,*,*]"}


def test_the_class_token_is_split_like_the_samples_and_moves_nothing() -> None:
    """Sample-parallel: ``cls_token.expand(B, -1, -1)`` with ``B = x.shape[0]`` (the global
    batch, a constant of the program) is each rank's own samples' block, as ``x``'s, and the
    join moves nothing; on 3 ranks of 5 samples (2, 2, 1) each rank holds its count of rows."""
    got = _placed(Tokens(), OPTIONS["sample"], 4, SHAPE)
    assert got["expand"][0] == "[o_N,*,*]"
    assert got["cat"][0] == "[o_N,*,*]"
    assert set(got["cat"][2].values()) == {"[o_N,*,*]"}
    plan = explain(Tokens(), {"default": {"grid": {"N": 3}, "algorithm": "sample"}}, SHAPE,
                   world_size=3)
    moving = {layer.name for layer in plan.layers for r in range(3)
              if layer.bytes("forward", r)}
    assert moving == {"(input)"}  # the entry's agreement on the local shapes, no more
    rows = run_threads(_class_token_rows, 3, Tokens().double(), SHAPE)
    assert rows == [2, 2, 1]


def _class_token_rows(comm, model: nn.Module, shape: tuple[int, ...]) -> int:  # noqa: ANN001
    """The rows of this rank's expanded class token, read from its layer."""
    from distconv.data import sample_block
    from distconv.parallel import parallelize

    pmodel = parallelize(model, {"default": {"grid": {"N": comm.size}, "algorithm": "sample"}},
                         comm=comm)
    seen: list[int] = []
    layer = pmodel._function_modules["expand"]
    layer.register_forward_hook(lambda m, i, o: seen.append(o.shape[0]))
    x = torch.randn(shape, dtype=torch.float64)
    pmodel(x[sample_block(shape[0], pmodel.data_grid)])
    return seen[0]


class Grow(nn.Module):
    """Parameters expanded to the rows of a map (``y.size(2)``: split like the rows; one of a
    single row, one of a row each, which each rank narrows to its own), a gate
    broadcast with ``expand_as``, the channels repeated (split under stationary-x: gathered)
    and tiled, and a map broadcast to new leading dims."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 2, 3, padding=1)
        self.row = nn.Parameter(torch.zeros(1, 2, 1, 4))
        self.per_row = nn.Parameter(torch.zeros(7, 4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = y * torch.sigmoid(y.mean(1, keepdim=True)).expand_as(y)
        y = y + self.row.expand(-1, -1, y.size(2), -1)
        y = y * self.per_row.expand(1, 1, y.size(2), -1)
        z = y.repeat(1, 2, 1, 1) + torch.tile(y, (2, 1, 1)) * y.tile(1, 2, 1, 1)
        w = z.expand(2, -1, -1, -1, -1)[1]
        return self.head(w.mean((2, 3)))


@pytest.mark.parametrize("name", ["sample", "spatial", "stationary-x", "stationary-y",
                                  "stationary-w"])
def test_expand_repeat_and_tile_equal_one_process(name: str) -> None:
    gen = torch.Generator().manual_seed(8)
    model = seeded(Grow().double(), gen)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    check_rows(square_mean_reference(model, x),
               run_threads(square_mean_step, 4, model, OPTIONS[name], x))


def test_grown_dims_are_split_like_their_source_or_whole() -> None:
    """Rows split over H: the parameter grown to ``y.size(2)`` is split over H as ``y``'s rows;
    the gate's size-1 dim is whole before ``expand_as``; a repeat of channels split over C
    gathers them (whole in the result), the dims it leaves alone keep their split."""
    got = _placed(Grow(), OPTIONS["spatial"], 4, SHAPE)
    assert got["expand"][0] == "[*,*,o_H,*]"
    assert got["expand_1"][:3] == ("[*,*,o_H,*]", 0, {"per_row": "[*,*]"})
    assert got["expand_as"][0] == "[o,*,o,*]"  # y's own: its dims N and H split over N, H
    assert got["repeat"][0] == "[o_N,*,o_H,*]"
    assert got["expand_2"][:2] == ("[*,o_N,*,o_H,*]", 1)
    got = _placed(Grow(), OPTIONS["stationary-x"], 4, SHAPE)
    assert got["stem"][0] == "[o,o_C,*,*]"
    assert got["repeat"][:3] == ("[o_N,*,*,*]", 0, {"mul_1": "[o_N,*,*,*]"})


class _ExpandsSamples(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stem(x).repeat(2, 1, 1, 1).mean((1, 2, 3))


class _SlicesSamples(_ExpandsSamples):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stem(x)[1:].mean((1, 2, 3))


@pytest.mark.parametrize("model, words", [
    (_ExpandsSamples(), r"^explain: node 'repeat'.*: Expand or repeat the samples outside "
     r"the model: repeat grows dim 0"),
    (_SlicesSamples(), r"^explain: node 'getitem'.*: Slice the plain model's input instead"),
], ids=["repeat-samples", "slice-samples"])
def test_what_picks_or_grows_the_samples_is_refused_naming_the_node(model: nn.Module,
                                                                   words: str) -> None:
    with pytest.raises(ops.Unsupported, match=words):
        explain(model, OPTIONS["sample"], SHAPE, world_size=4)


class _Sliced(nn.Module):
    """A slice and an integer of the rows of a map (split over H under a spatial config)."""

    def __init__(self, rows: slice, row: int) -> None:
        super().__init__()
        self.rows, self.row = rows, row
        self.stem = nn.Conv2d(2, 3, 1)
        self.head = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        return self.head(y[:, :, self.rows].mean((2, 3)) * y[:, :, self.row].sum(2))


@settings(max_examples=8)
@given(rows=st.integers(3, 9), parts=st.integers(2, 3), data=st.data())
def test_slices_and_integers_of_uneven_split_rows_equal_one_process(rows: int, parts: int,
                                                                   data: st.DataObject) -> None:
    """Any slice (start, stop, step) and any integer, negative ones included, of rows split
    unevenly over 2 or 3 ranks: the slice on the gathered rows, the integer its owner's."""
    start = data.draw(st.integers(-rows, rows - 1))
    stop = data.draw(st.one_of(st.none(), st.integers(start % rows + 1, rows)))
    step = data.draw(st.integers(1, 3))
    row = data.draw(st.integers(-rows, rows - 1))
    gen = torch.Generator().manual_seed(rows)
    model = seeded(_Sliced(slice(start, stop, step), row).double(), gen)
    x = torch.randn((3, 2, rows, 2), generator=gen, dtype=torch.float64)
    config = {"default": {"grid": {"H": parts}, "algorithm": "spatial"}, "data": {"H": parts}}
    check_rows(square_mean_reference(model, x),
               run_threads(square_mean_step, parts, model, config, x))
