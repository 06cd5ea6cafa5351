"""What capturing a model costs and yields: ``torch.fx`` (``distconv.parallel.graph.trace``), the
meta-device shape propagation of one global input shape, and the check that the captured graph is
the module's forward (:func:`distconv.parallel.shapes.check_capture`), against ``torch.export`` in
non-strict mode, which runs the model's real Python.

For each model: milliseconds (best of ``--repeats``), the nodes each capture yields, how many of
them are module calls (what the op handlers bind), or the first line of the refusal. MONAI
models are measured where MONAI imports. ``--exact``: each model in fp64 on 2 thread ranks, split
over samples and over rows (H), one forward and backward against one process: the largest
difference of the outputs and of the gradients, or the refusal.

    python benchmarks/capture.py [--repeats 3] [--exact]
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
    except Exception:  # noqa: BLE001 - MONAI missing or failing to import: its cases are left out
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


SPLITS = {"sample N=2": {"default": {"grid": {"N": 2}, "algorithm": "sample"}},
          "spatial H=2": {"default": {"grid": {"H": 2}, "algorithm": "spatial"},
                          "data": {"H": 2}}}


def _step(comm: Any, model: torch.nn.Module, config: dict, x: torch.Tensor) -> tuple:
    """This rank's output rows and the gathered gradients of one step of the user's loop."""
    from distconv.data import sample_block
    from distconv.nn import shard_specs
    from distconv.parallel import parallelize
    from distconv.redistribute import gather

    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    out = pmodel(x[rows])
    out.square().mean().backward()
    specs, grads = shard_specs(pmodel), {}
    for k, p in pmodel.named_parameters():
        s = specs[k]
        grads[k] = p.grad if s.grid is None else gather(p.grad, s.dist, s.grid, s.global_shape)
    return rows, out.detach(), grads


def _exact(model: torch.nn.Module, shape: tuple[int, ...]) -> str:
    from distconv.testing import run_threads

    gen = torch.Generator().manual_seed(0)
    model = model.double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) - 0.5)
    x = torch.randn((4,) + shape[1:], generator=gen, dtype=torch.float64)
    ref = copy.deepcopy(model)
    want = ref(x)
    want.square().mean().backward()
    found = []
    for name, config in SPLITS.items():
        try:
            ranks = run_threads(_step, 2, model, config, x)
        except Exception as exc:  # noqa: BLE001 - the refusal is the result
            found.append(f"{name}: {_refusal(exc)}")
            continue
        out = max((o - want.detach()[r]).abs().max().item() for r, o, _ in ranks)
        grad = max((g[k] - p.grad).abs().max().item() for _, _, g in ranks
                   for k, p in ref.named_parameters())
        found.append(f"{name}: outputs {out:.1e}, gradients {grad:.1e}")
    return "; ".join(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timings are the best of these")
    parser.add_argument("--exact", action="store_true",
                        help="also train each model one step on 2 thread ranks against one process")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    for name, (make, shape) in _cases().items():
        model = make()
        print(f"{name} {shape}\n  fx:     {_fx(model, shape, args.repeats)}\n"
              f"  export: {_export(model, shape, args.repeats)}", flush=True)
        if args.exact:
            print(f"  exact:  {_exact(model, shape)}", flush=True)


if __name__ == "__main__":
    main()
