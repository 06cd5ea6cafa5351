"""The whole-network planner on synthetic machines whose optimum is known by construction."""

from __future__ import annotations

import fnmatch
import itertools
import math

import pytest
import torch
import torch.nn as nn

from distconv.machines import Level, Machine
from distconv.perfmodel import ConvProblem
from distconv.planner import (
    Choice, candidates, plan_network, trace_network, transition_bytes,
)
from distconv.redistribute import _repartition_plan, plan_redistribution


class TinyResNet(nn.Module):
    """A stem conv, an identity-skip block and a block whose skip is a strided 1x1 conv."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.b1 = nn.Conv2d(8, 8, 3, padding=1)
        self.b2 = nn.Conv2d(8, 8, 1)
        self.d1 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.d2 = nn.Conv2d(16, 16, 1)
        self.down = nn.Conv2d(8, 16, 1, stride=2)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.stem(x)))
        x = x + self.b2(torch.relu(self.b1(x)))
        x = torch.relu(self.d2(self.d1(x)) + self.down(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _flat(alpha: float, bandwidth: float, rate: float, memory: float = math.inf) -> Machine:
    return Machine("synthetic", (Level("all", 0, alpha, bandwidth),), rate, memory)


@pytest.fixture(scope="module")
def tiny() -> object:
    return trace_network(TinyResNet(), (8, 4, 8, 8))


def test_trace_finds_every_convolution_with_its_global_problem(tiny) -> None:  # noqa: ANN001
    assert [c.name for c in tiny.convs] == ["stem", "b1", "b2", "d1", "d2", "down"]
    stem = tiny.convs[0]
    assert stem.problem == ConvProblem(8, 4, 8, 8, 8, (3, 3), (1, 1), (1, 1), (1, 1), 1, True)
    assert stem.out_shape == (8, 8, 8, 8) and tiny.out_shape == (8, 16, 4, 4)


def test_free_communication_gives_pure_sample_parallelism(tiny) -> None:  # noqa: ANN001
    # Communication free (no latency, bandwidth without limit): sample parallelism moves nothing
    # but weight gradients, which hide behind backward; every other layout adds collectives on
    # the critical path. (This ran with alpha = 1 µs while conversions were priced as exchanges
    # among all 4 ranks; priced over their 2-rank segments, a filter-split stem is 3 µs cheaper
    # with any latency at all: its BatchNorm statistics and its gradient allreduce, the one
    # backward cannot hide, run over 2 ranks instead of 4. So the latency is zero here too.)
    plan = plan_network(tiny, world_size=4, machine=_flat(0.0, 1e30, 1e9))
    assert {str(lp.choice) for lp in plan.layers} == {"sample N4"}
    assert plan.config() == {"default": {"grid": {"N": 4}, "algorithm": "sample"}, "layers": []}


def _one_layer(cin: int, cout: int, hw: int = 8) -> nn.Module:
    return nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False))


@pytest.mark.parametrize("cin, cout, expected", [(4, 64, "stationary-y"), (64, 4, "stationary-x")])
def test_the_larger_of_x_and_y_stays_put(cin: int, cout: int, expected: str) -> None:
    # stationary-x moves y (reduce-scatter, backward allgather); stationary-y moves x. With a
    # slow network the algorithm that keeps the larger tensor stationary wins.
    plan = plan_network(_one_layer(cin, cout), (2, cin, 8, 8), world_size=2,
                        machine=_flat(1e-6, 1e6, 1e12),
                        algorithms=("stationary-x", "stationary-y"))
    (lp,) = plan.layers
    assert lp.choice.algorithm == expected and lp.choice.extents.get("N", 1) == 1
    assert lp.runner_up is not None and lp.runner_up_delta > 0


def test_tiny_memory_forces_the_most_sharded_layout() -> None:
    # One 64->64 3x3 conv with a tiny activation: weight bytes dominate. Per rank, fp32, SGD with
    # momentum (3 copies): sample keeps all 36864 weights: 442368 bytes; a layout over
    # C x F = 2 keeps 221184; over C x F = 4, 9216 weights: 110592 bytes. Activations (x work
    # block + 3 y blocks) stay below 8192 bytes per rank in every layout.
    model = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1, bias=False))
    shape = (4, 64, 2, 2)
    limit = 110_592 + 8192
    free = plan_network(model, shape, world_size=4, machine=_flat(1e-6, 1e12, 1e12))
    assert free.memory > limit  # unconstrained, the fastest layout needs more
    m = _flat(1e-6, 1e12, 1e12, memory=limit)
    plan = plan_network(model, shape, world_size=4, machine=m)
    (lp,) = plan.layers
    e = lp.choice.extents
    assert e.get("C", 1) * e.get("F", 1) == 4 and plan.memory <= limit
    assert "memory limit" in plan.explain()
    with pytest.raises(ValueError, match="no plan fits memory_limit"):
        plan_network(model, shape, world_size=4, machine=m, memory_limit=100_000)


def test_config_names_modules_and_grids_of_the_world_size(tiny) -> None:  # noqa: ANN001
    plan = plan_network(tiny, world_size=4, machine=_flat(1e-5, 1e7, 1e12))
    cfg = plan.config()
    names = {n for n, _ in TinyResNet().named_modules()}
    assert math.prod(cfg["default"]["grid"].values()) == 4
    for entry in cfg["layers"]:
        assert fnmatch.filter(names, entry["match"]) and math.prod(entry["grid"].values()) == 4
        assert entry["algorithm"] in ("sample", "spatial", "stationary-x", "stationary-y",
                                      "stationary-w")
    text = plan.explain()
    assert all(lp.conv.name in text for lp in plan.layers) and "runner-up" in text


def _expected_bytes(src: Choice, dst: Choice, shape: tuple[int, ...], rank: int) -> int:
    """Straight from the executor's plans: one-grid redistribution or cross-grid repartition."""
    from types import SimpleNamespace

    from distconv.grid import ProcessorGrid

    if src.grid == dst.grid:
        grid = ProcessorGrid(dict(src.grid), comm=SimpleNamespace(rank=rank, size=src.size,
                                                                  backend="none"))
        return plan_redistribution(src.grid, src.output_dist, dst.input_dist,
                                   shape).received_bytes(grid, 4)
    plan = _repartition_plan(src.grid, src.output_dist, dst.grid, dst.input_dist, shape)
    return plan.received_bytes(rank, 4)


