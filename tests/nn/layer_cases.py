"""Shared pieces of the BatchNorm and pooling tests: a case, the single-process reference, the
per-rank run and the checks.

Module-level functions so that real worker processes (gloo, MPI) can import and run them.
Expected distributions are written here from the paper's rules, never read back from a layer:
BN and windowed pooling keep x's Dist; BN's parameters are distributed like x's channel entry;
global average pooling keeps the N and C entries, replicates H and W, and is a pending sum over
the grid dims that split H and W.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from distconv.distribution import Dist, Entry
from distconv.grid import ProcessorGrid
from distconv.nn import DistAdaptiveAvgPool2d, DistAvgPool2d, DistBatchNorm2d, DistMaxPool2d
from distconv.redistribute import gather, redistribute, scatter

TOLERANCES = {torch.float64: (1e-10, 1e-11), torch.float32: (2e-5, 2e-5)}
KINDS = ("bn", "max", "avg", "adaptive")


@dataclass(frozen=True)
class LayerCase:
    """One layer (``kind``) on one grid with x distributed as ``entries`` (N, C, H, W)."""

    kind: str
    grid: tuple[tuple[str, int], ...]
    entries: tuple[Entry, Entry, Entry, Entry]
    shape: tuple[int, int, int, int]
    options: dict[str, Any] = field(default_factory=dict)
    dtype: torch.dtype = torch.float64
    seed: int = 0

    @property
    def size(self) -> int:
        return math.prod(e for _, e in self.grid)

    @property
    def x_dist(self) -> Dist:
        return Dist(self.entries)

    def extent(self, name: str) -> int:
        return dict(self.grid).get(name, 1)

    def expected_y_dist(self) -> Dist:
        if self.kind != "adaptive":
            return self.x_dist
        spatial = [g for e in self.entries[2:] for g in _names(e) if self.extent(g) > 1]
        return Dist((self.entries[0], self.entries[1], None, None), frozenset(spatial))

    def expected_param_dist(self) -> Dist:
        return Dist((self.entries[1],))


def _names(entry: Entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def torch_layer(case: LayerCase) -> nn.Module:
    o = case.options
    if case.kind == "bn":
        return nn.BatchNorm2d(case.shape[1], dtype=case.dtype, **o)
    if case.kind == "max":
        return nn.MaxPool2d(**o)
    if case.kind == "avg":
        return nn.AvgPool2d(**o)
    return nn.AdaptiveAvgPool2d((1, 1))


def dist_layer(case: LayerCase, layer: nn.Module, grid: ProcessorGrid) -> nn.Module:
    kw = {"grid": grid, "input_dist": case.x_dist}
    if case.kind == "bn":
        return DistBatchNorm2d.from_batchnorm2d(layer, **kw)
    if case.kind == "max":
        return DistMaxPool2d.from_plain(layer, **kw)
    if case.kind == "avg":
        return DistAvgPool2d.from_plain(layer, **kw)
    return DistAdaptiveAvgPool2d.from_plain(layer, **kw)


#: BN runs three phases (two in training, one in eval); pooling one.
def phases(case: LayerCase) -> list[bool]:
    return [True, True, False] if case.kind == "bn" else [True]


def reference(case: LayerCase) -> dict[str, Any]:
    """Inputs, cotangents and the single-process results of every phase."""
    gen = torch.Generator().manual_seed(case.seed)
    layer = torch_layer(case)
    if case.kind == "bn":
        with torch.no_grad():
            c = case.shape[1]
            if layer.affine:
                layer.weight.copy_(torch.randn(c, generator=gen, dtype=case.dtype))
                layer.bias.copy_(torch.randn(c, generator=gen, dtype=case.dtype))
            if layer.track_running_stats:
                layer.running_mean.copy_(torch.randn(c, generator=gen, dtype=case.dtype))
                layer.running_var.copy_(torch.rand(c, generator=gen, dtype=case.dtype) + 0.5)
                layer.num_batches_tracked.fill_(3)
    initial = copy.deepcopy(layer)
    steps = []
    for training in phases(case):
        layer.train(training)
        x = torch.randn(case.shape, generator=gen, dtype=case.dtype)
        if case.kind == "bn":  # statistics far from (0, 1); pooling keeps negative values, so
            x = x * 3 + 5      # that a max window that saw padding as 0 would be caught
        x.requires_grad_()
        y = layer(x)
        g = torch.randn(y.shape, generator=gen, dtype=case.dtype)
        for p in layer.parameters():
            p.grad = None
        y.backward(g)
        step = {"x": x.detach(), "g": g, "y": y.detach(), "dx": x.grad}
        for name in ("weight", "bias"):
            p = getattr(layer, name, None)
            if p is not None:
                step[f"d{name}"] = p.grad.clone()
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            b = getattr(layer, name, None)
            if b is not None:
                step[name] = b.clone()
        steps.append(step)
    return {"layer": initial, "steps": steps}


def _compare(errors: dict[str, str], name: str, got: torch.Tensor | None, want: torch.Tensor,
             dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCES[dtype]
    if got is None or tuple(got.shape) != tuple(want.shape):
        errors[name] = f"shape {None if got is None else tuple(got.shape)} != {tuple(want.shape)}"
    elif got.dtype != want.dtype or not torch.allclose(got, want, rtol=rtol, atol=atol):
        errors[name] = f"max abs error {(got.double() - want.double()).abs().max().item():.3g}"


def run_case(comm: Any, case: LayerCase, ref: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run every phase of ``case`` on this rank; return the mismatches against the reference."""
    ref = reference(case) if ref is None else ref
    grid = ProcessorGrid(dict(case.grid), comm=comm)
    layer = dist_layer(case, ref["layer"], grid)
    x_dist, y_dist = case.x_dist, case.expected_y_dist()
    w_dist = case.expected_param_dist()
    errors: dict[str, str] = {}
    if layer.output_dist != y_dist:
        errors["output_dist"] = f"{layer.output_dist} != {y_dist}"
        return {"errors": errors, "coords": grid.coords}
    for name, spec in layer._shard_specs().items():
        want = Dist(()) if name == "num_batches_tracked" else w_dist
        if spec.dist != want:
            errors[f"{name} dist"] = f"{spec.dist} != {want}"
    shape = case.shape
    y_shape = tuple(ref["steps"][0]["y"].shape)
    w_slices = w_dist.local_slices((shape[1],), grid)
    for k, (training, step) in enumerate(zip(phases(case), ref["steps"])):
        layer.train(training)
        x = step["x"][x_dist.local_slices(shape, grid)].clone().requires_grad_()
        for p in layer.parameters():
            p.grad = None
        y = layer(x, shape)
        if case.kind == "adaptive":  # resolve the pending sum as a consumer would
            y_dist_done = Dist(y_dist.entries)
            y = redistribute(y, grid, y_dist, y_dist_done, y_shape)
        else:
            y_dist_done = y_dist
        _compare(errors, f"y{k}", y.detach(), step["y"][y_dist_done.local_slices(y_shape, grid)],
                 case.dtype)
        # the cotangent in the sum convention: a pending sum over y's redundant dims
        y.backward(scatter(step["g"], y_dist_done.dual(grid), grid))
        dx = gather(x.grad, x_dist.dual(grid), grid, shape)
        _compare(errors, f"dx{k}", dx, step["dx"], case.dtype)
        for name in ("weight", "bias"):
            if f"d{name}" in step:
                p = getattr(layer, name)
                _compare(errors, f"d{name}{k}", p.grad, step[f"d{name}"][w_slices], case.dtype)
        for name in ("running_mean", "running_var"):
            if name in step:
                _compare(errors, f"{name}{k}", getattr(layer, name), step[name][w_slices],
                         case.dtype)
        if "num_batches_tracked" in step:
            got, want = int(layer.num_batches_tracked), int(step["num_batches_tracked"])
            if got != want:
                errors[f"num_batches_tracked{k}"] = f"{got} != {want}"
    if case.kind == "bn":  # collective: the plain layer with the gathered state
        dense, last = layer.to_batchnorm2d(), ref["steps"][-1]
        for name in ("running_mean", "running_var"):
            if name in last:
                _compare(errors, f"to_batchnorm2d {name}", getattr(dense, name), last[name],
                         case.dtype)
        if dense.affine:
            _compare(errors, "to_batchnorm2d weight", dense.weight.detach(),
                     ref["layer"].weight.detach(), case.dtype)
    return {"errors": errors, "coords": grid.coords}


