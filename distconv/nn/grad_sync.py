"""Completion of sharded parameters' gradients over the grid dims they are replicated on.

A parameter whose distribution leaves some grid dims unused (e.g. a convolution weight under
sample or spatial parallelism) is replicated over those *redundant* dims; after backward each rank
holds only its own samples' / rows' contribution, a pending sum over the redundant dims. The sum is
completed by a segmented allreduce over them, started asynchronously the moment the local gradient
is ready (a tensor hook) and finished at the end of the backward pass (an autograd engine callback),
so ``loss.backward()`` returns with complete gradients and the reduction overlaps the rest of
backward where the backend allows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from distconv.nn.clip import mark_shard_grad

if TYPE_CHECKING:
    from distconv.nn.sharding import ShardSpec
    from distconv.parallel.placement import Layout

__all__ = ["BucketedGradSync", "GradSync", "GradSyncGroup", "finish_grad_sync", "gradient_groups",
           "plan_buckets", "redundant_sync"]


class GradSync:
    """Segmented allreduce of the gradients of some parameters over one communicator.

    Args:
        comm: communicator of the parameters' redundant grid dims (every rank of it holds the same
            shard).
        where: description used in collective metadata and errors.

    The contract: :meth:`register` a parameter once; during every backward pass that reaches it,
    its gradient's allreduce is started as soon as the local gradient is computed, and finished
    before ``backward()`` returns. Gradients accumulate across backward passes exactly as with
    plain PyTorch (each pass's contribution is reduced once). Call :meth:`finish` explicitly only
    when gradients were produced outside ``Tensor.backward`` (it is idempotent).
    """

    def __init__(self, comm: Any, *, where: str = "") -> None:
        self.comm = comm
        self.where = where
        self._arrived: dict[int, tuple[torch.Tensor, bool]] = {}
        self._pending: list[tuple[nn.Parameter, Any, bool]] = []
        self._next = 0  # allreduces start in registration order, whatever order hooks fire in
        self._queued = False
        self.params: list[nn.Parameter] = []
        self._handles: list[Any] = []

    def register(self, param: nn.Parameter) -> Any:
        """Start the allreduce of ``param``'s gradient whenever one is computed."""

        def hook(grad: torch.Tensor) -> torch.Tensor:
            first = param.grad is None
            self._arrived[id(param)] = (grad, first)
            if not self._queued:
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._launch()
            # The first contribution becomes .grad and is replaced by the complete sum in finish();
            # later ones must not add their local part to an already complete gradient.
            return grad if first else torch.zeros_like(grad)

        self.params.append(param)
        self._handles.append(param.register_hook(hook))
        return self._handles[-1]

    def _launch(self, flush: bool = False) -> None:
        """Start the allreduces of the gradients that arrived, in registration order: ranks
        pair collectives by order, and autograd's order of the hooks may differ between ranks
        (one rank's empty block takes another kernel's backward). ``flush``: also past a
        parameter this pass did not reach."""
        while self._next < len(self.params):
            param = self.params[self._next]
            got = self._arrived.pop(id(param), None)
            if got is None and not flush:
                return
            self._next += 1
            if got is not None:
                work = self.comm.allreduce(got[0].contiguous(), async_op=True,
                                           meta=f"gradient allreduce {self.where}")
                self._pending.append((param, work, got[1]))

    def detach(self) -> list[nn.Parameter]:
        """Stop synchronising (remove the hooks); returns the parameters it synchronised, for a
        model that takes their completion over (e.g. fused into buckets)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return self.params

    def finish(self) -> None:
        """Wait for every started allreduce and write the complete gradients."""
        self._launch(flush=True)
        pending, self._pending, self._queued = self._pending, [], False
        self._next, self._arrived = 0, {}
        for param, work, first in pending:
            total = work.wait()
            if first or param.grad is None:
                param.grad = total
                mark_shard_grad(param)
            else:
                param.grad.add_(total)

    def __repr__(self) -> str:
        return f"GradSync(comm size={self.comm.size}, where={self.where!r})"


def redundant_sync(grid: Any, dist: Any, where: str, params: Sequence[Any] = ()
                   ) -> GradSync | None:
    """The segmented allreduce that completes the gradients of parameters sharded as ``dist``
    on ``grid``: over the grid dims the Dist leaves redundant (extent > 1), registered for
    ``params`` (None entries skipped); None where no dim is redundant."""
    redundant = [d for d in dist.redundant(grid) if grid.extent(d) > 1]
    if not redundant:
        return None
    sync = GradSync(grid.subcomm(redundant), where=f"{where} over {'×'.join(redundant)}")
    for p in params:
        if p is not None:
            sync.register(p)
    return sync


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of the tensors of ``sizes`` (bytes, in registration order) per bucket: filled in
    reverse order, a new bucket whenever the next tensor would take one past ``bucket_bytes``
    (an empty tensor -- a rank's empty block -- joins the bucket it meets, the first one too)."""
    buckets: list[list[int]] = []
    size = 0
    for i in reversed(range(len(sizes))):
        if not buckets or (size + sizes[i] > bucket_bytes and buckets[-1]):
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += sizes[i]
    return buckets


def _unshared(t: torch.Tensor) -> bool:
    """Whether ``t`` is the only tensor on its memory (no view of it is alive anywhere)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:  # cannot tell: never reuse
        return False
    return count(t.untyped_storage()._cdata) <= 2  # t's own and this call's temporary


class BucketedGradSync:
    """Allreduce of many parameters' gradients over one communicator, fused into buckets.

    DDP's idea on a :class:`~distconv.comm.Communicator` (so on gloo and MPI alike): parameters
    are grouped, in reverse registration order (the order backward produces their gradients),
    into buckets of about ``bucket_bytes`` (one dtype and device each). Each gradient is copied
    into its slot of its bucket's flat buffer the moment its hook fires (autograd then keeps no
    second copy); a bucket's allreduce is started in place, asynchronously, once all its members
    arrived (buckets start in bucket order); every bucket is finished by an autograd engine
    callback before ``loss.backward()`` returns, and each ``.grad`` is then a view of its
    bucket's reduced buffer (no copy). A bucket's buffer is reused by the next pass only when
    nothing views it any more (after ``zero_grad()``, unless the user kept a gradient), so a
    gradient someone holds never changes under them; a second buffer serves
    ``zero_grad(set_to_none=False)`` and accumulation.

    A parameter a backward pass does not reach contributes zeros (every rank flushes the same
    buckets, so none waits on a peer), and a flag per parameter travels in its bucket: a parameter
    that no rank reached keeps its ``.grad`` as it was (``None`` stays ``None``, as on one process,
    so an optimizer skips it). Gradients accumulate over backward passes as in PyTorch (each
    pass's contribution is reduced once).

    Args:
        comm: communicator of the ranks that replicate the parameters.
        params: the parameters (each registered once; shared parameters once).
        bucket_bytes: target bucket size in bytes. Default 1 MiB.
        where: description used in collective metadata and errors.
    """

    def __init__(self, comm: Any, params: list[nn.Parameter], *, bucket_bytes: int = 1 << 20,
                 where: str = "") -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        self.comm, self.where, self.bucket_bytes = comm, where, bucket_bytes
        unique: list[nn.Parameter] = []
        for p in params:
            if p.requires_grad and all(p is not q for q in unique):
                unique.append(p)
        layout = plan_buckets([p.numel() * p.element_size() for p in unique], bucket_bytes)
        self.buckets: list[list[nn.Parameter]] = []
        for b in layout:  # a bucket is one flat tensor: one dtype and device
            for i in b:
                p = unique[i]
                last = self.buckets[-1][-1] if self.buckets and self.buckets[-1] else None
                if last is None or (last.dtype, last.device) != (p.dtype, p.device) or i == b[0]:
                    self.buckets.append([])
                self.buckets[-1].append(p)
        #: id(param) -> (bucket, index in it, offset in its flat buffer)
        self._slot: dict[int, tuple[int, int, int]] = {}
        self._sizes: list[int] = []
        for bi, b in enumerate(self.buckets):
            offset = 0
            for i, p in enumerate(b):
                self._slot[id(p)] = (bi, i, offset)
                offset += p.numel()
            self._sizes.append(offset)
        self._buffers: list[list[torch.Tensor]] = [[] for _ in self.buckets]
        self.enabled = True
        self._carry = False  # local gradients of unsynchronised passes wait in .grad
        self._reset()
        self._handles = [p.register_hook(self._hook(p)) for p in unique]

    def _reset(self) -> None:
        self._flat: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._reached: list[list[bool]] = [[False] * len(b) for b in self.buckets]
        self._count = [0] * len(self.buckets)
        self._first: dict[int, bool] = {}
        self._works: dict[int, Any] = {}
        self._next = 0  # buckets start in bucket order, whatever order their hooks fire in
        self._queued = False

    def _buffer(self, b: int) -> torch.Tensor:
        """This pass's flat buffer of bucket ``b`` (its gradients, then a flag per parameter):
        a kept one that nothing else references any more (no ``.grad`` and no tensor the user
        kept views it), else a new one."""
        for buf in self._buffers[b]:
            if _unshared(buf):
                return buf
        params = self.buckets[b]
        buf = torch.empty(self._sizes[b] + len(params), dtype=params[0].dtype,
                          device=params[0].device)
        if len(self._buffers[b]) < 2:
            self._buffers[b].append(buf)
        return buf

    def _put(self, param: nn.Parameter, grad: torch.Tensor, carried: torch.Tensor | None) -> None:
        """Copy ``grad`` (plus what earlier unsynchronised passes left) into its slot."""
        b, i, offset = self._slot[id(param)]
        flat = self._flat[b]
        if flat is None:
            flat = self._flat[b] = self._buffer(b)
        slot = flat[offset:offset + param.numel()].view_as(param)
        if carried is None:
            slot.copy_(grad)
        else:
            torch.add(grad, carried, out=slot)
        if not self._reached[b][i]:
            self._reached[b][i] = True
            self._count[b] += 1

    def _hook(self, param: nn.Parameter) -> Any:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if not self.enabled:  # accumulate locally; the next synchronised pass reduces it
                self._carry = True
                return grad
            if self._carry and param.grad is not None:  # reduce what waited, replace .grad
                self._first[id(param)] = True
                self._put(param, grad, param.grad)
                self._start(self._slot[id(param)][0])
                return grad
            first = param.grad is None
            self._first[id(param)] = first
            self._put(param, grad, None)
            self._start(self._slot[id(param)][0])
            return grad if first else torch.zeros_like(grad)

        return hook

    def _start(self, b: int) -> None:
        """Queue the end-of-backward callback once; launch the buckets that are complete."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        while (self._next < len(self.buckets)
               and self._count[self._next] == len(self.buckets[self._next])):
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        params = self.buckets[b]
        reached = self._reached[b]
        if self._carry:  # parameters this pass missed but earlier unsynchronised passes reached
            for i, p in enumerate(params):
                if not reached[i] and p.grad is not None:
                    self._first[id(p)] = True
                    self._put(p, p.grad, None)
        flat = self._flat[b]
        if flat is None:
            flat = self._flat[b] = self._buffer(b)
        for i, p in enumerate(params):  # what this rank did not reach adds nothing
            if not reached[i]:
                offset = self._slot[id(p)][2]
                flat[offset:offset + p.numel()].zero_()
        if all(reached):  # (a fill on the device: no copy from the host that waits on it)
            flat[self._sizes[b]:].fill_(1.0)
        else:
            flat[self._sizes[b]:].copy_(torch.tensor(reached, dtype=flat.dtype))
        self._works[b] = self.comm.allreduce(
            flat, async_op=True, consume=True, meta=f"gradient bucket {b} {self.where}")
        self._next = b + 1

    def finish(self) -> None:
        """Start the buckets still waiting (in bucket order), wait for all, write the sums."""
        if not self._queued:
            return
        while self._next < len(self.buckets):
            self._launch(self._next)
        for b, params in enumerate(self.buckets):
            total = self._works[b].wait()
            # what this rank reached, some rank reached: the flags are read (from the device)
            # only where this rank missed a parameter
            flags = (None if all(self._reached[b])
                     else total[self._sizes[b]:].tolist())
            for i, p in enumerate(params):
                if flags is not None and not flags[i] > 0:  # no rank's backward reached it
                    continue
                offset = self._slot[id(p)][2]
                part = total[offset:offset + p.numel()].view_as(p)
                if self._first.get(id(p), p.grad is None) or p.grad is None:
                    p.grad = part  # a view of the reduced buffer: no copy per step
                    mark_shard_grad(p)
                else:
                    p.grad.add_(part)
        self._carry = False
        self._reset()

    def detach(self) -> None:
        """Stop synchronising (remove the gradient hooks), e.g. to rebuild the buckets."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __repr__(self) -> str:
        return (f"BucketedGradSync(comm size={self.comm.size}, buckets={len(self._sizes)}, "
                f"elements={self._sizes}, bucket_bytes={self.bucket_bytes}, "
                f"where={self.where!r})")


class GradSyncGroup:
    """Several :class:`BucketedGradSync` (one per communicator), finished together."""

    def __init__(self, syncs: list[BucketedGradSync]) -> None:
        self.syncs = list(syncs)

    def finish(self) -> None:
        for sync in self.syncs:
            sync.finish()

    def detach(self) -> None:
        for sync in self.syncs:
            sync.detach()

    def __repr__(self) -> str:
        return "GradSyncGroup(" + ", ".join(map(repr, self.syncs)) + ")"


def finish_grad_sync(module: nn.Module) -> None:
    """Finish every pending gradient allreduce in ``module`` (idempotent).

    Not needed after ``loss.backward()``, which finishes them itself; use it after gradients were
    computed another way (e.g. ``torch.autograd.backward`` from a non-default thread).
    """
    for m in module.modules():
        sync = getattr(m, "grad_sync", None)
        if isinstance(sync, (GradSync, BucketedGradSync, GradSyncGroup)):
            sync.finish()


def gradient_groups(specs: dict[str, ShardSpec], params: dict[str, Any]
                    ) -> dict[tuple[Layout | None, tuple[str, ...]], list[str]]:
    """Parameters (in registration order) by the ranks their gradient is summed over: the grid
    dims of extent > 1 their distribution leaves unused (in grid order), or every rank (``None``)
    for parameters replicated on all ranks. Ranks that share no such dim need no reduction."""
    groups: dict[tuple[Layout | None, tuple[str, ...]], list[str]] = {}
    for name, p in params.items():
        if not p.requires_grad:
            continue
        spec = specs[name]
        if spec.grid is None:
            key: tuple[Layout | None, tuple[str, ...]] = (None, ())
        else:
            dims = tuple(d for d in spec.dist.redundant(spec.grid) if spec.grid.extent(d) > 1)
            if not dims:
                continue
            key = (spec.grid.layout, dims)
        groups.setdefault(key, []).append(name)
    return groups