@pytest.mark.parametrize("world", [4, 6])
def test_transition_bytes_equal_the_redistribution_plans(world: int) -> None:
    pb = ConvProblem(5, 6, 7, 5, 6, 3, padding=1)  # uneven blocks everywhere
    options = candidates(pb, world, max_model=world)
    shape = (5, 7, 5, 6)
    for a, b in itertools.product(options, options):
        for r in range(world):
            assert transition_bytes(a, b, shape, r) == _expected_bytes(a, b, shape, r), (a, b, r)


def test_explain_counts_the_redistribution_into_each_layer_exactly(tiny) -> None:  # noqa: ANN001
    plan = plan_network(tiny, world_size=4, machine=_flat(1e-5, 1e7, 1e12))
    from distconv.ops.elementwise import meeting as _cheaper_meeting
    from distconv.parallel.placement import Placement

    chosen = {lp.conv.name: lp.choice for lp in plan.layers}
    main, skip = chosen["b2"], chosen["stem"]  # block 1's add: b2's output + the stem's
    pm, ps = (Placement(c.grid, c.output_dist) for c in (main, skip))
    joined = "b2" if _cheaper_meeting(pm, ps) == pm else "stem"
    sources = {"stem": None, "b1": "stem", "b2": "b1", "d1": joined, "d2": "d1", "down": joined}
    entry = Choice((("N", 4),), "sample")
    for lp in plan.layers:
        src = chosen[sources[lp.conv.name]] if sources[lp.conv.name] else entry
        worst = max(_expected_bytes(src, lp.choice, lp.conv.in_shape, r) for r in range(4))
        assert lp.transition_bytes == worst, lp.conv.name


def test_bad_arguments_raise() -> None:
    model = _one_layer(4, 4)
    m = _flat(1e-6, 1e9, 1e9)
    with pytest.raises(ValueError, match="world_size must be an int"):
        plan_network(model, (2, 4, 8, 8), world_size=0, machine=m)
    with pytest.raises(ValueError, match="algorithms must be among"):
        plan_network(model, (2, 4, 8, 8), world_size=2, machine=m, algorithms=("im2col",))
    with pytest.raises(ValueError, match="input_shape must be"):
        plan_network(model, (2, 4), world_size=2, machine=m)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        Choice((("N", 2),), "data")


