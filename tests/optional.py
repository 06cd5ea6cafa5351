"""Optional packages (MONAI, torchvision, timm, segmentation-models-pytorch, einops, safetensors,
PyYAML) in tests and benchmarks: a package that fails to import for ANY reason (missing, or
installed but broken: a CUDA wheel beside the CPU torch, a version clash raising ``AttributeError``
or ``RuntimeError`` at import) skips what needs it, with the reason, and never fails the suite.
``pytest.importorskip`` skips only on ``ImportError``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["load", "need", "why_not"]


def load(name: str) -> ModuleType | str:
    """The module ``name``, or why it does not import here (a one-line reason)."""
    if name.split(".")[0] in {"torchvision", "timm", "segmentation_models_pytorch"}:
        # torchvision's models load beside the CPU torch (tests/vision_ops.py); timm and smp
        # import torchvision
        from tests.vision_ops import install

        install()
    try:
        return importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - a broken install skips like a missing one
        text = " ".join(str(exc).split())
        return f"{name} does not import here ({type(exc).__name__}: {text[:200]})"


def why_not(*names: str) -> str | None:
    """Why the first of ``names`` that does not import fails, or None when all import."""
    for name in names:
        got = load(name)
        if isinstance(got, str):
            return got
    return None


def need(name: str) -> ModuleType:
    """``pytest.importorskip`` on any exception: the module, or a skip of the calling test (or,
    at module level, of the whole file) giving the reason."""
    import pytest

    got = load(name)
    if isinstance(got, str):
        pytest.skip(got, allow_module_level=True)
    return got
