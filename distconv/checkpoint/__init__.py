"""Sharded checkpoints that reshard onto any grid, algorithm and world size.

:func:`save` writes every block once, its bytes spread over the ranks that hold it (one
safetensors file per rank), and rank 0 writes a JSON index last: each tensor's global shape, dtype,
distribution in the paper's notation (``[*,o_C,*,*]``), grid layout, and each shard's file, key,
index box and SHA-256 (the convention of sharded Hugging Face checkpoints). :func:`load` reads on
each rank, lazily, only the boxes its current layout needs, so a job saved on
``{N:2, C:2}`` stationary-x resumes on ``{F:4}`` stationary-y or on one process, bit for bit.
:func:`load_global_state_dict` slices a plain single-process ``state_dict`` into a parallel
model; :func:`consolidate` turns any checkpoint back into one. Optimizer state and any
:class:`Shardable` (e.g. K-FAC's) reshard the same way. JSON and safetensors only: nothing is
ever unpickled. ``save(..., async_save=True)`` copies the state to host memory, returns a
:class:`SaveHandle` at once and writes in the background. ``extra=`` holds plain values shared by
every rank; ``rank_extra=`` each rank's own (random generators, data position), stored with its
shards and handed back by ``load(..., rank_extra=True)`` to the rank of the same number.
"""

from __future__ import annotations

from distconv.checkpoint._index import INDEX_NAME, CheckpointError
from distconv.checkpoint._load import consolidate, load, load_global_state_dict
from distconv.checkpoint._save import SaveHandle, save
from distconv.checkpoint._sections import Shardable

__all__ = [
    "INDEX_NAME", "CheckpointError", "Shardable", "consolidate", "load", "load_global_state_dict",
    "SaveHandle", "save",
]
