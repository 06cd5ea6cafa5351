"""Whole models, model-parallel from a declarative per-layer config.

* :func:`parallelize` -- trace a model, place every layer on its config's grid and algorithm,
  and return a :class:`ParallelModel` that a user's ordinary data-parallel loop trains exactly.
* :func:`explain` -- the same plan on paper, for any world size, with no communication.
"""

from __future__ import annotations

from typing import Callable, Sequence

from torch import nn

from distconv.comm.base import Communicator
from distconv.parallel.config import ALGORITHMS, ConfigSource, ParallelConfig, load_config
from distconv.parallel.model import LOSS_REDUCTIONS, ParallelModel
from distconv.pricing.machine import AnyMachine

__all__ = ["ALGORITHMS", "LOSS_REDUCTIONS", "ConfigSource", "ParallelConfig", "ParallelModel",
           "load_config", "parallelize"]


def parallelize(model: nn.Module, config: ConfigSource | ParallelConfig, *,
                comm: Communicator | None = None, loss_reduction: str = "mean",
                input_shape: Sequence[int] | None = None, bucket_bytes: int = 25 << 20,
                machine: AnyMachine | Callable[[], AnyMachine] | str | None = None
                ) -> ParallelModel:
    """Convert ``model`` to run model-parallel as ``config`` says (collective).

    Args:
        model: the single-process model, the same architecture on every rank. Every rank
            starts from rank 0's parameters and buffers, broadcast before sharding as
            ``DistributedDataParallel`` does (:mod:`distconv.parallel.state_sync`); the
            caller's model is left as it was.
        config: a dict or a YAML (or JSON) file's path (see :mod:`distconv.parallel.config`),
            or a :class:`~distconv.parallel.config.ParallelConfig` for ``comm``'s world size.
        comm: the communicator of all ranks. Default: ``distconv.comm.world()``.
        loss_reduction: how the user's loss reduces over its local samples: ``'mean'``
            (default; ``F.cross_entropy``'s default) or ``'sum'``. The output's gradient is scaled
            so that the parameters' gradients are those of the same reduction over the global
            batch.
        input_shape: the global input shape, if known; needed only for ``algorithm: auto`` and
            for models whose first layer does not tell the input's number of dims.
        bucket_bytes: fusion size of the gradient allreduces (DDP's default). Default 25 MiB.
        machine: what ``algorithm: auto`` is planned on (:mod:`distconv.parallel.auto`: rank 0
            searches, every rank runs its config): a :class:`distconv.pricing.machine.Machine`
            or a hierarchical :class:`distconv.machines.base.Machine`, a factory of one
            (``distconv.machines.lassen``) or a known name (``"lassen"``); anything else is a
            ``TypeError`` (:func:`distconv.machines.resolve_machine`). Default None:
            :func:`distconv.pricing.calibrate.calibrate` on ``comm`` (collective).

    Returns:
        A :class:`ParallelModel` whose parameters are this rank's shards.

    Raises:
        ValueError: a config that does not fit the model or the world (naming the entry), or
            ranks whose models differ in their parameters' or buffers' names, shapes or dtypes
            (rank 0's values are broadcast to every rank; see ``model``).
        NotImplementedError: a layer or construct the library cannot run distributed (naming
            the node and what to write instead), e.g. ``.item()`` in a forward or a module type
            no op handler binds (docs/support.md lists what runs).
        TypeError: a model ``torch.fx`` cannot trace (naming the construct).
    """
    return ParallelModel(model, config, comm=comm, loss_reduction=loss_reduction,
                         input_shape=input_shape, bucket_bytes=bucket_bytes, machine=machine)
