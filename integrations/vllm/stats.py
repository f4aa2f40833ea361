"""Connector statistics (``KVConnectorStats``) and Prometheus metrics for vLLM."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

COUNTERS = (
    "load_requests",  # requests whose external hit kvstrata loaded
    "loaded_blocks",  # group blocks loaded intact
    "loaded_bytes",
    "failed_loads",  # requests whose load failed (vLLM recomputes them)
    "aborted_during_load",  # requests vLLM finished (a client gone) while their load still ran here
    "stored_blocks",  # group blocks handed to the engine
    "saved_bytes",
    "dropped_stores",  # store batches that lost blocks to the engine's queue (full for store_wait_s)
    "dropped_blocks",  # how many blocks they lost
    "load_time_ms",  # summed wall time of loads
    "save_time_ms",  # summed time spent copying pages out of the KV cache
    "kv_events_dropped",  # KV events for routers lost to a full queue (worker or scheduler side)
    "worker_hook_time_ms",  # summed time vLLM's worker spent in the connector's hooks (its steps wait for it)
    "scheduler_hook_time_ms",  # the same for the scheduler's hooks (lookups, metadata)
)

#: Gauges (what is held right now, not counts): ``data[LIVE]`` maps a source (``worker<rank>``,
#: ``scheduler``) to its latest values, sent when they change. An operator (or a test) sees from
#: them that nothing stays pinned, staged or tracked once requests are gone, aborted or not.
LIVE = "live"
LIVE_GAUGES = (
    "pinned_blocks",  # worker: blocks pinned in its engine's tiers (held lookups, running loads)
    "held_plans",  # worker: socket-lookup plans kept for a load (they expire after held.HOLD_S)
    "pending_loads",  # worker: loads started and not reported to vLLM yet
    "staging_out_bytes",  # worker: staging buffers taken and not returned (stores in flight)
    "staging_idle_bytes",  # worker: staging buffers kept for reuse (bounded by the queue budget)
    "queued_store_bytes",  # worker: bytes the engine's store queue holds or waits to take
    "tracked_requests",  # scheduler: requests it keeps state for (dropped when vLLM frees them)
)

#: Per-tier counters of the worker's engine (``Engine.stats()["tiers"]``), sent as deltas under
#: ``tier:<counter>:<tier>``: a tier that is down (a Mooncake master gone, a full disk) shows here as
#: faults while its lookups turn into misses, so an operator sees an outage that vLLM serves through.
TIER_PREFIX = "tier:"
TIER_MISSES = "misses"  # blocks a lookup reached the tier for and did not find there
TIER_FAULTS = ("io_errors", "write_failures", "checksum_failures")
TIER_COUNTERS = (TIER_MISSES, *TIER_FAULTS)


def tier_key(counter: str, tier: str) -> str:
    """The stats key of one tier's counter (``counter`` is one of :data:`TIER_COUNTERS`)."""
    return f"{TIER_PREFIX}{counter}:{tier}"


def split_tier_key(key: str) -> tuple[str, str] | None:
    """``(counter, tier)`` of a :func:`tier_key`, None for any other key (tier names may hold ':')."""
    if not key.startswith(TIER_PREFIX):
        return None
    counter, sep, tier = key[len(TIER_PREFIX) :].partition(":")
    return (counter, tier) if sep and counter in TIER_COUNTERS else None


# Scheduler side: ``declined_requests`` (all reasons) and ``declined_<reason>``, requests kvstrata
# could not key safely (neither restored nor stored; see integrations/vllm/plan.py)
DECLINED = "declined_requests"
DECLINED_PREFIX = "declined_"


class KVStrataConnectorStats(KVConnectorStats):
    """Counters since the last report; ``hits_<tier>`` count loaded blocks per tier."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def add(self, key: str, value: float) -> None:
        self.data[key] = self.data.get(key, 0) + value

    def set_live(self, source: str, values: dict[str, int]) -> None:
        """The latest gauges of ``source`` (a later report of the same source replaces them)."""
        self.data.setdefault(LIVE, {})[source] = dict(values)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if key == LIVE:  # gauges: per source, the latest wins (workers and steps alike)
                for source, values in value.items():
                    self.set_live(source, values)
            else:
                self.add(key, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            k: round(v, 3) if isinstance(v, float) else v for k, v in self.data.items() if k != LIVE
        }
        for values in self.data.get(LIVE, {}).values():  # summed over sources, for vLLM's log line
            for name, v in values.items():
                out[f"live_{name}"] = out.get(f"live_{name}", 0) + v
        if self.data.get("load_requests"):
            out["avg_load_ms"] = round(self.data.get("load_time_ms", 0) / self.data["load_requests"], 3)
        return out

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items() if k != LIVE) and not self.data.get(LIVE)


class KVStrataPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvstrata_*`` counters, one series per engine (and per tier for hits, per reason for
    ``vllm:kvstrata_declined_requests``)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {
            name: self._counter_cls(
                name=f"vllm:kvstrata_{name}",
                documentation=f"kvstrata connector: {name.replace('_', ' ')}",
                labelnames=labelnames,
            )
            for name in COUNTERS
        }
        self._hits: Any = self._counter_cls(
            name="vllm:kvstrata_hit_blocks",
            documentation="kvstrata connector: blocks loaded, by the tier that served them",
            labelnames=[*labelnames, "tier"],
        )
        self._declined: Any = self._counter_cls(
            name=f"vllm:kvstrata_{DECLINED}",
            documentation="kvstrata connector: requests kvstrata could not key safely (computed by vLLM, "
            "neither restored nor stored), by reason",
            labelnames=[*labelnames, "reason"],
        )
        gauge: Any = self._gauge_cls  # vLLM's Gauge class (its annotation admits every metric type)
        self._tier_misses: Any = self._counter_cls(
            name="vllm:kvstrata_tier_misses",
            documentation="kvstrata connector: blocks a lookup reached a tier for and did not find there, by tier",
            labelnames=[*labelnames, "tier"],
        )
        self._tier_faults: Any = self._counter_cls(
            name="vllm:kvstrata_tier_faults",
            documentation="kvstrata connector: a tier's failed reads (io_errors), refused or failed writes "
            "(write_failures) and records that failed their checksum (checksum_failures), by tier and kind; "
            "each is served as a miss",
            labelnames=[*labelnames, "tier", "kind"],
        )
        self._live: dict[str, Any] = {
            name: gauge(
                name=f"vllm:kvstrata_live_{name}",
                documentation=f"kvstrata connector: {name.replace('_', ' ')} now (per source: worker<rank>, scheduler)",
                multiprocess_mode="mostrecent",
                labelnames=[*labelnames, "source"],
            )
            for name in LIVE_GAUGES
        }
        self._labels = per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self._labels.get(engine_idx, [])
        for key, value in transfer_stats_data.items():
            if key == LIVE:
                for source, values in value.items():
                    for name, v in values.items():
                        if name in self._live:
                            self._live[name].labels(*labels, source).set(v)
            elif key in self._counters and value:
                self._counters[key].labels(*labels).inc(value)
            elif key.startswith("hits_") and value:
                self._hits.labels(*labels, key[len("hits_") :]).inc(value)
            elif (tier := split_tier_key(key)) is not None and value:
                counter, name = tier
                if counter == TIER_MISSES:
                    self._tier_misses.labels(*labels, name).inc(value)
                else:
                    self._tier_faults.labels(*labels, name, counter).inc(value)
            elif key.startswith(DECLINED_PREFIX) and key != DECLINED and value:  # the total is their sum
                self._declined.labels(*labels, key[len(DECLINED_PREFIX) :]).inc(value)
