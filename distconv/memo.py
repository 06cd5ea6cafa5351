"""A bounded memo that thread ranks may share.

A few pure functions of layouts (a checkpoint's write plan, a block's local shape) are remembered
at module level, so one process's ranks share them when they run as threads
(:mod:`distconv.comm.threads`). A plain dict evicted with ``pop(next(iter(d)))`` is not safe
there: two ranks past the bound pick the same oldest key and the second ``pop`` raises, or one
iterates while another inserts. :class:`BoundedMemo` reads without a lock (a value, once stored,
never changes) and evicts under one.
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, Hashable, TypeVar

__all__ = ["BoundedMemo"]

V = TypeVar("V")
_MISSING = object()


class BoundedMemo(Generic[V]):
    """At most ``bound`` remembered values of a pure function, the oldest evicted first.

    ``get(key, make)`` returns the value remembered for ``key``, or ``make()``'s, remembered.
    Ranks that miss the same key at once may both call ``make`` (it is pure: either result is
    the value); none ever sees another's eviction fail.
    """

    def __init__(self, bound: int) -> None:
        if not isinstance(bound, int) or isinstance(bound, bool) or bound < 1:
            raise ValueError(f"bound must be a positive int, got {bound!r}")
        self._bound = bound
        self._items: dict[Hashable, V] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        found = self._items.get(key, _MISSING)
        if found is not _MISSING:
            return found  # type: ignore[return-value]
        value = make()
        with self._lock:
            while len(self._items) >= self._bound:
                del self._items[next(iter(self._items))]
            return self._items.setdefault(key, value)

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __repr__(self) -> str:
        return f"BoundedMemo(bound={self._bound}, held={len(self._items)})"
