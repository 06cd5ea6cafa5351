"""The API reference renders the docstrings' Sphinx roles as cross-references: the griffe
extension mkdocs.yml names leaves no role as text, links what the reference documents, and
shows the rest (torch's objects) as code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe", reason="the docs extra (mkdocstrings) is not installed")

ROOT = Path(__file__).resolve().parent.parent
EXTENSION = ROOT / "docs" / "hooks" / "sphinx_roles.py"
ROLE = re.compile(r":(?:mod|class|func|meth|data|attr|exc|obj):`")


def _objects(obj):  # noqa: ANN001, ANN202 - griffe objects
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)


def test_mkdocs_loads_the_extension() -> None:
    assert "docs/hooks/sphinx_roles.py:SphinxRoles" in (ROOT / "mkdocs.yml").read_text()


def test_no_docstring_keeps_a_role_and_references_resolve() -> None:
    extensions = griffe.load_extensions(f"{EXTENSION}:SphinxRoles")
    package = griffe.load("distconv.parallel", search_paths=[str(ROOT)], extensions=extensions)
    docs = {o.path: o.docstring.value for o in _objects(package) if o.docstring}
    left = {p: ROLE.findall(d) for p, d in docs.items() if ROLE.search(d)}
    assert not left, left
    model = docs["distconv.parallel.model.ParallelModel"]
    # ":class:`~distconv.parallel.config.ParallelConfig`": a link titled by the last name
    assert ('<autoref identifier="distconv.parallel.config.ParallelConfig" optional>'
            "<code>ParallelConfig</code></autoref>") in model
    # a relative ":meth:`load_state_dict`" resolves in its class
    assert 'identifier="distconv.parallel.model.ParallelModel.load_state_dict"' in \
        docs["distconv.parallel.model.ParallelModel.state_dict"]
