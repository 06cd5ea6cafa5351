"""``load``, ``load_global_state_dict`` and ``consolidate``: each rank reads only its boxes."""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from distconv.checkpoint._index import (
    Box, CheckpointError, TensorEntry, as_path, check_flag, intersect, read_index, volume,
)
from distconv.checkpoint._shardfile import _DTYPES
from distconv.checkpoint._sections import RANK_EXTRA, ModuleSection, Section, sections_for
from distconv.checkpoint._tree import flatten, tensor_keys, unflatten
from distconv.comm import Communicator
from distconv.nn.sharding import ShardSpec

__all__ = ["consolidate", "load", "load_global_state_dict"]


def load(
    model: Any,
    path: str | os.PathLike[str],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    states: Mapping[str, Any] | None = None,
    strict: bool = True,
    verify: bool = False,
    rank_extra: bool = False,
    comm: Communicator | None = None,
) -> Any:
    """Load a checkpoint written by :func:`save` onto ``model``'s layout, whatever it was saved on.

    Not collective: each rank reads, lazily (``safe_open(...).get_slice``), only the parts of the
    saved shards that intersect the blocks it holds now, as the loading model's
    :class:`~distconv.nn.sharding.ShardSpec` s say (any grid, algorithm and world size, or one
    process). Values are copied bit for bit. Nothing is unpickled.

    Args:
        model: the ``nn.Module`` (or :class:`~distconv.checkpoint.Shardable`) to load into.
        path: the checkpoint directory.
        optimizer: a ``torch.optim.Optimizer`` over ``model``'s parameters, with the same param
            groups (by parameter name) as the saved one; its state and hyperparameters are
            replaced. Default ``None`` (the saved optimizer state, if any, is not read).
        states: named :class:`~distconv.checkpoint.Shardable` objects saved with ``states=``;
            each one's ``shard_specs()`` gives the layout it loads onto. Default ``None``.
        strict: the model's tensors and the checkpoint's must match key for key. With ``False``
            missing and unknown keys are skipped (as ``nn.Module.load_state_dict``). Default
            ``True``.
        verify: also check each shard read against its SHA-256 in the index, which reads every
            intersecting shard whole instead of only the needed box. Default ``False`` (file
            sizes, shapes and dtypes are always checked).
        rank_extra: also return this rank's ``rank_extra`` (what the rank of the same number
            passed to :func:`save`). Only on the world size that saved: on another the values
            belong to no rank of this world, so the load refuses, naming both sizes, before it
            changes anything; ``consolidate(path, section="rank_extra")`` then gives every
            saved rank's value (a list by rank) to redistribute. A checkpoint saved without
            ``rank_extra`` (or before it existed) gives ``None`` on any world size. Default
            ``False``.
        comm: the communicator whose rank and size ``rank_extra`` refers to (nothing is
            communicated). Default: the communicator of the first grid among ``model``'s
            specs, else ``distconv.comm.world()``.

    Returns:
        The ``extra`` saved with the checkpoint (``None`` if none); with ``rank_extra=True`` the
        pair ``(extra, this rank's rank_extra)``.

    Raises:
        CheckpointError (a ``ValueError``): no complete index at ``path``; a tensor missing from
            the checkpoint or unknown to the model; a different global shape or dtype; a missing,
            truncated or corrupt shard file (the message names the tensor); ``rank_extra`` asked
            of a checkpoint saved on another world size.
    """
    check_flag(strict, "strict")
    check_flag(rank_extra, "rank_extra")
    if comm is not None and not isinstance(comm, Communicator):
        raise TypeError(f"comm must be a distconv Communicator, got {type(comm).__name__}")
    sections = sections_for(model, optimizer, states)
    with _Files(as_path(path), verify=check_flag(verify, "verify")) as files:
        if rank_extra:  # refused on another world size before anything is loaded
            mine = _rank_entry(files, comm if comm is not None else _model_comm(sections[0]))
        for section in sections:
            _load_section(section, files, strict)
        extra = sections[-1].loaded  # type: ignore[attr-defined]
        if not rank_extra:
            return extra
        return extra, None if mine is None else unflatten(
            mine, lambda key: files.read(f"{RANK_EXTRA}/{key}", None).clone())


