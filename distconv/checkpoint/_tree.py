"""Nested state (dicts, lists, tuples, tensors, plain values) <-> a JSON tree plus flat tensors.

Every node of the JSON tree is tagged with what it was, so it comes back exactly as it went in
(tuples stay tuples, int keys stay ints)::

    {"tensor": "state/0.weight/exp_avg"}      a tensor, stored under that flat key
    {"dict": [[key, node], ...]}             keys are str or int
    {"list": [node, ...]}    {"tuple": [node, ...]}
    {"value": v}                             None, bool, int, float (NaN and ±inf too) or str
    {"dtype": "float32"}                     a torch.dtype (settings such as a factor dtype)

A tensor's flat key is its path of keys joined by ``/`` (``%`` and ``/`` inside a key are written
``%25`` and ``%2F``), so ``{"factors": {"conv1": {"A": t}}}`` stores ``t`` as ``factors/conv1/A``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["flat_key", "flatten", "tensor_keys", "unflatten"]

_SCALARS = (type(None), bool, int, float, str)


def flat_key(path: tuple[str | int, ...]) -> str:
    """The flat key of the tensor at ``path``."""
    return "/".join(str(p).replace("%", "%25").replace("/", "%2F") for p in path)


def flatten(
    state: Any, *, where: str, under: str | int | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(json_tree, {flat_key: tensor})`` of ``state``; ``where`` names it in errors (with the
    paths inside ``state``). With ``under``, the flat keys are those of ``state`` stored as the
    entry ``under`` of a larger tree (``f"{under}/{key}"``)."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, (), tensors, where)
    if under is None:
        return tree, tensors
    top = flat_key((under,))
    return _moved(tree, top), {f"{top}/{k}" if k else top: t for k, t in tensors.items()}


def _moved(node: Any, top: str) -> Any:
    """``node`` with every tensor key put under ``top``."""
    (tag, body), = node.items()
    if tag == "tensor":
        return {"tensor": f"{top}/{body}" if body else top}
    if tag == "dict":
        return {"dict": [[k, _moved(v, top)] for k, v in body]}
    if tag in ("list", "tuple"):
        return {tag: [_moved(v, top) for v in body]}
    return node


def _encode(obj: Any, path: tuple[str | int, ...], out: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        key = flat_key(path)
        if key in out:
            raise ValueError(f"{where}: two entries share the flat key {key!r}")
        out[key] = obj
        return {"tensor": key}
    if isinstance(obj, Mapping):
        items = []
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise TypeError(
                    f"{where}: key {k!r} at {flat_key(path) or '(top)'!r} must be a str or int "
                    "to be checkpointed"
                )
            items.append([k, _encode(v, (*path, k), out, where)])
        return {"dict": items}
    if isinstance(obj, (list, tuple)):
        tag = "tuple" if isinstance(obj, tuple) else "list"
        return {tag: [_encode(v, (*path, i), out, where) for i, v in enumerate(obj)]}
    if isinstance(obj, _SCALARS):
        return {"value": obj}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).removeprefix("torch.")}
    raise TypeError(
        f"{where}: {flat_key(path) or '(top)'!r} is a {type(obj).__name__}; a checkpoint holds "
        "tensors, dicts, lists, tuples, None, bool, int, float, str and torch dtypes (never "
        "pickles)"
    )


def tensor_keys(tree: Any) -> list[str]:
    """The flat keys of every tensor in ``tree``, in order."""
    keys: list[str] = []
    _walk(tree, lambda key: keys.append(key) or None)
    return keys


def unflatten(tree: Any, tensor: Callable[[str], torch.Tensor]) -> Any:
    """Rebuild the state of ``tree``, taking each tensor from ``tensor(flat_key)``."""
    return _walk(tree, tensor)


def _walk(node: Any, tensor: Callable[[str], Any]) -> Any:
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError(f"checkpoint index: malformed state node {node!r}")
    (tag, body), = node.items()
    if tag == "tensor" and isinstance(body, str):
        return tensor(body)
    if tag == "value" and isinstance(body, _SCALARS):
        return body
    if tag == "dict" and isinstance(body, list):
        return {_key(pair): _walk(pair[1], tensor) for pair in body}
    if tag == "dtype" and isinstance(getattr(torch, str(body), None), torch.dtype):
        return getattr(torch, body)
    if tag in ("list", "tuple") and isinstance(body, list):
        items = [_walk(v, tensor) for v in body]
        return tuple(items) if tag == "tuple" else items
    raise ValueError(f"checkpoint index: malformed state node {node!r}")


def _key(pair: Any) -> str | int:
    if (not isinstance(pair, list) or len(pair) != 2 or isinstance(pair[0], bool)
            or not isinstance(pair[0], (str, int))):
        raise ValueError(f"checkpoint index: malformed dict item {pair!r}")
    return pair[0]
