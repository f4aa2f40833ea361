"""Caller-provided buffers: numpy arrays or torch tensors (CPU now, CUDA when present).

kvstrata never needs torch to be imported for numpy callers; torch is imported
only when a torch tensor is seen. Buffers must be contiguous; they are treated
as flat byte arrays of exactly one layer-block.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

Buffer = Any  # numpy.ndarray | torch.Tensor


def is_torch(buf: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(buf, torch.Tensor)


def is_device(buf: object) -> bool:
    """True for a torch tensor that lives in accelerator memory."""
    return is_torch(buf) and buf.device.type != "cpu"  # type: ignore[attr-defined]


def nbytes(buf: Buffer) -> int:
    if is_torch(buf):
        return int(buf.numel() * buf.element_size())
    return int(buf.nbytes)


def host_bytes(buf: Buffer) -> np.ndarray:
    """A flat uint8 numpy view of a host buffer (no copy). Raises for device or non-contiguous buffers."""
    if is_torch(buf):
        if buf.device.type != "cpu":
            raise ValueError("host_bytes() needs a CPU buffer")
        if not buf.is_contiguous():
            raise ValueError("buffers must be contiguous")
        import torch

        return buf.detach().reshape(-1).view(torch.uint8).numpy()
    arr = np.asarray(buf)
    if not arr.flags.c_contiguous:
        raise ValueError("buffers must be contiguous")
    return arr.reshape(-1).view(np.uint8)


def copy_bytes(dst: Buffer, src: Buffer) -> None:
    """Copy one layer-block from ``src`` to ``dst`` (host or device, either side)."""
    if is_device(dst) or is_device(src):
        import torch

        def as_torch(b: Buffer) -> Any:
            if is_torch(b):
                return b.detach().reshape(-1).view(torch.uint8)
            return torch.from_numpy(host_bytes(b))

        as_torch(dst).copy_(as_torch(src), non_blocking=False)
        return
    np.copyto(host_bytes(dst), host_bytes(src), casting="no")
