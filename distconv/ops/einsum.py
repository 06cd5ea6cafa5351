"""Contractions: ``torch.einsum`` and ``matmul`` (``@``, ``torch.matmul``, ``torch.bmm``, the
methods), as attention writes ``q kᵀ`` and ``softmax(·) v``.

Every dim is a letter of the equation. A split is exact when each grid dim splits at most one
letter, the same way in every operand that has the letter, and operands without the letter are
whole over it: a letter kept in the output (a batch dim of both operands, or a free dim of one)
keeps the split, each rank computing its block; a contracted letter split over ``G`` leaves
each rank a partial sum over its block, the output pending ``Σ_G`` (completed where a consumer
needs it, as a stationary-x layer's is). So the rule: letters take, in turn -- the samples', the
others of the output, then the contracted ones -- the split one of their operands has (the
first), unless a letter before took its grid dims; the letter is whole otherwise. Each operand
is converted to that: a whole operand slices (no communication), a differently split one is
gathered (an allgather, priced as the conversion it is). Under sample or head splits attention
moves nothing; with the tokens split over space, ``q kᵀ`` keeps the queries' split and gathers
the keys, ``softmax(·) v`` gathers the values: exact, its price stated by ``explain``.

torch broadcasts a letter of size 1 against a larger one (as ``matmul`` broadcasts batch dims):
such a letter, where the captured shapes show one, is whole; on any input shape where a split
letter's sizes differ between operands the step is refused by name before it runs.
"""

from __future__ import annotations

import operator
import string
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from distconv.distribution import Dist, Entry
from distconv.ops.base import SAMPLE_GRIDS, Handler, Sample, SampleNet
from distconv.ops.elementwise import is_constant
from distconv.ops.extents import captured_shape
from distconv.parallel.placement import Placement, on_layout
from distconv.parallel.steps import samples_of

__all__ = ["EinsumHandler", "equation"]

_MATMUL = frozenset({torch.matmul, operator.matmul, torch.bmm, "matmul", "bmm"})


def _fresh(used: str) -> Any:
    return iter(c for c in string.ascii_letters if c not in used)


def equation(eq: str, ndims: Sequence[int]) -> tuple[list[str], str]:
    """``eq`` with every ``...`` written out in fresh letters for operands of ``ndims`` dims
    (aligned to the right, as torch broadcasts them): each operand's letters and the output's.
    Raises ``ValueError`` where the equation does not fit the operands."""
    eq = eq.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        raise ValueError(f"{len(terms)} operand terms for {len(ndims)} operands")
    spans = [n - (len(t) - 3) for t, n in zip(terms, ndims) if "..." in t]
    fresh = _fresh(eq)
    ell = "".join(next(fresh) for _ in range(max(spans, default=0)))
    out_terms = []
    for t, n in zip(terms, ndims):
        if "..." in t:
            k = n - (len(t) - 3)
            t = t.replace("...", ell[len(ell) - k:])
        if len(t) != n or not t.isalpha():
            raise ValueError(f"term {t!r} does not fit an operand of {n} dims")
        out_terms.append(t)
    if arrow:
        out = rhs.replace("...", ell)
    else:  # implicit: the ellipsis, then the letters written once, in torch's (ASCII) order
        letters = "".join(out_terms)
        out = ell + "".join(sorted(c for c in set(letters) if letters.count(c) == 1
                                   and c not in ell))
    return out_terms, out


def _matmul_equation(na: int, nb: int) -> str:
    """``a @ b`` as an einsum equation."""
    if na < 1 or nb < 1:
        raise ValueError("matmul of a 0-d operand")
    batch = "".join(c for c in string.ascii_uppercase[:max(na, nb) - 2])
    a = batch[len(batch) - (na - 2):] + "ij" if na > 1 else "j"
    b = batch[len(batch) - (nb - 2):] + "jk" if nb > 1 else "j"
    out = batch + ("i" if na > 1 else "") + ("k" if nb > 1 else "")
    return f"{a},{b}->{out}"


def letters_of(node: fx.Node, eq: str | None, ndims: Sequence[int]) -> tuple[list[str], str]:
    """Each operand's letters and the output's, of an einsum (``eq``) or a matmul (None)."""
    if eq is None:
        eq = _matmul_equation(*ndims)
    return equation(eq, ndims)


def operands(node: fx.Node) -> tuple[str | None, list[Any]]:
    """The einsum equation (None for matmul) and the operands, in any call form."""
    if node.target is torch.einsum:
        rest = list(node.args[1:])
        if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
            rest = list(rest[0])
        return node.args[0], rest
    return None, list(node.args[:2])


