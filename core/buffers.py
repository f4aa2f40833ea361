"""Caller-provided buffers: numpy arrays or torch tensors (CPU now, CUDA when present).

kvstrata never needs torch to be imported for numpy callers; torch is imported
only when a torch tensor is seen. Buffers must be contiguous; they are treated
as flat byte arrays of exactly one layer-block. A :data:`HostSpan` ``(address, size)`` stands
for bytes of host memory that outlive the copy (an arena slot, a caller's row): copies take
either, and :func:`row_addresses` reads a whole layer's rows by address without building views.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

import numpy as np

from kvstrata.core import native
from kvstrata.core.hostcopy import Copy, merge_runs

Buffer = Any  # numpy.ndarray | torch.Tensor
_ADDR = itemgetter(0)  # of a HostSpan
_SIZE = itemgetter(1)


def is_torch(buf: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(buf, torch.Tensor)


def is_device(buf: object) -> bool:
    """True for a torch tensor that lives in accelerator memory."""
    return is_torch(buf) and buf.device.type != "cpu"  # type: ignore[attr-defined]


def is_contiguous(buf: Buffer) -> bool:
    if type(buf) is tuple:  # a HostSpan
        return True
    if is_torch(buf):
        return bool(buf.is_contiguous())
    return bool(np.asarray(buf).flags.c_contiguous)


def nbytes(buf: Buffer) -> int:
    kind = type(buf)
    if kind is np.ndarray:
        return buf.nbytes
    if kind is tuple:  # a HostSpan
        return int(buf[1])
    if is_torch(buf):
        return int(buf.numel() * buf.element_size())
    return int(buf.nbytes)


def rows_fit(bufs: Any, rows: int, size: int) -> bool:
    """True when ``bufs`` is one C-contiguous array or tensor of at least ``rows`` rows of ``size``
    bytes each (a layer's buffers as callers usually pass them): checked on the whole, with no
    view of a row. False says nothing: the caller checks row by row (and names what is wrong)."""
    if type(bufs) is np.ndarray:
        shape = bufs.shape
        return len(shape) >= 2 and shape[0] >= rows and bufs.flags.c_contiguous and bufs.nbytes == size * shape[0]
    tensor = _tensor_type()
    if tensor is None or not isinstance(bufs, tensor):
        return False
    t: Any = bufs
    shape = t.shape
    return (
        len(shape) >= 2 and shape[0] >= rows and t.is_contiguous() and t.numel() * t.element_size() == size * shape[0]
    )


def host_bytes(buf: Buffer) -> np.ndarray:
    """A flat uint8 numpy view of a host buffer or span (no copy). Raises for device or non-contiguous buffers."""
    if type(buf) is tuple:
        return span_view(buf)
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


HostSpan = tuple[int, int]  # (address, size) of bytes in host memory that outlive the copy
_TORCH_TENSOR: list[type] = []


def _tensor_type() -> type | None:
    """``torch.Tensor`` once torch is imported (kvstrata never imports it for numpy callers)."""
    if not _TORCH_TENSOR:
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        _TORCH_TENSOR.append(torch.Tensor)
    return _TORCH_TENSOR[0]


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


class Pages:
    """Pages ``ids`` of ``base``, an array or tensor whose first axis is the page (one layer of
    vLLM's KV cache): the engine takes it wherever it takes a list of per-page buffers
    (``pages[i]`` is ``base[ids[i]]``), and :func:`row_addresses` reads its pages' addresses as
    arithmetic (the first page's address plus id offsets times the first axis' stride), with no
    view built per page: a list of 1,000 page views of each of 32 layers (a 16K-token restore in
    16-token pages) took ~150 ms to build and ~30 ms to read the addresses of."""

    __slots__ = ("base", "ids")

    def __init__(self, base: Any, ids: Sequence[int]) -> None:
        self.base = base
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Any:
        return self.base[self.ids[i]]

    def addresses(self, positions: Sequence[int], size: int, write: bool) -> list[int] | None:
        """Host addresses of pages ``positions`` (``size`` bytes each), or None when the pages are
        not contiguous host memory of that size (the caller then takes them page by page)."""
        ids = [self.ids[p] for p in positions]
        if not ids:
            return []
        rows = int(self.base.shape[0])
        if min(ids) < 0 or max(ids) >= rows:
            raise IndexError(f"page ids out of range 0..{rows - 1}")
        first = _host_span(self.base[ids[0]], write)  # one view: is a page contiguous host memory
        if first is None or first[1] != size:
            return None
        base: Any = self.base
        numpy = type(base) is np.ndarray  # else a torch tensor
        stride = int(base.strides[0]) if numpy else int(base.stride(0)) * int(base.element_size())
        start = first[0] - ids[0] * stride
        return [start + i * stride for i in ids]


def row_addresses(bufs: Any, positions: Sequence[int], size: int, write: bool) -> Sequence[int] | None:
    """Host addresses of ``bufs[p]`` for each of ``positions``, each ``size`` bytes, without views.

    ``bufs`` is one layer's buffers as the engine takes them: a C-contiguous host array or tensor
    of rows (the rows' addresses are arithmetic: one address read for the whole batch), or a
    sequence or mapping of buffers (one address read each: a C call for a torch tensor, a slower
    one for a numpy array). None when some buffer cannot be copied by address (device memory,
    strided, read-only for ``write``, another size): the caller then passes the buffers.
    """
    if not positions:
        return []
    if type(bufs) is Pages:
        return bufs.addresses(positions, size, write)
    tensor = _tensor_type()
    if type(bufs) is np.ndarray or (tensor is not None and isinstance(bufs, tensor)):
        return _array_rows(bufs, positions, size, write)
    out = []
    for p in positions:
        buf = bufs[p]
        got = _tensor_span(buf) if type(buf) is tensor else _host_span(buf, write)
        if got is None or got[1] != size:
            return None
        out.append(got[0])
    return out


def layers_row_addresses(
    layer_bufs: Sequence[Any], positions: Sequence[int], sizes: Sequence[int], write: bool
) -> list[Sequence[int]] | None:
    """:func:`row_addresses` of each of ``layer_bufs`` (``sizes[i]`` bytes a row) at the same
    ``positions``: the addresses of every numpy array in one extension call (a layer's address read
    from Python costs ~1.5 us, and a load or store reads one per layer and side). None when some
    buffer cannot be copied by address."""
    nat = native.NATIVE
    rng = positions if isinstance(positions, range) and positions.step == 1 and len(positions) else None
    spans = nat.buffer_spans(layer_bufs, write) if nat is not None and rng is not None else None
    out: list[Sequence[int]] = []
    for i, bufs in enumerate(layer_bufs):
        size = sizes[i]
        span = spans[i] if spans is not None else None
        if rng is not None and span is not None and span[2] >= 0 and span[1] == span[2] * size:  # rows of size
            out.append(_rows_at(span[0], span[2], rng, size))
            continue
        addresses = row_addresses(bufs, positions, size, write)
        if addresses is None:
            return None
        out.append(addresses)
    return out


def _array_rows(arr: Any, positions: Sequence[int], size: int, write: bool) -> Sequence[int] | None:
    if arr.ndim < 2:
        return None
    span = _host_span(arr, write)
    rows = int(arr.shape[0])
    if span is None or span[1] != rows * size:
        return None
    return _rows_at(span[0], rows, positions, size)


def _rows_at(base: int, rows: int, positions: Sequence[int], size: int) -> Sequence[int]:
    """Addresses of rows ``positions`` of ``rows`` rows of ``size`` bytes at ``base``: a range where
    they are consecutive; IndexError for a position outside the rows."""
    if type(positions) is range and positions.step == 1:
        if positions.start < 0 or positions.stop > rows:
            raise IndexError(f"buffer positions {positions} out of range 0..{rows - 1}")
        return range(base + positions.start * size, base + positions.stop * size, size)
    if min(positions) < 0 or max(positions) >= rows:
        raise IndexError(f"buffer position out of range 0..{rows - 1}")
    first, n = positions[0], len(positions)
    if positions[-1] - first == n - 1 and (n < 3 or list(positions) == list(range(first, first + n))):
        return range(base + first * size, base + (first + n) * size, size)
    return [base + p * size for p in positions]


def _tensor_span(t: Any) -> HostSpan | None:
    if not t.is_cpu or not t.is_contiguous():
        return None
    return int(t.data_ptr()), int(t.nbytes)


def as_spans(bufs: Sequence[Any], write: bool) -> Sequence[HostSpan] | None:
    """``bufs`` as host spans (spans pass as they are), or None when one cannot be copied by address."""
    if set(map(type, bufs)) <= {tuple}:
        return bufs
    spans = [_host_span(b, write) for b in bufs]
    return None if None in spans else spans  # type: ignore[return-value]


def copy_spans(dst: Sequence[HostSpan], src: Sequence[HostSpan], background: bool = False) -> None:
    """Copy host spans ``src[i] -> dst[i]`` (equal sizes, checked), merged into runs."""
    sizes = list(map(_SIZE, src))
    if list(map(_SIZE, dst)) != sizes:
        for d, s in zip(dst, src, strict=True):
            if d[1] != s[1]:
                raise ValueError(f"cannot copy a {s[1]}-byte block into a {d[1]}-byte buffer")
    Copy(merge_runs(list(map(_ADDR, dst)), list(map(_ADDR, src)), sizes), background).finish()


def copy_many(pairs: Sequence[tuple[Buffer | HostSpan, Buffer | HostSpan]], background: bool = False) -> None:
    """Copy many (dst, src) layer-blocks; either side may be a buffer or a :data:`HostSpan`.

    ``background`` copies (stores) run on their own threads, so a load never waits behind them.

    Host memory is copied by address (:mod:`kvstrata.core.hostcopy`): neighbouring blocks that are
    adjacent on both sides merge into one run, and runs are copied by ``memmove`` without the GIL,
    on a few threads when the batch is large. Per block this costs a pointer read or two instead
    of building array views, which dominated loads of thousands of small blocks (about 25 us a
    block into torch pages). Device buffers go through :func:`copy_bytes`.
    """
    d_all = as_spans([p[0] for p in pairs], write=True)
    s_all = as_spans([p[1] for p in pairs], write=False) if d_all is not None else None
    if d_all is not None and s_all is not None:
        copy_spans(d_all, s_all, background)
        return
    dsts: list[HostSpan] = []
    srcs: list[HostSpan] = []
    for dst, src in pairs:
        d = _host_span(dst, write=True)
        s = _host_span(src, write=False)
        if d is None or s is None:
            copy_bytes(span_view(dst) if type(dst) is tuple else dst, span_view(src) if type(src) is tuple else src)
            continue
        dsts.append(d)
        srcs.append(s)
    copy_spans(dsts, srcs, background)
