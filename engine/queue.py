"""The store queue: how a store batch gets into the engine's queue budget, prefix first.

A store batch holds the caller's buffers until its future completes; ``max_pending_bytes`` bounds
the bytes of batches queued or being written (``max_pending_stores`` their number). A batch larger
than the free budget is not dropped whole: it is split, and its longest prefix that fits now is
admitted as one *part* (the prefix is the most valuable piece: every later block depends on it).
The rest waits, in arrival order behind earlier waiting batches, and is admitted part by part as
the budget frees. Whatever of a batch is not admitted ``store_wait_s`` seconds after the store
call (a stuck tier, a producer faster than the tiers) is dropped, counted per block, and so is a
block larger than the whole budget: the caller gets its buffers back within a bounded time, and
what waits is bounded by what the caller produces in that time. With ``store_wait_s = 0``
nothing waits: what does not fit at once is dropped (still prefix first).

Every key of a batch counts as in flight (a load waits for it) until its part is written or it
is dropped; the batch's own event is set when every block is accounted for. One daemon thread
wakes to drop batches whose wait ran out when no finishing part would.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvstrata.engine.plans import Pin, WriteJob
from kvstrata.engine.results import StoreResult
from kvstrata.engine.state import EngineState
from kvstrata.units import total_size

log = logging.getLogger("kvstrata.engine")

__all__ = ["StoreQueue", "StoreTicket", "budget_parts", "pending_budget"]

MIN_AUTO_PENDING = 256 * 1024**2
MAX_AUTO_PENDING = 16 * 1024**3
AUTO_PENDING_FRACTION = 8  # "auto": an eighth of the top tier


def pending_budget(setting: int | str, top_capacity: int | None) -> int:
    """``max_pending_bytes`` in bytes: ``"auto"`` is an eighth of the top tier's capacity, at least
    256 MiB and at most 16 GiB (2 GiB when the top tier is unbounded)."""
    if setting != "auto":
        return int(setting)
    if top_capacity is None:
        return 2 * 1024**3
    return min(max(int(top_capacity) // AUTO_PENDING_FRACTION, MIN_AUTO_PENDING), MAX_AUTO_PENDING)


def budget_parts(costs: list[int], budget: int) -> list[tuple[int, int]]:
    """The parts ``[a, b)`` the queue admits a batch of ``costs`` in when nothing else is queued:
    each the longest run that fits ``budget``; they stop at a block larger than the budget (it
    and the blocks after it are dropped). The planner's simulators store in these parts."""
    parts: list[tuple[int, int]] = []
    a = 0
    while a < len(costs):
        b, total = a, 0
        while b < len(costs) and total + costs[b] <= budget:
            total += costs[b]
            b += 1
        if b == a:
            break
        parts.append((a, b))
        a = b
    return parts


@dataclass
class StoreTicket:
    """One store batch on its way in: ``job`` holds every block it writes, in chain order."""

    job: WriteJob
    costs: list[int]  # queue bytes of each job position
    result: StoreResult
    pinned: list[Pin]  # blocks that must survive the whole batch (released when it is done)
    deadline: float
    future: Future[StoreResult] = field(default_factory=Future)
    next: int = 0  # first job position not admitted yet
    running: int = 0  # parts queued or being written
    finished: bool = False

    @property
    def left(self) -> int:
        return len(self.job.keys) - self.next

    def waiting_bytes(self) -> int:
        return sum(self.costs[self.next :])


Writer = Callable[[WriteJob], tuple[int, int]]  # a part -> (blocks stored, blocks failed)


