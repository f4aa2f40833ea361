"""copy_many: copies by address, merging runs that are adjacent on both sides."""

from __future__ import annotations

import os
import random
import re
import threading

import numpy as np
import pytest
import torch

from kvstrata.core import hostcopy
from kvstrata.core.buffers import copy_many, span_view
from kvstrata.tiers.memory import SlotArena

pytestmark = pytest.mark.usefixtures("code_path")  # both paths: the C extension and pure Python

PAGE = 4096


def _pages(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, (n, 2, 16, 64), dtype=torch.int16, generator=gen)


@pytest.mark.parametrize("order", ["adjacent", "shuffled", "reversed"])
@pytest.mark.parametrize("large", [False, True])
def test_pages_round_trip_through_an_arena(order: str, large: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if large:
        monkeypatch.setattr(hostcopy, "_CPUS", 8)  # copy threads even on a 2-core machine
        monkeypatch.setattr(hostcopy, "PARALLEL_MIN_BYTES", 1)  # the threaded path, with runs cut in pieces
        monkeypatch.setattr(hostcopy, "PIECE_MIN_BYTES", PAGE * 3 + 8)  # pieces cut runs mid-page
    n = 64
    src = _pages(n + 4, seed=1)
    page = int(src[0].nbytes)
    arena = SlotArena(page * n * 2)
    allocated = [arena.allocate(page) for _ in range(n)]
    offsets = [off for off in allocated if off is not None]
    assert len(offsets) == n  # the arena holds twice as many pages
    slots = list(range(n))
    if order == "shuffled":
        random.Random(7).shuffle(slots)
    elif order == "reversed":
        slots.reverse()
    copy_many([(arena.span(offsets[s], page), src[2 + i]) for i, s in enumerate(slots)])  # pages -> arena
    dst = torch.zeros_like(src)
    copy_many([(dst[1 + i], arena.span(offsets[s], page)) for i, s in enumerate(slots)])  # arena -> pages
    assert torch.equal(dst[1 : 1 + n], src[2 : 2 + n])
    assert not dst[0].any() and not dst[n + 1 :].any()  # nothing written outside the targets


def test_numpy_torch_and_spans_mix() -> None:
    a = np.arange(3 * PAGE, dtype=np.uint8)
    t = torch.zeros(3, PAGE, dtype=torch.uint8)
    out = np.zeros(3 * PAGE, dtype=np.uint8)
    copy_many([(t[0], a[:PAGE]), (t[2], a[PAGE : 2 * PAGE]), (t[1], a[2 * PAGE :])])
    copy_many([(out[i * PAGE : (i + 1) * PAGE], t[i]) for i in range(3)])
    expect = np.concatenate([a[:PAGE], a[2 * PAGE :], a[PAGE : 2 * PAGE]])
    assert np.array_equal(out, expect)
    view = span_view((int(out.__array_interface__["data"][0]), 16))
    assert np.array_equal(view, expect[:16])


def test_size_mismatch_names_both_sizes() -> None:
    with pytest.raises(ValueError, match="4096-byte block into a 2048-byte buffer"):
        copy_many([(np.zeros(2048, np.uint8), np.zeros(4096, np.uint8))])


def test_read_only_buffer_is_not_written_by_address() -> None:
    src = np.arange(PAGE, dtype=np.uint8)
    frozen = np.zeros(PAGE, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        copy_many([(frozen, src)])
    assert not frozen.any()


def test_strided_buffer_is_refused() -> None:
    src = np.arange(PAGE, dtype=np.uint8)
    strided = torch.zeros(2 * PAGE, dtype=torch.uint8)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        copy_many([(strided, src)])


@pytest.mark.parametrize("background", [False, True])
def test_a_copy_never_waits_for_busy_copy_threads(background: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every thread of the pool is held (a long store, another load): the caller copies the
    pieces no thread took and returns (it used to wait for a free thread)."""
    monkeypatch.setattr(hostcopy, "_CPUS", 8)  # copy threads even on a 2-core machine
    monkeypatch.setattr(hostcopy, "PARALLEL_MIN_BYTES", 1)  # the threaded path
    monkeypatch.setattr(hostcopy, "PIECE_MIN_BYTES", PAGE)  # many pieces
    release = threading.Event()
    pool = hostcopy.copy_pool(background)
    blockers = [pool.submit(release.wait, 30) for _ in range(pool._max_workers)]
    try:
        src = np.arange(64 * PAGE, dtype=np.uint8)
        dst = np.zeros_like(src)
        done = threading.Event()

        def copy() -> None:
            copy_many([(dst[i * PAGE : (i + 1) * PAGE], src[i * PAGE : (i + 1) * PAGE]) for i in range(64)], background)
            done.set()

        threading.Thread(target=copy, daemon=True).start()
        assert done.wait(10), "a copy waited for a busy copy thread"
        assert np.array_equal(dst, src)
    finally:
        release.set()
        for b in blockers:
            b.result(timeout=30)


def test_loads_and_stores_have_their_own_copy_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostcopy, "_CPUS", 8)  # copy threads even on a 2-core machine
    assert hostcopy.copy_pool(False) is not hostcopy.copy_pool(True)
    src = np.arange(16 * 1024 * 1024, dtype=np.uint8)  # large enough for the threaded path
    dst = np.zeros_like(src)
    copy_many([(dst, src)], background=True)
    copy_many([(src, dst)])
    assert np.array_equal(dst, src)
    names = {t.name for t in threading.enumerate()}
    assert any(n.startswith("kvstrata-copy-bg") for n in names)
    assert any(n.startswith("kvstrata-copy_") for n in names)


def test_runs_merge_where_both_sides_are_adjacent() -> None:
    merge = hostcopy.merge_runs
    assert merge(range(1000, 1400, 100), [5000, 5100, 5200, 5300], 100) == [(1000, 5000, 400)]  # one run
    assert merge([0, 100, 300], [0, 100, 200], [100, 100, 100]) == [(0, 0, 200), (300, 200, 100)]
    assert merge([0, 100], [100, 0], 100) == [(0, 100, 100), (100, 0, 100)]  # adjacent on one side only
    many = list(range(0, 64 * 10, 10))  # the vectorized path (64 copies), one gap in the middle
    src = many[:32] + [s + 7 for s in many[32:]]
    assert merge(many, src, 10) == [(0, 0, 320), (320, 327, 320)]
    assert merge([], [], 8) == []
    with pytest.raises(ValueError, match="2 destinations for 1 sources"):
        merge([0, 1], [0], 1)


def test_a_large_copy_in_many_pieces_lands_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostcopy, "_CPUS", 8)
    monkeypatch.setattr(hostcopy, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(hostcopy, "PIECE_MIN_BYTES", 3 * PAGE + 5)  # pieces cut runs at odd offsets
    src = np.random.default_rng(3).integers(0, 256, 257 * PAGE, dtype=np.uint8)
    dst = np.zeros(259 * PAGE, dtype=np.uint8)
    s0, d0 = int(src.ctypes.data), int(dst.ctypes.data)
    hostcopy.copy_runs([d0 + PAGE, d0 + 200 * PAGE], [s0, s0 + 199 * PAGE], [199 * PAGE, 58 * PAGE])
    assert np.array_equal(dst[PAGE : 200 * PAGE], src[: 199 * PAGE])
    assert np.array_equal(dst[200 * PAGE : 258 * PAGE], src[199 * PAGE :])
    assert not dst[:PAGE].any() and not dst[258 * PAGE :].any()


def test_row_addresses_of_arrays_tensors_and_lists() -> None:
    from kvstrata.core.buffers import row_addresses

    arr = np.zeros((8, PAGE), np.uint8)
    base = int(arr.ctypes.data)
    assert list(row_addresses(arr, range(2, 5), PAGE, write=True) or []) == [base + i * PAGE for i in (2, 3, 4)]
    assert list(row_addresses(arr, [6, 1], PAGE, write=True) or []) == [base + 6 * PAGE, base + PAGE]
    t = torch.zeros(4, 2, PAGE // 2, dtype=torch.uint8)
    assert list(row_addresses(t, [0, 3], PAGE, write=True) or []) == [t.data_ptr(), t.data_ptr() + 3 * PAGE]
    pages = [t[3], t[1]]  # a list of per-block tensors, as vLLM's pages
    assert row_addresses(pages, [0, 1], PAGE, write=False) == [t[3].data_ptr(), t[1].data_ptr()]
    with pytest.raises(IndexError):
        row_addresses(arr, [8], PAGE, write=False)
    frozen = arr.copy()
    frozen.flags.writeable = False
    assert row_addresses(frozen, [0], PAGE, write=True) is None  # never written by address
    assert row_addresses(frozen, [0], PAGE, write=False) is not None
    assert row_addresses(np.zeros((8, 2 * PAGE), np.uint8)[:, ::2], [0], PAGE, write=False) is None  # strided
    assert row_addresses(arr, [0], PAGE // 2, write=False) is None  # rows of another size


def test_layers_row_addresses_equal_row_addresses_layer_by_layer() -> None:
    """The batched address read (one extension call for every numpy layer, on the native path)
    gives what row_addresses gives layer by layer, for every kind of layer buffer, and None, the
    same IndexError, where that does."""
    from kvstrata.core.buffers import layers_row_addresses, row_addresses

    arr = np.zeros((8, PAGE), np.uint8)
    wide = np.zeros((8, 2 * PAGE), np.float16)  # another dtype, rows of 4 pages
    t = torch.zeros(8, 2, PAGE // 2, dtype=torch.uint8)
    pages = [t[i] for i in range(8)]
    layers = [arr, wide, t, pages, arr[2:]]
    sizes = [PAGE, 4 * PAGE, PAGE, PAGE, PAGE]
    for positions in (range(1, 5), range(0, 6), [5, 2, 3], range(3, 3)):
        got = layers_row_addresses(layers, positions, sizes, write=True)
        want = [row_addresses(b, positions, n, True) for b, n in zip(layers, sizes, strict=True)]
        assert got is not None
        assert [list(a) for a in got] == [list(a or []) for a in want]
    assert list(layers_row_addresses([arr], range(6, 8), [PAGE], False)[0]) == [  # type: ignore[index]
        int(arr.ctypes.data) + i * PAGE for i in (6, 7)
    ]
    with pytest.raises(IndexError, match=re.escape("out of range 0..5")):
        layers_row_addresses([arr, arr[2:]], range(4, 7), [PAGE, PAGE], False)
    frozen = arr.copy()
    frozen.flags.writeable = False
    assert layers_row_addresses([arr, frozen], range(2), [PAGE, PAGE], write=True) is None
    assert layers_row_addresses([arr, frozen], range(2), [PAGE, PAGE], write=False) is not None
    strided = np.zeros((8, 2 * PAGE), np.uint8)[:, ::2]
    assert layers_row_addresses([arr, strided], range(2), [PAGE, PAGE], write=False) is None
    assert layers_row_addresses([arr], range(2), [PAGE // 2], write=False) is None  # rows of another size
    flat = np.zeros(8 * PAGE, np.uint8)  # one dimension: rows are not its first axis
    assert row_addresses(flat, range(2), PAGE, False) is None
    assert layers_row_addresses([flat], range(2), [PAGE], write=False) is None


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_pages_address_pages_as_their_views_do(kind: str) -> None:
    """Pages of a cache whose pages are contiguous but not adjacent (two layers interleaved per
    page, as cross-layer layouts have): the same addresses as a list of the pages' views."""
    from kvstrata.core.buffers import Pages, row_addresses

    whole = np.zeros((10, 2, PAGE), np.uint8) if kind == "numpy" else torch.zeros(10, 2, PAGE, dtype=torch.uint8)
    layer = whole[:, 1]  # page i of this layer: PAGE bytes, 2 * PAGE apart
    ids = [7, 2, 3, 9]
    pages = Pages(layer, ids)
    views = [layer[i] for i in ids]
    assert len(pages) == 4 and all(
        row_addresses([pages[i]], [0], PAGE, True) == row_addresses([v], [0], PAGE, True) for i, v in enumerate(views)
    )
    for positions in (range(4), [3, 0], range(1, 3)):
        assert row_addresses(pages, positions, PAGE, True) == row_addresses(views, positions, PAGE, True)
    assert row_addresses(pages, range(0), PAGE, True) == []
    assert row_addresses(pages, [0], PAGE // 2, True) is None  # pages of another size
    with pytest.raises(IndexError, match=re.escape("page ids out of range 0..9")):
        row_addresses(Pages(layer, [3, 10]), range(2), PAGE, True)
    strided = whole[:, :, ::2]
    assert row_addresses(Pages(strided, [0, 1]), range(2), PAGE, False) is None  # a page is not contiguous


def test_rows_fit_checks_a_whole_array_of_rows() -> None:
    from kvstrata.core.buffers import rows_fit

    arr = np.zeros((8, 2, PAGE // 2), np.uint8)
    assert rows_fit(arr, 8, PAGE) and rows_fit(arr, 3, PAGE)
    assert not rows_fit(arr, 9, PAGE)  # too few rows
    assert not rows_fit(arr, 8, PAGE // 2)  # rows of another size
    assert not rows_fit(np.zeros((8, 2 * PAGE), np.uint8)[:, ::2], 8, PAGE)  # strided
    assert not rows_fit(np.zeros(8 * PAGE, np.uint8), 8, PAGE)  # flat
    assert rows_fit(torch.zeros(4, PAGE // 2, dtype=torch.float16), 4, PAGE)
    assert not rows_fit(torch.zeros(PAGE, 4, dtype=torch.uint8).t(), 4, PAGE)  # transposed
    assert not rows_fit([arr[0]], 1, PAGE)  # a list: checked row by row by the caller


def test_copy_threads_are_set_by_the_environment_or_a_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVSTRATA_COPY_THREADS`` (or set_copy_threads) overrides half-the-CPUs: on a 2-core machine
    the default is one thread, and 2 set makes a large copy use a pool thread beside the caller."""
    assert hostcopy._threads_setting(None) is None
    assert hostcopy._threads_setting(" Auto ") is None
    assert hostcopy._threads_setting("2") == 2
    for bad in ("0", "-1", "two", "1.5", "65"):
        with pytest.raises(ValueError, match=f"KVSTRATA_COPY_THREADS must be auto .*got '{re.escape(bad)}'"):
            hostcopy._threads_setting(bad)
    with pytest.raises(ValueError, match="got 0"):
        hostcopy.set_copy_threads(0)
    monkeypatch.setattr(hostcopy, "_CPUS", 2)
    monkeypatch.setattr(hostcopy, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(hostcopy, "PIECE_MIN_BYTES", PAGE)  # many pieces
    assert hostcopy.copy_threads() == 1
    seen: set[str] = set()
    real = hostcopy.Copy._work

    def work(self: hostcopy.Copy) -> None:
        seen.add(threading.current_thread().name)
        real(self)

    monkeypatch.setattr(hostcopy.Copy, "_work", work)
    src = np.random.default_rng(5).integers(0, 256, 256 * PAGE, dtype=np.uint8)
    with hostcopy.using_copy_threads(2):
        assert hostcopy.copy_threads() == 2
        assert hostcopy.copy_pool(False)._max_workers == 1  # the caller is the second thread
        for _ in range(20):  # the pool thread takes pieces in at least one of them
            dst = np.zeros_like(src)
            hostcopy.copy_runs([int(dst.ctypes.data)], [int(src.ctypes.data)], [src.nbytes])
            assert np.array_equal(dst, src)
            if any(n.startswith("kvstrata-copy_") for n in seen):
                break
    assert any(n.startswith("kvstrata-copy_") for n in seen), seen
    assert hostcopy.copy_threads() == 1  # the setting before the block


def test_a_bad_copy_threads_variable_stops_the_import_with_its_value() -> None:
    import subprocess
    import sys

    env = {**os.environ, "KVSTRATA_COPY_THREADS": "lots"}
    proc = subprocess.run(
        [sys.executable, "-c", "import kvstrata.core.hostcopy"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert "KVSTRATA_COPY_THREADS must be auto or a whole number 1..64, got 'lots'" in proc.stderr
