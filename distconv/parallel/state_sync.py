"""Every rank starts from rank 0's model: DDP's construction-time guarantee, on our Communicator.

``parallelize`` calls :func:`sync_module_states` on its own copy of the model, before it shards
anything. A model built on every rank with its own seed would otherwise train without a word as
a mix of several initialisations, and diverge from the single-process run. The state is taken
from rank 0 *before* sharding, whole, so every rank then cuts its blocks out of the same (rank
0's) tensors: a sharded parameter ``w[o_F,o_C]`` gets rank 0's values in every block, which a
broadcast of the shards over their redundant dims could not give (it would assemble one model
from the blocks of several ranks' initialisations). The bytes are DDP's: the model's parameters
and buffers, once, from rank 0, in a few coalesced broadcasts.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

__all__ = ["BROADCAST_BUCKET_BYTES", "sync_module_states"]

#: the most bytes of state one coalesced broadcast carries (DDP's construction bucket is 250 MiB)
BROADCAST_BUCKET_BYTES = 256 << 20


def _state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters and buffers, each tensor once (tied ones under their first name),
    in the module's order; meta and uninitialised (lazy) tensors hold no values to send."""
    out, seen = [], set()
    named = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    for name, t in named:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        if t.is_meta or isinstance(t, nn.parameter.UninitializedTensorMixin):
            continue
        out.append((name, t))
    return out


def _check_same_structure(comm: Any, state: list[tuple[str, torch.Tensor]]) -> None:
    """One small allgather of a digest of (name, shape, dtype) of every tensor: ranks that built
    different models get a ``ValueError`` before any broadcast could pair mismatched buffers."""
    text = "\n".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in state)
    digest = hashlib.sha256(text.encode()).digest()[:8]
    local = torch.tensor(list(digest), dtype=torch.int64)
    digests = comm.host.allgather(local, meta="parallelize: the model's state, names and shapes")
    differ = [r for r, d in enumerate(digests) if not torch.equal(d, digests[0])]
    if differ:
        raise ValueError(
            f"build the same model on every rank before parallelize: ranks {differ} hold "
            "parameters or buffers (names, shapes or dtypes) other than rank 0's, so rank 0's "
            "values cannot be broadcast to them")


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if not out or size + n > BROADCAST_BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return out


@torch.no_grad()
def sync_module_states(model: nn.Module, comm: Any) -> None:
    """Copy rank 0's parameters and buffers into ``model`` on every rank of ``comm``
    (collective), bit for bit: one allgather of an 8-byte digest of the names, shapes and dtypes,
    then the state in coalesced broadcasts from rank 0 (one per device and dtype, of at most
    :data:`BROADCAST_BUCKET_BYTES` each). Ranks that already hold rank 0's values
    keep them unchanged: a broadcast copies bits, so identical seeding stays exact.

    Raises:
        ValueError: the ranks' models differ in their parameters' or buffers' names, shapes
            or dtypes.
    """
    if comm.size == 1:
        return
    state = _state(model)
    _check_same_structure(comm, state)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for _, t in state:
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    for (device, dtype), tensors in groups.items():
        # a device the communicator moves goes straight; others (CPU tensors beside NCCL, CUDA
        # tensors beside gloo) through the host
        on_comm = device == comm.device or (device.type == comm.device.type == "cuda")
        link = comm if on_comm else comm.host
        for bucket in _buckets(tensors):
            flat = torch.cat([t.detach().reshape(-1) for t in bucket])
            if dtype == torch.bool:
                flat = flat.view(torch.uint8)
            if not on_comm:
                flat = flat.cpu()
            flat = link.broadcast(flat, root=0,
                                  meta="parallelize: rank 0's parameters and buffers")
            if dtype == torch.bool:
                flat = flat.view(torch.bool)
            offset = 0
            for t in bucket:
                t.detach().copy_(flat[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()
