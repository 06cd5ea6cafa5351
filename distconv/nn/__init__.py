"""Distributed layers: :class:`DistConv2d`, :class:`Redistribute` and gradient completion."""

from distconv.nn.conv import ALGORITHMS, DistConv2d, UnsupportedConvError
from distconv.nn.grad_sync import GradSync, finish_grad_sync
from distconv.nn.redistribute import Redistribute

__all__ = ["ALGORITHMS", "DistConv2d", "GradSync", "Redistribute", "UnsupportedConvError",
           "finish_grad_sync"]
