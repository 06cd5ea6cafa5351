"""Model-parallel 2-d convolution: channel/filter parallelism with sample/spatial parallelism."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import nn

from distconv.conv_geometry import PADDING_MODES, normalize_padding, pair
from distconv.comm.base import agree_on_value, get_debug
from distconv.distribution import as_shape
from distconv.grid import ProcessorGrid
from distconv.nn._factory import check_factory_kwargs
from distconv.nn.clip import register_parameter_specs
from distconv.nn.conv_forward import ConvGeometry, conv_forward, layer_geometry
from distconv.nn.conv_layout import (
    ALGORITHMS, GroupSpan, UnsupportedConvError, conv_dists, group_role, group_span,
    groups_aligned,
)
from distconv.nn.grad_sync import GradSync
from distconv.nn.halo_conv import HaloConvSpec
from distconv.nn.sharding import ShardSpec, keep_requires_grad
from distconv.pricing.problem import ConvProblem
from distconv.pricing.traffic import conv_traffic
from distconv.redistribute import gather, plan_redistribution

__all__ = ["ALGORITHMS", "DistConv2d", "UnsupportedConvError", "conv_dists"]


class DistConv2d(nn.Module):
    r"""A drop-in for ``nn.Conv2d`` partitioned over a processor grid (Dryden et al., SC'19).

    The grid's dims play five roles: samples (``sample_dim``, default ``"N"``), input channels
    (``channel_dim``, ``"C"``), output filters (``filter_dim``, ``"F"``) and the two spatial dims
    (``spatial_dims``, ``("H", "W")``); a role the grid leaves out has extent 1. Distributions are
    written in the paper's notation: ``x[o,o_C,o,o]`` blocks x's channel dim over grid dim C and
    its sample and spatial dims over N, H and W; ``*`` is replicated; ``Σ_C`` is a pending sum over
    C. A tuple entry is written **major first**: ``o_{C×F}`` splits the dim into blocks over C and
    each C block into sub-blocks over F, so dropping the minor dim F is exactly a segmented
    allgather over F. (The paper lists the minor dim first and writes the same layouts of
    stationary-w as ``x[o,o_{F×C},o,o]`` and ``y[o,o_{C×F},o,o]``.)

    **Stationary-x** (channel parallelism, ``w[*,o_C]``; needs F = 1)::

        forward    1. Σ_C y[o,*,o,o] = conv(x[o,o_C,o,o], w[*,o_C])       local
                   2. y[o,o_C,o,o]   <- Σ_C y[o,*,o,o]                    reduce-scatter over C
        backward   1. dL/dy[o,*,o,o] <- dL/dy[o,o_C,o,o]                  allgather over C
                   2. dL/dx[o,o_C,o,o] = conv_bwd_data(dL/dy[o,*,o,o], w[*,o_C])
                   3. dL/dw[*,o_C]   = conv_bwd_filter(x[o,o_C,o,o], dL/dy[o,*,o,o])

    **Stationary-y** (filter parallelism, ``w[o_F,*]``; needs C = 1)::

        forward    1. x[o,*,o,o]     <- x[o,o_F,o,o]                      allgather over F
                   2. y[o,o_F,o,o]   = conv(x[o,*,o,o], w[o_F,*])         local
        backward   1. Σ_F dL/dx[o,*,o,o] = conv_bwd_data(dL/dy[o,o_F,o,o], w[o_F,*])
                   2. dL/dx[o,o_F,o,o] <- Σ_F dL/dx[o,*,o,o]              reduce-scatter over F
                   3. dL/dw[o_F,*]   = conv_bwd_filter(x[o,*,o,o], dL/dy[o,o_F,o,o])

    **Stationary-w** (channel and filter parallelism, ``w[o_F,o_C]``)::

        forward    1. x[o,o_C,o,o]   <- x[o,o_{C×F},o,o]                  allgather over F
                   2. Σ_C y[o,o_F,o,o] = conv(x[o,o_C,o,o], w[o_F,o_C])   local
                   3. y[o,o_{F×C},o,o] <- Σ_C y[o,o_F,o,o]                reduce-scatter over C
        backward   1. dL/dy[o,o_F,o,o] <- dL/dy[o,o_{F×C},o,o]            allgather over C
                   2. Σ_F dL/dx[o,o_C,o,o] = conv_bwd_data(dL/dy[o,o_F,o,o], w[o_F,o_C])
                   3. dL/dx[o,o_{C×F},o,o] <- Σ_F dL/dx[o,o_C,o,o]        reduce-scatter over F
                   4. dL/dw[o_F,o_C] = conv_bwd_filter(x[o,o_C,o,o], dL/dy[o,o_F,o,o])

    **Grouped convolutions** (``groups > 1``) run under every algorithm, their channels and
    filters blocked over the role dims R (C for stationary-x, F for -y, C×F for -w), ``w[o_R,*]``.
    Where each rank's channel block and filter block hold the same whole groups (``groups``
    divisible by R; a depthwise layer of any width), ``x[o,o_R,o,o] -> y[o,o_R,o,o]`` is a local
    grouped convolution with no communication. Where the blocks cut groups (RegNet's 19 groups
    over 2 blocks), each rank gathers the channels first and convolves the groups its filters
    reach into::

        forward    1. x[o,*,o,o]     <- x[o,o_R,o,o]                      allgather over R
                   2. y[o,o_R,o,o]   = conv(x[o,groups of my filters,o,o], w[o_R,*])  local
        backward   1. Σ_R dL/dx[o,*,o,o] = conv_bwd_data(dL/dy[o,o_R,o,o], w[o_R,*])
                   2. dL/dx[o,o_R,o,o] <- Σ_R dL/dx[o,*,o,o]              reduce-scatter over R

    (the filters of a group cut by the block boundary that another rank owns are zero rows of
    the local weight, their outputs dropped).

    Stationary-x and -y are stationary-w with F = 1 and C = 1. Because y's channel dim is blocked
    ``o_{F×C}``, a following stationary-w layer built with ``channel_dim="F", filter_dim="C"``
    takes it as its ``x[o,o_{F×C},o,o]`` with no data movement between the layers.

    **Sample and spatial parallelism** combine with all three. Samples are blocked over N. H and W
    are blocked over the grid dims H and W: each rank owns a balanced block of the *output* rows
    and of the input rows, and after forward step 1 it gathers the input rows its output block
    reads from their owners (halo exchange, H then W, so corners travel with the W exchange),
    adding the global padding itself; the convolution then runs unpadded on those dims. In
    backward the halo rows' gradients go back to their owners and are added there (halo
    accumulate), before the reduce-scatter of dL/dx. Any kernel (odd or even), stride, dilation and
    padding (ints, pairs, ``'same'``, ``'valid'``), every padding mode (the rows that
    ``'reflect'``, ``'replicate'`` and ``'circular'`` copy travel like halo rows) and uneven blocks
    on every dim are exact.

    **Bias** is distributed like y's channel dim (``b[o_C]``, ``b[o_F]``, ``b[o_{F×C}]``) and added
    after the last forward step.

    **Gradient completion** (the last backward step of every algorithm,
    ``dL/dw <- Σ_{N,H,W} dL/dw``: allreduce over N×H×W). Weight and bias are ordinary
    ``nn.Parameter`` shards, replicated over the grid dims their distribution does not use (N, H
    and W). Their local gradients are pending sums over those dims; a segmented allreduce over them is started asynchronously from a hook
    the moment each gradient is ready and finished by an autograd callback before
    ``loss.backward()`` returns, so an optimizer reads complete gradients. Gradients accumulate over
    several backward passes as in PyTorch. After gradients computed any other way (e.g.
    ``torch.autograd.grad``), call :meth:`finish_grad_sync`.

    **Global shapes.** Collectives are planned from global shapes only. The layer knows C and F
    from its parameters; the global N, H, W come from, in this order: the ``global_shape``
    argument of :meth:`forward`, the ``input_shape`` given at construction, or -- when N, H and W
    are not distributed -- the local input itself. Otherwise the ranks of the N×H×W segment agree
    on them with one small allgather of their local sizes per forward call (counted by the
    communicator; pass the shape to avoid it).

    Example::

        grid = ProcessorGrid({"N": 2, "C": 2})                  # 4 ranks
        conv = DistConv2d(128, 128, 3, padding=1, grid=grid, algorithm="stationary-x")
        shape = (32, 128, 28, 28)                               # global input
        x = X[conv.input_dist.local_slices(shape, grid)]        # this rank's x[o,o_C,o,o]
        y = conv(x, shape)                                      # this rank's y[o,o_C,o,o]
        y.square().sum().backward()                             # weight/bias grads complete
        dense = conv.to_conv2d()                                # collective: a plain nn.Conv2d

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups: as
            ``nn.Conv2d`` (global sizes).
        bias, padding_mode, device, dtype: as ``nn.Conv2d``.
        grid: the :class:`~distconv.grid.ProcessorGrid` over all ranks. Its dims must be among
            the five role names.
        algorithm: ``'stationary-x'``, ``'stationary-y'`` or ``'stationary-w'``.
        channel_dim: grid dim distributing input channels. Default ``"C"``.
        filter_dim: grid dim distributing output filters. Default ``"F"``.
        sample_dim: grid dim distributing samples. Default ``"N"``.
        spatial_dims: grid dims distributing H and W. Default ``("H", "W")``.
        input_shape: the global input shape ``(N, C, H, W)`` if fixed; validated at construction.
            Default ``None``.
        init_seed: seed of the initial global weight and bias (every rank slices the same global
            tensors; drawn like ``nn.Conv2d.reset_parameters``). Default ``None``: rank 0 draws one
            from torch's default generator and broadcasts it.
        pipeline: chunks of this rank's samples the layer is pipelined over
            (:mod:`distconv.nn.pipeline`): chunk i's allgather over F and reduce-scatter over C
            (in backward: allgather of dL/dy, reduce-scatter of dL/dx) run while chunk i+1
            computes. The same bytes and the same sums; at most as many chunks as samples.
            Default 1 (not pipelined). Under autocast, or with a ``work_hook`` (distkfac), the
            layer runs unpipelined (the same result).
        overlap: convolve the interior rows (whose windows lie in the rank's own rows) while
            the halo rows travel, then the border rows; in backward the border rows' input
            gradients first, the interior's while their halo part travels back
            (:func:`distconv.nn.halo_conv.halo_conv`). For layers that split one of H, W (with a
            kernel wider than one row there) and pad with zeros. The same bytes; the results
            equal the unoverlapped layer's up to the order of sums. Default False. Under
            autocast, with a ``work_hook`` or pipelined, the layer runs unoverlapped.
        gathered_input: the input arrives already whole over the filter dim, as
            :attr:`work_dist` (forward step 1's result), and the layer skips that allgather and
            its adjoint (the cotangent of x leaves pending over F). Its caller gathers it once
            for every layer that reads the same value: ``parallelize`` does, for a value that
            several stationary-y or -w layers on one grid read. For layers that gather x (F > 1,
            not stationary-x, not grouped) and are not pipelined. Default False.

    Raises:
        ValueError: an unknown algorithm or padding mode, a grid dim without a role, a grid that
            the algorithm cannot use (e.g. F > 1 with stationary-x), more ranks than channels,
            filters, samples, input or output rows on some dim, ``pipeline`` or
            ``gathered_input`` on a grouped layer whose blocks cut groups, or a padding mode that cannot pad the input (reflect:
            padding < size; circular: padding <= size). Each message says what would work.
            Checks that need the global input shape run at construction when ``input_shape`` is
            given, else at the first forward with that shape.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: str | int | tuple[int, int] = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        grid: ProcessorGrid,
        algorithm: str,
        channel_dim: str = "C",
        filter_dim: str = "F",
        sample_dim: str = "N",
        spatial_dims: tuple[str, str] = ("H", "W"),
        input_shape: Sequence[int] | None = None,
        init_seed: int | None = None,
        pipeline: int = 1,
        overlap: bool = False,
        gathered_input: bool = False,
    ) -> None:
        super().__init__()
        self.in_channels, self.out_channels = _positive(in_channels, "in_channels"), _positive(
            out_channels, "out_channels"
        )
        self.kernel_size = pair(kernel_size, "kernel_size")
        self.stride = pair(stride, "stride")
        self.dilation = pair(dilation, "dilation")
        for name in ("kernel_size", "stride", "dilation"):
            if min(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        self.padding: str | tuple[int, int] = (
            padding if isinstance(padding, str) else pair(padding, "padding")
        )
        self._pads = normalize_padding(padding, self.kernel_size, self.stride, self.dilation)
        self.groups = _positive(groups, "groups")
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"in_channels ({in_channels}) and out_channels ({out_channels}) must be divisible "
                f"by groups ({groups})"
            )
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool, got {bias!r}")
        if init_seed is not None and (isinstance(init_seed, bool) or not isinstance(init_seed, int)):
            raise TypeError(f"init_seed must be None or an int, got {init_seed!r}")
        for role, dim in (("channel_dim", channel_dim), ("filter_dim", filter_dim),
                          ("sample_dim", sample_dim)):
            if not isinstance(dim, str):
                raise TypeError(f"{role} must be a grid dim name (str), got {dim!r}")
        if padding_mode not in PADDING_MODES:
            raise ValueError(f"padding_mode must be one of {PADDING_MODES}, got {padding_mode!r}")
        self.padding_mode = padding_mode
        self._reversed_padding = tuple(p for pads in reversed(self._pads) for p in pads)
        if not isinstance(grid, ProcessorGrid):
            raise TypeError(
                f"grid must be a distconv.grid.ProcessorGrid, got {type(grid).__name__}"
            )
        if (not isinstance(spatial_dims, (tuple, list)) or len(spatial_dims) != 2
                or not all(isinstance(d, str) for d in spatial_dims)):
            raise TypeError(f"spatial_dims must be a pair of grid dim names, got {spatial_dims!r}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        self.grid, self.algorithm = grid, algorithm
        self.roles = {
            "sample_dim": sample_dim, "channel_dim": channel_dim, "filter_dim": filter_dim,
            "H": spatial_dims[0], "W": spatial_dims[1],
        }
        self._check_grid()
        self._build_dists()
        self._local = all(
            self._ext(self.roles[r]) == 1 for r in ("channel_dim", "filter_dim", "H", "W")
        )
        grouped = self._group_parts > 1
        self._gather_x = self._gather_groups or (
            not grouped and algorithm != "stationary-x" and self._ext(filter_dim) > 1)
        self._reduce_y = not grouped and algorithm != "stationary-y" and self._ext(channel_dim) > 1
        #: the groups of this rank's local convolution
        self._local_groups = self.groups if self._span is None else (
            self._span.g1 - self._span.g0)
        if isinstance(pipeline, bool) or not isinstance(pipeline, int):
            raise TypeError(f"pipeline must be an int (chunks of samples), got {pipeline!r}")
        if pipeline < 1:
            raise ValueError(f"pipeline must be at least 1 (1: not pipelined), got {pipeline}")
        if pipeline > 1 and self._gather_groups:
            raise ValueError(
                f"use pipeline=1 for this grouped {algorithm} layer on the grid "
                f"{dict(grid.layout)}: its channel blocks do not hold whole groups (groups="
                f"{self.groups}), so it gathers x whole first, which is not pipelined")
        if pipeline > 1 and not (self._gather_x or self._reduce_y):
            raise ValueError(
                f"pipeline={pipeline} overlaps the allgather over F and the reduce-scatter over "
                f"C with the local convolution, but this {algorithm} layer on the grid "
                f"{dict(grid.layout)} runs neither; use pipeline=1, or a grid that splits "
                f"channels (stationary-x, -w) or filters (stationary-y, -w)"
            )
        #: Chunks of samples the local convolution is split into so that each chunk's
        #: collectives overlap the next chunk's compute (1: not pipelined).
        self.pipeline = pipeline
        if not isinstance(gathered_input, bool):
            raise TypeError(f"gathered_input must be a bool, got {gathered_input!r}")
        if gathered_input and self._gather_groups:
            raise ValueError(
                f"use gathered_input=False for this grouped {algorithm} layer on the grid "
                f"{dict(grid.layout)}: its channel blocks do not hold whole groups, so it "
                "gathers x over them itself")
        if gathered_input and (not self._gather_x or pipeline > 1):
            raise ValueError(
                f"gathered_input=True skips the allgather of x over F, but this {algorithm} "
                f"layer on the grid {dict(grid.layout)}"
                + (f" is pipelined (pipeline={pipeline}: its chunks gather x themselves)"
                   if self._gather_x else " gathers nothing")
                + "; use gathered_input=False" + ("" if self._gather_x else
                                                  ", or stationary-y/-w with F > 1"))
        #: Whether the input arrives as :attr:`work_dist` (gathered over F by the caller).
        self.gathered_input = gathered_input
        if gathered_input:
            self.input_dist, self._gather_x = self.work_dist, False
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {overlap!r}")
        split = [i for i, role in enumerate(spatial_dims) if self._ext(role) > 1]
        if overlap and (len(split) != 1 or padding_mode != "zeros"
                        or (self.kernel_size[split[0]] - 1) * self.dilation[split[0]] == 0):
            raise ValueError(
                f"overlap=True overlaps the halo exchange of one split spatial dim with the "
                f"interior rows, but this layer on {dict(grid.layout)} splits "
                f"{len(split)} of H, W" + (f" and pads with {padding_mode!r}"
                                           if padding_mode != "zeros" else "")
                + (" and reads one row there" if len(split) == 1 else "")
                + "; use a grid that splits one of them, a kernel wider than one row there and "
                "padding_mode='zeros', or overlap=False")
        #: Whether the halo exchange overlaps the interior rows' convolution.
        self.overlap = overlap
        #: Called after the local convolution as ``work_hook(layer, x, padding, y, y_shape)``:
        #: ``x`` the input the local convolution read (after the allgather over F and the halo
        #: exchange), ``padding`` the zero padding (left, right, top, bottom) it still applied,
        #: ``y`` its output (``partial_dist``; its gradient is dL/dy after the backward
        #: allgather over C) and ``y_shape`` the global output shape (N is -1 when this rank
        #: does not know it). distkfac reads its factors here. Default None.
        self.work_hook: Any = None
        self.input_shape = None if input_shape is None else self._check_input_shape(input_shape)
        self._geometries: dict[tuple[int, ...], ConvGeometry] = {}
        self._specs: dict[tuple[int, ...], HaloConvSpec] = {}  # per global input shape
        #: (input block shape, given global shape) -> the global shape, once checked
        self._checked: dict[tuple[Any, tuple[int, ...]], tuple[int, ...]] = {}
        if self.input_shape is not None:
            layer_geometry(self, self.input_shape)
        # Sub-communicators are created collectively, in the same order on every rank.
        self._shape_comm = self._subcomm(sample_dim, *spatial_dims)
        self._halo_comms = tuple(self._subcomm(d) for d in spatial_dims)
        redundant = tuple(d for d in self.weight_dist.redundant(grid) if self._ext(d) > 1)
        where = f"DistConv2d({in_channels}, {out_channels}, {algorithm}) over {'×'.join(redundant)}"
        self.grad_sync = GradSync(self._subcomm(*redundant), where=where) if redundant else None
        check_factory_kwargs(device, dtype, "DistConv2d")
        self._make_parameters(bias, device, dtype, init_seed)

    # ------------------------------------------------------------------ construction
    def _ext(self, name: str) -> int:
        return self.grid.shape.get(name, 1)

    def _subcomm(self, *dims: str) -> Any:
        """The segment over those of ``dims`` the grid splits (None when it splits none)."""
        split = [d for d in dims if self._ext(d) > 1]
        return self.grid.subcomm(split) if split else None

    def _check_grid(self) -> None:
        roles = self.roles
        names = list(roles.values())
        if len(set(names)) != len(names):
            raise ValueError(f"the grid-dim roles must be distinct, got {roles}")
        for d in self.grid.names:
            if d not in names:
                raise ValueError(
                    f"grid dim {d!r} of {self.grid!r} has no role in DistConv2d; roles are "
                    + ", ".join(f"{k}={v!r}" for k, v in roles.items())
                )
        c, f = self._ext(roles["channel_dim"]), self._ext(roles["filter_dim"])
        if self.algorithm == "stationary-x" and f > 1:
            raise ValueError(
                f"algorithm='stationary-x' distributes only channels, but the grid has "
                f"{roles['filter_dim']}={f}; use algorithm='stationary-w' (or stationary-y)"
            )
        if self.algorithm == "stationary-y" and c > 1:
            raise ValueError(
                f"algorithm='stationary-y' distributes only filters, but the grid has "
                f"{roles['channel_dim']}={c}; use algorithm='stationary-w' (or stationary-x)"
            )
        self._group_parts = 1
        #: a grouped layer whose channel blocks do not hold whole groups: x is gathered over
        #: the role dims and each rank convolves the groups its filters reach into
        self._gather_groups = False
        self._span: GroupSpan | None = None
        if self.groups > 1 and (c > 1 or f > 1):
            self._group_parts = c * f
            dims, extents = group_role(self.algorithm, self.grid.shape, roles["channel_dim"],
                                       roles["filter_dim"])
            coords = tuple(self.grid.coords.get(d, 0) for d in dims)
            if min(self.in_channels, self.out_channels) >= c * f:
                self._gather_groups = not groups_aligned(
                    self.in_channels, self.out_channels, self.groups, extents)
                self._span = group_span(self.out_channels, self.groups, extents, coords)
        parts = c * f
        for what, n in (("in_channels", self.in_channels), ("out_channels", self.out_channels)):
            if n < parts:
                raise ValueError(
                    f"{what}={n} is smaller than the {parts} channel/filter blocks of "
                    f"{self.grid!r} under {self.algorithm}; every rank needs at least one: use "
                    f"{roles['channel_dim']}×{roles['filter_dim']} <= {n}"
                )

    def _role(self, role: str) -> str | None:
        name = self.roles[role]
        return name if name in self.grid.shape or name in ("N", "C", "F", "H", "W") else None

    def _build_dists(self) -> None:
        roles = {k: self._role(r) for k, r in (("N", "sample_dim"), ("C", "channel_dim"),
                                               ("F", "filter_dim"), ("H", "H"), ("W", "W"))}
        d = conv_dists(self.algorithm, roles, grouped=self._group_parts > 1,
                       gather_groups=self._gather_groups)
        self.input_dist, self.work_dist = d["input"], d["work"]
        self.partial_dist, self.output_dist = d["partial"], d["output"]
        self.weight_dist, self.bias_dist = d["weight"], d["bias"]

    def _check_input_shape(self, shape: Sequence[int]) -> tuple[int, int, int, int]:
        shape = as_shape(shape, "input_shape")
        if len(shape) != 4 or shape[1] != self.in_channels:
            raise ValueError(
                f"input_shape must be the global (N, C, H, W) with C = in_channels = "
                f"{self.in_channels}, got {shape}"
            )
        n_dim = self.roles["sample_dim"]
        if shape[0] < self._ext(n_dim):
            raise ValueError(
                f"the global batch {shape[0]} is smaller than grid dim {n_dim}={self._ext(n_dim)}; "
                f"every rank needs at least one sample: use {n_dim} <= {shape[0]}"
            )
        return shape  # type: ignore[return-value]


    def _make_parameters(
        self, bias: bool, device: Any, dtype: torch.dtype | None, seed: int | None
    ) -> None:
        kw = {"device": device, "dtype": dtype}
        w_local = self.weight_dist.local_shape(self.weight_shape, self.grid)
        self.weight = nn.Parameter(torch.empty(w_local, **kw))
        if bias:
            b_local = self.bias_dist.local_shape((self.out_channels,), self.grid)
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(b_local, **kw))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters(seed)
        if self.grad_sync is not None:
            self.grad_sync.register(self.weight)
            if self.bias is not None:
                self.grad_sync.register(self.bias)
        register_parameter_specs(self, self.grid.comm)  # for distconv.clip_grad_norm_

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        """Global weight shape ``(out_channels, in_channels // groups, kh, kw)``."""
        return (self.out_channels, self.in_channels // self.groups, *self.kernel_size)

    def reset_parameters(self, seed: int | None = None) -> None:
        """Re-draw weight and bias like ``nn.Conv2d`` from a seed shared by all ranks (collective
        when ``seed`` is None)."""
        if seed is None:
            seed = self._agree_seed()
        gen = torch.Generator().manual_seed(int(seed))
        w = torch.empty(self.weight_shape, dtype=self.weight.dtype)
        nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=gen)
        fan_in = self.weight_shape[1] * self.kernel_size[0] * self.kernel_size[1]
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        b = torch.empty(self.out_channels, dtype=self.weight.dtype).uniform_(
            -bound, bound, generator=gen
        )
        self.load_global_parameters(w, b if self.bias is not None else None)

    def _agree_seed(self) -> int:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64) if self.grid.rank == 0 else (
            torch.zeros(1, dtype=torch.int64)
        )
        seed = seed.to(self.grid.comm.device)
        if self.grid.size > 1:
            seed = self.grid.comm.broadcast(seed, root=0, meta="DistConv2d init seed")
        return int(seed.item())

    @torch.no_grad()
    def load_global_parameters(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Copy this rank's shards of the global ``weight`` (and ``bias``) into the parameters.

        Every rank passes the same global tensors; no communication (in debug mode,
        :func:`distconv.comm.set_debug`, the ranks first compare digests of them and raise
        :class:`~distconv.comm.CollectiveMismatchError` when they differ).
        """
        for name, t in (("weight", weight), ("bias", bias)):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(weight.shape) != self.weight_shape:
            raise ValueError(
                f"weight must have the global shape {self.weight_shape}, got {tuple(weight.shape)}"
            )
        if get_debug():
            agree_on_value(self.grid.comm, weight, "DistConv2d: the global weight")
            if bias is not None:
                agree_on_value(self.grid.comm, bias, "DistConv2d: the global bias")
        self.weight.copy_(weight[self.weight_dist.local_slices(self.weight_shape, self.grid)])
        if self.bias is not None:
            if bias is None or tuple(bias.shape) != (self.out_channels,):
                raise ValueError(f"bias must have the global shape ({self.out_channels},)")
            self.bias.copy_(bias[self.bias_dist.local_slices((self.out_channels,), self.grid)])

    @classmethod
    def from_conv2d(
        cls, conv: nn.Conv2d, *, grid: ProcessorGrid, algorithm: str, **options: Any
    ) -> DistConv2d:
        """Shard an existing ``nn.Conv2d`` (the same on every rank) onto ``grid``.

        ``options`` are the keyword options of the constructor (roles, ``input_shape``).
        """
        if not isinstance(conv, nn.Conv2d):
            raise TypeError(f"conv must be an nn.Conv2d, got {type(conv).__name__}")
        layer = cls(
            conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
            conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode,
            conv.weight.device, conv.weight.dtype, grid=grid, algorithm=algorithm,
            init_seed=0, **options,
        )
        layer.load_global_parameters(
            conv.weight.detach(), None if conv.bias is None else conv.bias.detach()
        )
        keep_requires_grad(layer, conv, ("weight", "bias"))
        return layer

    def _shard_specs(self) -> dict[str, ShardSpec]:
        specs = {"weight": ShardSpec(self.grid, self.weight_dist, self.weight_shape)}
        if self.bias is not None:
            specs["bias"] = ShardSpec(self.grid, self.bias_dist, (self.out_channels,))
        return specs

    # ------------------------------------------------------------------ gathering
    def gather_weight(self) -> torch.Tensor:
        """The global weight on every rank (collective)."""
        return gather(self.weight.detach(), self.weight_dist, self.grid, self.weight_shape)

    def gather_bias(self) -> torch.Tensor | None:
        """The global bias on every rank (collective), or None."""
        if self.bias is None:
            return None
        return gather(self.bias.detach(), self.bias_dist, self.grid, (self.out_channels,))

    def to_conv2d(self) -> nn.Conv2d:
        """A plain ``nn.Conv2d`` with the gathered global parameters, on every rank (collective)."""
        w, b = self.gather_weight(), self.gather_bias()
        conv = nn.Conv2d(
            self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding,
            self.dilation, self.groups, self.bias is not None, self.padding_mode,
            device=w.device, dtype=w.dtype,
        )
        with torch.no_grad():
            conv.weight.copy_(w)
            if b is not None:
                conv.bias.copy_(b)
        return conv

    def finish_grad_sync(self) -> None:
        """Finish pending gradient allreduces (``loss.backward()`` does this itself)."""
        if self.grad_sync is not None:
            self.grad_sync.finish()

    # ------------------------------------------------------------------ shapes
    def output_shape(self, input_shape: Sequence[int]) -> tuple[int, int, int, int]:
        """Global output shape for the global input shape ``(N, C, H, W)``."""
        return layer_geometry(self, tuple(int(s) for s in input_shape)).y_shape

    def local_input_shape(self, input_shape: Sequence[int]) -> tuple[int, ...]:
        """This rank's input block for the global input shape."""
        return self.input_dist.local_shape(tuple(input_shape), self.grid)


    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, global_shape: Sequence[int] | None = None) -> torch.Tensor:
        """Convolve this rank's block ``x`` (distributed as :attr:`input_dist`).

        Returns this rank's block of y, distributed as :attr:`output_dist`. ``global_shape`` is
        the global input shape ``(N, C, H, W)`` (see the class docstring). The steps are
        :func:`distconv.nn.conv_forward.conv_forward`.
        """
        return conv_forward(self, x, global_shape)

    # ------------------------------------------------------------------ description
    def describe(self, input_shape: Sequence[int]) -> str:
        """The forward steps with distributions and plans for the global ``input_shape``."""
        shape = tuple(int(s) for s in input_shape)
        geo = layer_geometry(self, shape)
        lines = [f"{self.algorithm} on {dict(self.grid.layout)}"]
        move = plan_redistribution(self.grid.layout, self.input_dist, self.work_dist, shape)
        lines.append(f"  {move.describe()}")
        for i, plan in enumerate(geo.halo):
            if plan is not None:
                lines.append(f"  halo exchange on {self.roles['HW'[i]]} ({plan.parts} blocks)")
        lines.append(
            f"  conv: {self.work_dist.format('x')} * {self.weight_dist.format('w')} -> "
            f"{self.partial_dist.format('y')}"
        )
        move = plan_redistribution(
            self.grid.layout, self.partial_dist, self.output_dist, geo.y_shape
        )
        lines.append(f"  {move.describe()}")
        if self.grad_sync is not None:
            lines.append(f"  backward: gradient allreduce {self.grad_sync.where}")
        traffic = conv_traffic(
            self._problem(shape), self.grid.layout, self.algorithm, self.grid.coords,
            itemsize=self.weight.element_size(), channel_dim=self.roles["channel_dim"],
            filter_dim=self.roles["filter_dim"], sample_dim=self.roles["sample_dim"],
            spatial_dims=(self.roles["H"], self.roles["W"]),
        )
        lines.append(
            f"  bytes received by rank {self.grid.rank}: forward {traffic.forward_bytes:,}, "
            f"backward {traffic.backward_bytes:,} (distconv.pricing.traffic)"
        )
        return "\n".join(lines)

    def _problem(self, input_shape: Sequence[int]) -> ConvProblem:
        n, c, h, w = input_shape
        return ConvProblem(
            n, c, self.out_channels, h, w, self.kernel_size, self.stride, self.padding,
            self.dilation, self.groups, self.bias is not None, self.padding_mode,
        )

    def extra_repr(self) -> str:
        s = (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding!r}, dilation={self.dilation}, "
            f"groups={self.groups}, bias={self.bias is not None}, "
            f"padding_mode={self.padding_mode!r}, grid={dict(self.grid.layout)}, "
            f"algorithm={self.algorithm!r}"
        )
        defaults = {"sample_dim": "N", "channel_dim": "C", "filter_dim": "F", "H": "H", "W": "W"}
        changed = {k: v for k, v in self.roles.items() if defaults[k] != v}
        if changed:
            s += ", " + ", ".join(f"{k}={v!r}" for k, v in changed.items())
        if self.input_shape is not None:
            s += f", input_shape={self.input_shape}"
        if self.pipeline > 1:
            s += f", pipeline={self.pipeline}"
        if self.overlap:
            s += ", overlap=True"
        if self.gathered_input:
            s += ", gathered_input=True"
        dists = (self.input_dist.format("x"), self.weight_dist.format("w"),
                 self.output_dist.format("y"))
        return s + ", x={}, w={}, y={}".format(*dists)


def _positive(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value
