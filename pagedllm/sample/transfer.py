"""Host -> device copies that do not wait for the GPU.

A plain ``torch.tensor(values, device="cuda")`` synchronises the stream, which would stall the
CPU behind the step in flight; staging through pinned memory and copying asynchronously does
not. On the CPU both are the tensor itself.
"""

from __future__ import annotations

import numpy as np
import torch


def host_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor (asynchronous on CUDA)."""
    return _to_device(torch.tensor(values, dtype=dtype), device)


def numpy_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a device tensor (asynchronous on CUDA; shares memory on the CPU)."""
    return _to_device(torch.from_numpy(np.ascontiguousarray(array)), device)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
