"""The ``device`` and ``dtype`` a layer's parameters are made with, checked where the layer is
built: torch's own answers (an ``AssertionError`` from a CPU-only build, "only floating point
can require gradients") name neither the layer nor the argument."""

from __future__ import annotations

from typing import Any

import torch


def check_factory_kwargs(device: Any, dtype: Any, where: str) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``where``'s ``device`` or ``dtype`` unless the
    parameters can be made with them (a floating dtype; a device this torch can use)."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(
            f"{where}: dtype must be None or a floating point torch.dtype (torch.float32, "
            f"torch.float64, torch.bfloat16, torch.float16): parameters learn by gradients; "
            f"got {dtype!r}")
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{where}: device must be None or a torch.device or device string "
                         f"('cpu', 'cuda', 'cuda:1'), got {device!r} ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = ("this torch is built without CUDA" if torch.version.cuda is None
               else "torch sees no CUDA device")
        raise ValueError(f"{where}: device={device!r}, but {why}; use device='cpu' (or None), "
                         "or a CUDA build of torch on a machine with a GPU")
