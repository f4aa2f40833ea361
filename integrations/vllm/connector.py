"""``KVStrataConnector``: kvstrata as vLLM's tiered KV cache (vLLM 0.32/0.33 KV connector API).

Process model. vLLM builds the connector twice: in the scheduler (EngineCore)
process, which answers "how many tokens can you restore?", and in every worker,
which owns the KV tensors. This class only dispatches by role: the worker half
(:mod:`kvstrata.integrations.vllm.worker`) runs a full engine (DRAM + NVMe, ...)
and moves bytes; the scheduler half (:mod:`kvstrata.integrations.vllm.scheduler`)
reads the *persistent* tiers of the same config through a light prober (their
index is shared between processes, e.g. the NVMe tier's LMDB), so every hit it
reports is something any worker on the node can read, whichever instance stored
it. Settings (``kv_connector_extra_config``) are parsed once, in
:mod:`kvstrata.integrations.vllm.settings`. Blocks reach the
persistent tiers through write-through, milliseconds after they are stored.
First, though, the scheduler asks the workers themselves over a local socket
(:mod:`kvstrata.integrations.vllm.lookup`): a worker's engine also sees its DRAM
tier and the stores it has queued, so a prompt re-sent right after it was
stored hits at once; a worker that does not answer in time is skipped.

Loads are asynchronous (``(n, True)``): the scheduler parks the request while
the worker loads its blocks on kvstrata's I/O threads, and other requests keep
running; a failed or corrupt load is reported through ``failed_recving`` and vLLM
recomputes (set ``kv_load_failure_policy: "recompute"``). Stores copy the pages
of newly full blocks out of the KV cache at the end of each step (one
``index_select`` per layer), then the engine writes them in the background, so
vLLM can free blocks at once (``request_finished`` never delays frees).

Hybrid models keep vLLM's hybrid KV cache manager on (``SupportsHMA``) and map each KV cache
group onto kvstrata's per-layer policies (:mod:`kvstrata.integrations.vllm.plan`): sliding-window
groups store the window before each restore point, Mamba / linear-attention groups (``align``
cache mode) store the state slot of every block boundary a step ends on and restore the one at
the restore point, MLA latents are stored once for all ranks, and ``[[policies.layers]]`` rules
decide which tiers each group may occupy. The connector applies retention itself (it knows each
group's block size), so its engines keep whatever it stores.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger

from kvstrata.config import KVStrataConfig
from kvstrata.integrations.vllm.events import KVStrataKVEvents
from kvstrata.integrations.vllm.metadata import KVStrataMetadata, TransferSpec
from kvstrata.integrations.vllm.plan import ModelPlan, build_plan, layer_policies, rank_keys
from kvstrata.integrations.vllm.scheduler import SchedulerSide
from kvstrata.integrations.vllm.settings import ConnectorSettings
from kvstrata.integrations.vllm.stats import KVStrataConnectorStats, KVStrataPromMetrics
from kvstrata.integrations.vllm.worker import WorkerSide, tp_rank

log = init_logger("vllm.kvstrata")  # vLLM's handlers: the start-up line shows in vLLM's log

__all__ = [
    "KVStrataConnector",
    "KVStrataMetadata",
    "TransferSpec",
    "connector_config",
    "layer_policies",
    "rank_keys",
]


def connector_config(vllm_config: Any) -> KVStrataConfig:
    """The kvstrata config of ``kv_connector_extra_config.config`` (see :mod:`.settings`)."""
    return ConnectorSettings.from_vllm_config(vllm_config).config


def _model_plan(vllm_config: Any, kv_cache_config: Any, settings: ConnectorSettings) -> ModelPlan:
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return build_plan(settings.model, kv_cache_config.kv_cache_groups, sched_bs, hash_bs)


F = TypeVar("F", bound=Callable[..., Any])

#: The stats key of the time vLLM's threads spent inside this connector's hooks (ms): on the
#: critical path of every step, a miss's too (a cold prompt's lookup, its pages copied out for the
#: store). The worker side's and the scheduler side's are kept apart.
HOOK_KEYS = {"worker": "worker_hook_time_ms", "scheduler": "scheduler_hook_time_ms"}


def _timed(method: F) -> F:
    """Count the time spent in a hook towards the connector's ``*_hook_time_ms`` stats."""

    @functools.wraps(method)
    def run(self: KVStrataConnector, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._hook_s += time.perf_counter() - t0

    return run  # type: ignore[return-value]


class KVStrataConnector(KVConnectorBase_V1, SupportsHMA):
    """kvstrata's KV connector. Configure with ``kv_connector_extra_config={"config": ...}``."""

    _hook_s = 0.0  # time in the hooks since the last stats report (see _timed)

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._settings = settings = ConnectorSettings.from_vllm_config(vllm_config)
        self._config = settings.config
        self._plan = _model_plan(vllm_config, kv_cache_config, settings)
        self._impl: SchedulerSide | WorkerSide
        if role == KVConnectorRole.SCHEDULER:
            self._impl = SchedulerSide(settings, self._plan)
        else:
            self._impl = WorkerSide(settings, self._plan, tp_rank())
        log.info(
            "kvstrata connector (%s): model=%s weights=%s kv_dtype=%s groups=%s unsupported=%s "
            "hash_block=%d layer_policy=%s config=%s",
            role.name.lower(),
            settings.model,
            settings.weights.describe(),
            settings.kv_dtype,
            [(g.kind.value, g.block_size, len(g.layers), g.window) for g in self._plan.groups],
            list(self._plan.unsupported),
            self._plan.hash_block_size,
            self._config.policies.layer_policy,
            json.dumps(self._config.model_dump(mode="json")),
        )

    @property
    def requires_kv_delivery(self) -> bool:  # a cache: a lost hand-off is recomputed, never required
        return False

    # ---------------------------------------------------------------- scheduler side
    @_timed
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    @_timed
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    @_timed
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    @_timed
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._sched.forget(request.request_id)
        return False, None

    @_timed
    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._sched.forget(request.request_id)
        return False, None

    @_timed
    def update_connector_output(self, connector_output: Any) -> None:
        self._sched.on_output(connector_output)

    def take_events(self) -> Iterable[Any]:
        """KV events for kvstrata's tiers (see :mod:`.events`), once every worker reported them."""
        return self._sched.take_events() if isinstance(self._impl, SchedulerSide) else ()

    def reset_cache(self) -> bool | None:
        return None  # kvstrata's tiers outlive vLLM's prefix cache on purpose

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    # vLLM 0.33 sleep mode: the KV cache memory is released while asleep and restored in place
    def unregister_kv_caches(self) -> None:
        self._worker.sleep()

    def restore_kv_caches(self) -> None:
        self._worker.wake()

    @_timed
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVStrataMetadata)
            self._worker.start_loads(meta)

    @_timed
    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)  # sync loads only; async ones finished before the request ran

    @_timed
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVStrataMetadata)
            self._worker.stage_layer(meta, layer_name, kv_layer)

    def get_kv_connector_kv_cache_events(self) -> KVStrataKVEvents | None:
        return self._worker.take_events() if isinstance(self._impl, WorkerSide) else None

    @_timed
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    @_timed
    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVStrataMetadata)
            self._worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return None, res.finished_recving or None

    @_timed
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, failed = self._worker.poll_loads(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(), finished_recving=done, failed_recving=failed)

    def get_kv_connector_stats(self) -> KVStrataConnectorStats | None:
        """Workers: transfer counters. Scheduler: ``declined_requests`` (vLLM aggregates the
        scheduler's stats with the workers'). Both: the time spent in this connector's hooks since
        the last report (:data:`HOOK_KEYS`)."""
        hook_ms, self._hook_s = self._hook_s * 1e3, 0.0
        if isinstance(self._impl, WorkerSide):
            stats = self._impl.take_stats()
            if hook_ms:
                stats = stats or KVStrataConnectorStats()
                stats.add(HOOK_KEYS["worker"], hook_ms)
            return stats
        data = dict(self._impl.take_stats() or {})
        if hook_ms:
            data[HOOK_KEYS["scheduler"]] = hook_ms
        return KVStrataConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStrataConnectorStats:
        return KVStrataConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVStrataPromMetrics:
        return KVStrataPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self._impl.close()

    # ---------------------------------------------------------------- helpers
    @property
    def _sched(self) -> SchedulerSide:
        assert isinstance(self._impl, SchedulerSide)
        return self._impl

    @property
    def _worker(self) -> WorkerSide:
        assert isinstance(self._impl, WorkerSide)
        return self._impl
