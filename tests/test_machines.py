"""Machines as data: the hierarchy's pricing by hand, the Lassen profile's sources, calibration."""

from __future__ import annotations

import math
import re

import pytest

from distconv.machines import LASSEN, LASSEN_SOURCES, ConvTable, Level, Machine, calibrate, group_of
from distconv.perfmodel import ConvProblem, conv_cost
from distconv.testing import run_threads

# A toy hierarchy: 2 ranks per socket (dedicated link), 4 per node (shared bus), then a network
# adapter shared by the node's 4 ranks. Round numbers so every price below is by hand.
TOY = Machine("toy", (
    Level("socket", 2, 1e-6, 100.0),
    Level("node", 4, 2e-6, 50.0, shared=True),
    Level("network", 0, 10e-6, 10.0, shared=True),
), flop_rate=1e9, memory=1e9)


def test_group_of_follows_row_major_rank_order() -> None:
    layout = (("N", 4), ("C", 2))  # C varies fastest: rank = 2 n + c
    assert group_of(layout, ["C"]) == [0, 1]
    assert group_of(layout, ["N"]) == [0, 2, 4, 6]
    assert group_of(layout, ["N", "C"]) == list(range(8))


@pytest.mark.parametrize("ranks, level, k", [
    ([0, 1], 0, 1),          # inside a socket
    ([0, 2], 1, 1),          # two sockets of one node, one member in each
    ([0, 1, 2, 3], 1, 2),    # a whole node: two members per socket
    ([0, 4], 2, 1),          # two nodes
    ([0, 2, 4, 6], 2, 2),    # two nodes, two members per node
])
def test_level_of_a_group_is_the_innermost_unit_holding_it(ranks, level, k) -> None:  # noqa: ANN001
    assert TOY.level_of(ranks) == (level, k)


def test_link_time_shares_a_link_among_the_rings_that_cross_it() -> None:
    # Ring over ranks {0,4,8,12}: one member per node, so the node's 4 ranks run 4 such rings
    # through one adapter: each gets 10/4 bytes/s. 100 bytes in 3 steps.
    assert TOY.link_time([0, 4, 8, 12], 100, 3) == pytest.approx(3 * 10e-6 + 100 * 4 / 10.0)
    # Whole nodes in the ring: one ring leaves each node, the adapter is not shared.
    assert TOY.link_time(list(range(8)), 100, 7) == pytest.approx(7 * 10e-6 + 100 / 10.0)
    # Inside a socket: a dedicated link.
    assert TOY.link_time([0, 1], 100, 1) == pytest.approx(1e-6 + 100 / 100.0)
    assert TOY.link_time([3], 100, 0) == 0.0


def test_segmented_allreduce_inside_a_socket_is_priced_on_the_socket_link() -> None:
    layout = (("N", 4), ("C", 2))
    t_c = TOY.collective_time("allreduce", 2, 80, layout=layout, dims=("C",))
    assert t_c == pytest.approx(2 * 1e-6 + 80 / 100.0)
    # Over N: ranks {0,2,4,6} span two nodes with two members each: 4 / 2 = 2 rings per adapter.
    t_n = TOY.collective_time("allreduce", 4, 80, layout=layout, dims=("N",))
    assert t_n == pytest.approx(6 * 10e-6 + 80 * 2 / 10.0)


def test_conv_cost_prices_each_collective_on_the_level_its_segment_crosses() -> None:
    # stationary-x on N=2 x C=2, 1x1 kernel, no bias: the reduce-scatter / allgather over C stay
    # in a socket; the weight-gradient allreduce over N crosses sockets inside a node.
    pb = ConvProblem(2, 4, 4, 2, 2, 1, bias=False)
    cost = conv_cost(pb, {"N": 2, "C": 2}, "stationary-x", TOY)
    # per rank: n=1, y block 2 filters of 2x2: reduce-scatter receives 1*2*4*4 = 32 bytes
    assert cost.steps["reduce-scatter y over C"] == pytest.approx(1e-6 + 32 / 100.0)
    assert cost.steps["allgather dL/dy over C"] == pytest.approx(1e-6 + 32 / 100.0)
    # weight shard 4 x 2 = 8 elements over N=2 (ranks {0, 2}: one per socket, two rings per bus)
    assert cost.steps["allreduce dL/dw"] == pytest.approx(2 * 2e-6 + 8 * 4 * 2 / 50.0)


