"""``F.scaled_dot_product_attention(q, k, v)``, as timm's ``Attention`` calls it: queries
``q[..., L, E]``, keys ``k[..., S, E]``, values ``v[..., S, Ev]``, the result ``[..., L, Ev]``.

Each query row needs every key and value row, all of its head dim: the leading (batch-like) dims
-- the samples, the heads -- keep ``q``'s split and ``k``, ``v`` are converted to it (nothing
moves under sample or head splits); the queries' token dim ``L`` keeps its split (each rank
attends its rows); the keys' and values' token dim ``S`` and every head dim (``E``, ``Ev``) are
made whole (an allgather over the grid dims that split them, priced as the conversion it is:
each score sums over all of ``E`` and goes through the softmax before any sum over its blocks
could be completed), exact. ``is_causal=True`` masks by global positions: there ``L`` is made
whole too, as where the query is also the key or value. Refused by name: a tensor ``attn_mask``,
``dropout_p`` other than 0 (its draws are no one process's), ``enable_gqa``, and samples in the
token or head dim.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from distconv.distribution import Dist
from distconv.ops.base import SAMPLE_GRIDS, Handler, Sample, SampleNet
from distconv.ops.elementwise import is_constant
from distconv.ops.extents import captured_shape
from distconv.ops.mha import query_key_value
from distconv.parallel.placement import Placement
from distconv.parallel.steps import samples_of

__all__ = ["SdpaHandler"]

_WORKS = ("what works: any split of query, key and value (the samples' and heads' kept, the "
          "queries' tokens' kept, the rest gathered) with attn_mask=None and dropout_p=0")
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
             "enable_gqa": False}


def _arguments(node: fx.Node) -> dict[str, Any]:
    """The call's arguments by name (defaults filled in)."""
    named = dict(_DEFAULTS)
    named.update(zip(_NAMES, node.args))
    named.update(node.kwargs)
    return named


