"""The global convolution a price is made for: a 2-d convolution of a global input
``x[n, c, h, w]``, in ``nn.Conv2d``'s terms, with its output size and its FLOPs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distconv.conv_geometry import conv_dims, normalize_padding, pair

__all__ = ["ConvProblem"]


@dataclass(frozen=True)
class ConvProblem:
    """A 2-d convolution on a global input ``(batch, in_channels, height, width)``."""

    batch: int
    in_channels: int
    out_channels: int
    height: int
    width: int
    kernel_size: int | tuple[int, int] = 3
    stride: int | tuple[int, int] = 1
    padding: str | int | tuple[int, int] = 0
    dilation: int | tuple[int, int] = 1
    groups: int = 1
    bias: bool = True
    padding_mode: str = "zeros"

    def dims(self) -> tuple[Any, Any]:
        k, s, d = (pair(v, n) for v, n in ((self.kernel_size, "kernel_size"),
                                            (self.stride, "stride"), (self.dilation, "dilation")))
        pads = normalize_padding(self.padding, k, s, d)
        return conv_dims((self.height, self.width), k, s, d, pads)

    @property
    def output_hw(self) -> tuple[int, int]:
        dh, dw = self.dims()
        return dh.out_length, dw.out_length

    def flops(self) -> int:
        """Multiply-adds times two of the whole forward convolution."""
        ho, wo = self.output_hw
        kh, kw = pair(self.kernel_size, "kernel_size")
        per_output = 2 * (self.in_channels // self.groups) * kh * kw
        return self.batch * self.out_channels * ho * wo * per_output
