"""Exceptions raised by communicators.

Every failure of a collective surfaces as a :class:`CommError`; a collective that cannot complete
within the communicator's timeout raises :class:`CommTimeoutError` (also a ``TimeoutError``), and a
collective whose participants called different things raises :class:`CollectiveMismatchError`.
"""

from __future__ import annotations

__all__ = ["CollectiveMismatchError", "CommError", "CommTimeoutError"]


class CommError(RuntimeError):
    """A collective or point-to-point operation failed (a peer died, the library failed)."""


class CommTimeoutError(CommError, TimeoutError):
    """An operation did not complete within the communicator's timeout.

    The message names the rank, the backend and the operation.
    """


class CollectiveMismatchError(CommError):
    """The ranks of a communicator entered different collectives (op, meta, dtype or shapes).

    The message lists what each rank called.
    """
