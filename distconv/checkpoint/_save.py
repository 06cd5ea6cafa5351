"""``save``: every rank writes its share of the blocks; rank 0 writes the index last."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path
from collections.abc import Callable
from typing import Any, Mapping

import torch

from distconv.checkpoint._async import (
    FAILED_NAME, SaveHandle, await_index, await_records, record_name, report, reusable, start,
    wait_previous,
)
from distconv.checkpoint._index import (
    FORMAT, INDEX_NAME, VERSION, CheckpointError, TensorEntry, as_path, check_flag, dtype_name,
    shard_file_name, sync_dir, write_atomic,
)
from distconv.checkpoint._plan import Piece, assign, blocks_of
from distconv.checkpoint._sections import RANK_EXTRA, Section, sections_for
from distconv.checkpoint._shardfile import _DTYPES, write_shard_file
from distconv.checkpoint._tree import flatten
from distconv.comm import Communicator
from distconv.distribution import Dist
from distconv.memo import BoundedMemo
from distconv.nn.sharding import ShardSpec

__all__ = ["SaveHandle", "save"]

#: Every tensor to save by full key (``section/flat key``): its local value and its spec.
Items = dict[str, tuple[torch.Tensor, ShardSpec]]


def save(
    model: Any,
    path: str | os.PathLike[str],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    states: Mapping[str, Any] | None = None,
    extra: Any = None,
    rank_extra: Any = None,
    comm: Communicator | None = None,
    async_save: bool = False,
) -> SaveHandle | None:
    """Write a sharded checkpoint of ``model`` (and optionally more state) to directory ``path``.

    Collective: every rank calls it with the same structure of state. Every block of every tensor
    is written exactly once, by the ranks that hold it (:mod:`distconv.checkpoint._plan`): a block
    held by several ranks (``w[*,o_C]`` on ``{N:2, C:2}`` is held by both ranks of each ``C``
    coordinate; every weight of a sample-parallel model and every tensor without a grid by all
    ranks) goes whole to the least loaded of its holders, or, from 1 MiB, is cut into contiguous
    row ranges, one per holder, so the bytes are spread evenly over the ranks. Each rank writes
    one safetensors file (straight from the tensors' memory, SHA-256 computed alongside); the JSON
    index (global shape, dtype, Dist in the paper's notation, grid layout, each shard's file, key,
    index box and SHA-256) is written by rank 0 last, after every rank's file is durable
    (written, ``fsync``'d and renamed). An older index at ``path`` is removed first, so an
    interrupted save leaves no index and is never loaded as whole.

    With ``async_save=True`` the agreement between the ranks and a copy of this rank's share of
    the state into host memory (a snapshot: later optimizer steps do not change what is written)
    happen before ``save`` returns a :class:`SaveHandle`; the files are written by a background
    thread while training goes on, and the index still appears last. A save called while an
    asynchronous one is in flight on the same communicator first waits for it. The host copy is
    kept and reused by the next asynchronous save of the same ``model`` (fresh memory costs
    several times the copy), so it costs one rank's share of the state for the model's life.

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
        rank_extra: this rank's own plain values (the same kinds as ``extra``), e.g. its random
            generators and data position: ``{"rng": distconv.rng_state()}``. Each rank passes
            its own; they may differ in value and in structure. Each rank's value is stored
            beside its shards, and ``load(..., rank_extra=True)`` hands it back to the rank of
            the same number (on the world size that saved), ``consolidate(path,
            section="rank_extra")`` gives every rank's, as a list by rank. Default ``None``
            (on every rank: nothing rank-specific is stored).
        comm: the communicator of all ranks. Default: the communicator of the first grid among
            the tensors' specs, else ``distconv.comm.world()``.
        async_save: return as soon as the state is copied, and write in the background.
            Default ``False`` (return when the checkpoint is complete).

    Returns:
        ``None``, or with ``async_save`` a :class:`SaveHandle`: ``wait()`` blocks until the
        checkpoint is complete on every rank and raises the save's failure; ``done()`` polls. A
        failure not seen through ``wait()`` is raised by the next ``save`` on every rank.

    Raises:
        ValueError: a local tensor that does not match its spec, or a pending sum (``Σ``).
        TypeError: state, ``extra`` or ``rank_extra`` that is not tensors and plain values, or
            a tensor of a dtype safetensors cannot hold.
        CheckpointError (a ``ValueError``): on every other rank when one rank fails (naming it
            and its error), when the ranks disagree on the state (its structure, plain values,
            dtypes, global shapes or distributions), or when the previous asynchronous save
            failed.
    """
    path = as_path(path)
    check_flag(async_save, "async_save")
    if comm is not None and not isinstance(comm, Communicator):
        raise TypeError(f"comm must be a distconv Communicator, got {type(comm).__name__}")
    got: dict[str, Any] = {}

    def collect() -> dict[str, Any]:
        wait_previous(comm)
        if not got:
            got["trees"], got["items"] = _collect(sections_for(model, optimizer, states, extra))
        _check_grids(got["items"], comm)
        got["rank_tree"], got["rank_tensors"] = _rank_extra(rank_extra, comm.rank)
        # what every rank must agree on: the structure, plain values and tensor layouts
        got["meta"] = _metadata(got["items"])
        agreed = json.dumps([got["trees"], got["meta"]], sort_keys=True).encode()
        got["pieces"] = _plan(got["items"], comm.size)
        if not async_save:
            got["mine"] = [*_own(got["pieces"], got["items"], comm.rank, snapshot=None),
                           *_own_rank_extra(got["rank_tensors"], copy=False)]
        if comm.rank == 0:  # before the exchange, so before any rank can put a shard in place
            _clear(path)
        return {"meta": hashlib.sha256(agreed).hexdigest(), "token": secrets.token_hex(8)}

    if comm is None:  # the communicator comes from the state's grids: collect before agreeing
        got["trees"], got["items"] = _collect(sections_for(model, optimizer, states, extra))
        comm = _default_comm(got["items"])
    # Every phase ends with an exchange that also carries failures: a rank that fails raises its
    # own error and the others raise naming it, instead of waiting in the next collective.
    if async_save:
        agreed = _snapshot_while_agreeing(comm, path, collect, got, model)
    else:
        agreed = _together(comm, "collect the state", collect, small=True)
    if len({r["meta"] for r in agreed}) > 1:
        raise CheckpointError(
            "checkpoint.save: the ranks disagree on the state to save (keys, plain values, "
            "dtypes, global shapes or distributions differ); every rank must save the same "
            "structure, and the same plain values in extra= (pass values that differ "
            "between the ranks as rank_extra=)"
        )
    job = _Job(path, comm.rank, comm.size, agreed[0]["token"], got)
    if async_save:
        timeout = float(getattr(comm, "timeout", 600.0))
        handle = SaveHandle(path, comm.rank, job.mine, lambda: job.background(timeout), model)
        return start(comm, handle)
    records = _together(comm, "write the shards", job.write_own)
    _together(comm, "write the index", lambda: job.finish(records) if comm.rank == 0 else None)
    return None


class _Job:
    """The file writing of one save on one rank, the same whether it runs now or later."""

    def __init__(self, path: Path, rank: int, size: int, token: str, got: dict[str, Any]) -> None:
        self.path, self.rank, self.size, self.token = path, rank, size, token
        self.trees, self.meta, self.pieces = got["trees"], got["meta"], got["pieces"]
        self.mine: list[tuple[str, torch.Tensor]] = got["mine"]
        # this rank's rank_extra for the index: its tree, and its tensors' dtypes and shapes
        self.rank_extra = None if got["rank_tree"] is None else {
            "tree": got["rank_tree"],
            "tensors": {k: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
                        for k, t in got["rank_tensors"].items()},
        }

    def write_own(self) -> dict[str, Any]:
        own: dict[str, Any] = {} if self.rank_extra is None else {"rank_extra": self.rank_extra}
        if not self.mine:
            return {"file": None, **own}
        name = shard_file_name(self.rank, self.size)
        size, digests = write_shard_file(
            self.path / name, self.mine, {"format": "pt", FORMAT: str(VERSION)}
        )
        return {"file": name, "size": size, "sha256": digests, **own}

    def finish(self, records: list[dict[str, Any]]) -> None:
        """Rank 0, once every rank's file is durable: the index, then the stale files go."""
        index = _index(self.trees, self.meta, self.pieces, records, self.size, self.token)
        write_atomic(self.path / INDEX_NAME, json.dumps(index, indent=1).encode())
        _remove_stale(self.path, set(index["files"]))

    def background(self, timeout: float) -> None:
        try:
            record = self.write_own()
            if self.rank == 0:
                self.finish([record, *await_records(self.path, self.size, self.token, timeout)])
                for r in range(1, self.size):
                    (self.path / record_name(r)).unlink(missing_ok=True)
                return
        except Exception as exc:
            failure = {"token": self.token, "error": f"{type(exc).__name__}: {exc}"}
            try:
                report(self.path, FAILED_NAME if self.rank == 0 else record_name(self.rank),
                       failure)
            except OSError:
                pass  # the others then stop at their timeout
            raise
        report(self.path, record_name(self.rank), {**record, "token": self.token})
        await_index(self.path, self.token, timeout)


def _together(comm: Communicator, what: str, step: Any, *,
              small: bool = False) -> list[dict[str, Any]]:
    """Run ``step()`` on every rank and exchange its record; raise on all ranks if any failed."""
    return _begin_together(comm, what, step, small=small)[1]()


def _begin_together(
    comm: Communicator, what: str, step: Any, *, small: bool = False
) -> tuple[bool, Callable[[], list[dict[str, Any]]]]:
    """Run ``step()`` and start exchanging its record: whether it succeeded here, and the
    function that waits for every rank's record (raising on all ranks if any failed). A
    ``small`` record (a digest and a token) goes in one collective, any other in two."""
    failure: Exception | None = None
    try:
        record = step() or {}  # type: ignore[func-returns-value]
    except Exception as exc:
        failure = exc
        record = {"error": f"rank {comm.rank}: {type(exc).__name__}: {exc}"}
    exchange = (_start_small_json(comm, record, what) if small
                else lambda: _allgather_json(comm, record, what))

    def finish() -> list[dict[str, Any]]:
        records = exchange()
        if failure is not None:
            raise failure
        errors = [r["error"] for r in records if "error" in r]
        if errors:
            raise CheckpointError(f"checkpoint.save could not {what}: " + "; ".join(errors))
        return records

    return failure is None, finish


def _snapshot_while_agreeing(comm: Communicator, path: Path, collect: Callable[[], Any],
                             got: dict[str, Any], model: Any) -> list[dict[str, Any]]:
    """The asynchronous save's critical path: collect the state, start the exchange that agrees
    on it, copy this rank's share into host memory while the exchange is in flight, then wait.

    The copy comes after the exchange has started, so a copy that fails cannot travel in it:
    this rank raises its error, and writes it where the other ranks' writers look for their
    peers' reports (``.rank-RRRRR.json``, or ``.failed.json`` on rank 0), so their saves fail at
    their next ``wait()`` or ``save`` naming it, and no index is written."""
    ok, finish = _begin_together(comm, "collect the state", collect, small=True)
    failure: Exception | None = None
    if ok:
        try:
            got["mine"] = [*_own(got["pieces"], got["items"], comm.rank,
                                 snapshot=reusable(model)),
                           *_own_rank_extra(got["rank_tensors"], copy=True)]
        except Exception as exc:
            failure = exc
    agreed = finish()
    if failure is not None:
        error = {"token": agreed[0]["token"],
                 "error": f"rank {comm.rank}: {type(failure).__name__}: {failure}"}
        try:
            report(path, FAILED_NAME if comm.rank == 0 else record_name(comm.rank), error)
        except OSError:
            pass  # the others then stop at their timeout, naming this rank
        raise failure
    return agreed


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
            if tuple(t.shape) != _local_shape(spec):
                raise ValueError(
                    f"tensor {full!r} has local shape {tuple(t.shape)} but its spec "
                    f"{spec.dist} of global shape {spec.global_shape} gives {spec.local_shape}"
                )
            items[full] = (t, spec)
    return trees, items


#: the local shape of each layout saved (working it out costs most of collecting the state)
_LOCAL_SHAPES: BoundedMemo[tuple[int, ...]] = BoundedMemo(4096)


def _local_shape(spec: ShardSpec) -> tuple[int, ...]:
    if spec.grid is None:
        return spec.global_shape
    key = (spec.dist, spec.global_shape, spec.grid.layout, spec.grid.rank)
    return _LOCAL_SHAPES.get(key, lambda: spec.local_shape)


def _rank_extra(value: Any, rank: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """This rank's ``rank_extra`` as its entry of the ``rank_extra`` section (a list by rank):
    its tree, and its tensors by full key (``rank_extra/<rank>/<key>``); ``(None, {})`` for
    ``None``."""
    if value is None:
        return None, {}
    tree, tensors = flatten(value, where="rank_extra", under=rank)
    for key, t in tensors.items():
        if t.dtype not in _DTYPES:
            name = key.partition("/")[2] or "(top)"
            raise TypeError(f"rank_extra: tensor {name!r} has dtype {t.dtype}, which a "
                            f"checkpoint cannot hold (it holds "
                            f"{', '.join(sorted(dtype_name(d) for d in _DTYPES))})")
    return tree, {f"{RANK_EXTRA}/{k}": t for k, t in tensors.items()}


def _own_rank_extra(tensors: dict[str, torch.Tensor], *,
                    copy: bool) -> list[tuple[str, torch.Tensor]]:
    """This rank's ``rank_extra`` tensors as contiguous CPU tensors (copies with ``copy``)."""
    out = []
    for key, t in tensors.items():
        t = t.detach()
        if copy or t.device.type != "cpu" or not t.is_contiguous():
            t = torch.empty(t.shape, dtype=t.dtype).copy_(t)
        out.append((key, t))
    return out


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
    try:
        (path / INDEX_NAME).unlink()
    except FileNotFoundError:
        pass
    else:
        sync_dir(path)  # the old index is gone for good before any new shard replaces its own
    with os.scandir(path) as entries:
        stale = [e.name for e in entries if e.name == FAILED_NAME or (
            e.name.startswith(".") and e.name.endswith(".tmp"))
            or (e.name.startswith(".rank-") and e.name.endswith(".json"))]
    for name in stale:
        (path / name).unlink(missing_ok=True)


def _remove_stale(path: Path, keep: set[str]) -> None:
    for f in path.glob("shard-*-of-*.safetensors"):
        if f.name not in keep:
            f.unlink(missing_ok=True)


#: the plans of the last layouts saved (a step's saves repeat); thread ranks share it
_PLANS: BoundedMemo[list[Piece]] = BoundedMemo(8)


def _plan(items: Items, size: int) -> list[Piece]:
    """Who writes which block: a pure function of the layouts, cached by them."""
    key = (size, tuple((k, spec.global_shape, spec.dist, None if spec.grid is None else
                        spec.grid.layout, t.element_size()) for k, (t, spec) in items.items()))
    return _PLANS.get(key, lambda: assign([b for k, (t, spec) in items.items()
                                          for b in blocks_of(k, spec, t.element_size(), size)],
                                         size))


def _own(pieces: list[Piece], items: Items, rank: int, *,
         snapshot: dict[Any, torch.Tensor] | None) -> list[tuple[str, torch.Tensor]]:
    """This rank's pieces as contiguous CPU tensors; copies (into the reusable buffers given,
    where they fit) when ``snapshot`` is not None."""
    out = []
    for p in pieces:
        if p.rank != rank:
            continue
        t = items[p.key][0].detach()
        if p.rows is not None:
            t = t[p.rows[0]:p.rows[1]]
        if snapshot is not None or t.device.type != "cpu" or not t.is_contiguous():
            buf = (snapshot or {}).pop((p.key, tuple(t.shape), t.dtype), None)
            t = (torch.empty(t.shape, dtype=t.dtype) if buf is None else buf).copy_(t)
        out.append((p.key, t))
    return out


_DIST_TEXT: BoundedMemo[str] = BoundedMemo(4096)  # the index's text of each Dist saved


def _metadata(items: Items) -> dict[str, Any]:
    """Key, dtype, global shape, Dist and grid of each tensor."""
    out = {}
    for key, (t, spec) in items.items():
        # explicit grid dim names (o_C, never a bare o): the text parses without tensor_dims
        text = _DIST_TEXT.get(spec.dist, lambda: Dist(spec.dist.entries,
                                                      spec.dist.pending).format())
        out[key] = {"dtype": dtype_name(t.dtype), "shape": list(spec.global_shape), "dist": text,
                    "grid": None if spec.grid is None else [list(p) for p in spec.grid.layout]}
    return out


#: bytes of a small record's first exchange: a digest and a token fit, an error may not
_SMALL = 256


def _start_small_json(comm: Communicator, record: dict[str, Any],
                      what: str) -> Callable[[], list[dict[str, Any]]]:
    """Start exchanging a small record in one fixed-width allgather; the function returned waits
    for every rank's. A record that does not fit (a long error) is sent again, whole, by
    :func:`_allgather_json` on every rank (each rank sees that one did not fit)."""
    data = json.dumps(record).encode()
    first = data if len(data) <= _SMALL else b'{"long": true}'
    device = getattr(comm, "_device", torch.device("cpu"))  # NCCL moves only CUDA tensors
    buf = torch.frombuffer(bytearray(first.ljust(_SMALL)), dtype=torch.uint8).to(device)
    work = comm.allgather(buf, async_op=True, meta=f"checkpoint.save: {what}")

    def wait() -> list[dict[str, Any]]:
        records = [json.loads(p.cpu().numpy().tobytes()) for p in work.wait()]
        if any(r.get("long") for r in records):
            return _allgather_json(comm, record, what)
        return records

    return wait


def _allgather_json(comm: Communicator, record: dict[str, Any], what: str) -> list[dict[str, Any]]:
    data = json.dumps(record).encode()
    device = getattr(comm, "_device", torch.device("cpu"))  # NCCL moves only CUDA tensors
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [int(s.item()) for s in comm.allgather(n, meta=f"checkpoint.save: {what}")]
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    parts = comm.allgather(buf, shapes=[(s,) for s in sizes], meta=f"checkpoint.save: {what}")
    return [json.loads(p.cpu().numpy().tobytes()) for p in parts]


def _index(
    trees: dict[str, Any], meta: dict[str, Any], pieces: list[Piece],
    records: list[dict[str, Any]], size: int, token: str,
) -> dict[str, Any]:
    files = {r["file"]: {"size": r["size"]} for r in records if r["file"] is not None}
    tensors = {key: {**m, "shards": []} for key, m in meta.items()}
    for p in pieces:
        record = records[p.rank]
        tensors[p.key]["shards"].append({
            "file": record["file"], "key": p.key, "box": [list(b) for b in p.box],
            "sha256": record["sha256"][p.key],
        })
    sections = dict(trees)
    per_rank = [r.get("rank_extra") for r in records]
    if any(v is not None for v in per_rank):
        # one entry per rank, its tensors in its own file, each held whole by that file
        sections[RANK_EXTRA] = {"list": [{"value": None} if v is None else v["tree"]
                                         for v in per_rank]}
        for record, value in zip(records, per_rank):
            for key, m in ({} if value is None else value["tensors"]).items():
                tensors[key] = {**m, "dist": Dist.replicated(len(m["shape"])).format(),
                                "grid": None, "shards": [{
                                    "file": record["file"], "key": key,
                                    "box": [[0, n] for n in m["shape"]],
                                    "sha256": record["sha256"][key]}]}
    for key, raw in tensors.items():
        raw["shards"].sort(key=lambda s: s["box"])
        TensorEntry.parse(key, raw, files)  # the shards tile every tensor exactly once
    return {
        "format": FORMAT, "version": VERSION, "world_size": size, "files": files,
        "sections": sections, "tensors": tensors, "token": token,
    }
