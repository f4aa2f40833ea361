"""Caller-provided buffers: numpy arrays or torch tensors (CPU now, CUDA when present).

kvstrata never needs torch to be imported for numpy callers; torch is imported
only when a torch tensor is seen. Buffers must be contiguous; they are treated
as flat byte arrays of exactly one layer-block.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

Buffer = Any  # numpy.ndarray | torch.Tensor


def is_torch(buf: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(buf, torch.Tensor)


def is_device(buf: object) -> bool:
    """True for a torch tensor that lives in accelerator memory."""
    return is_torch(buf) and buf.device.type != "cpu"  # type: ignore[attr-defined]


def is_contiguous(buf: Buffer) -> bool:
    if is_torch(buf):
        return bool(buf.is_contiguous())
    return bool(np.asarray(buf).flags.c_contiguous)


def nbytes(buf: Buffer) -> int:
    if type(buf) is np.ndarray:
        return buf.nbytes
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
    if (
        type(dst) is np.ndarray
        and type(src) is np.ndarray
        and dst.dtype == src.dtype == np.uint8
        and dst.ndim == src.ndim == 1
    ):
        np.copyto(dst, src, casting="no")  # fast path: flat byte rows (views, never copies)
        return
    if is_device(dst) or is_device(src):
        import torch

        def as_torch(b: Buffer) -> Any:
            if is_torch(b):
                return b.detach().reshape(-1).view(torch.uint8)
            return torch.from_numpy(host_bytes(b))

        as_torch(dst).copy_(as_torch(src), non_blocking=False)
        return
    np.copyto(host_bytes(dst), host_bytes(src), casting="no")


_COPY_POOL: ThreadPoolExecutor | None = None
_COPY_POOL_LOCK = threading.Lock()
PARALLEL_MIN_BYTES = 8 * 1024 * 1024


def _copy_pool() -> ThreadPoolExecutor:
    global _COPY_POOL
    with _COPY_POOL_LOCK:
        if _COPY_POOL is None:
            _COPY_POOL = ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="kvstrata-copy")
        return _COPY_POOL


def copy_many(pairs: Sequence[tuple[Buffer, Buffer]], total_bytes: int) -> None:
    """Copy many (dst, src) layer-blocks; large batches are split across a small thread pool.

    numpy and torch release the GIL while copying, so two cores move about twice the bytes.
    """
    workers = min(4, os.cpu_count() or 1)
    if total_bytes < PARALLEL_MIN_BYTES or workers < 2 or len(pairs) < 2 * workers:
        for dst, src in pairs:
            copy_bytes(dst, src)
        return

    def run(part: Sequence[tuple[Buffer, Buffer]]) -> None:
        for dst, src in part:
            copy_bytes(dst, src)

    futures = [_copy_pool().submit(run, pairs[i::workers]) for i in range(workers)]
    for f in futures:
        f.result()
