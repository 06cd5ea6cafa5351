"""Both packages state the project's one version, the one pyproject.toml gives."""

from __future__ import annotations

import re
from pathlib import Path

import distconv
import distkfac

ROOT = Path(__file__).resolve().parent.parent


def test_both_packages_state_the_version_of_pyproject() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    want = re.search(r'^version = "([^"]+)"', text, re.M)
    assert want is not None
    assert distconv.__version__ == distkfac.__version__ == want.group(1)
