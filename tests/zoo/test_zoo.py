"""The model zoo in CI: a few (model, config) pairs of each family, the cheapest that cover its
constructs, trained two SGD steps on 4 thread ranks in fp64 against one process
(``tests/zoo/catalogue.py``), each exact (relative error ≤ 1e-9) or refused with the exception and
the words the table below states: the node or module it names and the reason. The whole matrix is
``benchmarks/model_zoo.py``'s."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.zoo.catalogue import (
    REL_TOL, ZOO, case, configs, relative_error, reference, run_kfac, run_pair, train,
)


@dataclass(frozen=True)
class Refused:
    """A refusal: the exception's class name and words its message must hold."""

    raised: str
    words: tuple[str, ...]


EXACT = "exact"

#: what each pair does, written down by hand with the reason in the model's code (never read back
#: from the library): pairs that run must be exact; the rest are refused, naming what and why.
#: A pair the library learns to run moves from a refusal to EXACT here.
EXPECTED: dict[tuple[str, str], str | Refused] = {
    ("monai.ResNet", "channels"): EXACT,
    ("monai.ResNet", "plan"): EXACT,
    ("monai.DenseNet", "spatial"): EXACT,
    # MONAI pads the stem with a ConstantPad2d module ("same" padding, TensorFlow style): the
    # padded dims are gathered first
    ("monai.EfficientNet", "sample"): EXACT,
    ("monai.EfficientNet", "spatial"): EXACT,
    # its residual blocks add torch.as_tensor of a traced value
    ("monai.HighResNet", "sample"): EXACT,
    ("monai.HighResNet", "channels"): EXACT,
    # its upsampling blocks call F.pad
    ("monai.MedNeXt", "sample"): EXACT,
    ("monai.MedNeXt", "spatial"): EXACT,
    # its decoder (MONAI's UpCat) asks torch.jit.isinstance of a traced value, loops over
    # range(len(x.shape) - 2) and pads where the skip's sizes differ: captured on the input shape
    # (the same capture under every config: spatial, which also splits the rows, runs it);
    # its ResNet encoder maps 32 rows to 1: the deepest convolutions keep their rows whole
    ("monai.FlexibleUNet", "spatial"): EXACT,
    ("monai.AttentionUnet", "channels"): EXACT,
    # the attention gate multiplies two values: the planner plans any graph the handlers run
    ("monai.AttentionUnet", "plan"): EXACT,
    # the same UpCat
    ("monai.BasicUNet", "sample"): EXACT,
    ("monai.UNet", "spatial"): EXACT,
    ("monai.DynUNet", "spatial"): EXACT,
    ("monai.DynUNet", "channels"): EXACT,
    ("monai.SegResNet", "sample"): EXACT,
    ("monai.SegResNet", "channels"): EXACT,
    # captured on the input shape, its ViT's einops rearrangement ("b h (qkv l d) -> qkv b l
    # h d") moves the samples behind the q/k/v axis, qkv[0] takes them back, the attention is
    # two einsums around a softmax; its blocks hold a cross-attention norm they never call
    # (channels runs all of it, its convolutions' channels split too)
    ("monai.UNETR", "channels"): EXACT,
    # an index the capture made a constant (its relative-position index, read on the captured
    # shape) under split rows: the analysis once crashed reading it as a new axis
    ("monai.SwinUNETR", "spatial"): EXACT,
    # torchvision, each through its class at a small width
    ("torchvision.ResNet", "sample"): EXACT,
    # SqueezeExcitation (a pooled gate times its input), Hardswish, depthwise convolutions
    ("torchvision.MobileNetV3", "channels"): EXACT,
    # MBConv with SE and stochastic depth at p=0 (torchvision's StochasticDepth module)
    ("torchvision.EfficientNet", "filters"): EXACT,
    # grouped 3x3 convolutions (group width 4) in its X blocks
    ("torchvision.RegNet", "channels"): EXACT,
    # channels-last LayerNorm and Linear between permutes, a layer scale parameter
    ("torchvision.ConvNeXt", "spatial"): EXACT,
    # torch.cat of a growing list of features; its layers ask requires_grad of their inputs
    ("torchvision.DenseNet", "sample"): EXACT,
    # chunk into two halves, cat, and channel_shuffle's view/transpose/view
    ("torchvision.ShuffleNetV2", "channels"): EXACT,
    # AdaptiveAvgPool2d((7, 7)) on a 4x4 map (each output averages overlapping windows)
    ("torchvision.VGG", "channels"): EXACT,
    # timm: BasicBlock with timm's create_conv2d / create_act; ResNeSt's split attention (a
    # radix softmax over reshaped groups); SE-ResNeXt's grouped convs and SE
    ("timm.ResNet", "spatial"): EXACT,
    ("timm.ResNeSt", "sample"): EXACT,
    ("timm.SE-ResNeXt", "channels"): EXACT,
    # DLA's tree of roots concatenating its children
    ("timm.DLA", "sample"): EXACT,
    # LayerNorm2d (F.layer_norm between permutes) and 1x1-conv MLPs (conv_mlp)
    ("timm.ConvNeXt", "filters"): EXACT,
    # patch embedding, depthwise conv residual, pointwise conv
    ("timm.ConvMixer", "spatial"): EXACT,
    # token-mixing Linear on transposed patches
    ("timm.MLPMixer", "sample"): EXACT,
    # segmentation-models-pytorch on timm's ResNet encoder (features_only): the U-Net decoder
    # (F.interpolate, cat with the skips)
    ("smp.Unet", "sample"): EXACT,
    # timm's BatchNormAct2d calls F.batch_norm on its own buffers: the call follows its module
    ("timm.EfficientNet", "sample"): EXACT,
    # the class token self.cls_token.expand(B, -1, -1) is split like the tokens' samples
    ("timm.ViT", "sample"): EXACT,
    # Res2Net's Bottle2neck: torch.split of the channels into scales, each a value of its own
    ("timm.Res2Net", "sample"): EXACT,
    # shifted windows: torch.roll, window partitions, a relative position bias indexed by a
    # non-persistent buffer, the mask built from sizes (a constant of the capture, not state)
    ("timm.Swin", "sample"): EXACT,
    # the FPN decoder's merge: torch.stack(features).sum(0)
    ("smp.FPN", "sample"): EXACT,
    # its classifier is timm's Linear (an nn.Linear whose forward calls F.linear): one call
    ("timm.MobileNetV3", "sample"): EXACT,
    # refused, naming the node, its module and what refuses it: LeViT's LinearNorm
    # batch-normalises samples and tokens as one dim, x.flatten(0, 1)
    ("timm.LeViT", "sample"): Refused("Unsupported", ("'flatten_1'", "merges or splits the "
                                                                     "samples")),
}


