"""The planner on networks of ``Conv1d``, ``Conv3d`` and transposed convolutions: what it plans
runs as one process, moving the bytes ``explain`` says, and is no dearer than any pure
alternative priced the same way."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distconv import models
from distconv.machines import lassen
from distconv.parallel.explain import explain
from distconv.planner import plan_network
from distconv.testing import run_threads
from tests.parallel.cases import TOL, counted_step


def _signal() -> nn.Module:
    """A Conv1d and a grouped ConvTranspose1d doubling the length."""
    return nn.Sequential(nn.Conv1d(3, 8, 5, padding=2), nn.ReLU(),
                         nn.ConvTranspose1d(8, 4, 4, stride=2, padding=1, groups=2))


def _case(name: str, shape: tuple[int, ...]) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(7)
    if name.startswith("unet"):  # unet2: two levels, the inner skip nested in the outer
        depth = 2 if name == "unet2" else 1
        model, classes = models.unet3d(in_channels=shape[1], base=2, depth=depth), 2
        target = (shape[0], *shape[2:])
    elif name == "signal":
        model, classes, target = _signal(), 4, (shape[0], 2 * shape[2])
    else:
        model, classes = models.cosmoflow_mini(in_channels=shape[1], size=shape[2]), 4
        target = (shape[0],)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    return model.double(), x, torch.randint(0, classes, target, generator=gen)


def _planned_step(comm: Any, explained: list, case: tuple, config: dict) -> dict:
    """One step under ``config`` against one process (a rank may hold no sample of a batch
    smaller than the world), and the bytes counted."""
    model, x, y = case
    ref = copy.deepcopy(model)
    out_ref = ref(x)
    F.cross_entropy(out_ref, y).backward()
    got = counted_step(comm, model, config, x, y)
    diff = (got["out"] - out_ref.detach()[got["rows"]]).abs()
    return {"out": diff.max().item() if diff.numel() else 0.0,
            "grads": max((got["grads"][k] - p.grad).abs().max().item()
                         for k, p in ref.named_parameters()),
            "counted": got["counted"], "explained": tuple(explained[comm.rank])}


@pytest.mark.parametrize("name, shape", [("unet", (2, 1, 8, 8, 8)), ("unet", (1, 1, 8, 8, 8)),
                                         ("unet2", (1, 1, 8, 8, 8)),
                                         ("cosmoflow", (2, 4, 8, 8, 8)),
                                         ("cosmoflow", (1, 4, 8, 8, 8)),
                                         ("signal", (1, 3, 16)), ("signal", (2, 3, 16))])
def test_the_planned_network_trains_as_one_process_moving_what_explain_says(
        name, shape) -> None:  # noqa: ANN001
    case = _case(name, shape)
    plan = plan_network(case[0], shape, world_size=4, machine=lassen(), itemsize=8)
    config = plan.config()
    ex = explain(case[0], config, shape, world_size=4)
    explained = [tuple(ex.rank_bytes(r).values()) for r in range(4)]
    for r in run_threads(_planned_step, 4, explained, case, config):
        assert r["out"] < TOL and r["grads"] < TOL, r
        assert r["counted"] == r["explained"], r


#: one grid and algorithm for every convolution: the pure alternatives to a plan
PURE = [({"N": 4}, "sample"), ({"D": 4}, "spatial"), ({"D": 2, "H": 2}, "spatial"),
        ({"N": 2, "D": 2}, "spatial"), ({"H": 4}, "spatial"), ({"C": 4}, "stationary-x"),
        ({"F": 4}, "stationary-y"), ({"C": 2, "F": 2}, "stationary-w"),
        ({"N": 2, "C": 2}, "stationary-x"), ({"N": 2, "F": 2}, "stationary-y")]


def _pure_prices(model: nn.Module, shape: tuple[int, ...], names: list[str]) -> dict[str, float]:
    """``explain``'s step time on Lassen of each pure alternative the layers can all run."""
    out = {}
    for grid, algorithm in PURE:
        if grid.get("N", 1) > shape[0]:
            # more sample blocks than samples: explain runs it with ranks that hold nothing,
            # which the planner never offers (e.g. one 64³ volume on {N: 2, F: 2}: the second
            # row idle). Priced with its conversions over their segments, such a plan can be
            # the cheaper: the input moves to the 2 ranks of the first row, not to all 4.
            continue
        config = {"layers": [{"match": n, "grid": grid, "algorithm": algorithm} for n in names]}
        try:
            ex = explain(model, config, shape, world_size=4, machine=lassen())
        except ValueError:  # a layer cannot be split so (too few rows, channels or samples)
            continue
        out[f"{algorithm} {grid}"] = ex.timeline().step
    return out


