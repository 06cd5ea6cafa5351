"""Declarative per-layer parallelism: the config ``parallelize`` reads, validated up front.

A config is a dict (or a YAML file holding one)::

    default:                      # every Conv2d / Linear no entry matches
      grid: {N: 4}
      algorithm: sample
    data: {N: 4}                  # optional: the grid of the model's input and output samples
    layers:                       # checked in order; the first entry whose pattern matches wins
      - match: "layer1.*"         # fnmatch on qualified module names; a module registered
                                  # under several paths matches by any (AliasedConfig)
        grid: {N: 2, H: 2}
        algorithm: spatial
      - match: "layer3.*.conv2"
        grid: {N: 2, C: 2}
        algorithm: stationary-x

Activation checkpointing is chosen per entry with ``checkpoint: true``: the modules the entry
matches, and everything inside them, keep no activations for backward but their inputs and run
their forward again in backward (collectives included); consecutive such nodes form one segment.
An entry may carry only ``match`` and ``checkpoint`` (e.g. ``{match: "layer2", checkpoint:
true}``).

BatchNorm statistics are chosen per entry with ``statistics``: ``global`` (default: the
statistics of the whole global batch, one process's semantics), ``local`` (each sample block's
own statistics, reduced only over the ranks that split its rows and columns: DDP's plain-BN
semantics), or an int ``k``: each group of k consecutive sample blocks normalises by the
statistics of its samples (LBANN's statistics groups; the running statistics are the first
group's, as with ``local``; ``1`` is ``local``, the number of sample blocks ``global``, and k
must divide it). An entry may carry only ``match`` and ``statistics`` (e.g. ``{match: "*.bn*",
statistics: local}``); it then applies to the BatchNorm layers it matches.

A stationary-x, -y or -w entry may ask for ``pipeline: k``: the local convolution runs on k
chunks of each rank's samples, each chunk's collectives overlapping the next chunk's compute
(:mod:`distconv.nn.pipeline`; the same bytes and results). Default 1.

An entry whose convolutions split one spatial dim may ask for ``overlap: true``: the halo
exchange runs while the interior rows are convolved, the border rows after it (in backward the
border rows' gradients first, the interior's while their halo part travels back;
:func:`distconv.nn.halo_conv.halo_conv`; the same bytes). A layer entry's ``overlap`` must apply
to every convolution it matches (one split spatial dim with a halo, zero padding, a direct
convolution): others are refused, naming the layer. The default entry's applies to the
convolutions it can. Default false.

Grids name dims among N (samples), C (channels), F (filters), D, H and W (depth, rows, columns:
a volume's spatial dims are D, H, W, an image's H, W, a signal's W); their extents multiply to the
world size. Algorithms: ``sample`` (grid ``{N: P}``), ``spatial`` (dims among N, D, H, W),
``stationary-x`` (C > 1, F = 1), ``stationary-y`` (F > 1, C = 1), ``stationary-w`` (C and F; each
with the spatial dims too) and ``auto`` (every ``auto`` convolution chosen at once by the
planner's whole-network search, :mod:`distconv.parallel.auto`; needs the input shape). Only
convolutions and ``Linear`` modules take entries (``Conv1d``, ``Conv3d`` and the transposed
convolutions take every algorithm; a stationary default leaves them sample-parallel); batch norm,
pooling and pointwise layers follow their input.
``Linear`` layers run sample-parallel. ``data`` defaults to ``{N: P}``: each rank its own samples.
"""

from __future__ import annotations

import fnmatch
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from distconv.nn._statistics import STATISTICS, check_statistics

__all__ = ["ALGORITHMS", "GRID_DIMS", "STATISTICS", "AliasedConfig", "ConfigSource",
           "LayerChoice", "ParallelConfig", "load_config"]

#: what a config is given as: a mapping, or the path of a YAML (or JSON) file holding one
ConfigSource = Mapping[str, Any] | str | os.PathLike[str]

GRID_DIMS = ("N", "C", "F", "D", "H", "W")
ALGORITHMS = ("sample", "spatial", "stationary-x", "stationary-y", "stationary-w", "auto")
_KEYS = frozenset({"default", "data", "layers"})
_ENTRY_KEYS = frozenset({"match", "grid", "algorithm", "statistics", "checkpoint", "pipeline",
                         "overlap"})

