"""Per-tensor distributions in the notation of Dryden et al. (SC'19, §2.3).

A :class:`Dist` gives, for each tensor dim, where its index space lives on the processor grid:

* ``None`` -- replicated, written ``*``;
* a grid dim name -- block-distributed over it, written ``o_C``; a sample or spatial dim (N, D, H,
  W) distributed over the grid dim of its own name is written plain ``o``, as in ``x[o,o_C,o,o]``;
* a tuple of grid dim names, **major first** -- blocked over their nested linearisation, written
  ``o_{F×C}``: the dim is split into blocks over F, and each F block into sub-blocks over C.

plus the set of grid dims over which the local values are **pending sums** (partial values whose
sum over that grid dim is the tensor), written ``Σ_C y[o,*,o,o]``. Grid dims used by no entry and
not pending are *redundant*: the tensor is replicated over them.

Blocks are balanced: n items over p parts give part i ``n//p + (i < n%p)`` items starting at
``i*(n//p) + min(i, n%p)``. Nested blocking is block-of-block, so dropping the minor grid dim of an
entry is exactly a segmented allgather over that dim. Parts may be empty (p > n).

A Dist is a frozen value: hashable, cheap to compare, with no communication inside it. The
``tensor_dims`` names only decide how ``o`` is printed; they take no part in equality.
"""
from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from distconv.grid import ProcessorGrid

Entry = Union[None, str, tuple[str, ...]]

__all__ = ["Dist", "Entry", "as_shape", "as_size", "balanced_block", "nested_block"]

#: Tensor dims whose own-named grid dim prints as plain ``o`` (sample and spatial dims); the paper
#: writes channel and filter subscripts explicitly (``y[o,o_C,o,o]``, ``w[o_F,*]``).
_IMPLICIT = frozenset("NDHW")

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SEPARATORS = re.compile(r"\s*(?:×|,|\*|\bx\b)\s*")


def as_size(value: Any, name: str) -> int:
    """``value`` as a non-negative int (a Python or numpy/torch integer; never a bool or float).

    Raises ``TypeError`` for a non-integer and ``ValueError`` for a negative value, naming
    ``name`` and the value received.
    """
    if type(value) is int and value >= 0:
        return value
    if isinstance(value, bool) or isinstance(value, float):
        raise TypeError(f"{name} must be a non-negative int, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be a non-negative int, got {value!r} ({type(value).__name__})"
        ) from None
    if n < 0:
        raise ValueError(f"{name} must be a non-negative int, got {n}")
    return n


def as_shape(shape: Any, name: str) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints (a sequence of them or a ``torch.Size``).

    Raises ``TypeError`` for something that is not a sequence of integers and ``ValueError`` for
    a negative size, naming ``name`` and the shape received.
    """
    if type(shape) is tuple and all(type(n) is int and n >= 0 for n in shape):
        return shape  # (the common case, checked at C speed)
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(
            f"{name} must be a shape (a sequence of non-negative ints), got {shape!r}"
        )
    out = []
    for i, n in enumerate(shape):
        if isinstance(n, bool) or isinstance(n, float) or not hasattr(n, "__index__"):
            raise TypeError(f"{name} must contain ints, got {tuple(shape)!r} (entry {i} is {n!r})")
        if operator.index(n) < 0:
            raise ValueError(
                f"{name} must contain non-negative sizes, got {tuple(shape)!r} (entry {i} is {n})"
            )
        out.append(operator.index(n))
    return tuple(out)


def balanced_block(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, size)`` of block ``index`` when ``n`` items are split into ``parts`` balanced blocks."""
    n = as_size(n, "balanced_block: n")
    parts, index = as_size(parts, "balanced_block: parts"), as_size(index, "balanced_block: index")
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"balanced_block: need 0 <= index < parts, got index={index}, parts={parts}")
    q, r = divmod(n, parts)
    return index * q + min(index, r), q + (index < r)


def nested_block(n: int, extents: Sequence[int], coords: Sequence[int]) -> tuple[int, int]:
    """``(start, size)`` of the block-of-block at ``coords`` (major first) of ``n`` items.

    ``extents`` and ``coords`` have one entry per nesting level (equal lengths).
    """
    extents = as_shape(extents, "nested_block: extents")
    coords = as_shape(coords, "nested_block: coords")
    if len(extents) != len(coords):
        raise ValueError(
            f"nested_block: extents {extents} and coords {coords} must have equal lengths "
            "(one coordinate per nesting level)"
        )
    start, size = 0, as_size(n, "nested_block: n")
    for parts, index in zip(extents, coords):
        offset, size = balanced_block(size, parts, index)
        start += offset
    return start, size


