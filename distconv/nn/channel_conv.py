"""Channel and filter parallelism for every convolution torch has: ``Conv1d``, ``Conv3d`` and the
transposed ``ConvTranspose1d/2d/3d``, with sample parallelism; their spatial dims stay whole.

The algebra of stationary-x, -y and -w (Dryden et al. §3) does not depend on the spatial dims nor
on which way the kernel slides: a convolution's output is a sum over input channels of each
channel block's own convolution, ``y = Σ_C conv(x[o,o_C,...], w_C)``, for a transposed one as
for a direct one. Only the weight's layout differs: ``(out, in/groups, k...)`` for a convolution,
``(in, out/groups, k...)`` for a transposed one, so its channel and filter entries trade places::

    stationary-x   x[o,o_C,*..] -> y[o,o_C,*..]   w[*,o_C,..]  (transposed: w[o_C,*,..])
    stationary-y   x[o,o_F,*..] -> y[o,o_F,*..]   w[o_F,*,..]  (transposed: w[*,o_F,..])
    stationary-w   x[o,o_{C×F},*..] -> y[o,o_{F×C},*..]   w[o_F,o_C,..] (transposed: w[o_C,o_F,..])

with the same collectives as :class:`~distconv.nn.DistConv2d`: an allgather of x over F before the
local convolution, a reduce-scatter of y over C after it, and their adjoints in backward.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from distconv.distribution import Dist, as_shape
from distconv.grid import ProcessorGrid
from distconv.nn.clip import register_parameter_specs
from distconv.nn.conv import ALGORITHMS, UnsupportedConvError, conv_dists
from distconv.nn.grad_sync import GradSync
from distconv.nn.sharding import ShardSpec, keep_requires_grad
from distconv.redistribute import gather, redistribute

__all__ = ["CONVOLUTIONS", "DistChannelConv", "channel_conv_dists"]

#: the modules :class:`DistChannelConv` takes
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                nn.ConvTranspose3d)

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_TRANSPOSED = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def channel_conv_dists(algorithm: str, roles: dict[str, str | None], spatial: int,
                       transposed: bool) -> dict[str, Dist]:
    """The distributions of a :class:`DistChannelConv` over ``spatial`` whole spatial dims:
    ``input``, ``work``, ``partial``, ``output``, ``weight`` and ``bias`` (see the module
    docstring). ``roles`` maps ``N``, ``C`` and ``F`` to grid dims."""
    base = conv_dists(algorithm, {**roles, "H": None, "W": None})
    out = {}
    for key, d in base.items():
        if key == "bias":
            out[key] = d
            continue
        head = list(d.entries[:2])
        if key == "weight" and transposed:
            head.reverse()
        out[key] = Dist((*head, *([None] * spatial)), pending=d.pending)
    return out


class DistChannelConv(nn.Module):
    r"""A ``Conv1d/2d/3d`` or ``ConvTranspose1d/2d/3d`` partitioned over channels and filters
    (stationary-x, -y or -w) and samples; its spatial dims stay whole on every rank.

    Build it from the module (the same on every rank) with :meth:`from_module`. The input and
    output distributions are :attr:`input_dist` and :attr:`output_dist` (module docstring);
    ``forward(x, global_shape)`` takes this rank's block of the global input
    ``(N, C, *spatial)`` and returns its block of y. Weight and bias are shards of the global
    tensors (:attr:`weight_dist`, :attr:`bias_dist`), their gradients completed over the sample
    dim by an allreduce started from a hook, as for :class:`~distconv.nn.DistConv2d`.

    Args:
        conv: the module to shard.
        grid: the :class:`~distconv.grid.ProcessorGrid` over all ranks; its dims play the roles
            of samples, channels and filters only.
        algorithm: ``'stationary-x'``, ``'stationary-y'`` or ``'stationary-w'``.
        channel_dim, filter_dim, sample_dim: the grid dims of those roles. Defaults
            ``"C"``, ``"F"``, ``"N"``.

    Raises:
        ValueError: an unknown algorithm, a grid dim without a role (a spatial split: only
            :class:`~distconv.nn.DistConv2d` has halos), a grid the algorithm cannot use, more
            ranks on a dim than channels or filters.
        UnsupportedConvError: a grouped convolution split over channels or filters.
    """

    def __init__(self, conv: nn.Module, *, grid: ProcessorGrid, algorithm: str,
                 channel_dim: str = "C", filter_dim: str = "F", sample_dim: str = "N") -> None:
        super().__init__()
        if not isinstance(conv, CONVOLUTIONS):
            raise TypeError(f"conv must be one of {[c.__name__ for c in CONVOLUTIONS]}, got "
                            f"{type(conv).__name__}")
        if not isinstance(grid, ProcessorGrid):
            raise TypeError(f"grid must be a distconv.grid.ProcessorGrid, got "
                            f"{type(grid).__name__}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        kind = type(conv).__name__
        roles = {"N": sample_dim, "C": channel_dim, "F": filter_dim}
        other = [d for d, e in grid.layout if e > 1 and d not in roles.values()]
        if other:
            raise ValueError(
                f"{kind} splits samples, channels and filters only; the grid's {other} would "
                f"split its spatial dims (halos are implemented for Conv2d): keep them at 1")
        ext = {r: grid.shape.get(d, 1) for r, d in roles.items()}
        if algorithm == "stationary-x" and ext["F"] > 1 or algorithm == "stationary-y" and (
                ext["C"] > 1):
            raise ValueError(f"{algorithm} cannot use the grid {dict(grid.layout)}: "
                             "stationary-x splits channels only, stationary-y filters only; use "
                             "stationary-w for both")
        if conv.groups > 1 and ext["C"] * ext["F"] > 1:
            raise UnsupportedConvError(
                f"a grouped {kind} (groups={conv.groups}) split over channels or filters is not "
                "implemented; run it sample-parallel")
        for role, size in (("C", conv.in_channels), ("F", conv.out_channels)):
            if ext[role] > size:
                raise ValueError(f"grid dim {roles[role]}={ext[role]} has more ranks than the "
                                 f"{size} {'channels' if role == 'C' else 'filters'}")
        self.grid, self.algorithm, self.kind = grid, algorithm, kind
        self.transposed = isinstance(conv, nn.modules.conv._ConvTransposeNd)
        self.spatial = conv.weight.dim() - 2
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self.groups, self.padding_mode = conv.groups, conv.padding_mode
        self.output_padding = getattr(conv, "output_padding", None)
        self._reversed_padding = getattr(conv, "_reversed_padding_repeated_twice", None)
        self.roles = roles
        dists = channel_conv_dists(algorithm, roles, self.spatial, self.transposed)
        self.input_dist, self.work_dist = dists["input"], dists["work"]
        self.partial_dist, self.output_dist = dists["partial"], dists["output"]
        self.weight_dist, self.bias_dist = dists["weight"], dists["bias"]
        self._gather_x = algorithm != "stationary-x" and ext["F"] > 1
        self._reduce_y = algorithm != "stationary-y" and ext["C"] > 1
        self.weight_shape = tuple(conv.weight.shape)
        w = conv.weight.detach()
        self.weight = nn.Parameter(w[self.weight_dist.local_slices(w.shape, grid)].clone())
        if conv.bias is not None:
            b = conv.bias.detach()
            self.bias: nn.Parameter | None = nn.Parameter(
                b[self.bias_dist.local_slices(b.shape, grid)].clone())
        else:
            self.register_parameter("bias", None)
        keep_requires_grad(self, conv, ("weight", "bias"))
        self._shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
        #: (input block shape, global shape) pairs checked once: global shape -> output shape
        self._checked: dict[tuple[Any, Any], tuple[int, ...]] = {}
        redundant = tuple(d for d in self.weight_dist.redundant(grid) if grid.shape[d] > 1)
        where = f"{kind}({self.in_channels}, {self.out_channels}, {algorithm})"
        self.grad_sync = GradSync(grid.subcomm(redundant), where=where) if redundant else None
        if self.grad_sync is not None:  # a frozen shard (requires_grad False) has no hook
            for p in (self.weight, self.bias):
                if p is not None and p.requires_grad:
                    self.grad_sync.register(p)
        register_parameter_specs(self, grid.comm)

    @classmethod
    def from_module(cls, conv: nn.Module, *, grid: ProcessorGrid, algorithm: str,
                    **roles: str) -> DistChannelConv:
        """Shard ``conv`` (the same on every rank) onto ``grid``; ``roles`` as the constructor's
        ``channel_dim``, ``filter_dim``, ``sample_dim``."""
        return cls(conv, grid=grid, algorithm=algorithm, **roles)

    def _shard_specs(self) -> dict[str, ShardSpec]:
        specs = {"weight": ShardSpec(self.grid, self.weight_dist, self.weight_shape)}
        if self.bias is not None:
            specs["bias"] = ShardSpec(self.grid, self.bias_dist, (self.out_channels,))
        return specs

    def output_shape(self, input_shape: Sequence[int]) -> tuple[int, ...]:
        """The global output shape for the global input ``(N, C, *spatial)`` (torch's own
        arithmetic, on the meta device)."""
        shape = as_shape(input_shape, "input_shape")
        out = self._shapes.get(shape)
        if out is None:
            if len(shape) != 2 + self.spatial or shape[1] != self.in_channels:
                raise ValueError(f"{self.kind} takes a global input (N, {self.in_channels}, "
                                 f"{self.spatial} spatial sizes), got {shape}")
            w = torch.empty(self.weight_shape, device="meta")
            out = tuple(self._local(torch.empty(shape, device="meta"), w, None,
                                    self.groups).shape)
            self._shapes[shape] = out
        return out

    def _local(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
               groups: int) -> torch.Tensor:
        if self.transposed:
            return _TRANSPOSED[self.spatial](x, w, b, self.stride, self.padding,
                                             self.output_padding, groups, self.dilation)
        if self.padding_mode != "zeros":
            return _CONV[self.spatial](F.pad(x, self._reversed_padding, mode=self.padding_mode),
                                       w, b, self.stride, 0, self.dilation, groups)
        return _CONV[self.spatial](x, w, b, self.stride, self.padding, self.dilation, groups)

    def forward(self, x: torch.Tensor, global_shape: Sequence[int]) -> torch.Tensor:
        """This rank's block of y (:attr:`output_dist`) from its block ``x``
        (:attr:`input_dist`) of the global input of ``global_shape``."""
        key = (x.shape, global_shape) if type(global_shape) is tuple else None
        y_shape = self._checked.get(key) if key is not None else None
        if y_shape is None:  # a block and global shape not seen yet: checked once
            shape = as_shape(global_shape, f"{self.kind}.forward: global_shape")
            y_shape = self.output_shape(shape)
            expected = self.input_dist.local_shape(shape, self.grid)
            if tuple(x.shape) != expected:
                raise ValueError(
                    f"rank {self.grid.rank} (coords {self.grid.coords}) got an input block of "
                    f"shape {tuple(x.shape)}, but {self.input_dist.format('x')} of the global "
                    f"shape {shape} gives it {expected}")
            if len(self._checked) > 64:
                self._checked.clear()
            self._checked[(x.shape, tuple(shape))] = y_shape
        shape = tuple(global_shape)
        if self._gather_x:
            x = redistribute(x, self.grid, self.input_dist, self.work_dist, shape)
        y = self._local(x, self.weight, None if self._reduce_y else self.bias, self.groups)
        if self._reduce_y:
            y = redistribute(y, self.grid, self.partial_dist, self.output_dist, y_shape)
            if self.bias is not None:
                # in y's dtype, as autocast's convolution adds it
                y = y + self.bias.to(y.dtype).view(1, -1, *([1] * self.spatial))
        return y

    def gather_weight(self) -> torch.Tensor:
        """The global weight on every rank (collective)."""
        return gather(self.weight.detach(), self.weight_dist, self.grid, self.weight_shape)

    def finish_grad_sync(self) -> None:
        """Finish pending gradient allreduces (``loss.backward()`` does this itself)."""
        if self.grad_sync is not None:
            self.grad_sync.finish()

    def extra_repr(self) -> str:
        return (f"{self.kind}({self.in_channels}, {self.out_channels}), "
                f"grid={dict(self.grid.layout)}, algorithm={self.algorithm!r}, "
                f"x={self.input_dist.format('x')}, w={self.weight_dist.format('w')}, "
                f"y={self.output_dist.format('y')}")
