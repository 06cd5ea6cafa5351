"""The model zoo: networks as users bring them (MONAI, torchvision, timm), made tiny, the configs
each is trained under, and the harness that trains one (model, config) pair on thread ranks
against one process. Module-level, so real worker processes and ``benchmarks/model_zoo.py``
import it.

A pair's outcome is ``exact`` (fp64, two SGD steps with momentum on 4 ranks: outputs, gradients,
parameters and buffers within :data:`REL_TOL` of one process, relative to each tensor's largest
value), ``refused`` (a ``ValueError``/``TypeError``/``NotImplementedError`` raised by the library
before or at the first step), ``inexact`` (it ran and differs: never acceptable) or ``error``
(anything else: an internal error).
"""

from __future__ import annotations

import copy
import importlib
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from distconv.data import sample_block
from distconv.nn import shard_specs
from distconv.redistribute import gather

#: the largest relative error of an exact pair (fp64)
REL_TOL = 1e-9
WORLD = 4
STEPS = 2
LR, MOMENTUM = 0.05, 0.9
#: the machine ``auto`` and ``plan_network`` price with (a fixed one: no calibration run)
MACHINE = "lassen"
#: the configs every model is trained under, in table order
CONFIGS = ("sample", "spatial", "channels", "filters", "auto", "plan")
#: refusals are these exceptions raised by the library's own code
REFUSALS = (ValueError, TypeError, NotImplementedError)


@dataclass(frozen=True)
class Entry:
    """One zoo model: ``build()`` makes it (float64, random init), ``shape`` is the global input
    (batch 4), ``classes`` the classes of its output (a label per sample, or per voxel for a
    segmentation network); ``needs`` the modules it imports (the pair is skipped without them)."""

    name: str
    source: str
    build: Callable[[], nn.Module] = field(repr=False)
    shape: tuple[int, ...]
    classes: int
    needs: tuple[str, ...] = ()

    @property
    def ndim(self) -> int:
        return len(self.shape) - 2

    def missing(self) -> str | None:
        """The first module this entry needs that does not import here, or None."""
        for name in self.needs:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a broken install skips the model like a missing one
                return name
        return None