def _as_entry(value: object, position: int) -> Entry:
    if value is None:
        return None
    if isinstance(value, str):
        names: tuple[str, ...] = (value,)
    elif isinstance(value, (tuple, list)):
        names = tuple(value)
    else:
        raise TypeError(
            f"Dist entry {position} must be None, a grid dim name or a tuple of names, got {value!r}"
        )
    for name in names:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"Dist entry {position}: {name!r} is not a valid grid dim name")
    if not names:
        return None
    return names[0] if len(names) == 1 else names


def _names(entry: Entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else entry


@dataclass(frozen=True)
class Dist:
    """Placement of a tensor on a processor grid, in the paper's notation.

    Args:
        entries: one entry per tensor dim: ``None`` (replicated), a grid dim name, or a tuple of
            grid dim names (major first).
        pending: grid dims over which local values are partial sums. Default: none.
        tensor_dims: names of the tensor dims (``"NCHW"`` or a sequence such as
            ``("F", "C", "kh", "kw")``), used to print ``o`` for a dim distributed over the grid dim
            of the same name. Default: none (every distributed entry prints as ``o_X``).

    Raises:
        ValueError: a grid dim used twice (across entries and pending), a bad name, or
            ``tensor_dims`` of the wrong length.
    """

    entries: tuple[Entry, ...]
    pending: frozenset[str] = frozenset()
    tensor_dims: tuple[str, ...] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.entries, (tuple, list)):
            raise TypeError(
                f"Dist: entries must be a tuple with one entry per tensor dim (None, a grid dim "
                f"name or a tuple of names), got {self.entries!r}; to read the paper's notation "
                "use Dist.parse"
            )
        entries = tuple(_as_entry(e, i) for i, e in enumerate(self.entries))
        object.__setattr__(self, "entries", entries)
        if isinstance(self.pending, str) or not isinstance(self.pending, Iterable):
            raise TypeError(
                f"Dist: pending must be a set of grid dim names, got {self.pending!r}"
            )
        pending = frozenset(_as_entry(p, -1) for p in self.pending)  # type: ignore[misc]
        if None in pending or any(not isinstance(p, str) for p in pending):
            raise ValueError(f"Dist: pending must hold single grid dim names, got {self.pending!r}")
        object.__setattr__(self, "pending", pending)
        if self.tensor_dims is not None:
            dims = _tensor_dims(self.tensor_dims, "Dist: tensor_dims")
            if len(dims) != len(entries):
                raise ValueError(
                    f"Dist entries {entries!r}: tensor_dims {dims!r} has {len(dims)} names for "
                    f"{len(entries)} entries"
                )
            object.__setattr__(self, "tensor_dims", dims)
        seen: set[str] = set()
        for name in [n for e in entries for n in _names(e)] + sorted(pending):
            if name in seen:
                raise ValueError(
                    f"Dist {self}: grid dim {name!r} is used twice; a grid dim may distribute at "
                    "most one tensor dim and cannot also hold a pending sum"
                )
            seen.add(name)

    # ----------------------------------------------------------------- construction
    @classmethod
    def replicated(cls, ndim: int, *, tensor_dims: Sequence[str] | None = None) -> Dist:
        """``[*,*,...]``: every rank holds the whole tensor."""
        return cls((None,) * ndim, tensor_dims=tuple(tensor_dims) if tensor_dims else None)

    @classmethod
    def parse(cls, spec: str, tensor_dims: str | Sequence[str] | None = None) -> Dist:
        """Parse the paper's notation, e.g. ``"x[o,o_{F×C},o,o]"`` or ``"Σ_C y[o,*,o,o]"``.

        Accepted: an optional pending prefix ``Σ_C`` / ``Σ_{C,F}`` / ``sum_{C}``, an optional
        tensor name, then ``[...]`` with one entry per tensor dim: ``*``, ``o`` (the grid dim named
        like the tensor dim; needs ``tensor_dims``), ``o_C``, ``o_{F×C}``, ``o_{F,C}``, ``o_(F,C)``.
        """
        if not isinstance(spec, str):
            raise TypeError(
                f"Dist.parse: spec must be a str in the paper's notation (e.g. 'x[o,o_C,o,o]'), "
                f"got {spec!r} ({type(spec).__name__})"
            )
        dims = None if tensor_dims is None else _tensor_dims(tensor_dims, "Dist.parse: tensor_dims")
        m = re.fullmatch(
            r"\s*(?:(?:Σ|sum)_(\{[^}]*\}|\([^)]*\)|\w)\s*)?([A-Za-z_]\w*)?\s*\[(.*)\]\s*", spec
        )
        if m is None:
            raise ValueError(
                f"Dist.parse: cannot read {spec!r}; expected e.g. 'x[o,o_C,o,o]' or 'Σ_C y[o,*,o,o]'"
            )
        pending = _split_names(m.group(1), spec) if m.group(1) else ()
        items = _split_top_level(m.group(3), spec)
        if dims is not None and len(items) != len(dims):
            raise ValueError(
                f"Dist.parse: {spec!r} has {len(items)} entries but tensor_dims "
                f"{''.join(dims) if all(len(d) == 1 for d in dims) else dims!r} has {len(dims)}"
            )
        entries: list[Entry] = []
        for i, item in enumerate(items):
            entries.append(_parse_entry(item, i, dims, spec))
        return cls(tuple(entries), frozenset(pending), dims)

    # ----------------------------------------------------------------- notation
    def format(self, name: str = "") -> str:
        """The paper's notation, e.g. ``format("x") == "x[o,o_C,o,o]"``."""
        parts = []
        for i, entry in enumerate(self.entries):
            if entry is None:
                parts.append("*")
            elif isinstance(entry, str):
                own = (
                    self.tensor_dims is not None and self.tensor_dims[i] == entry
                    and entry in _IMPLICIT
                )
                parts.append("o" if own else f"o_{_sub(entry)}")
            else:
                parts.append("o_{" + "×".join(entry) + "}")
        text = f"{name}[{','.join(parts)}]"
        if self.pending:
            names = sorted(self.pending)
            prefix = f"Σ_{names[0]}" if len(names) == 1 and len(names[0]) == 1 else (
                "Σ_{" + ",".join(names) + "}"
            )
            text = f"{prefix} {text}"
        return text

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        return f"Dist({self.format()!r})"

    # ----------------------------------------------------------------- structure
    @property
    def ndim(self) -> int:
        return len(self.entries)

    def grid_dims_of(self, dim: int) -> tuple[str, ...]:
        """The grid dims (major first) that tensor dim ``dim`` is blocked over."""
        return _names(self.entries[dim])

    def used(self) -> frozenset[str]:
        """Grid dims that distribute some tensor dim."""
        return frozenset(n for e in self.entries for n in _names(e))

    def redundant(self, grid: ProcessorGrid) -> tuple[str, ...]:
        """Grid dims (in grid order) the tensor is replicated over."""
        taken = self.used() | self.pending
        return tuple(n for n in grid.names if n not in taken)

    def dual(self, grid: ProcessorGrid) -> Dist:
        """The distribution of this tensor's cotangent: pending and redundant dims swapped.

        A replicated tensor's gradient is the sum of every rank's contribution (a pending sum over
        the dims it is replicated on), and a pending sum's gradient is replicated.
        """
        self.validate(grid)
        return Dist(self.entries, frozenset(self.redundant(grid)), self.tensor_dims)

    def with_pending(self, pending: Iterable[str]) -> Dist:
        return Dist(self.entries, frozenset(pending), self.tensor_dims)

    def validate(self, grid: ProcessorGrid, ndim: int | None = None) -> None:
        """Raise ``ValueError`` if this Dist names a grid dim ``grid`` lacks or has the wrong rank."""
        if ndim is not None and ndim != self.ndim:
            raise ValueError(f"Dist {self} has {self.ndim} entries for a {ndim}-dim tensor")
        for name in sorted(self.used() | self.pending):
            grid.extent(name)  # raises for unknown names

    # ----------------------------------------------------------------- block math
    def block(
        self, dim: int, n: int, grid: ProcessorGrid, coords: Mapping[str, int] | None = None
    ) -> tuple[int, int]:
        """``(start, size)`` of this rank's block of tensor dim ``dim`` of global size ``n``."""
        coords = grid.coords if coords is None else coords
        n = as_size(n, f"global size of tensor dim {dim}")
        names = self.grid_dims_of(dim)
        return nested_block(n, [grid.extent(g) for g in names], [coords.get(g, 0) for g in names])

    def blocks(
        self, global_shape: Sequence[int], grid: ProcessorGrid,
        coords: Mapping[str, int] | None = None,
    ) -> Iterator[tuple[int, int]]:
        global_shape = as_shape(global_shape, "global_shape")
        if not hasattr(grid, "extent"):
            raise TypeError(
                f"grid must be a distconv.ProcessorGrid, got {grid!r} ({type(grid).__name__})"
            )
        if len(global_shape) != self.ndim:
            raise ValueError(
                f"Dist {self} has {self.ndim} entries for global shape {tuple(global_shape)}"
            )
        for d, n in enumerate(global_shape):
            yield self.block(d, n, grid, coords)

    def local_shape(
        self, global_shape: Sequence[int], grid: ProcessorGrid,
        coords: Mapping[str, int] | None = None,
    ) -> tuple[int, ...]:
        """Shape of the local block of a tensor of ``global_shape`` on the rank at ``coords``."""
        return tuple(size for _, size in self.blocks(global_shape, grid, coords))

    def local_slices(
        self, global_shape: Sequence[int], grid: ProcessorGrid,
        coords: Mapping[str, int] | None = None,
    ) -> tuple[slice, ...]:
        """Index of the local block in the global tensor."""
        return tuple(slice(s, s + n) for s, n in self.blocks(global_shape, grid, coords))


