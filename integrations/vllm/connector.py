"""``KVStrataConnector``: kvstrata as vLLM's tiered KV cache (vLLM 0.32/0.33 KV connector API).

Process model. vLLM builds the connector twice: in the scheduler (EngineCore)
process, which answers "how many tokens can you restore?", and in every worker,
which owns the KV tensors. kvstrata's worker half runs a full engine (DRAM +
NVMe, ...) and moves bytes. The scheduler half opens the *persistent* tiers of
the same config (their index is shared between processes, e.g. the NVMe tier's
LMDB) and answers lookups from them, so every hit it reports is something any
worker on the node can read, whichever instance stored it. Blocks reach the
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

import contextlib
import functools
import json
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger

from kvstrata.config import KVStrataConfig, load_config
from kvstrata.core.keys import BlockHasher, Key
from kvstrata.core.layout import LayerKind
from kvstrata.engine.engine import Engine, LoadHandle, StoreResult
from kvstrata.errors import KVStrataError
from kvstrata.integrations.vllm.lookup import LookupClient, LookupServer, lookup_address
from kvstrata.integrations.vllm.plan import (
    DETERMINISTIC_HASHES,
    GroupPlan,
    ModelPlan,
    RequestKeys,
    build_plan,
    group_keys,
    lcm_block,
    make_namespace,
)
from kvstrata.integrations.vllm.staging import StagingPool, copy_pages_out
from kvstrata.integrations.vllm.stats import KVStrataConnectorStats, KVStrataPromMetrics
from kvstrata.policies.layers import LayerPolicies

log = init_logger("vllm.kvstrata")  # vLLM's handlers: the start-up line shows in vLLM's log


def _lookup_endpoint(vllm_config: Any, tp_rank: int) -> tuple[str, bytes]:
    """Address and handshake key of a worker's lookup server (shared by one vLLM instance)."""
    instance = str(getattr(vllm_config, "instance_id", "") or os.getppid())
    dp_rank = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
    return lookup_address(instance, dp_rank, tp_rank), f"kvstrata:{instance}".encode()


@dataclass
class TransferSpec:
    """Blocks of one request and one group to load or store: keys and vLLM block ids, paired."""

    req_id: str
    group: int  # index into ModelPlan.groups
    keys: list[Key]
    block_ids: list[int]
    salt: str = ""
    sync: bool = False  # a synchronous, layer-wise load: the forward waits per layer


@dataclass
class KVStrataMetadata(KVConnectorMetadata):
    loads: list[TransferSpec] = field(default_factory=list)
    stores: list[TransferSpec] = field(default_factory=list)


def _extra(vllm_config: Any) -> dict[str, Any]:
    ktc = vllm_config.kv_transfer_config
    return dict(getattr(ktc, "kv_connector_extra_config", None) or {})


def connector_config(vllm_config: Any) -> KVStrataConfig:
    """``kv_connector_extra_config.config``: a TOML path, an inline dict, or absent (embedded default)."""
    raw = _extra(vllm_config).get("config")
    if isinstance(raw, str) and raw.strip().startswith("{"):
        raw = json.loads(raw)
    return load_config(raw)


def layer_policies(plan: ModelPlan, config: KVStrataConfig) -> LayerPolicies:
    """The groups' placement and priorities from the config; retention is the connector's own."""
    names = [t.name for t in config.tiers]
    return LayerPolicies.resolve(plan.layout, config.policies, tier_names=names).with_caller_retention()


def _rank_independent(plan: ModelPlan, config: KVStrataConfig) -> bool:
    """MLA-only models under the per-layer policy: one copy of the latents for every rank."""
    return plan.mla_only and LayerPolicies.resolve(plan.layout, config.policies).rank_independent


def _model_plan(vllm_config: Any, kv_cache_config: Any) -> tuple[ModelPlan, str, str]:
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    mc = vllm_config.model_config
    model = str(_extra(vllm_config).get("model_id") or getattr(mc, "served_model_name", None) or mc.model)
    if isinstance(getattr(mc, "served_model_name", None), list | tuple):
        model = str(_extra(vllm_config).get("model_id") or mc.served_model_name[0])
    kv_dtype = str(vllm_config.cache_config.cache_dtype)
    if kv_dtype == "auto":
        kv_dtype = str(mc.dtype).removeprefix("torch.")
    plan = build_plan(model, kv_cache_config.kv_cache_groups, sched_bs, hash_bs)
    return plan, model, kv_dtype


