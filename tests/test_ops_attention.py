"""Attention as models write it: the samples moved behind a stacked q/k/v axis and taken back by
an integer index, contractions (``einsum``, ``@``) and softmax, each exact against one process in
fp64 on thread ranks; the placements they take written down from the rule (each grid dim splits
one letter; a contracted split leaves a pending sum; the rest is gathered); and what cannot be
exact refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from distconv import ops
from distconv.ops.base import SampleNet
from distconv.ops.einsum import _Attention, equation
from distconv.parallel.config import ParallelConfig
from distconv.parallel.explain import explain
from distconv.parallel.graph import analyse, trace
from distconv.testing import run_threads
from tests.parallel.cases import (
    OPTIONS, _gathered_grads, check_rows, seeded, square_mean_reference, square_mean_step,
)

SHAPE = (5, 4, 6, 5)


def _placed(model: nn.Module, config: dict, world: int, shape: tuple[int, ...]) -> dict:
    """Each value's (Dist, samples' dim) and each operand's conversion target, by node name."""
    analysis = analyse(trace(model, shape), ParallelConfig(config, world_size=world),
                       input_ndim=len(shape))
    return {s.node.name: (str(s.out.dist), s.samples,
                          {a.name: str(p.dist) for a, p in s.needs.items()})
            for s in analysis.steps if s.out is not None}


def test_the_samples_move_behind_the_stacked_axis_and_back() -> None:
    """Sample-parallel: the permute puts the samples' split in dim 1, ``qkv[0]`` takes it back
    to dim 0, and the contractions and softmax run on it where it is: nothing moves."""
    got = _placed(SampleNet(_Attention(False), 4), OPTIONS["sample"], 4, (5, 4, 8, 6))
    assert got["permute"][:2] == ("[*,o_N,*,*,*]", 1)
    for name in ("getitem_4", "getitem_5", "einsum", "softmax", "einsum_1"):
        assert got[name][:2] == ("[o_N,*,*,*]", 0), name
    assert got["einsum"][2] == {"getitem_4": "[o_N,*,*,*]", "getitem_5": "[o_N,*,*,*]"}


class _Gram(nn.Module):
    """Rows against rows (``q kᵀ`` over a map's rows), normalised over the keys, then applied to
    the values: the tokens are the rows, split under a spatial config. A gram of one value
    against itself last."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 4, 3, padding=1)
        self.key = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.stem(x)
        g = torch.einsum("nchw,nckw->nhk", q, self.key(q)).softmax(-1)
        v = torch.einsum("nhk,nckw->nchw", g, q)
        return v + torch.einsum("nchw,nckw->nhk", v, v).mean(2)[:, None, :, None]


def test_split_tokens_keep_the_queries_split_and_gather_the_keys() -> None:
    """Rows split over H: the first contraction keeps the queries' rows (``h``) split and
    gathers the keys' (``k``: H is taken), the softmax over ``k`` finds it whole, and the second
    gathers the values' rows (``k``, contracted: H is taken by ``h``)."""
    got = _placed(_Gram(), OPTIONS["spatial"], 4, SHAPE)
    assert got["einsum"][0] == "[o_N,o_H,*]"
    assert got["einsum"][2] == {"stem": "[o_N,*,o_H,*]", "key": "[o_N,*,*,*]"}
    assert got["softmax"][2] == {"einsum": "[o_N,o_H,*]"}
    assert got["einsum_1"][0] == "[o_N,*,o_H,*]"
    assert got["einsum_1"][2] == {"softmax": "[o_N,o_H,*]", "stem": "[o_N,*,*,*]"}
    # one value as both operands is converted once: its rows whole for both terms
    assert got["einsum_2"][2] == {"einsum_1": "[o_N,*,*,*]"}


def test_a_split_contracted_dim_leaves_a_pending_sum() -> None:
    """Channels split over C (stationary-x): ``c`` is contracted in both operands alike, each
    rank sums its channels, and the result is a pending sum over C, which the softmax (whole
    over ``k``) completes."""
    got = _placed(_Gram(), OPTIONS["stationary-x"], 4, SHAPE)
    assert got["einsum"][0] == "Σ_C [o_N,*,*]"
    assert got["softmax"][2] == {"einsum": "[o_N,*,*]"}


@pytest.mark.parametrize("name", ["sample", "spatial", "stationary-x"])
def test_gram_attention_equals_one_process(name: str) -> None:
    gen = torch.Generator().manual_seed(4)
    model = seeded(_Gram().double(), gen)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    check_rows(square_mean_reference(model, x),
               run_threads(square_mean_step, 4, model, OPTIONS[name], x))


class _Contract(nn.Module):
    """A stem's map against a permuted convolution of it, contracted by ``eq``."""

    def __init__(self, eq: str, perm: tuple[int, ...]) -> None:
        super().__init__()
        self.eq, self.perm = eq, perm
        self.stem = nn.Conv2d(4, 4, 1)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.stem(x)
        return torch.einsum(self.eq, a, self.conv(a).permute(0, *self.perm))


