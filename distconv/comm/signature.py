"""The debug mode's agreement between ranks: what each rank is calling, as a fixed-size record the
ranks exchange before communicating, and the check that a value is the same on every rank."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from distconv.comm.errors import CollectiveMismatchError

if TYPE_CHECKING:
    from distconv.comm.base import Communicator

__all__ = ["CallSignature", "agree_on_value", "decode_signature", "encode_signature",
           "find_mismatch", "signature_nbytes"]


@dataclass(frozen=True)
class CallSignature:
    """What one rank is calling: ``common`` must be equal on every rank; for an all-to-all,
    ``sends[r]`` (shape sent to rank r) must equal rank r's ``recvs[self]``."""

    desc: str
    common: str
    sends: tuple[str, ...] | None = None
    recvs: tuple[str, ...] | None = None


def find_mismatch(sigs: Sequence[CallSignature]) -> str | None:
    """None when the ranks agree, else a message listing what each rank called."""
    bad = any(s.common != sigs[0].common for s in sigs)
    if not bad and sigs[0].sends is not None:
        bad = any(
            s.sends is None or r.recvs is None or s.sends[j] != r.recvs[i]
            for i, s in enumerate(sigs)
            for j, r in enumerate(sigs)
        )
    if not bad:
        return None
    lines = "\n".join(f"  rank {i}: {s.desc}" for i, s in enumerate(sigs))
    return f"ranks entered different collectives:\n{lines}"


_DIGEST = 8
_DESC_BYTES = 480


def agree_on_value(comm: Communicator, t: torch.Tensor, what: str) -> None:
    """Raise :class:`CollectiveMismatchError` on every rank of ``comm`` unless all ranks pass
    bitwise equal tensors ``t`` (dtype, shape and bytes; one small allgather of digests).

    For arguments the API requires to be the same on every rank; called in debug mode.
    """
    if comm.size == 1:
        return
    t = t.detach()
    data = t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    digest = hashlib.sha1(data, usedforsecurity=False).hexdigest()[:16]
    desc = f"dtype={t.dtype}, shape={tuple(t.shape)}, sha1 {digest}"
    sigs = comm._exchange_signatures(CallSignature(desc, desc), "value-check")
    if any(s.common != sigs[0].common for s in sigs):
        lines = "\n".join(f"  rank {i}: {s.desc}" for i, s in enumerate(sigs))
        raise CollectiveMismatchError(
            f"rank {comm.rank}, backend {comm.backend!r}: {what} must be the same on every rank, "
            f"but it differs:\n{lines}"
        )


def _digest(text: str) -> bytes:
    return hashlib.sha1(text.encode(), usedforsecurity=False).digest()[:_DIGEST]


def encode_signature(sig: CallSignature, size: int) -> bytes:
    """Fixed-size record (``signature_nbytes(size)``) carrying the digests and a truncated desc."""
    sends = sig.sends if sig.sends is not None else ("",) * size
    recvs = sig.recvs if sig.recvs is not None else ("",) * size
    flag = b"\x01" if sig.sends is not None else b"\x00"
    body = flag + _digest(sig.common) + b"".join(_digest(x) for x in sends + recvs)
    desc = sig.desc.encode()[:_DESC_BYTES].ljust(_DESC_BYTES, b"\x00")
    return body + desc


def signature_nbytes(size: int) -> int:
    return 1 + _DIGEST * (1 + 2 * size) + _DESC_BYTES


def decode_signature(rec: bytes, size: int) -> CallSignature:
    has_pairs = rec[0] == 1
    common = rec[1 : 1 + _DIGEST].hex()
    pos = 1 + _DIGEST
    digs = [rec[pos + i * _DIGEST : pos + (i + 1) * _DIGEST].hex() for i in range(2 * size)]
    desc = rec[signature_nbytes(size) - _DESC_BYTES :].rstrip(b"\x00").decode(errors="replace")
    if not has_pairs:
        return CallSignature(desc, common)
    return CallSignature(desc, common, tuple(digs[:size]), tuple(digs[size:]))
