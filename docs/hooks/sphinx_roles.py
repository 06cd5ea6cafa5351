"""A griffe extension for the API reference: the docstrings' Sphinx roles (``:class:`~a.B```,
``:func:`f```, ``:mod:``, ``:meth:``, ``:attr:``, ``:data:``, ``:exc:``, ``:obj:``) become
cross-references that mkdocs-autorefs resolves to the rendered object, or, for an object the
reference does not render (torch's, a private helper), its name in code, without a warning.

Relative names resolve as Sphinx resolves them: a method or attribute of the documented class,
then a name of its module, then a name of its package."""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:mod|class|func|meth|data|attr|exc|obj):`(?P<tilde>~)?(?P<name>[^`<>]+)`")


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring's roles into optional autorefs, once the tree is loaded."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader,
                  **kwargs: Any) -> None:
        _rewrite(obj, loader)

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader,
                   **kwargs: Any) -> None:
        _rewrite(pkg, loader)  # a package's own docstring (its members have on_object)


def _rewrite(obj: griffe.Object, loader: griffe.GriffeLoader) -> None:
    if obj.docstring is None or ":`" not in obj.docstring.value:
        return
    obj.docstring.value = _ROLE.sub(lambda m: _link(m, obj, loader), obj.docstring.value)


def _exists(path: str, loader: griffe.GriffeLoader) -> bool:
    try:
        loader.modules_collection[path]
    except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return False
    return True


def _candidates(name: str, obj: griffe.Object) -> list[str]:
    name = name.lstrip(".")
    scopes = []
    scope: Any = obj
    while scope is not None:
        if scope.is_class or scope.is_module:
            scopes.append(scope.path)
        scope = scope.parent
    return [name] + [f"{s}.{name}" for s in scopes]


def _link(m: re.Match[str], obj: griffe.Object, loader: griffe.GriffeLoader) -> str:
    name = m["name"].strip()
    found = next((c for c in _candidates(name, obj) if _exists(c, loader)), None)
    title = name.rsplit(".", 1)[-1] if m["tilde"] else name
    code = f"<code>{html.escape(title)}</code>"
    if found is None:
        return code
    return f'<autoref identifier="{html.escape(found)}" optional>{code}</autoref>'
