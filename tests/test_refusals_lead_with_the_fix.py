"""Refusals lead with the fix: an unsupported op's message says first what to write, names at
most ten alternatives (the nearest first) and points to docs/support.md for the rest."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distconv import ops
from distconv.parallel.explain import explain

SAMPLE = {"default": {"grid": {"N": 2}, "algorithm": "sample"}}


@pytest.mark.parametrize("op", ["call_module", "call_function", "call_method"])
def test_at_most_ten_forms_are_listed_and_the_page_named(op: str) -> None:
    text = ops.supported(op, "PixelShuffle")
    listed = text.split(", ... (")[0].split(", ")
    assert 1 <= len(listed) <= ops.MAX_LISTED, text
    assert "docs/support.md" in text
    assert len(ops.supported(op)) < 700  # the whole list once filled a 600-character line


class Maxed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).max(3)[0].mean(2))


def test_max_is_refused_pointing_to_amax_first() -> None:
    plan = explain(Maxed(), SAMPLE, (2, 3, 8, 8), strict=False)
    reasons = {n: r for n, _, r in plan.unsupported}
    why = reasons["max_1"].split("): ", 1)[1]
    assert why.startswith("write .amax() instead: tensor method .max() is not supported"), why
    assert ".amax()" in why.split("supported: ", 1)[1].split(",")[0]


def test_an_unknown_module_is_refused_saying_what_to_do_first() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.PixelShuffle(2))
    with pytest.raises(ops.Unsupported) as info:
        explain(model, SAMPLE, (2, 3, 8, 8))
    why = str(info.value).split("): ", 1)[1]
    assert why.startswith("compute it outside the model, or write an op handler"), why
    assert "PixelShuffle is not supported" in why and "docs/support.md" in why
