"""``save``: every rank writes its own shards; rank 0 writes the index last."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from distconv.checkpoint._index import (
    FORMAT, INDEX_NAME, VERSION, Box, CheckpointError, TensorEntry, dtype_name,
    as_path, shard_file_name, sync_dir, volume, write_atomic,
)
from distconv.checkpoint._sections import Section, sections_for
from distconv.checkpoint._tree import flatten
from distconv.comm import Communicator
from distconv.distribution import Dist
from distconv.nn.sharding import ShardSpec

__all__ = ["save"]

#: Every tensor to save by full key (``section/flat key``): its local value and its spec.
Items = dict[str, tuple[torch.Tensor, ShardSpec]]


def save(
    model: Any,
    path: str | os.PathLike[str],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    states: Mapping[str, Any] | None = None,
    extra: Any = None,
    comm: Communicator | None = None,
) -> None:
    """Write a sharded checkpoint of ``model`` (and optionally more state) to directory ``path``.

    Collective: every rank calls it with the same structure of state. Each rank writes only the
    blocks it holds: a tensor ``t[D]`` with a :class:`~distconv.nn.sharding.ShardSpec` over grid
    ``G`` is written by the ranks at coordinate 0 of the grid dims ``D`` is replicated over (e.g.
    ``w[*,o_C]`` on ``{N:2, C:2}``: the two ranks with ``N = 0`` write one ``o_C`` block each); a
    tensor replicated on every rank (``[*,...,*]``) is written once, by one rank (spread
    round-robin over the ranks). Shards go to one safetensors file per rank; the JSON index
    (global shape, dtype, Dist in the paper's notation, grid layout, each shard's file, key, index
    box and SHA-256) is written by rank 0 after every rank's file is complete. Every file is
    written under a temporary name and renamed; an older index at ``path`` is removed first, so
    an interrupted save leaves no index and is never loaded as whole.

    Args:
        model: an ``nn.Module`` (its ``state_dict()`` laid out by
            :func:`~distconv.nn.sharding.shard_specs`) or any object with ``state_dict()``,
            ``load_state_dict()`` and optionally ``shard_specs()``
            (:class:`~distconv.checkpoint.Shardable`).
        path: the checkpoint directory (created if needed; an earlier checkpoint there is
            replaced).
        optimizer: a ``torch.optim.Optimizer`` over ``model``'s parameters. Its state is stored by
            parameter name; a state tensor shaped like its parameter takes the parameter's
            distribution, anything else (e.g. Adam's ``step``) is replicated. Default ``None``.
        states: more named :class:`~distconv.checkpoint.Shardable` objects (e.g. a K-FAC
            preconditioner: ``{"kfac": kfac}``). Default ``None``.
        extra: plain values (nested dicts / lists of numbers and strings, or tensors, replicated)
            returned by :func:`load`, e.g. ``{"epoch": 3}``; the same on every rank.
            Default ``None``.
        comm: the communicator of all ranks. Default: the communicator of the first grid among
            the tensors' specs, else ``distconv.comm.world()``.

    Raises:
        ValueError: a local tensor that does not match its spec, or a pending sum (``Σ``).
        TypeError: state that is not tensors and plain values.
        CheckpointError (a ``ValueError``): on every other rank when one rank fails (naming it
            and its error), or when the ranks disagree on the state (its structure, plain values,
            dtypes, global shapes or distributions).
    """
    path = as_path(path)
    if comm is not None and not isinstance(comm, Communicator):
        raise TypeError(f"comm must be a distconv Communicator, got {type(comm).__name__}")
    got: dict[str, Any] = {}

    def collect() -> None:
        if not got:
            got["trees"], got["items"] = _collect(sections_for(model, optimizer, states, extra))
        _check_grids(got["items"], comm)
        if comm.rank == 0:
            _clear(path)

    if comm is None:  # the communicator comes from the state's grids: collect before agreeing
        got["trees"], got["items"] = _collect(sections_for(model, optimizer, states, extra))
        comm = _default_comm(got["items"])
    # Every phase ends with an exchange that also carries failures: a rank that fails raises its
    # own error and the others raise naming it, instead of waiting in the next collective.
    _together(comm, "collect the state", collect)
    trees, items = got["trees"], got["items"]
    name = shard_file_name(comm.rank, comm.size)
    # what every rank must agree on: the structure, plain values and tensor layouts of the state
    agreed = json.dumps([trees, _metadata(items)], sort_keys=True).encode()
    digest = hashlib.sha256(agreed).hexdigest()
    records = _together(
        comm, "write the shards", lambda: {**_write_own(items, comm, path / name), "meta": digest}
    )
    index = _index(trees, items, records, comm.size)

    def write_index() -> None:
        if comm.rank == 0:
            write_atomic(path / INDEX_NAME, json.dumps(index, indent=1).encode())
            _remove_stale(path, set(index["files"]))

    _together(comm, "write the index", write_index)


def _together(comm: Communicator, what: str, step: Any) -> list[dict[str, Any]]:
    """Run ``step()`` on every rank and exchange its record; raise on all ranks if any failed."""
    failure: Exception | None = None
    try:
        record = step() or {}  # type: ignore[func-returns-value]
    except Exception as exc:
        failure = exc
        record = {"error": f"rank {comm.rank}: {type(exc).__name__}: {exc}"}
    records = _allgather_json(comm, record, what)
    if failure is not None:
        raise failure
    errors = [r["error"] for r in records if "error" in r]
    if errors:
        raise CheckpointError(f"checkpoint.save could not {what}: " + "; ".join(errors))
    return records


def _collect(sections: list[Section]) -> tuple[dict[str, Any], Items]:
    """The state tree of each section, and every tensor to save by full key
    (``section/flat key``) with its spec, checked."""
    trees: dict[str, Any] = {}
    items: Items = {}
    for section in sections:
        trees[section.name], tensors = flatten(section.state(), where=section.name)
        specs = section.specs()
        for key, t in tensors.items():
            full = f"{section.name}/{key}"
            spec = specs.get(key) or ShardSpec(None, Dist.replicated(t.dim()), tuple(t.shape))
            if spec.dist.pending:
                raise ValueError(
                    f"tensor {full!r} is a pending sum ({spec.dist}); only complete values can be "
                    "checkpointed"
                )
            if tuple(t.shape) != spec.local_shape:
                raise ValueError(
                    f"tensor {full!r} has local shape {tuple(t.shape)} but its spec "
                    f"{spec.dist} of global shape {spec.global_shape} gives {spec.local_shape}"
                )
            items[full] = (t, spec)
    return trees, items


def _default_comm(items: Items) -> Communicator:
    for _, spec in items.values():
        if spec.grid is not None:
            return spec.grid.comm
    from distconv.comm import world

    return world()


def _check_grids(items: Items, comm: Communicator) -> None:
    for key, (_, spec) in items.items():
        grid = spec.grid
        if grid is not None and (grid.size != comm.size or grid.rank != comm.rank):
            raise ValueError(
                f"tensor {key!r}: {grid!r} is not laid over the {comm.size} ranks of {comm!r}; "
                "a checkpoint's grids must span the communicator's ranks with the same numbering"
            )


def _clear(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise ValueError(f"path {str(path)!r} exists and is not a directory")
    path.mkdir(parents=True, exist_ok=True)
    (path / INDEX_NAME).unlink(missing_ok=True)
    sync_dir(path)
    for tmp in path.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def _remove_stale(path: Path, keep: set[str]) -> None:
    for f in path.glob("shard-*-of-*.safetensors"):
        if f.name not in keep:
            f.unlink(missing_ok=True)


def _box(spec: ShardSpec, coords: Mapping[str, int] | None = None) -> Box:
    if spec.grid is None:
        return tuple((0, n) for n in spec.global_shape)
    return tuple((s, s + n) for s, n in spec.dist.blocks(spec.global_shape, spec.grid, coords))


def _writes(spec: ShardSpec, replicated_index: int, comm: Communicator) -> bool:
    """Whether this rank writes ``spec``'s block: one replica of each block writes."""
    if spec.grid is None or spec.is_replicated:
        return replicated_index % comm.size == comm.rank
    coords = spec.grid.coords
    return all(coords[d] == 0 for d in spec.dist.redundant(spec.grid))


def _write_own(items: Items, comm: Communicator, file: Path):
    from safetensors.torch import save_file

    tensors, shards, storages, replicated = {}, {}, set(), 0
    for key, (t, spec) in items.items():
        mine = _writes(spec, replicated, comm)
        replicated += spec.grid is None or spec.is_replicated
        box = _box(spec)
        if not mine or volume(box) == 0:
            continue
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage().data_ptr()
        if storage in storages and t.numel():  # safetensors refuses tensors that share memory
            t = t.clone()
        storages.add(storage)
        tensors[key] = t
        digest = hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()
        shards[key] = {"key": key, "box": [list(b) for b in box], "sha256": digest}
    if not tensors:
        return {"file": None, "shards": {}}
    tmp = file.with_name(f".{file.name}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", FORMAT: str(VERSION)})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, file)
    return {"file": file.name, "size": file.stat().st_size, "shards": shards}


