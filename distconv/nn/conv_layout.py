"""The layouts of :class:`~distconv.nn.conv.DistConv2d`'s algorithms in the paper's notation.

:func:`conv_dists` is the one rule that places x, w, y and b for stationary-x, -y and -w (and their
grouped forms); the layer, its handler (:mod:`distconv.ops.conv`) and the planner read it.
"""

from __future__ import annotations

from distconv.conv_groups import GroupSpan, group_role, group_span, groups_aligned
from distconv.distribution import Dist, Entry

__all__ = ["ALGORITHMS", "GroupSpan", "UnsupportedConvError", "conv_dists", "group_role",
           "group_span", "groups_aligned"]

ALGORITHMS = ("stationary-x", "stationary-y", "stationary-w")

# Tensor-dim names used only to print distributions the way the paper does (x[o,o_C,o,o]).
_ACT_DIMS = ("N", "channels", "H", "W")
_W_DIMS = ("filters", "channels", "kh", "kw")


class UnsupportedConvError(NotImplementedError, ValueError):
    """A valid ``nn.Conv2d`` configuration that this grid and algorithm do not implement.

    Both a ``NotImplementedError`` (the computation exists, this layer does not provide it on
    this grid) and a ``ValueError`` (it is refused at construction, like any bad argument).
    """



def conv_dists(algorithm: str, roles: dict[str, str | None], grouped: bool = False,
               gather_groups: bool = False) -> dict[str, Dist]:
    """The distributions of a :class:`DistConv2d` in the paper's notation, from its algorithm and
    grid-dim roles (``roles["N"|"C"|"F"|"H"|"W"]``: the grid dim playing that role, or None):
    ``input`` (x), ``work`` (x after forward step 1), ``partial`` (the local convolution's y,
    pending over C), ``output`` (y), ``weight`` and ``bias``. ``grouped``: a grouped convolution
    split over C, F or C×F, its weight's filters and y's channels blocked over them; its
    channel blocks hold whole groups (a local grouped convolution, no communication), or, with
    ``gather_groups``, x is gathered over them first (``x[o,*,o,o]``) and each rank convolves the
    channels of the groups its filters reach into."""
    n, c, f, h, w = (roles[k] for k in ("N", "C", "F", "H", "W"))

    def both(major: str | None, minor: str | None) -> Entry:
        names = tuple(g for g in (major, minor) if g is not None)
        return names if len(names) > 1 else (names[0] if names else None)

    x_in = {"stationary-x": c, "stationary-y": f, "stationary-w": both(c, f)}[algorithm]
    x_work = {"stationary-x": c, "stationary-y": None, "stationary-w": c}[algorithm]
    w_rows = {"stationary-x": None, "stationary-y": f, "stationary-w": f}[algorithm]
    w_cols = {"stationary-x": c, "stationary-y": None, "stationary-w": c}[algorithm]
    y_part = {"stationary-x": None, "stationary-y": f, "stationary-w": f}[algorithm]
    y_out = {"stationary-x": c, "stationary-y": f, "stationary-w": both(f, c)}[algorithm]
    pending = frozenset({c}) if c is not None and algorithm != "stationary-y" else frozenset()
    if grouped:
        role = {"stationary-x": c, "stationary-y": f, "stationary-w": both(c, f)}[algorithm]
        x_in = x_work = y_part = y_out = role
        w_rows, w_cols, pending = role, None, frozenset()
        if gather_groups:
            x_work = None

    def act(entry: Entry, pend: frozenset[str] = frozenset()) -> Dist:
        return Dist((n, entry, h, w), pend, _ACT_DIMS)

    return {"input": act(x_in), "work": act(x_work), "partial": act(y_part, pending),
            "output": act(y_out), "weight": Dist((w_rows, w_cols, None, None), frozenset(), _W_DIMS),
            "bias": Dist((y_out,), frozenset(), ("filters",))}