class StoreQueue:
    """Admission of store batches into the queue budget, and the parts' lifecycle."""

    def __init__(
        self,
        state: EngineState,
        budget: int,
        submit: Callable[..., object],
        writer: Writer,
        unpin: Callable[[list[Pin]], None],
    ) -> None:
        self.s = state
        self.budget = budget
        self.wait_s = state.config.engine.store_wait_s
        self.max_stores = state.config.engine.max_pending_stores
        self._submit = submit  # runs a part on an I/O thread
        self.writer = writer
        self.unpin = unpin
        self.waiting: deque[StoreTicket] = deque()
        self._wake = threading.Condition(state.lock)
        self._closed = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ entry
    def submit(self, job: WriteJob, costs: list[int], result: StoreResult, pinned: list[Pin]) -> Future[StoreResult]:
        """Lock held: queue a batch (its keys are marked in flight here). Never blocks."""
        s = self.s
        t = StoreTicket(job, costs, result, pinned, time.monotonic() + self.wait_s)
        if job.masks is None:  # every key the job's layers: one entry for all
            s.inflight.update(dict.fromkeys(job.keys, (job.mask, job.done)))
        else:
            for j, key in enumerate(job.keys):
                s.inflight[key] = (job.mask_of(j), job.done)
        done: list[StoreTicket] = []
        if not self.waiting:
            self._admit(t)
        if t.left:
            if self.wait_s <= 0:
                self._drop_rest(t)
            else:
                self.waiting.append(t)
                s.backlog.waiting_stores += 1
                s.backlog.waiting_bytes += t.waiting_bytes()
                self._ensure_thread()
                self._wake.notify_all()
        self._maybe_finish(t, done)
        self._complete(done)  # only a batch that was dropped whole or empty completes here
        return t.future

    # ------------------------------------------------------------------ admission
    def _admit(self, t: StoreTicket) -> bool:
        """Lock held: start the longest prefix of ``t``'s remaining blocks that fits the free budget.
        Returns whether a part started."""
        b = self.s.backlog
        if not t.left or b.pending_stores >= self.max_stores:
            return False
        if t.costs[t.next] > self.budget:  # can never fit: it and what depends on it are dropped
            self._drop_from(t, t.next)
            return False
        free = self.budget - b.pending_bytes
        end, cost = t.next, 0
        rest = total_size(t.costs[t.next :]) if t.next else total_size(t.costs)
        if rest <= free:  # usual: all of it fits
            end, cost = len(t.costs), rest
        while end < len(t.costs) and cost + t.costs[end] <= free:
            cost += t.costs[end]
            end += 1
        if end == t.next:
            return False
        part = t.job if t.next == 0 and end == len(t.costs) else _slice(t.job, t.next, end)  # usual: all
        top = self.s.tiers[0]
        pins = self.s.pin(top, [part.parents[0]]) if t.next else []  # the part's parent must stay
        t.next = end
        t.running += 1
        b.pending_stores += 1
        b.pending_bytes += cost
        self._submit(self._run, t, part, cost, pins)
        return True

    def _run(self, t: StoreTicket, part: WriteJob, cost: int, pins: list[Pin]) -> None:
        s = self.s
        try:
            stored, failed = self.writer(part)
        except Exception:  # a tier fault must never reach the caller as an exception
            log.exception("store failed")
            stored, failed = 0, len(part.keys)
        done: list[StoreTicket] = []
        with s.lock:
            t.result.stored += stored
            t.result.failed += failed
            self.unpin(pins)
            self._clear_inflight(t, part.keys)
            s.backlog.pending_stores -= 1
            s.backlog.pending_bytes -= cost
            t.running -= 1
            self._pump(done)
            self._maybe_finish(t, done)
            s.notify_if_idle()
        part.done.set()
        self._complete(done)

    def _pump(self, done: list[StoreTicket]) -> None:
        """Lock held: drop waiting batches whose wait ran out, then admit in arrival order."""
        b = self.s.backlog
        now = time.monotonic()
        for t in [t for t in self.waiting if t.deadline <= now]:
            self._unwait(t)
            self._drop_rest(t)
            self._maybe_finish(t, done)
        while self.waiting:
            head = self.waiting[0]
            before = head.waiting_bytes()
            progressed = self._admit(head)
            b.waiting_bytes -= before - head.waiting_bytes()
            if head.left:
                if not progressed:
                    break
                continue
            self._unwait(head)
            self._maybe_finish(head, done)

    def _unwait(self, t: StoreTicket) -> None:
        b = self.s.backlog
        self.waiting.remove(t)
        b.waiting_stores -= 1
        b.waiting_bytes -= t.waiting_bytes()

    # ------------------------------------------------------------------ dropping, finishing
    def _drop_rest(self, t: StoreTicket) -> None:
        if t.left:
            self._drop_from(t, t.next)

    def _drop_from(self, t: StoreTicket, start: int) -> None:
        """Lock held: drop blocks ``start..`` of ``t`` (not admitted), counted per block."""
        n = len(t.job.keys) - start
        b = self.s.backlog
        b.dropped_blocks += n
        if not t.result.dropped:
            b.dropped_stores += 1
        t.result.dropped = True
        t.result.dropped_blocks += n
        self._clear_inflight(t, t.job.keys[start:])
        del t.costs[start:]
        t.job = _slice(t.job, 0, start, done=t.job.done)

    def _clear_inflight(self, t: StoreTicket, keys: list[bytes]) -> None:
        inflight = self.s.inflight
        for key in keys:
            if inflight.get(key, (0, None))[1] is t.job.done:
                del inflight[key]

    def _maybe_finish(self, t: StoreTicket, done: list[StoreTicket]) -> None:
        """Lock held: a batch with every block written or dropped is done."""
        if t.finished or t.left or t.running:
            return
        t.finished = True
        self.unpin(t.pinned)
        self.s.notify_if_idle()
        done.append(t)

    def _complete(self, done: list[StoreTicket]) -> None:
        """Outside the lock: wake loads waiting on the batches and complete their futures."""
        for t in done:
            t.job.done.set()
            t.future.set_result(t.result)

    # ------------------------------------------------------------------ the deadline thread
    def _ensure_thread(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._watch, name="kvstrata-store-wait", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        while True:
            done: list[StoreTicket] = []
            with self.s.lock:
                if self._closed:
                    return
                if not self.waiting:
                    self._wake.wait()
                    continue
                delay = min(t.deadline for t in self.waiting) - time.monotonic()
                if delay > 0:
                    self._wake.wait(delay)
                    continue
                self._pump(done)
                self.s.notify_if_idle()
            self._complete(done)

    def close(self) -> None:
        """Drop whatever still waits and stop the deadline thread."""
        done: list[StoreTicket] = []
        with self.s.lock:
            self._closed = True
            for t in list(self.waiting):
                self._unwait(t)
                self._drop_rest(t)
                self._maybe_finish(t, done)
            self._wake.notify_all()
        self._complete(done)
        if self._thread is not None:
            self._thread.join(timeout=5)


def _slice(job: WriteJob, a: int, b: int, done: threading.Event | None = None) -> WriteJob:
    """Positions ``a..b`` of ``job`` as a job of their own (the caller's buffers are shared)."""
    part = WriteJob(
        job.keys[a:b],
        job.parents[a:b],
        job.mask,
        job.layer_bufs,
        job.src_index[a:b],
        masks=None if job.masks is None else job.masks[a:b],
        positions=None if job.positions is None else job.positions[a:b],
    )
    if done is not None:
        part.done = done
    return part
