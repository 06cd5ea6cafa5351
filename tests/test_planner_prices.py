"""``explain``'s prices of given configs are those recorded before the planner was rebuilt over
the one price (``tests/data/explain_prices.json``, written from the base commit by
``python -m tests.test_planner_prices --write``): the planner changes, the price does not.
Rewritten once since, when conversions came to be priced over their segments: the steps of
configs that convert between layouts fell (tiny-stationary 0.4172 -> 0.3372 ms, tiny-spatial
0.4785 -> 0.4305, se-resnet-stationary (flat) 1.5613 -> 1.3413, resnet-mini-pipelined 1.6180 ->
1.5219), their bytes unchanged; the sample-parallel and volume configs, which convert nothing
across segments, are as before."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.nn as nn

from distconv import models
from distconv.parallel.explain import explain
from distconv.perfmodel import Machine as Flat

FIXTURE = Path(__file__).parent / "data" / "explain_prices.json"


def _tiny() -> nn.Module:
    from tests.test_planner import TinyResNet

    return TinyResNet()


def _cases() -> dict[str, tuple[Any, dict, tuple[int, ...], int, Any]]:
    """name -> (model factory, config, input shape, world size, machine)."""
    flat = Flat(1e-5, 1e-9, 1e10)
    stx = {"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"},
           "layers": [{"match": "d*", "grid": {"N": 2, "F": 2}, "algorithm": "stationary-y"}]}
    spatial = {"default": {"grid": {"N": 2, "H": 2}, "algorithm": "spatial"}}
    piped = {"default": {"grid": {"N": 4}, "algorithm": "sample"},
             "layers": [{"match": "layer2.*conv*", "grid": {"N": 2, "C": 2},
                         "algorithm": "stationary-x", "pipeline": 2}]}
    vol = {"default": {"grid": {"N": 1, "D": 2, "H": 2}, "algorithm": "spatial"},
           "data": {"N": 1, "D": 2, "H": 2}}
    # auto picks the cheapest: resolved per layer by the §4 model this config was priced at a
    # step of 1.4578 ms; the whole-network search resolves it to a plan priced 1.2633 ms (both
    # explain's, on lassen), whose totals the fixture now holds.
    # Conversions priced over their segments (the ranks that exchange data: their count for the
    # latency, the level they span for the bandwidth) instead of as exchanges among every rank
    # over the slowest link: every config that converts between layouts is priced lower (the
    # bytes are unchanged: the totals of the given configs are as before), and the search now
    # resolves auto to another plan, priced 1.1606 ms (its bytes and memory are the fixture's)
    auto = {"default": {"grid": {"N": 4}, "algorithm": "sample"},
            "layers": [{"match": "*conv*", "algorithm": "auto"}]}
    return {
        "tiny-sample-flat": (_tiny, {"default": {"grid": {"N": 4}, "algorithm": "sample"}},
                             (8, 4, 8, 8), 4, flat),
        "tiny-stationary-lassen": (_tiny, stx, (8, 4, 8, 8), 4, "lassen"),
        "tiny-spatial-lassen": (_tiny, spatial, (8, 4, 8, 8), 4, "lassen"),
        "resnet-mini-pipelined-lassen": (models.resnet_mini, piped, (8, 3, 16, 16), 4, "lassen"),
        "resnet-mini-auto-lassen": (models.resnet_mini, auto, (8, 3, 16, 16), 4, "lassen"),
        "unet3d-spatial-lassen": (lambda: models.unet3d(in_channels=1, base=2, depth=2), vol,
                                  (2, 1, 16, 16, 16), 4, "lassen"),
        "se-resnet-stationary-flat": (models.se_resnet_mini, stx | {"layers": []},
                                      (8, 3, 16, 16), 4, flat),
    }


def _prices(name: str) -> dict[str, Any]:
    make, config, shape, world, machine = _cases()[name]
    e = explain(make(), config, shape, world_size=world, machine=machine)
    t = e.timeline()
    return {"step": t.step, "forward": t.forward, "backward": t.backward,
            "gradients": t.gradients, "totals": {k: v for k, v in e.totals().items()
                                                 if k != "predicted_seconds"}}


@pytest.mark.parametrize("name", sorted(_cases()))
def test_explain_prices_a_given_config_as_before(name: str) -> None:
    want = json.loads(FIXTURE.read_text())[name]
    got = _prices(name)
    assert got["totals"] == want["totals"]
    for key in ("step", "forward", "backward", "gradients"):
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=0.0), key


if __name__ == "__main__" and "--write" in sys.argv:
    FIXTURE.write_text(json.dumps({n: _prices(n) for n in sorted(_cases())}, indent=1,
                                  sort_keys=True) + "\n")


def _sent_by_every_rank(sl: Any, s: Any, dl: Any, d: Any, shape: tuple, rank: int) -> int:
    """What ``rank`` sends in a repartition, counted over every target rank: target t reads the
    source box from its holder ``t % holders`` (holders: the ranks with the same box)."""
    import math

    from distconv.parallel.placement import paper_grid

    size = math.prod(e for _, e in sl)
    src = [tuple(s.blocks(shape, paper_grid(sl, r))) for r in range(size)]
    dst = [tuple(d.blocks(shape, paper_grid(dl, r))) for r in range(size)]
    mine = [r for r in range(size) if src[r] == src[rank]]

    def overlap(a: tuple, b: tuple) -> int:
        n = 1
        for (s0, n0), (s1, n1) in zip(a, b):
            n *= max(0, min(s0 + n0, s1 + n1) - max(s0, s1))
        return n

    return sum(overlap(src[rank], dst[t]) for t in range(size)
               if t != rank and mine[t % len(mine)] == rank)


def test_the_bytes_a_rank_sends_across_grids_in_closed_form_are_every_targets_count() -> None:
    import itertools

    from distconv.distribution import Dist
    from distconv.parallel.placement import _sent

    layouts = [(("N", 4),), (("N", 2), ("C", 2)), (("C", 2), ("F", 2)),
               (("N", 1), ("H", 2), ("W", 2))]
    dists = [Dist(("N", None, None, None)), Dist(("N", "C", None, None)),
             Dist(("N", ("C", "F"), None, None)), Dist((None, "C", None, None)),
             Dist(("N", None, "H", "W")), Dist((None,) * 4), Dist((("N", "H"), None, None, None))]
    checked = 0
    for sl, dl, s, d in itertools.product(layouts, layouts, dists, dists):
        if not s.used() <= set(dict(sl)) or not d.used() <= set(dict(dl)):
            continue
        for shape in ((5, 3, 5, 6), (1, 2, 3, 1)):
            for rank in range(4):
                assert _sent(sl, s, dl, d, shape, rank) == _sent_by_every_rank(
                    sl, s, dl, d, shape, rank), (sl, s, dl, d, shape, rank)
                checked += 1
    assert checked > 300