def load_global_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True
) -> None:
    """Load a plain single-process ``state_dict`` (global tensors) into a parallel ``model``:
    every rank copies the block its :class:`~distconv.nn.sharding.ShardSpec` s give it
    (``t[dist.local_slices(global_shape, grid)]``). Not collective; bitwise.

    Raises:
        CheckpointError (a ``ValueError``): a missing or unknown key (when ``strict``, default
            ``True``), or a tensor whose global shape or dtype differs from the model's.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
    check_flag(strict, "strict")
    _load_section(ModuleSection("model", model), _Memory(state_dict), strict)


def consolidate(path: str | os.PathLike[str], *, section: str = "model", verify: bool = False):
    """The global state of one section of a checkpoint, on one process, without communication.

    ``consolidate(path)`` is the plain ``state_dict`` of the whole model (global tensors keyed as
    in ``nn.Module.state_dict()``), ready for a single-process ``nn.Module``; another
    ``section`` (``"optimizer"``, ``"extra"`` or a name given to ``states=``) returns that state,
    tensors global. ``verify`` as in :func:`load` (default ``False``).
    """
    if not isinstance(section, str):
        raise TypeError(f"section must be a str, got {section!r}")
    with _Files(as_path(path), verify=check_flag(verify, "verify")) as files:
        tree = files.tree(section)
        return unflatten(tree, lambda key: files.read(f"{section}/{key}", None))


def _model_comm(section: Section) -> Communicator:
    for spec in section.specs().values():
        if spec.grid is not None:
            return spec.grid.comm
    from distconv.comm import world

    return world()


def _rank_entry(files: _Files, comm: Communicator) -> Any:
    """The tree of this rank's ``rank_extra`` (None if the checkpoint has none); raises on a
    world of another size."""
    section = files.index["sections"].get(RANK_EXTRA)
    if section is None:
        return None
    saved = files.index.get("world_size")
    if saved != comm.size:
        raise CheckpointError(
            f"rank_extra: {files.where} was saved on {saved} ranks and this world has "
            f"{comm.size}: each saved value belongs to a rank of the saving world. Read them all "
            f"with distconv.consolidate(path, section={RANK_EXTRA!r}) (a list of {saved}, one per "
            "saved rank) and give each rank of this world what it needs"
        )
    entries = section.get("list") if isinstance(section, dict) else None
    if not isinstance(entries, list) or len(entries) != saved:
        raise CheckpointError(f"{files.where}: the {RANK_EXTRA!r} section is malformed (not a "
                              f"list of {saved} entries, one per saved rank)")
    return entries[comm.rank]


def _load_section(section: Section, source: Any, strict: bool) -> None:
    tree = source.tree(section.name)
    saved = tensor_keys(tree)
    current = section.current()
    if section.strict_keys() and strict:
        missing = [k for k in current if k not in saved]
        unknown = [k for k in saved if k not in current]
        if missing:
            raise CheckpointError(
                f"{section.name}: tensor {missing[0]!r} is missing from {source.where}"
                + (f" (and {len(missing) - 1} more: {missing[1:]})" if len(missing) > 1 else "")
            )
        if unknown:
            raise CheckpointError(
                f"{section.name}: {source.where} holds tensors the {section.name} does not have: "
                f"{unknown}; pass strict=False to skip them"
            )
    specs = section.specs()
    local: dict[str, torch.Tensor] = {}
    wanted: list[tuple[str, str, ShardSpec, torch.Tensor | None, torch.dtype]] = []
    for key in saved:  # every tensor checked before any is read
        if section.strict_keys() and key not in current:
            continue
        full = f"{section.name}/{key}"
        shape, dtype = source.meta(full)
        spec = section.target(key, shape, specs)
        have = current.get(key)
        _check(full, shape, dtype, spec, have)
        wanted.append((key, full, spec, have, dtype))
    for key, full, spec, have, dtype in wanted:
        box = _box(spec)
        # a block assembled from several shards goes straight into the tensor it restores
        # (one copy, not two: restoring it onto itself copies nothing), unless every shard is
        # to be hash-checked first
        into = have if (isinstance(have, torch.Tensor) and have.device.type == "cpu"
                        and have.dtype == dtype and not getattr(source, "verify", True)
                        and tuple(have.shape) == tuple(b - a for a, b in box)) else None
        out = source.read(full, box, into=into)
        local[key] = out if have is None else out.to(have.device)
    skipped = object()  # tensors of the checkpoint the model lacks (strict=False)
    state = unflatten(tree, lambda k: local.get(k, skipped))
    if isinstance(state, dict):
        state = {k: v for k, v in state.items() if v is not skipped}
    section.restore(state, strict=strict)


def _check(key: str, shape: tuple[int, ...], dtype: torch.dtype, spec: ShardSpec,
           have: torch.Tensor | None) -> None:
    if shape != spec.global_shape:
        raise CheckpointError(
            f"tensor {key!r}: the checkpoint's global shape {shape} differs from "
            f"{spec.global_shape}, the shape being loaded into"
        )
    if have is not None and have.dtype != dtype:
        raise CheckpointError(
            f"tensor {key!r}: the checkpoint holds {dtype}, the tensor being loaded into is "
            f"{have.dtype}"
        )
    if have is not None and tuple(have.shape) != spec.local_shape:
        raise CheckpointError(
            f"tensor {key!r}: local shape {tuple(have.shape)} does not match its spec "
            f"{spec.dist} ({spec.local_shape})"
        )


def _box(spec: ShardSpec) -> Box:
    if spec.grid is None:
        return tuple((0, n) for n in spec.global_shape)
    if spec.dist.pending:
        raise ValueError(f"a pending sum ({spec.dist}) cannot be loaded into")
    return tuple((s, s + n) for s, n in spec.dist.blocks(spec.global_shape, spec.grid))


class _Memory:
    """Global tensors in memory (a plain state_dict) as a source of boxes."""

    where = "the state_dict"

    def __init__(self, state_dict: Mapping[str, Any]) -> None:
        self._tree, self.tensors = flatten(dict(state_dict), where="state_dict")

    def tree(self, name: str) -> Any:
        return self._tree

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        t = self.tensors[key.split("/", 1)[1]]
        return tuple(t.shape), t.dtype

    def read(self, key: str, box: Box, into: torch.Tensor | None = None) -> torch.Tensor:
        t = self.tensors[key.split("/", 1)[1]]
        return t.detach()[tuple(slice(a, b) for a, b in box)].clone()


class _Files:
    """A checkpoint directory as a source of boxes: safetensors files opened once, read lazily."""

    def __init__(self, path: Path, *, verify: bool) -> None:
        self.path, self.verify = path, verify
        self.where = f"the checkpoint at {str(path)!r}"
        self.index = read_index(path)
        self.entries: dict[str, TensorEntry] = {}
        self.handles: dict[str, Any] = {}
        self.verified: set[tuple[str, str]] = set()
        self.stack = ExitStack()

    def __enter__(self) -> _Files:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()

    def tree(self, name: str) -> Any:
        if name not in self.index["sections"]:
            raise CheckpointError(
                f"{self.where} has no {name!r} section; it holds "
                f"{sorted(self.index['sections'])}"
            )
        return self.index["sections"][name]

    def entry(self, key: str) -> TensorEntry:
        if key not in self.entries:
            raw = self.index["tensors"].get(key)
            if raw is None:
                raise CheckpointError(f"tensor {key!r} is missing from {self.where}'s index")
            self.entries[key] = TensorEntry.parse(key, raw, self.index["files"])
        return self.entries[key]

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        e = self.entry(key)
        return e.shape, e.dtype

    def read(self, key: str, box: Box | None, into: torch.Tensor | None = None) -> torch.Tensor:
        """The block ``box`` of tensor ``key`` (None: the whole tensor), from the shards that
        intersect it: a view of the file's memory map where one shard holds the box (the caller
        copies it where it belongs), else assembled from the parts with one copy each, into
        ``into`` where given (a tensor of the box's shape and the entry's dtype)."""
        e = self.entry(key)
        box = tuple((0, n) for n in e.shape) if box is None else box
        if volume(box) == 0:
            return torch.empty([b - a for a, b in box], dtype=e.dtype)
        touched = [s for s in e.shards if intersect(box, s.box) is not None]
        if len(touched) == 1 and intersect(box, touched[0].box) == box:
            # one shard holds the whole box (the same layout loading): no block to assemble
            (shard,) = touched
            return self._part(e, shard, tuple(slice(a - s, b - s)
                                              for (a, b), (s, _) in zip(box, shard.box)))
        out = into if into is not None else torch.empty([b - a for a, b in box], dtype=e.dtype)
        for shard in touched:
            part = intersect(box, shard.box)
            if part is None:
                continue
            src = tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(part, shard.box))
            dst = tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(part, box))
            out[dst] = self._part(e, shard, src)
        return out

    def _part(self, e: TensorEntry, shard: Any, src: tuple[slice, ...]) -> torch.Tensor:
        """The part ``src`` of a shard: a view into the file's private memory map (no copy; the
        map lives as long as a view of it), its whole tensor hash-checked first with ``verify``."""
        tensors, (mapped, base) = self._open(e.key, shard.file)
        where = f"tensor {e.key!r}: shard {shard.box} in {shard.file!r}"
        want = tuple(b - a for a, b in shard.box)
        info = tensors.get(shard.key)
        if not isinstance(info, dict):
            raise CheckpointError(f"{where} cannot be read: the file has no tensor {shard.key!r}")
        dtype = _SAFETENSORS_DTYPES.get(info.get("dtype"))
        shape = tuple(info.get("shape", ()))
        if shape != want:
            raise CheckpointError(f"{where} has shape {shape}, the index says {want}")
        if dtype != e.dtype:
            raise CheckpointError(f"{where} holds {info.get('dtype')}, the index says {e.dtype}")
        start, stop = (int(v) for v in info["data_offsets"])
        count = math.prod(shape)
        if stop - start != count * dtype.itemsize or base + stop > len(mapped):
            raise CheckpointError(f"{where} cannot be read: its byte range {start}..{stop} does "
                                  "not hold it")
        whole = (torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + start)
                 if count else torch.empty(0, dtype=dtype)).view(shape)
        if self.verify and (shard.file, shard.key) not in self.verified:
            digest = hashlib.sha256(whole.reshape(-1).view(torch.uint8).numpy()).hexdigest()
            if digest != shard.sha256:
                raise CheckpointError(f"{where} is corrupt: its SHA-256 differs from the index")
            self.verified.add((shard.file, shard.key))
        return whole[src] if src else whole

    def _open(self, key: str, name: str) -> tuple[dict[str, Any], tuple[mmap.mmap, int]]:
        """A shard file's header (tensor name -> dtype, shape, byte range) and its memory map with
        the offset of its data, opened once and checked against the index."""
        if name not in self.handles:
            file = self.path / name
            if not file.is_file():
                raise CheckpointError(f"tensor {key!r}: shard file {str(file)!r} is missing")
            size, recorded = file.stat().st_size, self.index["files"][name].get("size")
            if size != recorded:
                raise CheckpointError(
                    f"tensor {key!r}: shard file {str(file)!r} has {size} bytes, the index "
                    f"records {recorded} (truncated or replaced)"
                )
            try:
                with open(file, "rb", buffering=0) as f:
                    (length,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(length))
                    if not isinstance(header, dict) or 8 + length > size:
                        raise ValueError("the header does not fit the file")
                    # a private copy-on-write map: writable for torch.frombuffer, never written;
                    # unmapped when the last tensor viewing it goes (never closed by hand)
                    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except Exception as exc:
                raise CheckpointError(
                    f"tensor {key!r}: shard file {str(file)!r} cannot be read: {exc}"
                ) from None
            self.handles[name] = (header, (mapped, 8 + length))
        return self.handles[name]


#: safetensors dtype name -> torch dtype
_SAFETENSORS_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}