@st.composite
def contractions(draw: st.DrawFn) -> tuple[str, tuple[int, ...]]:
    """An equation of ``a[n,c,h,w]`` and ``b = y.permute(0, *perm)`` (y shaped as a): each of
    the dims c, h, w shared by both operands (kept: a batch dim; dropped: contracted) or a
    letter of its own in each (each kept or summed), the output the samples and the kept
    letters in a drawn order."""
    perm = tuple(draw(st.permutations([1, 2, 3])))
    own = {}
    out = []
    for role in "chw":
        mode = draw(st.sampled_from(["batch", "contracted", "free"]))
        own[role] = role.upper() if mode == "free" else role
        if mode == "batch":
            out.append(role)
        elif mode == "free":
            out += [c for c in (role, role.upper()) if draw(st.booleans())]
    b = "n" + "".join(own["chw"[p - 1]] for p in perm)
    return f"nchw,{b}->n{''.join(draw(st.permutations(out)))}", perm


@settings(max_examples=6, deadline=None)
@given(contractions(), st.sampled_from(["sample", "spatial", "stationary-x"]))
def test_any_contraction_equals_one_process(case: tuple[str, tuple[int, ...]], name: str) -> None:
    eq, perm = case
    gen = torch.Generator().manual_seed(9)
    model = seeded(_Contract(eq, perm).double(), gen)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    check_rows(square_mean_reference(model, x),
               run_threads(square_mean_step, 4, model, OPTIONS[name], x))


def test_equations_are_read_as_torch_reads_them() -> None:
    """The ellipsis written out in fresh letters (aligned to the right), the implicit output in
    torch's order: the ellipsis, then the letters written once, sorted."""
    terms, out = equation("...ij,...jk", [4, 3])
    assert terms[1][0] == terms[0][1] and out == terms[0][:2] + "ik"
    assert len(set(terms[0][:2]) - set("ijk")) == 2
    assert equation("bij,bjk->bik", [3, 3]) == (["bij", "bjk"], "bik")
    assert equation("ba,ca", [2, 2])[1] == "bc"
    with pytest.raises(ValueError, match="does not fit"):
        equation("bij,bjk->bik", [3, 2])


class _SumsSamples(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.stem(x)
        return torch.einsum("nchw,nchw->chw", a, a).mean((1, 2))


class _ReturnsMoved(_SumsSamples):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stem(x).transpose(0, 1)


class _LinearOnMoved(_SumsSamples):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.stem(x).permute(2, 0, 3, 1)  # [H, N, W, C]
        return self.fc(z).mean((0, 2))


class _PicksSample(_SumsSamples):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stem(x).permute(1, 0, 2, 3)[:, 0]


class _PairsSamples(_SumsSamples):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.stem(x).mean((2, 3))
        return torch.einsum("nc,mc->nm", p, p)


@pytest.mark.parametrize("model, words", [
    (_SumsSamples(), r"node 'einsum'.*sums over the samples"),
    (_ReturnsMoved(), r"node 'output'.*returns 'transpose' with the samples in dim 1"),
    (_LinearOnMoved(), r"node 'fc'.*holds the samples in dim 1 \(node 'permute' moves"),
    (_PicksSample(), r"node 'getitem'.*picks one sample"),
    (_PairsSamples(), r"node 'einsum'.*samples under different letters"),
], ids=["sums", "returns", "linear", "picks", "pairs"])
def test_what_would_mix_or_misplace_the_samples_is_refused_naming_the_node(
        model: nn.Module, words: str) -> None:
    with pytest.raises(ops.Unsupported, match=words):
        explain(model, OPTIONS["sample"], (4, 3, 5, 6), world_size=4)


class _Broadcast(nn.Module):
    """An einsum whose letter ``h`` is 1 in one operand (a row mean) and the rows in the other:
    torch broadcasts it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.stem(x)
        return torch.einsum("nchw,nchw->nchw", a, a.mean(2, keepdim=True))


def _sized_step(comm, model: nn.Module, config: dict, x: torch.Tensor) -> dict:  # noqa: ANN001
    """``square_mean_step`` of the model captured on the input's shape."""
    from distconv.data import sample_block
    from distconv.parallel import parallelize

    pmodel = parallelize(copy.deepcopy(model), config, comm=comm, input_shape=x.shape)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    out = pmodel(x[rows])
    out.square().mean().backward()
    return {"rows": rows, "out": out.detach(), "grads": _gathered_grads(pmodel)}


def test_a_letter_that_broadcasts_is_whole_and_equals_one_process() -> None:
    """Captured on the input shape, ``h`` is seen broadcast (1 against 6): it is whole, the
    rows gathered, exact. Without the shape it is split as the operands' rows are, and the
    shape that broadcasts it is refused by name before a step runs."""
    got = _placed(_Broadcast(), OPTIONS["spatial"], 4, SHAPE)
    assert got["einsum"][0] == "[o_N,*,*,*]"
    gen = torch.Generator().manual_seed(2)
    model = seeded(_Broadcast().double(), gen)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    check_rows(square_mean_reference(model, x),
               run_threads(_sized_step, 4, model, OPTIONS["spatial"], x))
    with pytest.raises(ValueError, match=r"node 'einsum'.*letter 'h'.*sizes \[1, 6\]"):
        run_threads(square_mean_step, 4, model, OPTIONS["spatial"], x)
