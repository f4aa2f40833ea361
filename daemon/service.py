"""The daemon's main loop: one long-running process per node, beside the inference processes.

Start-up
    Load and validate the config (a bad one is a clear error and exit status 2), take the
    state directory's lock (one daemon per node and state directory), start the HTTP endpoints
    (``/healthz`` answers 503 "starting" until ready), hold the Mooncake pool segment if a
    ``mooncake`` tier is configured, find the namespaces on disk, and, after an unclean stop
    (the previous daemon's state file says it did not stop cleanly) or with ``startup_check =
    "full"``, verify every NVMe namespace and repair it (drop bad index entries, recount,
    reclaim dead segments) before serving. A namespace's tier that cannot be opened or checked
    (a corrupt LMDB index, a damaged meta.json, a store that refuses) is marked broken: logged
    once with its path, shown in ``/status`` and ``kvstrata_daemon_broken_tiers``, left alone
    until a SIGHUP or a restart; the other namespaces are served.
Loop (main thread)
    every ``hint_poll_s``: promotion hints (hint file, ``POST /prefetch``); every ``interval_s``:
    watermarks of every persistent tier of every namespace; every ``compact_interval_s``: NVMe
    compaction; every ``gc_interval_s`` of the fs tier: its housekeeping (tombstones, TTL, grace-
    period GC); every ``rescan_interval_s``: new namespaces. Scrubbing runs on its own thread.
Signals
    SIGTERM/SIGINT finish the current batch, close the tiers (NVMe seals its segment, fs
    publishes pending tombstones), mark the state file clean and exit 0; SIGHUP reloads the
    config (a bad one is logged and counted, and the old one keeps running) and retries broken
    tiers. The state file says clean only when the loop ended on such a stop and every tier
    closed: after an exception (or kill -9) it stays unclean, so the next start checks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import disable_created_metrics

from kvstrata import __version__
from kvstrata.config import KVStrataConfig, load_config
from kvstrata.errors import ConfigError, KVStrataError, TierError
from kvstrata.tiers import BlockId, ReadStatus, Tier, connectable, indexed, shrinkable

from .control import Control
from .heap import FrozenHeap
from .hints import Hint, HintQueue, HintReader
from .http import DaemonHTTP, Limits, open_api
from .kv_events import RESTART_ONLY_KV_EVENTS, DaemonKVEvents, open_kv_events
from .logs import setup_logging
from .metrics import DaemonMetrics
from .namespaces import ManagedNamespace, TierPlan, Unreadable, discover, local_fingerprints, persistent_chain
from .pool import hold_pool_segments
from .promote import Promoter
from .scrub import Scrubber
from .shields import Shields
from .startup import startup_check
from .state import StateDir, state_dir_for
from .watermarks import MoveResult, Watermarks

log = logging.getLogger("kvstrata.daemon")

ConfigSource = str | os.PathLike[str] | Mapping[str, Any] | None
DEFAULT_GC_S = 10.0
WARN_EVERY_S = 60.0
_RESTART = ("metrics_host", "metrics_port", "state_dir", "auth", "token_file", "auth_metrics", "max_connections")
RESTART_ONLY = _RESTART + RESTART_ONLY_KV_EVENTS
#: ``/status`` ``totals``: each is the counter ``kvstrata_daemon_<name>_total``
STATUS_TOTALS: tuple[str, ...] = ("demoted_blocks", "demoted_bytes", "dropped_blocks", "promoted_blocks")
STATUS_TOTALS += ("promoted_bytes", "hints", "scrubbed_bytes", "scrub_bad_blocks", "compacted_segments", "errors")


class Daemon:
    """The tier-migration daemon. ``run()`` serves until SIGTERM; tests may drive ``open()``,
    ``step()`` and ``close()`` themselves (no signals, no HTTP)."""

    def __init__(
        self, source: ConfigSource = None, *, metrics_port: int | None = None, metrics_host: str | None = None
    ) -> None:
        self.source = source
        self._overrides = {
            k: v for k, v in (("metrics_port", metrics_port), ("metrics_host", metrics_host)) if v is not None
        }
        self.config = self._load()
        self.metrics = DaemonMetrics()
        self.control = Control(self.config.daemon.drain_timeout_s)
        self.stop = self.control.stop
        self.chain = persistent_chain(self.config)
        self.state = StateDir(state_dir_for(self.config))
        self.hints = HintReader(self.state.path)
        d = self.config.daemon
        self._posted = HintQueue(d.hint_queue_keys)  # POST /prefetch -> main loop; 503 when full
        self.namespaces: dict[str, ManagedNamespace] = {}
        self._unreadable: Unreadable = {}  # namespaces whose meta.json cannot be used: not managed
        self._ns_lock = threading.Lock()
        self.shields = Shields(self.metrics, d.max_protected_keys)  # hinted keys not to demote yet
        self._unknown_warned_at = -WARN_EVERY_S
        self.watermarks = Watermarks(self.metrics, d.move_batch, self.stop)
        self.promoter = Promoter(self.metrics, d.max_promote_bytes)
        self.scrubber = Scrubber(
            self.metrics, self._scrub_targets, self._on_bad, d.scrub_bytes_per_s, d.scrub_pause_s, self.stop
        )
        self.http: DaemonHTTP | None = None
        self.kv_events: DaemonKVEvents | None = None  # [daemon] kv_events_endpoint (kv_events.open_kv_events)
        self.pool: list[Tier] = []
        self.phase = "starting"
        self.activity = "starting"
        self.started = time.time()
        self.startup: dict[str, Any] = {}
        self.last_cycle: dict[str, Any] = {}
        self.last_promotion: dict[str, Any] = {}
        self.last_reload: dict[str, Any] = {}
        self._due: dict[str, float] = {}
        self._unknown_rescan_at = 0.0
        self._closed = False
        self.heap = FrozenHeap()  # run() freezes the start-up heap

    # ------------------------------------------------------------------ config
    def _load(self) -> KVStrataConfig:
        cfg = load_config(self.source)  # ConfigError: named field and value
        if self._overrides:
            cfg = cfg.model_copy(update={"daemon": cfg.daemon.model_copy(update=self._overrides)})
        return cfg

    def reload(self) -> bool:
        """Re-read the config (SIGHUP). A bad one is logged and counted; the old one stays."""
        try:
            new = self._load()
            chain = persistent_chain(new)
        except (ConfigError, KVStrataError, OSError) as exc:
            self.metrics.reloads.labels("error").inc()
            self.last_reload = {"ok": False, "at": time.time(), "error": str(exc)}
            log.error("config reload failed, keeping the running config: %s", exc, extra={"event": "reload_failed"})
            return False
        old = self.config
        for name in RESTART_ONLY:
            if getattr(new.daemon, name) != getattr(old.daemon, name):
                log.warning("daemon.%s changed: takes effect at the next start", name, extra={"event": "reload"})
        self.config = new
        if new.tiers != old.tiers or new.policies != old.policies:
            self._close_namespaces()
            self.chain = chain
            self._rescan()
            self.heap.refreeze()
        else:
            self.chain = chain
            with self._ns_lock:
                for ns in self.namespaces.values():
                    ns.chain = chain
                    ns.retry_broken()  # repaired meanwhile? the next rescan opens them again
        d = new.daemon
        self.watermarks.move_batch = d.move_batch
        self.promoter.max_bytes = d.max_promote_bytes
        self.scrubber.set_rate(d.scrub_bytes_per_s, d.scrub_pause_s)
        self.control.drain_timeout_s = d.drain_timeout_s
        self._posted.max_keys = d.hint_queue_keys
        self.shields.max_keys = d.max_protected_keys
        if self.http is not None:  # the connection limit stays: it sized the server at start
            self.http.limits = Limits.of(d, self.http.limits.max_connections)
        setup_logging(d.log_level, d.log_format)
        self.metrics.reloads.labels("ok").inc()
        self.last_reload = {"ok": True, "at": time.time()}
        log.info("config reloaded", extra={"event": "reloaded", "config": str(self.source or "default")})
        return True

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; returns the exit status (0: clean)."""
        d = self.config.daemon
        setup_logging(d.log_level, d.log_format)
        disable_created_metrics()  # this process is the daemon: no *_created series on /metrics
        unclean = self.state.acquire()
        clean = False
        try:
            http = self.start_http()
            self.kv_events = open_kv_events(self.config.daemon, self.state.path, self.metrics, self.watermarks)
            self.control.install()
            self.state.write("starting", http.url)
            log.info(
                "kvstrata daemon %s starting (pid %d), http %s, state %s",
                __version__,
                os.getpid(),
                http.url,
                self.state.path,
                extra={"event": "starting", "url": http.url, "unclean_stop_before": unclean},
            )
            self.open(unclean)
            self.heap.freeze()
            self.state.write("running", http.url)
            self.scrubber.start()
            while not self.stop.is_set():
                self.step()
                self.control.wake.wait(self.config.daemon.hint_poll_s)
                self.control.wake.clear()
            clean = True  # the loop ended on a stop request, not an exception
        finally:
            self.close(clean)
        return 0

    def start_http(self) -> DaemonHTTP:
        """Serve the HTTP API (``run()`` does; tests driving ``open()``/``step()`` may too).
        With ``auth = "token"`` this makes the token file first if there is none."""
        self.http = open_api(self.config, self.state.path, self, self.metrics)
        self.http.start()
        return self.http

    def open(self, unclean: bool = False) -> None:
        """Start-up: pool segment, namespaces, consistency check (and repair) before serving."""
        self._open_pool()
        self._rescan()
        self._startup_check(unclean)
        self.phase = self.activity = "running"
        self.metrics.ready.set(1)
        log.info("ready", extra={"event": "ready", "namespaces": len(self.namespaces)})

    def close(self, clean: bool = True) -> None:
        """Drain and close everything. The state file says ``clean`` only when ``clean`` (the serve
        loop ended on a stop request) and every tier closed: otherwise the next start checks them."""
        if self._closed:
            return
        self._closed = True
        self.phase = self.activity = "draining"
        self.metrics.ready.set(0)
        self.stop.set()
        self.scrubber.join(self.config.daemon.drain_timeout_s)
        clean = self._close_namespaces() and clean
        for tier in self.pool:
            try:
                tier.close()
            except Exception:  # pragma: no cover - best effort
                log.exception("closing pool tier %s failed", tier.name)
        self.pool = []
        if self.kv_events is not None:  # its thread sends what is queued, then the socket closes
            self.kv_events.close()
        if self.http is not None:
            url = self.http.url
            self.http.close()
            self.state.write("stopped", url, clean=clean)
        self.state.release()
        self.control.restore()
        if clean:
            log.info("stopped cleanly", extra={"event": "stopped"})
        else:
            log.error(
                "stopped after an error: the state file says unclean, so the next start verifies the tiers",
                extra={"event": "stopped_unclean"},
            )

    def step(self) -> None:
        """One turn of the main loop: whatever is due."""
        if self.control.reload.is_set():
            self.control.reload.clear()
            self._guard("reload", self.reload)
        self._guard("hints", self.serve_hints, True)
        now = time.monotonic()
        d = self.config.daemon
        if self._is_due("rescan", now, d.rescan_interval_s):
            self._guard("rescan", self._rescan)
        if self._is_due("watermarks", now, d.interval_s):
            self._guard("rescan", self._rescan_local)
            self._guard("watermarks", self.enforce_watermarks)
        if self._is_due("compact", now, d.compact_interval_s, first=d.compact_interval_s):
            self._guard("compact", self.compact)
        if self._is_due("maintain", now, self._gc_interval()):
            self._guard("maintain", self.maintain)
        self.shields.expire()

    def _is_due(self, what: str, now: float, every: float, first: float = 0.0) -> bool:
        due = self._due.setdefault(what, now + first)
        if now < due:
            return False
        self._due[what] = now + every
        return True

    def _guard(self, where: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # one failing step must not stop the daemon
            self.metrics.errors.labels(where).inc()
            log.exception("%s failed", where, extra={"event": "error", "where": where})
        finally:
            self.activity = "idle"

    # ------------------------------------------------------------------ namespaces
    def _rescan_local(self) -> None:
        """A namespace directory appeared on the local disk (a new model started): manage it now."""
        with self._ns_lock:
            known = set(self.namespaces) | set(self._unreadable)
        if local_fingerprints(self.chain) - known:
            self._rescan(local_only=True)

    def _rescan(self, local_only: bool = False) -> None:
        unreadable: Unreadable = {}
        found = discover(self.chain, local_only, unreadable)
        with self._ns_lock:
            if local_only:
                self._unreadable.update(unreadable)
            else:
                self._unreadable = unreadable
            for fp, f in found.items():
                ns = self.namespaces.get(fp)
                if ns is None:
                    ns = self.namespaces[fp] = ManagedNamespace(fp, f, self.config, self.chain)
                    log.info("managing namespace %s", ns.label, extra={"event": "namespace", "namespace": fp})
                else:
                    ns.present |= f.tiers
            managed = list(self.namespaces.values())
        for ns in managed:
            for plan in ns.chain:
                ns.tier(plan)  # opens the tiers holding the namespace
        self.metrics.namespaces.set(len(managed))

    def _close_namespaces(self) -> bool:
        """Close every namespace; False when a tier failed to close."""
        with self._ns_lock:
            managed, self.namespaces = list(self.namespaces.values()), {}
        return all([ns.close() for ns in managed])

    def managed(self) -> list[ManagedNamespace]:
        with self._ns_lock:
            return list(self.namespaces.values())

    def _broken_metas(self) -> list[tuple[str, dict[str, Any]]]:
        """Namespaces found on disk whose meta.json cannot be used (so not managed), by tier."""
        with self._ns_lock:
            return [(fp, dict(tiers)) for fp, tiers in self._unreadable.items()]

    def _startup_check(self, unclean: bool) -> None:
        mode = self.config.daemon.startup_check
        if mode == "off" or (mode == "auto" and not unclean):
            self.startup = {"checked": False, "unclean_stop": unclean}
            return
        self.activity = "start-up check"
        self.startup = startup_check(self.managed(), self.metrics, unclean)

    def _open_pool(self) -> None:
        """Hold the node's Mooncake segment: objects in it then outlive inference processes."""
        if self.config.daemon.hold_pool_segment:
            self.pool = hold_pool_segments(self.config, self.metrics)

    # ------------------------------------------------------------------ work
    def enforce_watermarks(self) -> MoveResult:
        """One pass over every persistent tier of every namespace."""
        self.activity = "watermarks"
        t0 = time.monotonic()
        total = MoveResult()
        for ns in self.managed():
            for plan in ns.chain:
                if self.stop.is_set():
                    break
                total.add(self.watermarks.enforce(ns, plan, self.is_protected, self._hints_between_batches))
        seconds = time.monotonic() - t0
        self.metrics.cycle.observe(seconds)
        self.last_cycle = {
            "at": time.time(),
            "seconds": round(seconds, 4),
            "demoted": total.demoted,
            "dropped": total.dropped,
            "kept": total.failed,
            "expired_objects": total.expired_objects,
        }
        self._update_gauges()
        return total

    def _hints_between_batches(self) -> None:
        self._guard("hints", self.serve_hints, False)
        self.activity = "watermarks"

    def _make_room(self, ns: ManagedNamespace, plan: TierPlan, need: int) -> None:
        self.watermarks.enforce(ns, plan, self.is_protected, None, need=need)

    def compact(self) -> int:
        self.activity = "compaction"
        gone = 0
        for ns in self.managed():
            for plan, tier in ns.open_tiers():
                if indexed(tier) and not self.stop.is_set():
                    n = tier.compact()
                    gone += n
                    self.metrics.compacted.labels(plan.name).inc(n)
        return gone

    def maintain(self) -> None:
        """fs housekeeping: pending tombstones, TTL, capacity, compaction, grace-period GC."""
        self.activity = "fs maintenance"
        for ns in self.managed():
            for plan, tier in ns.open_tiers():
                if shrinkable(tier) and not self.stop.is_set():
                    self.watermarks.listen_expiry(ns, plan, tier)
                    try:
                        tier.maintain()
                    except TierError as exc:
                        log.warning("fs housekeeping of %s skipped: %s", ns.label, exc)
                        continue
                    self.metrics.maintenance.labels(plan.name).inc()

    def _gc_interval(self) -> float:
        values = [float(getattr(p.config.options, "gc_interval_s", 0.0)) for p in self.chain]
        values = [v for v in values if v > 0]
        return min(values) if values else DEFAULT_GC_S

    # ------------------------------------------------------------------ hints and promotion
    def serve_hints(self, make_room: bool = True) -> int:
        """Handle every pending hint; returns how many."""
        d = self.config.daemon
        hints = self.hints.poll(max_keys=d.max_hint_keys, max_skew_s=d.hint_clock_skew_s)
        hints += self._posted.drain()
        self.metrics.hint_queue_keys.set(0)
        for hint in hints:
            self._serve(hint, make_room)
        return len(hints)

    def _serve(self, hint: Hint, make_room: bool) -> None:
        d = self.config.daemon
        now = time.time()
        if now - hint.at > d.hint_ttl_s:
            self.metrics.hints.labels(hint.source, "stale").inc()
            return
        ns = self.namespaces.get(hint.namespace)
        if ns is None and time.monotonic() - self._unknown_rescan_at > 1.0:  # a namespace created since?
            self._unknown_rescan_at = time.monotonic()
            self._rescan()
            ns = self.namespaces.get(hint.namespace)
        if ns is None:
            self.metrics.hints.labels(hint.source, "unknown_namespace").inc()
            if time.monotonic() - self._unknown_warned_at >= WARN_EVERY_S:
                self._unknown_warned_at = time.monotonic()
                log.warning(
                    "hint for unknown namespace %r (warned at most once a minute; "
                    "kvstrata_daemon_hints_total{result=unknown_namespace} counts them)",
                    hint.namespace,
                    extra={"event": "hint_unknown"},
                )
            return
        self.shields.protect(ns.fingerprint, hint.keys, min(hint.at, now) + d.hint_ttl_s)
        if not d.promote:
            self.metrics.hints.labels(hint.source, "noted").inc()
            return
        self.activity = "promotion"
        res = self.promoter.promote(ns, hint, self._make_room if make_room else None)
        self.metrics.hints.labels(hint.source, res.outcome).inc()
        if res.promoted:
            self.metrics.promotion_latency.observe(res.seconds)
        if res.keys and self.kv_events is not None and ns.chain:
            self.kv_events.moved(ns.fingerprint, None, (ns.chain[0].kind, sorted(res.keys)))
        self.last_promotion = {
            "at": time.time(),
            "namespace": ns.fingerprint,
            "keys": len(hint.keys),
            "wanted": res.wanted,
            "promoted": res.promoted,
            "absent": res.absent,
            "latency_s": round(res.seconds, 4),
        }
        log.info(
            "hint for %d keys: promoted %d of %d missing layer-blocks",
            len(hint.keys),
            res.promoted,
            res.wanted,
            extra={"event": "promote", "namespace": ns.fingerprint, **self.last_promotion},
        )

    def is_protected(self, fingerprint: str, key: bytes) -> bool:
        return self.shields.protects(fingerprint, key)

    # ------------------------------------------------------------------ scrubbing
    def _scrub_targets(self) -> list[tuple[ManagedNamespace, TierPlan, Tier]]:
        return [(ns, plan, tier) for ns in self.managed() for plan, tier in ns.open_tiers()]

    def _on_bad(self, ns: ManagedNamespace, plan: TierPlan, bad: Sequence[tuple[BlockId, ReadStatus]]) -> None:
        now = time.time()
        entries = [
            {"at": now, "namespace": ns.fingerprint, "tier": plan.name, "key": bytes(bid[0]).hex(), "layer": bid[1]}
            for bid, _ in bad
        ]
        self.state.quarantine(entries)
        if self.kv_events is not None:  # out of service in that tier: the blocks left it
            self.kv_events.moved(ns.fingerprint, (plan.kind, [bytes(bid[0]) for bid, _ in bad]))
        log.warning(
            "scrub: %d layer-blocks of %s failed their checksum and were quarantined",
            len(bad),
            ns.label,
            extra={"event": "quarantine", "namespace": ns.fingerprint, "tier": plan.name, "blocks": len(bad)},
        )

    # ------------------------------------------------------------------ HTTP handlers
    def metrics_text(self) -> bytes:
        self._update_gauges()
        return self.metrics.render()

    def health(self) -> tuple[int, dict[str, Any]]:
        ok = self.phase == "running"
        return (200 if ok else 503), {"status": "ok" if ok else self.phase}

    def prefetch(self, body: Any) -> tuple[int, dict[str, Any]]:
        code, reply = self._posted.accept(body, self.config.daemon)  # 400/413/503 or 202
        if code == 202:
            self.metrics.hint_queue_keys.set(self._posted.keys)
            self.control.wake.set()
        elif code == 503:
            self.metrics.hints.labels("http", "queue_full").inc()
        return code, reply

    def status(self) -> dict[str, Any]:
        m = self.metrics
        return {
            "state": self.phase,
            "activity": self.activity,
            "pid": os.getpid(),
            "version": __version__,
            "uptime_s": round(time.time() - self.started, 1),
            "config": str(self.source) if self.source is not None else "default",
            "state_dir": str(self.state.path),
            "namespaces": (rows := self._tier_rows()),
            "broken": [{"namespace": r["namespace"], "tier": t, **b} for r in rows for t, b in r["broken"].items()]
            + [{"namespace": fp, "tier": t, **b.to_dict()} for fp, bad in self._broken_metas() for t, b in bad.items()],
            "totals": {name: m.total(f"kvstrata_daemon_{name}_total") for name in STATUS_TOTALS},
            "scrub": {**self.scrubber.progress.to_dict(), "budget_bytes_per_s": self.scrubber.bucket.rate},
            "last_cycle": self.last_cycle,
            "last_promotion": self.last_promotion,
            "last_reload": self.last_reload,
            "startup": {k: v for k, v in self.startup.items() if k != "reports"},
            "pool": [{"tier": t.name, "connected": _connected(t)} for t in self.pool],
            "kv_events": self.kv_events.status() if self.kv_events is not None else {"endpoint": None},
            "gc": self.heap.status(),
        }

    def _tier_rows(self) -> list[dict[str, Any]]:
        rows = []
        for ns in self.managed():
            tiers = []
            broken = ns.broken()
            for plan in ns.chain:
                tier = ns.opened(plan)
                why = broken.get(plan.name)
                tiers.append(
                    {
                        "tier": plan.name,
                        "kind": plan.kind,
                        "open": tier is not None,
                        "broken": None if why is None else why.reason,
                        "used_bytes": _used(tier),
                        "capacity_bytes": plan.capacity,
                        "high_bytes": plan.high,
                        "low_bytes": plan.low,
                    }
                )
            rows.append(
                {
                    "namespace": ns.fingerprint,
                    "model": ns.layout.model,
                    "tiers": tiers,
                    "broken": {name: b.to_dict() for name, b in broken.items()},
                }
            )
        return rows

    def _update_gauges(self) -> None:
        m = self.metrics
        m.broken.clear()
        for fingerprint, tiers in [(ns.fingerprint, ns.broken()) for ns in self.managed()] + self._broken_metas():
            for name in tiers:
                m.broken.labels(fingerprint, name).set(1)
        for ns in self.managed():
            for plan, tier in ns.open_tiers():
                labels = (ns.fingerprint, plan.name)
                used = _used(tier)
                if used is not None:
                    m.used.labels(*labels).set(used)
                m.capacity.labels(*labels).set(plan.capacity)
                m.high.labels(*labels).set(plan.high)
                m.low.labels(*labels).set(plan.low)
        for tier in self.pool:
            m.pool_connected.labels(tier.name).set(1 if _connected(tier) else 0)


def _used(tier: Tier | None) -> int | None:
    if tier is None:
        return None
    try:
        return int(tier.used_bytes)
    except (TierError, OSError):
        return None


def run_daemon(config: str | Path | None, *, metrics_port: int | None = None, metrics_host: str | None = None) -> int:
    """``kvstrata daemon``: run until SIGTERM; returns the exit status."""
    return Daemon(config, metrics_port=metrics_port, metrics_host=metrics_host).run()


def _connected(tier: Tier) -> bool:
    """Whether a pool tier reaches its store now (a tier that does not say: no)."""
    return connectable(tier) and tier.connected
