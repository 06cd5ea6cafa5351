"""The GPU check: CUDA exactness on thread ranks sharing one GPU, NCCL on a world of one, and
DistConv2d / split-convolution timings against cuDNN. One command, under 10 minutes on one GPU.

    python benchmarks/gpu_check.py                 # CUDA (the result); make gpu-check
    python benchmarks/gpu_check.py --device cpu    # the same logic on CPU, small (a dry run)
    python benchmarks/gpu_check.py --out DIR       # also write the result files to DIR

Part (a), exactness. Every check builds a single-process reference on the same device and
compares the distributed result with it (gathered to global tensors):

- DistConv2d stationary-x / -y / -w with spatial splits (halos), forward and the three
  gradients against ``nn.Conv2d``; fp64, and fp32 with TF32 off.
- a parallelized ResNet (``distconv.models.resnet_mini``, BatchNorm, the paper's hybrid on 4
  ranks) trained 2 SGD steps against one process: outputs, gradients, final parameters and
  BN running statistics; fp64.
- sharded K-FAC (``factor_sharding='exact'``) steps of DistConv2d layers against
  single-process K-FAC of the gathered layer; fp64.
- a checkpoint (``distconv.save`` / ``distconv.load``) saved from CUDA (model and optimizer
  state on 4 ranks), loaded on CPU into a plain model, saved there and loaded back onto CUDA on
  another layout; bitwise.
- NCCL through torch.distributed on a world of one (``init_process_group`` with a file://
  store): every collective on CUDA tensors, a DistConv2d layer, a checkpoint save, and the error
  for a CPU tensor.

Tolerances (values and gradients are O(1)): fp64 rtol 1e-10, atol 1e-11 (K-FAC: atol 1e-12, the
test suite's); fp32 (TF32 off) rtol 1e-4, atol 1e-4; checkpoints bitwise. Each check records
pass / fail / skip, its error text, and where the data was: the devices of the results, and the
tensors that went through the thread communicator (counted by device, in bytes).

Part (b), timings (CUDA only; ``--device cpu`` runs them tiny, as a dry run):

- one-rank DistConv2d vs ``nn.Conv2d`` (cuDNN), forward + backward, on ResNet-50 layer shapes:
  median of interleaved timed repeats (``torch.cuda.synchronize`` around each); target ratio
  <= 1.05.
- the local convolution a rank runs when channels (stationary-x: C/p input channels, all F
  filters) or filters (stationary-y: F/p filters, all C channels) are split p = 1, 2, 4, 8 ways:
  its forward + backward time against the full convolution's divided by p (1.0 = linear
  scaling; the SC'19 paper's observation is that cuDNN's kernels do not scale linearly).

Part (c): ``gpu_check.json`` and ``gpu_check.md`` under ``benchmarks/results/gpu/`` (and
``--out``); CPU dry runs write ``gpu_check_cpu.*`` instead.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import traceback
import zlib
from collections import Counter
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable as `python3 benchmarks/gpu_check.py` without install
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import distconv  # noqa: E402
import distkfac  # noqa: E402
from distconv.comm import SingleCommunicator  # noqa: E402
from distconv.comm.threads import ThreadCommunicator  # noqa: E402
from distconv.data import sample_block  # noqa: E402
from distconv.grid import ProcessorGrid  # noqa: E402
from distconv.models import resnet_mini  # noqa: E402
from distconv.nn import DistBatchNorm2d, DistConv2d, shard_specs  # noqa: E402
from distconv.parallel import parallelize  # noqa: E402
from distconv.redistribute import gather  # noqa: E402
from distconv.testing import run_threads  # noqa: E402

TOL = {torch.float64: (1e-10, 1e-11), torch.float32: (1e-4, 1e-4)}
KFAC_TOL = (1e-10, 1e-12)
DEFAULT_DIR = ROOT / "benchmarks" / "results" / "gpu"


def log(msg: str) -> None:
    print(msg, flush=True)


# ====================================================================== device audit
class DeviceAudit:
    """Counts the bytes of every tensor handed to a thread communicator, by device type.

    Installed around one check: ThreadCommunicator validates every tensor of every collective
    through ``_check_device``; the audit wraps it (class-wide, so sub-communicators count too).
    """

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._orig: Any = None

    def __enter__(self) -> DeviceAudit:
        orig = ThreadCommunicator._check_device
        audit = self

        def check(comm: Any, t: torch.Tensor, name: str) -> None:
            with audit._lock:
                audit.bytes[t.device.type] += t.numel() * t.element_size()
                audit.calls[t.device.type] += 1
            orig(comm, t, name)

        self._orig = orig
        ThreadCommunicator._check_device = check  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        ThreadCommunicator._check_device = self._orig  # type: ignore[method-assign]

    def summary(self) -> dict[str, Any]:
        return {"comm_bytes_by_device": dict(self.bytes), "comm_tensors_by_device": dict(self.calls)}


def _rank_backward_here(comm: Any, fn: Callable[..., Any], *args: Any) -> Any:
    with torch.autograd.set_multithreading_enabled(False):
        return fn(comm, *args)


def run_ranks(fn: Callable[..., Any], size: int, *args: Any, timeout: float = 20.0) -> list:
    """``run_threads`` with each rank's backward on the rank's own thread.

    Autograd runs the backward of CUDA tensors on one worker thread per device, shared by every
    thread of the process: thread ranks on one GPU whose backward passes hold collectives
    (halo and redistribution adjoints, gradient allreduces) would all queue on that one thread,
    the first to enter a collective waiting forever for the others. With multithreaded backward
    off (thread-local), each rank's backward runs on its own thread, as on CPU.
    """
    return run_threads(_rank_backward_here, size, fn, *args, timeout=timeout)


def devices_of(tensors: Any) -> list[str]:
    """The distinct device types of the tensors in a (nested) structure."""
    found: set[str] = set()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            found.add(x.device.type)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(tensors)
    return sorted(found)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def within(a: torch.Tensor, b: torch.Tensor, tol: tuple[float, float]) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=tol[0], atol=tol[1])


# ====================================================================== (a) exactness
# ---------------------------------------------------------------- DistConv2d
#: (name, grid, algorithm, batch, C, F, H, W, conv kwargs): every algorithm with H and/or W
#: split (halo exchanges), uneven blocks, stride, dilation, padding modes.
CONV_CASES = [
    ("x-NCH", {"N": 2, "C": 2, "H": 2}, "stationary-x", 3, 5, 6, 11, 9,
     {"kernel_size": 3, "padding": 1}),
    ("x-CW-reflect", {"C": 2, "W": 2}, "stationary-x", 2, 4, 5, 7, 10,
     {"kernel_size": 3, "padding": 1, "padding_mode": "reflect"}),
    ("x-HW-stride", {"H": 2, "W": 2}, "stationary-x", 2, 3, 4, 13, 12,
     {"kernel_size": 5, "stride": 2, "padding": 2}),
    ("y-FH", {"F": 2, "H": 2}, "stationary-y", 2, 4, 7, 12, 8,
     {"kernel_size": 3, "padding": 1}),
    ("y-FW-dil", {"F": 2, "W": 3}, "stationary-y", 2, 5, 6, 8, 14,
     {"kernel_size": 3, "padding": 2, "dilation": 2}),
    ("w-CFH", {"C": 2, "F": 2, "H": 2}, "stationary-w", 2, 6, 5, 10, 7,
     {"kernel_size": 3, "padding": 1}),
    ("w-CFW-circ", {"C": 2, "F": 2, "W": 2}, "stationary-w", 3, 5, 7, 6, 9,
     {"kernel_size": 3, "padding": 1, "padding_mode": "circular", "bias": False}),
]


def conv_reference(case: tuple, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    name, grid, algorithm, n, c, f, h, w, kw = case
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    conv = nn.Conv2d(c, f, **kw).to(dtype)
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype))
    x = torch.randn((n, c, h, w), generator=gen, dtype=dtype)
    conv = conv.to(device)
    x = x.to(device).requires_grad_(True)
    y = conv(x)
    g = torch.randn(y.shape, generator=gen, dtype=dtype).to(device)
    y.backward(g)
    return {"conv": conv, "x": x.detach(), "g": g, "y": y.detach(), "dx": x.grad,
            "dw": conv.weight.grad, "db": None if conv.bias is None else conv.bias.grad}


def conv_rank(comm: Any, case: tuple, ref: dict[str, Any], tol: tuple[float, float]) -> dict:
    _, grid_dims, algorithm, *_ = case
    grid = ProcessorGrid(grid_dims, comm=comm)
    layer = DistConv2d.from_conv2d(ref["conv"], grid=grid, algorithm=algorithm)
    shape = tuple(ref["x"].shape)
    y_shape = layer.output_shape(shape)
    x = ref["x"][layer.input_dist.local_slices(shape, grid)].clone().requires_grad_(True)
    y = layer(x, shape)
    y.backward(ref["g"][layer.output_dist.local_slices(y_shape, grid)].contiguous())
    got = {
        "y": (gather(y.detach(), layer.output_dist, grid, y_shape), ref["y"]),
        "dx": (gather(x.grad, layer.input_dist, grid, shape), ref["dx"]),
        "dw": (gather(layer.weight.grad, layer.weight_dist, grid, layer.weight_shape), ref["dw"]),
    }
    if ref["db"] is not None:
        got["db"] = (gather(layer.bias.grad, layer.bias_dist, grid, (layer.out_channels,)),
                     ref["db"])
    return {
        "errors": {k: max_err(a, b) for k, (a, b) in got.items()},
        "ok": all(within(a, b, tol) for a, b in got.values()),
        "devices": devices_of([y, x.grad, layer.weight.grad, layer.weight]),
    }


def check_conv(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    tol = TOL[dtype]
    cases, ok = {}, True
    for case in CONV_CASES:
        ref = conv_reference(case, dtype, device)
        size = math.prod(case[1].values())
        ranks = run_ranks(conv_rank, size, case, ref, tol)
        err = {k: max(r["errors"][k] for r in ranks) for k in ranks[0]["errors"]}
        case_ok = all(r["ok"] for r in ranks)
        ok &= case_ok
        cases[case[0]] = {"grid": case[1], "algorithm": case[2], "ok": case_ok,
                          "max_abs_error": err,
                          "devices": sorted({d for r in ranks for d in r["devices"]})}
    return {"ok": ok, "tolerance": {"rtol": tol[0], "atol": tol[1]}, "cases": cases,
            "max_abs_error": max(max(c["max_abs_error"].values()) for c in cases.values()),
            "devices": sorted({d for c in cases.values() for d in c["devices"]})}


# ---------------------------------------------------------------- parallelized ResNet
from tests.parallel.cases import (  # noqa: E402  the tests' hybrid and gathering
    RESNET_CONFIG, RESNET_SHAPE, _gathered_grads,
)
LR, MOMENTUM, STEPS = 0.1, 0.9, 2


def resnet_case(device: torch.device) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    model = resnet_mini().double()
    with torch.no_grad():
        for p in model.parameters():
            fan_in = p[0].numel() if p.dim() > 1 else p.numel()
            p.copy_((torch.rand(p.shape, generator=gen, dtype=p.dtype) * 2 - 1) / fan_in ** 0.5)
    batches = []
    for _ in range(STEPS):
        x = torch.randn(RESNET_SHAPE, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 10, (RESNET_SHAPE[0],), generator=gen)
        batches.append((x.to(device), y.to(device)))
    return model.to(device), batches


def reference_steps(model: nn.Module, batches: list) -> dict[str, Any]:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    outs, grads = [], []
    for x, y in batches:
        opt.zero_grad()
        out = model(x)
        _volume_loss(out, y).backward()
        outs.append(out.detach())
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
    return {"outs": outs, "grads": grads, "state": copy.deepcopy(model.state_dict())}


def step_errors(ranks: list[dict], ref: dict[str, Any]) -> dict[str, float]:
    """The largest errors of the ranks' outputs (their rows), gathered gradients and final
    gathered state against one process's steps."""
    err = {"out": 0.0, "grads": 0.0, "state": 0.0}
    for got in ranks:
        for step in range(STEPS):
            err["out"] = max(err["out"], max_err(got["outs"][step],
                                                 ref["outs"][step][got["rows"]]))
            err["grads"] = max(err["grads"], max(max_err(got["grads"][step][k], g)
                                                 for k, g in ref["grads"][step].items()))
        err["state"] = max(err["state"], max(max_err(got["state"][k], v)
                                             for k, v in ref["state"].items()))
    return err


