"""Shared pieces of the DistConv2d tests: a case description, the per-rank run and the checks.

Module-level functions so that real worker processes (gloo, MPI) can import and run them.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from distconv.grid import ProcessorGrid
from distconv.nn import DistConv2d
from distconv.perfmodel import ConvProblem, conv_traffic
from distconv.redistribute import gather

#: Tolerances per dtype (relative, absolute); values and gradients are O(1).
TOLERANCES = {torch.float64: (1e-10, 1e-11), torch.float32: (2e-5, 2e-5)}


@dataclass(frozen=True)
class ConvCase:
    """One layer on one grid: global sizes, conv parameters, algorithm and dtype."""

    grid: tuple[tuple[str, int], ...]
    algorithm: str
    batch: int
    in_channels: int
    out_channels: int
    height: int
    width: int
    conv: dict[str, Any] = field(default_factory=dict)
    dtype: torch.dtype = torch.float64
    seed: int = 0

    @property
    def size(self) -> int:
        return math.prod(e for _, e in self.grid)

    @property
    def input_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.in_channels, self.height, self.width)

    def problem(self) -> ConvProblem:
        c = self.conv
        return ConvProblem(
            self.batch, self.in_channels, self.out_channels, self.height, self.width,
            c.get("kernel_size", 1), c.get("stride", 1), c.get("padding", 0),
            c.get("dilation", 1), c.get("groups", 1), c.get("bias", True),
            c.get("padding_mode", "zeros"),
        )


def reference(case: ConvCase) -> dict[str, torch.Tensor | None]:
    """The single-process result: y, dL/dx, dL/dw, dL/db for a fixed random dL/dy."""
    gen = torch.Generator().manual_seed(case.seed)
    conv = nn.Conv2d(case.in_channels, case.out_channels, dtype=case.dtype, **case.conv)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen, dtype=case.dtype))
        if conv.bias is not None:
            conv.bias.copy_(torch.randn(conv.bias.shape, generator=gen, dtype=case.dtype))
    x = torch.randn(case.input_shape, generator=gen, dtype=case.dtype).requires_grad_(True)
    with warnings.catch_warnings():  # 'same' with an even kernel: PyTorch's own performance note
        warnings.simplefilter("ignore", UserWarning)
        y = conv(x)
    g = torch.randn(y.shape, generator=gen, dtype=case.dtype)
    y.backward(g)
    return {
        "conv": conv, "x": x.detach(), "g": g, "y": y.detach(), "dx": x.grad,
        "dw": conv.weight.grad, "db": None if conv.bias is None else conv.bias.grad,
    }


def run_case(comm: Any, case: ConvCase, ref: dict | None = None) -> dict[str, Any]:
    """Run ``case`` on this rank; return its max errors, weight share and bytes vs the model."""
    ref = reference(case) if ref is None else ref
    grid = ProcessorGrid(dict(case.grid), comm=comm)
    layer = DistConv2d.from_conv2d(ref["conv"], grid=grid, algorithm=case.algorithm)
    shape = case.input_shape
    y_shape = layer.output_shape(shape)
    x = ref["x"][layer.input_dist.local_slices(shape, grid)].clone().requires_grad_(True)
    comm.stats.reset()
    y = layer(x, shape)
    y.backward(ref["g"][layer.output_dist.local_slices(y_shape, grid)])
    measured = {op: b for op, b in comm.stats.snapshot()["bytes"].items() if b}
    model = conv_traffic(
        case.problem(), case.grid, case.algorithm, grid.coords,
        itemsize=torch.empty((), dtype=case.dtype).element_size(),
    ).by_op()
    # every result gathered to the global tensor on every rank (collective), then compared
    got = {
        "y": (gather(y.detach(), layer.output_dist, grid, y_shape), ref["y"]),
        "dx": (gather(x.grad, layer.input_dist, grid, shape), ref["dx"]),
        "dw": (gather(layer.weight.grad, layer.weight_dist, grid, layer.weight_shape), ref["dw"]),
    }
    if ref["db"] is not None:
        got["db"] = (gather(layer.bias.grad, layer.bias_dist, grid, (case.out_channels,)),
                     ref["db"])
    rtol, atol = TOLERANCES[case.dtype]
    errors = {}
    for name, (a, b) in got.items():
        if a is None or a.shape != b.shape:
            errors[name] = f"shape {None if a is None else tuple(a.shape)} != {tuple(b.shape)}"
        elif not torch.allclose(a, b, rtol=rtol, atol=atol):
            errors[name] = f"max abs error {(a - b).abs().max().item():.3g}"
    return {
        "errors": errors, "bytes": measured, "model_bytes": model,
        "weight_shape": tuple(layer.weight.shape), "coords": grid.coords,
    }


def check_results(case: ConvCase, results: list[dict[str, Any]]) -> None:
    for r, res in enumerate(results):
        assert not res["errors"], f"{case}: rank {r} {res['coords']}: {res['errors']}"
        assert res["bytes"] == res["model_bytes"], (
            f"{case}: rank {r} {res['coords']}: counted {res['bytes']} but the model says "
            f"{res['model_bytes']}"
        )


#: A representative set for real engines (4 ranks): every algorithm, hybrid grids, uneven sizes,
#: even kernels, stride, dilation, 'same' / 'valid' / tuple padding.
REPRESENTATIVE = [
    ConvCase((("C", 4),), "stationary-x", 2, 6, 5, 7, 6, {"kernel_size": 3, "padding": 1}),
    ConvCase((("F", 4),), "stationary-y", 3, 5, 7, 6, 5, {"kernel_size": 3, "padding": "same"}),
    ConvCase((("C", 2), ("F", 2)), "stationary-w", 2, 7, 5, 6, 7,
             {"kernel_size": (2, 3), "padding": "same", "bias": False}),
    ConvCase((("N", 2), ("C", 2)), "stationary-x", 3, 5, 4, 9, 8,
             {"kernel_size": 3, "stride": 2, "padding": (1, 2)}),
    ConvCase((("H", 2), ("W", 2)), "stationary-w", 2, 3, 4, 9, 7,
             {"kernel_size": 4, "dilation": 2, "padding": 3}),
    ConvCase((("F", 2), ("H", 2)), "stationary-y", 2, 4, 5, 11, 6,
             {"kernel_size": 3, "stride": 2, "padding": "valid"}),
    ConvCase((("N", 2), ("H", 2)), "stationary-x", 3, 3, 6, 7, 5,
             {"kernel_size": 3, "padding": 1, "groups": 3}),
    ConvCase((("C", 2), ("W", 2)), "stationary-x", 2, 5, 3, 5, 9, {"kernel_size": (1, 2)}),
    ConvCase((("C", 2), ("F", 2)), "stationary-w", 4, 9, 6, 8, 8,
             {"kernel_size": 3, "padding": 1}, dtype=torch.float32),
    ConvCase((("H", 2), ("N", 2)), "stationary-x", 2, 3, 4, 6, 5,
             {"kernel_size": 3, "padding": 2, "padding_mode": "reflect"}),
    ConvCase((("F", 2), ("N", 2)), "stationary-y", 3, 4, 6, 5, 5,
             {"kernel_size": 3, "padding": 1, "groups": 2}),
    ConvCase((("W", 4),), "stationary-x", 2, 3, 4, 5, 9,
             {"kernel_size": 3, "padding": (1, 3), "padding_mode": "circular"}),
]


def run_representative(comm: Any) -> list[dict[str, Any]]:
    """Every representative case on this rank (one call per world)."""
    torch.set_num_threads(1)
    return [run_case(comm, case) for case in REPRESENTATIVE]
