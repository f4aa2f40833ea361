"""Scrubbing: read every persistent block back and check its checksum, within an I/O budget.

A background thread walks each open persistent tier of each namespace (NVMe in on-disk order,
so the reads are sequential; fs object by object), reading batches through the tier's own
``read``, which verifies the xxh3_64 of every layer-block. A block that fails is quarantined by
the tier itself (NVMe: dropped from the shared index, so no process serves it again; fs: its
object moved to ``quarantine/``), counted (``kvstrata_daemon_scrub_bad_blocks_total``) and
recorded in ``<state_dir>/quarantine.jsonl``. A token bucket holds the reads to
``scrub_bytes_per_s`` averaged over any second (one batch is at most a second's budget, and at
most 4 MiB); a full pass of a tier is followed by ``scrub_pause_s`` of rest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstrata.errors import TierError
from kvstrata.tiers import BlockId, ReadStatus, Tier, indexed

from .metrics import DaemonMetrics
from .namespaces import ManagedNamespace, TierPlan

log = logging.getLogger("kvstrata.daemon.scrub")

MAX_BATCH = 4 * 1024**2
Targets = Callable[[], list[tuple[ManagedNamespace, TierPlan, Tier]]]
OnBad = Callable[[ManagedNamespace, TierPlan, Sequence[tuple[BlockId, ReadStatus]]], None]


class TokenBucket:
    """``rate`` bytes per second, bursts up to ``burst`` bytes."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._at = time.monotonic()

    def take(self, n: int, stop: threading.Event) -> bool:
        """Wait until ``n`` bytes may be read (then spend them); False if ``stop`` is set first."""
        while not stop.is_set():
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
            if self._tokens >= min(n, self.burst):
                self._tokens -= n  # may go negative for a batch over the burst: later reads wait
                return True
            stop.wait((min(n, self.burst) - self._tokens) / self.rate)
        return False


@dataclass
class ScrubProgress:
    """What ``/status`` shows about the scrubber."""

    tier: str = ""
    namespace: str = ""
    done_blocks: int = 0
    total_blocks: int = 0
    passes: int = 0
    bytes: int = 0
    bad: int = 0
    started: float = 0.0  # monotonic start of the scrubber
    state: str = "idle"

    def to_dict(self) -> dict[str, Any]:
        elapsed = max(1e-9, time.monotonic() - self.started) if self.started else 0.0
        return {
            "state": self.state,
            "tier": self.tier,
            "namespace": self.namespace,
            "done_blocks": self.done_blocks,
            "total_blocks": self.total_blocks,
            "passes": self.passes,
            "bytes": self.bytes,
            "bad_blocks": self.bad,
            "bytes_per_s": self.bytes / elapsed if elapsed else 0.0,
        }


class Scrubber:
    """The scrub thread (start/stop with the daemon; ``rate`` may change on reload)."""

    def __init__(
        self, metrics: DaemonMetrics, targets: Targets, on_bad: OnBad, rate: int, pause_s: float, stop: threading.Event
    ) -> None:
        self.metrics = metrics
        self.targets = targets
        self.on_bad = on_bad
        self.stop = stop
        self.pause_s = pause_s
        self.bucket = TokenBucket(rate, min(rate, MAX_BATCH))
        self.progress = ScrubProgress()
        self._next_pass: dict[tuple[str, str], float] = {}
        self._thread: threading.Thread | None = None

    def set_rate(self, rate: int, pause_s: float) -> None:
        self.bucket.rate, self.bucket.burst = rate, min(rate, MAX_BATCH)
        self.pause_s = pause_s

    def start(self) -> None:
        if self.bucket.rate <= 0:
            log.info("scrubbing is off (scrub_bytes_per_s = 0)")
            return
        self.progress.started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kvstrata-scrub", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self.stop.is_set():
            did = False
            for ns, plan, tier in self.targets():
                if self.stop.is_set() or self.bucket.rate <= 0:
                    break
                key = (ns.fingerprint, plan.name)
                if time.monotonic() < self._next_pass.get(key, 0.0):
                    continue
                try:
                    self.scrub_tier(ns, plan, tier)
                except TierError as exc:  # closed by a reload, or the store is down
                    log.debug("scrub of %s %s interrupted: %s", plan.name, ns.label, exc)
                except Exception:  # pragma: no cover - never let the thread die silently
                    self.metrics.errors.labels("scrub").inc()
                    log.exception("scrub of %s %s failed", plan.name, ns.label)
                self._next_pass[key] = time.monotonic() + self.pause_s
                did = True
            self.progress.state = "idle"
            self.stop.wait(0.05 if did else 0.5)

    def scrub_tier(self, ns: ManagedNamespace, plan: TierPlan, tier: Tier) -> bool:
        """One pass over ``tier``; True when it completed (not stopped)."""
        with ns.lock:  # the namespace is not closed (reload) under an index walk
            items = _items(tier)
        p = self.progress
        p.tier, p.namespace, p.done_blocks, p.total_blocks, p.state = plan.name, ns.fingerprint, 0, len(items), "busy"
        lo = 0
        while lo < len(items):
            hi, size = lo, 0
            while hi < len(items) and (hi == lo or size + items[hi][1] <= min(MAX_BATCH, self.bucket.burst)):
                size += items[hi][1]
                hi += 1
            if not self.bucket.take(size, self.stop):
                return False
            self._check(ns, plan, tier, items[lo:hi])
            p.done_blocks, p.bytes = hi, p.bytes + size
            lo = hi
        p.passes += 1
        self.metrics.scrub_passes.labels(plan.name).inc()
        log.info(
            "scrubbed %s of %s: %d layer-blocks",
            plan.name,
            ns.label,
            len(items),
            extra={"event": "scrub_pass", "tier": plan.name, "namespace": ns.fingerprint, "blocks": len(items)},
        )
        return True

    def _check(self, ns: ManagedNamespace, plan: TierPlan, tier: Tier, batch: list[tuple[BlockId, int]]) -> None:
        bufs = [np.empty(n, dtype=np.uint8) for _, n in batch]
        with ns.lock:  # the namespace is not closed (reload) under a read
            statuses = tier.read([(bid, buf) for (bid, _), buf in zip(batch, bufs, strict=True)])
        ok = [(bid, n) for (bid, n), s in zip(batch, statuses, strict=True) if s is ReadStatus.OK]
        self.metrics.scrubbed_blocks.labels(plan.name).inc(len(ok))
        self.metrics.scrubbed_bytes.labels(plan.name).inc(sum(n for _, n in ok))
        bad = [(bid, s) for (bid, _), s in zip(batch, statuses, strict=True) if s is ReadStatus.CORRUPT]
        self.metrics.scrub_bad.labels(plan.name, "corrupt").inc(len(bad))
        self.metrics.errors.labels("scrub_read").inc(sum(1 for s in statuses if s is ReadStatus.ERROR))
        if bad:
            self.progress.bad += len(bad)
            self.on_bad(ns, plan, bad)


def _items(tier: Tier) -> list[tuple[BlockId, int]]:
    """Every layer-block of ``tier`` with its size, in the order that reads it fastest."""
    if indexed(tier):  # capabilities.records (NVMe): on-disk order
        return [(bid, loc.length) for bid, loc in tier.records()]
    return list(tier.scan())