def test_lassen_every_number_has_a_source() -> None:
    assert [(lv.name, lv.ranks) for lv in LASSEN.levels] == [
        ("socket", 2), ("node", 4), ("network", 0)]
    keys = " | ".join(LASSEN_SOURCES)
    for lv in LASSEN.levels:
        assert lv.source, lv.name
        assert f"{lv.name} bandwidth = {lv.bandwidth / 1e9:g} GB/s" in keys
        assert f"{lv.name} alpha = {lv.alpha * 1e6:g} us" in keys
        if lv.ranks:
            assert f"ranks per {lv.name} = {lv.ranks}" in keys
    assert f"flop_rate = {LASSEN.flop_rate / 1e12:.1f} TFLOP/s" in keys
    assert f"memory = {LASSEN.memory / 2**30:g} GiB" in keys
    assert f"schedule = {LASSEN.schedule}" in keys
    assert f"comm_overlap = {LASSEN.comm_overlap:g}" in keys
    roof = LASSEN.conv_time
    assert f"memory_bandwidth = {roof.memory_bandwidth / 1e9:g} GB/s" in keys
    assert f"parallelism = {roof.parallelism}" in keys
    assert f"overhead = {roof.overhead * 1e6:g} us" in keys
    for key, source in LASSEN_SOURCES.items():
        assert len(source) > 20 and re.search(r"LLNL|IBM|NVIDIA|Dryden|Mellanox|assum", source), key
    assert LASSEN.sources is LASSEN_SOURCES


def test_machine_rejects_bad_hierarchies() -> None:
    with pytest.raises(ValueError, match="each dividing the next"):
        Machine("bad", (Level("a", 3, 1e-6, 1.0), Level("b", 4, 1e-6, 1.0),
                        Level("c", 0, 1e-6, 1.0)), 1.0)
    with pytest.raises(ValueError, match="bandwidth"):
        Level("a", 2, 1e-6, 0.0)
    with pytest.raises(ValueError, match="levels must not be empty"):
        Machine("bad", (), 1.0)


def test_machine_takes_a_comm_overlap_in_the_unit_interval_and_shows_it() -> None:
    level = (Level("all", 0, 1e-6, 1.0),)
    assert Machine("m", level, 1.0).comm_overlap == 1.0  # the default: fully hidden
    assert "comm_overlap=0.25" in repr(Machine("m", level, 1.0, comm_overlap=0.25))
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"comm_overlap must be in \[0, 1\]"):
            Machine("m", level, 1.0, comm_overlap=bad)
    for bad in ("0.5", True, None):
        with pytest.raises(TypeError, match="comm_overlap must be a number"):
            Machine("m", level, 1.0, comm_overlap=bad)


def test_conv_table_uses_measured_times_and_falls_back_to_the_rate() -> None:
    pb, other = ConvProblem(2, 4, 4, 8, 8, 3), ConvProblem(1, 4, 4, 8, 8, 3)
    table = ConvTable({ConvTable.key(pb): 0.5}, flop_rate=1e6)
    m = Machine("t", (Level("all", 0, 0.0, 1.0),), 1e6, conv_time=table)
    assert m.local_conv(pb) == 0.5
    assert m.local_conv(other) == other.flops() / 1e6


def _calibrate(comm):  # noqa: ANN001, ANN202
    return calibrate(comm, problems=[ConvProblem(1, 4, 4, 8, 8, 3, padding=1)],
                     sizes=(1, 1024), repeats=1)


