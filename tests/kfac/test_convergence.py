"""K-FAC reaches a target test accuracy in fewer epochs than SGD (fixed seed).

The data are drawn here (ten smooth 8x8 class templates plus noise, shaped like the digits of
``examples/kfac_digits.py``), so the test needs none of the examples' extras and never skips;
the example's model and training loop are the ones exercised.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kfac_digits.py"


def load_example():
    if importlib.util.find_spec("tqdm") is None:  # the loop's progress bar: an extra, not needed
        stub = types.ModuleType("tqdm")
        stub.tqdm = _NoBar  # type: ignore[attr-defined]
        sys.modules["tqdm"] = stub
    spec = importlib.util.spec_from_file_location("kfac_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _NoBar:
    def __init__(self, iterable, **kw):
        self._it = iterable

    def __iter__(self):
        return iter(self._it)

    def set_postfix(self, **kw):
        pass


def template_digits(seed: int, n_train: int = 1000, n_test: int = 500, noise: float = 0.2):
    """``(x_train, y_train, x_test, y_test)``: (N, 1, 8, 8) in [0, 1], ten classes."""
    g = torch.Generator().manual_seed(seed)
    templates = F.avg_pool2d(F.pad(torch.rand(10, 1, 8, 8, generator=g), (1, 1, 1, 1),
                                   mode="replicate"), 3, 1)

    def draw(n):
        y = torch.randint(0, 10, (n,), generator=g)
        return (templates[y] + noise * torch.randn(n, 1, 8, 8, generator=g)).clamp(0, 1), y

    return (*draw(n_train), *draw(n_test))


@pytest.fixture
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add contention on a shared machine
    yield
    torch.set_num_threads(old)


def test_kfac_reaches_target_in_fewer_epochs_than_sgd(one_thread):
    ex = load_example()
    data = template_digits(0)
    target, epochs = 0.8, 3
    sgd = ex.train(False, epochs=epochs, seed=0, progress=False, data=data)
    kfac = ex.train(True, epochs=epochs, seed=0, progress=False, data=data)
    k, s = ex.epochs_to(kfac, target), ex.epochs_to(sgd, target)
    assert k is not None and k <= 3, kfac
    assert s is None or s > k, sgd
