"""The planner's promises that hold through one part of its search each, pinned part by part:
the plan is never priced above each layer's own cheapest choice because the search starts from
that plan (with the beam and the uniform plans made useless here, it is what remains), and the
beam keeps, of the states that reach one frontier, the cheapest (with a width that drops none,
its best score is the least score over every plan, each plan scored alone by the same beam)."""

from __future__ import annotations

import itertools
import math

import pytest

from distconv.planner import layer_candidates, layer_cost, trace_network
from distconv.planner import plan as plan_module
from distconv.planner.search import _Search
from tests.test_planner import TinyResNet, _Concat, _flat

SAMPLE = {"default": {"grid": {"N": 4}, "algorithm": "sample"}}


@pytest.mark.parametrize("machine", [_flat(1e-5, 1e7, 1e12), _flat(1e-6, 1e9, 1e10)])
def test_the_search_keeps_each_layers_own_cheapest_choice_as_a_starting_plan(
        machine, monkeypatch) -> None:  # noqa: ANN001
    net = trace_network(TinyResNet(), (8, 4, 8, 8))
    options = {c.name: layer_candidates(c, 4) for c in net.convs}
    search = _Search(net, 4, machine, options, SAMPLE, 4, 1)
    # each layer's cheapest candidate by its own price, worked out here as auto once chose
    own = {c.name: min(options[c.name], key=lambda ch, c=c: layer_cost(c, ch, machine).total)
           for c in net.convs}
    own_step = search.price(own).step
    # the dearest plan that gives every layer one grid and algorithm: the beam's only answer
    uniform = plan_module._uniform(search)
    dear = max(uniform, key=lambda p: search.price(p).step)
    assert search.price(dear).step > own_step  # else the case could not tell
    monkeypatch.setattr(plan_module, "_uniform", lambda s: [])
    monkeypatch.setattr(search, "beam", lambda lam, mu, width: [(0.0, dear, search.base.data)])
    chosen, _, priced = plan_module._search(search, 0.0, math.inf, 1)
    assert priced.step <= own_step * (1 + 1e-12), (chosen, priced.step, own_step)


def test_the_beam_keeps_the_cheapest_state_that_reaches_a_frontier() -> None:
    # gradient allreduces weighed in (lam = 1) on fast links and slow compute: the cheapest plan
    # splits filters, and states from several (a, b) pairs reach c's frontier with other scores
    machine = _flat(1e-6, 1e10, 1e9)
    net = trace_network(_Concat(), (4, 2, 6, 6))
    options = {c.name: layer_candidates(c, 4, max_model=4) for c in net.convs}
    full = _Search(net, 4, machine, options, SAMPLE, 4, 1)
    best = full.beam(1.0, 0.0, 10 ** 6)[0][0]
    scores = []
    for combo in itertools.product(*options.values()):
        one = dict(zip(options, combo))
        alone = _Search(net, 4, machine, {n: [ch] for n, ch in one.items()}, SAMPLE, 4, 1)
        found = alone.beam(1.0, 0.0, 10 ** 6)
        if found:
            scores.append(found[0][0])
    assert len(scores) > 100 and best == pytest.approx(min(scores), rel=1e-12, abs=0.0)