Layout = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class LayerChoice:
    """The grid layout and algorithm one module runs with, and the config entry that chose it."""

    layout: Layout | None  # None: algorithm 'auto' with no grid given (every layout is a candidate)
    algorithm: str
    source: str
    statistics: str | int | None = None  # BatchNorm statistics asked for (None: not given)
    checkpoint: bool | None = None  # activation checkpointing the entry asks for (None: not given)
    pipeline: int = 1  # chunks of samples a stationary-x/-y/-w layer is pipelined over
    #: halo exchange overlapped with the interior rows: "" (no), "required" (a layer entry:
    #: every convolution it matches must be able to), "where possible" (the default entry)
    overlap: str = ""

    @property
    def grid(self) -> dict[str, int] | None:
        return None if self.layout is None else dict(self.layout)


def load_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """The config as a dict: a mapping as it is, or a path to a YAML (or JSON) file.

    Raises:
        ValueError: a path that is not a file, a file that is not valid YAML (naming the file,
            line and column) or that does not hold a mapping.
        TypeError: anything else than a mapping or a path.
    """
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise ValueError(f"config: {path!r} is neither a dict nor an existing YAML file")
        try:
            import yaml
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "reading a YAML config needs pyyaml: pip install 'distconv[yaml]'"
            ) from exc
        with open(path, encoding="utf-8") as f:
            try:
                data = yaml.safe_load(f)
            except yaml.YAMLError as exc:
                raise ValueError(_yaml_error(path, exc)) from None
        if not isinstance(data, Mapping):
            raise ValueError(f"config file {path!r} must hold a mapping, got {type(data).__name__}")
        return dict(data)
    raise TypeError(
        f"config must be a dict or a path to a YAML file, got {type(config).__name__}"
    )


