"""``algorithm: auto`` is resolved by the planner's whole-network search: on small worlds the
resolved config is priced by ``explain`` no dearer than each layer's own cheapest pick (the §4
model's, conversions between layers ignored) and than every uniform config of the planner's
candidates, with the fixed entry kept; and the resolved model trains as one process (fp64)."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from distconv.data import sample_block
from distconv.machines import resolve_machine
from distconv.ops import Unsupported
from distconv.parallel import ParallelConfig, parallelize
from distconv.parallel.explain import explain
from distconv.perfmodel import ConvProblem, conv_cost
from distconv.planner import candidates
from distconv.testing import run_threads
from tests.parallel.cases import reference_step, resnet_case

MACHINE = "lassen"


def _config(P: int) -> dict[str, Any]:
    """The user's config: ``auto`` by default, one layer fixed to channel parallelism."""
    fixed = {"N": P // 2, "C": 2} if P > 2 else {"C": 2}
    return {"default": {"algorithm": "auto"},
            "layers": [{"match": "layer1.0.conv1", "grid": fixed, "algorithm": "stationary-x"}]}


def _auto_convs(model: torch.nn.Module, shape: tuple[int, ...], P: int
                ) -> dict[str, ConvProblem]:
    """The Conv2d layers ``auto`` reaches, with their global problems (shapes by hand: a hook)."""
    cfg = ParallelConfig(_config(P), world_size=P)
    problems: dict[str, ConvProblem] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Conv2d) and cfg.choice(name).algorithm == "auto":
            def hook(m: Any, args: Any, _: Any, name: str = name) -> None:
                x = args[0].shape
                problems[name] = ConvProblem(x[0], m.in_channels, m.out_channels, x[2], x[3],
                                             m.kernel_size, m.stride, m.padding, m.dilation,
                                             m.groups, m.bias is not None, m.padding_mode)
            hooks.append(m.register_forward_hook(hook))
    with torch.no_grad():
        model(torch.zeros(shape, dtype=torch.float64))
    for h in hooks:
        h.remove()
    return problems


