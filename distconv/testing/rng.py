"""Per-rank random generators.

Thread ranks (:func:`~distconv.testing.run_threads`, ``launch(backend="threads")``) live in one
process and so share torch's global generator: ``torch.manual_seed(0); torch.randn(4)`` on every
rank draws interleaved numbers from one stream, and "same-seed" ranks get different data,
depending on how the threads are scheduled. A generator of each rank's own, passed to the
sampling calls (``torch.randn(..., generator=g)``), gives every rank the same numbers on every
backend (threads or processes).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

__all__ = ["rank_generator"]

_MAX_SEED = 2**64 - 1


def rank_generator(
    comm: Any, seed: int, *, distinct: bool = False, device: str | torch.device = "cpu"
) -> torch.Generator:
    """A new ``torch.Generator`` for this rank of ``comm``, independent of torch's global one.

    Args:
        comm: the rank's communicator (any backend).
        seed: an int in ``[0, 2**64)``.
        distinct: ``False`` (default): every rank gets the same stream (the generator is seeded
            with ``seed``, as ``torch.manual_seed(seed)`` would seed the global one), for data
            that must agree across ranks. ``True``: each rank gets its own stream, seeded from
            ``(seed, comm.rank)``, for data that must differ (e.g. dropout masks per sample block).
        device: the generator's device (default ``"cpu"``).
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"rank_generator: seed must be an int, got {seed!r}")
    if not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"rank_generator: seed must be in [0, 2**64), got {seed}")
    if not isinstance(distinct, bool):
        raise TypeError(f"rank_generator: distinct must be a bool, got {distinct!r}")
    rank = getattr(comm, "rank", None)
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank_generator: comm must be a distconv communicator, got {comm!r}")
    if distinct:
        digest = hashlib.sha256(f"{seed}/{rank}".encode()).digest()
        seed = int.from_bytes(digest[:8], "little")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
