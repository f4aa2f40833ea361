"""Reused host buffers for the pages a store copies out of vLLM's KV cache.

A store copies each layer's new pages out right after the layer ran, so vLLM may free or reuse
them at once. Copying into a fresh tensor every step costs page faults on every byte (a fresh
64 MiB allocation is mmapped, faulted in at ~2 GB/s, and unmapped again) inside the forward
pass; these buffers are faulted in once and handed back when the engine has taken the bytes.
"""

from __future__ import annotations

import threading

import torch

from kvstrata.core.buffers import copy_many

MIN_BLOCKS = 16  # buffers hold a power of two of pages, at least this many


class StagingPool:
    """Free lists of host tensors ``[capacity, *page_shape]``, keeping at most ``limit_bytes`` idle."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._free: dict[tuple[tuple[int, ...], torch.dtype, int], list[torch.Tensor]] = {}
        self._idle_bytes = 0
        self._out_bytes = 0
        self._lock = threading.Lock()
        self.allocated = 0  # buffers created (a steady workload stops creating them)

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    @property
    def out_bytes(self) -> int:
        """Bytes of buffers taken and not handed back yet (a store copies into or the engine reads
        them); 0 once every store has finished, whatever happened to its request."""
        return self._out_bytes

    def take(self, page: torch.Tensor, n: int) -> torch.Tensor:
        """A host buffer for at least ``n`` pages shaped like ``page``."""
        cap = max(MIN_BLOCKS, 1 << max(0, n - 1).bit_length())
        key = (tuple(page.shape), page.dtype, cap)
        with self._lock:
            free = self._free.get(key)
            if free:
                buf = free.pop()
                self._idle_bytes -= buf.nbytes
                self._out_bytes += buf.nbytes
                return buf
            self.allocated += 1
        buf = torch.empty((cap, *page.shape), dtype=page.dtype)
        with self._lock:
            self._out_bytes += buf.nbytes
        return buf

    def give(self, bufs: list[torch.Tensor]) -> None:
        """Hand buffers back once nothing reads them; beyond ``limit_bytes`` they are freed."""
        with self._lock:
            for buf in bufs:
                self._out_bytes -= buf.nbytes
                if self._idle_bytes + buf.nbytes > self.limit_bytes:
                    continue
                key = (tuple(buf.shape[1:]), buf.dtype, int(buf.shape[0]))
                self._free.setdefault(key, []).append(buf)
                self._idle_bytes += buf.nbytes


def copy_pages_out(kv_layer: torch.Tensor, block_ids: list[int], buf: torch.Tensor) -> torch.Tensor:
    """Copy pages ``block_ids`` of a host KV-cache layer into ``buf[:n]`` and return that view.

    Runs of consecutive block ids (vLLM allocates a new request's blocks mostly in order) are
    copied as one slice each when the layer's tensor is contiguous (each page always is).
    """
    n = len(block_ids)
    if not kv_layer.is_contiguous():
        copy_many([(buf[i], kv_layer[b]) for i, b in enumerate(block_ids)])
        return buf[:n]
    pairs = []
    i = 0
    while i < n:
        j = i + 1
        while j < n and block_ids[j] == block_ids[j - 1] + 1:
            j += 1
        pairs.append((buf[i:j], kv_layer[block_ids[i] : block_ids[i] + (j - i)]))
        i = j
    copy_many(pairs)
    return buf[:n]
