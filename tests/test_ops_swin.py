"""Swin's pieces, exact against one process in fp64 on thread ranks: the cyclic shift
(``torch.roll``), the window partition and its reverse (the samples merged with the window
counts), the shifted-window mask built from sizes, and the sizes a model reads through numpy and
einops on the captured shape; what cannot be exact refused by name."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from distconv import ops
from distconv.parallel.capture import UntraceableModelError, trace
from distconv.parallel.explain import explain
from distconv.testing import run_threads
from tests.parallel.cases import OPTIONS, check_rows, seeded, square_mean_reference
from tests.test_ops_attention import _placed, _sized_step

WS = 4  # window size


def window_partition(x: torch.Tensor, ws: int) -> torch.Tensor:
    """``[B, H, W, C]`` -> ``[B * windows, ws * ws, C]``, as Swin writes it."""
    B, H, W, C = x.shape
    x = x.view(B, H // ws, ws, W // ws, ws, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, C)


def window_reverse(w: torch.Tensor, ws: int, H: int, W: int) -> torch.Tensor:
    C = w.shape[-1]
    x = w.view(-1, H // ws, W // ws, ws, ws, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, H, W, C)


def shift_mask(h: int, w: int, ws: int, shift: int, device: Any) -> torch.Tensor:
    """Swin's shifted-window mask, built from sizes: ``[windows, ws * ws, ws * ws]``."""
    img = torch.zeros((1, h, w, 1), device=device)
    cnt = 0
    for hs in (slice(-ws), slice(-ws, -shift), slice(-shift, None)):
        for wsl in (slice(-ws), slice(-ws, -shift), slice(-shift, None)):
            img[:, hs, wsl, :] = cnt
            cnt += 1
    m = window_partition(img, ws).squeeze(-1)
    m = m.unsqueeze(1) - m.unsqueeze(2)
    return m.masked_fill(m != 0, -100.0).masked_fill(m == 0, 0.0)