class _Concat(nn.Module):
    def __init__(self, dim: int = 1, ways: int = 2) -> None:
        super().__init__()
        self.dim, self.ways = dim, ways
        self.a, self.b = nn.Conv2d(2, 2, 1), nn.Conv2d(2, 3 if dim == 1 else 2, 1)
        self.c = nn.Conv2d(5 if dim == 1 else 2, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [self.a(x), self.b(x), x][:self.ways]
        return self.c(torch.cat(parts, self.dim)) if self.ways == 2 else torch.cat(parts, 1)


@pytest.mark.parametrize("dim,ways", [(1, 2), (2, 2), (1, 3)])
def test_any_concatenation_is_planned_and_priced_as_explain_prices_it(dim: int, ways: int) -> None:
    """cat([a(x), b(x)], 1), a cat along rows and a three-way cat: planned (the one walk places
    the join as the executor does), and the plan's price is explain's."""
    from distconv.parallel.explain import explain

    m = _flat(1e-5, 1e9, 1e9)
    shape = (4, 2, 6, 6)
    plan = plan_network(_Concat(dim, ways), shape, world_size=4, machine=m, max_model=4)
    assert {lp.conv.name for lp in plan.layers} == ({"a", "b", "c"} if ways == 2 else {"a", "b"})
    assert plan.step_time == explain(_Concat(dim, ways), plan.config(), shape, world_size=4,
                                     machine=m).seconds()


def test_the_search_prices_every_pair_of_choices_as_explain_does() -> None:
    """For every pair of choices of the two branches of a cat, the search's price of the plan
    (its cached reports) is explain's price of its config, to the bit."""
    from distconv.parallel.explain import explain
    from distconv.planner import _Search

    m = _flat(1e-6, 1e9, 1e9)
    shape = (8, 2, 8, 8)
    net = trace_network(_Concat(), shape)
    options = [c for c in candidates(ConvProblem(8, 2, 2, 8, 8, 1), 4, max_model=4)
               if not c.groups_aligned]
    search = _Search(net, 4, m, {"a": options, "b": options},
                     {"default": {"grid": {"N": 4}, "algorithm": "sample"}}, 4, 1)
    for a, b in itertools.product(options, options):
        config = {"default": {"grid": {"N": 4}, "algorithm": "sample"}, "layers": [
            {"match": "a", **a.config()}, {"match": "b", **b.config()}]}
        priced = explain(_Concat(), config, shape, world_size=4, machine=m)
        got = search.price({"a": a, "b": b})
        assert got.step == priced.seconds(), (a, b)
        assert got.memory == sum(priced.memory().values()), (a, b)


def test_planner_takes_a_flat_machine_a_factory_or_a_name(tiny) -> None:  # noqa: ANN001
    """A flat ``perfmodel.Machine`` is the one-level machine that prices alike (it crashed the
    planner, which prices transitions by link); ``lassen`` and ``"lassen"`` are ``lassen()``."""
    from distconv.machines import lassen
    from distconv.perfmodel import Machine as Flat

    flat = plan_network(tiny, world_size=4, machine=Flat(1e-6, 1e-30, 1e9))
    one_level = plan_network(tiny, world_size=4, machine=_flat(1e-6, 1e30, 1e9))
    assert flat.step_time == pytest.approx(one_level.step_time)
    assert flat.config() == one_level.config()
    by = [plan_network(tiny, world_size=4, machine=m) for m in (lassen(), lassen, "lassen")]
    assert len({(p.step_time, str(p.config())) for p in by}) == 1
    with pytest.raises(TypeError, match="machine must be"):
        plan_network(tiny, world_size=4, machine=None)


@pytest.mark.parametrize("machine", ["lassen", "slow links"])
def test_the_plan_is_priced_no_dearer_than_each_layers_own_cheapest_choice(
        tiny, machine: str) -> None:
    """Each convolution's cheapest candidate priced alone (its own report and gradient
    allreduce, conversions between layers ignored: how ``auto`` once chose), made one config and
    priced by explain: the plan is no dearer (the search starts from it)."""
    from distconv.machines import lassen
    from distconv.parallel.explain import explain
    from distconv.planner import layer_candidates, layer_cost

    m = lassen() if machine == "lassen" else _flat(1e-5, 1e7, 1e12)
    plan = plan_network(tiny, world_size=4, machine=m)
    picks = {c.name: min(layer_candidates(c, 4), key=lambda ch, c=c: layer_cost(c, ch, m).total)
             for c in tiny.convs}
    config = {"default": {"grid": {"N": 4}, "algorithm": "sample"},
              "layers": [{"match": n, **ch.config()} for n, ch in picks.items()]}
    own = explain(TinyResNet(), config, (8, 4, 8, 8), world_size=4, machine=m).seconds()
    assert plan.step_time <= own * (1 + 1e-12), (plan.config(), plan.step_time, own)


def test_planner_refuses_what_parallelize_refuses() -> None:
    from torch import nn

    from distconv.ops import Unsupported
    from distconv.planner import plan_network

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.PixelShuffle(2), nn.Conv2d(2, 8, 3))
    with pytest.raises(Unsupported, match="PixelShuffle is not supported"):
        plan_network(model, (4, 3, 16, 16), world_size=4, machine="lassen")


