"""The model zoo: networks as users bring them (MONAI, torchvision, timm,
segmentation-models-pytorch), made tiny (narrow widths, one or two blocks a stage, 32x32 inputs),
the configs each is trained under, and the harness that trains one (model, config) pair on thread
ranks against one process. Module-level, so real worker processes and ``benchmarks/model_zoo.py``
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
from tests.vision_ops import install as _install_vision_ops

# torchvision's models load beside the CPU torch (tests/vision_ops.py); timm, MONAI, smp import it
_install_vision_ops()

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
        """Why a module this entry needs does not import here (missing, or installed and
        failing for any reason), or None."""
        from tests.optional import why_not

        return why_not(*self.needs)


def _monai(name: str, *args: Any, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        return getattr(importlib.import_module("monai.networks.nets"), name)(*args, **kw)
    return build


def _narrow(model: nn.Module, k: int) -> nn.Module:
    """Every convolution, batch norm and Linear of ``model`` rebuilt with its channels divided by
    ``k`` (the image's channels and the classes kept): the model's own code at a width that
    trains in seconds, for classes without a width option (torchvision's ResNet, GoogLeNet)."""
    for parent in list(model.modules()):
        for name, c in list(parent.named_children()):
            if isinstance(c, nn.Conv2d):
                new: nn.Module = nn.Conv2d(
                    c.in_channels if c.in_channels == 3 else c.in_channels // k,
                    c.out_channels // k, c.kernel_size, c.stride, c.padding, c.dilation,
                    c.groups if c.groups == 1 else c.groups // k, c.bias is not None)
            elif isinstance(c, nn.BatchNorm2d):
                new = nn.BatchNorm2d(c.num_features // k, c.eps, c.momentum)
            elif isinstance(c, nn.Linear):
                new = nn.Linear(c.in_features // k, c.out_features, c.bias is not None)
            else:
                continue
            setattr(parent, name, new)
    return model


# ---------------------------------------------------------------------------- torchvision
def _tv_resnet() -> nn.Module:
    from torchvision.models.resnet import BasicBlock, ResNet
    return _narrow(ResNet(BasicBlock, [1, 1, 1, 1], num_classes=3), 16)


def _tv_mobilenet_v3() -> nn.Module:
    from torchvision.models.mobilenetv3 import InvertedResidualConfig as C
    from torchvision.models.mobilenetv3 import MobileNetV3
    # (in, kernel, expanded, out, SE, activation, stride, dilation, width)
    setting = [C(8, 3, 8, 8, True, "RE", 2, 1, 1.0), C(8, 3, 24, 16, False, "RE", 2, 1, 1.0),
               C(16, 5, 32, 16, True, "HS", 1, 1, 1.0)]
    return MobileNetV3(setting, last_channel=32, num_classes=3, dropout=0.0)


def _tv_efficientnet() -> nn.Module:
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig
    # (expand, kernel, stride, in, out, layers, width, depth)
    setting = [MBConvConfig(1, 3, 1, 8, 8, 1, 1.0, 1.0), MBConvConfig(4, 3, 2, 8, 16, 2, 1.0, 1.0),
               MBConvConfig(4, 5, 2, 16, 16, 1, 1.0, 1.0)]
    return EfficientNet(setting, dropout=0.0, stochastic_depth_prob=0.0, num_classes=3,
                        last_channel=32)


def _tv_regnet() -> nn.Module:
    from torchvision.models.regnet import BlockParams, RegNet
    return RegNet(BlockParams.from_init_params(depth=3, w_0=8, w_a=8.0, w_m=2.0, group_width=4),
                  num_classes=3, stem_width=8)


def _tv_convnext() -> nn.Module:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    return ConvNeXt([CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 1)],
                    stochastic_depth_prob=0.0, num_classes=3)


def _tv_densenet() -> nn.Module:
    from torchvision.models.densenet import DenseNet
    return DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8, bn_size=2,
                    num_classes=3)


def _tv_shufflenet() -> nn.Module:
    from torchvision.models.shufflenetv2 import ShuffleNetV2
    return ShuffleNetV2([1, 1, 1], [8, 8, 16, 32, 64], num_classes=3)


def _tv_googlenet() -> nn.Module:
    from torchvision.models.googlenet import GoogLeNet
    # dropout 0: a dropout mask is a random draw, never the one process's (its default is 0.2)
    return _narrow(GoogLeNet(num_classes=3, aux_logits=False, transform_input=False,
                             init_weights=False, dropout=0.0), 8)


def _tv_vgg() -> nn.Module:
    from torchvision.models.vgg import VGG, make_layers
    model = VGG(make_layers([8, "M", 16, "M", 32, "M"], batch_norm=True), num_classes=3,
                init_weights=False, dropout=0.0)
    # its classifier's 25088 x 4096 layer, 16 wide (the same layers: Linear, ReLU, Dropout)
    for i, (fan_in, fan_out) in zip((0, 3, 6), ((32 * 7 * 7, 16), (16, 16), (16, 3))):
        model.classifier[i] = nn.Linear(fan_in, fan_out)
    return model


def _tv_vit() -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer
    return VisionTransformer(image_size=32, patch_size=8, num_layers=1, num_heads=2,
                             hidden_dim=16, mlp_dim=32, num_classes=3)


# ---------------------------------------------------------------------------- timm
def _timm(name: str, **kw: Any) -> Callable[[], nn.Module]:
    """``timm.create_model`` (no download with ``pretrained=False``), sizes overridden."""
    def build() -> nn.Module:
        return importlib.import_module("timm").create_model(name, pretrained=False,
                                                            num_classes=3, **kw)
    return build


_TINY_RESNET = {"layers": (1, 1, 1, 1), "channels": (8, 16, 32, 64), "stem_width": 8}


def _timm_efficientnet(arch: list[list[str]], **kw: Any) -> Callable[[], nn.Module]:
    """timm's ``EfficientNet`` class (EfficientNet, MixNet, ...) from a short architecture
    string list, as its ``_gen_*`` functions build it."""
    def build() -> nn.Module:
        from timm.models._efficientnet_builder import decode_arch_def
        from timm.models.efficientnet import EfficientNet
        return EfficientNet(decode_arch_def(arch), num_classes=3, num_features=32, stem_size=8,
                            **kw)
    return build


def _timm_mobilenet_v3() -> nn.Module:
    from functools import partial

    from timm.layers import get_act_layer
    from timm.models._efficientnet_blocks import SqueezeExcite
    from timm.models._efficientnet_builder import decode_arch_def, round_channels
    from timm.models.mobilenetv3 import MobileNetV3
    arch = [["ds_r1_k3_s2_e1_c8_se0.25_nre"], ["ir_r1_k3_s2_e4.5_c16_nre"],
            ["ir_r1_k5_s2_e4_c16_se0.25"]]
    se = partial(SqueezeExcite, gate_layer="hard_sigmoid", force_act_layer=nn.ReLU,
                 rd_round_fn=round_channels)
    return MobileNetV3(decode_arch_def(arch), num_classes=3, stem_size=8, num_features=32,
                       act_layer=get_act_layer("hard_swish"), se_layer=se)


def _timm_regnety() -> nn.Module:
    from timm.models.regnet import RegNet, RegNetCfg
    return RegNet(RegNetCfg(depth=5, w0=8, wa=12.0, wm=2.0, group_size=4, se_ratio=0.25,
                            stem_width=8), num_classes=3)


def _timm_repvgg() -> nn.Module:
    from timm.models.byobnet import ByobNet, ByoBlockCfg, ByoModelCfg
    cfg = ByoModelCfg(blocks=(ByoBlockCfg("rep", d=2, c=8, s=2, gs=0),
                              ByoBlockCfg("rep", d=1, c=16, s=2, gs=0)),
                      stem_type="rep", stem_chs=8, stem_pool=None, num_features=0)
    return ByobNet(cfg, num_classes=3)


def _timm_cspdarknet() -> nn.Module:
    from timm.models.cspnet import CspModelCfg, CspNet, CspStagesCfg, CspStemCfg
    cfg = CspModelCfg(stem=CspStemCfg(out_chs=8, kernel_size=3, stride=1, pool=""),
                      stages=CspStagesCfg(depth=(1, 1), out_chs=(16, 32), stride=2,
                                          expand_ratio=(2.0, 1.0), bottle_ratio=(0.5, 1.0),
                                          block_ratio=(1.0, 0.5), down_growth=True,
                                          block_type="dark"))
    return CspNet(cfg, num_classes=3)


def _timm_dla() -> nn.Module:
    from timm.models.dla import DLA, DlaBasic
    return DLA(levels=(1, 1, 1, 1, 1, 1), channels=(4, 8, 8, 16, 16, 32), block=DlaBasic,
               num_classes=3)


def _timm_ghostnet() -> nn.Module:
    from timm.models.ghostnet import GhostNet
    # per stage, per block: kernel, expanded, out, SE ratio, stride
    cfgs = [[[3, 8, 8, 0.25, 1]], [[3, 24, 16, 0, 2]], [[5, 32, 16, 0.25, 2]]]
    return GhostNet(cfgs, num_classes=3, width=0.5, drop_rate=0.0)


def _timm_dpn() -> nn.Module:
    from timm.models.dpn import DPN
    return DPN(k_sec=(1, 1, 1, 1), inc_sec=(4, 4, 4, 4), k_r=8, groups=2, small=True,
               num_init_features=8, num_classes=3)


def _timm_vovnet() -> nn.Module:
    from timm.models.vovnet import VovNet
    cfg = {"stem_chs": [8, 8, 16], "stage_conv_chs": [8, 8, 16, 16],
           "stage_out_chs": [16, 16, 32, 32], "layer_per_block": 2,
           "block_per_stage": [1, 1, 1, 1], "residual": True, "depthwise": False, "attn": "ese"}
    return VovNet(cfg, num_classes=3)


def _timm_levit() -> nn.Module:
    from timm.models.levit import Levit
    return Levit(img_size=32, embed_dim=(16, 24), key_dim=8, depth=(1, 1),
                 num_heads=(1, 2), num_classes=3)


def _timm_pit() -> nn.Module:
    from timm.models.pit import PoolingVisionTransformer
    return PoolingVisionTransformer(img_size=32, patch_size=4, stride=2, base_dims=(8, 8),
                                    depth=(1, 1), heads=(1, 2), mlp_ratio=2, num_classes=3)


def _timm_mixer() -> nn.Module:
    from timm.models.mlp_mixer import MlpMixer
    return MlpMixer(num_classes=3, img_size=32, patch_size=8, num_blocks=1, embed_dim=16)


def _timm_convmixer() -> nn.Module:
    from timm.models.convmixer import ConvMixer
    return ConvMixer(dim=16, depth=1, kernel_size=3, patch_size=4, num_classes=3)


# ---------------------------------------------------------------------------- MONAI extras
def _monai_swinunetr() -> nn.Module:
    from monai.networks.nets import SwinUNETR
    return SwinUNETR(in_channels=1, out_channels=2, feature_size=12, depths=(1, 1, 1, 1),
                     num_heads=(1, 1, 1, 1), window_size=4, spatial_dims=2)


def _monai_vnet() -> nn.Module:
    from monai.networks.nets import VNet
    model = VNet(spatial_dims=2, in_channels=1, out_channels=2, dropout_prob_down=0.0,
                 dropout_prob_up=(0.0, 0.0))
    for m in (model.up_tr64.dropout2, model.up_tr32.dropout2):  # 0.5, fixed in its __init__
        m.p = 0.0
    return model


# ---------------------------------------------------------------------------- smp
def _smp(arch: str, **kw: Any) -> Callable[[], nn.Module]:
    """A segmentation-models-pytorch network (no download: ``encoder_weights=None``) on timm's
    ResNet made tiny (``tu-`` encoders pass their keywords to ``timm.create_model``)."""
    def build() -> nn.Module:
        smp = importlib.import_module("segmentation_models_pytorch")
        return getattr(smp, arch)(encoder_name="tu-resnet18", encoder_weights=None, classes=2,
                                  **{"encoder_depth": 3, **_TINY_RESNET, **kw})
    return build


_IMG, _VOL = (4, 1, 32, 32), (4, 1, 8, 8, 8)
_RGB = (4, 3, 32, 32)
_MONAI, _TV = ("monai",), ("torchvision",)
_TIMM, _SMP = ("timm",), ("segmentation_models_pytorch", "timm")

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
    # its encoder halves the map five times and instance-normalises what is left: 64 x 64
    Entry("monai.SwinUNETR", "monai", _monai_swinunetr, (4, 1, 64, 64), 2, (*_MONAI, "einops")),
    # its input block adds the input repeated to 16 channels; its widths are fixed (16 to 256)
    Entry("monai.VNet", "monai", _monai_vnet, (4, 1, 16, 16), 2, _MONAI),
    # torchvision: each through its class, narrow and shallow
    Entry("torchvision.ResNet", "torchvision", _tv_resnet, _RGB, 3, _TV),
    Entry("torchvision.MobileNetV3", "torchvision", _tv_mobilenet_v3, _RGB, 3, _TV),
    Entry("torchvision.EfficientNet", "torchvision", _tv_efficientnet, _RGB, 3, _TV),
    Entry("torchvision.RegNet", "torchvision", _tv_regnet, _RGB, 3, _TV),
    Entry("torchvision.ConvNeXt", "torchvision", _tv_convnext, _RGB, 3, _TV),
    Entry("torchvision.DenseNet", "torchvision", _tv_densenet, _RGB, 3, _TV),
    Entry("torchvision.ShuffleNetV2", "torchvision", _tv_shufflenet, _RGB, 3, _TV),
    Entry("torchvision.GoogLeNet", "torchvision", _tv_googlenet, _RGB, 3, _TV),
    Entry("torchvision.VGG", "torchvision", _tv_vgg, _RGB, 3, _TV),
    Entry("torchvision.ViT", "torchvision", _tv_vit, _RGB, 3, _TV),
    # timm: create_model with sizes overridden, or the family's class from a small config
    Entry("timm.ResNet", "timm", _timm("resnet18", **_TINY_RESNET), _RGB, 3, _TIMM),
    Entry("timm.Res2Net", "timm", _timm("res2net50_26w_4s", **_TINY_RESNET), _RGB, 3, _TIMM),
    Entry("timm.ResNeSt", "timm", _timm("resnest14d", **_TINY_RESNET), _RGB, 3, _TIMM),
    Entry("timm.SE-ResNeXt", "timm", _timm("seresnext26d_32x4d", **_TINY_RESNET, cardinality=4,
                                           base_width=32), _RGB, 3, _TIMM),
    Entry("timm.EfficientNet", "timm", _timm_efficientnet(
        [["ds_r1_k3_s1_e1_c8_se0.25"], ["ir_r2_k3_s2_e4_c16_se0.25"],
         ["ir_r1_k5_s2_e4_c16_se0.25"]]), _RGB, 3, _TIMM),
    Entry("timm.MixNet", "timm", _timm_efficientnet(
        [["ds_r1_k3_s1_e1_c8"], ["ir_r1_k3.5_a1.1_p1.1_s2_e3_c16"],
         ["ir_r1_k3.5.7_s2_e4_c16_se0.5_nsw"]]), _RGB, 3, _TIMM),
    Entry("timm.MobileNetV3", "timm", _timm_mobilenet_v3, _RGB, 3, _TIMM),
    Entry("timm.GhostNet", "timm", _timm_ghostnet, _RGB, 3, _TIMM),
    Entry("timm.RegNetY", "timm", _timm_regnety, _RGB, 3, _TIMM),
    Entry("timm.RepVGG", "timm", _timm_repvgg, _RGB, 3, _TIMM),
    Entry("timm.CSPDarknet", "timm", _timm_cspdarknet, _RGB, 3, _TIMM),
    Entry("timm.DLA", "timm", _timm_dla, _RGB, 3, _TIMM),
    Entry("timm.DPN", "timm", _timm_dpn, _RGB, 3, _TIMM),
    Entry("timm.VoVNet", "timm", _timm_vovnet, _RGB, 3, _TIMM),
    Entry("timm.ConvNeXt", "timm", _timm("convnext_atto", depths=(1, 1, 1, 1),
                                         dims=(8, 16, 32, 64)), _RGB, 3, _TIMM),
    Entry("timm.ConvMixer", "timm", _timm_convmixer, _RGB, 3, _TIMM),
    Entry("timm.ViT", "timm", _timm("vit_tiny_patch16_224", img_size=32, patch_size=8,
                                    embed_dim=16, depth=1, num_heads=2), _RGB, 3, _TIMM),
    Entry("timm.DeiT", "timm", _timm("deit_tiny_distilled_patch16_224", img_size=32,
                                     patch_size=8, embed_dim=16, depth=1, num_heads=2),
          _RGB, 3, _TIMM),
    Entry("timm.Swin", "timm", _timm("swin_tiny_patch4_window7_224", img_size=32, patch_size=4,
                                     window_size=4, embed_dim=8, depths=(1, 1),
                                     num_heads=(1, 2), drop_path_rate=0.0), _RGB, 3, _TIMM),
    Entry("timm.MLPMixer", "timm", _timm_mixer, _RGB, 3, _TIMM),
    Entry("timm.LeViT", "timm", _timm_levit, _RGB, 3, _TIMM),
    Entry("timm.PiT", "timm", _timm_pit, _RGB, 3, _TIMM),
    # segmentation-models-pytorch on a tiny timm ResNet encoder, three stages deep
    Entry("smp.Unet", "smp", _smp("Unet", decoder_channels=(16, 8, 8)), _RGB, 2, _SMP),
    Entry("smp.FPN", "smp", _smp("FPN", decoder_pyramid_channels=16,
                                 decoder_segmentation_channels=32, upsampling=1,
                                 decoder_dropout=0.0), _RGB, 2, _SMP),
    Entry("smp.DeepLabV3Plus", "smp", _smp("DeepLabV3Plus", encoder_output_stride=8,
                                           decoder_channels=16, decoder_aspp_dropout=0.0),
          _RGB, 2, _SMP),
    Entry("smp.Linknet", "smp", _smp("Linknet"), _RGB, 2, _SMP),
    Entry("smp.PSPNet", "smp", _smp("PSPNet", psp_out_channels=16, psp_dropout=0.0), _RGB, 2, _SMP),
]}


def case(entry: Entry, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model (float64, every parameter redrawn from ``seed``: thread ranks share torch's
    global generator), a global input batch and its labels (per sample or per voxel)."""
    gen = torch.Generator().manual_seed(seed)
    model = entry.build().double()
    random = random_layers(model)
    assert not random, (f"{entry.name}: {random} draw random masks in training, which no "
                        "parallel run reproduces on sample-split values (build it with p=0)")
    with torch.no_grad():
        for p in model.parameters():
            fan_in = p[0].numel() if p.dim() > 1 else p.numel()
            p.copy_((torch.rand(p.shape, generator=gen, dtype=p.dtype) * 2 - 1) / fan_in ** 0.5)
    x = torch.randn(entry.shape, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        out = copy.deepcopy(model)(x)
    labels = (entry.shape[0], *out.shape[2:])  # a label per sample, or per output voxel
    return model, x, torch.randint(0, entry.classes, labels, generator=gen)


def random_layers(model: nn.Module) -> list[str]:
    """The modules that draw a random mask in training (dropout with p > 0, stochastic depth):
    zoo models are built without them, since sample-split values draw their own masks (as
    DDP's ranks do) and a pair could not be compared with one process."""
    found = []
    for name, m in model.named_modules():
        p = getattr(m, "p", None) if isinstance(m, nn.modules.dropout._DropoutNd) else None
        p = getattr(m, "drop_prob", p) if "DropPath" in type(m).__name__ else p
        p = getattr(m, "p", p) if type(m).__name__ == "StochasticDepth" else p
        if p:
            found.append(name or "(the root)")
    return found


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
        return Outcome("skipped", message=missing)
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
        return Outcome("skipped", message=missing), {}
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
