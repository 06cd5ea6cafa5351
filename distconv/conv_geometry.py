"""Index math of a convolution split over blocks of its spatial dims (pure, no communication).

A spatial dim of a convolution is described by :class:`ConvDim` (global input length, kernel,
stride, dilation, padding before/after). When the dim is blocked over ``parts`` ranks, every rank
owns a balanced block of the *output* and a balanced block of the *input*; :class:`HaloPlan`
computes, from the output block back, which input rows each rank needs, which of them it owns,
which arrive from which other rank (the halo), and how many zero rows of global padding it adds
before and after. Everything here is a pure function of global sizes, so all ranks derive the same
plan and take the same collective path.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Union

from distconv.distribution import balanced_block

PaddingArg = Union[str, int, tuple[int, ...]]
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")

__all__ = [
    "PADDING_MODES",
    "ConvDim",
    "HaloPlan",
    "TransposedConvDim",
    "block_range",
    "check_padding_mode",
    "conv_dims",
    "normalize_padding",
    "pair",
]


def block_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """Balanced block ``index`` of ``n`` items over ``parts``: ``(start, stop)``.

    Part ``i`` gets ``n // parts + (i < n % parts)`` items starting at
    ``i * (n // parts) + min(i, n % parts)`` (the same blocks as ``distconv.distribution``).
    """
    start, size = balanced_block(n, parts, index)
    return start, start + size


def pair(value: int | tuple[int, ...], name: str) -> tuple[int, int]:
    """``value`` as a pair of non-negative ints; ``name`` is used in the error message."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    if isinstance(value, int):
        return (value, value)
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return (int(value[0]), int(value[1]))
    raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")


def normalize_padding(
    padding: PaddingArg,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Padding as ``((top, bottom), (left, right))``, following ``nn.Conv2d``.

    ``'valid'`` is no padding; ``'same'`` pads ``dilation * (kernel - 1)`` in total with the odd
    row or column at the end (bottom/right), exactly as PyTorch does, and requires stride 1.
    """
    if isinstance(padding, str):
        if padding == "valid":
            return ((0, 0), (0, 0))
        if padding == "same":
            if stride != (1, 1):
                raise ValueError(
                    f"padding='same' is not supported for strided convolutions (stride={stride}); "
                    "use an explicit integer padding"
                )
            out = []
            for k, d in zip(kernel_size, dilation):
                total = d * (k - 1)
                out.append((total // 2, total - total // 2))
            return (out[0], out[1])
        raise ValueError(
            f"padding must be 'same', 'valid', an int or a pair of ints, got {padding!r}"
        )
    ph, pw = pair(padding, "padding")
    if ph < 0 or pw < 0:
        raise ValueError(f"padding must be non-negative, got {padding!r}")
    return ((ph, ph), (pw, pw))


@dataclass(frozen=True)
class ConvDim:
    """One spatial dim of a convolution: global input ``length`` and the conv parameters."""

    length: int
    kernel: int
    stride: int = 1
    dilation: int = 1
    pad_before: int = 0
    pad_after: int = 0

    @property
    def span(self) -> int:
        """Input rows one output row reads: ``dilation * (kernel - 1) + 1``."""
        return self.dilation * (self.kernel - 1) + 1

    @property
    def out_length(self) -> int:
        """``floor((L + p0 + p1 - span) / stride) + 1``, or 0 if the kernel does not fit."""
        padded = self.length + self.pad_before + self.pad_after
        if padded < self.span:
            return 0
        return (padded - self.span) // self.stride + 1

    def input_range(self, out_start: int, out_stop: int) -> tuple[int, int]:
        """Global input rows ``[lo, hi)`` read by output rows ``[out_start, out_stop)``.

        Rows outside ``[0, length)`` are padding.
        """
        if out_stop <= out_start:
            return (0, 0)
        lo = out_start * self.stride - self.pad_before
        hi = (out_stop - 1) * self.stride - self.pad_before + self.span
        return lo, hi


@dataclass(frozen=True)
class TransposedConvDim:
    """One spatial dim of a transposed convolution: global input ``length`` and its parameters.

    Input row ``i`` scatters into output rows ``i·stride - padding + k·dilation`` for
    ``k < kernel``; the output has ``(length - 1)·stride - 2·padding + dilation·(kernel - 1) +
    output_padding + 1`` rows (torch's). An output block is computed from the input rows that
    scatter into it (:meth:`input_range`), on which the local transposed convolution runs
    unpadded; its rows are then cropped (or, where no input row reaches, zero-filled) to the
    block. There is no padding row: a :class:`HaloPlan` of it only exchanges halo.
    """

    length: int
    kernel: int
    stride: int = 1
    dilation: int = 1
    padding: int = 0
    output_padding: int = 0
    pad_before = 0
    pad_after = 0

    @property
    def span(self) -> int:
        """Output rows one input row writes: ``dilation * (kernel - 1) + 1``."""
        return self.dilation * (self.kernel - 1) + 1

    @property
    def out_length(self) -> int:
        n = ((self.length - 1) * self.stride - 2 * self.padding + self.span
             + self.output_padding)
        return max(n, 0)

    def first_output(self, in_start: int) -> int:
        """The global output row of the first row the unpadded local transposed convolution of
        input rows from ``in_start`` writes."""
        return in_start * self.stride - self.padding

    def input_range(self, out_start: int, out_stop: int) -> tuple[int, int]:
        """Input rows ``[lo, hi)`` that scatter into output rows ``[out_start, out_stop)``,
        within ``[0, length)``; at least one row (where none reaches, the nearest, whose
        contribution the crop drops), so that every rank runs the local convolution."""
        if out_stop <= out_start:
            return (0, 0)
        s, L = self.stride, self.length
        lo = max(0, -(-(out_start + self.padding - self.span + 1) // s))
        hi = min(L, (out_stop - 1 + self.padding) // s + 1)
        if hi <= lo:
            lo = min(lo, L - 1)
            hi = lo + 1
        return lo, hi


def conv_dims(
    input_hw: tuple[int, int],
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
    padding: tuple[tuple[int, int], tuple[int, int]],
) -> tuple[ConvDim, ConvDim]:
    """The two :class:`ConvDim` of a 2-d convolution on a global ``(H, W)`` input."""
    return tuple(  # type: ignore[return-value]
        ConvDim(input_hw[i], kernel_size[i], stride[i], dilation[i], padding[i][0], padding[i][1])
        for i in range(2)
    )


@dataclass(frozen=True)
class HaloPlan:
    """How one spatial dim of a convolution is split over ``parts`` ranks.

    Rank ``r`` owns input rows ``owned[r]`` and output rows ``out[r]`` (balanced blocks). It
    computes its output rows from the input rows ``needed[r]`` (clipped to the global input) plus
    ``pad[r]`` rows of global padding before and after. ``transfer(q, r)`` is the part of
    ``needed[r]`` owned by rank ``q``; for ``q != r`` it is halo that travels from ``q`` to ``r``.
    With a padding ``mode`` other than ``'zeros'`` the padding rows copy input rows, possibly of
    other ranks: :attr:`sources` maps every local row to its global row and :meth:`rows_from`
    lists what travels (for ``'zeros'`` it is exactly ``transfer``).
    """

    dim: ConvDim | TransposedConvDim
    parts: int
    mode: str = "zeros"

    def __post_init__(self) -> None:
        if self.parts < 1:
            raise ValueError(f"parts must be >= 1, got {self.parts}")
        if self.mode not in PADDING_MODES:
            raise ValueError(f"mode must be one of {PADDING_MODES}, got {self.mode!r}")

    def check(self, grid_dim: str) -> None:
        """Raise ``ValueError`` (saying what would work) if some rank would own no rows."""
        d, p = self.dim, self.parts
        check_padding_mode(d, self.mode, grid_dim)
        if d.out_length == 0:
            raise ValueError(
                f"the kernel (span {d.span}) does not fit the padded input of length "
                f"{d.length} + {d.pad_before} + {d.pad_after} on spatial dim {grid_dim}"
            )
        limit = min(d.length, d.out_length)
        if p > limit:
            raise ValueError(
                f"grid dim {grid_dim}={p} exceeds what this layer can split: the input has "
                f"{d.length} and the output {d.out_length} rows on that dim (kernel {d.kernel}, "
                f"stride {d.stride}, dilation {d.dilation}, padding ({d.pad_before}, "
                f"{d.pad_after})); every rank needs at least one input and one output row, "
                f"so use {grid_dim} <= {limit}"
            )

    @cached_property
    def owned(self) -> tuple[tuple[int, int], ...]:
        return tuple(block_range(self.dim.length, self.parts, r) for r in range(self.parts))

    @cached_property
    def out(self) -> tuple[tuple[int, int], ...]:
        return tuple(block_range(self.dim.out_length, self.parts, r) for r in range(self.parts))

    @cached_property
    def _reads(self) -> tuple[tuple[int, int], ...]:
        return tuple(self.dim.input_range(*self.out[r]) for r in range(self.parts))

    @cached_property
    def needed(self) -> tuple[tuple[int, int], ...]:
        """Global input rows ``[lo, hi)`` each rank needs, clipped to ``[0, length)``."""
        L = self.dim.length
        return tuple(
            (min(max(lo, 0), L), max(min(hi, L), min(max(lo, 0), L))) for lo, hi in self._reads
        )

    @cached_property
    def pad(self) -> tuple[tuple[int, int], ...]:
        """Zero rows (global padding) each rank adds before and after its needed rows."""
        L = self.dim.length
        out = []
        for lo, hi in self._reads:
            if hi <= lo:
                out.append((0, 0))
            else:
                out.append((max(0, -lo) - max(0, -hi), max(0, hi - L) - max(0, lo - L)))
        return tuple(out)

    def transfer(self, src: int, dst: int) -> tuple[int, int]:
        """Global rows ``[start, stop)`` that rank ``src`` owns and rank ``dst`` needs."""
        o0, o1 = self.owned[src]
        n0, n1 = self.needed[dst]
        start, stop = max(o0, n0), min(o1, n1)
        return (start, stop) if stop > start else (start, start)

    def send_rows(self, src: int, dst: int) -> tuple[int, int]:
        """``transfer(src, dst)`` as ``(offset, count)`` in ``src``'s local rows."""
        start, stop = self.transfer(src, dst)
        return (start - self.owned[src][0], stop - start) if stop > start else (0, 0)

    def recv_rows(self, src: int, dst: int) -> tuple[int, int]:
        """``transfer(src, dst)`` as ``(offset, count)`` in ``dst``'s local padded input."""
        start, stop = self.transfer(src, dst)
        if stop <= start:
            return (0, 0)
        return self.pad[dst][0] + start - self.needed[dst][0], stop - start

    @cached_property
    def local_length(self) -> tuple[int, ...]:
        """Rows of each rank's local (haloed, padded) input."""
        return tuple(
            self.pad[r][0] + self.needed[r][1] - self.needed[r][0] + self.pad[r][1]
            for r in range(self.parts)
        )

    @cached_property
    def sources(self) -> tuple[tuple[int, ...], ...]:
        """For each rank, the global input row behind each row of its local input (-1: zero).

        Rows inside the input are themselves; padding rows are -1 for ``'zeros'`` and the row the
        padding mode copies otherwise (``'reflect'``, ``'replicate'``, ``'circular'``, as
        ``F.pad``).
        """
        return tuple(tuple(self._source(i) for i in range(lo, hi)) for lo, hi in self._reads)

    def _source(self, i: int) -> int:
        L = self.dim.length
        if 0 <= i < L:
            return i
        if self.mode == "zeros":
            return -1
        if self.mode == "circular":
            return i % L
        if self.mode == "replicate":
            return min(max(i, 0), L - 1)
        return -i if i < 0 else 2 * (L - 1) - i  # reflect

    def rows_from(self, src: int, dst: int) -> tuple[int, ...]:
        """Global rows, ascending and distinct, that rank ``src`` owns and rank ``dst`` reads."""
        o0, o1 = self.owned[src]
        return tuple(sorted({g for g in self.sources[dst] if o0 <= g < o1}))

    @cached_property
    def exchanges(self) -> bool:
        """Whether any rank needs a row owned by another rank (else the halo step is local)."""
        return any(
            self.rows_from(q, r) for r in range(self.parts) for q in range(self.parts) if q != r
        )

    @cached_property
    def is_identity(self) -> bool:
        """Whether every rank's local input is exactly its owned block (no halo, pad or trim)."""
        return all(
            self.sources[r] == tuple(range(*self.owned[r])) for r in range(self.parts)
        )

    @cached_property
    def most_sent(self) -> int:
        """The most halo rows any rank sends in the exchange (zero padding)."""
        return max(sum(self.send_rows(p, q)[1] for q in range(self.parts) if q != p)
                   for p in range(self.parts))

    @cached_property
    def most_returned(self) -> int:
        """The most rows' gradients any rank sends back in the halo accumulate (zero padding)."""
        return max(sum(self.recv_rows(q, p)[1] for q in range(self.parts) if q != p)
                   for p in range(self.parts))

    def halo_rows_received(self, rank: int) -> int:
        """Rows ``rank`` receives from other ranks in the forward halo exchange."""
        return sum(len(self.rows_from(q, rank)) for q in range(self.parts) if q != rank)

    def halo_rows_sent(self, rank: int) -> int:
        """Rows ``rank`` sends to other ranks (what it receives back in the adjoint)."""
        return sum(len(self.rows_from(rank, q)) for q in range(self.parts) if q != rank)


def check_padding_mode(dim: ConvDim, mode: str, name: str) -> None:
    """Raise ``ValueError`` when ``mode`` cannot pad ``dim`` (as ``F.pad`` would refuse)."""
    pad = max(dim.pad_before, dim.pad_after)
    if mode == "reflect" and pad >= dim.length:
        raise ValueError(
            f"padding_mode='reflect' needs padding < input size on dim {name}, got padding {pad} "
            f"for {dim.length} rows"
        )
    if mode == "circular" and pad > dim.length:
        raise ValueError(
            f"padding_mode='circular' needs padding <= input size on dim {name}, got padding "
            f"{pad} for {dim.length} rows"
        )