@pytest.mark.parametrize("machine", ["flat", "lassen"])
def test_planner_and_explain_give_one_price_for_one_plan(tiny, machine) -> None:  # noqa: ANN001
    """The planner's plan and a hand config, priced by ``predict``/``plan_network`` and by
    ``explain`` on the same machine: the same seconds (one pricing, by the op handlers)."""
    from distconv.machines import lassen
    from distconv.parallel.explain import explain
    from distconv.perfmodel import Machine as Flat
    from distconv.planner import predict

    m = Flat(1e-5, 1e-9, 1e10) if machine == "flat" else lassen()
    plan = plan_network(tiny, world_size=4, machine=m)
    hand = {"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"},
            "layers": [{"match": "d*", "grid": {"N": 2, "F": 2}, "algorithm": "stationary-y"}]}
    for config, planned in ((plan.config(), plan),
                            (hand, predict(tiny, hand, world_size=4, machine=m))):
        priced = explain(TinyResNet(), config, (8, 4, 8, 8), world_size=4, machine=m)
        assert planned.step_time == priced.seconds() > 0
        assert planned.forward_time == priced.timeline().forward
        assert f"predicted step {planned.step_time * 1e3:.2f} ms" in planned.explain()


def test_the_step_overlaps_gradient_allreduces_with_the_rest_of_backward() -> None:
    """Two layers of 1 s forward and 2 s backward each; a 3 s gradient allreduce ready after the
    second layer's backward hides 2 s behind the first's; one ready after the first layer's
    backward (the last to run) hides nothing; a 1 s activation collective is on the path."""
    from distconv.ops.pricing import CommStep, LayerReport, timeline
    from distconv.perfmodel import Machine as Flat

    machine = Flat(alpha=0.0, beta=1.0, flop_rate=1.0)  # seconds = bytes received

    def layer(name: str) -> LayerReport:
        return LayerReport(name, "conv", "-", "-", {}, forward_seconds=1.0, backward_seconds=2.0)

    a, b = layer("a"), layer("b")
    b.steps.append(CommStep("forward", "allgather x", "allgather", {0: 1}, 2))
    grads = LayerReport("(gradients)", "grad-sync", "-", "-", {}, [
        CommStep("backward", "bucket 0", "allreduce", {0: 3}, 2, after="b"),
        CommStep("backward", "bucket 1", "allreduce", {0: 3}, 2, after="a")])
    t = timeline([a, b, grads], machine)
    # forward 1 + 1 + 1; backward b (2), a (2); bucket 0 runs 5..8, bucket 1 8..11
    assert (t.forward, t.backward, t.gradients) == (3.0, 4.0, 6.0)
    assert t.step == 11.0 and t.exposed == 4.0


@pytest.mark.parametrize("problem", [
    ConvProblem(2, 4, 4, 1, 6, kernel_size=1, padding=1),  # 3 output rows from 1 input row
    ConvProblem(2, 4, 4, 3, 5, kernel_size=3, padding=1, padding_mode="reflect"),
    ConvProblem(2, 4, 4, 3, 7, kernel_size=3, stride=2, padding=1),  # 2 output rows
], ids=["padding-grows-rows", "reflect", "strided"])
def test_planner_candidates_are_the_layouts_explain_accepts(problem: ConvProblem) -> None:
    """The planner offers a spatial split exactly where explain (and DistConv2d) can run it:
    every rank at least one input and one output row, a padding mode that splits."""
    from distconv.parallel.explain import explain

    model = nn.Sequential(nn.Conv2d(problem.in_channels, problem.out_channels,
                                    problem.kernel_size, stride=problem.stride,
                                    padding=problem.padding, padding_mode=problem.padding_mode))
    shape = (problem.batch, problem.in_channels, problem.height, problem.width)
    offered = {c.grid for c in candidates(problem, 4, algorithms=("spatial",))}
    # the spatial grids the planner considers on 4 ranks (N the rest, named where it splits)
    shaped = [(("N", 2), ("H", 2)), (("H", 4),), (("H", 2), ("W", 2))]
    accepted = set()
    for grid in shaped:
        config = {"layers": [{"match": "0", "grid": dict(grid), "algorithm": "spatial"}]}
        try:
            explain(model, config, shape, world_size=4)
        except ValueError as exc:
            assert "exceeds what this layer can split" in str(exc) or "padding" in str(exc), exc
            continue
        accepted.add(grid)
    assert offered == accepted
    assert accepted != set(shaped)  # each case has a split explain refuses


