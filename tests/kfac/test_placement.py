"""Placement policies and packing: pure functions, no communication."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distkfac.factors import pack, packed_numel, unpack
from distkfac.placement import EVERYWHERE, CostModel, FactorTask, LoadBalanced, RoundRobin

tasks_st = st.lists(st.tuples(st.integers(1, 4), st.integers(1, 600)), min_size=1, max_size=20)


def make_tasks(spec):
    return [FactorTask(f"t{i}", g, d, packed_numel(g, d)) for i, (g, d) in enumerate(spec)]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5), st.integers(1, 9))
def test_pack_unpack_roundtrip_is_identity(groups, d):
    m = torch.randn(groups, d, d, dtype=torch.float64)
    m = m + m.transpose(1, 2)
    for symmetric in (True, False):
        flat = pack(m, symmetric=symmetric)
        assert flat.numel() == packed_numel(groups, d, symmetric=symmetric)
        torch.testing.assert_close(unpack(flat, groups, d, symmetric=symmetric), m)


def test_round_robin_cycles_over_ranks():
    assert RoundRobin().assign(make_tasks([(1, 5)] * 7), 3) == [0, 1, 2, 0, 1, 2, 0]


@settings(max_examples=50, deadline=None)
@given(tasks_st, st.integers(2, 8))
def test_lbp_is_greedy_largest_first_onto_least_loaded(spec, size):
    model = CostModel(c0=1e-5, c2=0.0, c3=1e-9, alpha=1e-4, beta=1e-9)
    tasks = make_tasks(spec)
    owners = LoadBalanced(model).assign(tasks, size)
    load = [0.0] * size
    for i in sorted(range(len(tasks)), key=lambda i: (-model.decompose_s(tasks[i]), i)):
        cost = model.decompose_s(tasks[i])
        if cost <= model.broadcast_s(tasks[i].payload * 4):
            assert owners[i] == EVERYWHERE
            load = [x + cost for x in load]
        else:
            assert load[owners[i]] == min(load)
            load[owners[i]] += cost


def test_lbp_decomposes_small_factors_everywhere_and_balances_large_ones():
    model = CostModel(c0=0.0, c2=0.0, c3=1e-9, alpha=1e-3, beta=1e-9)
    tasks = make_tasks([(1, 8), (1, 500), (1, 500), (1, 400), (1, 300), (1, 16)])
    owners = LoadBalanced(model).assign(tasks, 2)
    assert owners[0] == owners[5] == EVERYWHERE
    assert owners[1] != owners[2]
    big = [model.decompose_s(t) for t in tasks]
    loads = [sum(c for c, o in zip(big, owners) if o == r) for r in range(2)]
    assert max(loads) <= 1.5 * min(loads)
    rr = RoundRobin().assign(tasks, 2)
    rr_loads = [sum(c for c, o in zip(big, rr) if o == r) for r in range(2)]
    assert max(loads) <= max(rr_loads)


def test_lbp_on_one_rank_computes_everything_locally():
    assert LoadBalanced(CostModel()).assign(make_tasks([(1, 300)] * 3), 1) == [EVERYWHERE] * 3


def test_cost_model_fit_single_process_is_monotone_in_size():
    from distkfac.methods import EigenMethod

    model = CostModel.fit(None, lambda m: EigenMethod().decompose(m, 1e-3), repeats=1)
    small, large = (model.decompose_s(FactorTask("x", 1, d, 0)) for d in (16, 320))
    assert 0 <= small <= large and model.alpha == model.beta == 0.0