class SwinBlock(nn.Module):
    """A shifted-window attention block on ``[B, C, H, W]`` maps: sizes read through numpy, the
    map rearranged to channels-last by einops, rolled, partitioned into windows, attention with
    a relative-position bias and the shifted-window mask, reversed and rolled back."""

    def __init__(self, dim: int = 4, heads: int = 2, shift: int = 2) -> None:
        super().__init__()
        self.heads, self.shift = heads, shift
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.bias = nn.Parameter(torch.zeros(heads, WS * WS, WS * WS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from einops import rearrange

        b, c, h, w = x.shape
        hp, wp = (int(np.ceil(s / WS)) * WS for s in np.array(x.shape[2:]))
        mask = shift_mask(hp, wp, WS, self.shift, x.device)
        t = rearrange(x, "b c h w -> b h w c")
        t = torch.roll(t, shifts=(-self.shift, -self.shift), dims=(1, 2))
        win = window_partition(t, WS)  # [b * nw, n, c]
        bw, n, _ = win.shape
        qkv = self.qkv(win).reshape(bw, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = q @ k.transpose(-2, -1) * 0.5 + self.bias.unsqueeze(0)
        nw = mask.shape[0]
        attn = attn.view(bw // nw, nw, self.heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, self.heads, n, n).softmax(-1).to(v.dtype)
        o = self.proj((attn @ v).transpose(1, 2).reshape(bw, n, c))
        t = window_reverse(o, WS, hp, wp)
        t = torch.roll(t, shifts=(self.shift, self.shift), dims=(1, 2))
        return x + rearrange(t, "b h w c -> b c h w")


class SwinNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.block = SwinBlock()
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)).mean((2, 3)))


SHAPE = (4, 3, 8, 8)


def _case(model: nn.Module, seed: int = 3) -> tuple[nn.Module, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    model = seeded(model.double(), gen)
    return model, torch.randn(SHAPE, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("name", ["sample", "spatial", "stationary-x"])
def test_swin_block_equals_one_process(name: str) -> None:
    """Sample-parallel: the windows of each rank's samples stay local; spatial: the rows, split
    over H, are gathered by the roll before the windows are cut; stationary-x: the channels,
    split over C, are gathered by the Linear layers' rule."""
    model, x = _case(SwinNet())
    check_rows(square_mean_reference(model, x),
               run_threads(_sized_step, 4, model, OPTIONS[name], x))


def test_windows_of_a_batch_the_blocks_do_not_divide_are_refused_before_a_step() -> None:
    """5 samples over 4 blocks: the windows' blocks would not be the samples' blocks times the
    window count, so the reverse's view is refused naming it, before any step runs."""
    gen = torch.Generator().manual_seed(3)
    model = seeded(SwinNet().double(), gen)
    x = torch.randn((5, 3, 8, 8), generator=gen, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"node 'view_\d+'.*does not keep input dim\(s\) \[0\]"):
        run_threads(_sized_step, 4, model, OPTIONS["sample"], x)


class Shift(nn.Module):
    def __init__(self, dims: Any = (1, 2)) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.stem(x).permute(0, 2, 3, 1)
        s = torch.roll(t, shifts=(-3, 1), dims=self.dims) if self.dims else torch.roll(t, 2)
        return t * s


def test_roll_of_split_rows_gathers_them_and_keeps_the_samples_split() -> None:
    """Under N x H: the rows (split over H) are made whole before the roll, the samples stay
    split; under sample parallelism nothing moves."""
    got = _placed(Shift(), OPTIONS["spatial"], 4, SHAPE)["roll"]
    assert got[0] == "[o_N,*,*,*]"
    assert got[2] == {"permute": "[o_N,*,*,*]"}
    got = _placed(Shift(), OPTIONS["sample"], 4, SHAPE)["roll"]
    assert got[0] == "[o_N,*,*,*]" and got[2] == {"permute": "[o_N,*,*,*]"}


@pytest.mark.parametrize("name", ["sample", "spatial", "stationary-x"])
def test_roll_equals_one_process(name: str) -> None:
    model, x = _case(Shift())
    check_rows(square_mean_reference(model, x),
               run_threads(_sized_step, 4, model, OPTIONS[name], x))


def test_roll_of_negative_dims_equals_one_process() -> None:
    """``dims=(-3, -2)`` are the rows and columns of ``[N, H, W, C]``: under N x H the rows,
    split, are made whole as for ``dims=(1, 2)``."""
    model, x = _case(Shift((-3, -2)))
    check_rows(square_mean_reference(model, x),
               run_threads(_sized_step, 4, model, OPTIONS["spatial"], x))


class _RolledMean(nn.Module):
    """A roll of the columns of a mean over the rows: under N x H the mean is each rank's
    partial sum over its rows until something settles it, the roll moving it as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.stem(x)
        r = torch.roll(a.mean(2), 1, 2)  # [N, C, W]
        return a * r[:, :, None, :]


def test_roll_of_an_unsettled_mean_over_split_rows_equals_one_process() -> None:
    """The roll moves the partial sums as they are (nothing is summed at the roll: the sum
    settles once, where the product needs it)."""
    got = _placed(_RolledMean(), OPTIONS["spatial"], 4, SHAPE)["roll"]
    assert got == ("Σ_H [o_N,*,*]", 0, {"mean": "Σ_H [o_N,*,*]"}), got
    model, x = _case(_RolledMean())
    check_rows(square_mean_reference(model, x),
               run_threads(_sized_step, 4, model, OPTIONS["spatial"], x))


@pytest.mark.parametrize("dims, words", [
    ((0, 1), r"node 'roll'.*roll a dim other than the samples"),
    (None, r"node 'roll'.*give dims= to torch.roll"),
], ids=["samples", "flattened"])
def test_a_roll_that_cannot_be_exact_is_refused_naming_the_node(dims: Any, words: str) -> None:
    with pytest.raises((ops.Unsupported, ValueError), match=words):
        explain(Shift(dims), OPTIONS["sample"], SHAPE, world_size=4)


class _NumpySizes(nn.Module):
    """Pads a map up to a multiple of 3 with sizes computed through numpy."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = np.array(x.shape[2:])
        pad = (np.ceil(size / 3) * 3 - size).astype(int)
        y = torch.nn.functional.pad(self.stem(x), (0, int(pad[1]), 0, int(pad[0])))
        return y.mean((2, 3))


class _NumpyValues(_NumpySizes):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        return y * float(np.array(y).max())


def test_sizes_read_through_numpy_are_the_global_shape_s_under_guards() -> None:
    gm = trace(_NumpySizes(), SHAPE)
    guards = [n for n in gm.graph.nodes if n.target is torch._assert]
    assert guards and all("input_shape=" in n.args[1] for n in guards)
    model, x = _case(_NumpySizes())
    check_rows(square_mean_reference(model, x),
               run_threads(_sized_step, 4, model, OPTIONS["spatial"], x))


def test_numpy_reading_a_tensor_s_values_is_refused_with_the_fix() -> None:
    with pytest.raises(UntraceableModelError, match=r"numpy reads the values of 'stem'"):
        trace(_NumpyValues(), SHAPE)
    with pytest.raises(UntraceableModelError, match=r"give input_shape= so the capture reads "
                       r"sizes through numpy"):
        trace(_NumpySizes())


def test_the_mask_built_from_sizes_is_a_constant_of_the_graph() -> None:
    """``shift_mask`` (torch.zeros on ``x.device``, filled by slices, partitioned) runs at capture
    and is held as a constant equal to the one the module builds (with the new axes the block
    adds to it, computed from it alone)."""
    gm = trace(SwinNet(), SHAPE)
    consts = [getattr(gm, str(n.target)) for n in gm.graph.nodes
              if n.op == "get_attr" and str(n.target).startswith("_tensor_constant")]
    want = shift_mask(8, 8, WS, 2, "cpu").unsqueeze(1).unsqueeze(0)
    assert any(c.shape == want.shape and torch.equal(c, want) for c in consts)
    assert not [n for n in gm.graph.nodes if n.target in (torch.zeros, "masked_fill")]


class _MergedTokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from einops import rearrange

        return rearrange(self.stem(x), "b c h w -> b (h w) c").mean(1)


def test_sizes_einops_reads_are_the_captured_shape_s_ints() -> None:
    """``b (h w) c`` on the captured ``[4, 4, 8, 8]``: einops' reshape is recorded with the
    global sizes as numbers (4 samples, 8 * 8 tokens, 4 channels), guarded."""
    gm = trace(_MergedTokens(), SHAPE)
    shaped = [n for n in gm.graph.nodes if n.target == "reshape"]
    assert [tuple(n.args[1]) for n in shaped] == [(4, 64, 4)], [n.args for n in shaped]
    assert [n for n in gm.graph.nodes if n.target is torch._assert]


def test_einops_first_imported_by_the_traced_forward_is_bound_to_traced_values() -> None:
    """A process that has not imported einops when the capture starts (the forward imports it
    while it is traced): the capture still runs einops on traced values."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys\n"
            "from tests.test_ops_swin import SwinNet, SHAPE\n"
            "from distconv.parallel.capture import trace\n"
            "assert 'einops' not in sys.modules, 'einops was imported before the capture'\n"
            "trace(SwinNet(), SHAPE)\n")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.gloo
def test_swin_block_on_gloo(gloo4) -> None:  # noqa: ANN001
    model, x = _case(SwinNet())
    check_rows(square_mean_reference(model, x),
               gloo4.run(_sized_step, model, OPTIONS["sample"], x))
