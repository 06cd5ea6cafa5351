"""The checkpoint index: one JSON file that says where every shard of every tensor lies.

Layout (the convention of sharded Hugging Face checkpoints, with distributions added)::

    checkpoint.index.json
        {"format": "distconv.checkpoint", "version": 1, "world_size": 4,
         "files": {"shard-00000-of-00004.safetensors": {"size": 1234}, ...},
         "sections": {"model": <state tree>, "optimizer": <state tree>, ...,
                      "rank_extra": {"list": [<rank 0's tree>, ...]}},
         "tensors": {"model/0.weight": {
             "dtype": "float64", "shape": [8, 6, 3, 3], "dist": "[*,o_C,*,*]",
             "grid": [["N", 2], ["C", 2]],
             "shards": [{"file": "shard-00000-of-00004.safetensors", "key": "model/0.weight",
                         "box": [[0, 8], [0, 3], [0, 3], [0, 3]], "sha256": "..."}, ...]}}}
    shard-RRRRR-of-SSSSS.safetensors     the shards rank R wrote

A box is ``[start, stop)`` per tensor dim in the global tensor. The shards of a tensor tile its
global shape exactly once. State trees are described in :mod:`distconv.checkpoint._tree`. The
``rank_extra`` section (only where some rank saved one) holds each saving rank's own values, by
rank; its tensors (``rank_extra/<rank>/<key>``) are replicated entries whose one shard lies in
that rank's file.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FORMAT", "INDEX_NAME", "VERSION", "Box", "CheckpointError", "Shard", "TensorEntry",
    "as_path", "check_flag", "dtype_name", "intersect", "read_index", "shard_file_name", "volume",
    "write_atomic",
]

FORMAT = "distconv.checkpoint"
VERSION = 1
INDEX_NAME = "checkpoint.index.json"

Box = tuple[tuple[int, int], ...]


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or does not match what loads it."""


def shard_file_name(rank: int, size: int) -> str:
    return f"shard-{rank:05d}-of-{size:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: Any, key: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"tensor {key!r}: unknown dtype {name!r} in the checkpoint index")
    return dtype


def volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, None if they share no element (0-dim boxes: ``()``)."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


@dataclass(frozen=True)
class Shard:
    file: str
    key: str
    box: Box
    sha256: str


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the index: global shape, dtype, distribution and shards (validated)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    dist: str
    grid: tuple[tuple[str, int], ...] | None
    shards: tuple[Shard, ...]

    @classmethod
    def parse(cls, key: str, raw: Any, files: dict[str, Any]) -> TensorEntry:
        try:
            shape = tuple(int(n) for n in raw["shape"])
            grid = None if raw["grid"] is None else tuple((str(n), int(e)) for n, e in raw["grid"])
            shards = tuple(
                Shard(str(s["file"]), str(s["key"]), tuple((int(a), int(b)) for a, b in s["box"]),
                      str(s["sha256"]))
                for s in raw["shards"]
            )
            entry = cls(key, shape, _dtype(raw["dtype"], key), str(raw["dist"]), grid, shards)
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"tensor {key!r}: malformed index entry ({exc!r})") from None
        entry.check_tiling(files)
        return entry

    def check_tiling(self, files: dict[str, Any]) -> None:
        """Raise unless the shards lie inside the global shape and cover it exactly once."""
        full = tuple((0, n) for n in self.shape)
        for s in self.shards:
            if s.file not in files:
                raise CheckpointError(
                    f"tensor {self.key!r}: shard file {s.file!r} is not listed in the index"
                )
            if len(s.box) != len(self.shape) or intersect(s.box, full) != s.box:
                raise CheckpointError(
                    f"tensor {self.key!r}: shard box {s.box} lies outside the global shape "
                    f"{self.shape}"
                )
        for i, a in enumerate(self.shards):
            for b in self.shards[i + 1:]:
                if intersect(a.box, b.box) is not None:
                    raise CheckpointError(
                        f"tensor {self.key!r}: shards {a.box} and {b.box} overlap"
                    )
        covered = sum(volume(s.box) for s in self.shards)
        if covered != math.prod(self.shape):
            raise CheckpointError(
                f"tensor {self.key!r}: its shards hold {covered} of the "
                f"{math.prod(self.shape)} elements of global shape {self.shape}"
            )


def read_index(path: Path) -> dict[str, Any]:
    """The parsed index of the checkpoint directory ``path`` (raises if absent or malformed)."""
    index_path = path / INDEX_NAME
    if not index_path.is_file():
        what = "is not a directory" if not path.is_dir() else f"has no {INDEX_NAME}"
        raise CheckpointError(
            f"no complete checkpoint at {str(path)!r}: it {what} (the index is written last, "
            "so a save that did not finish has none)"
        )
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint index {str(index_path)!r} is unreadable: {exc}"
        ) from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{str(index_path)!r} is not a {FORMAT} index")
    if index.get("version") != VERSION:
        raise CheckpointError(
            f"{str(index_path)!r} has format version {index.get('version')!r}; this distconv "
            f"reads version {VERSION}"
        )
    for field in ("files", "sections", "tensors"):
        if not isinstance(index.get(field), dict):
            raise CheckpointError(f"{str(index_path)!r}: field {field!r} is missing or malformed")
    return index


def as_path(path: Any) -> Path:
    """``path`` as a ``Path``, or a TypeError naming what was given."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike directory, got {path!r}")
    return Path(os.fspath(path))


def check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` under a temporary name, flush it to disk, then rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    sync_dir(path.parent)


def sync_dir(path: Path) -> None:
    """Make renames inside ``path`` durable (where the platform allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
