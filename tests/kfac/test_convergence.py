"""K-FAC reaches a target test accuracy on digits in fewer epochs than SGD (fixed seed)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kfac_digits.py"


def load_example():
    spec = importlib.util.spec_from_file_location("kfac_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add contention on a shared machine
    yield
    torch.set_num_threads(old)


def test_kfac_reaches_target_in_fewer_epochs_than_sgd(one_thread):
    pytest.importorskip("sklearn")
    ex = load_example()
    data = ex.load_digits_split(0)
    target, epochs = 0.9, 6
    sgd = ex.train(False, epochs=epochs, seed=0, progress=False, data=data)
    kfac = ex.train(True, epochs=epochs, seed=0, progress=False, data=data)
    k, s = ex.epochs_to(kfac, target), ex.epochs_to(sgd, target)
    assert k is not None and k <= 3, kfac
    assert s is None or s > k, sgd
