"""Pricing: the one layer that says what a plan costs, below the op handlers that fill it in.

A layer's price walks down through it and never climbs back: an op handler (``distconv.ops``)
states its layer's problem and placements, and these modules turn them into bytes and seconds,
using only the data below them (geometry, distributions, placements, machines as data):

* :mod:`~distconv.pricing.problem` -- the global convolution a price is made for;
* :mod:`~distconv.pricing.traffic` -- the exact bytes of each algorithm per rank (§4);
* :mod:`~distconv.pricing.machine` -- the flat alpha-beta machine, and every form a ``machine=``
  argument takes;
* :mod:`~distconv.pricing.cost` -- the §4 time of a layer, and the cheapest algorithm;
* :mod:`~distconv.pricing.timeline` -- each layer's report (its collectives, bytes and compute)
  and the two-stream timeline of a training step;
* :mod:`~distconv.pricing.calibrate` -- the flat machine this runs on, measured.

Nothing here imports the op handlers, the layers, the executor, ``explain`` or the planner
(``tests/test_import_layers.py`` keeps it so). The names are imported from their modules: the
package imports none of them, so that the machines below can use its lowest modules while the
executor above is still being imported.
"""