def _needs(name: str) -> None:
    """Skips the test, saying why, where a package the model needs does not import (missing, or
    failing for any reason: ``tests/optional.py``)."""
    why = ZOO[name].missing()
    if why is not None:
        pytest.skip(why)


@pytest.mark.parametrize("name, config", list(EXPECTED), ids=[f"{m}-{c}" for m, c in EXPECTED])
def test_zoo_pair_is_exact_or_refused_as_stated(name: str, config: str) -> None:
    _needs(name)
    want = EXPECTED[(name, config)]
    got = run_pair(ZOO[name], config)
    if want == EXACT:
        assert got.kind == "exact", got
        assert got.error is not None and got.error <= REL_TOL
    else:
        assert isinstance(want, Refused)
        assert got.kind == "refused" and got.raised == want.raised, got
        missing = [w for w in want.words if w not in got.message]
        assert not missing, f"{missing} not in {got.message!r}"


#: K-FAC on the channel config (the deepest convolutions over C), against one process's K-FAC,
#: and the layers neither preconditions (none: every convolution and Linear is a K-FAC layer);
#: timm's Swin: Linear layers inside windows, ``[N * windows, tokens, C]`` (was 1.2e-6 apart)
KFAC_CASES = ["monai.ResNet", "monai.UNet", "monai.DynUNet", "timm.Swin"]


@pytest.mark.parametrize("name", KFAC_CASES)
def test_kfac_on_a_parallelized_zoo_model_equals_one_process(name: str) -> None:
    _needs(name)
    got, skipped = run_kfac(ZOO[name], "channels")
    assert got.kind == "exact", got
    assert skipped == {}


def _gloo_pair(comm, name: str, config: str) -> float:  # noqa: ANN001
    model, x, y = case(ZOO[name])
    return relative_error(reference(model, x, y),
                          train(comm, model, configs(ZOO[name], model, x)[config], x, y))


@pytest.mark.gloo
def test_zoo_densenet_on_gloo(gloo4) -> None:  # noqa: ANN001
    """A DenseNet's last dense block over channels on a real gloo world."""
    _needs("monai.DenseNet")
    for err in gloo4.run(_gloo_pair, "monai.DenseNet", "channels"):
        assert err <= REL_TOL