def resnet_rank(comm: Any, model: nn.Module, batches: list) -> dict[str, Any]:
    return volume_rank(comm, model, RESNET_CONFIG, batches)  # (class targets: cross-entropy)


def check_resnet(device: torch.device) -> dict[str, Any]:
    model, batches = resnet_case(device)
    ranks = run_ranks(resnet_rank, 4, model, batches)
    err = step_errors(ranks, reference_steps(model, batches))
    rtol, atol = TOL[torch.float64]
    return {"ok": max(err.values()) < atol * 10, "tolerance": {"max_abs": atol * 10},
            "steps": STEPS, "ranks": 4, "config": RESNET_CONFIG["layers"],
            "max_abs_error": err,
            "devices": sorted({d for r in ranks for d in r["devices"]}),
            "state_devices": sorted({d for r in ranks for d in devices_of(r["state"])})}


# ---------------------------------------------------------------- volumes and decoders
#: (name, model builder, config, input shape, target): N-d convolutions (DistConvNd), transposed
#: up-convolutions, upsampling and interpolation, GroupNorm / BatchNorm3d and pooling split over
#: samples, channels and D/H/W, trained 2 SGD steps on 4 thread ranks against one process; fp64.
class _Resampler(nn.Module):
    """Convolutions around interpolations that no integer scale describes (split rows
    interpolated in place: their halo rows exchanged, then torch's own rows and weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(self.conv1(x), size=(17, 11), mode="bilinear", align_corners=True)
        x = F.interpolate(torch.relu(x), scale_factor=0.7, mode="bicubic")
        return F.interpolate(self.conv2(x), size=(12, 8), mode="nearest-exact")


def _volume_cases() -> list[tuple]:
    from distconv import models

    return [
        ("unet3d_DxH_group", lambda: models.unet3d(in_channels=1, base=2, depth=1),
         {"default": {"grid": {"D": 2, "H": 2}, "algorithm": "spatial"},
          "data": {"N": 1, "D": 2, "H": 2}, "layers": [
              {"match": "bottom.0", "grid": {"C": 2, "D": 2}, "algorithm": "stationary-x"},
              {"match": "up.0", "grid": {"F": 2, "D": 2}, "algorithm": "stationary-y"}]},
         (3, 1, 8, 6, 4), "classes"),
        ("unet3d_channels_batch", lambda: models.unet3d(in_channels=1, base=2, depth=1,
                                                        norm="batch"),
         {"default": {"grid": {"N": 4}, "algorithm": "sample"}, "layers": [
             {"match": "bottom.0", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"},
             {"match": "bottom.3", "grid": {"C": 2, "F": 2}, "algorithm": "stationary-w"},
             {"match": "up.*", "grid": {"N": 2, "F": 2}, "algorithm": "stationary-y"}]},
         (5, 1, 4, 4, 4), "classes"),
        ("unet2d_HxW_upsample", lambda: models.unet2d(in_channels=2, base=2, depth=2,
                                                      up="upsample"),
         {"default": {"grid": {"H": 2, "W": 2}, "algorithm": "spatial"},
          "data": {"N": 1, "H": 2, "W": 2}},
         (2, 2, 12, 8), "classes"),
        ("interpolate_HxW_size_align_bicubic", _Resampler,
         {"default": {"grid": {"H": 2, "W": 2}, "algorithm": "spatial"},
          "data": {"N": 1, "H": 2, "W": 2}},
         (2, 2, 12, 8), "classes"),
        ("cosmoflow_NxD_overlap", lambda: models.cosmoflow_mini(),
         {"default": {"grid": {"N": 2, "D": 2}, "algorithm": "spatial", "overlap": True},
          "data": {"N": 2, "D": 2}},
         (4, 4, 8, 8, 8), "values"),
    ]


def _volume_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y) if y.is_floating_point() else F.cross_entropy(out, y)


def volume_case(case: tuple, device: torch.device) -> tuple[nn.Module, list]:
    name, build, _, shape, target = case
    torch.manual_seed(zlib.crc32(name.encode()))
    model = build().double()
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        with torch.no_grad():
            out = model(x)
        y = (torch.randn(out.shape, generator=gen, dtype=torch.float64) if target == "values"
             else torch.randint(0, out.shape[1], (shape[0], *out.shape[2:]), generator=gen))
        batches.append((x.to(device), y.to(device)))
    return model.to(device), batches


def volume_rank(comm: Any, model: nn.Module, config: dict, batches: list) -> dict[str, Any]:
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    opt = torch.optim.SGD(pmodel.parameters(), lr=LR, momentum=MOMENTUM)
    outs, grads, rows = [], [], None
    for x, y in batches:
        rows = sample_block(x.shape[0], pmodel.data_grid)
        opt.zero_grad()
        out = pmodel(x[rows])
        _volume_loss(out, y[rows]).backward()
        outs.append(out.detach())
        grads.append(_gathered_grads(pmodel))
        opt.step()
    local = list(pmodel.parameters()) + list(pmodel.buffers())
    return {"rows": rows, "outs": outs, "grads": grads, "state": pmodel.gather_state_dict(),
            "devices": devices_of([outs, [p.grad for p in pmodel.parameters()], local])}


def check_volumes(device: torch.device) -> dict[str, Any]:
    cases, ok = {}, True
    atol = TOL[torch.float64][1] * 10
    for case in _volume_cases():
        model, batches = volume_case(case, device)
        ranks = run_ranks(volume_rank, 4, model, case[2], batches, timeout=60.0)
        err = step_errors(ranks, reference_steps(model, batches))
        case_ok = max(err.values()) < atol
        ok &= case_ok
        cases[case[0]] = {"config": case[2], "shape": case[3], "ok": case_ok,
                          "max_abs_error": err,
                          "devices": sorted({d for r in ranks for d in r["devices"]})}
        log(f"    {case[0]}: {'pass' if case_ok else 'FAIL'} {err}")
    return {"ok": ok, "tolerance": {"max_abs": atol}, "steps": STEPS, "ranks": 4,
            "cases": cases,
            "max_abs_error": max(max(c["max_abs_error"].values()) for c in cases.values()),
            "devices": sorted({d for c in cases.values() for d in c["devices"]})}


# ---------------------------------------------------------------- BatchNorm statistics
from tests.test_statistics import (  # noqa: E402  the tests' configs, DDP loop and our loop
    GROUPS, HYBRID_LOCAL, LOCAL, ddp_reference, ours as statistics_rank,
)
#: (name, config, ranks, blocks DDP sees, global batch): each sample block's own statistics
#: (sample and hybrid), and groups of 2 of 4 sample blocks, against DDP's loop by hand
STATISTICS_CASES = [("local-sample", LOCAL, 2, 2, 6), ("local-hybrid", HYBRID_LOCAL, 4, 2, 6),
                    ("groups-of-2", GROUPS, 4, 2, 8)]


def check_statistics(device: torch.device) -> dict[str, Any]:
    from distconv.parallel.explain import explain

    model = resnet_case(device)[0]
    gen = torch.Generator().manual_seed(10)
    cases, ok = {}, True
    atol = TOL[torch.float64][1]
    for name, config, world, blocks, batch in STATISTICS_CASES:
        x = torch.randn((batch,) + tuple(RESNET_SHAPE[1:]), generator=gen, dtype=torch.float64)
        y = torch.randint(0, 10, (batch,), generator=gen)
        x, y = x.to(device), y.to(device)
        want = ddp_reference(model, x, y, blocks=blocks)
        plan = explain(model, config, tuple(x.shape), world_size=world, itemsize=8)
        ranks = run_ranks(statistics_rank, world, model, config, x, y)
        err = max(max_err(r["state"][k], v) for r in ranks for k, v in want.items())
        moved = all(r["counted"] == tuple(plan.rank_bytes(i).values())
                    for i, r in enumerate(ranks))
        case_ok = err < atol and moved
        ok &= case_ok
        cases[name] = {"config": config, "ranks": world, "ok": case_ok, "max_abs_error": err,
                       "bytes_as_explain_says": moved,
                       "devices": devices_of([r["state"] for r in ranks])}
        log(f"    {name}: {'pass' if case_ok else 'FAIL'} {err:.3g}, bytes {moved}")
    return {"ok": ok, "tolerance": {"max_abs": atol}, "steps": 2, "cases": cases,
            "max_abs_error": max(c["max_abs_error"] for c in cases.values()),
            "devices": sorted({d for c in cases.values() for d in c["devices"]})}


# ---------------------------------------------------------------- K-FAC of N-d layers
from tests.kfac.test_conv_nd import (  # noqa: E402  the tests' layers, data and K-FAC runs
    _layer as kfac_nd_layer, _sharded as kfac_nd_sharded, _single as kfac_nd_single,
)
#: (module, global input shape, grid, algorithm): DistConvNd layers split over channels,
#: filters and space, transposed ones read as the direct convolution they equal
KFAC_ND_CASES = [
    (lambda: nn.Conv3d(3, 4, 3, padding=1, bias=False), (2, 3, 4, 3, 3),
     {"N": 2, "C": 2, "F": 2}, "stationary-w"),
    (lambda: nn.Conv1d(5, 4, 3, stride=2), (4, 5, 11), {"C": 2, "W": 2}, "stationary-x"),
    (lambda: nn.ConvTranspose3d(3, 4, 2, stride=2), (2, 3, 3, 2, 2), {"C": 3, "D": 2},
     "stationary-x"),
    (lambda: nn.ConvTranspose1d(3, 8, 3, stride=2, padding=1, output_padding=1), (4, 3, 7),
     {"F": 2, "W": 2}, "stationary-y"),
]


def _kfac_nd_rank(comm: Any, conv: nn.Module, shape: tuple, dims: dict, algorithm: str) -> dict:
    grads, exact, _ = kfac_nd_sharded(comm, conv, shape, dims, algorithm, "exact")
    return {"grads": grads, "exact": exact, "devices": devices_of(grads)}


def check_kfac_nd(device: torch.device) -> dict[str, Any]:
    cases, ok = {}, True
    for build, shape, dims, algorithm in KFAC_ND_CASES:
        conv = kfac_nd_layer(build()).to(device)
        name = f"{type(conv).__name__}-{'x'.join(dims)}"
        want = kfac_nd_single(conv, shape)
        ranks = run_ranks(_kfac_nd_rank, math.prod(dims.values()), conv, shape, dims, algorithm)
        err = max(max_err(r["grads"][k], g) for r in ranks for k, g in want.items())
        case_ok = all(within(r["grads"][k], g, KFAC_TOL) for r in ranks
                      for k, g in want.items()) and all(r["exact"] == 1 for r in ranks)
        ok &= case_ok
        cases[name] = {"grid": dims, "algorithm": algorithm, "ok": case_ok,
                       "max_abs_error": err,
                       "devices": sorted({d for r in ranks for d in r["devices"]})}
    return {"ok": ok, "tolerance": {"rtol": KFAC_TOL[0], "atol": KFAC_TOL[1]}, "cases": cases,
            "max_abs_error": max(c["max_abs_error"] for c in cases.values()),
            "devices": sorted({d for c in cases.values() for d in c["devices"]})}


# ---------------------------------------------------------------- sharded K-FAC
KFAC_SHAPE = (4, 5, 6, 5)
KFAC_KW = dict(kl_clip=1e-2, damping=1e-2, factor_decay=0.7)
KFAC_CASES = [
    ({"N": 2, "C": 2}, "stationary-x", dict(kernel_size=3, padding=1)),
    ({"F": 3}, "stationary-y", dict(kernel_size=3, padding=1)),
    ({"C": 2, "F": 2}, "stationary-w", dict(kernel_size=3, padding=1)),
    ({"H": 2, "C": 2}, "stationary-x", dict(kernel_size=3, padding=1, dilation=(1, 2))),
]


def kfac_conv(conv_kw: dict, device: torch.device) -> nn.Conv2d:
    conv = nn.Conv2d(KFAC_SHAPE[1], 5, **conv_kw).double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return conv.to(device)


def kfac_data(step: int, y_shape: tuple, device: torch.device):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(KFAC_SHAPE, generator=g, dtype=torch.float64)
    return x.to(device), torch.randn(y_shape, generator=g, dtype=torch.float64).to(device)


def kfac_loss(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(y) * t).sum() / KFAC_SHAPE[0]


def kfac_rank(comm: Any, grid_dims: dict, algorithm: str, conv_kw: dict, device: torch.device,
              steps: int) -> dict[str, Any]:
    grid = ProcessorGrid(grid_dims, comm=comm)
    layer = DistConv2d.from_conv2d(kfac_conv(conv_kw, device), grid=grid, algorithm=algorithm)
    kfac = distkfac.KFAC(layer, factor_dtype=torch.float64, factor_sharding="exact", **KFAC_KW)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    shape = KFAC_SHAPE
    for step in range(steps):
        y_shape = layer.output_shape(shape)
        x, t = kfac_data(step, y_shape, device)
        opt.zero_grad()
        y = layer(x[layer.input_dist.local_slices(shape, grid)], shape)
        kfac_loss(y, t[layer.output_dist.local_slices(y_shape, grid)]).backward()
        kfac.step()
        if step < steps - 1:
            opt.step()
    wg = gather(layer.weight.grad, layer.weight_dist, grid, layer.weight_shape)
    bg = None if layer.bias is None else gather(layer.bias.grad, layer.bias_dist, grid,
                                                (layer.out_channels,))
    return {"wg": wg, "bg": bg, "exact_layers": len(getattr(kfac, "exact_layers", []) or []),
            "devices": devices_of([layer.weight.grad, layer.weight])}


def kfac_single(conv_kw: dict, device: torch.device, steps: int) -> nn.Conv2d:
    conv = kfac_conv(conv_kw, device)
    with torch.no_grad():
        y_shape = tuple(conv(torch.zeros(KFAC_SHAPE, dtype=torch.float64, device=device)).shape)
    kfac = distkfac.KFAC(conv, factor_dtype=torch.float64, comm=None, **KFAC_KW)
    opt = torch.optim.SGD(conv.parameters(), lr=0.1)
    for step in range(steps):
        x, t = kfac_data(step, y_shape, device)
        opt.zero_grad()
        kfac_loss(conv(x), t).backward()
        kfac.step()
        if step < steps - 1:
            opt.step()
    return conv


def check_kfac(device: torch.device) -> dict[str, Any]:
    steps, cases, ok = 2, {}, True
    rtol, atol = KFAC_TOL
    for grid_dims, algorithm, conv_kw in KFAC_CASES:
        ref = kfac_single(conv_kw, device, steps)
        size = math.prod(grid_dims.values())
        ranks = run_ranks(kfac_rank, size, grid_dims, algorithm, conv_kw, device, steps)
        werr = max(max_err(r["wg"], ref.weight.grad) for r in ranks)
        berr = 0.0 if ref.bias is None else max(max_err(r["bg"], ref.bias.grad) for r in ranks)
        case_ok = all(within(r["wg"], ref.weight.grad, KFAC_TOL) and (
            ref.bias is None or within(r["bg"], ref.bias.grad, KFAC_TOL)) for r in ranks)
        ok &= case_ok
        name = f"{algorithm}-" + "".join(f"{k}{v}" for k, v in grid_dims.items())
        cases[name] = {"ok": case_ok, "max_abs_error": {"weight_grad": werr, "bias_grad": berr},
                       "exact_layers": ranks[0]["exact_layers"],
                       "devices": sorted({d for r in ranks for d in r["devices"]})}
    return {"ok": ok, "tolerance": {"rtol": rtol, "atol": atol}, "steps": steps,
            "factor_sharding": "exact", "cases": cases,
            "max_abs_error": max(max(c["max_abs_error"].values()) for c in cases.values()),
            "devices": sorted({d for c in cases.values() for d in c["devices"]})}


# ---------------------------------------------------------------- checkpoint
def ckpt_model(seed: int, device: torch.device) -> nn.Sequential:
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(5, 7, 3, padding=1), nn.Conv2d(7, 6, 1), nn.BatchNorm2d(6),
                          nn.Linear(3, 4)).double()
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype))
        model[2].num_batches_tracked.fill_(seed + 5)
    return model.to(device)


def ckpt_build(comm: Any, layout: tuple | None, seed: int, device: torch.device) -> nn.Module:
    ref = ckpt_model(seed, device)
    if layout is None:
        return ref
    dims, algorithm = layout
    grid = ProcessorGrid(dims, comm=comm)
    convs = [DistConv2d.from_conv2d(c, grid=grid, algorithm=algorithm) for c in ref[:2]]
    bn = DistBatchNorm2d.from_batchnorm2d(ref[2], grid=grid, input_dist=convs[1].output_dist)
    return nn.Sequential(*convs, bn, ref[3])


def ckpt_train(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> None:
    """Two optimizer steps on fixed global gradients, each rank taking its block."""
    specs = shard_specs(model)
    for step in range(2):
        for i, (name, p) in enumerate(model.named_parameters()):
            gen = torch.Generator().manual_seed(100 * step + i)
            g = torch.randn(specs[name].global_shape, generator=gen, dtype=p.dtype)
            s = specs[name]
            box = (tuple(slice(0, n) for n in s.global_shape) if s.grid is None
                   else s.dist.local_slices(s.global_shape, s.grid))
            p.grad = g[box].clone().to(device)
        opt.step()


def ckpt_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every tensor gathered to its global value (collective), model and optimizer state."""
    specs = shard_specs(model)
    out = {}
    for k, v in model.state_dict().items():
        s = specs[k]
        out[f"model/{k}"] = (v.clone() if s.grid is None or s.is_replicated
                             else gather(v, s.dist, s.grid, s.global_shape))
    names = [n for n, _ in model.named_parameters()]
    for i, fields in opt.state_dict()["state"].items():
        s = specs[names[i]]
        for field, v in fields.items():
            if v.dim() == 0 or s.grid is None or s.is_replicated:
                out[f"optim/{names[i]}/{field}"] = v.clone()
            else:
                out[f"optim/{names[i]}/{field}"] = gather(v, s.dist, s.grid, s.global_shape)
    return out


