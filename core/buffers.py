"""Caller-provided buffers: numpy arrays or torch tensors (CPU now, CUDA when present).

kvstrata never needs torch to be imported for numpy callers; torch is imported
only when a torch tensor is seen. Buffers must be contiguous; they are treated
as flat byte arrays of exactly one layer-block.
"""

from __future__ import annotations

import ctypes
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


_COPY_POOLS: dict[bool, ThreadPoolExecutor] = {}
_COPY_POOL_LOCK = threading.Lock()
PARALLEL_MIN_BYTES = 8 * 1024 * 1024
COPY_CHUNK = 4 * 1024 * 1024  # coalesced runs are cut into pieces of this size for the threads


def _copy_pool(background: bool = False) -> ThreadPoolExecutor:
    """Copy threads: one pool for loads (someone waits), another for stores.

    With one shared pool a load queued behind a store's copy: a 512 MiB store into fresh memory
    made a 50 ms DRAM load take ~0.9 s. Store threads keep normal priority: at nice 10 they
    starved beside vLLM's compute threads, and a later load of those blocks waited for the store
    (vLLM TTFT benchmark: a DRAM restore took 1.19 s instead of 0.67 s)."""
    with _COPY_POOL_LOCK:
        pool = _COPY_POOLS.get(background)
        if pool is None:
            pool = ThreadPoolExecutor(
                min(4, os.cpu_count() or 1),
                thread_name_prefix="kvstrata-copy-bg" if background else "kvstrata-copy",
            )
            _COPY_POOLS[background] = pool
        return pool


HostSpan = tuple[int, int]  # (address, size) of bytes in host memory that outlive the copy


def _host_span(buf: Any, write: bool) -> HostSpan | None:
    """(address, size) of a contiguous host buffer (or a span) that may be copied by address;
    None for anything else."""
    kind = type(buf)
    if kind is tuple:
        return buf  # type: ignore[no-any-return]
    if kind is np.ndarray:
        flags = buf.flags
        if not flags.c_contiguous or (write and not flags.writeable):
            return None
        return int(buf.__array_interface__["data"][0]), int(buf.nbytes)
    if is_torch(buf):
        if not buf.is_cpu or not buf.is_contiguous():
            return None
        return int(buf.data_ptr()), int(buf.nbytes)
    return None


def span_view(span: HostSpan) -> np.ndarray:
    """A numpy uint8 view of a host span (valid while its owner keeps the memory)."""
    addr, size = span
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr))


def _memmove_all(runs: Sequence[tuple[int, int, int]]) -> None:
    move = ctypes.memmove  # a C call that releases the GIL while it copies
    for dst, src, n in runs:
        move(dst, src, n)


def copy_many(pairs: Sequence[tuple[Buffer | HostSpan, Buffer | HostSpan]], background: bool = False) -> None:
    """Copy many (dst, src) layer-blocks; either side may be a buffer or a :data:`HostSpan`.

    ``background`` copies (stores) run on their own threads, so a load never waits behind them.

    Host memory is copied by address: neighbouring blocks that are adjacent on both sides
    (a request's pages in an engine's KV cache, blocks stored together in a pool) merge into one
    run, and runs are copied by ``memmove`` without the GIL, split across a small thread pool
    when the batch is large. Per block this costs a pointer read or two instead of building
    array views, which dominated loads of thousands of small blocks (about 25 us a block into
    torch pages). Device buffers go through :func:`copy_bytes`.
    """
    runs: list[list[int]] = []
    slow: list[tuple[Buffer, Buffer]] = []
    for dst, src in pairs:
        d = _host_span(dst, write=True)
        s = _host_span(src, write=False)
        if d is None or s is None:
            slow.append((span_view(dst) if type(dst) is tuple else dst, span_view(src) if type(src) is tuple else src))
            continue
        if d[1] != s[1]:
            raise ValueError(f"cannot copy a {s[1]}-byte block into a {d[1]}-byte buffer")
        if runs:
            last = runs[-1]
            if last[0] + last[2] == d[0] and last[1] + last[2] == s[0]:
                last[2] += d[1]
                continue
        runs.append([d[0], s[0], d[1]])
    for dst, src in slow:
        copy_bytes(dst, src)
    if not runs:
        return
    workers = min(4, os.cpu_count() or 1)
    moved = sum(r[2] for r in runs)
    if moved < PARALLEL_MIN_BYTES or workers < 2:
        _memmove_all([(r[0], r[1], r[2]) for r in runs])
        return
    pieces = [(d + o, s + o, min(COPY_CHUNK, n - o)) for d, s, n in runs for o in range(0, n, COPY_CHUNK)]
    pool = _copy_pool(background)
    futures = [pool.submit(_memmove_all, pieces[i::workers]) for i in range(workers)]
    for f in futures:
        f.result()
