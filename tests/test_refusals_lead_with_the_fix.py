"""Refusals lead with the fix: an unsupported op's message says first what to write, names at
most ten alternatives (the nearest first) and points to docs/support.md for the rest; every
refusal of the op handlers, the analysis and the capture opens with what to do (an imperative
verb, read from the source), then the reason."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from distconv import ops
from distconv.parallel.explain import explain

SAMPLE = {"default": {"grid": {"N": 2}, "algorithm": "sample"}}


@pytest.mark.parametrize("op", ["call_module", "call_function", "call_method"])
def test_at_most_ten_forms_are_listed_and_the_page_named(op: str) -> None:
    text = ops.supported(op, "PixelShuffle")
    listed = text.split(", ... (")[0].split(", ")
    assert 1 <= len(listed) <= ops.MAX_LISTED, text
    assert "docs/support.md" in text
    assert len(ops.supported(op)) < 700  # the whole list once filled a 600-character line


class Maxed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).max(3)[0].mean(2))


def test_max_is_refused_pointing_to_amax_first() -> None:
    plan = explain(Maxed(), SAMPLE, (2, 3, 8, 8), strict=False)
    reasons = {n: r for n, _, r in plan.unsupported}
    why = reasons["max_1"].split("): ", 1)[1]
    assert why.startswith("write .amax() instead: tensor method .max() is not supported"), why
    assert ".amax()" in why.split("supported: ", 1)[1].split(",")[0]


def test_an_unknown_module_is_refused_saying_what_to_do_first() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.PixelShuffle(2))
    with pytest.raises(ops.Unsupported) as info:
        explain(model, SAMPLE, (2, 3, 8, 8))
    why = str(info.value).split("): ", 1)[1]
    assert why.startswith("compute it outside the model, or write an op handler"), why
    assert "PixelShuffle is not supported" in why and "docs/support.md" in why


# ---------------------------------------------------------------- every refusal's first word
#: the verbs a refusal may open with: each says what to do (the reason follows)
IMPERATIVES = frozenset("""
    add branch call check compute concatenate construct convert count cut expand gather give index
    keep leave move name pass permute pool put reduce repeat return rewrite roll slice split stack
    take unbind use write""".split())

#: refusals whose whole text is another function's, its first words checked by triggering it
#: (below): file, the message expression as ``ast.unparse`` writes it
FORWARDED = {
    ("ops/norm.py", "str(exc).split(': ', 1)[1]"),  # resolve_statistics's
}

ROOT = Path(__file__).resolve().parents[1] / "distconv"
#: the handlers' methods (and their helper) that say why a step cannot run on a shape
_REFUSE = ("refuse", "refuse_operands", "misplaced")


def _openings(node: ast.expr, names: dict[str, list[ast.expr]]) -> list[str | None]:
    """The literal words a message expression may open with: a string's own, or those of the
    values a leading local name is given in its function (None: it opens with another value)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        if isinstance(first, ast.Constant):
            return [str(first.value)]
        return _openings(first.value, names) if isinstance(first, ast.FormattedValue) else [None]
    if isinstance(node, ast.BinOp):
        return _openings(node.left, names)
    if isinstance(node, ast.IfExp):
        return _openings(node.body, names) + _openings(node.orelse, names)
    if isinstance(node, ast.Name) and names.get(node.id):
        return [o for v in names[node.id] for o in _openings(v, {})]
    return [None]


def _refusals() -> list[tuple[str, int, ast.expr, dict[str, list[ast.expr]]]]:
    """(file, line, message, its function's local assignments) of every refusal an op handler,
    the analysis or the capture raises: ``an.fail(node, message)``, ``Unsupported(message)``,
    the capture's raises, and the reasons a handler's ``refuse`` gives for an input shape."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(("ops/", "parallel/")):
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            names: dict[str, list[ast.expr]] = {}
            for a in ast.walk(fn):
                if isinstance(a, ast.Assign) and len(a.targets) == 1 and isinstance(
                        a.targets[0], ast.Name):
                    names.setdefault(a.targets[0].id, []).append(a.value)
            for call in ast.walk(fn):
                if (isinstance(call, ast.Return) and fn.name in _REFUSE
                        and _openings(call.value or ast.Constant(None), {}) != [None]):
                    found.append((rel, call.lineno, call.value, names))
                if not isinstance(call, ast.Call):
                    continue
                f = call.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name == "fail" and len(call.args) >= 2:
                    found.append((rel, call.lineno, call.args[1], names))
                elif name == "Unsupported" and call.args:
                    found.append((rel, call.lineno, call.args[0], names))
                elif (rel == "parallel/capture.py" and call.args
                      and name in ("UntraceableModelError", "TraceError", "TypeError",
                                   "ValueError")):
                    found.append((rel, call.lineno, call.args[0], names))
    # a call in a nested function is met from each enclosing one: its innermost (last) kept
    return sorted({(r, ln): (r, ln, m, n) for r, ln, m, n in found}.values(),
                  key=lambda t: (t[0], t[1]))


def test_every_refusal_opens_with_what_to_do() -> None:
    """Each refusal's first word is one of :data:`IMPERATIVES` (after "parallelize: "):
    listed by file:line where not, with the words it opens with."""
    refusals = _refusals()
    assert len(refusals) > 100  # the op handlers' refusals are all found
    offenders = []
    for rel, line, message, names in refusals:
        if (rel, ast.unparse(message)) in FORWARDED:
            continue
        for text in _openings(message, names):
            words = (text or "").removeprefix("parallelize: ").split()
            if not words or words[0].lower().strip("(") not in IMPERATIVES:
                shown = text if text is not None else "{" + ast.unparse(message) + "}"
                offenders.append(f"distconv/{rel}:{line}: {shown[:60]!r}")
    assert not offenders, (f"{len(offenders)} refusals do not open with what to do:\n"
                           + "\n".join(offenders))


def test_a_forwarded_refusal_opens_with_what_to_do() -> None:
    """The statistics refusal a BatchNorm module's handler forwards (:data:`FORWARDED`)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    config = {"default": {"grid": {"N": 4}, "algorithm": "sample", "statistics": 3}}
    with pytest.raises(ValueError) as info:
        explain(model, config, (8, 3, 8, 8), world_size=4)
    why = str(info.value).split("): ", 1)[1]
    assert why.startswith("give statistics a k that divides 4, 'local' or 'global': "), why
    assert "statistics 3 groups sample blocks" in why


def test_the_check_fails_where_a_refusal_opens_with_its_reason() -> None:
    """The scan reads a refusal that opens with its reason, or with a value, as an offender."""
    names: dict[str, list[ast.expr]] = {}
    for source, opens in (('an.fail(node, "give it as an int: got x")', True),
                          ('an.fail(node, f"it unbinds dim {d}; give the dim as an int")', False),
                          ('an.fail(node, f"{source} asks for pipeline")', False),
                          ('an.fail(node, str(exc))', False)):
        message = ast.parse(source).body[0].value.args[1]  # type: ignore[attr-defined]
        text = _openings(message, names)[0]
        assert (text is not None and text.split()[0] in IMPERATIVES) == opens, source
