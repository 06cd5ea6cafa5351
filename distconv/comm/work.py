"""Handles of asynchronous operations and the waits on them: :class:`Work`, the timeouts waits
honour (:func:`check_timeout`), and waits run eagerly under ``torch.compile`` (:func:`eager`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Work", "check_timeout", "compiling", "eager"]


def check_timeout(value: Any, name: str = "timeout", *, allow_none: bool = False) -> float | None:
    """``value`` as a positive, finite number of seconds, else TypeError/ValueError naming it."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        allowed = "None or " if allow_none else ""
        raise TypeError(
            f"{name} must be {allowed}a positive number of seconds, got {value!r} "
            f"({type(value).__name__})"
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return float(value)


_IS_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", None)


def compiling() -> bool:
    """Whether ``torch.compile`` is tracing the calling code."""
    return _IS_COMPILING is not None and bool(_IS_COMPILING())


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run eagerly under ``torch.compile``, as a graph break: communicators talk to
    process groups, MPI and threads that dynamo cannot trace. Costs one check otherwise."""
    import functools

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if compiling():
            return torch.compiler.disable(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


_UNSET: Any = object()


class Work:
    """Handle of an asynchronous operation; :meth:`wait` returns its result (idempotent)."""

    def __init__(
        self,
        wait_fn: Callable[[], Any] | None = None,
        *,
        test_fn: Callable[[], bool] | None = None,
        result: Any = _UNSET,
        keep: Any = None,
    ) -> None:
        self._wait_fn = wait_fn
        self._test_fn = test_fn
        self._result = result
        self._error: BaseException | None = None
        #: what must outlive the operation (its buffers), released once it has completed
        self._keep = keep

    @classmethod
    def completed(cls, result: Any) -> Work:
        return cls(result=result)

    @eager
    def wait(self) -> Any:
        if self._error is not None:
            raise self._error
        if self._result is _UNSET:
            assert self._wait_fn is not None
            try:
                self._result = self._wait_fn()
            except BaseException as exc:
                self._error = exc
                raise
            self._wait_fn = self._keep = None
        return self._result

    def is_completed(self) -> bool:
        if self._result is not _UNSET or self._error is not None:
            return True
        return bool(self._test_fn()) if self._test_fn is not None else False

    def __repr__(self) -> str:
        return f"Work(completed={self.is_completed()})"
