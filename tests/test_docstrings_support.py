"""Every docstring agrees with docs/support.md: no ``Raises:`` section names as refused an op
the support page lists as running on every distribution (where the page says so in one bullet,
the check is mechanical: the op's name in a docstring's ``Raises:`` section)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import distconv
import distkfac

ROOT = Path(__file__).resolve().parent.parent


def _bullets(text: str) -> list[str]:
    """The page's bullets, each with its continuation lines."""
    out: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.startswith("- "):
            out.append(line[2:])
            inside = True
        elif inside and line.startswith("  "):
            out[-1] += " " + line.strip()
        else:
            inside = False
    return out


def runs_everywhere() -> set[str]:
    """Names of the ops a bullet of docs/support.md says run on every distribution (its
    backticked and CamelCase names; ``Dropout1d/2d/3d`` counts as ``Dropout``)."""
    names: set[str] = set()
    for bullet in _bullets((ROOT / "docs" / "support.md").read_text()):
        if "on every distribution" not in bullet.lower():
            continue
        head = bullet.lower().split("on every distribution")[0] + " " + bullet
        for word in re.findall(r"`([A-Za-z_.]+)", head) + re.findall(
                r"\b[A-Z][a-z]+(?:[A-Z][a-z]+)+\b", bullet):
            word = word.rsplit(".", 1)[-1]
            if re.fullmatch(r"[A-Z][A-Za-z]+", word):
                names.add(word)
    return names


def raises_sections() -> dict[str, str]:
    """Every public docstring's ``Raises:`` section in distconv and distkfac, by qualified name."""
    found: dict[str, str] = {}
    for package in (distconv, distkfac):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if any(part.startswith("_") for part in info.name.split(".")):
                continue
            try:
                module = importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - an optional dependency missing: not our text
                continue
            objects = [(info.name, module)]
            for name, obj in vars(module).items():
                if name.startswith("_") or getattr(obj, "__module__", None) != info.name:
                    continue
                objects.append((f"{info.name}.{name}", obj))
                if inspect.isclass(obj):
                    objects += [(f"{info.name}.{name}.{m}", f) for m, f in vars(obj).items()
                                if not m.startswith("_") and callable(f)]
            for qual, obj in objects:
                doc = inspect.getdoc(obj) or ""
                part = doc.split("Raises:", 1)
                if len(part) == 2:
                    found[qual] = part[1].split("\n\n")[0]
    return found


def test_the_support_page_lists_ops_that_run_everywhere() -> None:
    assert {"Dropout", "DropPath", "GroupNorm"} <= runs_everywhere()


def test_no_docstring_names_as_refused_what_the_support_page_runs_everywhere() -> None:
    names = runs_everywhere()
    wrong = {qual: sorted(n for n in names if re.search(rf"\b{n}\b", text, re.I))
             for qual, text in raises_sections().items()}
    wrong = {q: n for q, n in wrong.items() if n}
    assert not wrong, f"docstrings whose Raises name ops docs/support.md runs: {wrong}"
