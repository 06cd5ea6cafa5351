"""Fixtures shared by the second-order tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Tiny tensors: intra-op threads only contend (10-100x slower on a loaded 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
