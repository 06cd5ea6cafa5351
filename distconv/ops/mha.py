"""``nn.MultiheadAttention`` as torchvision's ViT calls it (``x, _ = self.self_attention(x, x, x,
need_weights=False)``): queries ``[N, L, E]``, keys ``[N, S, Ek]``, values ``[N, S, Ev]``
(``[L, N, E]`` ... with ``batch_first=False``), the node's value the tuple
``(attn_output, attn_weights)``.

The module runs as it is on each rank's blocks, its parameters whole on every rank (replicated:
their gradients, each rank's partial sums over its own samples and query rows, are completed as
any replicated parameter's). Each query row needs every key and value row and all of their
embedding: the samples' dim (``Step.samples``: 0, or 1 with ``batch_first=False``) keeps the
query's split and the keys and values are converted to it (nothing moves under a sample split);
the queries' token dim ``L`` keeps its split where the query is a value of its own (each rank
attends its rows: ``q[o_N,o_H,*]``); the keys' and values' token dim ``S`` and every embedding dim
are made whole (an allgather over the grid dims that split them, priced as the conversion it is),
exact. Self-attention (the query also the key or value, one value placed once) gathers the tokens
of all three: the output is the rows' ``[o_N,*,*]``.

The tuple is placed as its item 0 (``attn_output``); ``operator.getitem`` takes item 0 in that
placement and item 1, the attention weights ``[N, L, S]`` (``[N, heads, L, S]`` with
``average_attn_weights=False``; batch first whatever ``batch_first`` is), with the samples' and
the query rows' splits and the key tokens whole (:func:`tuple_item`). Refused by name: a
``key_padding_mask`` or ``attn_mask`` (their blocks would have to follow the splits), ``dropout``
other than 0 (its draws inside the fused call are no one process's), unbatched inputs, and inputs
whose samples are not in the dim the module reads as its batch.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from distconv.distribution import Dist
from distconv.ops.base import SAMPLE_GRIDS, Handler, PriceContext, Sample, SampleNet
from distconv.ops.elementwise import is_constant
from distconv.parallel.placement import Placement
from distconv.parallel.steps import samples_of

__all__ = ["MultiheadAttentionHandler", "tuple_item"]

_WORKS = ("what works: query, key and value of shape [N, L, E] (batch_first=True) or [L, N, E], "
          "the samples in the batch dim, split any way (the samples' split kept, the queries' "
          "tokens kept, the rest gathered), with no masks and dropout=0")
_NAMES = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
          "average_attn_weights", "is_causal")
_DEFAULTS = {"key_padding_mask": None, "need_weights": True, "attn_mask": None,
             "average_attn_weights": True, "is_causal": False}


def _arguments(node: fx.Node) -> dict[str, Any]:
    """The call's arguments by name (defaults filled in)."""
    named = dict(_DEFAULTS)
    named.update(zip(_NAMES, node.args))
    named.update(node.kwargs)
    return named


def tuple_item(an: Any, node: fx.Node, index: Any) -> tuple[Placement | None, int] | None:
    """The placement and samples' dim of ``node[index]`` where ``node`` is a multi-head
    attention's tuple (None where it is not one): item 0, ``attn_output``, as the tuple is
    placed; item 1, the attention weights ``[N, (heads,) L, S]``, the samples' and query rows'
    splits kept, the key tokens whole (no placement where ``need_weights=False`` makes it
    None). Refuses another index by name."""
    module = an.modules.get(node.target) if node.op == "call_module" else None
    if not isinstance(module, nn.MultiheadAttention):
        return None
    module = an.modules[node.target]
    p = an.placement(node)
    samples = 0 if module.batch_first else 1
    if index in (0, -2):
        return p, samples
    if index not in (1, -1):
        an.fail(node, "take item 0 or 1 by an integer: its tuple (attn_output, attn_weights) "
                f"is indexed with {index!r}")
    named = _arguments(node)
    if not named["need_weights"]:
        return None, 0  # item 1 is None: the getitem's value carries no tensor
    batch, rows = p.dist.entries[samples], p.dist.entries[1 - samples]
    heads = () if named["average_attn_weights"] else (None,)
    return Placement(p.layout, Dist((batch, *heads, rows, None))), 0


def query_key_value(an: Any, node: fx.Node, named: dict[str, Any]
                    ) -> tuple[fx.Node, fx.Node, fx.Node]:
    """An attention call's ``query``, ``key`` and ``value`` (by name, from ``named``): placed
    values of the graph, or refused by name (``F.scaled_dot_product_attention`` and
    ``nn.MultiheadAttention`` alike)."""
    q, k, v = (named.get(n) for n in ("query", "key", "value"))
    if not all(isinstance(t, fx.Node) and an.out.get(t) is not None for t in (q, k, v)):
        an.fail(node, "pass query, key and value as tensors of the graph: here one is not",
                TypeError)
    return q, k, v