def _yaml_error(path: str, exc: Exception) -> str:
    """``config file 'x.yaml', line 3, column 5: <what the parser says>`` (lines from 1)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    detail = f"{problem} ({context})" if context else problem
    return f"config file {path!r}{where}: not valid YAML: {detail}"


def _layout(grid: Any, where: str, world_size: int) -> Layout:
    if not isinstance(grid, Mapping) or not grid:
        raise ValueError(f"{where}: grid must be a non-empty mapping such as {{N: 2, C: 2}}, "
                         f"got {grid!r}")
    pairs = []
    for name, extent in grid.items():
        if name not in GRID_DIMS:
            raise ValueError(f"{where}: grid dim {name!r} is not one of {GRID_DIMS}")
        if isinstance(extent, bool) or not isinstance(extent, int) or extent < 1:
            raise ValueError(f"{where}: extent of grid dim {name!r} must be an int >= 1, "
                             f"got {extent!r}")
        pairs.append((str(name), int(extent)))
    size = math.prod(e for _, e in pairs)
    if size != world_size:
        raise ValueError(
            f"{where}: grid {dict(pairs)} has {size} positions but the world has {world_size} "
            f"ranks (world_size={world_size}); the extents must multiply to the world size"
        )
    return tuple(pairs)


def _check_algorithm(layout: Layout, algorithm: Any, where: str) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{where}: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    ext = {n: e for n, e in layout}
    live = {n for n, e in layout if e > 1}
    c, f = ext.get("C", 1), ext.get("F", 1)
    problem = None
    if algorithm == "sample" and live - {"N"}:
        problem = (f"algorithm 'sample' splits only samples, but the grid splits "
                   f"{sorted(live - {'N'})}; use {{N: {math.prod(ext.values())}}}, or 'spatial' "
                   "for N, H, W grids, or a stationary-* algorithm for C and F")
    elif algorithm == "spatial" and live - {"N", "D", "H", "W"}:
        problem = (f"algorithm 'spatial' splits N, D, H and W only, but the grid splits "
                   f"{sorted(live - {'N', 'D', 'H', 'W'})}; use stationary-x (C), stationary-y (F) or "
                   "stationary-w (C and F)")
    elif algorithm == "stationary-x" and f > 1:
        problem = "stationary-x splits channels only (F must be 1); use stationary-w for C and F"
    elif algorithm == "stationary-y" and c > 1:
        problem = "stationary-y splits filters only (C must be 1); use stationary-w for C and F"
    if problem:
        raise ValueError(f"{where}: {problem}")
    return str(algorithm)


class ParallelConfig:
    """A validated config for a world of ``world_size`` ranks (see the module docstring).

    Args:
        config: a dict or a path to a YAML file.
        world_size: number of ranks every grid must cover.

    Raises:
        ValueError: unknown keys, a grid whose extents do not multiply to ``world_size``, an
            unknown grid dim or algorithm, an algorithm the grid cannot run; each message names
            the entry (``default``, ``data`` or ``layers[i]``).
    """

    def __init__(self, config: Mapping[str, Any] | str | os.PathLike[str], *, world_size: int):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        raw = load_config(config)
        unknown = set(raw) - _KEYS
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)}; allowed: {sorted(_KEYS)}")
        self.world_size = world_size
        default = raw.get("default", {"grid": {"N": world_size}, "algorithm": "sample"})
        self.default = self._entry(default, "default", needs_match=False)
        self.data: Layout = _layout(raw.get("data", {"N": world_size}), "data", world_size)
        layers = raw.get("layers", [])
        if not isinstance(layers, Sequence) or isinstance(layers, (str, bytes)):
            raise ValueError(f"config: layers must be a list of entries, got {layers!r}")
        self.layers = [self._entry(e, f"layers[{i}]", needs_match=True)
                       for i, e in enumerate(layers)]
        self._raw = raw

    def _entry(self, entry: Any, where: str, *, needs_match: bool) -> tuple[str, LayerChoice]:
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: an entry must be a mapping, got {entry!r}")
        allowed = _ENTRY_KEYS if needs_match else _ENTRY_KEYS - {"match"}
        unknown = set(entry) - allowed
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        pattern = entry.get("match", "*")
        if needs_match and (not isinstance(pattern, str) or not pattern):
            raise ValueError(f"{where}: match must be a non-empty fnmatch pattern, got {pattern!r}")
        statistics = entry.get("statistics")
        if statistics is not None:
            check_statistics(statistics, f"{where}: statistics")
        checkpoint = entry.get("checkpoint")
        if checkpoint is not None and not isinstance(checkpoint, bool):
            raise ValueError(f"{where}: checkpoint must be true or false, got {checkpoint!r}")
        source = f"{where} ({pattern!r})" if needs_match else where
        if needs_match and set(entry) - {"match"} and not set(entry) - {
                "match", "statistics", "checkpoint"}:
            # BatchNorm statistics and/or activation checkpointing only: no layout of its own
            return pattern, LayerChoice(None, "", source, statistics, checkpoint)
        algorithm = entry.get("algorithm", "sample")
        overlap = entry.get("overlap", False)
        if not isinstance(overlap, bool):
            raise ValueError(f"{where}: overlap must be true or false, got {overlap!r}")
        if "grid" not in entry:
            if "pipeline" in entry:
                raise ValueError(f"{where}: pipeline needs a grid and a stationary-x, -y or -w "
                                 "algorithm")
            if overlap:
                raise ValueError(f"{where}: overlap needs a grid that splits a spatial dim "
                                 "(D, H or W)")
            if algorithm != "auto":
                raise ValueError(f"{where}: grid is required (e.g. {{N: 2, C: 2}}) unless the "
                                 "algorithm is 'auto'")
            return pattern, LayerChoice(None, "auto", source, statistics, checkpoint)
        layout = _layout(entry["grid"], where, self.world_size)
        algorithm = _check_algorithm(layout, algorithm, where)
        pipeline = entry.get("pipeline", 1)
        if isinstance(pipeline, bool) or not isinstance(pipeline, int) or pipeline < 1:
            raise ValueError(f"{where}: pipeline must be a positive int (chunks of samples; 1: "
                             f"not pipelined), got {pipeline!r}")
        if pipeline > 1 and not algorithm.startswith("stationary-"):
            raise ValueError(
                f"{where}: pipeline overlaps the collectives of stationary-x, -y and -w with "
                f"their local convolution; algorithm {algorithm!r} has none to overlap (use "
                f"one of those, or leave pipeline out)")
        if overlap and not any(d in ("D", "H", "W") and e > 1 for d, e in layout):
            raise ValueError(f"{where}: overlap overlaps a halo exchange with the interior rows; "
                             f"the grid {dict(layout)} splits no spatial dim (D, H or W) to "
                             "exchange halos over")
        mode = "" if not overlap else ("required" if needs_match else "where possible")
        return pattern, LayerChoice(layout, algorithm, source, statistics, checkpoint, pipeline,
                                    mode)

    def choice(self, name: str) -> LayerChoice:
        """The entry for the module named ``name``: the first matching layer entry, else the
        default."""
        for pattern, choice in self.layers:
            if choice.algorithm and fnmatch.fnmatchcase(name, pattern):
                return choice
        return self.default[1]

    def statistics(self, name: str) -> str | int:
        """The BatchNorm statistics for the module named ``name``: those of the first matching
        entry that states them, else the default's, else ``'global'``."""
        return self.statistics_entry(name)[0]

    def statistics_entry(self, name: str) -> tuple[str | int, str]:
        """:meth:`statistics` and the entry that states it (``default`` where none does)."""
        for pattern, choice in self.layers:
            if choice.statistics is not None and fnmatch.fnmatchcase(name, pattern):
                return choice.statistics, choice.source
        return self.default[1].statistics or "global", "default"

    def checkpointed(self, path: str) -> bool:
        """Whether the module at ``path`` (a qualified name; "" for the model itself) runs under
        activation checkpointing: the first entry that states ``checkpoint`` and matches the
        module or one of its parents decides, else the default's, else False."""
        return self.checkpoint_entry(path)[0]

    def checkpoint_entry(self, path: str) -> tuple[bool, str]:
        """:meth:`checkpointed` and the entry that decides it (``default`` where none does)."""
        parts = path.split(".") if path else []
        scopes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        for pattern, choice in self.layers:
            if choice.checkpoint is not None and any(
                    fnmatch.fnmatchcase(s, pattern) for s in scopes):
                return choice.checkpoint, choice.source
        return bool(self.default[1].checkpoint), "default"

    def check_matches(self, names: Sequence[str], norms: Sequence[str] = (),
                      modules: Sequence[str] = ()) -> None:
        """Raise if a layer entry's pattern matches none of ``names`` (the configurable modules;
        a statistics-only entry: none of ``norms``, the BatchNorm modules; a checkpoint-only
        entry: none of ``modules``, every module)."""
        for i, (pattern, choice) in enumerate(self.layers):
            if not choice.algorithm and choice.statistics is None:
                if not any(fnmatch.fnmatchcase(n, pattern) for n in modules):
                    raise ValueError(f"{choice.source}: the pattern matches no module of the "
                                     "model (a checkpoint entry applies to the modules it "
                                     "matches and everything inside them)")
                continue
            if not choice.algorithm:
                if not any(fnmatch.fnmatchcase(n, pattern) for n in norms):
                    raise ValueError(f"{choice.source}: the pattern matches no BatchNorm module "
                                     "of the model (an entry with only statistics applies to "
                                     "BatchNorm layers)")
                continue
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
                raise ValueError(
                    f"{choice.source}: the pattern matches no Conv2d or Linear module of the "
                    f"model; configurable modules are: {shown}"
                )

    def has_local_statistics(self) -> bool:
        return any(c.statistics == "local" for _, c in [self.default, *self.layers])

    def has_auto(self) -> bool:
        return any(c.algorithm == "auto" for _, c in [self.default, *self.layers])

    def to_dict(self) -> dict[str, Any]:
        return dict(self._raw)

    def __repr__(self) -> str:
        entries = "; ".join(f"{p!r}: {c.grid or 'any grid'} {c.algorithm}"
                            for p, c in self.layers)
        return (f"ParallelConfig(world_size={self.world_size}, default={self.default[1].grid} "
                f"{self.default[1].algorithm}, data={dict(self.data)}, layers=[{entries}])")


