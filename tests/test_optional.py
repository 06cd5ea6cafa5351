"""Optional packages skip what needs them on any import failure, saying why (tests/optional.py)."""
from __future__ import annotations

import sys

import pytest

from tests.optional import load, need, why_not


@pytest.fixture
def broken(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    """A package that is installed and raises ``RuntimeError`` on import (as torchvision's CUDA
    build does beside the CPU torch)."""
    (tmp_path / "zoo_broken_pkg").mkdir()
    (tmp_path / "zoo_broken_pkg" / "__init__.py").write_text(
        "raise RuntimeError('operator zoo::nms does not exist')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "zoo_broken_pkg"
    sys.modules.pop("zoo_broken_pkg", None)


def test_a_package_failing_with_runtime_error_skips_with_the_reason(broken: str) -> None:
    with pytest.raises(pytest.skip.Exception, match=r"zoo_broken_pkg does not import here "
                                                    r"\(RuntimeError: operator zoo::nms"):
        need(broken)
    assert why_not("json", broken).startswith("zoo_broken_pkg does not import here")


def test_a_missing_package_skips_and_a_present_one_is_returned() -> None:
    with pytest.raises(pytest.skip.Exception, match="ModuleNotFoundError"):
        need("zoo_no_such_package")
    assert load("json") is sys.modules["json"]
    assert why_not("json", "os.path") is None