class MultiheadAttentionHandler(Handler):
    modules = (nn.MultiheadAttention,)
    samples_anywhere = True

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import Step

        named = _arguments(node)
        q, k, v = query_key_value(an, node, named)
        self._check_options(an, node, module, named)
        placed = [an.placement(t).settled() for t in (q, k, v)]
        if any(p.ndim != 3 for p in placed):
            an.fail(node, "give query, key and value a batch dim (unbatched attention has no "
                    f"samples to split): they have {[p.ndim for p in placed]} dims; {_WORKS}")
        samples = 0 if module.batch_first else 1
        for t in (q, k, v):
            dim = samples_of(t)[0]
            if not is_constant(t) and dim != samples:
                an.fail(node, f"pass batch_first={dim == 0} or move the samples to dim "
                        f"{samples}: {t.name!r} holds the samples in dim {dim}, which the module "
                        f"(batch_first={module.batch_first}) reads as its tokens or embedding, "
                        f"pairing one sample's tokens with another's; {_WORKS}")
        for user in node.users:  # the tuple is placed as its item 0: only its items are values
            if user.target is not operator.getitem or not isinstance(user.args[1], int):
                an.fail(node, f"take its items by an integer (out, weights = mha(q, k, v), or "
                        f"mha(q, k, v)[0]): its tuple is used whole by node {user.name!r}")
        qp = placed[0]  # k and v are converted to its layout
        batch = qp.dist.entries[samples]
        # a query that is also the key or value is one value placed once: its tokens whole
        rows = None if q in (k, v) else qp.dist.entries[1 - samples]

        def at(tokens: Any) -> Placement:
            entries = (batch, tokens, None) if samples == 0 else (tokens, batch, None)
            return Placement(qp.layout, Dist(entries))

        needs = {q: at(rows), k: at(None), v: at(None)}
        return Step(node, "contract", at(rows), needs, samples=samples)

    @staticmethod
    def _check_options(an: Any, node: Any, module: Any, named: dict[str, Any]) -> None:
        for name in ("key_padding_mask", "attn_mask"):
            if named[name] is not None:
                an.fail(node, f"pass {name}=None, or write the attention out (q @ k.T * scale + "
                        "mask).softmax(-1) @ v, each op of which runs distributed: a tensor "
                        f"{name} is not supported (its blocks would have to follow the queries' "
                        f"and keys' splits); {_WORKS}")
        for name in ("need_weights", "average_attn_weights", "is_causal"):
            if isinstance(named[name], fx.Node):
                an.fail(node, f"give {name} as a constant: it is a value of the graph",
                        TypeError)
        if module.dropout:
            an.fail(node, f"construct it with dropout=0 (it has dropout={module.dropout}), or "
                    "put an nn.Dropout after it: the attention-weight draws inside the fused call "
                    f"are no one process's; {_WORKS}")

    def price(self, report: Any, step: Any, module: Any, ctx: PriceContext) -> None:
        report.param_elements = sum(p.numel() for p in module.parameters())

    def samples(self) -> Sequence[Sample]:
        return (Sample("mha-self", lambda: SampleNet(_SelfAttention(True), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS),
                Sample("mha-self-seq-first", lambda: SampleNet(_SelfAttention(False), 4),
                       (5, 4, 7, 6), SAMPLE_GRIDS),
                Sample("mha-rows", lambda: SampleNet(_RowQueries(), 4), (5, 4, 7, 6),
                       SAMPLE_GRIDS))


class _SelfAttention(nn.Module):
    """torchvision's ``EncoderBlock`` attention (``batch_first=True``) over a map's positions
    (made whole by the flatten under spatial; the embedding, split under the stationary
    options, made whole), back to a map; with ``batch_first=False`` over the map's rows (split
    under spatial: the self-attention gathers them), the tokens leading, the samples dim 1."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.norm = nn.LayerNorm(4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=batch_first)

    def forward(self, x: Any) -> Any:
        n, c, h, w = x.shape
        if self.batch_first:
            t = x.flatten(2).transpose(1, 2)  # [N, L, C]
            y = self.norm(t)
            y, _ = self.attn(y, y, y, need_weights=False)
            return (t + y).transpose(1, 2).reshape(n, c, h, w)
        t = self.norm(x.mean(3).transpose(1, 2)).transpose(0, 1)  # rows as tokens [H, N, C]
        y = self.attn(t, t, t, need_weights=False)[0]
        return x + y.permute(1, 2, 0)[..., None]


class _RowQueries(nn.Module):
    """A map's rows as tokens: queries that are a value of their own (kept split over their
    tokens under spatial), keys and values another with other embedding sizes (gathered), and
    the averaged and per-head attention weights taken from the tuple and used."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = nn.Linear(4, 6)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True, kdim=6, vdim=6)
        self.heads = nn.MultiheadAttention(4, 2, batch_first=True, bias=False)

    def forward(self, x: Any) -> Any:
        t = x.mean(3).transpose(1, 2)  # rows as tokens [N, H, C], split under spatial
        kv = torch.tanh(self.kv(t))
        out, weights = self.attn(t, kv, kv)  # weights [N, L, L]
        t = t + out * weights.amax(-1, keepdim=True)
        mixed, per_head = self.heads(t, x.amax(3).transpose(1, 2), t,
                                 average_attn_weights=False)  # [N, 2, L, L]
        t = mixed + per_head.sum(1).mean(-1, keepdim=True)
        return x + t.transpose(1, 2)[..., None]
