"""copy_many: copies by address, merging runs that are adjacent on both sides."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvstrata.core import buffers
from kvstrata.core.buffers import copy_many, span_view
from kvstrata.tiers.memory import SlotArena

PAGE = 4096


def _pages(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, (n, 2, 16, 64), dtype=torch.int16, generator=gen)


@pytest.mark.parametrize("order", ["adjacent", "shuffled", "reversed"])
@pytest.mark.parametrize("large", [False, True])
def test_pages_round_trip_through_an_arena(order: str, large: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if large:
        monkeypatch.setattr(buffers, "PARALLEL_MIN_BYTES", 1)  # the threaded path, with runs cut in pieces
        monkeypatch.setattr(buffers, "COPY_CHUNK", PAGE * 3 + 8)
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


def test_loads_do_not_queue_behind_background_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    monkeypatch.setattr(buffers, "PARALLEL_MIN_BYTES", 1)  # both copies take the threaded path
    release = threading.Event()
    bg = buffers._copy_pool(background=True)
    blockers = [bg.submit(release.wait, 30) for _ in range(bg._max_workers)]  # a long store holds them all
    try:
        src = np.arange(64 * PAGE, dtype=np.uint8)
        dst = np.zeros_like(src)
        done = threading.Event()

        def load() -> None:
            copy_many([(dst[i * PAGE : (i + 1) * PAGE], src[i * PAGE : (i + 1) * PAGE]) for i in range(64)])
            done.set()

        threading.Thread(target=load, daemon=True).start()
        assert done.wait(10), "a foreground copy waited for the background pool"
        assert np.array_equal(dst, src)
        queued = threading.Event()

        def background_copy() -> None:
            copy_many([(dst, src)], background=True)
            queued.set()

        threading.Thread(target=background_copy, daemon=True).start()
        assert not queued.wait(0.2)  # background copies do wait for their own pool
    finally:
        release.set()
        for b in blockers:
            b.result(timeout=30)
    assert queued.wait(10)
    names = {t.name for t in threading.enumerate()}
    assert any(n.startswith("kvstrata-copy-bg") for n in names)
