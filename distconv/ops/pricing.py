"""What pricing a plan reports, kept under its old name: the code lives in
:mod:`distconv.pricing.timeline` (``Machine`` here is
:data:`distconv.pricing.machine.AnyMachine`, a flat or a hierarchical machine)."""

from distconv.pricing.machine import AnyMachine as Machine
from distconv.pricing.timeline import (
    CommStep, LayerReport, Timeline, block_index, halo_hidden, largest_block, pair, segment_rank,
    timeline,
)

__all__ = ["CommStep", "LayerReport", "Machine", "Timeline", "block_index", "halo_hidden",
           "largest_block", "pair", "segment_rank", "timeline"]
