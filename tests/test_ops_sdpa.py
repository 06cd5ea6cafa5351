"""timm-style attention (``qkv.unbind(0)``, ``F.scaled_dot_product_attention``) in a small
ViT-ish model, exact against one process in fp64 on thread ranks under sample, spatial and
stationary configs; the placements written down from the rule (batch-like splits kept, the
queries' tokens kept, keys and values whole over their tokens, head dims whole); and what
cannot be exact refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distconv import ops
from distconv.parallel.explain import explain
from distconv.testing import run_threads
from tests.parallel.cases import (
    OPTIONS, check_rows, seeded, square_mean_reference, square_mean_step,
)
from tests.test_ops_attention import _placed

SHAPE = (4, 3, 8, 4)  # 4 samples, 3 colours, 8 x 4 pixels: 4 x 2 patches of 2 x 2


class Attention(nn.Module):
    """timm's ``Attention`` as it writes its forward."""

    def __init__(self, dim: int, num_heads: int, **sdpa: Any) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.sdpa = sdpa

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, **self.sdpa)
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class ViT(nn.Module):
    """Patch embedding (a 2 x 2 strided Conv2d, flattened to tokens), a pre-norm attention block
    with a residual, and a head over the mean token."""

    def __init__(self, dim: int = 8, heads: int = 2, **sdpa: Any) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 2, stride=2)
        self.norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, **sdpa)
        self.head = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.patch(x).flatten(2).transpose(1, 2)  # [B, tokens, dim]
        t = t + self.attn(self.norm(t))
        return self.head(t.mean(1))


@pytest.mark.parametrize("sdpa", [{"dropout_p": 0.0},
                                  {"attn_mask": None, "is_causal": False, "scale": 0.4},
                                  {"is_causal": True}], ids=["default", "scaled", "causal"])
@pytest.mark.parametrize("name", ["sample", "spatial", "stationary-x"])
def test_vit_attention_equals_one_process(name: str, sdpa: dict) -> None:
    gen = torch.Generator().manual_seed(3)
    model = seeded(ViT(**sdpa).double(), gen)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    check_rows(square_mean_reference(model, x),
               run_threads(square_mean_step, 4, model, OPTIONS[name], x))


def test_vit_attention_moves_nothing_under_the_samples_split() -> None:
    """The permute puts the samples in dim 1, unbind keeps them there, each slice takes them back
    to dim 0, and the attention runs on the samples' blocks: nothing converted."""
    got = _placed(ViT(), OPTIONS["sample"], 4, SHAPE)
    assert got["unbind"][:2] == ("[*,o_N,*,*,*]", 1)
    assert [got[f"getitem_{i}"][:2] for i in (3, 4, 5)] == [("[o_N,*,*,*]", 0)] * 3
    sdpa = got["scaled_dot_product_attention"]
    assert sdpa[0] == "[o_N,*,*,*]"
    assert set(sdpa[2].values()) == {"[o_N,*,*,*]"}


class Rows(nn.Module):
    """Attention between a map's rows or columns: ``q, k, v`` three convolutions of a stem's map
    permuted by ``perm`` to ``[N, batch, tokens, channels]``; under a spatial config the rows
    (split over H) are the tokens (``perm = (0, 3, 2, 1)``) or a batch-like dim
    (``(0, 2, 3, 1)``)."""

    def __init__(self, perm: tuple[int, ...], **sdpa: Any) -> None:
        super().__init__()
        self.perm, self.sdpa = perm, sdpa
        self.back = tuple(perm.index(d) for d in range(4))
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.qkv = nn.ModuleList(nn.Conv2d(4, 4, 1) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.stem(x)
        q, k, v = (c(a).permute(*self.perm) for c in self.qkv)
        o = F.scaled_dot_product_attention(q, k, v, **self.sdpa)
        return a + o.permute(*self.back)


def test_split_tokens_keep_the_queries_split_and_gather_keys_and_values() -> None:
    """Rows split over H as the tokens: the queries keep them, keys and values are gathered
    over them; rows as a batch-like dim: nothing moves."""
    got = _placed(Rows((0, 3, 2, 1)), OPTIONS["spatial"], 4, SHAPE)["scaled_dot_product_attention"]
    assert got[0] == "[o_N,*,o_H,*]"
    assert got[2] == {"permute": "[o_N,*,o_H,*]", "permute_1": "[o_N,*,*,*]",
                      "permute_2": "[o_N,*,*,*]"}
    got = _placed(Rows((0, 2, 3, 1)), OPTIONS["spatial"], 4, SHAPE)["scaled_dot_product_attention"]
    assert got[0] == "[o_N,o_H,*,*]"
    assert set(got[2].values()) == {"[o_N,o_H,*,*]"}
    causal = _placed(Rows((0, 3, 2, 1), is_causal=True), OPTIONS["spatial"], 4, SHAPE)
    assert causal["scaled_dot_product_attention"][0] == "[o_N,*,*,*]"


def test_a_split_head_dim_is_gathered() -> None:
    """Channels split over F (stationary-y) are the head dim: each score sums over all of it and
    goes through the softmax, so query, key and value are gathered over it."""
    got = _placed(Rows((0, 2, 3, 1)), OPTIONS["stationary-y"], 4, SHAPE)
    assert got["permute"][0] == "[o,*,*,o_F]"
    sdpa = got["scaled_dot_product_attention"]
    assert sdpa[0] == "[o_N,*,*,*]"
    assert set(sdpa[2].values()) == {"[o_N,*,*,*]"}


@pytest.mark.parametrize("perm, name", [
    ((0, 3, 2, 1), "spatial"), ((0, 2, 3, 1), "spatial"), ((0, 2, 3, 1), "stationary-y")],
    ids=["tokens", "batch", "head-dim"])
@pytest.mark.parametrize("sdpa", [{}, {"is_causal": True, "scale": 0.7}], ids=["plain", "causal"])
def test_row_attention_equals_one_process(perm: tuple[int, ...], name: str, sdpa: dict) -> None:
    gen = torch.Generator().manual_seed(5)
    model = seeded(Rows(perm, **sdpa).double(), gen)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    check_rows(square_mean_reference(model, x),
               run_threads(square_mean_step, 4, model, OPTIONS[name], x))


class _Masked(Rows):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.stem(x)
        q, k, v = (c(a).permute(*self.perm) for c in self.qkv)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=q.sigmoid())
        return a + o.permute(*self.back)


