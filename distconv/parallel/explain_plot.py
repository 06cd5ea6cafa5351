"""``Explanation.plot``: one training step of an explained config as a picture.

Top: the step's timeline on the machine, as :func:`distconv.pricing.timeline.timeline` prices
it -- a compute stream (each layer's forward, then its backward in reverse order) and a
communication stream (the collectives the compute waits for, and the gradient allreduces, which
run beside the backward: the part before the backward ends is hidden, the rest is exposed).
Below: per layer, the most bytes a rank receives (forward and backward) and the memory a rank
holds for it (parameters, gradients, optimizer state and kept activations).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from distconv import machines

if TYPE_CHECKING:
    from distconv.parallel.explain import Explanation

__all__ = ["Interval", "plot", "step_intervals"]


@dataclass(frozen=True)
class Interval:
    """One bar of the timeline: ``stream`` "compute" or "communication"; ``kind`` "forward",
    "backward", "collective" (the compute waits for it), "hidden" or "exposed" (a gradient
    allreduce's part before and after the backward ends)."""

    stream: str
    kind: str
    layer: str
    start: float
    end: float


def step_intervals(e: Explanation) -> list[Interval]:
    """The step's bars, in seconds from its start, with the timeline's own terms: the last bar
    ends at ``e.seconds()``. Needs ``e.machine``."""
    if e.machine is None:
        raise ValueError("Explanation.plot's timeline needs explain(..., machine=...)")
    machine = machines.resolve_machine(e.machine, hierarchical=True)
    busy = 1.0 - machine.comm_overlap
    out: list[Interval] = []
    t = 0.0

    def run(lay_name: str, phase: str, compute: float, comm: float, hidden: float) -> None:
        nonlocal t
        if compute > 0:
            out.append(Interval("compute", phase, lay_name, t, t + compute))
        t += compute
        waited = comm - hidden  # a pipelined layer hides part of its collectives
        if waited > 0:
            out.append(Interval("communication", "collective", lay_name, t, t + waited))
        t += waited

    def critical(lay: object, phase: str) -> float:
        return sum(s.seconds(machine) for s in lay.steps if s.phase == phase and s.after is None)

    for lay in e.layers:
        run(lay.name, "forward", lay.forward_seconds, critical(lay, "forward"),
            lay.overlap.get("forward", 0.0))
    names = {lay.name for lay in e.layers}
    waiting: dict[str | None, list[tuple[str, float]]] = {}
    for lay in e.layers:
        for s in lay.steps:
            if s.after is not None:
                waiting.setdefault(s.after if s.after in names else None, []).append(
                    (lay.name, s.seconds(machine)))
    comm = t
    grads: list[tuple[str, float, float]] = []
    for lay in reversed(e.layers):
        run(lay.name, "backward", lay.backward_seconds, critical(lay, "backward"),
            lay.overlap.get("backward", 0.0))
        for owner, seconds in waiting.pop(lay.name, ()):
            start = max(comm, t)
            grads.append((owner, start, start + seconds))
            comm = start + seconds
            t += busy * seconds
    for owner, seconds in waiting.pop(None, ()):
        start = max(comm, t)
        grads.append((owner, start, start + seconds))
        comm = start + seconds
        t += busy * seconds
    for owner, start, end in grads:  # hidden while the backward computes, exposed after it
        if start < t:
            out.append(Interval("communication", "hidden", owner, start, min(end, t)))
        if end > t:
            out.append(Interval("communication", "exposed", owner, max(start, t), end))
    return out


_COLOURS = {"forward": "#4c72b0", "backward": "#55a868", "collective": "#c44e52",
            "hidden": "#8172b2", "exposed": "#dd8452"}


def plot(e: Explanation, path: str | os.PathLike[str]) -> None:
    """Write the picture of ``e`` to ``path`` (the format from its suffix): the step's
    timeline on top, every compute bar named by its layer on the top axis; below, one row per
    layer (its module path, legible) of bytes received and of memory held. Legends sit beside
    the plots, never over a bar."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = max(len(e.layers), 1)
    timeline = 4.5 if e.machine is not None else 0.5  # without a machine: one line of text
    fig = Figure(figsize=(14, 1.5 + timeline + 0.24 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subfigures(2, 1, height_ratios=(timeline, 1.6 + 0.24 * rows))
    _timeline(e, top.subplots())
    bytes_ax, memory_ax = bottom.subplots(1, 2, sharey=True)
    _per_layer(e, bytes_ax, memory_ax)
    fig.suptitle(f"{e.world_size} ranks, global input {e.input_shape}")
    fig.savefig(os.fspath(path), dpi=110)


_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": "small",
            "borderaxespad": 0.0}


def _timeline(e: Explanation, ax: object) -> None:
    if e.machine is None:
        ax.text(0.5, 0.5, "no machine: explain(..., machine='lassen') predicts the timeline",
                ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    rows = {"compute": 1, "communication": 0}
    intervals = step_intervals(e)
    step = e.seconds() or 0.0
    for kind in _COLOURS:
        bars = [(iv.start * 1e3, (iv.end - iv.start) * 1e3) for iv in intervals
                if iv.kind == kind]
        if bars:
            stream = "compute" if kind in ("forward", "backward") else "communication"
            ax.broken_barh(bars, (rows[stream] - 0.4, 0.8), color=_COLOURS[kind], label=kind,
                           edgecolor="white", linewidth=0.5)
    # every compute bar named on the top axis, at its middle: the timeline reads by layer
    named = [iv for iv in intervals if iv.kind in ("forward", "backward")]
    top = ax.secondary_xaxis("top")
    top.set_xticks([(iv.start + iv.end) / 2 * 1e3 for iv in named],
                   [e.paths.get(iv.layer, iv.layer) for iv in named], rotation=90, fontsize=6.5)
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_xlabel("ms (predicted, slowest rank)")
    ax.axvline(step * 1e3, color="black", linewidth=0.8)
    ax.set_xlim(0, step * 1e3 * 1.01 or 1)
    ax.set_title(f"one step: {step * 1e3:.3f} ms on {getattr(e.machine, 'name', 'the machine')}"
                 " (gradient allreduces: hidden behind backward, or exposed)")
    ax.legend(**_OUTSIDE)


def _per_layer(e: Explanation, bytes_ax: object, memory_ax: object) -> None:
    layers = e.layers
    names = [e.paths.get(lay.name, lay.name) for lay in layers]
    at = list(range(len(layers)))
    fwd = [max(lay.bytes("forward", r) for r in e.ranks) for lay in layers]
    bwd = [max(lay.bytes("backward", r) for r in e.ranks) for lay in layers]
    bytes_ax.barh(at, fwd, color=_COLOURS["forward"], label="forward")
    bytes_ax.barh(at, bwd, left=fwd, color=_COLOURS["backward"], label="backward")
    bytes_ax.set_xlabel("bytes received per step (most of any rank)")
    state = 2 + e.optimizer_states  # parameters, gradients, optimizer state
    params = [lay.param_elements * state * e.itemsize for lay in layers]
    acts = [lay.activation_elements * e.itemsize for lay in layers]
    memory_ax.barh(at, params, color="#937860", label="parameters, gradients,\noptimizer state")
    memory_ax.barh(at, acts, left=params, color="#da8bc3", label="activations kept")
    memory_ax.set_xlabel("bytes per rank (largest block)")
    bytes_ax.set_yticks(at, names, fontsize=8)
    bytes_ax.set_ylim(len(layers) - 0.5, -0.5)  # the first layer on top, as in the text
    for ax in (bytes_ax, memory_ax):
        ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.01), ncols=2, fontsize="small",
                  borderaxespad=0.0, frameon=False)
        ax.grid(axis="x", linewidth=0.3)