def test_calibration_gives_every_rank_the_same_profile() -> None:
    a, b = run_threads(_calibrate, 2)
    assert a.levels == b.levels and a.flop_rate == b.flop_rate
    assert a.conv_time.times == b.conv_time.times and len(a.conv_time.times) == 1
    assert a.levels[0].alpha > 0 and a.levels[0].bandwidth > 0
    assert a.comm_overlap == b.comm_overlap and 0.0 <= a.comm_overlap <= 1.0


def test_tree_schedule_shortens_only_the_latency_term() -> None:
    ring = Machine("r", (Level("all", 0, 1e-6, 100.0),), 1.0)
    tree = Machine("t", (Level("all", 0, 1e-6, 100.0),), 1.0, schedule="tree")
    # 16 ranks: ring allreduce 30 steps, tree 2 * log2(16) = 8; the same 100 bytes either way.
    assert ring.collective_time("allreduce", 16, 100) == pytest.approx(30e-6 + 1.0)
    assert tree.collective_time("allreduce", 16, 100) == pytest.approx(8e-6 + 1.0)
    assert tree.collective_time("allgather", 5, 100) == pytest.approx(3e-6 + 1.0)
    with pytest.raises(ValueError, match="schedule must be"):
        Machine("x", (Level("all", 0, 1e-6, 1.0),), 1.0, schedule="butterfly")


def test_roofline_by_hand() -> None:
    from distconv.machines import Roofline

    roof = Roofline(flop_rate=1e9, memory_bandwidth=1e9, parallelism=64, overhead=1e-3)
    # 1x1 conv, batch 1, 4 -> 4 channels, 4x4: 64 outputs (full occupancy), 512 FLOPs,
    # (64 + 64 + 16) * 4 bytes = 576 bytes: memory-bound.
    pb = ConvProblem(1, 4, 4, 4, 4, 1, bias=False)
    assert roof(pb) == pytest.approx(576 / 1e9 + 1e-3)
    # 2x2 image: 16 outputs of 64 -> a quarter of the device busy.
    small = ConvProblem(1, 4, 4, 2, 2, 1, bias=False)
    assert roof(small) == pytest.approx((16 + 16 + 16) * 4 / 1e9 * 4 + 1e-3)
    assert LASSEN.local_conv(pb) == pytest.approx(
        max(pb.flops() / LASSEN.flop_rate, 576 / 900e9) / (64 / 163840) + 10e-6)


def test_resolve_machine_takes_a_machine_a_factory_or_a_known_name() -> None:
    from distconv.machines import lassen, resolve_machine
    from distconv.perfmodel import Machine as Flat

    assert resolve_machine(TOY) is TOY
    assert resolve_machine(lassen) == resolve_machine("lassen") == resolve_machine("Lassen")
    assert resolve_machine(lassen) == lassen()
    flat = Flat(3e-6, 2e-9, 1e10)
    assert resolve_machine(flat) is flat
    one_level = resolve_machine(flat, hierarchical=True)
    assert isinstance(one_level, Machine) and one_level.memory == math.inf
    for op, peers, nbytes in [("allgather", 4, 1000), ("allreduce", 8, 123), ("alltoall", 2, 7)]:
        assert one_level.collective_time(op, peers, nbytes) == pytest.approx(
            flat.collective_time(op, peers, nbytes))
    pb = ConvProblem(2, 4, 4, 8, 8, 3, padding=1)
    assert one_level.local_conv(pb) == flat.local_conv(pb)
    with pytest.raises(TypeError, match=r"machine must be .* got 3 of type int"):
        resolve_machine(3)
    with pytest.raises(ValueError, match=r"machine='frontier' is not a known machine name"):
        resolve_machine("frontier")