def ckpt_local_devices(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    return devices_of([model.state_dict(), [v for v in opt.state_dict()["state"].values()]])


def ckpt_save_rank(comm: Any, layout: tuple, path: str, device: torch.device) -> dict:
    model = ckpt_build(comm, layout, 0, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt_train(model, opt, device)
    distconv.save(model, path, optimizer=opt, extra={"epoch": 3}, comm=comm)
    return {"state": ckpt_state(model, opt), "devices": ckpt_local_devices(model, opt)}


def ckpt_load_rank(comm: Any, layout: tuple, path: str, device: torch.device) -> dict:
    model = ckpt_build(comm, layout, 1, device)  # other values: the load must overwrite all
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    extra = distconv.load(model, path, optimizer=opt)
    devices = ckpt_local_devices(model, opt)
    state = ckpt_state(model, opt)
    # and it trains on: one more step on the loaded optimizer state
    ckpt_train(model, opt, device)
    return {"state": state, "devices": devices, "extra": extra,
            "lr": opt.param_groups[0]["lr"]}


def compare_states(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    bad = []
    if set(want) != set(got):
        bad.append(f"keys differ: {sorted(set(want) ^ set(got))}")
    for k in sorted(set(want) & set(got)):
        a, b = want[k].cpu(), got[k].cpu()
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            bad.append(f"{k}: not bitwise equal (max abs diff "
                       f"{max_err(a, b) if a.shape == b.shape else 'shape'})")
    return bad


def check_checkpoint(device: torch.device) -> dict[str, Any]:
    src_layout = ({"N": 2, "C": 2}, "stationary-x")
    dst_layout = ({"C": 2, "F": 2}, "stationary-w")
    with tempfile.TemporaryDirectory() as tmp:
        p1, p2 = str(Path(tmp) / "from_device"), str(Path(tmp) / "from_cpu")
        saved = run_ranks(ckpt_save_rank, 4, src_layout, p1, device)
        expected = saved[0]["state"]
        # 1. on CPU, one process: a plain model and optimizer
        cpu = torch.device("cpu")
        model = ckpt_model(1, cpu)
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        extra = distconv.load(model, p1, optimizer=opt)
        on_cpu = ckpt_state(model, opt)
        cpu_devices = ckpt_local_devices(model, opt)
        bad_cpu = compare_states(expected, on_cpu)
        consolidated = distconv.consolidate(p1)
        bad_cons = compare_states({k[6:]: v for k, v in expected.items()
                                   if k.startswith("model/")}, consolidated)
        # 2. saved from CPU, loaded back onto the device on another layout
        distconv.save(model, p2, optimizer=opt, extra=extra, comm=SingleCommunicator())
        loaded = run_ranks(ckpt_load_rank, 4, dst_layout, p2, device)
        bad_back = [f"rank {r}: {m}" for r, got in enumerate(loaded)
                    for m in compare_states(expected, got["state"])]
        bad_extra = [] if all(g["extra"] == {"epoch": 3} and g["lr"] == 0.1 for g in loaded) \
            else ["extra state or optimizer settings not restored"]
    back_devices = sorted({d for r in loaded for d in r["devices"]})
    want = device.type
    dev_ok = (cpu_devices == ["cpu"] and back_devices == [want]
              and all(d == [want] for r in saved for d in [r["devices"]]))
    problems = bad_cpu + bad_cons + bad_back + bad_extra
    if not dev_ok:
        problems.append(f"devices: saved from {sorted({d for r in saved for d in r['devices']})},"
                        f" loaded on CPU {cpu_devices}, loaded back {back_devices}")
    return {"ok": not problems, "tolerance": "bitwise",
            "saved_on": f"{src_layout[0]} {src_layout[1]}, {want}",
            "loaded_on": ["one process, cpu", f"{dst_layout[0]} {dst_layout[1]}, {want}"],
            "tensors": len(expected), "problems": problems[:20],
            "devices": {"saved": sorted({d for r in saved for d in r["devices"]}),
                        "loaded_cpu": cpu_devices, "loaded_back": back_devices}}


# ---------------------------------------------------------------- NCCL, world of one
def check_nccl(device: torch.device) -> dict[str, Any]:
    import torch.distributed as dist

    from distconv.comm.torch_backend import init_torch

    # on CPU (a dry run of this check's logic) the same program runs on gloo
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if not dist.is_available() or (backend == "nccl" and not dist.is_nccl_available()):
        return {"skipped": f"this torch has no {backend}"}
    if dist.is_initialized():
        return {"skipped": "torch.distributed is already initialised in this process"}
    sub: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if backend == "nccl":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            comm = init_torch(backend, timeout=60.0)
            sub["backend"] = comm.backend

            def run(name: str, fn: Callable[[], Any]) -> None:
                try:
                    res = fn()
                    sub[name] = {"ok": bool(res[0]), **res[1]}
                except Exception as exc:  # record, go on
                    sub[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]}

            t = torch.randn(1000, device=device)

            def collectives():
                outs = {
                    "allreduce": comm.allreduce(t),
                    "allgather": comm.allgather(t)[0],
                    "reduce_scatter": comm.reduce_scatter([t]),
                    "alltoall": comm.alltoall([t], recv_shapes=[tuple(t.shape)])[0],
                    "broadcast": comm.broadcast(t, root=0),
                }
                ok = all(torch.equal(v, t) for v in outs.values())
                return ok, {"devices": devices_of(list(outs.values())),
                            "equal": {k: bool(torch.equal(v, t)) for k, v in outs.items()}}

            def wrong_device_refused():
                other = "cpu" if backend == "nccl" else "meta"
                try:
                    comm.allreduce(torch.ones(3, device=other))
                except ValueError as exc:
                    msg = str(exc)
                    return (other in msg and device.type in msg), {"message": msg}
                return False, {"message": f"a {other} tensor was accepted"}

            def conv():
                grid = ProcessorGrid({"N": 1}, comm=comm)
                ref = nn.Conv2d(4, 6, 3, padding=1).to(device)
                layer = DistConv2d.from_conv2d(ref, grid=grid, algorithm="stationary-x")
                x = torch.randn(2, 4, 8, 8, device=device)
                y, yr = layer(x, (2, 4, 8, 8)), ref(x)
                y.sum().backward()
                yr.sum().backward()
                ok = torch.equal(y, yr) and torch.equal(layer.weight.grad, ref.weight.grad)
                return ok, {"devices": devices_of([y, layer.weight.grad])}

            def parallel():
                model = resnet_mini().to(device)
                cfg = {"layers": [{"match": "layer2.*", "grid": {"C": 1},
                                   "algorithm": "stationary-x"}]}
                pmodel = parallelize(copy.deepcopy(model), cfg, comm=comm)
                x = torch.randn(2, 3, 16, 16, device=device)
                out = pmodel(x)
                out.sum().backward()
                ref = model(x)
                return max_err(out, ref) < 1e-4, {"max_abs_error": max_err(out, ref),
                                                  "devices": devices_of([out])}

            def host():
                # control messages (the global batch's agreement) go between the hosts: on
                # NCCL through a gloo sibling of the same ranks, made once; on gloo, itself
                sibling = comm.host
                shapes = sibling.allgather(torch.tensor([5, 3]), meta="host check")
                ok = (sibling is comm.host and sibling.backend == "torch-gloo"
                      and (sibling is comm) == (backend == "gloo")
                      and torch.equal(shapes[0], torch.tensor([5, 3])))
                return ok, {"backend": sibling.backend, "sibling": sibling is not comm}

            def checkpoint():
                model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).to(device)
                grid = ProcessorGrid({"N": 1}, comm=comm)
                model[0] = DistConv2d.from_conv2d(model[0], grid=grid, algorithm="stationary-x")
                with tempfile.TemporaryDirectory() as ck:
                    distconv.save(model, ck, comm=comm)
                    state = distconv.consolidate(ck)
                ok = all(torch.equal(state[k], v.cpu()) for k, v in model.state_dict().items())
                return ok, {}

            run("collectives", collectives)
            run("wrong_device_refused", wrong_device_refused)
            run("dist_conv2d", conv)
            run("parallelize", parallel)
            run("host_sibling", host)
            run("checkpoint_save", checkpoint)
        finally:
            dist.destroy_process_group()
    parts = {k: v for k, v in sub.items() if isinstance(v, dict)}
    return {"ok": all(v["ok"] for v in parts.values()), "world_size": 1,
            "init": f"init_process_group({backend!r}, init_method='file://...', world_size=1)",
            "parts": sub}


# ====================================================================== (b) timings
#: ResNet-50 layer shapes (N = 32 per GPU): (name, C, F, H=W, kernel, stride).
BENCH_SHAPES = [
    ("conv2_3x3", 64, 64, 56, 3, 1),
    ("conv2_1x1_expand", 64, 256, 56, 1, 1),
    ("conv3_3x3", 128, 128, 28, 3, 1),
    ("conv4_3x3", 256, 256, 14, 3, 1),
    ("conv4_1x1_reduce", 1024, 256, 14, 1, 1),
    ("conv5_3x3", 512, 512, 7, 3, 1),
]
SPLIT_SHAPES = ["conv2_3x3", "conv3_3x3", "conv4_3x3", "conv5_3x3", "conv4_1x1_reduce"]
SPLITS = (1, 2, 4, 8)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fns: dict[str, Callable[[], None]], device: torch.device, repeats: int,
               inner: int, warmup: int) -> dict[str, dict[str, float]]:
    """Median (and spread) seconds per call of each fn; the fns interleaved, their order
    rotated every repeat; each sample times ``inner`` calls between two synchronizations."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    sync(device)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(repeats):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                fns[name]()
            sync(device)
            samples[name].append((time.perf_counter() - t0) / inner)
    out = {}
    for n, s in samples.items():
        s = sorted(s)
        out[n] = {"median_s": statistics.median(s), "p10_s": s[len(s) // 10],
                  "p90_s": s[(len(s) * 9) // 10]}
    return out


def fwd_bwd(module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
            g: torch.Tensor, params: list[torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        for p in params:
            p.grad = None
        x.grad = None
        module(x).backward(g)

    return step


def graphed(step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``step`` captured in a CUDA graph (after warm-up on a side stream); returns its replay.
    Replays run the same kernels with no Python or launch overhead between them."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: calls of other threads (a process group's watchdog) cannot void the capture
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        step()
    return graph.replay


def kernel_seconds(step: Callable[[], None], device: torch.device, iters: int = 20) -> float:
    """Mean GPU kernel time of one ``step`` (the sum of its kernels' durations, from the
    profiler): the measure when graph capture is unavailable."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        sync(device)
    cuda = torch.autograd.DeviceType.CUDA
    total_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == cuda)
    return total_us * 1e-6 / iters


