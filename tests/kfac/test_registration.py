"""Registration: what is preconditioned, what is skipped (with a warning), what raises."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import distkfac


def test_unhandled_modules_are_skipped_with_warning():
    frozen = nn.Linear(3, 3)
    frozen.weight.requires_grad_(False)
    model = nn.Sequential(nn.Linear(2, 3), frozen, torch.jit.script(nn.Linear(3, 3)),
                          nn.LazyLinear(2))
    with pytest.warns(UserWarning, match="skipping"):
        kfac = distkfac.KFAC(model)
    assert set(kfac.skipped) == {"1", "3"}
    model(torch.randn(4, 2)).sum().backward()
    kfac.step()


def test_unused_layer_warns_in_step_and_does_not_crash():
    model = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    kfac = distkfac.KFAC(model)
    model["a"](torch.randn(3, 2)).sum().backward()
    with pytest.warns(UserWarning, match="produced no factors"):
        kfac.step()
    assert model["b"].weight.grad is None


def test_extra_forward_without_grad_is_ignored():
    layer = nn.Linear(2, 2)
    kfac = distkfac.KFAC(layer)
    with torch.no_grad():
        layer(torch.randn(3, 2))
    layer(torch.randn(3, 2)).sum().backward()
    kfac.step()
    assert kfac.layers[0].a.updates == 1


def test_skip_layers_by_class_name_and_unknown_names_raise():
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    assert len(distkfac.KFAC(model, skip_layers=["Linear"]).layers) == 0
    assert len(distkfac.KFAC(model, skip_layers=["0"]).layers) == 1
    with pytest.raises(ValueError, match=r"skip_layers names \['lienar'\]"):
        distkfac.KFAC(model, skip_layers=["lienar"])
