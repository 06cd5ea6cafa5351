"""Debug mode: whether every collective first checks that all ranks of its communicator enter
the same one (:func:`set_debug`, ``DISTCONV_DEBUG=1``)."""

from __future__ import annotations

import os

__all__ = ["get_debug", "set_debug"]

_debug = os.environ.get("DISTCONV_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


def set_debug(flag: bool) -> None:
    """Turn the collective agreement check on or off for every communicator of this process.

    In debug mode every collective first exchanges a digest of (op, meta, dtype, shapes) among
    the ranks of its communicator and raises :class:`CollectiveMismatchError` on every rank when
    they differ. The environment variable ``DISTCONV_DEBUG=1`` sets the initial value.
    The exchange is not counted in :attr:`Communicator.stats`.
    """
    global _debug
    if not isinstance(flag, bool):
        raise TypeError(f"set_debug: flag must be a bool, got {flag!r}")
    _debug = flag


def get_debug() -> bool:
    """Whether debug mode (the collective agreement check) is on."""
    return _debug