def _priced_plan(model: nn.Module, shape: tuple[int, ...]) -> tuple[Any, dict[str, float]]:
    plan = plan_network(model, shape, world_size=4, machine=lassen())
    names = [lp.conv.name for lp in plan.layers]
    priced = explain(model, plan.config(), shape, world_size=4, machine=lassen())
    assert plan.step_time == priced.timeline().step  # one price for one plan
    pure = _pure_prices(model, shape, names)
    assert len(pure) >= 4, pure
    for label, step in pure.items():
        assert plan.step_time <= step * (1 + 1e-12), (label, step, plan.step_time, plan.config())
    return plan, pure


def test_a_large_volume_is_split_over_space_no_dearer_than_any_pure_plan() -> None:
    """One 64³ volume on 4 ranks: samples cannot share it, and halos of a few channels cost far
    less than gathering or reducing whole activations over channels or filters."""
    torch.manual_seed(0)
    plan, pure = _priced_plan(models.unet3d(in_channels=1, base=8, depth=1), (1, 1, 64, 64, 64))
    chosen = {lp.conv.name: lp.choice for lp in plan.layers}
    for name in ("down.0.0", "down.0.3"):
        assert chosen[name].algorithm == "spatial", chosen
    best_stationary = min(t for k, t in pure.items() if k.startswith("stationary"))
    assert plan.step_time < best_stationary / 2, (plan.step_time, pure)


@pytest.mark.parametrize("name, model, shape", [
    ("unet", lambda: models.unet3d(in_channels=64, base=128, depth=1), (4, 64, 4, 4, 4)),
    ("cosmoflow", lambda: models.cosmoflow_mini(in_channels=64, size=4, base=256),
     (4, 64, 4, 4, 4)),
])
def test_a_tiny_wide_volume_is_split_over_channels_filters_or_samples_no_dearer_than_pure(
        name, model, shape) -> None:  # noqa: ANN001
    """4³ volumes of hundreds of channels: the weights, not the activations, are what is large,
    and halos would be most of each block."""
    torch.manual_seed(0)
    plan, _ = _priced_plan(model(), shape)
    assert all(lp.choice.algorithm != "spatial" for lp in plan.layers), plan.config()
    assert any(lp.choice.algorithm.startswith("stationary") for lp in plan.layers), plan.config()


def test_a_large_cosmoflow_volume_is_planned_no_dearer_than_any_pure_plan() -> None:
    torch.manual_seed(0)
    _priced_plan(models.cosmoflow_mini(size=64, base=8), (1, 4, 64, 64, 64))


def test_an_auto_entry_for_a_3d_convolution_is_priced_no_dearer_than_any_choice_of_it(
) -> None:
    """parallelize and explain resolve a layer entry's ``auto`` for a Conv3d or a transposed
    layer by the planner's whole-network search (as for Conv2d): the decision lists the chosen
    candidate first at explain's price of the resolved config, then the others the search
    priced, no cheaper; and no candidate the layer can run (each priced by explain, the other
    layer as resolved) is cheaper than the resolved config. The layer then runs that entry.
    (Resolved per layer alone before, the Conv3d took stationary-y {'N': 2, 'F': 2} and the
    transposed layer spatial {'N': 2, 'D': 2}: a step of 0.2300 ms; the search gives both
    spatial {'D': 4}: 0.1684 ms, both explain's on lassen.)"""
    from distconv.planner import ConvNode, layer_candidates

    model = nn.Sequential(nn.Conv3d(2, 8, 3, padding=1), nn.ReLU(),
                          nn.ConvTranspose3d(8, 2, 2, stride=2))
    shape = (2, 2, 32, 32, 32)
    config = {"layers": [{"match": "*", "algorithm": "auto"}]}
    from distconv.parallel.auto import resolve_auto
    from distconv.parallel.config import ParallelConfig
    from distconv.parallel.graph import trace

    ex = explain(model, config, shape, world_size=4, machine="lassen")
    resolved, decisions = resolve_auto(trace(model), ParallelConfig(config, world_size=4), shape,
                                       "lassen")
    assert set(decisions) == {"0", "2"}
    step = ex.seconds()
    for name, x_shape, y_shape in (("0", shape, (2, 8, 32, 32, 32)),
                                   ("2", (2, 8, 32, 32, 32), (2, 2, 64, 64, 64))):
        decision = decisions[name]
        grid, alg, t = decision.chosen
        assert t == pytest.approx(step, rel=1e-12)
        assert all(other >= t * (1 - 1e-9) for _, _, other in decision.candidates[1:])
        conv = ConvNode(name, None, y_shape, model.get_submodule(name), x_shape)
        every = layer_candidates(conv, 4)
        assert len(every) > 3 and (grid, alg) in [(dict(c.grid), c.algorithm) for c in every]
        rest = [e for e in resolved.to_dict()["layers"] if e["match"] != name]
        for c in every:
            swapped = {"layers": [{"match": name, "grid": dict(c.grid),
                                   "algorithm": c.algorithm}] + rest}
            assert explain(model, swapped, shape, world_size=4,
                           machine="lassen").seconds() >= step * (1 - 1e-9), c
        layer = next(lay for lay in ex.layers if lay.name == name)
        runs = "stationary-x" if alg == "spatial" else alg  # spatial runs as stationary-x
        assert layer.algorithm == runs and layer.note.startswith("auto: ")


