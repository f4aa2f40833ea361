"""The nvme tier's pipeline of CPU work and I/O (kvstrata.tiers.nvme.lanes): every chunk goes
through its steps once, in order per chunk, never two chunks in one buffer at a time; I/O threads
find their next chunk without waiting for a copy; a failure anywhere stops the rest and is raised,
with no thread left waiting."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvstrata.tiers.nvme.lanes import Pipeline, cpu_workers


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as p:
        yield p


class Ledger:
    """Which chunk holds which buffer, checked at every step."""

    def __init__(self, buffers: list[np.ndarray]) -> None:
        self.ids = {id(b): i for i, b in enumerate(buffers)}
        self.holder: dict[int, int] = {}
        self.lock = threading.Lock()
        self.steps: list[tuple[str, int]] = []

    def take(self, step: str, k: int, buf: np.ndarray) -> None:
        with self.lock:
            b = self.ids[id(buf)]
            if step in ("before", "io-read"):  # a chunk's first step takes a free buffer
                assert b not in self.holder, f"buffer {b} given to chunk {k} while chunk {self.holder.get(b)} has it"
                self.holder[b] = k
            else:
                assert self.holder.get(b) == k, f"chunk {k}'s {step} got buffer {b} of chunk {self.holder.get(b)}"
            self.steps.append((step, k))

    def give(self, k: int, buf: np.ndarray) -> None:
        with self.lock:
            assert self.holder.pop(self.ids[id(buf)]) == k


@pytest.mark.parametrize("cpu", [1, 2])
def test_a_write_stages_every_chunk_once_and_writes_it_after(pool: ThreadPoolExecutor, cpu: int) -> None:
    buffers = [np.zeros(8, np.uint8) for _ in range(2 + cpu + 1)]
    ledger = Ledger(buffers)

    def before(k: int, buf: np.ndarray) -> int:
        ledger.take("before", k, buf)
        buf[0] = k % 256
        time.sleep(0.001)
        return k * 10

    def io(k: int, buf: np.ndarray) -> int:
        ledger.take("io", k, buf)
        assert buf[0] == k % 256  # the bytes its own before step staged
        time.sleep(0.003)
        ledger.give(k, buf)
        return 8

    results = Pipeline(pool, buffers, 2, cpu, io, before=before).run(40)
    assert results == [k * 10 for k in range(40)]
    for k in range(40):
        assert ledger.steps.index(("before", k)) < ledger.steps.index(("io", k))
    assert not ledger.holder


@pytest.mark.parametrize("cpu", [1, 2])
def test_a_read_fed_in_parts_delivers_every_chunk_once(pool: ThreadPoolExecutor, cpu: int) -> None:
    buffers = [np.zeros(8, np.uint8) for _ in range(3 + cpu)]
    ledger = Ledger(buffers)
    delivered: list[int] = []

    def io(k: int, buf: np.ndarray) -> int:
        ledger.take("io-read", k, buf)
        buf[0] = k % 256
        time.sleep(0.002)
        return k + 1000

    def after(k: int, buf: np.ndarray, got: int) -> None:
        ledger.take("after", k, buf)
        assert got == k + 1000 and buf[0] == k % 256
        ledger.give(k, buf)
        with ledger.lock:
            delivered.append(k)

    pipe: Pipeline[None] = Pipeline(pool, buffers, 2, cpu, io, after=after)
    pipe.start()
    pipe.feed(range(5))
    time.sleep(0.02)  # the caller plans the rest while the first reads run
    pipe.feed(range(5, 30))
    pipe.finish()
    assert sorted(delivered) == list(range(30))
    assert not ledger.holder


def test_reads_go_on_while_a_delivery_is_slow_as_far_as_the_free_buffers_reach(pool: ThreadPoolExecutor) -> None:
    """The I/O threads never wait for a CPU worker while a buffer is free: with the one delivery
    of chunk 0 held up, chunks 1-3 are still read into the other three buffers, and nothing more
    (every buffer then holds a chunk waiting for delivery) until the delivery goes on."""
    buffers = [np.zeros(8, np.uint8) for _ in range(4)]
    read: list[int] = []
    cond = threading.Condition()
    hold = threading.Event()

    def io(k: int, buf: np.ndarray) -> int:
        with cond:
            read.append(k)
            cond.notify_all()
        return 0

    def after(k: int, buf: np.ndarray, got: int) -> None:
        if k == 0:
            assert hold.wait(10)

    pipe: Pipeline[None] = Pipeline(pool, buffers, 2, 1, io, after=after)
    runner = threading.Thread(target=pipe.run, args=(20,), daemon=True)
    runner.start()
    with cond:
        assert cond.wait_for(lambda: len(read) >= 4, 10)
        assert not cond.wait_for(lambda: len(read) > 4, 0.3)  # bounded by the buffers
    assert sorted(read) == [0, 1, 2, 3]
    hold.set()
    runner.join(10)
    assert not runner.is_alive() and sorted(read) == list(range(20))


@pytest.mark.parametrize("where", ["before", "io", "after"])
def test_a_failure_in_any_step_is_raised_and_nothing_hangs(pool: ThreadPoolExecutor, where: str) -> None:
    buffers = [np.zeros(8, np.uint8) for _ in range(4)]
    seen: list[int] = []

    def maybe(step: str, k: int) -> None:
        if step == where and k == 7:
            raise OSError(f"{step} of chunk {k} failed")

    def before(k: int, buf: np.ndarray) -> int:
        maybe("before", k)
        return k

    def io(k: int, buf: np.ndarray) -> int:
        maybe("io", k)
        seen.append(k)
        time.sleep(0.001)
        return 0

    def after(k: int, buf: np.ndarray, got: int) -> None:
        maybe("after", k)

    if where == "after":
        pipe: Pipeline[int] = Pipeline(pool, buffers, 2, 1, io, after=after)
    else:
        pipe = Pipeline(pool, buffers, 2, 1, io, before=before if where == "before" else (lambda k, b: k))
    done = threading.Event()
    errors: list[BaseException] = []

    def go() -> None:
        try:
            pipe.run(200)
        except OSError as exc:
            errors.append(exc)
        done.set()

    threading.Thread(target=go, daemon=True).start()
    assert done.wait(10), "the pipeline hung after a failure"
    assert [str(e) for e in errors] == [f"{where} of chunk 7 failed"]
    assert len(seen) < 200  # it stopped taking chunks


@pytest.mark.parametrize("cores", [1, 2, 3, 4, 64])
def test_cpu_workers_leave_the_io_threads_their_cores(monkeypatch: pytest.MonkeyPatch, cores: int) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert cpu_workers(2) == max(1, min(2, cores - 2))


@pytest.mark.parametrize("cpu", [1, 2])
def test_an_early_part_runs_on_an_io_thread_before_its_chunk_is_staged(pool: ThreadPoolExecutor, cpu: int) -> None:
    """``early`` from a ``before`` step: an I/O thread runs it while that step goes on (the step
    here waits for it), the buffer stays with its chunk, and the chunk's ``io`` still follows."""
    buffers = [np.zeros(8, np.uint8) for _ in range(2 + cpu + 1)]
    ledger = Ledger(buffers)
    early_ran: dict[int, threading.Event] = {}
    order: list[tuple[str, int]] = []

    def before(k: int, buf: np.ndarray) -> int:
        ledger.take("before", k, buf)
        if k % 3 == 0:
            ran = early_ran[k] = threading.Event()

            def part() -> None:
                order.append(("early", k))
                ran.set()

            pipe.early(k, part)
            assert ran.wait(5), f"chunk {k}'s early part did not run while it was staged"
        return k

    def io(k: int, buf: np.ndarray) -> int:
        ledger.take("io", k, buf)
        order.append(("io", k))
        ledger.give(k, buf)
        return 0

    pipe: Pipeline[int] = Pipeline(pool, buffers, 2, cpu, io, before=before)
    assert pipe.run(30) == list(range(30))
    assert sorted(k for step, k in order if step == "io") == list(range(30))
    assert sorted(k for step, k in order if step == "early") == list(range(0, 30, 3))
    for k in range(0, 30, 3):
        assert order.index(("early", k)) < order.index(("io", k))


def test_a_failed_early_part_fails_the_run(pool: ThreadPoolExecutor) -> None:
    buffers = [np.zeros(8, np.uint8) for _ in range(4)]

    def before(k: int, buf: np.ndarray) -> int:
        if k == 2:
            pipe.early(k, lambda: (_ for _ in ()).throw(OSError("early part of chunk 2 failed")))
        return k

    pipe: Pipeline[int] = Pipeline(pool, buffers, 2, 1, lambda k, b: 0, before=before)
    with pytest.raises(OSError, match="early part of chunk 2 failed"):
        pipe.run(50)