class AliasedConfig:
    """``config`` read on a model that registers some modules under several paths
    (``self.skips = nn.ModuleList([self.enc[1]])``, MONAI DynUNet's ``skip_layers``).

    ``paths``: each such module's first path to all its paths, first first, as torch's
    ``named_modules(remove_duplicate=False)`` lists them. An entry matches a module when its
    pattern matches any of the module's paths: each path takes its first matching entry, as in a
    model without aliases, and the module takes the entry its paths take (an entry over the
    default). Entries that reach one module by different paths and set it differently are
    refused, naming both. The module keeps its first path as its name (``explain``'s rows, the
    parameters' names). Everything else is ``config``'s.
    """

    def __init__(self, config: Any, paths: Mapping[str, Sequence[str]]) -> None:
        self.config = config
        self.paths = {first: tuple(every) for first, every in paths.items()}

    def choice(self, name: str) -> LayerChoice:
        found = [(p, self.config.choice(p)) for p in self.paths.get(name, (name,))]
        taken = [(p, c) for p, c in found if c.source != "default"]
        if not taken:
            return found[0][1]
        path, chosen = taken[0]
        for other, c in taken[1:]:
            if not _agree(chosen, c):
                self._refuse(name, (path, chosen.source, _show(chosen)),
                             (other, c.source, _show(c)))
            if chosen.algorithm == "auto":
                path, chosen = other, c  # the resolved choice, where one is
        if chosen.algorithm == "auto" and path != name and found[0][1].source == "default":
            raise ValueError(
                f"{chosen.source} reaches {name!r} only by its path {path!r}: algorithm 'auto' "
                f"plans a module under its first path; match {name!r} as well")
        return chosen

    def statistics(self, name: str) -> str | int:
        return self._agreed(name, self.config.statistics_entry, "statistics")

    def checkpointed(self, path: str) -> bool:
        return bool(self._agreed(path, self.config.checkpoint_entry, "checkpoint"))

    def _agreed(self, name: str, entry: Any, key: str) -> Any:
        """The value of ``key`` the entries reaching ``name`` by any of its paths agree on."""
        found = [(p, *entry(p)) for p in self.paths.get(name, (name,))]
        taken = [f for f in found if f[2] != "default"] or found[:1]
        for other in taken[1:]:
            if other[1] != taken[0][1]:
                self._refuse(name, (taken[0][0], taken[0][2], f"{key}: {taken[0][1]}"),
                             (other[0], other[2], f"{key}: {other[1]}"))
        return taken[0][1]

    def _refuse(self, name: str, a: tuple[str, str, str], b: tuple[str, str, str]) -> None:
        hint = (f"; an 'auto' config plans a module under its first path: give {name!r} its "
                "entry by that path" if self.config.has_auto() else "")
        raise ValueError(
            f"{a[1]} matches {name!r} as {a[0]!r} ({a[2]}) and {b[1]} matches it as {b[0]!r} "
            f"({b[2]}): one module registered under several paths runs one way; make the "
            f"entries agree or match one path only{hint}")

    def check_matches(self, names: Sequence[str], norms: Sequence[str] = (),
                      modules: Sequence[str] = ()) -> None:
        """:meth:`ParallelConfig.check_matches` on every path of the modules (a checkpoint
        entry: and the containers holding them), then the refusal of entries that disagree on
        a module of ``names``, ``norms`` or ``modules``."""
        every = [p for n in modules for p in self.paths.get(n, (n,))]
        scopes = list(dict.fromkeys(s for p in every for s in _scopes(p)))
        self.config.check_matches(self._every(names), self._every(norms), scopes)
        for n in names:
            self.choice(n)
        for n in norms:
            self.statistics(n)
        for n in modules:
            self.checkpointed(n)

    def check_planned(self, names: Sequence[str]) -> None:
        """In a config with ``auto`` entries, refuse an entry that sets one of ``names`` (the
        convolutions) only by a path other than its first: the planner reads each module by its
        first path, and would plan it otherwise."""
        if not self.config.has_auto():
            return
        for name in names:
            if name in self.paths and self.choice(name).source != self.config.choice(name).source:
                raise ValueError(
                    f"{self.choice(name).source} sets {name!r} by its other path (of "
                    f"{list(self.paths[name])}) in a config with 'auto' entries: the planner "
                    f"plans each module under its first path; match {name!r} in that entry")

    def _every(self, names: Sequence[str]) -> list[str]:
        return [p for n in names for p in self.paths.get(n, (n,))]

    def __getattr__(self, attr: str) -> Any:
        if attr == "config":  # (not set yet: a copy being made)
            raise AttributeError(attr)
        return getattr(self.config, attr)

    def __repr__(self) -> str:
        return f"AliasedConfig({self.config!r}, paths={self.paths!r})"


def _agree(a: LayerChoice, b: LayerChoice) -> bool:
    """Whether two entries run a module alike: the same layout, algorithm, pipeline and overlap,
    or one of them ``auto`` (the planner's to choose) on the other's grid or any grid."""
    if a.algorithm == "auto" or b.algorithm == "auto":
        auto, other = (a, b) if a.algorithm == "auto" else (b, a)
        return auto.layout is None or auto.layout == other.layout
    return (a.layout, a.algorithm, a.pipeline, a.overlap) == (
        b.layout, b.algorithm, b.pipeline, b.overlap)


def _show(c: LayerChoice) -> str:
    grid = "any grid" if c.layout is None else str(dict(c.layout))
    return f"{c.algorithm} on {grid}" + (f", pipeline {c.pipeline}" if c.pipeline > 1 else "")


def _scopes(path: str) -> list[str]:
    """``a.b.c`` -> ``a``, ``a.b``, ``a.b.c``."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