def _monai(name: str, *args: Any, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        return getattr(importlib.import_module("monai.networks.nets"), name)(*args, **kw)
    return build


def _tv(name: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        return getattr(importlib.import_module("torchvision.models"), name)(weights=None, **kw)
    return build


def _seg_tv(name: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        seg = importlib.import_module("torchvision.models.segmentation")
        return _OutOf(getattr(seg, name)(weights=None, weights_backbone=None, **kw))
    return build


def _timm(name: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        return importlib.import_module("timm").create_model(name, pretrained=False, **kw)
    return build


class _OutOf(nn.Module):
    """torchvision's segmentation models return ``{"out": ...}``: the tensor the loss reads."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)["out"]


_IMG, _VOL = (4, 1, 32, 32), (4, 1, 8, 8, 8)
_RGB = (4, 3, 32, 32)
_MONAI, _TV, _TIMM = ("monai",), ("torchvision",), ("timm", "torchvision")

#: every model of the matrix, by name
ZOO: dict[str, Entry] = {e.name: e for e in [
    # MONAI, classification (2-D)
    Entry("monai.ResNet", "monai", _monai(
        "ResNet", "basic", [1, 1, 1, 1], [4, 8, 8, 16], spatial_dims=2, n_input_channels=1,
        num_classes=3, conv1_t_size=3, conv1_t_stride=1), _IMG, 3, _MONAI),
    Entry("monai.DenseNet", "monai", _monai(
        "DenseNet", 2, 1, 3, init_features=4, growth_rate=4, block_config=(2, 2), bn_size=2),
        _IMG, 3, _MONAI),
    Entry("monai.EfficientNet", "monai", _monai(
        "EfficientNet", ["r1_k3_s11_e1_i32_o16_se0.25", "r1_k3_s22_e2_i16_o24_se0.25",
                         "r1_k5_s22_e2_i24_o40_se0.25"], spatial_dims=2, in_channels=1,
        num_classes=3, width_coefficient=0.25, dropout_rate=0.0, image_size=32,
        drop_connect_rate=0.0), _IMG, 3, _MONAI),
    Entry("monai.HighResNet", "monai", _monai(
        "HighResNet", spatial_dims=2, in_channels=1, out_channels=2, layer_params=(
            {"name": "conv_0", "n_features": 4, "kernel_size": 3},
            {"name": "res_1", "n_features": 4, "kernels": (3, 3), "repeat": 1},
            {"name": "res_2", "n_features": 8, "kernels": (3, 3), "repeat": 1},
            {"name": "conv_1", "n_features": 8, "kernel_size": 1},
            {"name": "conv_2", "kernel_size": 1})), _IMG, 2, _MONAI),
    Entry("monai.MedNeXt", "monai", _monai(
        "MedNeXt", spatial_dims=2, init_filters=4, in_channels=1, out_channels=2, kernel_size=3,
        blocks_down=(1, 1), blocks_bottleneck=1, blocks_up=(1, 1)), _IMG, 2, _MONAI),
    # MONAI, segmentation (2-D and 3-D)
    Entry("monai.FlexibleUNet", "monai", _monai(
        "FlexibleUNet", 1, 2, "resnet10", decoder_channels=(16, 8, 8, 4, 4), spatial_dims=2),
        _IMG, 2, _MONAI),
    Entry("monai.AttentionUnet", "monai", _monai(
        "AttentionUnet", 2, 1, 2, channels=(4, 8, 16), strides=(2, 2)), _IMG, 2, _MONAI),
    Entry("monai.BasicUNet", "monai", _monai(
        "BasicUNet", spatial_dims=2, in_channels=1, out_channels=2,
        features=(4, 4, 8, 8, 16, 4)), _IMG, 2, _MONAI),
    Entry("monai.UNet", "monai", _monai(
        "UNet", 3, 1, 2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1), _VOL, 2, _MONAI),
    Entry("monai.DynUNet", "monai", _monai(
        "DynUNet", 3, 1, 2, kernel_size=[3, 3, 3], strides=[1, 2, 2],
        upsample_kernel_size=[2, 2], filters=[4, 8, 16]), _VOL, 2, _MONAI),
    Entry("monai.SegResNet", "monai", _monai(
        "SegResNet", spatial_dims=3, init_filters=4, in_channels=1, out_channels=2,
        blocks_down=(1, 1, 1), blocks_up=(1, 1), norm=("GROUP", {"num_groups": 2})),
        _VOL, 2, _MONAI),
    Entry("monai.UNETR", "monai", _monai(
        "UNETR", 1, 2, img_size=16, feature_size=4, hidden_size=16, mlp_dim=32, num_heads=2,
        spatial_dims=3), (4, 1, 16, 16, 16), 2, (*_MONAI, "einops")),  # 16³ patches
    # torchvision and timm (their smallest variants at a small input)
    Entry("torchvision.resnet18", "torchvision", _tv("resnet18", num_classes=3), _RGB, 3, _TV),
    Entry("torchvision.regnet_x_400mf", "torchvision", _tv("regnet_x_400mf", num_classes=3),
          _RGB, 3, _TV),
    Entry("torchvision.efficientnet_b0", "torchvision", _tv("efficientnet_b0", num_classes=3),
          _RGB, 3, _TV),
    Entry("torchvision.mobilenet_v3_small", "torchvision",
          _tv("mobilenet_v3_small", num_classes=3), _RGB, 3, _TV),
    Entry("torchvision.shufflenet_v2_x0_5", "torchvision",
          _tv("shufflenet_v2_x0_5", num_classes=3), _RGB, 3, _TV),
    Entry("torchvision.densenet121", "torchvision", _tv("densenet121", num_classes=3), _RGB, 3,
          _TV),
    Entry("torchvision.vgg11", "torchvision", _tv("vgg11", num_classes=3), _RGB, 3, _TV),
    Entry("torchvision.deeplabv3_mobilenet_v3_large", "torchvision",
          _seg_tv("deeplabv3_mobilenet_v3_large", num_classes=2, aux_loss=False), _RGB, 2, _TV),
    Entry("timm.regnetx_002", "timm", _timm("regnetx_002", num_classes=3), _RGB, 3, _TIMM),
    Entry("timm.convnext_atto", "timm", _timm("convnext_atto", num_classes=3), _RGB, 3, _TIMM),
    Entry("timm.mobilenetv3_small_050", "timm", _timm("mobilenetv3_small_050", num_classes=3),
          _RGB, 3, _TIMM),
    Entry("timm.efficientnet_b0", "timm", _timm("efficientnet_b0", num_classes=3), _RGB, 3,
          _TIMM),
]}


def case(entry: Entry, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model (float64, every parameter redrawn from ``seed``: thread ranks share torch's
    global generator), a global input batch and its labels (per sample or per voxel)."""
    gen = torch.Generator().manual_seed(seed)
    model = entry.build().double()
    with torch.no_grad():
        for p in model.parameters():
            fan_in = p[0].numel() if p.dim() > 1 else p.numel()
            p.copy_((torch.rand(p.shape, generator=gen, dtype=p.dtype) * 2 - 1) / fan_in ** 0.5)
    x = torch.randn(entry.shape, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        out = copy.deepcopy(model)(x)
    labels = (entry.shape[0], *out.shape[2:])  # a label per sample, or per output voxel
    return model, x, torch.randint(0, entry.classes, labels, generator=gen)


def deepest_convs(model: nn.Module, x: torch.Tensor) -> list[str]:
    """The convolutions that read the coarsest maps (fewest positions per channel): the last
    stage of a classifier, the bottleneck of a U-Net; of a network that never downsamples, its
    convolutions with channels and filters to split (a one-channel stem has none)."""
    seen: dict[str, int] = {}
    model = copy.deepcopy(model).eval()

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple, out: Any) -> None:
            seen.setdefault(name, args[0][0, 0].numel())
        return record

    hooks = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
             if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d))
             and min(m.in_channels, m.out_channels) >= 2]
    try:
        with torch.no_grad():
            model(x[:2])
    finally:
        for h in hooks:
            h.remove()
    least = min(seen.values())
    return [n for n, s in seen.items() if s == least]


def configs(entry: Entry, model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """The configs of :data:`CONFIGS` for one model (``plan`` is planned by
    ``distconv.planner.plan_network`` when the pair runs)."""
    sample = {"grid": {"N": WORLD}, "algorithm": "sample"}
    space = "D" if entry.ndim == 3 else "H"
    deep = deepest_convs(model, x)

    def last_stage(dim: str, algorithm: str) -> dict[str, Any]:
        return {"default": sample, "layers": [
            {"match": name, "grid": {"N": WORLD // 2, dim: 2}, "algorithm": algorithm}
            for name in deep]}

    return {
        "sample": {"default": sample},
        "spatial": {"default": {"grid": {"N": 2, space: 2}, "algorithm": "spatial"},
                    "data": {"N": 2, space: 2}},
        "channels": last_stage("C", "stationary-x"),
        "filters": last_stage("F", "stationary-y"),
        "auto": {"default": {"algorithm": "auto"}},
        "plan": "plan_network",
    }


def planned(model: nn.Module, shape: tuple[int, ...]) -> dict[str, Any]:
    """``plan_network``'s config for the model on :data:`WORLD` ranks (pure: no communication;
    call it outside a thread world, as tracing intercepts every thread's module calls)."""
    from distconv.planner import plan_network

    return plan_network(copy.deepcopy(model), shape, world_size=WORLD, machine=MACHINE).config()


def loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = STEPS
              ) -> dict[str, Any]:
    """One process: ``steps`` SGD steps with momentum on the global batch; the outputs of every
    step, the last step's gradients, the parameters and buffers after it."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    outs = []
    for _ in range(steps):
        opt.zero_grad()
        out = model(x)
        loss(out, y).backward()
        outs.append(out.detach())
        opt.step()
    return {"outs": outs, "grads": grads(model),
            "state": {k: v.clone() for k, v in model.state_dict().items()}}


def train(comm: Any, model: nn.Module, config: Any, x: torch.Tensor, y: torch.Tensor,
          steps: int = STEPS) -> dict[str, Any]:
    """The user's loop on this rank's samples (runs on every rank), everything gathered."""
    from distconv.parallel import parallelize

    pmodel = parallelize(copy.deepcopy(model), config, comm=comm, input_shape=x.shape,
                         machine=MACHINE)
    opt = torch.optim.SGD(pmodel.parameters(), lr=LR, momentum=MOMENTUM)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    outs = []
    for _ in range(steps):
        opt.zero_grad()
        out = pmodel(x[rows])
        loss(out, y[rows]).backward()
        outs.append(out.detach())
        opt.step()
    return {"rows": rows, "outs": outs, "grads": gathered_grads(pmodel),
            "state": pmodel.gather_state_dict()}


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """One process's gradients by name (parameters the forward does not use have none)."""
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def gathered_grads(pmodel: nn.Module) -> dict[str, torch.Tensor]:
    """The parallel model's gradients, gathered to their global tensors, by name."""
    specs = shard_specs(pmodel)
    return {k: p.grad.clone() if specs[k].grid is None else
            gather(p.grad, specs[k].dist, specs[k].grid, specs[k].global_shape)
            for k, p in pmodel.named_parameters() if p.grad is not None}


def relative_error(ref: dict[str, Any], got: dict[str, Any]) -> float:
    """The largest error of the outputs, of the gradients and of the parameters and buffers,
    each relative to the largest magnitude in its part of the reference (a conv bias before a
    norm has a gradient of rounding size: it is measured against the model's gradients); 1
    where a key, shape or integer value differs."""
    parts = {"outs": [(r[got["rows"]], g) for r, g in zip(ref["outs"], got["outs"])]}
    for part in ("grads", "state"):
        if set(ref[part]) != set(got[part]):
            return 1.0
        parts[part] = [(v, got[part][k]) for k, v in ref[part].items()]
    worst = 0.0
    for pairs in parts.values():
        if any(r.shape != g.shape for r, g in pairs):
            return 1.0
        if any(not r.is_floating_point() and not torch.equal(r, g) for r, g in pairs):
            return 1.0
        floats = [(r, g.to(r.dtype)) for r, g in pairs if r.is_floating_point() and r.numel()]
        scale = max([r.abs().max().item() for r, _ in floats] + [1e-300])
        diff = max([(g - r).abs().max().item() for r, g in floats] + [0.0])
        worst = max(worst, diff / scale)
    return worst


@dataclass
class Outcome:
    """What one (model, config) pair does: ``kind`` is ``exact``, ``inexact``, ``refused``,
    ``error`` or ``skipped``; ``error`` the relative error of a run; ``raised`` the exception's
    type name and ``message`` its text (or why the pair was skipped); ``where`` the frame of the
    library that raised it."""

    kind: str
    error: float | None = None
    raised: str = ""
    message: str = ""
    where: str = ""

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in ("", None)}


def _ours(filename: str) -> bool:
    return "/distconv/" in filename or "/distkfac/" in filename


def classify(exc: BaseException) -> Outcome:
    """A refusal is one of :data:`REFUSALS` raised by the library's own code (the innermost
    frame is in ``distconv``/``distkfac``: a torch error passing through is no refusal);
    everything else is an internal error. ``where``: the innermost frame of the library."""
    # run_threads raises a copy naming the rank, from the rank's own exception
    inner = exc.__cause__ if str(exc).startswith("[rank ") and exc.__cause__ else exc
    tb = traceback.extract_tb(inner.__traceback__)
    frames = [f for f in tb if _ours(f.filename)]
    where = f"{frames[-1].filename.split('/distconv/')[-1]}:{frames[-1].lineno}" if frames else ""
    kind = "refused" if isinstance(inner, REFUSALS) and tb and _ours(tb[-1].filename) else "error"
    return Outcome(kind, raised=type(inner).__name__, message=str(inner), where=where)


def run_pair(entry: Entry, config_name: str, seed: int = 0) -> Outcome:
    """Train one pair on :data:`WORLD` thread ranks against one process."""
    missing = entry.missing()
    if missing is not None:
        return Outcome("skipped", message=f"{missing} does not import here")
    from distconv.testing import run_threads

    model, x, y = case(entry, seed)
    config = configs(entry, model, x)[config_name]
    try:
        if config == "plan_network":
            config = planned(model, tuple(x.shape))
        ref = reference(model, x, y)
        got = run_threads(train, WORLD, model, config, x, y)
    except Exception as exc:  # noqa: BLE001 - every failure is classified and reported
        return classify(exc)
    err = max(relative_error(ref, g) for g in got)
    return Outcome("exact" if err <= REL_TOL else "inexact", error=err)


# ---------------------------------------------------------------------------- K-FAC
KFAC_OPTIONS = {"factor_dtype": torch.float64, "damping": 1e-2, "kl_clip": 1e-2,
                "factor_decay": 0.6}


def _kfac_steps(model: nn.Module, kfac: Any, x: torch.Tensor, y: torch.Tensor,
                steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(steps):
        opt.zero_grad()
        loss(model(x), y).backward()
        kfac.step()
        opt.step()


def kfac_reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = STEPS
                   ) -> dict[str, Any]:
    """One process's K-FAC: the preconditioned gradients of the last of ``steps`` steps, the
    parameters after them, and the layers it left alone (name -> why)."""
    import warnings

    import distkfac

    model = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kfac = distkfac.KFAC(model, comm=None, **KFAC_OPTIONS)
    _kfac_steps(model, kfac, x, y, steps)
    return {"outs": [], "grads": grads(model),
            "state": {k: v.clone() for k, v in model.state_dict().items()},
            "skipped": dict(kfac.skipped)}


def kfac_train(comm: Any, model: nn.Module, config: Any, x: torch.Tensor, y: torch.Tensor,
               steps: int = STEPS) -> dict[str, Any]:
    """``distkfac.KFAC`` on the parallelized model, the user's loop on this rank's samples."""
    import warnings

    import distkfac
    from distconv.parallel import parallelize

    pmodel = parallelize(copy.deepcopy(model), config, comm=comm, input_shape=x.shape,
                         machine=MACHINE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kfac = distkfac.KFAC(pmodel, **KFAC_OPTIONS)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    _kfac_steps(pmodel, kfac, x[rows], y[rows], steps)
    return {"rows": rows, "outs": [], "grads": gathered_grads(pmodel),
            "state": pmodel.gather_state_dict(), "skipped": dict(kfac.skipped)}


def run_kfac(entry: Entry, config_name: str, seed: int = 0) -> tuple[Outcome, dict[str, str]]:
    """K-FAC on one pair against one process's K-FAC, and the layers it does not precondition
    (name -> why; the same on one process and on the parallel model, or the outcome says so)."""
    missing = entry.missing()
    if missing is not None:
        return Outcome("skipped", message=f"{missing} does not import here"), {}
    from distconv.testing import run_threads

    model, x, y = case(entry, seed)
    config = configs(entry, model, x)[config_name]
    try:
        if config == "plan_network":
            config = planned(model, tuple(x.shape))
        got = run_threads(kfac_train, WORLD, model, config, x, y)
        ref = kfac_reference(model, x, y)
    except Exception as exc:  # noqa: BLE001 - every failure is classified and reported
        return classify(exc), {}
    if any(g["skipped"] != ref["skipped"] for g in got):
        return Outcome("inexact", error=1.0, message=(
            f"skipped {sorted(got[0]['skipped'])} in parallel, {sorted(ref['skipped'])} on one "
            "process")), ref["skipped"]
    err = max(relative_error(ref, g) for g in got)
    return Outcome("exact" if err <= REL_TOL else "inexact", error=err), ref["skipped"]