def test_explain_prices_each_collective_on_the_level_its_ranks_span() -> None:
    """{N: 2, C: 2}: C varies fastest, so the reduce-scatter over C stays in a socket (ranks 0,
    1) and the gradient allreduce over N crosses the node's shared bus (ranks 0, 2)."""
    import torch.nn as nn

    from distconv.parallel.explain import explain

    config = {"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"}}
    plan = explain(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1)), config, (4, 4, 8, 8),
                   machine=TOY)
    steps = {s.what.split(" (")[0]: s for lay in plan.layers for s in lay.steps}
    rs = steps["reduce-scatter y over C"]
    assert rs.seconds(TOY) == pytest.approx(1 * 1e-6 + max(rs.bytes.values()) / 100.0)
    grad = next(s for w, s in steps.items() if w.startswith("gradient bucket") and "N of" in w)
    # ring allreduce among 2: 2 steps; two rings share each socket's bus: 2 flows
    assert grad.seconds(TOY) == pytest.approx(2 * 2e-6 + max(grad.bytes.values()) * 2 / 50.0)
    assert plan.seconds() == pytest.approx(sum(
        lay.compute_seconds + sum(s.seconds(TOY) for s in lay.steps) for lay in plan.layers))


def test_explain_takes_the_lassen_factory_and_name() -> None:
    import torch.nn as nn

    from distconv.machines import lassen
    from distconv.parallel.explain import explain

    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3))
    config = {"default": {"grid": {"N": 2, "F": 2}, "algorithm": "stationary-y"}}
    seconds = {explain(model, config, (4, 4, 8, 8), machine=m).seconds()
               for m in (lassen(), lassen, "lassen")}
    assert len(seconds) == 1 and next(iter(seconds)) > 0


@pytest.mark.parametrize("o", [0.0, 1.0])
def test_timeline_hides_the_gradient_allreduces_only_as_far_as_communication_overlaps(
        o: float) -> None:
    """Sample parallelism on a flat machine: where communication takes the processor (o = 0)
    the step is the sum of the forward, the backward and every gradient allreduce; where it
    runs beside backward (o = 1), the allreduces hide behind the rest of the backward."""
    import torch.nn as nn

    from distconv.parallel.explain import explain

    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    machine = Machine.flat(1e-6, 1e-9, 1e8, comm_overlap=o)
    plan = explain(model, {"default": {"grid": {"N": 2}, "algorithm": "sample"}}, (4, 4, 8, 8),
                   machine=machine, bucket_bytes=1)  # a bucket per layer, launched in backward

    def phase(lay, name: str) -> float:  # noqa: ANN001
        return getattr(lay, f"{name}_seconds") + sum(
            s.seconds(machine) for s in lay.steps if s.phase == name and s.after is None)

    forward = sum(phase(lay, "forward") for lay in plan.layers)
    backward = sum(phase(lay, "backward") for lay in plan.layers)
    grads = sum(s.seconds(machine) for lay in plan.layers for s in lay.steps
                if s.after is not None)
    assert grads > 0
    step = plan.timeline().step
    if o == 0.0:
        assert step == pytest.approx(forward + backward + grads)
    else:  # the last layer's allreduce waits for nothing but its own backward
        assert forward + backward < step < forward + backward + grads


def test_an_overlapped_halo_hides_its_share_times_the_machines_comm_overlap() -> None:
    from distconv.ops.pricing import halo_hidden

    steps = {"halo exchange x": 2.0, "local conv forward": 10.0, "halo accumulate dL/dx": 3.0,
             "local conv backward (data + filter)": 20.0}
    half = Machine.flat(1e-6, 1e-9, 1e8, comm_overlap=0.5)
    assert halo_hidden(steps, 0.5) == {"forward": 2.0, "backward": 3.0}
    assert halo_hidden(steps, 0.5, half) == {"forward": 1.0, "backward": 1.5}
    assert halo_hidden(steps, 0.1, half) == {"forward": 0.5, "backward": 1.0}
