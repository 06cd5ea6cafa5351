"""Pipelined stationary-x, -y and -w equal the unpipelined layer and one process, and move the
same bytes.

Two kinds of data. With small integers in float64 every sum is exact whatever its order, so the
pipelined layer must equal the unpipelined one and ``nn.Conv2d`` **bitwise**: any element summed
twice, dropped or taken from the wrong chunk shows. With random reals the local convolution's
own arithmetic may depend on the batch it is given (oneDNN picks its kernels by shape), so there
the results are compared within the dtype's tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from distconv.grid import ProcessorGrid
from distconv.nn import DistConv2d
from distconv.nn.pipeline import chunk_sizes
from distconv.redistribute import gather
from distconv.testing import run_threads
from tests.nn.conv_cases import TOLERANCES, ConvCase, reference
from tests.nn.test_conv import RELAXED, conv_cases


def run_both(comm, case: ConvCase, k: int, ref: dict) -> dict:  # noqa: ANN001
    """Run ``case`` unpipelined and with ``pipeline=k`` on this rank: the results of both
    (local blocks), the bytes each moved, and the gathered pipelined results."""
    grid = ProcessorGrid(dict(case.grid), comm=comm)
    shape = case.input_shape
    out = {}
    for name, pipeline in (("plain", 1), ("pipelined", k)):
        layer = DistConv2d.from_conv2d(ref["conv"], grid=grid, algorithm=case.algorithm,
                                       pipeline=pipeline)
        y_shape = layer.output_shape(shape)
        x = ref["x"][layer.input_dist.local_slices(shape, grid)].clone().requires_grad_(True)
        comm.stats.reset()
        y = layer(x, shape)
        y.backward(ref["g"][layer.output_dist.local_slices(y_shape, grid)])
        layer.finish_grad_sync()
        node, kinds = y.grad_fn, set()
        while node is not None:  # y = chunks' result (+ bias)
            kinds.add(type(node).__name__)
            node = node.next_functions[0][0] if node.next_functions else None
        out[name] = {
            "ran pipelined": "_PipelinedBackward" in kinds,
            "bytes": {op: b for op, b in comm.stats.snapshot()["bytes"].items() if b},
            "y": y.detach(), "dx": x.grad, "dw": layer.weight.grad,
            "db": None if layer.bias is None else layer.bias.grad,
        }
    p = out["pipelined"]
    out["global"] = {
        "y": gather(p["y"], layer.output_dist, grid, y_shape),
        "dx": gather(p["dx"], layer.input_dist, grid, shape),
        "dw": gather(p["dw"], layer.weight_dist, grid, layer.weight_shape),
    }
    return out


def integer_reference(case: ConvCase) -> dict:
    """:func:`reference` with small integers in x, w, b and dL/dy: every sum exact in float64."""
    gen = torch.Generator().manual_seed(case.seed)
    conv = torch.nn.Conv2d(case.in_channels, case.out_channels, dtype=torch.float64, **case.conv)

    def ints(shape):  # noqa: ANN001, ANN202
        return torch.randint(-3, 4, tuple(shape), generator=gen).to(torch.float64)

    with torch.no_grad():
        conv.weight.copy_(ints(conv.weight.shape))
        if conv.bias is not None:
            conv.bias.copy_(ints(conv.bias.shape))
    x = ints(case.input_shape).requires_grad_(True)
    y = conv(x)
    g = ints(y.shape)
    y.backward(g)
    return {"conv": conv, "x": x.detach(), "g": g, "y": y.detach(), "dx": x.grad,
            "dw": conv.weight.grad, "db": None if conv.bias is None else conv.bias.grad}


def check(case: ConvCase, ref: dict, results: list[dict], bitwise: bool) -> None:
    rtol, atol = (0.0, 0.0) if bitwise else TOLERANCES[case.dtype]
    for r, res in enumerate(results):
        plain, piped = res["plain"], res["pipelined"]
        assert piped["ran pipelined"] and not plain["ran pipelined"]
        assert piped["bytes"] == plain["bytes"], f"rank {r}: {piped['bytes']} != {plain['bytes']}"
        for key in ("y", "dx", "dw", "db"):
            a, b = piped[key], plain[key]
            if key == "dx" and b is not None and a is None:
                raise AssertionError(f"rank {r}: no dL/dx")
            if b is None:
                assert a is None
            elif bitwise:
                assert torch.equal(a, b), f"rank {r} {key}: {(a - b).abs().max().item():.3g}"
            else:
                torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
        for key in ("y", "dx", "dw"):
            torch.testing.assert_close(res["global"][key], ref[key], rtol=rtol, atol=atol)


@st.composite
def pipelined_cases(draw: st.DrawFn) -> tuple[ConvCase, int]:
    case = draw(conv_cases())
    ext = dict(case.grid)
    communicates = case.conv["groups"] == 1 and (
        (case.algorithm != "stationary-x" and ext.get("F", 1) > 1)
        or (case.algorithm != "stationary-y" and ext.get("C", 1) > 1))
    assume(communicates)
    pn = ext.get("N", 1)  # at least 2 samples on every rank, or nothing is pipelined
    case = dataclasses.replace(case, batch=draw(st.integers(2 * pn, 4 * pn + 1)))
    return case, draw(st.integers(2, 4)), draw(st.booleans())


@settings(max_examples=40, deadline=None, suppress_health_check=RELAXED)
@given(pipelined_cases())
def test_pipelined_layer_equals_the_unpipelined_one(drawn: tuple[ConvCase, int, bool]) -> None:
    case, k, exact = drawn
    ref = integer_reference(case) if exact else reference(case)
    check(case, ref, run_threads(run_both, case.size, case, k, ref), bitwise=exact)


#: Fixed cases for real worlds (4 ranks): each algorithm, several samples per rank, halos.
REAL = [
    (ConvCase((("N", 2), ("C", 2)), "stationary-x", 7, 6, 4, 7, 6,
              {"kernel_size": 3, "padding": 1}), 3),
    (ConvCase((("F", 4),), "stationary-y", 4, 5, 6, 6, 5, {"kernel_size": 3, "padding": "same"}),
     2),
    (ConvCase((("C", 2), ("F", 2)), "stationary-w", 4, 6, 6, 6, 7,
              {"kernel_size": (2, 3), "padding": "same", "bias": False}), 4),
    (ConvCase((("H", 2), ("C", 2)), "stationary-x", 5, 3, 4, 9, 7,
              {"kernel_size": 3, "padding": 1, "padding_mode": "reflect"}), 2),
]


def run_real(comm) -> list[dict]:  # noqa: ANN001
    return [run_both(comm, case, k, ref(case)) for case, k in REAL
            for ref in (integer_reference, reference)]


@pytest.mark.gloo
def test_pipelined_layers_on_gloo(gloo4) -> None:  # noqa: ANN001
    per_rank = gloo4.run(run_real)
    _check_real(per_rank)


@pytest.mark.mpi
def test_pipelined_layers_on_mpi(mpi4) -> None:  # noqa: ANN001
    per_rank = mpi4.run(run_real)
    _check_real(per_rank)


def _check_real(per_rank: list[list[dict]]) -> None:
    for i, (case, _) in enumerate(REAL):
        for j, (ref, exact) in enumerate(((integer_reference, True), (reference, False))):
            check(case, ref(case), [rank[2 * i + j] for rank in per_rank], bitwise=exact)


def test_chunks_are_balanced_and_never_more_than_the_samples() -> None:
    assert chunk_sizes(7, 3) == [3, 2, 2]
    assert chunk_sizes(2, 4) == [1, 1]
    assert chunk_sizes(5, 1) == [5]


def _layer(comm, grid, **kw):  # noqa: ANN001, ANN202
    return DistConv2d(4, 4, 3, grid=ProcessorGrid(grid, comm=comm), **kw)


@pytest.mark.parametrize("grid, kw, error, message", [
    ({"N": 2}, {"algorithm": "stationary-x", "pipeline": 2}, ValueError, "runs neither"),
    ({"C": 2}, {"algorithm": "stationary-x", "pipeline": 2, "groups": 2}, ValueError,
     "runs neither"),
    ({"C": 2}, {"algorithm": "stationary-x", "pipeline": 0}, ValueError, "at least 1"),
    ({"C": 2}, {"algorithm": "stationary-x", "pipeline": 2.0}, TypeError, "must be an int"),
    ({"C": 2}, {"algorithm": "stationary-x", "pipeline": True}, TypeError, "must be an int"),
])
def test_bad_pipeline_values_are_refused(grid, kw, error, message) -> None:  # noqa: ANN001
    def build(comm):  # noqa: ANN001, ANN202
        with pytest.raises(error, match=message):
            _layer(comm, grid, **kw)
    run_threads(build, 2)


def test_repr_shows_the_pipeline() -> None:
    reprs = run_threads(lambda c: repr(_layer(c, {"C": 2}, algorithm="stationary-x",
                                              pipeline=3)), 2)
    assert "pipeline=3" in reprs[0]


# ------------------------------------------------------------------ whole networks and pricing
def _pipelined_config() -> dict:
    from tests.parallel.cases import RESNET_CONFIG

    layers = [dict(e, pipeline=2 + i % 2) if e["algorithm"].startswith("stationary") else e
              for i, e in enumerate(RESNET_CONFIG["layers"])]
    return {"layers": layers}


def _resnet_pipelined(comm, explained):  # noqa: ANN001, ANN202
    from tests.parallel.cases import counted_step, reference_step, resnet_case

    model, x, y = resnet_case()
    ref = reference_step(model, x, y)
    got = counted_step(comm, model, _pipelined_config(), x, y)
    return {"out": (got["out"] - ref["out"][got["rows"]]).abs().max().item(),
            "grads": max((got["grads"][k] - g).abs().max().item()
                         for k, g in ref["grads"].items()),
            "counted": got["counted"], "explained": tuple(explained[comm.rank])}


def test_a_pipelined_network_trains_as_one_process_and_moves_what_explain_says() -> None:
    from distconv.parallel.explain import explain
    from tests.parallel.cases import RESNET_SHAPE, TOL, resnet_case

    plan = explain(resnet_case()[0], _pipelined_config(), RESNET_SHAPE, world_size=4)
    assert sum("pipeline" in lay.note for lay in plan.layers) >= 4
    explained = [tuple(plan.rank_bytes(r).values()) for r in range(4)]
    for r in run_threads(_resnet_pipelined, 4, explained):
        assert r["out"] < TOL and r["grads"] < TOL, r
        assert r["counted"] == r["explained"], r


@pytest.mark.parametrize("entry, message", [
    ({"match": "layer2.*", "grid": {"N": 4}, "algorithm": "sample", "pipeline": 2},
     "has none to overlap"),
    ({"match": "layer2.*", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x",
      "pipeline": 0}, "positive int"),
    ({"match": "layer2.*", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x",
      "pipeline": "2"}, "positive int"),
    ({"match": "layer2.*", "pipeline": 2}, "needs a grid"),
])
def test_bad_pipeline_entries_are_refused_naming_the_entry(entry, message) -> None:  # noqa: ANN001
    from distconv.parallel.config import ParallelConfig

    with pytest.raises(ValueError, match=rf"layers\[0\].*{message}"):
        ParallelConfig({"layers": [entry]}, world_size=4)


def test_a_pipelined_layer_that_moves_nothing_is_refused_naming_it() -> None:
    """Channel blocks holding whole groups: a local grouped convolution, nothing to overlap."""
    from distconv.parallel.explain import explain

    model = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1, groups=2))
    config = {"layers": [{"match": "0", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x",
                          "pipeline": 2}]}
    with pytest.raises(ValueError, match=r"'0'.*pipeline: 2.*moves no data"):
        explain(model, config, (4, 4, 5, 5), world_size=4)
    config["layers"][0]["pipeline"] = 1
    explain(model, config, (4, 4, 5, 5), world_size=4)


def test_the_model_prices_the_overlap_by_hand() -> None:
    """One chunk's allgather g, conv c and reduce-scatter r; forward g + c + r + (k-1)max(c, g+r),
    written out for a flat machine (alpha 0: the bytes split exactly)."""
    from distconv.perfmodel import ConvProblem, Machine, conv_cost

    pb = ConvProblem(4, 8, 8, 6, 6, 3, 1, 1)  # stationary-w on C=2, F=2: all four collectives
    m = Machine(alpha=0.0, beta=1e-9, flop_rate=1e9)
    plain = conv_cost(pb, {"C": 2, "F": 2}, "stationary-w", m)
    piped = conv_cost(pb, {"C": 2, "F": 2}, "stationary-w", m, pipeline=2)
    conv = plain.steps["local conv forward"]
    s = plain.steps
    g, r = s["allgather x over F"], s["reduce-scatter y over C"]
    gb, rb = s["allgather dL/dy over C"], s["reduce-scatter dL/dx over F"]
    grads = s["allreduce dL/dw"] if "allreduce dL/dw" in s else 0.0
    assert plain.forward == pytest.approx(g + conv + r)
    assert piped.forward == pytest.approx(g / 2 + conv / 2 + r / 2 + max(conv / 2, (g + r) / 2))
    assert piped.backward == pytest.approx(
        grads + gb / 2 + conv / 2 + max(conv / 2, (gb + rb) / 2) + max(conv, rb / 2))
    # more chunks than samples: as many as there are
    assert conv_cost(pb, {"C": 2, "F": 2}, "stationary-w", m, pipeline=9).forward == (
        pytest.approx(conv_cost(pb, {"C": 2, "F": 2}, "stationary-w", m, pipeline=4).forward))


@pytest.mark.parametrize("o", [0.0, 0.5, 1.0])
def test_the_model_hides_only_the_machines_comm_overlap_by_hand(o: float) -> None:
    """A stage of chunk compute c beside chunk collectives m lasts c + m - o min(c, m): max(c, m)
    where communication runs beside compute (o = 1), c + m where it does not (o = 0)."""
    from distconv.machines import Machine
    from distconv.perfmodel import ConvProblem, conv_cost

    pb = ConvProblem(4, 8, 8, 6, 6, 3, 1, 1)
    m = Machine.flat(0.0, 1e-9, 1e9, comm_overlap=o)
    plain = conv_cost(pb, {"C": 2, "F": 2}, "stationary-w", m)
    piped = conv_cost(pb, {"C": 2, "F": 2}, "stationary-w", m, pipeline=2)
    s, conv = plain.steps, plain.steps["local conv forward"]
    g, r = s["allgather x over F"], s["reduce-scatter y over C"]
    gb, rb = s["allgather dL/dy over C"], s["reduce-scatter dL/dx over F"]
    grads = s.get("allreduce dL/dw", 0.0)

    def both(a: float, b: float) -> float:
        return a + b - o * min(a, b)

    assert piped.forward == pytest.approx(g / 2 + conv / 2 + r / 2 + both(conv / 2, (g + r) / 2))
    assert piped.backward == pytest.approx(
        grads + gb / 2 + conv / 2 + both(conv / 2, (gb + rb) / 2) + both(conv, rb / 2))
    if o == 0.0:  # nothing hidden: the chunks' compute and bytes are the layer's, in sequence
        assert piped.total == pytest.approx(plain.total)


def test_the_planner_does_not_pipeline_where_communication_does_not_overlap() -> None:
    """The network the planner pipelines on lassen (the test above), on a lassen whose
    collectives take the processor: no layer is pipelined, since every chunk only adds latency."""
    from distconv.machines import lassen
    from distconv.models import resnet_mini
    from distconv.planner import plan_network

    serial = dataclasses.replace(lassen(), comm_overlap=0.0)
    plan = plan_network(resnet_mini(), (8, 3, 16, 16), world_size=4, machine=serial)
    assert all(lp.choice.pipeline == 1 for lp in plan.layers), plan.config()


def test_explain_prices_the_pipeline_on_lassen() -> None:
    from distconv.parallel.explain import explain
    from tests.parallel.cases import RESNET_SHAPE, resnet_case

    model = resnet_case()[0]
    piped = explain(model, _pipelined_config(), RESNET_SHAPE, world_size=4, machine="lassen")
    from tests.parallel.cases import RESNET_CONFIG

    plain = explain(model, RESNET_CONFIG, RESNET_SHAPE, world_size=4, machine="lassen")
    hidden = sum(sum(lay.overlap.values()) for lay in piped.layers)
    assert hidden != 0 and all(not lay.overlap for lay in plain.layers)
    # layer by layer, where the unpipelined layer gathers x itself (a pipelined one always does;
    # an unpipelined one whose x must move anyway takes it gathered, a cheaper conversion)
    from distconv.ops.pricing import timeline

    same = [i for i, lay in enumerate(plain.layers) if lay.note != "x taken gathered"]
    assert 0 < len(same) < len(plain.layers)
    a = timeline([piped.layers[i] for i in same], piped.machine)
    b = timeline([plain.layers[i] for i in same], plain.machine)
    hidden_here = sum(sum(piped.layers[i].overlap.values()) for i in same)
    assert hidden_here > 0 and a.forward + a.backward < b.forward + b.backward
    assert a.forward + a.backward == pytest.approx(b.forward + b.backward - hidden_here)


def test_the_planner_pipelines_a_layer_where_the_model_says_it_pays() -> None:
    from distconv.models import resnet_mini
    from distconv.parallel.explain import explain
    from distconv.planner import layer_cost, plan_network

    shape = (8, 3, 16, 16)
    plan = plan_network(resnet_mini(), shape, world_size=4, machine="lassen")
    piped = [lp for lp in plan.layers if lp.choice.pipeline > 1]
    assert piped, plan.config()
    for lp in piped:
        plain = layer_cost(lp.conv, dataclasses.replace(lp.choice, pipeline=1), plan.machine)
        assert lp.cost.total < plain.total
        entry = next(e for e in plan.config()["layers"] if e["match"] == lp.conv.name)
        assert entry["pipeline"] == lp.choice.pipeline
    # the config it writes runs: explain (parallelize's analysis) takes it and prices the overlap
    priced = explain(resnet_mini(), plan.config(), shape, world_size=4, machine="lassen")
    assert any(lay.overlap for lay in priced.layers)
