"""What capturing a model costs and yields: ``torch.fx`` (``distconv.parallel.graph.trace``), the
meta-device shape propagation of one global input shape, and the check that the captured graph is
the module's forward (:func:`distconv.parallel.shapes.check_capture`), against ``torch.export`` in
non-strict mode, which runs the model's real Python.

For each model: milliseconds (best of ``--repeats``), the nodes each capture yields, how many of
them are module calls (what the op handlers bind), or the first line of the refusal. MONAI
models are measured where MONAI imports.

    python benchmarks/capture.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings
from typing import Any, Callable

import torch

from distconv import models
from distconv.parallel.graph import trace
from distconv.parallel.shapes import check_capture, propagate_shapes


def _cases() -> dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, ...]]]:
    cases = {"resnet_mini": (lambda: models.resnet_mini(), (2, 3, 32, 32)),
             "unet2d": (lambda: models.unet2d(), (2, 3, 32, 32))}
    try:
        from monai.networks import nets
    except ImportError:
        return cases
    cases.update({
        "monai BasicUNet": (lambda: nets.BasicUNet(spatial_dims=2, in_channels=1, out_channels=2,
                                                   features=(4, 4, 8, 8, 8, 4)), (2, 1, 32, 32)),
        "monai UNet": (lambda: nets.UNet(spatial_dims=2, in_channels=1, out_channels=2,
                                         channels=(4, 8, 16), strides=(2, 2), num_res_units=1),
                       (2, 1, 32, 32)),
        "monai DynUNet": (lambda: nets.DynUNet(spatial_dims=2, in_channels=1, out_channels=2,
                                               kernel_size=[3, 3, 3], strides=[1, 2, 2],
                                               upsample_kernel_size=[2, 2]), (2, 1, 32, 32)),
        "monai SegResNet": (lambda: nets.SegResNet(spatial_dims=2, in_channels=1,
                                                   out_channels=2, init_filters=8),
                            (2, 1, 32, 32)),
        "monai FlexibleUNet": (lambda: nets.FlexibleUNet(in_channels=1, out_channels=2,
                                                         backbone="resnet18", spatial_dims=2,
                                                         pretrained=False), (2, 1, 64, 64)),
    })
    return cases


def _best(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3, result


def _refusal(exc: BaseException) -> str:
    return f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def _fx(model: torch.nn.Module, shape: tuple[int, ...], repeats: int) -> str:
    try:
        ms, gm = _best(lambda: trace(copy.deepcopy(model)), repeats)
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return _refusal(exc)
    meta = copy.deepcopy(gm).to("meta")
    prop, _ = _best(lambda: propagate_shapes(meta, shape), repeats)
    out = meta(torch.empty(shape, device="meta"))
    check, _ = _best(lambda: check_capture(meta, model, shape, out=out), repeats)
    calls = sum(n.op == "call_module" for n in gm.graph.nodes)
    return (f"trace {ms:.0f} ms, {len(gm.graph.nodes)} nodes ({calls} module calls); "
            f"shapes {prop:.0f} ms; check {check:.0f} ms")


def _export(model: torch.nn.Module, shape: tuple[int, ...], repeats: int) -> str:
    x = torch.randn(shape)
    try:
        ms, ep = _best(lambda: torch.export.export(model, (x,), strict=False), repeats)
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return _refusal(exc)
    nodes = list(ep.graph.nodes)
    calls = sum(n.op == "call_module" for n in nodes)
    return f"export {ms:.0f} ms, {len(nodes)} nodes ({calls} module calls)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timings are the best of these")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    for name, (make, shape) in _cases().items():
        model = make()
        print(f"{name} {shape}\n  fx:     {_fx(model, shape, args.repeats)}\n"
              f"  export: {_export(model, shape, args.repeats)}", flush=True)


if __name__ == "__main__":
    main()