def _with(P: int, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The user's config with ``entries`` (one exact entry per auto layer) first and the other
    layers sample-parallel (what an ``auto`` default means for a Linear layer)."""
    cfg = _config(P)
    return {"default": {"grid": {"N": P}, "algorithm": "sample"},
            "layers": entries + cfg["layers"]}


def _per_layer_picks(problems: dict[str, ConvProblem], P: int) -> dict[str, Any]:
    """Each layer's own cheapest candidate by the §4 model, alone (how ``auto`` chose before)."""
    machine = resolve_machine(MACHINE)
    entries = []
    for name, pb in problems.items():
        def total(ch: Any, pb: ConvProblem = pb) -> float:
            run = "stationary-x" if ch.algorithm in ("sample", "spatial") else ch.algorithm
            return conv_cost(pb, dict(ch.grid), run, machine).total
        best = min(candidates(pb, P), key=total)
        entries.append({"match": name, "grid": dict(best.grid), "algorithm": best.algorithm})
    return _with(P, entries)


def _uniform(problems: dict[str, ConvProblem], P: int) -> list[dict[str, Any]]:
    """Per (grid, algorithm) some auto layer can take, the config giving it to every one that can
    (the others sample-parallel)."""
    options = {name: {(c.grid, c.algorithm) for c in candidates(pb, P)}
               for name, pb in problems.items()}
    keys = sorted(set().union(*options.values()), key=lambda k: (k[1], k[0]))
    return [_with(P, [{"match": name, "grid": dict(key[0]), "algorithm": key[1]}
                      for name in problems if key in options[name]]) for key in keys]


@pytest.mark.parametrize("P", [2, 4])
def test_auto_is_priced_no_dearer_than_per_layer_picks_or_any_uniform_config(P: int) -> None:
    model, x, _ = resnet_case()
    shape = tuple(x.shape)
    def price(cfg: dict[str, Any]) -> float:
        return explain(model, cfg, shape, world_size=P, machine=MACHINE).seconds()

    resolved = price(_config(P))
    problems = _auto_convs(model, shape, P)
    assert len(problems) == 12 and "layer1.0.conv1" not in problems
    assert resolved <= price(_per_layer_picks(problems, P))
    priced = 0
    for cfg in _uniform(problems, P):
        try:
            assert resolved <= price(cfg), cfg
        except (Unsupported, ValueError):
            continue  # a uniform config some layer's placement refuses (the search skips it)
        priced += 1
    assert priced >= 4


def _train(comm: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    pm = parallelize(copy.deepcopy(model), _config(comm.size), comm=comm, input_shape=x.shape,
                     machine=MACHINE)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    rows = sample_block(x.shape[0], pm.data_grid)
    out = pm(x[rows])
    F.cross_entropy(out, y[rows]).backward()
    opt.step()
    return {"out": out.detach(), "rows": rows, "state": pm.gather_state_dict(),
            "config": pm.config.to_dict(), "decisions": pm.auto_decisions}


@pytest.mark.parametrize("P", [2, 4])
def test_the_auto_resolved_model_trains_as_one_process(P: int) -> None:
    model, x, y = resnet_case()
    ref = reference_step(model, x, y)
    for got in run_threads(_train, P, model, x, y):
        assert (got["out"] - ref["out"][got["rows"]]).abs().max() < 1e-10
        for k, v in ref["state"].items():
            assert (got["state"][k].double() - v.double()).abs().max() < 1e-10, k
    decisions, config = got["decisions"], got["config"]
    # every auto Conv2d decided, the fixed layer kept, and each decision's first price is
    # explain's price of the resolved config, no dearer than the alternatives listed after it
    assert len(decisions) == 12 and "layer1.0.conv1" not in decisions
    step = explain(model, config, tuple(x.shape), world_size=P, machine=MACHINE).seconds()
    for d in decisions.values():
        assert d.chosen[2] == pytest.approx(step, rel=1e-12)
        assert all(t >= d.chosen[2] * (1 - 1e-9) for _, _, t in d.candidates[1:])
        assert d.describe().startswith(f"auto: {d.chosen[1]} {d.chosen[0]}")
    assert config["layers"][-1]["match"] == "layer1.0.conv1"


def test_explain_lists_every_unsupported_node_of_an_auto_config_at_once() -> None:
    """The search prices only graphs parallelize runs: with ``strict=False`` explain's coverage
    table is drawn with the auto layers sample-parallel and lists every node it cannot run."""
    from tests.test_ops import _Unsupported

    config = {"default": {"algorithm": "auto"}}
    with pytest.raises(Unsupported, match="node 'norm'"):
        explain(_Unsupported(), config, (2, 3, 8, 8), world_size=2, machine=MACHINE)
    e = explain(_Unsupported(), config, (2, 3, 8, 8), world_size=2, machine=MACHINE,
                strict=False)
    assert [n for n, _, _ in e.unsupported] == ["norm", "up"]
    conv = next(lay for lay in e.layers if lay.name == "conv")
    assert conv.grid == "{N: 2}" and not conv.note


def auto_on_world(comm: Any) -> dict[str, Any]:
    """The user's program on a real world, the machine calibrated there (collective): one SGD
    step's largest errors against one process, and what this rank resolved."""
    model, x, y = resnet_case()
    ref = reference_step(model, x, y)
    pm = parallelize(copy.deepcopy(model), _config(comm.size), comm=comm, input_shape=x.shape)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    rows = sample_block(x.shape[0], pm.data_grid)
    out = pm(x[rows])
    F.cross_entropy(out, y[rows]).backward()
    opt.step()
    state = pm.gather_state_dict()
    return {"out": float((out.detach() - ref["out"][rows]).abs().max()),
            "state": max(float((state[k].double() - v.double()).abs().max())
                         for k, v in ref["state"].items()),
            "config": pm.config.to_dict(),
            "decisions": {k: d.describe(limit=100) for k, d in pm.auto_decisions.items()}}


@pytest.mark.gloo
def test_auto_on_gloo_is_resolved_once_for_every_rank_and_exact(gloo2) -> None:  # noqa: ANN001
    got = gloo2.run(auto_on_world)
    assert got[0]["config"] == got[1]["config"] and got[0]["decisions"] == got[1]["decisions"]
    assert len(got[0]["decisions"]) == 12
    for g in got:
        assert g["out"] < 1e-10 and g["state"] < 1e-10, g


def test_what_rank_0_meets_resolving_auto_every_rank_raises() -> None:
    """Rank 0 searches; a config it refuses is refused on every rank, by the same words."""
    model = torch.nn.Sequential(torch.nn.Conv3d(1, 2, 3)).double()
    config = {"layers": [{"match": "0", "grid": {"C": 2}, "algorithm": "auto"}]}

    def build(comm: Any) -> str:
        with pytest.raises(ValueError) as info:
            parallelize(model, config, comm=comm, input_shape=(2, 1, 5, 5, 5), machine=MACHINE)
        return str(info.value)

    said = run_threads(build, 2)
    assert said[0] == said[1] and "layer '0' (Conv3d) cannot run on {'C': 2}" in said[0]


def test_the_ranks_waiting_for_a_search_longer_than_the_timeout_do_not_time_out(
        monkeypatch) -> None:  # noqa: ANN001
    """Rank 0 searches for several communicator timeouts (each plan it prices made slow); the
    other ranks wait for it without a CommTimeoutError, and every rank runs the same config."""
    from distconv.planner import search

    from distconv.parallel.capture import trace

    timeout, pause = 2.0, 0.8
    priced = []
    slow = search._Search.price

    def price(self, *args: Any, **kw: Any) -> Any:  # noqa: ANN001
        priced.append(1)
        time.sleep(pause)
        return slow(self, *args, **kw)

    monkeypatch.setattr(search._Search, "price", price)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(4, 4, 3, padding=1)).double()
    trace(copy.deepcopy(model), (2, 2, 8, 8))  # (the tracer's first imports: not the search)

    def build(comm: Any) -> dict[str, Any]:
        pm = parallelize(copy.deepcopy(model), {"default": {"algorithm": "auto"}}, comm=comm,
                         input_shape=(2, 2, 8, 8), machine=MACHINE)
        return pm.config.to_dict()

    got = run_threads(build, 2, timeout=timeout)
    assert got[0] == got[1]
    assert len(priced) * pause > 3 * timeout  # the search outlasted the timeout 3 times over