class _Three(nn.Module):
    """A stem, a residual 3x3 conv and a 1x1 widening conv: small enough to price every plan."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 16, 3, padding=1)
        self.body = nn.Conv2d(16, 16, 3, padding=1)
        self.wide = nn.Conv2d(16, 64, 1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        x = x + torch.relu(self.body(x))
        return self.fc(self.wide(x).mean((2, 3)))


@pytest.mark.parametrize("machine", ["lassen", "slow"])
def test_no_plan_of_the_space_is_priced_below_the_planners(machine: str) -> None:
    """Every plan of the search space (each convolution any of its candidates) priced by
    explain: none below the planner's plan, so no hand config of the space is either."""
    from distconv.machines import lassen
    from distconv.parallel.explain import explain
    from distconv.planner import _Search

    m = lassen() if machine == "lassen" else _flat(1e-6, 2e8, 1e11)
    shape = (8, 4, 16, 16)
    net = trace_network(_Three(), shape)
    plan = plan_network(net, world_size=4, machine=m, max_model=4,
                        algorithms=("sample", "spatial", "stationary-x", "stationary-y"))
    options = {c.name: [ch for ch in candidates(c.problem, 4, max_model=4, algorithms=(
        "sample", "spatial", "stationary-x", "stationary-y"))] for c in net.convs}
    search = _Search(net, 4, m, options, {"default": {"grid": {"N": 4}, "algorithm": "sample"}},
                     4, 1)
    prices = [search.price(dict(zip(options, combo))).step
              for combo in itertools.product(*options.values())]
    assert len(prices) > 100
    assert plan.step_time <= min(prices) * (1 + 1e-12)
    assert plan.step_time == explain(_Three(), plan.config(), shape, world_size=4,
                                     machine=m).seconds()


class _Dense(nn.Module):
    """A dense block (each conv reads the concatenation of all before it), a squeeze-and-
    excitation gate (a product with a sigmoid of pooled channels) and a decoder that
    interpolates to its skip's size."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.d1, self.d2, self.d3 = (nn.Conv2d(4 * i, 4, 3, padding=1) for i in (1, 2, 3))
        self.squeeze, self.excite = nn.Conv2d(16, 4, 1), nn.Conv2d(4, 16, 1)
        self.down = nn.Conv2d(16, 8, 3, stride=2, padding=1)
        self.up = nn.Conv2d(8 + 16, 4, 1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.stem(x)
        b = self.d1(a)
        c = self.d2(torch.cat([a, b], 1))
        d = self.d3(torch.cat([a, b, c], 1))
        skip = torch.cat([a, b, c, d], 1)
        gate = torch.sigmoid(self.excite(torch.relu(self.squeeze(skip.mean((2, 3), keepdim=True)))))
        skip = skip * gate
        low = nn.functional.interpolate(self.down(skip), size=(16, 16), mode="nearest")
        return self.head(self.up(torch.cat([low, skip], 1)).mean((2, 3)))


@pytest.mark.parametrize("machine", ["lassen", "flat"])
def test_dense_blocks_gates_and_interpolations_are_planned_at_explains_price(machine: str
                                                                            ) -> None:
    """Many-way concatenations, a gate's product and an interpolation back to the skip's size:
    every convolution chosen for, and the plan's price is explain's."""
    from distconv.machines import lassen
    from distconv.parallel.explain import explain

    m = lassen() if machine == "lassen" else _flat(1e-5, 1e8, 1e10)
    shape = (8, 3, 16, 16)
    plan = plan_network(_Dense(), shape, world_size=4, machine=m, max_model=4)
    names = [n for n, mod in _Dense().named_modules() if isinstance(mod, nn.Conv2d)]
    assert sorted(lp.conv.name for lp in plan.layers) == sorted(names)
    priced = explain(_Dense(), plan.config(), shape, world_size=4, machine=m)
    assert plan.step_time == priced.seconds()
    sample = explain(_Dense(), {"default": {"grid": {"N": 4}, "algorithm": "sample"}}, shape,
                     world_size=4, machine=m)
    assert plan.step_time <= sample.seconds()