class KVStrataConnector(KVConnectorBase_V1, SupportsHMA):
    """kvstrata's KV connector. Configure with ``kv_connector_extra_config={"config": ...}``."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._config = connector_config(vllm_config)
        self._plan, model, kv_dtype = _model_plan(vllm_config, kv_cache_config)
        self._impl: _SchedulerSide | _WorkerSide
        if role == KVConnectorRole.SCHEDULER:
            self._impl = _SchedulerSide(vllm_config, self._config, self._plan, model, kv_dtype)
        else:
            self._impl = _WorkerSide(vllm_config, self._config, self._plan, model, kv_dtype)
        log.info(
            "kvstrata connector (%s): model=%s kv_dtype=%s groups=%s unsupported=%s hash_block=%d "
            "layer_policy=%s config=%s",
            role.name.lower(),
            model,
            kv_dtype,
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
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._sched.forget(request.request_id)
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._sched.forget(request.request_id)
        return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched.on_output(connector_output)

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

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVStrataMetadata)
            self._worker.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)  # sync loads only; async ones finished before the request ran

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVStrataMetadata)
            self._worker.stage_layer(meta, layer_name, kv_layer)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVStrataMetadata)
            self._worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, failed = self._worker.poll_loads()
        return KVConnectorTransferResults(finished_sending=set(), finished_recving=done, failed_recving=failed)

    def get_kv_connector_stats(self) -> KVStrataConnectorStats | None:
        if isinstance(self._impl, _WorkerSide):
            return self._impl.take_stats()
        return None

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
    def _sched(self) -> _SchedulerSide:
        assert isinstance(self._impl, _SchedulerSide)
        return self._impl

    @property
    def _worker(self) -> _WorkerSide:
        assert isinstance(self._impl, _WorkerSide)
        return self._impl


# =====================================================================================
# scheduler side


@dataclass
class _RequestState:
    request: Any
    keys: RequestKeys
    block_ids: list[list[int]] = field(default_factory=list)  # per vLLM group
    stored: dict[int, int] = field(default_factory=dict)  # plan group -> group blocks handled
    lookup_start: int = 0  # tokens computed locally when the external hit was counted
    load_failed: bool = False  # a load failed: recompute this request, never offer it hits again
    sync_load: bool = False  # its hits load layer-wise inside the step (see load_mode)


class _SchedulerSide:
    def __init__(self, vllm_config: Any, config: KVStrataConfig, plan: ModelPlan, model: str, kv_dtype: str) -> None:
        self.plan = plan
        self.model, self.kv_dtype = model, kv_dtype
        self.rank_independent = _rank_independent(plan, config)
        self.tp_size = 1 if self.rank_independent else int(vllm_config.parallel_config.tensor_parallel_size)
        algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
        self.use_vllm_hashes = algo in DETERMINISTIC_HASHES or bool(os.environ.get("PYTHONHASHSEED"))
        persistent = tuple(t for t in config.tiers if _is_persistent(t.kind))
        self.engines: list[Engine] = []
        timeout = float(_extra(vllm_config).get("worker_lookup_timeout_s", 1.0))
        self.workers = [LookupClient(*_lookup_endpoint(vllm_config, r), timeout_s=timeout) for r in range(self.tp_size)]
        if persistent and not plan.unsupported:
            cfg = config.with_tiers(persistent)
            policies = layer_policies(plan, cfg)
            for rank in range(self.tp_size):
                ns = make_namespace(
                    plan, model, kv_dtype, rank, self.tp_size, "", rank_independent=self.rank_independent
                )
                self.engines.append(Engine(cfg, layout=plan.layout, namespace=ns, layer_policies=policies))
        elif not persistent:
            log.warning(
                "kvstrata: no persistent tier configured; hits come only from this instance's workers "
                "(their DRAM), never from other instances"
            )
        self.requests: dict[str, _RequestState] = {}
        self.pending_loads: list[TransferSpec] = []
        # "sync": layer-wise loads inside the step (failures reported per block, which vLLM
        # supports for one KV cache group only); "async": the request waits for its load while
        # others run; "auto" (default): sync when every hit is in the workers' memory (a memcpy,
        # faster than a scheduling round trip), async when any comes from disk or the network
        mode = str(_extra(vllm_config).get("load_mode", "auto"))
        if mode not in ("auto", "async", "sync"):
            raise KVStrataError(f"kv_connector_extra_config.load_mode must be 'auto', 'async' or 'sync', got {mode!r}")
        self.load_mode = mode if len(plan.groups) == 1 else "async"
        self._all_fast = True  # during one lookup: every block found so far is in worker memory
        self.step_block = lcm_block(plan)

    def close(self) -> None:
        for client in self.workers:
            client.close()
        for engine in self.engines:
            engine.close()

    def _state(self, request: Any) -> _RequestState:
        st = self.requests.get(request.request_id)
        if st is None:
            salt = str(getattr(request, "cache_salt", None) or "")
            ns = make_namespace(self.plan, self.model, self.kv_dtype, 0, 1, salt)
            own = None if self.use_vllm_hashes else BlockHasher(ns)
            st = _RequestState(request, RequestKeys(ns.seed, own))
            self.requests[request.request_id] = st
        return st

    def _namespaced(self, keys: list[Key], rank: int) -> list[Key]:
        return rank_keys(keys, 0 if self.rank_independent else rank)

    # -- lookup ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)  # stores need the state even when nothing can be looked up
        if not self.plan.groups or st.load_failed or self.plan.unsupported:
            return 0, False
        hash_keys = st.keys.update(request)
        usable = (request.num_tokens - 1) // self.plan.hash_block_size  # leave a token to compute
        self._all_fast = True
        tokens = self._restorable_tokens(hash_keys[:usable])
        ext = max(0, tokens - num_computed_tokens)
        st.lookup_start = num_computed_tokens
        st.sync_load = self.load_mode == "sync" or (self.load_mode == "auto" and self._all_fast)
        return ext, ext > 0 and not st.sync_load

    def _restorable_tokens(self, hash_keys: list[Key]) -> int:
        """Longest prefix (tokens, a multiple of every group's block size) every group can restore."""
        limit = len(hash_keys) * self.plan.hash_block_size
        sparse = (LayerKind.LINEAR, LayerKind.SLIDING)  # state groups first: one key to check
        for g in self.plan.groups:
            if g.kind not in sparse:
                nb = limit // g.block_size
                found = self._found(g, group_keys(g, hash_keys, range(nb)))
                limit = min(limit, found * g.block_size)
        limit -= limit % self.step_block
        points = sorted((g for g in self.plan.groups if g.kind in sparse), key=lambda g: sparse.index(g.kind))
        while limit > 0:  # state and sliding groups: the snapshot / window at the restore point
            if all(self._window_ok(g, hash_keys, limit) for g in points):
                return limit
            limit -= self.step_block
        return 0

    def _window_ok(self, g: GroupPlan, hash_keys: list[Key], end_tokens: int) -> bool:
        blocks = g.window_blocks(end_tokens)
        keys = group_keys(g, hash_keys, blocks)
        return self._found(g, keys) == len(keys)

    def _found(self, g: GroupPlan, keys: list[Key]) -> int:
        """Blocks of ``keys`` every rank can restore now. Each rank's worker answers from its
        engine (DRAM, queued stores, and what other processes put in shared tiers); for a worker
        that does not answer, the persistent tiers do, where a group's first layer stands for all
        (a group is written in one batch; the worker checks every layer, and reports a failed load)."""
        n = len(keys)
        for rank in range(self.tp_size):
            if n == 0:
                break
            answer = self.workers[rank].lookup(keys[:n], g.layers)
            if answer is None:
                self._all_fast = False
                if rank >= len(self.engines):
                    return 0
                got = self.engines[rank].probe(self._namespaced(keys[:n], rank), g.layers[:1]).num_blocks
            else:
                got, fast = answer
                self._all_fast &= fast >= got
            n = min(n, got)
        return n

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        st = self._state(request)
        ids = blocks.get_block_ids()
        hash_keys = st.keys.update(request)
        start, end = st.lookup_start, st.lookup_start + num_external_tokens
        salt = str(getattr(request, "cache_salt", None) or "")
        for gi, g in enumerate(self.plan.groups):
            table = ids[g.group_id]
            wanted = [i for i in g.window_blocks(end) if i >= start // g.block_size]
            pairs = [(i, table[i]) for i in wanted if i < len(table) and table[i] != 0]
            if g.kind is LayerKind.LINEAR and len(pairs) < len(wanted):
                # no slot to put the state in: a load of nothing, which fails and is recomputed
                keys = group_keys(g, hash_keys, wanted)
                self.pending_loads.append(TransferSpec(request.request_id, gi, keys, [], salt, st.sync_load))
            elif pairs:
                keys = group_keys(g, hash_keys, [i for i, _ in pairs])
                spec = TransferSpec(request.request_id, gi, keys, [b for _, b in pairs], salt, st.sync_load)
                self.pending_loads.append(spec)
        for gi, g in enumerate(self.plan.groups):  # what we load counts as stored
            st.stored[gi] = max(st.stored.get(gi, 0), end // g.block_size)

    # -- per-step metadata -----------------------------------------------------------
    def build_connector_meta(self, so: Any) -> KVStrataMetadata:
        meta = KVStrataMetadata(loads=self.pending_loads)
        self.pending_loads = []
        if not self.plan.groups or self.plan.unsupported:
            return meta
        for new in so.scheduled_new_reqs:
            st = self.requests.get(new.req_id)
            if st is None:
                continue
            st.block_ids = [list(b) for b in new.block_ids]
            for gi, g in enumerate(self.plan.groups):
                first = new.num_computed_tokens // g.block_size
                st.stored[gi] = min(st.stored.get(gi, first), first) if gi in st.stored else first
            self._stores(meta, st, new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.requests.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    st.block_ids = [list(b) for b in new_ids]
                else:
                    for table, extra in zip(st.block_ids, new_ids, strict=False):
                        table.extend(extra)
            done = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0)
            self._stores(meta, st, done)
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        return meta

    def _stores(self, meta: KVStrataMetadata, st: _RequestState, computed_tokens: int) -> None:
        hash_keys = st.keys.update(st.request)
        step_end = computed_tokens  # where this step's forward stops
        computed_tokens = min(computed_tokens, len(hash_keys) * self.plan.hash_block_size)
        salt = str(getattr(st.request, "cache_salt", None) or "")
        for gi, g in enumerate(self.plan.groups):
            upto = computed_tokens // g.block_size
            lo = st.stored.get(gi, 0)
            if upto <= lo or g.group_id >= len(st.block_ids):
                continue
            keep = g.window_blocks(computed_tokens)  # sliding: only blocks a restore point here needs
            if g.kind is LayerKind.LINEAR and step_end != upto * g.block_size:
                keep = range(upto, upto)  # the state slot holds a boundary state only when the step ends there
            table = st.block_ids[g.group_id]
            pairs = [(i, table[i]) for i in range(max(lo, keep.start), upto) if i < len(table) and table[i] != 0]
            st.stored[gi] = upto
            if pairs:
                keys = group_keys(g, hash_keys, [i for i, _ in pairs])
                meta.stores.append(TransferSpec(st.request.request_id, gi, keys, [b for _, b in pairs], salt))

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def on_output(self, output: Any) -> None:
        for req_id in getattr(output, "failed_recving", None) or ():
            st = self.requests.get(req_id)
            if st is not None:
                st.load_failed = True


def rank_keys(keys: list[Key], rank: int) -> list[Key]:
    """Keys of a tensor-parallel rank (each rank holds its own heads): rank 0 keeps the request keys."""
    if rank == 0:
        return keys
    tag = b"tp" + rank.to_bytes(2, "little")
    return [xxhash.xxh3_128_digest(k + tag) for k in keys]


def _is_persistent(kind: str) -> bool:
    from kvstrata.tiers import TIERS

    try:
        return bool(TIERS.get(kind).capabilities.persistent)
    except KVStrataError:
        return False


# =====================================================================================
# worker side


@dataclass
class _PendingLoad:
    handles: list[tuple[LoadHandle, int]]  # (handle, bytes of one block over the group's layers)
    expected: int
    started: float


class _WorkerSide:
    def __init__(self, vllm_config: Any, config: KVStrataConfig, plan: ModelPlan, model: str, kv_dtype: str) -> None:
        self.plan = plan
        rank, size = _tp_rank_size(vllm_config)
        independent = _rank_independent(plan, config)
        ns = make_namespace(plan, model, kv_dtype, rank, size, "", rank_independent=independent)
        self.rank = 0 if independent else rank
        self.engine = Engine(config, layout=plan.layout, namespace=ns, layer_policies=layer_policies(plan, config))
        self.hint_dir: str | None = None  # the daemon's state directory, when a shared tier exists
        if any(t.kind == "fs" for t in config.tiers):
            from kvstrata.daemon.state import state_dir_for

            with contextlib.suppress(Exception):
                self.hint_dir = str(state_dir_for(config))
        self.memory_tiers = {  # tiers private to this process: reading them is a memcpy
            idx.position
            for idx in self.engine.tiers
            if not (idx.tier.capabilities.persistent or idx.tier.capabilities.shared)
        }
        self.server: LookupServer | None = None
        try:  # answers the scheduler's lookups from this engine (DRAM and queued stores included)
            self.server = LookupServer(*_lookup_endpoint(vllm_config, rank), self._answer_lookup)
        except OSError as exc:
            log.warning("kvstrata: no lookup server for the scheduler (%s); it will use the persistent tiers", exc)
        self.kv: dict[int, torch.Tensor] = {}  # kvstrata layer -> [num_blocks, ...] tensor
        self.loads: dict[str, _PendingLoad] = {}
        self.failed: set[str] = set()
        self.sync: list[tuple[LoadHandle, TransferSpec, int]] = []  # this step's layer-wise loads
        self.load_errors: set[int] = set()  # vLLM block ids whose sync load failed
        self.staged: dict[tuple[int, int], torch.Tensor] = {}  # (store spec, layer) -> pages copied out
        self.staged_bases: dict[tuple[int, int], torch.Tensor] = {}  # their pooled buffers
        self.staging = StagingPool(int(config.engine.max_pending_bytes))
        self.stats = KVStrataConnectorStats()
        self._dropped_seen = 0
        self.asleep = False  # vLLM sleep mode: the KV cache is released, no loads into it

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.engine.close()

    def _hint_slow(self, keys: list[Key], found: Any) -> None:
        """Hits served by a shared tier: tell the node's daemon this session is active again, so
        it brings the session's blocks up to NVMe before the next turn (best effort)."""
        if self.hint_dir is None:
            return
        try:
            from kvstrata.daemon.hints import hint_slow_hits

            hint_slow_hits(self.engine, keys, found, self.hint_dir)
        except Exception as exc:  # a hint is an optimisation: never fail a load over it
            log.debug("kvstrata: daemon hint failed: %s", exc)

    def _answer_lookup(self, keys: list[Key], layers: list[int]) -> tuple[int, int]:
        """Restorable blocks, and how many of them (from the start) sit in this process's memory."""
        found = self.engine.lookup(rank_keys(keys, self.rank), layers, count=False)
        fast = 0
        for pos in found.tier_positions:
            if pos not in self.memory_tiers:
                break
            fast += 1
        return found.num_blocks, fast

    def sleep(self) -> None:
        """Before vLLM frees the KV cache: let every load into it finish, accept no new ones."""
        self.asleep = True
        for pending in self.loads.values():
            for handle, _ in pending.handles:
                with contextlib.suppress(Exception):
                    handle.result()
        for handle, _, _ in self.sync:
            with contextlib.suppress(Exception):
                handle.result()

    def wake(self) -> None:
        self.asleep = False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        index = self.plan.layer_index
        for name, tensor in kv_caches.items():
            if name not in index:
                continue
            page = int(tensor[0].numel() * tensor.element_size()) if len(tensor) else 0
            want = self.plan.layout.layer_nbytes(index[name])
            if page != want or not tensor[0].is_contiguous():  # never move bytes we cannot place exactly
                log.warning("kvstrata: layer %s has %d-byte pages, expected %d: not transferred", name, page, want)
                continue
            self.kv[index[name]] = tensor

    def _keys(self, spec: TransferSpec) -> list[Key]:
        return rank_keys(spec.keys, self.rank)

    def _pages(self, layer: int, block_ids: list[int]) -> list[torch.Tensor]:
        t = self.kv[layer]
        return [t[b] for b in block_ids]

    # -- loads ------------------------------------------------------------------------
    def start_loads(self, meta: KVStrataMetadata) -> None:
        for spec in meta.loads:
            g = self.plan.groups[spec.group]
            keys = self._keys(spec)
            try:
                if self.asleep:
                    raise KVStrataError("the KV cache is released (vLLM sleep mode)")
                if len(spec.block_ids) < len(keys):
                    raise KVStrataError("vLLM allocated no block to restore into")
                found = self.engine.lookup(keys, g.layers)  # adopts what other processes stored
                self._hint_slow(keys, found)
                bufs = {layer: self._pages(layer, spec.block_ids) for layer in g.layers if layer in self.kv}
                if found.num_blocks < len(keys) or len(bufs) < len(g.layers):
                    raise KVStrataError(f"only {found.num_blocks} of {len(keys)} blocks are restorable now")
                handle = self.engine.load(keys, bufs)
            except Exception as exc:  # never raise into vLLM: the request is recomputed
                log.warning("kvstrata: load for %s failed: %s", spec.req_id, exc)
                if spec.sync:
                    self.load_errors.update(spec.block_ids)
                else:
                    self.failed.add(spec.req_id)
                continue
            block_bytes = sum(self.plan.layout.layer_nbytes(i) for i in g.layers)
            if spec.sync:
                self.sync.append((handle, spec, block_bytes))
                continue
            pending = self.loads.setdefault(spec.req_id, _PendingLoad([], 0, time.perf_counter()))
            pending.handles.append((handle, block_bytes))
            pending.expected += len(keys)

    def poll_loads(self) -> tuple[set[str], set[str]]:
        done: set[str] = set()
        failed: set[str] = set(self.failed)
        self.failed.clear()
        for req_id, pending in list(self.loads.items()):
            if not all(h.done() for h, _ in pending.handles):
                continue
            del self.loads[req_id]
            loaded = 0
            for h, block_bytes in pending.handles:
                try:
                    res = h.result()
                except Exception:
                    continue
                loaded += res.loaded_blocks
                self.stats.add("loaded_bytes", res.loaded_blocks * block_bytes)
                for tier in res.tiers[: res.loaded_blocks]:
                    self.stats.add(f"hits_{tier}", 1)
            self.stats.add("load_time_ms", (time.perf_counter() - pending.started) * 1e3)
            if loaded == pending.expected:
                done.add(req_id)
                self.stats.add("load_requests", 1)
                self.stats.add("loaded_blocks", loaded)
            else:
                failed.add(req_id)
        if failed:
            self.stats.add("failed_loads", len(failed))
        return done | failed, failed

    def wait_layer(self, layer_name: str) -> None:
        """Block until this step's layer-wise loads have put ``layer_name``'s pages in place."""
        layer = self.plan.layer_index.get(layer_name)
        for handle, spec, _ in self.sync:
            if layer in self.plan.groups[spec.group].layers:
                handle.wait_layer(layer)

    def finish_sync_loads(self) -> None:
        """End of step: blocks a layer-wise load did not deliver intact are reported to vLLM."""
        for handle, spec, block_bytes in self.sync:
            try:
                res = handle.result()
                n = res.loaded_blocks
                tiers = res.tiers
            except Exception:
                n, tiers = 0, []
            self.stats.add("load_time_ms", (handle.elapsed_s or 0.0) * 1e3)  # issue to bytes in place
            self.stats.add("loaded_blocks", n)
            self.stats.add("loaded_bytes", n * block_bytes)
            for tier in tiers[:n]:
                self.stats.add(f"hits_{tier}", 1)
            if n < len(spec.block_ids):
                self.load_errors.update(spec.block_ids[n:])
                self.stats.add("failed_loads", 1)
            else:
                self.stats.add("load_requests", 1)
        self.sync = []

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    # -- stores -----------------------------------------------------------------------
    def stage_layer(self, meta: KVStrataMetadata, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Copy this layer's pages of the step's stores out of the KV cache, right after the layer ran."""
        layer = self.plan.layer_index.get(layer_name)
        if layer is None:
            return
        t0 = time.perf_counter()
        for si, spec in enumerate(meta.stores):
            if layer in self.plan.groups[spec.group].layers and spec.block_ids:
                if kv_layer.device.type == "cpu":  # into a reused buffer: no page faults in the forward pass
                    base = self.staging.take(kv_layer[0], len(spec.block_ids))
                    self.staged_bases[(si, layer)] = base
                    self.staged[(si, layer)] = copy_pages_out(kv_layer, spec.block_ids, base)
                else:
                    self.staged[(si, layer)] = _copy_out(kv_layer, spec.block_ids)
        self.stats.add("save_time_ms", (time.perf_counter() - t0) * 1e3)

    def save(self, meta: KVStrataMetadata) -> None:
        """End of step: finish layer-wise loads, then hand the step's copied-out pages to the engine."""
        self.finish_sync_loads()
        t0 = time.perf_counter()
        for si, spec in enumerate(meta.stores):
            g = self.plan.groups[spec.group]
            layers = [layer for layer in g.layers if layer in self.kv]
            if not layers or not spec.block_ids:
                continue
            bufs = {}
            bases: list[torch.Tensor] = []
            for layer in layers:
                staged = self.staged.pop((si, layer), None)  # copied right after the layer ran
                bufs[layer] = staged if staged is not None else _copy_out(self.kv[layer], spec.block_ids)
                base = self.staged_bases.pop((si, layer), None)
                if base is not None:
                    bases.append(base)
            try:
                future = self.engine.store(self._keys(spec), bufs)
            except Exception as exc:  # a store that cannot be done is dropped and counted
                log.warning("kvstrata: store for %s failed: %s", spec.req_id, exc)
                self.stats.add("dropped_stores", 1)
                self.staging.give(bases)
                continue
            if bases:  # the engine reads the buffers until the store is done
                future.add_done_callback(functools.partial(_give_when_done, self.staging, bases))
            self.stats.add("stored_blocks", len(spec.block_ids))
            self.stats.add("saved_bytes", sum(int(b.numel() * b.element_size()) for b in bufs.values()))
        self.staged.clear()
        self.staging.give(list(self.staged_bases.values()))
        self.staged_bases.clear()
        if meta.stores:
            self.stats.add("save_time_ms", (time.perf_counter() - t0) * 1e3)

    def take_stats(self) -> KVStrataConnectorStats | None:
        """What happened since the last call (vLLM aggregates and logs it)."""
        dropped = int(self.engine.stats()["dropped_stores"])
        if dropped > self._dropped_seen:
            self.stats.add("dropped_stores", dropped - self._dropped_seen)
            self._dropped_seen = dropped
        if self.stats.is_empty():
            return None
        out = KVStrataConnectorStats(data=dict(self.stats.data))
        self.stats.reset()
        return out


def _give_when_done(staging: StagingPool, bases: list[torch.Tensor], _future: Future[StoreResult]) -> None:
    """A store's done-callback: its staging buffers go back to the pool."""
    staging.give(bases)


def _copy_out(kv_layer: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """The pages of ``block_ids`` as a new host tensor ``[n, ...]`` (one gather, then D2H if needed)."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_layer.device)
    pages = kv_layer.index_select(0, idx)
    return pages.cpu() if pages.device.type != "cpu" else pages


def _tp_rank_size(vllm_config: Any) -> tuple[int, int]:
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank()), size
    except Exception:
        return 0, size
