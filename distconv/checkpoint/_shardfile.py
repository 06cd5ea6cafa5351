"""One rank's shard file: safetensors written straight from the tensors' memory, durably.

The safetensors layout is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and byte range; ``__metadata__``), padded with spaces to 8 bytes, then the raw
bytes. Each tensor goes to the file in one ``write`` from its own memory (no serialized copy), and
its SHA-256 is computed in a second thread while the next one is written (``hashlib`` releases
the GIL), so hashing hides behind the writing instead of adding to it. The file is written under a
temporary name, ``fsync``'d, renamed, and the rename made durable before the path is returned.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from distconv.checkpoint._index import sync_dir

__all__ = ["write_shard_file"]

#: torch dtype -> safetensors dtype name
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    **{getattr(torch, t): s for t, s in (
        ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
        ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
    ) if hasattr(torch, t)},
}


def write_shard_file(
    file: Path, tensors: Sequence[tuple[str, torch.Tensor]], metadata: Mapping[str, str]
) -> tuple[int, dict[str, str]]:
    """Write ``tensors`` (contiguous, on the CPU) to ``file``; return its size and each
    tensor's SHA-256."""
    views = [(key, _bytes(key, t)) for key, t in tensors]
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for (key, t), (_, data) in zip(tensors, views):
        header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = file.with_name(f".{file.name}.tmp")
    # hashing beside the writing, on a plain thread: an executor refuses work once the
    # interpreter starts to shut down, which is when an asynchronous save of a program that ends
    # without waiting for it still writes
    hashes: dict[str, str] = {}
    failed: list[BaseException] = []

    def digest() -> None:
        try:
            for key, data in views:
                hashes[key] = _sha256(data)
        except BaseException as exc:  # raised below, in the writing thread
            failed.append(exc)

    hasher = threading.Thread(target=digest, name="distconv-checkpoint-hash", daemon=True)
    with open(tmp, "wb", buffering=0) as f:
        _write_all(f, struct.pack("<Q", len(text)) + text)
        hasher.start()
        try:
            for _, data in views:
                _write_all(f, data)
            os.fsync(f.fileno())
        finally:
            hasher.join()
    if failed:
        raise failed[0]
    os.replace(tmp, file)
    sync_dir(file.parent)
    return 8 + len(text) + offset, hashes


def _bytes(key: str, t: torch.Tensor) -> memoryview:
    if t.dtype not in _DTYPES:
        raise TypeError(f"tensor {key!r} has dtype {t.dtype}, which safetensors cannot hold")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"tensor {key!r} must be contiguous on the CPU to be written")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def _sha256(data: memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_all(f: object, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view.nbytes:
        n = f.write(view)  # type: ignore[attr-defined]
        view = view[n:]
