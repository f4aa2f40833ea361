"""Prometheus metrics of the daemon (its own registry, served at ``/metrics``).

==============================================  ======================================================
metric                                          meaning
==============================================  ======================================================
``kvstrata_daemon_info{version,pid}``           constant 1
``kvstrata_daemon_ready``                       1 once the start-up check is done (``/healthz`` 200)
``kvstrata_daemon_namespaces``                  namespaces managed
``kvstrata_daemon_broken_tiers{namespace,tier}`` 1 for a namespace's tier out of service (it could not be
                                                opened or checked: ``/status`` says why and where)
``kvstrata_tier_capacity_bytes{namespace,tier}`` capacity of a persistent tier (per namespace)
``kvstrata_tier_used_bytes{namespace,tier}``    bytes in use (NVMe: segment files; fs: live objects)
``kvstrata_tier_{high,low}_watermark_bytes``    the watermarks in bytes
``kvstrata_daemon_demoted_{blocks,bytes}_total``  layer-blocks moved down (``tier``, ``to``)
``kvstrata_daemon_dropped_{blocks,bytes}_total``  layer-blocks deleted without a copy below (``reason``:
                                                ``policy`` = the layer group may not live lower,
                                                ``bottom`` = no persistent tier below)
``kvstrata_daemon_expired_objects_total``       fs objects expired to reach the low watermark
``kvstrata_daemon_move_failures_total``         blocks kept because their copy failed (retried later)
``kvstrata_daemon_promoted_{blocks,bytes}_total`` layer-blocks copied up on a hint (``tier``, ``from``)
``kvstrata_daemon_hints_total{source,result}``  hints handled (``file``/``http``; ``promoted``,
                                                ``present``, ``absent``, ``unknown_namespace``, ``stale``,
                                                ``noted``; ``queue_full``: refused with 503)
``kvstrata_daemon_promotion_latency_seconds``   hint given -> its blocks in the fast tier
``kvstrata_daemon_scrubbed_{blocks,bytes}_total`` layer-blocks read back and checked by the scrubber
``kvstrata_daemon_scrub_bad_blocks_total``      failed their checksum and were quarantined (``status``)
``kvstrata_daemon_scrub_passes_total``          complete passes over a tier
``kvstrata_daemon_compacted_segments_total``    NVMe segment files unlinked by compaction passes
``kvstrata_daemon_maintenance_runs_total``      fs housekeeping rounds (TTL, GC, tombstones)
``kvstrata_daemon_startup_repairs_total``       start-up verify + repair runs; ``..._problems_total``
                                                what they found (bad checksums + missing data)
``kvstrata_daemon_config_reloads_total{result}``  SIGHUP reloads (``ok``, ``error``)
``kvstrata_daemon_cycle_duration_seconds``      one pass of the main loop (watermarks)
``kvstrata_daemon_errors_total{where}``         unexpected failures, by component
``kvstrata_daemon_pool_connected{tier}``        1 while the held Mooncake segment has a client
``kvstrata_daemon_http_requests_total{code}``   HTTP requests answered, by status code
``kvstrata_daemon_http_dropped_total{reason}``  connections refused or cut: ``busy`` (503: all
                                                ``max_connections`` in use), ``timeout``,
                                                ``headers_too_large``, ``malformed``, ``client_gone``
``kvstrata_daemon_http_connections``            connections being served now
``kvstrata_daemon_hint_queue_keys``             keys of posted hints waiting for the main loop
``kvstrata_daemon_protected_keys``              hinted keys shielded from demotion now
``kvstrata_daemon_protection_evicted_total``    shields dropped early (``max_protected_keys`` reached)
``kvstrata_daemon_kv_events_total``            vLLM KV events sent on ``kv_events_endpoint``
``kvstrata_daemon_kv_events_dropped_total``    KV events dropped (queue full, or the socket refused)
``kvstrata_daemon_kv_events_unknown_keys_total`` moved keys whose vLLM hashes the sidecar did not
                                                know (nothing published for them)
==============================================  ======================================================
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvstrata import __version__

_NS_TIER = ("namespace", "tier")


class DaemonMetrics:
    """Every metric of one daemon; a fresh registry, so tests can run several daemons in-process."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        info = Gauge("kvstrata_daemon_info", "kvstrata daemon (constant 1)", ("version", "pid"), registry=r)
        info.labels(__version__, str(os.getpid())).set(1)
        self.ready = Gauge("kvstrata_daemon_ready", "1 once the start-up check is done", registry=r)
        self.namespaces = Gauge("kvstrata_daemon_namespaces", "namespaces managed", registry=r)
        self.broken = Gauge("kvstrata_daemon_broken_tiers", "tiers out of service", _NS_TIER, registry=r)
        self.capacity = Gauge("kvstrata_tier_capacity_bytes", "tier capacity", _NS_TIER, registry=r)
        self.used = Gauge("kvstrata_tier_used_bytes", "tier bytes in use", _NS_TIER, registry=r)
        self.high = Gauge("kvstrata_tier_high_watermark_bytes", "high watermark", _NS_TIER, registry=r)
        self.low = Gauge("kvstrata_tier_low_watermark_bytes", "low watermark", _NS_TIER, registry=r)
        self.demoted_blocks = Counter("kvstrata_daemon_demoted_blocks", "moved down", ("tier", "to"), registry=r)
        self.demoted_bytes = Counter("kvstrata_daemon_demoted_bytes", "moved down", ("tier", "to"), registry=r)
        self.dropped_blocks = Counter("kvstrata_daemon_dropped_blocks", "deleted", ("tier", "reason"), registry=r)
        self.dropped_bytes = Counter("kvstrata_daemon_dropped_bytes", "deleted", ("tier", "reason"), registry=r)
        self.expired = Counter("kvstrata_daemon_expired_objects", "fs objects expired", ("tier",), registry=r)
        self.move_failures = Counter("kvstrata_daemon_move_failures", "copies failed", ("tier",), registry=r)
        self.promoted_blocks = Counter("kvstrata_daemon_promoted_blocks", "copied up", ("tier", "from"), registry=r)
        self.promoted_bytes = Counter("kvstrata_daemon_promoted_bytes", "copied up", ("tier", "from"), registry=r)
        self.hints = Counter("kvstrata_daemon_hints", "hints handled", ("source", "result"), registry=r)
        self.promotion_latency = Histogram(
            "kvstrata_daemon_promotion_latency_seconds",
            "hint given -> blocks in the fast tier",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.scrubbed_blocks = Counter("kvstrata_daemon_scrubbed_blocks", "checked", ("tier",), registry=r)
        self.scrubbed_bytes = Counter("kvstrata_daemon_scrubbed_bytes", "checked", ("tier",), registry=r)
        self.scrub_bad = Counter("kvstrata_daemon_scrub_bad_blocks", "quarantined", ("tier", "status"), registry=r)
        self.scrub_passes = Counter("kvstrata_daemon_scrub_passes", "complete passes", ("tier",), registry=r)
        self.compacted = Counter("kvstrata_daemon_compacted_segments", "segments unlinked", ("tier",), registry=r)
        self.maintenance = Counter("kvstrata_daemon_maintenance_runs", "fs housekeeping", ("tier",), registry=r)
        self.startup_repairs = Counter("kvstrata_daemon_startup_repairs", "start-up repairs", registry=r)
        self.startup_problems = Counter("kvstrata_daemon_startup_problems", "found at start-up", registry=r)
        self.reloads = Counter("kvstrata_daemon_config_reloads", "SIGHUP reloads", ("result",), registry=r)
        self.cycle = Histogram(
            "kvstrata_daemon_cycle_duration_seconds",
            "one watermark pass",
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
            registry=r,
        )
        self.errors = Counter("kvstrata_daemon_errors", "unexpected failures", ("where",), registry=r)
        self.pool_connected = Gauge("kvstrata_daemon_pool_connected", "mooncake client up", ("tier",), registry=r)
        self.http_requests = Counter("kvstrata_daemon_http_requests", "HTTP answers", ("code",), registry=r)
        self.http_dropped = Counter("kvstrata_daemon_http_dropped", "connections refused", ("reason",), registry=r)
        self.http_connections = Gauge("kvstrata_daemon_http_connections", "connections served now", registry=r)
        self.hint_queue_keys = Gauge("kvstrata_daemon_hint_queue_keys", "posted hint keys queued", registry=r)
        self.protected_keys = Gauge("kvstrata_daemon_protected_keys", "keys shielded from demotion", registry=r)
        self.kv_events = Counter("kvstrata_daemon_kv_events", "KV events sent", registry=r)
        self.kv_events_dropped = Counter("kvstrata_daemon_kv_events_dropped", "KV events dropped", registry=r)
        self.kv_events_unknown = Counter(
            "kvstrata_daemon_kv_events_unknown_keys", "moved keys without vLLM hashes", registry=r
        )
        self.protection_evicted = Counter(
            "kvstrata_daemon_protection_evicted", "shields dropped at max_protected_keys", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def total(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples whose labels include ``labels`` (for ``/status``)."""
        out = 0.0
        for metric in self.registry.collect():
            for sample in metric.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    out += sample.value
        return out