def _metadata(items: Items) -> dict[str, Any]:
    """Key, dtype, global shape, Dist and grid of each tensor."""
    return {
        key: {
            "dtype": dtype_name(t.dtype),
            "shape": list(spec.global_shape),
            # explicit grid dim names (o_C, never a bare o) so the text parses without tensor_dims
            "dist": Dist(spec.dist.entries, spec.dist.pending).format(),
            "grid": None if spec.grid is None else [list(p) for p in spec.grid.layout],
        }
        for key, (t, spec) in items.items()
    }


def _allgather_json(comm: Communicator, record: dict[str, Any], what: str) -> list[dict[str, Any]]:
    data = json.dumps(record).encode()
    device = getattr(comm, "_device", torch.device("cpu"))  # NCCL moves only CUDA tensors
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [int(s.item()) for s in comm.allgather(n, meta=f"checkpoint.save: {what}")]
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    parts = comm.allgather(buf, shapes=[(s,) for s in sizes], meta=f"checkpoint.save: {what}")
    return [json.loads(p.cpu().numpy().tobytes()) for p in parts]


def _index(
    trees: dict[str, Any], items: Items,
    records: list[dict[str, Any]], size: int,
) -> dict[str, Any]:
    meta = _metadata(items)
    digests = {r["meta"] for r in records}
    if len(digests) > 1:
        raise CheckpointError(
            "checkpoint.save: the ranks disagree on the state to save (keys, plain values, "
            "dtypes, global shapes or distributions differ); every rank must save the same "
            "structure, and the same plain values (rank-specific values are not kept)"
        )
    files = {r["file"]: {"size": r["size"]} for r in records if r["file"] is not None}
    tensors = {key: {**m, "shards": []} for key, m in meta.items()}
    for r in records:
        for key, shard in r["shards"].items():
            tensors[key]["shards"].append({"file": r["file"], **shard})
    for key, raw in tensors.items():
        TensorEntry.parse(key, raw, files)  # the shards tile every tensor exactly once
    return {
        "format": FORMAT, "version": VERSION, "world_size": size, "files": files,
        "sections": trees, "tensors": tensors,
    }
