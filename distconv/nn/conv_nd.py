"""Every convolution torch has -- ``Conv1d``, ``Conv2d``, ``Conv3d`` and the transposed
``ConvTranspose1d/2d/3d`` -- split over samples, channels, filters and up to three spatial dims.

The algebra of stationary-x, -y and -w (Dryden et al. §3) does not depend on the spatial dims nor
on which way the kernel slides: a convolution's output is a sum over input channels of each
channel block's own convolution, ``y = Σ_C conv(x[o,o_C,...], w_C)``, for a transposed one as
for a direct one. Only the weight's layout differs: ``(out, in/groups, k...)`` for a convolution,
``(in, out/groups, k...)`` for a transposed one, so its channel and filter entries trade places::

    stationary-x   x[o,o_C,o..] -> y[o,o_C,o..]   w[*,o_C,..]  (transposed: w[o_C,*,..])
    stationary-y   x[o,o_F,o..] -> y[o,o_F,o..]   w[o_F,*,..]  (transposed: w[*,o_F,..])
    stationary-w   x[o,o_{C×F},o..] -> y[o,o_{F×C},o..]   w[o_F,o_C,..] (transposed: w[o_C,o_F,..])

with the same collectives as :class:`~distconv.nn.DistConv2d`: an allgather of x over F before the
local convolution, a reduce-scatter of y over C after it, and their adjoints in backward.

**Spatial dims** (D, H, W of a volume; H, W of an image; W, the length, of a signal) are blocked
over the grid dims of those names. Each rank owns a balanced block of the input's and of the
output's rows on each. For a direct convolution it gathers the input rows its output block reads
(:class:`~distconv.conv_geometry.HaloPlan`: halo exchange, dim after dim, so corners travel with
the later exchange; global padding added by the rank that needs it, the rows of ``'reflect'``,
``'replicate'`` and ``'circular'`` travelling like halo) and convolves unpadded on those dims. For a
transposed one it gathers the input rows that scatter into its output block
(:class:`~distconv.conv_geometry.TransposedConvDim`), runs the local transposed convolution
unpadded and crops the result to its block (zero rows where no input row reaches, e.g. output
padding), adding the bias after. In backward the halo rows' gradients go back to their owners
and are added there (halo accumulate).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from distconv.conv_geometry import (
    ConvDim, HaloPlan, TransposedConvDim, check_padding_mode,
)
from distconv.distribution import Dist, as_shape
from distconv.grid import ProcessorGrid
from distconv.halo import haloed
from distconv.nn._amp import autocast_dtype
from distconv.nn.clip import register_parameter_specs
from distconv.nn.conv import ALGORITHMS, UnsupportedConvError, conv_dists
from distconv.nn.grad_sync import GradSync
from distconv.nn.halo_conv import HaloConvSpec, halo_conv
from distconv.nn.sharding import ShardSpec, keep_requires_grad
from distconv.redistribute import gather, redistribute

__all__ = ["CONVOLUTIONS", "SPATIAL_DIMS", "DistConvNd", "conv_nd_dims", "conv_nd_dists",
           "halo_bytes", "spatial_roles"]

#: the modules :class:`DistConvNd` takes
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                nn.ConvTranspose3d)

#: the grid dims that split a volume's (D, H, W); an image takes the last two, a signal the last
SPATIAL_DIMS = ("D", "H", "W")

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_TRANSPOSED = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def spatial_roles(spatial: int) -> tuple[str, ...]:
    """The grid dims that split the ``spatial`` spatial dims of a tensor: ``('W',)``,
    ``('H', 'W')`` or ``('D', 'H', 'W')``."""
    if spatial not in (1, 2, 3):
        raise ValueError(f"a convolution has 1, 2 or 3 spatial dims, got {spatial}")
    return SPATIAL_DIMS[3 - spatial:]


def conv_nd_dims(conv: Any, input_shape: Sequence[int]
                 ) -> tuple[ConvDim | TransposedConvDim, ...]:
    """Each spatial dim of ``conv`` (a torch convolution or a :class:`DistConvNd`) on the global
    input ``input_shape``: its :class:`~distconv.conv_geometry.ConvDim` (a direct convolution,
    with torch's own padding before and after, ``'same'`` included) or
    :class:`~distconv.conv_geometry.TransposedConvDim`."""
    k = len(input_shape) - 2
    sizes = tuple(input_shape[2:])
    if conv.transposed:
        return tuple(TransposedConvDim(sizes[i], conv.kernel_size[i], conv.stride[i],
                                       conv.dilation[i], conv.padding[i],
                                       conv.output_padding[i]) for i in range(k))
    rp = conv._reversed_padding_repeated_twice  # last dim first
    return tuple(ConvDim(sizes[i], conv.kernel_size[i], conv.stride[i], conv.dilation[i],
                         rp[2 * (k - 1 - i)], rp[2 * (k - 1 - i) + 1]) for i in range(k))


def halo_bytes(conv: Any, dists: dict[str, Dist], layout: Any, input_shape: Sequence[int],
               rank: int, itemsize: int) -> list[tuple[str, int, int]]:
    """``(grid dim, forward bytes, backward bytes)`` that ``rank`` receives in the halo exchange
    (and its adjoint, the halo accumulate) of each spatial dim the grid ``layout`` splits, in the
    order they run, for a convolution ``conv`` with ``dists`` (:func:`conv_nd_dists`): what the
    communicators count (the exchanges of a dim where no rank needs another's rows send
    nothing)."""
    from distconv.parallel.placement import paper_grid

    g = paper_grid(tuple(layout), rank)
    block = list(dists["work"].local_shape(tuple(input_shape), g))
    rows = spatial_roles(len(input_shape) - 2)
    out = []
    for i, d in enumerate(conv_nd_dims(conv, input_shape)):
        parts = g.shape.get(rows[i], 1)
        if parts == 1:
            continue
        plan = HaloPlan(d, parts, getattr(conv, "padding_mode", "zeros"))
        plan.check(rows[i])
        c = g.coords[rows[i]]
        if plan.exchanges:
            other = math.prod(block[:2 + i] + block[3 + i:])
            out.append((rows[i], plan.halo_rows_received(c) * other * itemsize,
                        plan.halo_rows_sent(c) * other * itemsize))
        block[2 + i] = plan.local_length[c]
    return out


def conv_nd_dists(algorithm: str, roles: dict[str, str | None], spatial: int,
                  transposed: bool, grouped: bool = False) -> dict[str, Dist]:
    """The distributions of a :class:`DistConvNd` over ``spatial`` spatial dims: ``input``,
    ``work``, ``partial``, ``output``, ``weight`` and ``bias`` (see the module docstring).
    ``roles`` maps ``N``, ``C`` and ``F`` to grid dims, and each spatial role
    (:func:`spatial_roles`) it names to the grid dim that splits it (a role left out: whole)."""
    base = conv_dists(algorithm, {**roles, "H": None, "W": None}, grouped)
    rows = tuple(roles.get(r) for r in spatial_roles(spatial))
    out = {}
    for key, d in base.items():
        if key == "bias":
            out[key] = d
            continue
        head = list(d.entries[:2])
        if key == "weight":
            if transposed and not grouped:  # grouped: dim 0 holds the groups either way
                head.reverse()
            out[key] = Dist((*head, *([None] * spatial)), pending=d.pending)
        else:
            out[key] = Dist((*head, *rows), pending=d.pending)
    return out


@dataclass(frozen=True)
class _Geometry:
    """What a forward derives from the global input shape (cached per shape)."""

    y_shape: tuple[int, ...]
    #: per spatial dim: its halo plan where the grid splits it, else None
    plans: tuple[HaloPlan | None, ...]
    #: per spatial dim the local convolution's padding (0 on split dims), or None when the
    #: whole dims are padded explicitly first (``explicit``: F.pad's list, last dim first)
    padding: tuple[int, ...] | None
    explicit: tuple[int, ...] | None
    #: transposed, per split spatial dim: (rows to drop before, rows the block has)
    crop: tuple[tuple[int, int] | None, ...]
    #: the halo-convolution step of this shape (zero padding with a split dim), else None
    spec: HaloConvSpec | None = None


class DistConvNd(nn.Module):
    r"""A ``Conv1d/2d/3d`` or ``ConvTranspose1d/2d/3d`` partitioned over samples, channels and
    filters (stationary-x, -y or -w) and its spatial dims (module docstring).

    Build it from the module (the same on every rank) with :meth:`from_module`. The input and
    output distributions are :attr:`input_dist` and :attr:`output_dist`, e.g. for a ``Conv3d``
    under stationary-x on ``{N, C, D, H}``: ``x[o,o_C,o,o,*] -> y[o,o_C,o,o,*]`` (the sample and
    spatial entries blocked over N, D and H); ``forward(x, global_shape)`` takes this rank's
    block of the global input ``(N, C, *spatial)`` and returns its block of y. Weight and bias
    are shards of the global tensors (:attr:`weight_dist`, :attr:`bias_dist`), replicated over
    the sample and spatial grid dims, their gradients completed over those by an allreduce started
    from a hook, as for :class:`~distconv.nn.DistConv2d`. Under stationary-x with no channel
    split this is sample and spatial parallelism.

    Args:
        conv: the module to shard.
        grid: the :class:`~distconv.grid.ProcessorGrid` over all ranks; its dims play the roles
            of samples, channels, filters and the spatial dims (:func:`spatial_roles`: ``D``,
            ``H``, ``W`` of a volume, ``H``, ``W`` of an image, ``W`` of a signal).
        algorithm: ``'stationary-x'``, ``'stationary-y'`` or ``'stationary-w'``.
        channel_dim, filter_dim, sample_dim: the grid dims of those roles. Defaults
            ``"C"``, ``"F"``, ``"N"``.
        overlap: convolve the interior rows while the halo rows travel, then the border rows
            (backward: the border rows' input gradients first, the interior's while their halo
            part travels back; :func:`~distconv.nn.halo_conv.halo_conv`). For a direct
            convolution that splits one spatial dim (with a kernel wider than one row there)
            and pads with zeros. The same bytes; the results equal the unoverlapped layer's up
            to the order of sums. Default False. Under autocast, or with a ``work_hook``, the
            layer runs unoverlapped.

    Raises:
        ValueError: an unknown algorithm, a grid dim without a role, a grid the algorithm cannot
            use, more ranks on a dim than channels or filters; at the first forward of a shape,
            more ranks on a spatial dim than input or output rows, or a padding mode that cannot
            pad the input (each message says what would work).
        UnsupportedConvError: a grouped convolution split into channel blocks that do not hold
            whole groups (groups not divisible by C×F). One whose blocks hold whole groups is a
            local grouped convolution (``x[o,o_C,..] -> y[o,o_C,..]`` and the like, no
            communication).
    """

    def __init__(self, conv: nn.Module, *, grid: ProcessorGrid, algorithm: str,
                 channel_dim: str = "C", filter_dim: str = "F", sample_dim: str = "N",
                 overlap: bool = False) -> None:
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
        self.spatial = conv.weight.dim() - 2
        rows = spatial_roles(self.spatial)
        roles: dict[str, str | None] = {"N": sample_dim, "C": channel_dim, "F": filter_dim}
        named = set(roles.values()) | set(rows)
        other = [d for d, e in grid.layout if e > 1 and d not in named]
        if other:
            raise ValueError(
                f"{kind} splits samples ({sample_dim}), channels ({channel_dim}), filters "
                f"({filter_dim}) and its {self.spatial} spatial dim(s) over {list(rows)}; the "
                f"grid's {other} have no role: keep them at 1, or name the spatial dims "
                f"{list(rows)}")
        roles.update({r: (r if grid.shape.get(r, 1) > 1 else None) for r in rows})
        ext = {r: grid.shape.get(d, 1) if d else 1 for r, d in roles.items()}
        if algorithm == "stationary-x" and ext["F"] > 1 or algorithm == "stationary-y" and (
                ext["C"] > 1):
            raise ValueError(f"{algorithm} cannot use the grid {dict(grid.layout)}: "
                             "stationary-x splits channels only, stationary-y filters only; use "
                             "stationary-w for both")
        #: channel blocks that each hold whole groups (a grouped layer split over C, F or C×F:
        #: a local grouped convolution); 1 otherwise
        self._group_parts = ext["C"] * ext["F"] if conv.groups > 1 else 1
        if conv.groups % self._group_parts:
            raise UnsupportedConvError(
                f"a grouped {kind} (groups={conv.groups}) split into {self._group_parts} channel "
                f"blocks is not implemented: the blocks must hold whole groups (groups divisible "
                f"by {'×'.join(roles[r] for r in ('C', 'F') if ext[r] > 1)}); run it sample- or "
                "spatially parallel")
        for role, size in (("C", conv.in_channels), ("F", conv.out_channels)):
            if ext[role] > size:
                raise ValueError(f"grid dim {roles[role]}={ext[role]} has more ranks than the "
                                 f"{size} {'channels' if role == 'C' else 'filters'}")
        self.grid, self.algorithm, self.kind = grid, algorithm, kind
        self.transposed = isinstance(conv, nn.modules.conv._ConvTransposeNd)
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size = tuple(conv.kernel_size)
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self.groups, self.padding_mode = conv.groups, conv.padding_mode
        self.output_padding = getattr(conv, "output_padding", None)
        self._reversed_padding_repeated_twice = conv._reversed_padding_repeated_twice
        self.roles = roles
        #: the grid dims splitting each spatial dim (None: whole)
        self.spatial_dims = tuple(roles[r] for r in rows)
        grouped = self._group_parts > 1
        dists = conv_nd_dists(algorithm, roles, self.spatial, self.transposed, grouped)
        self.input_dist, self.work_dist = dists["input"], dists["work"]
        self.partial_dist, self.output_dist = dists["partial"], dists["output"]
        self.weight_dist, self.bias_dist = dists["weight"], dists["bias"]
        self._gather_x = not grouped and algorithm != "stationary-x" and ext["F"] > 1
        self._reduce_y = not grouped and algorithm != "stationary-y" and ext["C"] > 1
        self._local_groups = conv.groups // self._group_parts
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
        self._geometries: dict[tuple[int, ...], _Geometry] = {}
        #: Called after the local convolution of a direct layer as ``work_hook(layer, x,
        #: padding, y, y_shape)`` (:class:`~distconv.nn.DistConv2d`'s; distkfac reads its factors
        #: here). Default None.
        self.work_hook: Any = None
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {overlap!r}")
        split = [i for i, d in enumerate(self.spatial_dims) if d is not None]
        if overlap and (self.transposed or len(split) != 1 or self.padding_mode != "zeros"
                        or (conv.kernel_size[split[0]] - 1) * conv.dilation[split[0]] == 0):
            raise ValueError(
                f"overlap=True overlaps the halo exchange of one split spatial dim with the "
                f"interior rows, but this {kind} on {dict(grid.layout)} "
                + ("is transposed" if self.transposed else
                   f"splits {len(split)} spatial dims" if len(split) != 1 else
                   f"pads with {self.padding_mode!r}" if self.padding_mode != "zeros" else
                   "reads one row of the split dim")
                + "; use a direct convolution that splits one spatial dim, with a kernel wider "
                "than one row there and zero padding, or overlap=False")
        #: Whether the halo exchange overlaps the interior rows' convolution.
        self.overlap = overlap
        self._checked: dict[tuple[Any, Any], _Geometry] = {}
        # sub-communicators are created collectively, in the same order on every rank
        self._halo_comms = tuple(grid.subcomm([d]) if d else None for d in self.spatial_dims)
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
                    **options: Any) -> DistConvNd:
        """Shard ``conv`` (the same on every rank) onto ``grid``; ``options`` as the
        constructor's (``channel_dim``, ``filter_dim``, ``sample_dim``, ``overlap``)."""
        return cls(conv, grid=grid, algorithm=algorithm, **options)

    def _shard_specs(self) -> dict[str, ShardSpec]:
        specs = {"weight": ShardSpec(self.grid, self.weight_dist, self.weight_shape)}
        if self.bias is not None:
            specs["bias"] = ShardSpec(self.grid, self.bias_dist, (self.out_channels,))
        return specs

    # ------------------------------------------------------------------ geometry
    def dims(self, input_shape: Sequence[int]) -> tuple[ConvDim | TransposedConvDim, ...]:
        """Each spatial dim of the convolution on the global input ``input_shape``."""
        return conv_nd_dims(self, input_shape)

    def plans(self, input_shape: Sequence[int]) -> tuple[HaloPlan | None, ...]:
        """The halo plan of each spatial dim the grid splits (None for the whole ones)."""
        return self._geometry(tuple(input_shape)).plans

    def _geometry(self, shape: tuple[int, ...]) -> _Geometry:
        geo = self._geometries.get(shape)
        if geo is not None:
            return geo
        if len(shape) != 2 + self.spatial or shape[1] != self.in_channels:
            raise ValueError(f"{self.kind} takes a global input (N, {self.in_channels}, "
                             f"{self.spatial} spatial sizes), got {shape}")
        n_dim = self.roles["N"]
        if shape[0] < self.grid.shape.get(n_dim, 1):
            raise ValueError(f"the global batch {shape[0]} is smaller than grid dim {n_dim}="
                             f"{self.grid.shape[n_dim]}; every rank needs at least one sample")
        dims = self.dims(shape)
        w = torch.empty(self.weight_shape, device="meta")
        y_shape = tuple(self._plain(torch.empty(shape, device="meta"), w).shape)
        plans: list[HaloPlan | None] = []
        padding, explicit, crop = [], [0] * (2 * self.spatial), []
        for i, (d, grid_dim) in enumerate(zip(dims, self.spatial_dims)):
            if grid_dim is None:
                plans.append(None)
                crop.append(None)
                if not self.transposed:
                    check_padding_mode(d, self.padding_mode, spatial_roles(self.spatial)[i])
                    lo, hi = d.pad_before, d.pad_after
                    padding.append(lo if lo == hi else -1)
                    j = 2 * (self.spatial - 1 - i)
                    explicit[j], explicit[j + 1] = lo, hi
                continue
            plan = HaloPlan(d, self.grid.shape[grid_dim], self.padding_mode)
            plan.check(grid_dim)
            plans.append(plan)
            padding.append(0)
            if self.transposed:
                r = self.grid.coords[grid_dim]
                lo = plan.needed[r][0]
                o0, o1 = plan.out[r]
                crop.append((o0 - d.first_output(lo), o1 - o0))
            else:
                crop.append(None)
        pad_first = not self.transposed and any(explicit) and (
            self.padding_mode != "zeros" or -1 in padding)
        geo = _Geometry(y_shape, tuple(plans),
                        None if pad_first else tuple(max(p, 0) for p in padding),
                        tuple(explicit) if pad_first else None, tuple(crop))
        if self.padding_mode == "zeros" and any(plans):
            conv_padding, out_pad = self._conv_args(geo)
            geo = dataclasses.replace(geo, spec=HaloConvSpec(
                self._halo_comms, geo.plans, geo.explicit, self.stride, conv_padding,
                self.dilation, self._local_groups, self.transposed, out_pad, self.overlap))
        if len(self._geometries) > 64:
            self._geometries.clear()
        self._geometries[shape] = geo
        return geo

    def _plain(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The module's own convolution of a whole input (torch's arithmetic)."""
        if self.transposed:
            return _TRANSPOSED[self.spatial](x, w, b, self.stride, self.padding,
                                             self.output_padding, self.groups, self.dilation)
        if self.padding_mode != "zeros":
            return _CONV[self.spatial](F.pad(x, self._reversed_padding_repeated_twice,
                                             mode=self.padding_mode),
                                       w, b, self.stride, 0, self.dilation, self.groups)
        return _CONV[self.spatial](x, w, b, self.stride, self.padding, self.dilation,
                                   self.groups)

    def output_shape(self, input_shape: Sequence[int]) -> tuple[int, ...]:
        """The global output shape for the global input ``(N, C, *spatial)``."""
        return self._geometry(as_shape(input_shape, "input_shape")).y_shape

    # ------------------------------------------------------------------ forward
    def _conv_args(self, geo: _Geometry) -> tuple[Any, Any]:
        """The local convolution's padding and (transposed) output padding: none on the split
        dims, the module's on the whole ones (direct: 0 where ``geo.explicit`` pads first)."""
        if self.transposed:
            return (tuple(0 if c is not None else p for c, p in zip(geo.crop, self.padding)),
                    tuple(0 if c is not None else p
                          for c, p in zip(geo.crop, self.output_padding)))
        return (geo.padding if geo.explicit is None else 0), None

    def _crop(self, y: torch.Tensor, geo: _Geometry, b: torch.Tensor | None) -> torch.Tensor:
        """A transposed layer's output cropped (zero-filled where no input row reaches) to this
        rank's block on the split dims, then its bias. (Where none of the local output falls in
        the block, an empty slice of it is padded: the backward still reaches the exchanges.)"""
        for i, c in enumerate(geo.crop):
            if c is None:
                continue
            d, (start, rows) = 2 + i, c  # the block: local rows [start, start + rows)
            lo, hi = max(start, 0), min(start + rows, y.shape[d])
            if hi > lo:
                piece, fill = y.narrow(d, lo, hi - lo), [lo - start, start + rows - hi]
            else:
                piece, fill = y.narrow(d, 0, 0), [rows, 0]
            y = F.pad(piece, [0] * (2 * (y.dim() - 1 - d)) + fill)
        if b is not None:
            y = y + b.to(y.dtype).view(1, -1, *([1] * self.spatial))
        return y

    def _hooked(self, x: torch.Tensor, geo: _Geometry, b: torch.Tensor | None) -> torch.Tensor:
        """A direct layer's halo exchanges and local convolution as separate steps, the
        convolution's input handed to :attr:`work_hook` with the zero padding it still applies
        (``F.pad``'s list, last dim first)."""
        x = haloed(x, self._halo_comms, geo.plans, geo.explicit, self.padding_mode)
        y = self._local(x, geo, b)
        padding, _ = self._conv_args(geo)
        pads = [0] * (2 * self.spatial) if isinstance(padding, int) else [
            p for i in reversed(range(self.spatial)) for p in (padding[i], padding[i])]
        self.work_hook(self, x, tuple(pads), y, geo.y_shape)
        return y

    def _local(self, x: torch.Tensor, geo: _Geometry, b: torch.Tensor | None) -> torch.Tensor:
        """The local convolution of the haloed and padded input ``x`` (:func:`haloed`)."""
        padding, out_pad = self._conv_args(geo)
        if self.transposed:
            cropped = any(c is not None for c in geo.crop)
            y = _TRANSPOSED[self.spatial](x, self.weight, None if cropped else b, self.stride,
                                          padding, out_pad, self._local_groups, self.dilation)
            return self._crop(y, geo, b) if cropped else y
        return _CONV[self.spatial](x, self.weight, b, self.stride, padding, self.dilation,
                                   self._local_groups)

    def forward(self, x: torch.Tensor, global_shape: Sequence[int]) -> torch.Tensor:
        """This rank's block of y (:attr:`output_dist`) from its block ``x``
        (:attr:`input_dist`) of the global input of ``global_shape``."""
        key = (x.shape, global_shape) if type(global_shape) is tuple else None
        geo = self._checked.get(key) if key is not None else None
        if geo is None:  # a block and global shape not seen yet: checked once
            shape = as_shape(global_shape, f"{self.kind}.forward: global_shape")
            geo = self._geometry(shape)
            expected = self.input_dist.local_shape(shape, self.grid)
            if tuple(x.shape) != expected:
                raise ValueError(
                    f"rank {self.grid.rank} (coords {self.grid.coords}) got an input block of "
                    f"shape {tuple(x.shape)}, but {self.input_dist.format('x')} of the global "
                    f"shape {shape} gives it {expected}")
            if len(self._checked) > 64:
                self._checked.clear()
            self._checked[(x.shape, tuple(shape))] = geo
        shape = tuple(global_shape)
        if self._gather_x:
            x = redistribute(x, self.grid, self.input_dist, self.work_dist, shape)
        b = None if self._reduce_y else self.bias
        if self.work_hook is not None:
            y = self._hooked(x, geo, b)
        elif geo.spec is not None and autocast_dtype(x.device.type) is None:
            cropped = self.transposed and any(c is not None for c in geo.crop)
            y = halo_conv(x, self.weight, None if cropped else b, geo.spec)
            if cropped:
                y = self._crop(y, geo, b)
        else:
            x = haloed(x, self._halo_comms, geo.plans, geo.explicit, self.padding_mode)
            y = self._local(x, geo, b)
        if self._reduce_y:
            y = redistribute(y, self.grid, self.partial_dist, self.output_dist, geo.y_shape)
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
                f"y={self.output_dist.format('y')}" + (", overlap=True" if self.overlap else ""))

