"""explain tells the truth: with strict=False it lists every node parallelize refuses and
explains the rest (never blaming an input shape that fits), its refusals say ``explain``, and
a row's algorithm is what runs there."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distconv import ops
from distconv.parallel.explain import explain

SPATIAL = {"default": {"grid": {"N": 2, "H": 2}, "algorithm": "spatial"}}
SHAPE = (4, 3, 16, 16)


class ItemScaled(nn.Module):
    """A forward that reads a value into Python (``.item()``) and scales by it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        k = y.mean().item()
        return self.fc((self.b(y) * k).mean((2, 3)))


def test_item_is_listed_and_the_rest_explained_without_blaming_the_shape() -> None:
    plan = explain(ItemScaled(), SPATIAL, SHAPE, strict=False)
    refused = [n for n, _, _ in plan.unsupported]
    assert "item" in refused, plan.unsupported
    assert {lay.name for lay in plan.layers} >= {"a", "b", "fc"}
    text = str(plan)
    assert "does not fit the model" not in text and "input_shape" not in text
    assert all(r.startswith("explain: ") for _, _, r in plan.unsupported), plan.unsupported


def test_explains_refusals_say_explain() -> None:
    with pytest.raises(ops.Unsupported, match=r"^explain: node 'mean' "):
        explain(ItemScaled(), SPATIAL, SHAPE)


def test_a_linear_head_on_the_sample_grid_is_labelled_sample() -> None:
    plan = explain(ItemScaled(), SPATIAL, SHAPE, strict=False)
    rows = {line.split()[0]: line.split()[2] for line in str(plan).splitlines()
            if line.split() and line.split()[0] in ("a", "b", "fc")}
    assert rows == {"a": "spatial", "b": "spatial", "fc": "sample"}, rows


def test_without_a_machine_the_text_says_in_one_line_how_to_get_a_verdict() -> None:
    text = str(explain(ItemScaled(), SPATIAL, SHAPE, strict=False))
    last = text.split("against sample parallelism:", 1)[1]
    assert "machine=" in last and "distconv.machines.calibrate(comm)" in last.replace("\n", "")


class Branchy(nn.Module):
    """Python that branches on a tensor's value, which torch.fx cannot follow."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        if y.amax() > 0:  # the branch
            y = self.b(y)
        return self.fc(y.mean((2, 3)))


def test_a_branch_on_a_value_is_listed_where_it_is_and_the_rest_explained() -> None:
    with pytest.raises(TypeError, match="^explain: .*torch.fx cannot trace Branchy"):
        explain(Branchy(), SPATIAL, SHAPE)
    plan = explain(Branchy(), SPATIAL, SHAPE, strict=False)
    reasons = {n: r for n, _, r in plan.unsupported}
    assert "gt" in reasons, plan.unsupported
    assert reasons["gt"].startswith("explain: node 'gt' (call_function gt): rewrite the branch "
                                    "at "), reasons["gt"]
    assert "test_explain_truth.py" in reasons["gt"]
    assert {lay.name for lay in plan.layers} >= {"a", "b", "fc"}
