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

from typing import Any

import torch
from torch import nn

__all__ = ["GradSync", "finish_grad_sync"]


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
        self._pending: list[tuple[nn.Parameter, Any, bool]] = []
        self._queued = False

    def register(self, param: nn.Parameter) -> Any:
        """Start the allreduce of ``param``'s gradient whenever one is computed."""

        def hook(grad: torch.Tensor) -> torch.Tensor:
            first = param.grad is None
            work = self.comm.allreduce(
                grad.contiguous(), async_op=True, meta=f"gradient allreduce {self.where}"
            )
            self._pending.append((param, work, first))
            if not self._queued:
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            # The first contribution becomes .grad and is replaced by the complete sum in finish();
            # later ones must not add their local part to an already complete gradient.
            return grad if first else torch.zeros_like(grad)

        return param.register_hook(hook)

    def finish(self) -> None:
        """Wait for every started allreduce and write the complete gradients."""
        pending, self._pending, self._queued = self._pending, [], False
        for param, work, first in pending:
            total = work.wait()
            if first or param.grad is None:
                param.grad = total
            else:
                param.grad.add_(total)

    def __repr__(self) -> str:
        return f"GradSync(comm size={self.comm.size}, where={self.where!r})"


def finish_grad_sync(module: nn.Module) -> None:
    """Finish every pending gradient allreduce in ``module`` (idempotent).

    Not needed after ``loss.backward()``, which finishes them itself; use it after gradients were
    computed another way (e.g. ``torch.autograd.backward`` from a non-default thread).
    """
    for m in module.modules():
        sync = getattr(m, "grad_sync", None)
        if isinstance(sync, GradSync):
            sync.finish()
