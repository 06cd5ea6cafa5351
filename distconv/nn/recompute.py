"""Activation checkpointing: layers with state run their forward a second time in backward, and
must not advance that state twice (BatchNorm's running statistics, ``num_batches_tracked``), nor
draw other random numbers than the first time (dropout's masks from the generator the ranks
share, which torch's checkpoint does not restore as it restores its own generators).

:func:`recomputing` is the context a checkpoint's recomputation runs under
(``torch.utils.checkpoint.checkpoint(..., context_fn=recompute_context)``); layers ask
:func:`is_recomputing`, and draw from :func:`replayed`. The state is per thread: the
recomputation runs on the thread that runs that part of backward, and so do the layers it calls.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

__all__ = ["is_recomputing", "recompute_context", "recomputing", "replayed"]

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


@contextlib.contextmanager
def _recording(draws: list[torch.Tensor]) -> Iterator[None]:
    stack = _STATE.__dict__.setdefault("recording", [])
    stack.append(draws)
    try:
        yield
    finally:
        stack.pop()


@contextlib.contextmanager
def _replaying(draws: list[torch.Tensor]) -> Iterator[None]:
    stack = _STATE.__dict__.setdefault("replaying", [])
    stack.append(draws)
    try:
        with recomputing():
            yield
    finally:
        stack.pop()


def replayed(generator: torch.Generator) -> torch.Generator:
    """The generator a layer draws its random numbers from: ``generator`` itself, its state
    recorded where a checkpointed forward runs; in that forward's recomputation, a copy in the
    state recorded for the same draw (``generator`` is not advanced again)."""
    replaying = getattr(_STATE, "replaying", None)
    if replaying and is_recomputing():
        copy = torch.Generator(device=generator.device)
        copy.set_state(replaying[-1].pop(0))
        return copy
    recording = getattr(_STATE, "recording", None)
    if recording:
        recording[-1].append(generator.get_state())
    return generator


def recompute_context() -> tuple[contextlib.AbstractContextManager,
                                 contextlib.AbstractContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: around the first forward, the
    recording of the shared generators' states before each draw (:func:`replayed`); around the
    recomputation, :func:`recomputing` and the replay of those draws, in order."""
    draws: list[torch.Tensor] = []
    return _recording(draws), _replaying(draws)
