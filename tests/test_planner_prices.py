"""``explain``'s prices of given configs are those recorded before the planner was rebuilt over
the one price (``tests/data/explain_prices.json``, written from the base commit by
``python -m tests.test_planner_prices --write``): the planner changes, the price does not."""

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