class EinsumHandler(Handler):
    functions = frozenset({torch.einsum, torch.matmul, operator.matmul, torch.bmm})
    methods = frozenset({"matmul", "bmm"})
    samples_anywhere = True

    def place(self, an: Any, node: Any, module: Any) -> Any:
        from distconv.parallel.steps import Step

        eq, args = operands(node)
        if not isinstance(eq, (str, type(None))) or not all(isinstance(a, fx.Node) for a in args):
            an.fail(node, "give it an equation string and tensors of the graph as operands: "
                    "the sublist form, or an operand that is no tensor, is not supported",
                    TypeError)
        placed = [an.placement(a).settled() for a in args]
        ndims = [p.ndim for p in placed]
        try:
            terms, out = letters_of(node, eq, ndims)
        except ValueError as exc:
            an.fail(node, f"give an equation that fits the operands' dims {ndims}: {eq!r}: "
                    f"{exc}", ValueError)
        values = [i for i, a in enumerate(args) if not is_constant(a)]
        home = placed[values[0] if values else 0].layout
        on = [p if p.layout == home else on_layout(p, home) for p in placed]
        samples = self._samples_letter(an, node, args, terms, values, out)
        entry = _agreeing(args, terms, self._letters(args, terms, on, out, samples))
        needs = {a: Placement(home, Dist(tuple(entry[c] for c in t)))
                 for a, t in zip(args, terms)}
        pending = frozenset(g for c, e in entry.items() if c not in out
                            for g in _names(e))
        value = Placement(home, Dist(tuple(entry[c] for c in out), pending))
        return Step(node, "contract", value, needs,
                    samples=out.index(samples) if samples else 0)

    @staticmethod
    def _samples_letter(an: Any, node: Any, args: list[Any], terms: list[str],
                        values: list[int], out: str) -> str | None:
        """The letter of the samples (the same in every operand that is an activation)."""
        letters = {terms[i][samples_of(args[i])[0]] for i in values}
        if len(letters) > 1:
            an.fail(node, "give the operands' samples one letter: they hold the samples under "
                    f"different letters {sorted(letters)}, which would pair one sample with "
                    "another")
        letter = letters.pop() if letters else None
        if letter is not None and letter not in out:
            an.fail(node, f"keep the samples' letter {letter!r} in the result, and sum over "
                    f"the samples in the loss: it sums over the samples (letter {letter!r}), and "
                    "the parallel model's output rows are its samples")
        return letter

    @staticmethod
    def _letters(args: list[Any], terms: list[str], on: list[Placement | None],
                 out: str, samples: str | None) -> dict[str, Entry]:
        """Each letter's split (see the module docstring)."""
        letters = list(dict.fromkeys("".join(terms)))
        order = sorted(letters, key=lambda c: (c != samples, c not in out))
        shapes = [captured_shape(a) for a in args]
        taken: set[str] = set()
        entry: dict[str, Entry] = {}
        for c in order:
            held = [(p.dist.entries[t.index(c)], shapes[i][t.index(c)] if shapes[i] else None)
                    for i, (p, t) in enumerate(zip(on, terms)) if p is not None and c in t]
            sizes = {n for _, n in held}
            same = None in sizes or len(sizes) == 1  # (as far as the capture shows)
            split = [e for e, _ in held if e is not None]
            diagonal = any(t.count(c) > 1 for t in terms)  # ("ii->i"): whole
            pick = split[0] if split and same and not diagonal else None
            if pick is not None and taken.isdisjoint(_names(pick)):
                entry[c] = pick
                taken.update(_names(pick))
            else:
                entry[c] = None
        return entry

    def refuse_operands(self, step: Any, shapes: dict[str, tuple[int, ...]]) -> str | None:
        """A split letter whose sizes differ between operands on these shapes (torch would
        broadcast a size 1 against the others' blocks)."""
        node = step.node
        eq, args = operands(node)
        if any(a.name not in shapes for a in args):
            return None
        terms, _ = letters_of(node, eq, [len(shapes[a.name]) for a in args])
        for c in set("".join(terms)):
            held = [(step.needs[a].dist.entries[t.index(c)], shapes[a.name][t.index(c)])
                    for a, t in zip(args, terms) if c in t]
            sizes = sorted({n for _, n in held})
            if len(sizes) > 1 and any(e is not None for e, _ in held):
                return (f"pass input_shape= this shape to parallelize: letter {c!r} of "
                        f"{eq or 'the matmul'!r} has sizes {sizes} (torch broadcasts them) but "
                        "is split as placed for the input shape the model was captured on")
        return None

    def samples(self) -> Sequence[Sample]:
        return (Sample("attention-einsum", lambda: SampleNet(_Attention(False), 4),
                       (5, 4, 8, 6), SAMPLE_GRIDS),
                Sample("attention-matmul", lambda: SampleNet(_Attention(True), 4),
                       (5, 4, 8, 6), SAMPLE_GRIDS))


def _agreeing(args: list[Any], terms: list[str], entry: dict[str, Entry]) -> dict[str, Entry]:
    """``entry`` with the letters whole where one value is several operands and its terms
    would split it differently (``einsum("nci,ncj->nij", a, a)`` with ``i`` split): a value
    is converted once per node, so its occurrences must ask for the same blocks."""
    while True:
        changed = False
        for a in set(args):
            mine = [t for b, t in zip(args, terms) if b is a]
            for dims in zip(*mine):
                if len({entry[c] for c in dims}) > 1:
                    changed = True
                    entry.update({c: None for c in dims})
        if not changed:
            return entry


def _names(e: Entry) -> tuple[str, ...]:
    return () if e is None else (e,) if isinstance(e, str) else tuple(e)


class _Attention(nn.Module):
    """Self-attention over a map's positions, as MONAI's ``SABlock`` writes it (einsum, the
    heads' query, key and value taken from one permuted projection) or as timm's ``Attention``
    does (``q @ k.transpose(-2, -1)``, ``@ v``), back to a map."""

    def __init__(self, matmul: bool, dim: int = 4, heads: int = 2) -> None:
        super().__init__()
        self.matmul, self.heads = matmul, heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Any) -> Any:
        n, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)  # [N, L, C]
        qkv = self.qkv(t).reshape(n, h * w, 3, self.heads, c // self.heads)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # [3, N, heads, L, d]: the samples in dim 1
        q, k, v = qkv[0], qkv[1], qkv[2]
        if self.matmul:
            a = (q @ k.transpose(-2, -1) * 0.5).softmax(dim=-1)
            o = torch.matmul(a, v)
        else:
            a = (torch.einsum("blxd,blyd->blxy", q, k) * 0.5).softmax(dim=-1)
            o = torch.einsum("bhxy,bhyd->bhxd", a, v)
        o = self.proj(o.permute(0, 2, 1, 3).reshape(n, h * w, c))
        return o.transpose(1, 2).reshape(n, c, h, w) + x