def bench_modes(device: torch.device, small: bool) -> list[tuple[str, int]]:
    """(mode, batch) pairs: eager at N = 32 (a ResNet-50 batch per GPU; on an H100 these layers
    are partly bound by the host's launch rate) and N = 128, and CUDA-graph replays at N = 32
    (the kernels alone)."""
    if small:
        return [("eager", 2)]
    return [("eager", 32), ("eager", 128), ("graph", 32)]


def bench_dist_vs_cudnn(device: torch.device, dtype: torch.dtype, small: bool) -> list[dict]:
    rows = []
    repeats, inner, warmup = (5, 2, 2) if small else (30, 10, 10)
    grid = ProcessorGrid({"N": 1}, comm=SingleCommunicator())
    for name, c, f, hw, k, s in BENCH_SHAPES:
        if small:
            c, f, hw = max(c // 16, 2), max(f // 16, 2), min(hw, 14)
        for mode, batch in bench_modes(device, small):
            row: dict[str, Any] = {"layer": name, "mode": mode, "N": batch, "C": c, "F": f,
                                   "HW": hw, "kernel": k, "stride": s}
            fns: dict[str, Callable[[], None]] = {}
            try:
                conv = nn.Conv2d(c, f, k, stride=s, padding=k // 2, bias=False).to(device, dtype)
                layer = DistConv2d.from_conv2d(conv, grid=grid, algorithm="stationary-x")
                x = torch.randn(batch, c, hw, hw, device=device, dtype=dtype, requires_grad=True)
                g = torch.randn(conv(x).shape, device=device, dtype=dtype)
                fns = {"cudnn": fwd_bwd(conv, x, g, [conv.weight]),
                       "distconv": fwd_bwd(layer, x, g, [layer.weight])}
                if mode == "graph":
                    fns = {key: graphed(fn, device) for key, fn in fns.items()}
                t = time_calls(fns, device, repeats, inner, warmup)
                ratio = t["distconv"]["median_s"] / t["cudnn"]["median_s"]
                row.update({
                    "cudnn_ms": 1e3 * t["cudnn"]["median_s"],
                    "distconv_ms": 1e3 * t["distconv"]["median_s"],
                    "cudnn_p10_p90_ms": [1e3 * t["cudnn"]["p10_s"], 1e3 * t["cudnn"]["p90_s"]],
                    "distconv_p10_p90_ms": [1e3 * t["distconv"]["p10_s"],
                                            1e3 * t["distconv"]["p90_s"]],
                    "ratio": ratio, "within_1.05": ratio <= 1.05})
                log(f"  [b] {name} {mode} N={batch}: cudnn {row['cudnn_ms']:.3f} ms  distconv "
                    f"{row['distconv_ms']:.3f} ms  ratio {ratio:.3f}")
            except Exception as exc:  # record, go on
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                log(f"  [b] {name} {mode} N={batch}: FAILED {row['error']}")
            rows.append(row)
            fns.clear()
    return rows


#: volume layers (CosmoFlow / 3-D U-Net sizes per GPU): (name, torch module, N, input shape)
ND_SHAPES = [
    ("conv3d_3", lambda: nn.Conv3d(32, 32, 3, padding=1, bias=False), 4, (32, 64, 64, 64)),
    ("conv3d_3_s2", lambda: nn.Conv3d(32, 64, 3, stride=2, padding=1), 4, (32, 64, 64, 64)),
    ("convT3d_2", lambda: nn.ConvTranspose3d(64, 32, 2, stride=2), 4, (64, 32, 32, 32)),
    ("conv1d_5", lambda: nn.Conv1d(128, 128, 5, padding=2), 32, (128, 4096)),
    ("groupnorm3d", lambda: nn.GroupNorm(8, 32), 4, (32, 64, 64, 64)),
]


def bench_nd_vs_cudnn(device: torch.device, dtype: torch.dtype, small: bool) -> list[dict]:
    """One-rank DistConvNd / DistGroupNorm against the torch module (cuDNN), forward + backward,
    eager: the per-call cost of the N-d layers' Python next to the kernels."""
    from distconv.distribution import Dist
    from distconv.nn import DistConvNd
    from distconv.nn.groupnorm import from_module as norm_from_module

    rows = []
    repeats, inner, warmup = (5, 2, 2) if small else (30, 10, 10)
    grid = ProcessorGrid({"N": 1}, comm=SingleCommunicator())
    for name, build, batch, shape in ND_SHAPES:
        if small:
            batch, shape = 2, (shape[0] // 8, *(max(4, d // 16) for d in shape[1:]))
        row: dict[str, Any] = {"layer": name, "N": batch, "shape": list(shape)}
        try:
            module = build()
            if small and hasattr(module, "in_channels"):
                module = type(module)(shape[0], max(2, module.out_channels // 8),
                                      module.kernel_size, stride=module.stride,
                                      padding=module.padding, bias=module.bias is not None)
            elif small:
                module = nn.GroupNorm(2, shape[0])
            module = module.to(device, dtype)
            x = torch.randn(batch, *shape, device=device, dtype=dtype, requires_grad=True)
            if isinstance(module, nn.GroupNorm):
                layer = norm_from_module(module, grid=grid,
                                         input_dist=Dist(("N",) + (None,) * (x.dim() - 1)))
            else:
                layer = DistConvNd.from_module(module, grid=grid, algorithm="stationary-x")
            gshape = tuple(x.shape)
            g = torch.randn(module(x).shape, device=device, dtype=dtype)
            fns = {"torch": fwd_bwd(module, x, g, list(module.parameters())),
                   "distconv": fwd_bwd(lambda t: layer(t, gshape), x, g,
                                       list(layer.parameters()))}
            t = time_calls(fns, device, repeats, inner, warmup)
            ratio = t["distconv"]["median_s"] / t["torch"]["median_s"]
            row.update({"torch_ms": 1e3 * t["torch"]["median_s"],
                        "distconv_ms": 1e3 * t["distconv"]["median_s"], "ratio": ratio})
            log(f"  [b] {name} N={batch}: torch {row['torch_ms']:.3f} ms  distconv "
                f"{row['distconv_ms']:.3f} ms  ratio {ratio:.3f}")
        except Exception as exc:  # record, go on
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            log(f"  [b] {name}: FAILED {row['error']}")
        rows.append(row)
    return rows


def bench_split(device: torch.device, dtype: torch.dtype, small: bool) -> list[dict]:
    """Local conv fwd+bwd on a C/p (stationary-x) or F/p (stationary-y) block vs full / p."""
    rows = []
    repeats, inner, warmup = (5, 2, 2) if small else (25, 10, 10)
    shapes = {s[0]: s for s in BENCH_SHAPES}
    modes = [("eager", 2)] if small else [("graph", 32), ("graph", 128), ("kernels", 32)]
    graphs_ok = True  # a failed capture can leave the generator in capture state: stop using them
    for name in SPLIT_SHAPES:
        _, c, f, hw, k, s = shapes[name]
        if small:
            c, f, hw = max(c // 16, 8), max(f // 16, 8), min(hw, 14)
        for mode, batch in modes:
            if mode == "graph" and not graphs_ok:
                mode = "kernels"
            fns: dict[str, Callable[[], None]] = {}
            meta: dict[str, tuple] = {}
            try:
                for split in ("C", "F"):
                    for p in SPLITS:
                        ci, fo = (c // p, f) if split == "C" else (c, f // p)
                        # drawn on the host: the device's generator stays out of graph captures
                        w = torch.randn(fo, ci, k, k, dtype=dtype).to(device).requires_grad_()
                        x = torch.randn(batch, ci, hw, hw, dtype=dtype).to(device)
                        x.requires_grad_()
                        ho = (hw + 2 * (k // 2) - k) // s + 1
                        g = torch.randn(batch, fo, ho, ho, dtype=dtype).to(device)
                        key = f"{split}/{p}"
                        fn = fwd_bwd(lambda t, w=w: F.conv2d(t, w, None, s, k // 2), x, g, [w])
                        fns[key] = fn
                        meta[key] = (split, p, ci, fo)
                if mode == "graph":
                    try:
                        replays = {key: graphed(fn, device) for key, fn in fns.items()}
                    except Exception as exc:
                        graphs_ok = False
                        log(f"  [b] split {name}: graph capture failed ({type(exc).__name__}: "
                            f"{str(exc)[:200]}); timing kernels through the profiler instead")
                        mode = "kernels"
                    else:
                        t = time_calls(replays, device, repeats, inner, warmup)
                        replays.clear()
                if mode == "kernels":
                    t = {key: {"median_s": kernel_seconds(fn, device)} for key, fn in fns.items()}
                elif mode == "eager":
                    t = time_calls(fns, device, repeats, inner, warmup)
            except Exception as exc:  # record, go on
                err = f"{type(exc).__name__}: {exc}"[:500]
                rows.append({"layer": name, "mode": mode, "N": batch, "error": err})
                log(f"  [b] split {name} {mode} N={batch}: FAILED {err}")
                continue
            for key, (split, p, ci, fo) in meta.items():
                full = t[f"{split}/1"]["median_s"]
                local = t[key]["median_s"]
                rows.append({"layer": name, "mode": mode, "split": split, "p": p, "N": batch,
                             "C_local": ci, "F_local": fo, "HW": hw, "kernel": k,
                             "local_ms": 1e3 * local, "full_over_p_ms": 1e3 * full / p,
                             "ratio": local / (full / p)})
            line = "  ".join(f"{r['split']}/{r['p']}: {r['ratio']:.2f}"
                             for r in rows[-2 * len(SPLITS):])
            log(f"  [b] split {name} {mode} N={batch} local / (full/p): {line}")
            fns.clear()
    return rows


# ====================================================================== driver
def run_check(name: str, fn: Callable[[], dict], results: dict[str, Any]) -> None:
    log(f"[a] {name} ...")
    t0 = time.perf_counter()
    try:
        res = fn()
        status = "skip" if "skipped" in res else ("pass" if res.get("ok") else "fail")
    except Exception as exc:  # a failure must not stop the others
        res = {"error": f"{type(exc).__name__}: {exc}"[:2000],
               "traceback": traceback.format_exc()[-4000:]}
        status = "fail"
    res["status"] = status
    res["seconds"] = round(time.perf_counter() - t0, 2)
    results[name] = res
    detail = res.get("error") or res.get("skipped") or ""
    if status == "fail" and not detail:
        detail = json.dumps(res.get("problems") or res.get("max_abs_error") or "", default=str)[:400]
    log(f"    {status.upper()} ({res['seconds']} s){' - ' + detail if detail else ''}")


def _git_commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device) -> dict[str, Any]:
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "device": str(device), "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
           "commit": os.environ.get("GPU_CHECK_COMMIT") or _git_commit()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update({"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                    "sm_count": props.multi_processor_count,
                    "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
                    "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                    "nccl": ".".join(map(str, torch.cuda.nccl.version()))
                    if hasattr(torch.cuda, "nccl") else None})
    else:
        env["cpu_threads"] = torch.get_num_threads()
    return env


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = ["# GPU check", "",
             f"`{report['command']}` on {env.get('gpu', env['device'])} "
             f"(torch {env['torch']}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}), "
             f"commit {(env.get('commit') or '?')[:10]}, "
             f"{env['date_utc']} UTC, {report['seconds']:.0f} s.", "",
             "## Exactness (thread ranks sharing the device; NCCL on a world of one)", "",
             "| check | status | max abs error | tolerance | data on | seconds |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, r in report["checks"].items():
        err = r.get("max_abs_error")
        if isinstance(err, dict):
            err = max(err.values()) if err else None
        err_s = "" if err is None else f"{err:.2e}"
        tol = r.get("tolerance", "")
        if isinstance(tol, dict):
            tol = ", ".join(f"{k} {v:g}" for k, v in tol.items())
        audit = r.get("audit", {}).get("comm_bytes_by_device", {})
        devs = r.get("devices")
        if isinstance(devs, dict):
            devs = "; ".join(f"{k}: {','.join(v)}" for k, v in devs.items())
        elif isinstance(devs, list):
            devs = ",".join(devs)
        on = devs or ""
        if audit:
            on += " (comm bytes: " + ", ".join(f"{k} {v:,}" for k, v in sorted(audit.items())) + ")"
        status = r["status"]
        if status != "pass":
            why = r.get("error") or r.get("skipped") or "; ".join(r.get("problems", []))[:200]
            if why:
                status += f": {why[:200]}".replace("|", "/").replace("\n", " ")
        lines.append(f"| {name} | {status} | {err_s} | {tol} | {on} | {r['seconds']} |")
    nccl = report["checks"].get("nccl_world_of_one", {}).get("parts")
    if nccl:
        lines += ["", "NCCL parts: " + ", ".join(
            f"{k} {'pass' if v['ok'] else 'FAIL'}" for k, v in nccl.items() if isinstance(v, dict))]
    b = report.get("bench", {})
    if b.get("dist_vs_cudnn"):
        lines += ["", f"## One-rank DistConv2d vs cuDNN nn.Conv2d, forward + backward "
                  f"({b['dtype']}, TF32 {b['tf32']}, cudnn.benchmark {b['cudnn_benchmark']})", "",
                  "eager: the user's loop (Python, autograd and launches included); graph: CUDA "
                  "graph replays of the same step (the kernels alone). Target ratio <= 1.05.", "",
                  "| layer | mode | N | C | F | H=W | k | cuDNN ms | DistConv2d ms | ratio |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in b["dist_vs_cudnn"]:
            head = (f"| {r['layer']} | {r['mode']} | {r['N']} | {r['C']} | {r['F']} | {r['HW']} | "
                    f"{r['kernel']} |")
            if "error" in r:
                lines.append(f"{head} failed: {r['error'][:120]} | | |")
            else:
                lines.append(f"{head} {r['cudnn_ms']:.3f} | {r['distconv_ms']:.3f} | "
                             f"{r['ratio']:.3f} |")
    if b.get("nd_vs_torch"):
        lines += ["", "## One-rank DistConvNd / DistGroupNorm vs the torch module, forward + "
                  "backward, eager", "",
                  "| layer | N | C, spatial | torch ms | distconv ms | ratio |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in b["nd_vs_torch"]:
            head = f"| {r['layer']} | {r['N']} | {r['shape']} |"
            lines.append(f"{head} failed: {r['error'][:120]} | | |" if "error" in r else
                         f"{head} {r['torch_ms']:.3f} | {r['distconv_ms']:.3f} | "
                         f"{r['ratio']:.3f} |")
    if b.get("split_scaling"):
        lines += ["", "## Local convolution when C or F is split p ways, forward + backward", "",
                  "ms of the conv a rank runs on its C/p (or F/p) block, and in brackets its ratio "
                  "to (full conv time / p): 1.00 is linear scaling, 8.00 at p = 8 means no gain.",
                  "",
                  "| layer | mode | N | split | " + " | ".join(f"p={p}" for p in SPLITS) + " |",
                  "| --- | --- | --- | --- | " + " | ".join("---" for _ in SPLITS) + " |"]
        by: dict[tuple, dict[int, dict]] = {}
        for r in b["split_scaling"]:
            if "error" in r:
                lines.append(f"| {r['layer']} | {r['mode']} | {r['N']} | failed: "
                             f"{r['error'][:120]} |" + " |" * len(SPLITS))
                continue
            by.setdefault((r["layer"], r["mode"], r["N"], r["split"]), {})[r["p"]] = r
        for (layer, mode, n, split), ps in by.items():
            cells = " | ".join(f"{ps[p]['local_ms']:.3f} ({ps[p]['ratio']:.2f})" for p in SPLITS)
            lines.append(f"| {layer} | {mode} | {n} | {split} | {cells} |")
    lines += ["", "Tolerances: fp64 rtol 1e-10 / atol 1e-11 (K-FAC atol 1e-12), fp32 with TF32 "
              "off rtol 1e-4 / atol 1e-4, checkpoints bitwise. Timings: median of interleaved "
              "repeats, each a synchronized batch of calls.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    ap.add_argument("--out", default=None, help="also write the result files to this folder")
    ap.add_argument("--results", default=str(DEFAULT_DIR), help="results folder")
    ap.add_argument("--skip-bench", action="store_true", help="exactness checks only")
    ap.add_argument("--only", default=None, help="comma-separated check names to run")
    args = ap.parse_args(argv)

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        log("CUDA is not available here; run with --device cpu for a dry run")
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    small = device.type != "cuda"
    t_start = time.perf_counter()
    report: dict[str, Any] = {"command": " ".join(["python", "benchmarks/gpu_check.py",
                                                  *(argv if argv is not None else sys.argv[1:])]),
                              "environment": environment(device), "checks": {}, "bench": {}}
    log(f"gpu_check on {report['environment'].get('gpu', device)} (torch {torch.__version__})")

    # exactness: fp32 compared without TF32 (otherwise both sides round to 10-bit mantissas)
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    checks: list[tuple[str, Callable[[], dict]]] = [
        ("conv_fp64", lambda: check_conv(device, torch.float64)),
        ("conv_fp32", lambda: check_conv(device, torch.float32)),
        ("resnet_bn_2_steps", lambda: check_resnet(device)),
        ("volumes_decoders_2_steps", lambda: check_volumes(device)),
        ("bn_statistics_local_groups", lambda: check_statistics(device)),
        ("kfac_sharded_exact", lambda: check_kfac(device)),
        ("kfac_nd_sharded_exact", lambda: check_kfac_nd(device)),
        ("checkpoint_cuda_cpu_cuda", lambda: check_checkpoint(device)),
        ("nccl_world_of_one", lambda: check_nccl(device)),
    ]
    only = set(args.only.split(",")) if args.only else None

    def run_checks(names: set[str]) -> None:
        for name, fn in checks:
            if name in names and (not only or name in only):
                run_check(name, audited(fn), report["checks"])

    def audited(fn: Callable[[], dict]) -> Callable[[], dict]:
        def run() -> dict:
            with DeviceAudit() as audit:
                res = fn()
            if audit.bytes:
                res["audit"] = audit.summary()
                # activations and gradients through the communicator on the device; only small
                # metadata (shape agreement, seeds, checkpoint index records) on the host
                host = audit.bytes.get("cpu", 0)
                res["audit"]["host_share"] = host / max(1, sum(audit.bytes.values()))
            return res

        return run

    # NCCL last: its process group's threads must not run beside the timed CUDA graph captures
    run_checks({name for name, _ in checks} - {"nccl_world_of_one"})
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32

    if not args.skip_bench and not only:
        torch.backends.cudnn.benchmark = True
        dtype = torch.float32
        report["bench"] = {"dtype": str(dtype).removeprefix("torch."),
                           "tf32": torch.backends.cudnn.allow_tf32,
                           "cudnn_benchmark": True}
        for key, fn in (("dist_vs_cudnn", bench_dist_vs_cudnn), ("nd_vs_torch", bench_nd_vs_cudnn),
                        ("split_scaling", bench_split)):
            log(f"[b] {key} ...")
            try:
                report["bench"][key] = fn(device, dtype, small)
            except Exception as exc:
                report["bench"][key + "_error"] = f"{type(exc).__name__}: {exc}"[:2000]
                log(f"    FAILED: {exc}")

    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    run_checks({"nccl_world_of_one"})
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    report["checks"] = {name: report["checks"][name] for name, _ in checks
                        if name in report["checks"]}
    report["seconds"] = time.perf_counter() - t_start
    report["summary"] = {k: v["status"] for k, v in report["checks"].items()}
    stem = "gpu_check" if device.type == "cuda" else "gpu_check_cpu"
    text = json.dumps(report, indent=1, default=str)
    md = markdown(report)
    for folder in {args.results, *( [args.out] if args.out else [])}:
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(text + "\n")
        (out / f"{stem}.md").write_text(md)
        log(f"wrote {out / (stem + '.json')} and {stem}.md")
    log("")
    log(md)
    return 0 if all(v in ("pass", "skip") for v in report["summary"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
