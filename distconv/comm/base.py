"""The :class:`Communicator` interface: validation, accounting and the debug agreement check.

Public operations are template methods. Each one

1. validates its arguments (tensor types, one dtype and device, shapes, roots, chunk counts),
2. makes the buffers contiguous (inputs are never modified; results are new tensors; chunks
   that already lie back to back in one storage stay there, so a backend sends them in place),
3. counts the call and the logical bytes this rank receives (see :class:`CommStats`),
4. in debug mode, checks that every rank of the communicator is entering the same collective,
5. hands the buffers to the backend's ``_op`` method, which returns a :class:`Work`.

Backends implement only the ``_op`` methods; they never validate or count.

Beside it: :mod:`~distconv.comm.work` (the handles of asynchronous operations and their
timeouts), :mod:`~distconv.comm.stats` (what is counted), :mod:`~distconv.comm.debug` (whether
the agreement check runs), :mod:`~distconv.comm.signature` (what it compares) and
:mod:`~distconv.comm.buffers` (the packing helpers); their names stay importable from here.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from distconv.comm.buffers import (  # noqa: F401 (re-exported: the communicators' helpers)
    _REDUCERS, AlltoallBuffers, allreduce_bytes, concat_parts, flat_concat, flat_span,
    packed, reduce_in_order, split_chunks,
)
from distconv.comm.debug import get_debug, set_debug
from distconv.comm.errors import CollectiveMismatchError
from distconv.comm.signature import (  # noqa: F401 (re-exported)
    CallSignature, agree_on_value, decode_signature, encode_signature, find_mismatch,
    signature_nbytes,
)
from distconv.comm.stats import CommStats
from distconv.comm.work import Work, check_timeout, compiling, eager  # noqa: F401 (re-exported)

__all__ = [
    "REDUCE_OPS",
    "CommStats",
    "Communicator",
    "Work",
    "agree_on_value",
    "allreduce_bytes",
    "check_timeout",
    "concat_parts",
    "flat_concat",
    "flat_span",
    "get_debug",
    "packed",
    "set_debug",
    "split_chunks",
]

Shape = tuple[int, ...]
REDUCE_OPS = ("sum", "prod", "max", "min", "avg")


def _shape_of(shape: Any, name: str) -> Shape:
    if type(shape) is tuple and all(type(d) is int and d >= 0 for d in shape):
        return shape  # (the common case, checked without the general path's abc checks)
    if isinstance(shape, torch.Size):
        return tuple(shape)
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, Sequence) or isinstance(shape, str):
        raise TypeError(f"{name} must be a shape (a sequence of ints), got {shape!r}")
    out = []
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"{name} must contain non-negative ints, got {tuple(shape)!r}")
        out.append(int(d))
    return tuple(out)


def _numel(shape: Shape) -> int:
    return math.prod(shape)


class Communicator(abc.ABC):
    """A group of ``size`` ranks that exchange torch tensors.

    Results are new tensors; inputs are never modified. Every collective accepts ``meta: str``,
    a description (op, grid, dists, shapes) used by the debug agreement check and its messages,
    and ``async_op``: when true it returns a :class:`Work` whose ``wait()`` returns the result.
    Backends may send straight from the inputs, so an input must not be modified before then.
    """

    backend: str = "abstract"
    _device = torch.device("cpu")  # where the backend's internal buffers live

    def __init__(self, *, rank: int, size: int, timeout: float, parent: Communicator | None = None):
        timeout = check_timeout(timeout)
        self._rank = int(rank)
        self._size = int(size)
        self.timeout = float(timeout)
        self.stats = CommStats(parent=parent.stats if parent is not None else None)
        self._splits: dict[Any, Communicator] = {}
        self.closed = False

    @property
    def device(self) -> torch.device:
        """Where this communicator's small control tensors (shapes, seeds, digests) live: the
        one device an NCCL communicator moves, else the CPU."""
        return getattr(self, "_device", None) or torch.device("cpu")

    @property
    def host(self) -> Communicator:
        """A communicator of the same ranks, in the same order, that moves CPU tensors: for
        control messages (shapes, flags) that the host needs at once, without a device round
        trip. This communicator itself, except where it moves only device tensors (NCCL: a
        gloo group of its ranks, made at the first use, collectively)."""
        return self

    def shared_generator(self) -> torch.Generator:
        """A random generator in the same state on every rank of this communicator, on its
        :attr:`device`: created at the first call (a collective), seeded with rank 0's
        ``torch.initial_seed()``. Its draws stay the same on every rank as long as every rank
        draws the same (e.g. a mask for the global tensor, of which each rank keeps its block)."""
        g = getattr(self, "_shared_generator", None)
        if g is None:
            seed = torch.tensor([torch.initial_seed() % (1 << 63)], dtype=torch.int64,
                                device=self.device)
            seed = self.broadcast(seed, root=0, meta="shared generator seed")
            g = torch.Generator(device=self.device)
            g.manual_seed(int(seed[0]))
            self._shared_generator = g
        return g

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(backend={self.backend!r}, rank={self.rank}, size={self.size}, "
            f"timeout={self.timeout})"
        )

    # ---------------------------------------------------------------- validation helpers
    def _tensor(self, t: Any, name: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        self._check_device(t, name)
        return t.detach().resolve_conj().resolve_neg()

    def _check_device(self, t: torch.Tensor, name: str) -> None:
        if not t.is_cpu:
            raise ValueError(
                f"{name} is on device {t.device}; backend {self.backend!r} takes CPU tensors"
            )

    def _tensors(self, chunks: Any, name: str) -> list[torch.Tensor]:
        if type(chunks) not in (list, tuple) and (
                isinstance(chunks, torch.Tensor) or not isinstance(chunks, Sequence)):
            raise TypeError(f"{name} must be a sequence of {self.size} tensors (one per rank)")
        if len(chunks) != self.size:
            raise ValueError(
                f"{name} must have one tensor per rank: expected {self.size}, got {len(chunks)}"
            )
        out = [self._tensor(c, f"{name}[{i}]") for i, c in enumerate(chunks)]
        dtype, device = out[0].dtype, out[0].device
        if any(c.dtype != dtype for c in out):
            dtypes = {c.dtype for c in out}
            raise TypeError(f"{name} must all have one dtype, got {sorted(map(str, dtypes))}")
        if any(c.device != device for c in out):
            devices = {c.device for c in out}
            raise ValueError(f"{name} must all be on one device, got {sorted(map(str, devices))}")
        return [c.contiguous() for c in out]

    def _peer(self, value: Any, name: str, *, allow_self: bool = True) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int rank in [0, {self.size}), got {value!r}")
        if not 0 <= value < self.size:
            raise ValueError(f"{name} must be a rank in [0, {self.size}), got {value}")
        if not allow_self and value == self.rank:
            raise ValueError(f"{name} must differ from this rank ({self.rank})")
        return int(value)

    def _reduce_op(self, op: Any, dtype: torch.dtype) -> str:
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
        if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
            raise TypeError(f"op='avg' needs a floating or complex dtype, got {dtype}")
        if op in ("max", "min") and dtype.is_complex:
            raise TypeError(f"op={op!r} is undefined for complex dtype {dtype}")
        return op

    @staticmethod
    def _tag(tag: Any) -> int:
        if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
            raise ValueError(f"tag must be a non-negative int, got {tag!r}")
        return int(tag)

    # ---------------------------------------------------------------- debug agreement
    def _agree(self, sig: CallSignature, op: str) -> None:
        """Raise CollectiveMismatchError on every rank unless all ranks pass matching sigs."""
        if self.size == 1:
            return
        sigs = self._exchange_signatures(sig, op)
        msg = find_mismatch(sigs)
        if msg is not None:
            raise CollectiveMismatchError(
                f"rank {self.rank}, backend {self.backend!r}, op {op!r}: {msg}"
            )

    def _exchange_signatures(self, sig: CallSignature, op: str) -> list[CallSignature]:
        n = signature_nbytes(self.size)
        rec = torch.frombuffer(bytearray(encode_signature(sig, self.size)), dtype=torch.uint8)
        rec = rec.to(self._device)
        parts = self._allgather(rec, [(n,)] * self.size, f"{op}:debug-check").wait()
        return [decode_signature(p.cpu().numpy().tobytes(), self.size) for p in parts]

    def _enter(self, op: str, meta: str, common: Callable[[], str], nbytes: int, *,
               sends: Callable[[], Any] | None = None, recvs: Callable[[], Any] | None = None):
        """Count the call; in debug mode first agree with the other ranks on it. ``common``,
        ``sends`` and ``recvs`` describe the call and are only formatted in debug mode."""
        if not isinstance(meta, str):
            raise TypeError(f"meta must be a str, got {type(meta).__name__}")
        self._op = op  # (the call a failure while opening a host channel names)
        if get_debug():
            common = common()
            sends = sends() if sends is not None else None
            recvs = recvs() if recvs is not None else None
            desc = f"{op}({common}, meta={meta!r})"
            self._agree(CallSignature(desc, f"{op}|{meta}|{common}", sends, recvs), op)
        self.stats.add(op, nbytes)
        self.stats.note(op, self.size, meta)

    @staticmethod
    def _finish(work: Work, async_op: bool) -> Any:
        return work if async_op else work.wait()

    @staticmethod
    def _check_async(async_op: Any) -> None:
        if not isinstance(async_op, bool):
            raise TypeError(f"async_op must be a bool, got {async_op!r}")

    # ---------------------------------------------------------------- public operations
    @eager
    def allreduce(
        self, t: torch.Tensor, *, op: str = "sum", async_op: bool = False, meta: str = "",
        consume: bool = False,
    ):
        """Elementwise reduction of ``t`` over all ranks; every rank gets the result.

        ``consume=True`` hands ``t`` over: the backend may reduce in its storage and return it
        (no copy), so its values are undefined once the call starts. Default False."""
        self._check_async(async_op)
        if not isinstance(consume, bool):
            raise TypeError(f"consume must be a bool, got {consume!r}")
        t = self._tensor(t, "t").contiguous()
        op = self._reduce_op(op, t.dtype)
        nbytes = allreduce_bytes(t.numel(), self.rank, self.size, t.element_size())
        self._enter("allreduce", meta, lambda: f"op={op}, dtype={t.dtype}, shape={tuple(t.shape)}",
                    nbytes)
        if consume:
            return self._finish(self._allreduce_consuming(t, op), async_op)
        return self._finish(self._allreduce(t, op), async_op)

    def _allreduce_consuming(self, t: torch.Tensor, op: str) -> Work:
        """``_allreduce`` free to reduce in ``t``'s storage (backends that can, do)."""
        return self._allreduce(t, op)

    @eager
    def allgather(
        self,
        t: torch.Tensor,
        *,
        shapes: Sequence[Sequence[int]] | None = None,
        async_op: bool = False,
        meta: str = "",
    ):
        """``result[r]`` is rank r's tensor; ``shapes[r]`` its shape (None: all ``t.shape``)."""
        self._check_async(async_op)
        t = self._tensor(t, "t").contiguous()
        if shapes is None:
            shapes_ = [tuple(t.shape)] * self.size
        else:
            if type(shapes) not in (list, tuple) and (
                    isinstance(shapes, (str, torch.Size)) or not isinstance(shapes, Sequence)):
                raise TypeError(f"shapes must be a sequence of {self.size} shapes, got {shapes!r}")
            if len(shapes) != self.size:
                raise ValueError(
                    f"shapes must have one shape per rank: expected {self.size}, got {len(shapes)}"
                )
            shapes_ = [_shape_of(s, f"shapes[{i}]") for i, s in enumerate(shapes)]
            if shapes_[self.rank] != tuple(t.shape):
                raise ValueError(
                    f"shapes[{self.rank}] = {shapes_[self.rank]} must equal this rank's t.shape "
                    f"{tuple(t.shape)}"
                )
        isz = t.element_size()
        nbytes = sum(_numel(s) for i, s in enumerate(shapes_) if i != self.rank) * isz
        self._enter("allgather", meta, lambda: f"dtype={t.dtype}, shapes={shapes_}", nbytes)
        return self._finish(self._allgather(t, shapes_, "allgather"), async_op)

    @eager
    def reduce_scatter(
        self,
        chunks: Sequence[torch.Tensor],
        *,
        op: str = "sum",
        async_op: bool = False,
        meta: str = "",
    ):
        """The reduction over ranks s of ``chunks_s[self.rank]``; ``len(chunks) == size``."""
        self._check_async(async_op)
        cs = self._tensors(chunks, "chunks")
        op = self._reduce_op(op, cs[0].dtype)
        nbytes = (self.size - 1) * cs[self.rank].numel() * cs[0].element_size()
        self._enter("reduce_scatter", meta, lambda: f"op={op}, dtype={cs[0].dtype}, shapes="
                    f"{[tuple(c.shape) for c in cs]}", nbytes)
        return self._finish(self._reduce_scatter(cs, op), async_op)

    # ---------------------------------------------------------------- planned operations
    # The collectives of a redistribution plan, whose arguments the plan checked once (shapes,
    # dtype, the segment): no per-call validation, the same counts and bytes as the public
    # calls, and in debug mode the public calls themselves (with their agreement check).
    @eager
    def _allgather_along(self, t: torch.Tensor, shapes: list[Shape], dim: int,
                         meta: str) -> torch.Tensor:
        """Every rank's block ``t`` (``shapes[r]``, ``t`` contiguous) concatenated along
        ``dim``."""
        if get_debug():
            return concat_parts(self.allgather(t, shapes=shapes, meta=meta), dim)
        isz = t.element_size()
        self.stats.add("allgather", sum(_numel(s) for i, s in enumerate(shapes)
                                        if i != self.rank) * isz)
        self.stats.note("allgather", self.size, meta)
        return self._allgather_cat(t, shapes, dim)

    def _allgather_cat(self, t: torch.Tensor, shapes: list[Shape], dim: int) -> torch.Tensor:
        """``_allgather``'s parts concatenated along ``dim`` (backends with a shared-memory
        channel concatenate straight out of it)."""
        return concat_parts(self._allgather(t, shapes, "allgather").wait(), dim)

    @eager
    def _reduce_scatter_along(self, x: torch.Tensor, sizes: list[int], dim: int,
                              meta: str) -> torch.Tensor:
        """The sum over the ranks of this rank's slice of ``x`` (split along ``dim`` into
        ``sizes``, ``x`` contiguous)."""
        if get_debug():
            return self.reduce_scatter(split_chunks(x, sizes, dim), meta=meta)
        self.stats.add("reduce_scatter",
                       (self.size - 1) * math.prod(x.shape[:dim]) * sizes[self.rank]
                       * math.prod(x.shape[dim + 1:])
                       * x.element_size())
        self.stats.note("reduce_scatter", self.size, meta)
        return self._reduce_scatter_dim(x, sizes, dim)

    def _reduce_scatter_dim(self, x: torch.Tensor, sizes: list[int], dim: int) -> torch.Tensor:
        """``_reduce_scatter`` of ``x``'s chunks along ``dim`` (backends with a shared-memory
        channel write them into it in one copy)."""
        return self._reduce_scatter(split_chunks(x, sizes, dim), "sum").wait()

    @eager
    def alltoall(
        self,
        chunks: Sequence[torch.Tensor],
        *,
        recv_shapes: Sequence[Sequence[int]] | None = None,
        async_op: bool = False,
        meta: str = "",
        max_bytes: int | None = None,
    ):
        """``chunks[r]`` goes to rank r; ``result[s]`` came from rank s (shape ``recv_shapes[s]``;
        None: the same shape as ``chunks[s]``).

        ``max_bytes``: the most bytes any rank sends in this call (the sum of its chunks),
        given alike on every rank, or None (default: not known). Each rank knows only its own
        row and column of the sizes; with the bound, the ranks of one host can all choose the
        shared-memory channel for a small all-to-all (a halo exchange, a transition between
        layers) where gloo carries it over TCP."""
        self._check_async(async_op)
        cs = self._tensors(chunks, "chunks")
        if max_bytes is not None and (isinstance(max_bytes, bool)
                                      or not isinstance(max_bytes, int)):
            raise TypeError(f"max_bytes must be an int or None, got {max_bytes!r}")
        if recv_shapes is None:
            rshapes = [tuple(c.shape) for c in cs]
        else:
            if type(recv_shapes) not in (list, tuple) and (isinstance(
                    recv_shapes, (str, torch.Size)) or not isinstance(recv_shapes, Sequence)):
                raise TypeError(f"recv_shapes must be a sequence of {self.size} shapes")
            if len(recv_shapes) != self.size:
                raise ValueError(
                    f"recv_shapes must have one shape per rank: expected {self.size}, "
                    f"got {len(recv_shapes)}"
                )
            rshapes = [_shape_of(s, f"recv_shapes[{i}]") for i, s in enumerate(recv_shapes)]
            if rshapes[self.rank] != tuple(cs[self.rank].shape):
                raise ValueError(
                    f"recv_shapes[{self.rank}] = {rshapes[self.rank]} must equal "
                    f"chunks[{self.rank}].shape {tuple(cs[self.rank].shape)} "
                    "(this rank's own chunk)"
                )
        isz = cs[0].element_size()
        if max_bytes is not None and max_bytes < sum(c.numel() for c in cs) * isz:
            raise ValueError(
                f"max_bytes = {max_bytes} is less than the {sum(c.numel() for c in cs) * isz} "
                f"bytes rank {self.rank} sends; it bounds every rank's chunks together")
        nbytes = sum(_numel(s) for i, s in enumerate(rshapes) if i != self.rank) * isz
        self._enter(
            "alltoall",
            meta,
            lambda: f"dtype={cs[0].dtype}, max_bytes={max_bytes}",
            nbytes,
            sends=lambda: tuple(str(tuple(c.shape)) for c in cs),
            recvs=lambda: tuple(str(s) for s in rshapes),
        )
        if max_bytes is None:
            return self._finish(self._alltoall(cs, rshapes), async_op)
        return self._finish(self._alltoall_bounded(cs, rshapes, max_bytes), async_op)

    def _alltoall_bounded(self, chunks: list[torch.Tensor], recv_shapes: list[Shape],
                          max_bytes: int) -> Work:
        """``_alltoall`` where every rank sends at most ``max_bytes`` (the same bound on every
        rank): backends with a shared-memory channel may carry it there."""
        return self._alltoall(chunks, recv_shapes)

    @eager
    def broadcast(self, t: torch.Tensor, *, root: int, async_op: bool = False, meta: str = ""):
        """Root's ``t`` to every rank; non-roots pass a buffer giving shape and dtype."""
        self._check_async(async_op)
        t = self._tensor(t, "t").contiguous()
        root = self._peer(root, "root")
        nbytes = 0 if self.rank == root else t.numel() * t.element_size()
        self._enter(
            "broadcast", meta, lambda: f"root={root}, dtype={t.dtype}, shape={tuple(t.shape)}",
            nbytes)
        return self._finish(self._broadcast(t, root), async_op)

    @eager
    def barrier(self, *, meta: str = "") -> None:
        self._enter("barrier", meta, lambda: "", 0)
        self._barrier().wait()

    @eager
    def isend(self, t: torch.Tensor, *, dst: int, tag: int = 0) -> Work:
        t = self._tensor(t, "t").contiguous()
        dst = self._peer(dst, "dst", allow_self=False)
        tag = self._tag(tag)
        self.stats.add("send", 0)
        return self._send(t, dst, tag)

    @eager
    def irecv(self, shape: Sequence[int], dtype: torch.dtype, *, src: int, tag: int = 0) -> Work:
        shape_ = _shape_of(shape, "shape")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        src = self._peer(src, "src", allow_self=False)
        tag = self._tag(tag)
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.stats.add("recv", _numel(shape_) * itemsize)
        return self._recv(shape_, dtype, src, tag)

    @eager
    def send(self, t: torch.Tensor, *, dst: int, tag: int = 0) -> None:
        self.isend(t, dst=dst, tag=tag).wait()

    @eager
    def recv(self, shape: Sequence[int], dtype: torch.dtype, *, src: int, tag: int = 0):
        return self.irecv(shape, dtype, src=src, tag=tag).wait()

    @eager
    def split(
        self, groups: Sequence[Sequence[int]], *, timeout: float | None = None
    ) -> Communicator:
        """Sub-communicator of the group holding this rank (sub-rank = position in the group).

        Collective over all ranks of this communicator; ``groups`` partition ``range(size)`` and
        every rank passes the same groups in the same order. Cached by
        ``(tuple(map(tuple, groups)), timeout)``. ``timeout`` (default: this communicator's)
        is the sub-communicator's timeout.
        """
        key_groups = self._check_groups(groups)
        timeout_ = self.timeout if timeout is None else check_timeout(timeout)
        key = (key_groups, timeout_)
        cached = self._splits.get(key)
        if cached is not None and not cached.closed:
            return cached
        self.stats.add("split", 0)
        self.stats.note("split", self.size, f"split into {len(key_groups)} groups")
        if self.size > 1:
            sig = CallSignature(f"split(groups={key_groups})", f"split|{key}")
            self._agree(sig, "split")
        index = next(i for i, g in enumerate(key_groups) if self.rank in g)
        sub = self._split(key_groups, index, timeout_)
        self._splits[key] = sub
        return sub

    def _check_groups(self, groups: Any) -> tuple[tuple[int, ...], ...]:
        if isinstance(groups, (str, torch.Tensor)) or not isinstance(groups, Sequence):
            raise TypeError(f"groups must be a sequence of rank sequences, got {groups!r}")
        out = []
        for g in groups:
            if isinstance(g, (str, torch.Tensor)) or not isinstance(g, Sequence):
                raise TypeError(f"groups must be a sequence of rank sequences, got {groups!r}")
            if any(isinstance(r, bool) or not isinstance(r, int) for r in g):
                raise TypeError(f"groups must contain int ranks, got {groups!r}")
            if len(g) == 0:
                raise ValueError(f"groups must not contain empty groups, got {groups!r}")
            out.append(tuple(int(r) for r in g))
        flat = sorted(r for g in out for r in g)
        if flat != list(range(self.size)):
            raise ValueError(
                f"groups must partition range({self.size}) (each rank exactly once), got {groups!r}"
            )
        return tuple(out)

    # ---------------------------------------------------------------- teardown
    def close(self) -> None:
        """Release this communicator and its sub-communicators (newest first); idempotent.

        Not collective. Afterwards they must not be used (the torch and MPI backends raise
        ``CommError``), and a ``split`` of the parent creates a new sub-communicator in place of a
        closed one. Called for the world by
        :func:`distconv.comm.shutdown`, which runs by itself at interpreter exit.
        """
        subs = list(self._splits.values())
        self._splits.clear()
        for sub in reversed(subs):
            sub.close()
        self._release()
        self.closed = True

    def _release(self) -> None:
        """Free the backend's own resources (process groups, duplicated MPI communicators)."""

    # ---------------------------------------------------------------- backend interface
    @abc.abstractmethod
    def _allreduce(self, t: torch.Tensor, op: str) -> Work: ...

    @abc.abstractmethod
    def _allgather(self, t: torch.Tensor, shapes: list[Shape], opname: str) -> Work: ...

    @abc.abstractmethod
    def _reduce_scatter(self, chunks: list[torch.Tensor], op: str) -> Work: ...

    @abc.abstractmethod
    def _alltoall(self, chunks: list[torch.Tensor], recv_shapes: list[Shape]) -> Work: ...

    @abc.abstractmethod
    def _broadcast(self, t: torch.Tensor, root: int) -> Work: ...

    @abc.abstractmethod
    def _barrier(self) -> Work: ...

    @abc.abstractmethod
    def _send(self, t: torch.Tensor, dst: int, tag: int) -> Work: ...

    @abc.abstractmethod
    def _recv(self, shape: Shape, dtype: torch.dtype, src: int, tag: int) -> Work: ...

    @abc.abstractmethod
    def _split(
        self, groups: tuple[tuple[int, ...], ...], index: int, timeout: float
    ) -> Communicator: ...