def test_a_grid_an_auto_3d_layer_cannot_run_is_refused_naming_the_layer() -> None:
    config = {"layers": [{"match": "0", "grid": {"C": 4}, "algorithm": "auto"}]}
    with pytest.raises(ValueError, match=r"layer '0' \(Conv3d\) cannot run on \{'C': 4\}"):
        explain(nn.Sequential(nn.Conv3d(2, 2, 3)), config, (2, 2, 5, 5, 5), world_size=4)


ALL = ("sample", "spatial", "stationary-x", "stationary-y", "stationary-w")


class _Crossing(nn.Module):
    """Two residual joins whose branches cross: ``c(b(a(x)) + x) + a(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Conv3d(2, 2, 3, padding=1) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return self.c(self.b(y) + x) + y


def test_branches_that_cross_are_planned_and_priced_as_explain_prices_them() -> None:
    """Any graph the executor runs is planned: joins whose branches cross, too."""
    shape = (2, 2, 4, 4, 4)
    plan = plan_network(_Crossing(), shape, world_size=4, machine=lassen())
    assert [lp.conv.name for lp in plan.layers] == ["a", "b", "c"]
    assert plan.step_time == explain(_Crossing(), plan.config(), shape, world_size=4,
                                     machine="lassen").seconds()


@pytest.mark.parametrize("model, shape, config, algorithms, error, message", [
    (lambda: nn.Sequential(nn.Conv3d(2, 2, 3)), (2, 2, 5, 5, 5),
     {"layers": [{"match": "0", "algorithm": "auto", "grid": {"D": 4}}]}, ALL,
     ValueError, r"no candidate for 0 \(Conv3d on \(2, 2, 5, 5, 5\)\) on the grid \{'D': 4\}"),
    (lambda: nn.Sequential(nn.Conv1d(2, 2, 3, groups=2)), (1, 2, 9), None,
     ("sample", "stationary-x"), ValueError, r"no candidate for 0 \(Conv1d on \(1, 2, 9\)\)"),
])
def test_what_the_planner_cannot_plan_is_refused_naming_it(model, shape, config,  # noqa: ANN001
                                                           algorithms, error,  # noqa: ANN001
                                                           message) -> None:  # noqa: ANN001
    with pytest.raises(error, match=message):
        plan_network(model(), shape, world_size=4, machine=lassen(), config=config,
                     algorithms=algorithms)


def _auto_step(comm, model: nn.Module, config: dict, x: torch.Tensor, y: torch.Tensor  # noqa: ANN001
               ) -> dict:
    from distconv.data import sample_block
    from distconv.parallel import parallelize
    from tests.parallel.cases import _gathered_grads

    pmodel = parallelize(copy.deepcopy(model), config, comm=comm, input_shape=tuple(x.shape),
                         machine="lassen")
    rows = sample_block(x.shape[0], pmodel.data_grid)
    F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
    return {"grads": _gathered_grads(pmodel), "decided": sorted(pmodel.auto_decisions)}


def test_parallelize_resolves_an_auto_entry_of_3d_layers_and_trains_as_one_process() -> None:
    torch.manual_seed(21)
    model = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(),
                          nn.ConvTranspose3d(4, 2, 2, stride=2)).double()
    gen = torch.Generator().manual_seed(22)
    x = torch.randn((2, 2, 16, 8, 8), generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (2, 32, 16, 16), generator=gen)
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    config = {"layers": [{"match": "*", "algorithm": "auto"}]}
    for got in run_threads(_auto_step, 4, model, config, x, y):
        assert got["decided"] == ["0", "2"]
        for k, p in ref.named_parameters():
            torch.testing.assert_close(got["grads"][k], p.grad, rtol=TOL, atol=TOL, msg=k)


def test_auto_resolves_on_a_double_model_whose_first_convolution_has_a_bias() -> None:
    """The shapes auto chooses from are propagated in the model's own dtype (a float input
    through a double convolution with a bias would not run)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
                          nn.Identity()).double()
    ex = explain(model, {"layers": [{"match": "0", "algorithm": "auto"}]}, (4, 3, 8, 8),
                 world_size=2)
    assert next(lay for lay in ex.layers if lay.name == "0").note.startswith("auto: ")
