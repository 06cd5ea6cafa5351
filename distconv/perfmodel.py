"""The performance model of a distributed convolution (Dryden et al., SC'19, §4), kept under its
old name: the code lives in :mod:`distconv.pricing` -- the exact bytes per rank in
:mod:`distconv.pricing.traffic`, the time model in :mod:`distconv.pricing.cost`, the flat machine
in :mod:`distconv.pricing.machine`, its calibration in :mod:`distconv.pricing.calibrate`; the
coordinates of a grid's ranks in :mod:`distconv.grid`."""

from distconv.grid import all_coords, corner_coords
from distconv.pricing.calibrate import calibrate, measure_flop_rate
from distconv.pricing.cost import Cost, choose_algorithm, conv_cost
from distconv.pricing.machine import Machine
from distconv.pricing.problem import ConvProblem
from distconv.pricing.traffic import ALGORITHMS, Traffic, conv_traffic

__all__ = ["ALGORITHMS", "ConvProblem", "Cost", "Machine", "Traffic", "all_coords", "calibrate",
           "choose_algorithm", "conv_cost", "conv_traffic", "corner_coords", "measure_flop_rate"]