def check_results(case: LayerCase, results: list[dict[str, Any]]) -> None:
    for r, res in enumerate(results):
        assert not res["errors"], f"{case}: rank {r} {res['coords']}: {res['errors']}"


#: Fixed cases for the real engines (4 ranks): every layer, sample, channel and spatial splits,
#: uneven blocks, a tuple entry, ceil_mode overhangs.
REPRESENTATIVE = [
    LayerCase("bn", (("N", 2), ("C", 2)), ("N", "C", None, None), (3, 5, 4, 3),
              {"momentum": None}),
    LayerCase("bn", (("H", 2), ("W", 2)), (None, None, "H", "W"), (2, 3, 5, 3)),
    LayerCase("max", (("H", 2), ("W", 2)), (None, None, "H", "W"), (2, 3, 7, 6),
              {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True}),
    LayerCase("avg", (("C", 2), ("H", 2)), (None, "C", "H", None), (2, 3, 9, 5),
              {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True,
               "count_include_pad": False}),
    LayerCase("max", (("F", 2), ("C", 2)), (None, ("C", "F"), None, None), (2, 5, 4, 4),
              {"kernel_size": 2}),
    LayerCase("adaptive", (("N", 2), ("H", 2)), ("N", None, "H", None), (3, 4, 5, 2)),
]


def run_representative(comm: Any, kinds: tuple[str, ...] = KINDS) -> list[dict[str, Any]]:
    """The representative cases of the given kinds on this rank (one call per world)."""
    torch.set_num_threads(1)
    return [run_case(comm, case) for case in REPRESENTATIVE if case.kind in kinds]
