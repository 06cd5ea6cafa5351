"""Size-1 communicator: every collective is a copy; the embedded default with no launcher."""

from __future__ import annotations

import torch

from distconv.comm.base import Communicator, Shape, Work
from distconv.comm.errors import CommError

__all__ = ["SingleCommunicator"]


class SingleCommunicator(Communicator):
    """One rank. Results are copies of the inputs (inputs are never aliased)."""

    backend = "single"

    def __init__(self, *, timeout: float = 60.0, parent: Communicator | None = None) -> None:
        super().__init__(rank=0, size=1, timeout=timeout, parent=parent)

    def _check_device(self, t: torch.Tensor, name: str) -> None:
        """Any device: one rank's collectives are copies, made where the tensor lies."""

    def _allreduce(self, t: torch.Tensor, op: str) -> Work:
        return Work.completed(t.clone())

    def _allreduce_consuming(self, t: torch.Tensor, op: str) -> Work:
        return Work.completed(t)

    def _allgather(self, t: torch.Tensor, shapes: list[Shape], opname: str) -> Work:
        return Work.completed([t.clone()])

    def _reduce_scatter(self, chunks: list[torch.Tensor], op: str) -> Work:
        return Work.completed(chunks[0].clone())

    def _alltoall(self, chunks: list[torch.Tensor], recv_shapes: list[Shape]) -> Work:
        return Work.completed([chunks[0].clone()])

    def _broadcast(self, t: torch.Tensor, root: int) -> Work:
        return Work.completed(t.clone())

    def _barrier(self) -> Work:
        return Work.completed(None)

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> Work:
        raise CommError("a size-1 communicator has no peer to send to")

    def _recv(self, shape: Shape, dtype: torch.dtype, src: int, tag: int) -> Work:
        raise CommError("a size-1 communicator has no peer to receive from")

    def _split(self, groups, index, timeout) -> Communicator:
        return SingleCommunicator(timeout=timeout, parent=self)
