"""Choosing and re-raising the exception of a multi-rank run."""

from __future__ import annotations

from collections.abc import Sequence

from distconv.comm.errors import CollectiveMismatchError, CommError, CommTimeoutError

__all__ = ["RemoteError", "RemoteTraceback", "pick_error", "with_rank"]


class RemoteTraceback(Exception):
    """Carries the traceback text of an exception raised in another process."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n\n" + self.text


class RemoteError(CommError):
    """A worker raised an exception that could not be sent back as itself."""


def _severity(exc: BaseException) -> int:
    # the root cause first: an error in user code makes its peers fail in collectives
    if not isinstance(exc, CommError):
        return 0
    if isinstance(exc, CollectiveMismatchError):
        return 1
    if not isinstance(exc, CommTimeoutError):
        return 2
    return 3


def pick_error(errors: Sequence[BaseException | None]) -> int | None:
    """The rank whose exception to report: the lowest rank among the most telling errors."""
    ranked = [(_severity(e), r) for r, e in enumerate(errors) if e is not None]
    return min(ranked)[1] if ranked else None


def with_rank(exc: BaseException, rank: int, where: str) -> BaseException:
    """The same kind of exception, its message prefixed with the rank that raised it.

    Falls back to the original object with a note when its type cannot be rebuilt from a message.
    """
    label = f"[rank {rank} of {where}]"
    if len(exc.args) <= 1 and type(exc).__str__ in (BaseException.__str__, Exception.__str__):
        text = str(exc)
        if not text.startswith(label):
            try:
                new = type(exc)(f"{label} {text}" if text else label)
            except Exception:
                new = None
            if new is not None and type(new) is type(exc):
                new.__dict__.update(exc.__dict__)
                return new
    exc.add_note(f"raised on rank {rank} of {where}")
    return exc
