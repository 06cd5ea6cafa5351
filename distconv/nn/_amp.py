"""Mixed precision: the dtype ``torch.autocast`` gives the ops of a device, as the layers need it
to meet low-precision activations with float32 parameters the way torch's own layers do."""

from __future__ import annotations

import torch

__all__ = ["autocast_dtype"]


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The lower-precision dtype autocast runs ``device_type``'s convolutions and matmuls in, or
    None when autocast is off there."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except TypeError:  # torch before 2.4 takes no device type
        if device_type == "cpu":
            return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
