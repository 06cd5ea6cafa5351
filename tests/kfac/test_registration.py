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


def test_module_called_twice_per_step_raises_not_implemented():
    layer = nn.Linear(2, 2)
    distkfac.KFAC(layer)
    layer(torch.randn(3, 2))
    with pytest.raises(NotImplementedError, match="more than once"):
        layer(torch.randn(3, 2))


def test_extra_forward_without_grad_is_ignored():
    layer = nn.Linear(2, 2)
    kfac = distkfac.KFAC(layer)
    with torch.no_grad():
        layer(torch.randn(3, 2))
    layer(torch.randn(3, 2)).sum().backward()
    kfac.step()
    assert kfac.layers[0].a.updates == 1


def test_sharded_distconv_layers_raise_not_implemented():
    class DistConv2d(nn.Module):
        pass

    model = nn.Sequential(DistConv2d(), nn.Linear(2, 2))
    with pytest.raises(NotImplementedError, match="skip_layers"):
        distkfac.KFAC(model)
    assert len(distkfac.KFAC(model, skip_layers=["DistConv2d"]).layers) == 1
