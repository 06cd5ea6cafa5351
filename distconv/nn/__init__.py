"""Distributed layers: :class:`DistConv2d`, :class:`DistConvNd`, the normalisation, pooling and
dropout layers around them, :class:`Redistribute` and gradient completion."""

from distconv.nn.batchnorm import DistBatchNorm, DistBatchNorm1d, DistBatchNorm2d, DistBatchNorm3d
from distconv.nn.clip import clip_grad_norm_
from distconv.nn.conv import ALGORITHMS, DistConv2d, UnsupportedConvError
from distconv.nn.conv_nd import DistConvNd
from distconv.nn.dropout import (
    DistDropout, DistDropout1d, DistDropout2d, DistDropout3d, DistDropPath,
)
from distconv.nn.grad_sync import GradSync, finish_grad_sync
from distconv.nn.linear import DistLinear
from distconv.nn.groupnorm import (
    DistGroupNorm, DistInstanceNorm1d, DistInstanceNorm2d, DistInstanceNorm3d, DistLayerNorm,
)
from distconv.nn.pool import (
    DistAdaptiveAvgPool2d, DistAvgPool1d, DistAvgPool2d, DistAvgPool3d, DistMaxPool1d,
    DistMaxPool2d, DistMaxPool3d,
)
from distconv.nn.redistribute import Redistribute
from distconv.nn.sharding import ShardSpec, shard_specs

__all__ = ["ALGORITHMS", "DistConv2d", "DistConvNd", "GradSync", "Redistribute",
           "UnsupportedConvError", "ShardSpec", "clip_grad_norm_", "finish_grad_sync",
           "shard_specs"]
__all__ += ["DistAdaptiveAvgPool2d", "DistAvgPool1d", "DistAvgPool2d", "DistAvgPool3d",
            "DistBatchNorm", "DistBatchNorm1d", "DistBatchNorm2d", "DistBatchNorm3d",
            "DistDropPath", "DistDropout", "DistDropout1d", "DistDropout2d", "DistDropout3d",
            "DistGroupNorm",
            "DistInstanceNorm1d", "DistInstanceNorm2d", "DistInstanceNorm3d", "DistLayerNorm", "DistMaxPool1d", "DistMaxPool2d", "DistMaxPool3d"]
__all__ += ["DistLinear"]
