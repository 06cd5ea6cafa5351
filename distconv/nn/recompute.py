"""Activation checkpointing: layers with state run their forward a second time in backward, and
must not advance that state twice (BatchNorm's running statistics, ``num_batches_tracked``).

:func:`recomputing` is the context a checkpoint's recomputation runs under
(``torch.utils.checkpoint.checkpoint(..., context_fn=recompute_context)``); layers ask
:func:`is_recomputing`. The flag is per thread: the recomputation runs on the thread that runs
that part of backward, and so do the layers it calls.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

__all__ = ["is_recomputing", "recompute_context", "recomputing"]

_STATE = threading.local()


def is_recomputing() -> bool:
    """Whether the current forward is a checkpoint's recomputation in backward."""
    return getattr(_STATE, "depth", 0) > 0


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1


def recompute_context() -> tuple[contextlib.AbstractContextManager,
                                 contextlib.AbstractContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: nothing around the first forward,
    :func:`recomputing` around the recomputation."""
    return contextlib.nullcontext(), recomputing()