def _tensor_dims(dims: object, name: str) -> tuple[str, ...]:
    if isinstance(dims, str):
        return tuple(dims)
    if not isinstance(dims, Sequence) or not all(isinstance(d, str) and d for d in dims):
        raise TypeError(
            f"{name} must be a str (one letter per dim, e.g. 'NCHW') or a sequence of dim names, "
            f"got {dims!r}"
        )
    return tuple(dims)


def _sub(name: str) -> str:
    return name if len(name) == 1 else "{" + name + "}"


def _split_top_level(body: str, spec: str) -> list[str]:
    """The entries of ``[...]``, split at the commas outside braces; an unclosed or unopened
    brace is named here (it would otherwise read as a wrong number of entries)."""
    items, opened, current = [], [], []
    for ch in body:
        if ch in "{(":
            opened.append(ch)
        elif ch in "})":
            if not opened or opened.pop() != {"}": "{", ")": "("}[ch]:
                raise ValueError(f"Dist.parse: {spec!r} closes a {ch!r} that was not opened; "
                                 "a grid dim list is written o_{F×C}, o_{F,C} or o_(F,C)")
        if ch == "," and not opened:
            items.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    if opened:
        close = "}" if opened[-1] == "{" else ")"
        raise ValueError(f"Dist.parse: {spec!r} opens a {opened[-1]!r} that is never closed "
                         f"(a missing {close!r}); a grid dim list is written o_{{F×C}}, "
                         "o_{F,C} or o_(F,C)")
    items.append("".join(current).strip())
    return items if body.strip() else []


def _split_names(group: str, spec: str) -> tuple[str, ...]:
    inner = group[1:-1] if group[0] in "{(" else group
    names = tuple(n for n in _SEPARATORS.split(inner.strip()) if n)
    if not names:
        raise ValueError(f"Dist.parse: empty grid dim list in {spec!r}")
    for name in names:
        if not _NAME.match(name):
            raise ValueError(f"Dist.parse: {name!r} in {spec!r} is not a grid dim name")
    return names


def _parse_entry(item: str, i: int, dims: tuple[str, ...] | None, spec: str) -> Entry:
    if item == "*":
        return None
    if item == "o":
        if dims is None:
            raise ValueError(
                f"Dist.parse: entry {i} of {spec!r} is a plain 'o', which names the grid dim after "
                "the tensor dim: pass tensor_dims (e.g. 'NCHW')"
            )
        return dims[i]
    m = re.fullmatch(r"o_(\{[^}]*\}|\([^)]*\)|\w)", item)
    if m is None:
        raise ValueError(
            f"Dist.parse: entry {i} of {spec!r} is {item!r}; expected '*', 'o', 'o_C' or 'o_{{F×C}}'"
        )
    names = _split_names(m.group(1), spec)
    return names[0] if len(names) == 1 else names