class SdpaHandler(Handler):
    functions = frozenset({F.scaled_dot_product_attention})
    samples_anywhere = True

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import Step

        named = _arguments(node)
        q, k, v = query_key_value(an, node, named)
        self._check_options(an, node, named)
        placed = [an.placement(t).settled() for t in (q, k, v)]
        if len({p.ndim for p in placed}) > 1 or placed[0].ndim < 3:
            an.fail(node, "give query, key and value one number of dims, at least 3 "
                    f"(batch-like dims, tokens, head dim): they have {[p.ndim for p in placed]} "
                    f"dims; {_WORKS}")
        qp = placed[0]  # k and v are converted to its layout
        home, nd = qp.layout, qp.ndim
        for t in (q, k, v):
            dim = samples_of(t)[0]
            if dim >= nd - 2:
                an.fail(node, f"keep the samples in a leading dim: {t.name!r} holds the samples "
                        f"in dim {dim}, its tokens or head dim, and attention pairs tokens within "
                        f"each sample; {_WORKS}")
        dims = {samples_of(t)[0] for t in (q, k, v) if not is_constant(t)}
        if len(dims) > 1:
            an.fail(node, "move the samples of query, key and value to one dim: they hold the "
                    f"samples in dims {sorted(dims)}, which would pair one sample's queries with "
                    f"another's keys; {_WORKS}")
        shapes = [captured_shape(t) for t in (q, k, v)]
        batch = tuple(e if _same(shapes, d) else None
                      for d, e in enumerate(qp.dist.entries[:nd - 2]))
        # causal masks by global positions; a query that is also the key needs its tokens whole
        rows = None if named["is_causal"] or q in (k, v) else qp.dist.entries[nd - 2]
        qn = Placement(home, Dist(batch + (rows, None)))
        kv = Placement(home, Dist(batch + (None, None)))
        out = Placement(home, Dist(batch + (rows, None)))
        needs = {q: qn, k: kv, v: kv}
        return Step(node, "contract", out, needs, samples=samples_of(q)[0])

    def refuse_operands(self, step: Any, shapes: dict[str, tuple[int, ...]]) -> str | None:
        """A split batch-like dim whose sizes differ between query, key and value on these
        shapes (torch would broadcast a 1 against the others' blocks)."""
        for a, need in step.needs.items():
            for b in step.needs:
                if a.name not in shapes or b.name not in shapes:
                    continue
                for d, e in enumerate(need.dist.entries[:-2]):
                    if e is not None and shapes[a.name][d] != shapes[b.name][d]:
                        return ("pass input_shape= this shape to parallelize: dim "
                                f"{d} of {a.name!r} and {b.name!r} has sizes "
                                f"{shapes[a.name][d]} and {shapes[b.name][d]} (torch broadcasts "
                                "them) but is split as placed for the input shape the model was "
                                "captured on")
        return None

    @staticmethod
    def _check_options(an: Any, node: Any, named: dict[str, Any]) -> None:
        if named["attn_mask"] is not None:
            an.fail(node, "pass attn_mask=None, or write the attention out, (q @ "
                    "k.transpose(-2, -1) * scale + mask).softmax(-1) @ v, each op of which runs "
                    "distributed: a tensor attn_mask is not supported (its blocks would have to "
                    f"follow the queries' and keys' splits); {_WORKS}")
        p = named["dropout_p"]
        if isinstance(p, fx.Node) or p != 0:
            an.fail(node, "use dropout_p=0 (timm passes 0 in eval) or an explicit nn.Dropout on "
                    f"the attention weights: with dropout_p={p!r}, its draws inside the fused "
                    f"call are no one process's; {_WORKS}")
        for name in ("is_causal", "enable_gqa", "scale"):
            if isinstance(named[name], fx.Node):
                an.fail(node, f"give {name} as a constant: it is a value of the graph", TypeError)
        if named["enable_gqa"]:
            an.fail(node, "repeat the keys' heads explicitly (repeat_interleave) instead: "
                    f"enable_gqa=True broadcasts them; {_WORKS}")

    def samples(self) -> Sequence[Sample]:
        return (Sample("sdpa-heads", lambda: SampleNet(_Sdpa(), 4), (5, 4, 8, 6),
                       SAMPLE_GRIDS),
                Sample("sdpa-rows", lambda: SampleNet(_RowAttention(), 4), (5, 4, 8, 6),
                       SAMPLE_GRIDS))


def _same(shapes: list[tuple[int, ...] | None], d: int) -> bool:
    """Whether dim ``d`` has one size in every operand (as far as the capture shows); torch
    broadcasts a 1 against the others, which a split would break."""
    sizes = {s[d] for s in shapes if s is not None}
    return len(sizes) <= 1


class _Sdpa(nn.Module):
    """timm's ``Attention`` over a map's positions (tokens split under spatial, channels under
    the stationary options), back to a map; causal and scaled forms too."""

    def __init__(self, dim: int = 4, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Any) -> Any:
        n, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)  # [N, L, C]
        qkv = self.qkv(t).reshape(n, h * w, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0)
        o = o + F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True, scale=0.3)
        o = self.proj(o.transpose(1, 2).reshape(n, h * w, c))
        return o.transpose(1, 2).reshape(n, c, h, w) + x


class _RowAttention(nn.Module):
    """Attention between a map's rows (split under spatial: the queries keep them, the keys and
    values are gathered), each column a batch-like dim, the channels the head dim (split under
    the stationary options: gathered)."""

    def __init__(self) -> None:
        super().__init__()
        self.key, self.value = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)

    def forward(self, x: Any) -> Any:
        q, k, v = (t.permute(0, 3, 2, 1) for t in (x, self.key(x), self.value(x)))  # [N,W,H,C]
        return x + F.scaled_dot_product_attention(q, k, v, scale=0.5).permute(0, 3, 2, 1)
