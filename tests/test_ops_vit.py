"""Vision transformers as their packages write them -- timm's ``VisionTransformer`` (ViT, DeiT;
a class token, register tokens, ``_pos_embed``, token or average pooling) and torchvision's
(``class_token.expand(n, -1, -1)``, ``torch.cat``, ``x + self.pos_embedding``, ``x[:, 0]``) --
each exact against one process in fp64 on thread ranks under sample, spatial and stationary
configs end to end, and one fixed case on a real gloo world."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distconv import ops
from distconv.testing import run_threads
from tests.parallel.cases import (
    OPTIONS, check_rows, seeded, square_mean_reference, square_mean_step,
)
from tests.test_ops_attention import _placed
from tests.test_ops_expand import SHAPE as TOKENS_SHAPE, Tokens

IMAGE = (5, 3, 32, 32)  # 5 samples (uneven over 2 or 4 sample blocks), 4 x 4 patches of 8 x 8


def _timm(name: str, **kw: object) -> nn.Module:
    timm = pytest.importorskip("timm")
    return timm.create_model(name, img_size=32, patch_size=8, embed_dim=16, depth=1,
                             num_heads=2, num_classes=3, **kw)


@pytest.mark.parametrize("name", ["sample", "spatial", "stationary-x"])
@pytest.mark.parametrize("model, kw", [
    ("vit_tiny_patch16_224", {}),
    ("deit_tiny_patch16_224", {"reg_tokens": 2, "global_pool": "avg"}),
    ("vit_tiny_patch16_224", {"no_embed_class": True, "reg_tokens": 1}),
], ids=["vit-class-token", "deit-registers-avg", "vit-no-embed-class"])
def test_timm_vit_equals_one_process(model: str, kw: dict, name: str) -> None:
    """timm's ViT as ``create_model`` gives it (its forward's ``attn_mask=None`` bound):
    ``cls_token.expand(B, -1, -1)`` (and the register tokens') joined to the patches, the
    positional embedding added after the join or, ``no_embed_class``, to the patches before it,
    attention, and the class token (``x[:, 0]``) or the mean of the patches
    (``x[:, num_prefix_tokens:]``) pooled."""
    gen = torch.Generator().manual_seed(0)
    vit = seeded(_timm(model, **kw).double(), gen)
    x = torch.randn(IMAGE, generator=gen, dtype=torch.float64)
    check_rows(square_mean_reference(vit, x),
               run_threads(square_mean_step, 4, vit, OPTIONS[name], x))


def test_timm_vit_expands_the_class_token_to_each_ranks_samples() -> None:
    """Sample-parallel: the class token and the register tokens are each rank's own samples'
    block, the join and the positional embedding move nothing, and the pooled class token keeps
    the samples' split."""
    got = _placed(_timm("deit_tiny_patch16_224", reg_tokens=2), OPTIONS["sample"], 4, IMAGE)
    assert got["expand"][0] == got["expand_1"][0] == "[o_N,*,*]"
    assert set(got["cat"][2].values()) == {"[o_N,*,*]"}
    assert got["add"][0] == "[o_N,*,*]"
    pooled = [v for k, v in got.items() if k.startswith("getitem") and v[0] == "[o_N,*]"]
    assert pooled, "the class token's pooling keeps the samples split"


class _SelfAttention(nn.Module):
    """A tiny stand-in for ``nn.MultiheadAttention`` as torchvision's ``EncoderBlock`` calls it
    (``self_attention(x, x, x, need_weights=False)`` returning ``(out, None)``), written with
    ``Linear`` and ``F.scaled_dot_product_attention``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                need_weights: bool = False) -> tuple[torch.Tensor, None]:
        B, N, C = query.shape
        qkv = self.qkv(query).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C)
        return self.proj(out), None


def _torchvision_vit() -> nn.Module:
    models = pytest.importorskip("torchvision.models")
    vit = models.VisionTransformer(image_size=32, patch_size=8, num_layers=1, num_heads=2,
                                   hidden_dim=16, mlp_dim=32, num_classes=3)
    if not any(nn.MultiheadAttention in h.modules for h in ops.REGISTRY):
        for block in vit.encoder.layers:  # no handler runs nn.MultiheadAttention: a stand-in
            block.self_attention = _SelfAttention(16, 2)
    return vit


@pytest.mark.parametrize("name", ["sample", "spatial", "stationary-x"])
def test_torchvision_vit_equals_one_process(name: str) -> None:
    """torchvision's ViT: ``_process_input`` (a strided patch convolution, reshaped and
    permuted to tokens), ``class_token.expand(n, -1, -1)``, ``torch.cat``, the encoder's
    ``input + self.pos_embedding``, its blocks, and ``x[:, 0]`` into the head."""
    gen = torch.Generator().manual_seed(1)
    vit = seeded(_torchvision_vit().double(), gen)
    x = torch.randn(IMAGE, generator=gen, dtype=torch.float64)
    check_rows(square_mean_reference(vit, x),
               run_threads(square_mean_step, 4, vit, OPTIONS[name], x))


@pytest.mark.gloo
def test_class_token_and_split_tokens_on_gloo(gloo4) -> None:  # noqa: ANN001
    """Rows split over H as the tokens (the positional embedding sliced to them, partial slices
    gathered by a real allgather), a class token expanded to each rank's samples."""
    gen = torch.Generator().manual_seed(4)
    model = seeded(Tokens().double(), gen)
    x = torch.randn(TOKENS_SHAPE, generator=gen, dtype=torch.float64)
    check_rows(square_mean_reference(model, x),
               gloo4.run(square_mean_step, model, OPTIONS["spatial"], x))


class _Optional(nn.Module):
    """A forward with arguments after the input that have defaults, one guarding a branch (as
    ``if attn_mask is not None`` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None,
                square: bool = False) -> torch.Tensor:
        y = self.stem(x)
        if scale is not None:
            y = y * scale
        if square:
            y = y * y
        return self.head(y.mean((2, 3)))


def test_forward_arguments_with_defaults_take_them() -> None:
    """The captured graph is ``model(x)``'s: one input, each later argument its default (the
    branches it guards not taken), exact against one process."""
    from distconv.parallel.graph import trace

    gm = trace(_Optional(), TOKENS_SHAPE)
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["x"]
    assert not any(n.target is operator.mul for n in gm.graph.nodes)
    gen = torch.Generator().manual_seed(3)
    model = seeded(_Optional().double(), gen)
    x = torch.randn(TOKENS_SHAPE, generator=gen, dtype=torch.float64)
    check_rows(square_mean_reference(model, x),
               run_threads(square_mean_step, 4, model, OPTIONS["spatial"], x))
