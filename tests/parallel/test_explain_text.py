"""``explain`` read by people: at most 100 columns (``verbose`` and ``full()`` too), each layer
with the algorithm its config entry gives and its module path, no row that moves nothing unless
asked, predicted per-layer times with a machine, a line that says how the config compares with
sample parallelism, and ``plot`` drawing the step the timeline prices."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from distconv.parallel.explain import explain, layer_seconds
from distconv.parallel.explain_plot import step_intervals
from tests.parallel.cases import RESNET_CONFIG, RESNET_SHAPE, resnet_case

# a config predicted slower than sample parallelism: layer3 over 32 channel blocks. (It was
# {N: 16, C: 4}, slower only while its conversions were priced as 64-rank exchanges; priced over
# their 4-rank segments, one node each, that config is faster than sample parallelism.)
WIDE = {"default": {"grid": {"N": 64}, "algorithm": "sample"},
        "layers": [{"match": "layer3.*", "grid": {"N": 2, "C": 32}, "algorithm": "stationary-x"}]}


@pytest.fixture(scope="module")
def resnet():
    return resnet_case()[0]


def _row(text: str, name: str) -> list[str]:
    """The table row of layer ``name``: its columns."""
    return next(line.split() for line in text.splitlines() if line.split()[:1] == [name])


def test_every_line_fits_100_columns_and_full_shows_more(resnet) -> None:
    e = explain(resnet, RESNET_CONFIG, RESNET_SHAPE, world_size=4, machine="lassen")
    short, full = str(e), str(e.full())
    assert str(explain(resnet, RESNET_CONFIG, RESNET_SHAPE, world_size=4, machine="lassen",
                       verbose=True)) == full
    for text in (short, full):
        assert max(len(line) for line in text.splitlines()) <= 100
    assert len(full.splitlines()) > len(short.splitlines())
    assert "x[o,*,o,*]" in full and "x[o,*,o,*]" not in short  # distributions: verbose only


def test_rows_name_module_paths_and_the_configured_algorithm(resnet) -> None:
    text = str(explain(resnet, RESNET_CONFIG, RESNET_SHAPE, world_size=4).full())
    assert not re.search(r"\b\w+_\d\b", text), re.findall(r"\b\w+_\d\b", text)  # no fx names
    assert "redistribute layer1.0.relu:" in text  # the value a conversion moves, by its module
    # RESNET_CONFIG: conv1 and layer1.* spatial, layer2.* stationary-x, layer3.0.conv1 and
    # conv2 stationary-y, the rest of layer3.* stationary-w, fc by the default entry (sample)
    for name, algorithm in (("conv1", "spatial"), ("layer1.0.conv2", "spatial"),
                            ("layer2.0.conv1", "stationary-x"), ("layer3.0.conv1", "stationary-y"),
                            ("layer3.0.conv3", "stationary-w"), ("fc", "sample")):
        assert _row(text, name)[2] == algorithm, (name, _row(text, name))
    assert _row(text, "bn1")[2] == "-"  # a norm follows its input: no algorithm of its own


def test_rows_that_move_and_hold_nothing_only_in_full(resnet) -> None:
    e = explain(resnet, RESNET_CONFIG, RESNET_SHAPE, world_size=4)
    short, full = str(e), str(e.full())
    zero = re.compile(r"^\s+(forward|backward)\s+0 B\b", re.M)
    assert zero.search(full) and not zero.search(short)
    def empty(text: str) -> list[str]:  # layer rows with 0 bytes each way and 0 parameters
        return [line.split()[0] for line in text.splitlines()
                if not line.startswith(" ") and line.split()[-3:] == ["0", "0", "0"]]

    assert empty(full) and not empty(short), empty(full)
    # layer1.0.conv1 (1x1, spatial) moves nothing but holds parameters: its row stays
    assert _row(short, "layer1.0.conv1")[3:6] == ["0", "0", "128"]


def test_a_machine_adds_each_layers_predicted_time(resnet) -> None:
    e = explain(resnet, RESNET_CONFIG, RESNET_SHAPE, world_size=4, machine="lassen")
    text = str(e)
    conv = next(lay for lay in e.layers if lay.name == "layer3.0.conv2")
    assert float(_row(text, "layer3.0.conv2")[-1]) == round(layer_seconds(conv, e.machine) * 1e3,
                                                             3)
    assert layer_seconds(conv, e.machine) > conv.compute_seconds > 0  # its collectives too
    assert "ms" in text.splitlines()[2].split() and "ms" not in str(
        explain(resnet, RESNET_CONFIG, RESNET_SHAPE, world_size=4)).splitlines()[2].split()


def test_a_config_predicted_slower_than_sample_parallelism_says_by_how_much(resnet) -> None:
    e = explain(resnet, WIDE, (128, 3, 16, 16), machine="lassen")
    ratio = e.seconds() / e.baseline.seconds()
    assert ratio > 1
    said = " ".join(str(e).split())
    assert (f"predicted {ratio:.2f}× SLOWER than sample parallelism on the same 64 ranks "
            f"({e.seconds() * 1e3:.3f} ms vs {e.baseline.seconds() * 1e3:.3f} ms per step)"
            ) in said
    faster = explain(resnet, RESNET_CONFIG, RESNET_SHAPE, world_size=4, machine="lassen")
    assert faster.seconds() < faster.baseline.seconds()
    assert "faster than sample parallelism" in " ".join(str(faster).split())


def test_the_plotted_timeline_is_the_priced_step(resnet, tmp_path: Path) -> None:
    e = explain(resnet, RESNET_CONFIG, RESNET_SHAPE, world_size=4, machine="lassen")
    bars = step_intervals(e)
    tl = e.timeline()
    assert max(b.end for b in bars) == pytest.approx(tl.step, rel=1e-12)
    grads = sum(b.end - b.start for b in bars if b.kind in ("hidden", "exposed"))
    assert grads == pytest.approx(tl.gradients, rel=1e-12)
    exposed = sum(b.end - b.start for b in bars if b.kind == "exposed")
    assert exposed == pytest.approx(tl.exposed, rel=1e-9, abs=1e-15)
    for path in (tmp_path / "step.png", tmp_path / "bare.png"):
        (e if path.stem == "step" else explain(resnet, RESNET_CONFIG, RESNET_SHAPE,
                                               world_size=4)).plot(path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