class _UnbindsSamples(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stem(x).unbind(0)[0][None]


class _CatsUnbound(_UnbindsSamples):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.stem(x).unbind(1), dim=2)


class _PairsSamples(Rows):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.stem(x)
        q, v = (c(a).permute(0, 3, 2, 1) for c in (self.qkv[0], self.qkv[2]))  # [N, W, H, C]
        k = self.qkv[1](a).permute(3, 0, 2, 1)  # [W, N, H, C]: sized as q (W = N = C)
        o = F.scaled_dot_product_attention(q, k, v)
        return a + o.permute(0, 3, 2, 1)


@pytest.mark.parametrize("model, config, words", [
    (ViT(dropout_p=0.1), "sample", r"node 'scaled_dot_product_attention' .*'attn'.*dropout_p=0.1"),
    (Rows((0, 2, 3, 1), enable_gqa=True), "sample", r"node 'scaled_dot_product_attention'.*"
     "enable_gqa=True"),
    (_Masked((0, 2, 3, 1)), "sample", r"node 'scaled_dot_product_attention'.*attn_mask.*"
     "what works"),
    (_UnbindsSamples(), "sample", r"node 'unbind'.*unbinds the samples"),
    (_CatsUnbound(), "spatial", r"node 'unbind'.*tuple is used whole by node 'cat'"),
    (_PairsSamples((0, 3, 2, 1)), "sample", r"node 'scaled_dot_product_attention'.*samples in "
     r"dims \[0, 1\]"),
], ids=["dropout", "gqa", "mask", "unbind-samples", "unbind-whole", "pairs-samples"])
def test_what_cannot_be_exact_is_refused_naming_the_node(model: nn.Module, config: str,
                                                          words: str) -> None:
    with pytest.raises(ops.Unsupported, match=words):
        explain(model, OPTIONS[config], SHAPE, world_size=4)


@pytest.mark.parametrize("model", [ViT(), Rows((0, 2, 3, 1))], ids=["vit", "rows"])
def test_the_planners_plan_runs_attention_exactly(model: nn.Module) -> None:
    """``plan_network`` plans through unbind and the attention (its choices may split the head
    dim: gathered), and its config equals one process."""
    from tests.zoo.catalogue import planned

    gen = torch.Generator().manual_seed(6)
    model = seeded(model.double(), gen)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    config = planned(model, SHAPE)
    check_rows(square_mean_reference(model, x),
               run_threads(square_mean_step, 4, model, config, x))


@pytest.mark.gloo
def test_split_tokens_on_gloo(gloo4) -> None:  # noqa: ANN001
    """Rows split over H as the tokens (keys and values gathered by a real allgather)."""
    gen = torch.Generator().manual_seed(5)
    model = seeded(Rows((0, 3, 2, 1)).double(), gen)  # (a type pickle finds by its name)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    check_rows(square_mean_reference(model, x),
               gloo4.run(square_mean_step, model, OPTIONS["spatial"], x))


class _Broadcast(Rows):
    """Keys and values of one row (a row mean) broadcast against every query row: the rows,
    split over H, are a batch-like dim of size 1 in the keys."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.stem(x)
        q, k, v = (c(a).permute(*self.perm) for c in self.qkv)
        o = F.scaled_dot_product_attention(q, k.mean(1, keepdim=True), v.mean(1, keepdim=True))
        return a + o.permute(*self.back)


def test_a_dim_that_broadcasts_is_whole_and_equals_one_process() -> None:
    """Captured on the input shape, the rows are seen broadcast (1 against 8): whole, exact.
    Without the shape they are split as the queries' rows are, and the shape that broadcasts
    them is refused by name before a step runs."""
    from tests.test_ops_attention import _sized_step

    got = _placed(_Broadcast((0, 2, 3, 1)), OPTIONS["spatial"], 4, SHAPE)
    assert got["scaled_dot_product_attention"][0] == "[o_N,*,*,*]"
    gen = torch.Generator().manual_seed(2)
    model = seeded(_Broadcast((0, 2, 3, 1)).double(), gen)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    check_rows(square_mean_reference(model, x),
               run_threads(_sized_step, 4, model, OPTIONS["spatial"], x))
    with pytest.raises(ValueError, match=r"node 'scaled_dot_product_attention'.*dim 1 of.*sizes"):
        run_threads(square_mean_step, 4, model, OPTIONS["spatial"], x)
